"""compare(): several configs trained from the same weights on the same data order.

A comparison is only fair when the configs differ in nothing but their settings: each
seed builds the model once and every config starts from a copy of those weights, and
every config's run uses that seed, so all see the same permutation of the data (the
order is a function of TrainConfig.seed, see data/batches.py) and the same dropout.
"""
from __future__ import annotations

import gc
import math
import statistics
import weakref
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch

from ..auto.devices import resolve_device
from ..config import ConfigError, TrainConfig, as_config
from ..entry import fit, trials, without_validation
from ..run import Run, TrainingError
from ..tables import cell, html_table, text_table
from ..views.display import display_with_figure
from .models import fresh_model, initial_weights

# (column title, row key): the text table always has these columns, in this order.
COLUMNS = (("config", "name"), ("samples/s", "samples_per_s"), ("wall s", "wall_s"),
           ("to target s", "time_to_target_s"), ("final loss", "final_loss"),
           ("val loss", "val_loss"), ("val acc", "val_acc"), ("peak MB", "peak_mb"))


def compare(make_model, train_data, loss_fn: Optional[Callable] = None, configs=None, *,
            seeds: Sequence[int] = (0,), val_data=None,
            base: Union[TrainConfig, dict, None] = None, target_loss: Optional[float] = None,
            progress="auto") -> "Comparison":
    """Train one model per config (and seed) and put the runs side by side.

    >>> cmp = nt.compare(make_mlp, (x, y), F.cross_entropy,
    ...                  configs={"sgd": {"optimizer": "sgd", "lr": 0.1}, "adamw": {}},
    ...                  base=nt.TrainConfig(epochs=3), val_data=(xv, yv))
    >>> cmp.rows[0]["samples_per_s"]; cmp.figure()

    `make_model`: a function returning a fresh model, or a model (it is copied, never
    trained). `configs`: name -> TrainConfig, or a dict of overrides of `base`.
    `seeds`: one run per config and seed; the rows show the mean over seeds.
    `target_loss`: the train loss whose first time is "to target s"; by default the
    highest of the configs' best losses, the lowest loss every config reached.
    `progress`: as in `fit`, for each run.
    """
    resolved = _resolve_configs(configs, base)
    if not seeds:
        raise ValueError("seeds must name at least one seed, e.g. seeds=(0,).")
    runs: Dict[str, List[Run]] = {name: [] for name in resolved}
    _warm_up(make_model, train_data, loss_fn, *next(iter(resolved.items())))
    for seed in seeds:
        weights = initial_weights(make_model, seed)
        for name, cfg in resolved.items():
            run = _train_one(name, make_model, weights, train_data, loss_fn,
                             cfg.replace(seed=seed), val_data, progress)
            runs[name].append(run)
            if run.state == "interrupted":   # Ctrl-C ends the comparison, keeping what ran
                return Comparison(_drop_empty(runs), target_loss)
    return Comparison(runs, target_loss)


def _resolve_configs(configs, base) -> Dict[str, TrainConfig]:
    if not configs or not isinstance(configs, Mapping):
        raise TypeError("configs must be a non-empty dict of name -> TrainConfig or dict of "
                        "overrides, e.g. configs={'sgd': {'optimizer': 'sgd'}, 'adamw': {}}.")
    base_cfg = as_config(base)
    out = {}
    for name, cfg in configs.items():
        if isinstance(cfg, dict):
            if "seed" in cfg:
                raise ConfigError(f"configs[{name!r}] sets seed={cfg['seed']!r}: compare() "
                                  "gives every config the same seed so all see the same "
                                  "weights and data. Remove it and pass seeds=(...) instead.",
                                  field="seed")
            try:
                out[str(name)] = base_cfg.replace(**cfg)
            except ConfigError as exc:   # say which config: the others may be fine
                raise ConfigError(f"configs[{name!r}]: {exc}", field=exc.field) from None
        elif isinstance(cfg, TrainConfig):
            out[str(name)] = cfg
        else:
            raise TypeError(f"configs[{name!r}] must be a TrainConfig or a dict of overrides; "
                            f"got {type(cfg).__name__}.")
    return out


def _warm_up(make_model, train_data, loss_fn, name: str, cfg: TrainConfig) -> None:
    """Two untimed steps first: the process's one-time costs (thread pools, kernel and
    allocator set-up: ~1 s on a busy 2-core machine) would otherwise all land in the
    first config's time and make it look slow."""
    short = without_validation(cfg).replace(   # two steps only warm the kernels up
        max_steps=2, log_every=1, checkpoint_dir=None, checkpoint_every=None, warmup_steps=0)
    _fit_named(name, fresh_model(make_model), train_data, loss_fn, short, None, False)


def _train_one(name, make_model, weights, train_data, loss_fn, cfg, val_data, progress) -> Run:
    baseline_mb = _cuda_allocated_mb(cfg)
    model = fresh_model(make_model)
    model.load_state_dict(weights)
    run = _fit_named(name, model, train_data, loss_fn, cfg, val_data, progress)
    _BASELINE_MB[run] = baseline_mb
    return run


# The earlier runs' models and optimizer state stay allocated, and the loop's peak is
# reset to what is allocated at its start: a config's own peak is that peak less what
# was allocated before it (else it grows with the configs run before it).
_BASELINE_MB: "weakref.WeakKeyDictionary[Run, float]" = weakref.WeakKeyDictionary()


def _cuda_allocated_mb(cfg: TrainConfig) -> float:
    """MB allocated now on the CUDA device `cfg` trains on, after freeing what is garbage
    and emptying the cache (fair peaks); 0 off CUDA."""
    if not torch.cuda.is_available():
        return 0.0
    try:
        device, _ = resolve_device(cfg.device)
    except ConfigError:   # fit raises it, naming the config
        return 0.0
    gc.collect()   # a dropped run (e.g. the warm-up's) may be cyclic garbage: free it now
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0


def _fit_named(name, model, train_data, loss_fn, cfg, val_data, progress) -> Run:
    try:
        with trials(name):   # stored as a trial, named after its config unless named
            return fit(model, train_data, loss_fn, config=cfg, val_data=val_data,
                       progress=progress)
    except TrainingError as exc:
        raise TrainingError(f"compare: config {name!r} (seed {cfg.seed}) failed: {exc}",
                            exc.run) from exc
    except ConfigError as exc:   # settings that only fail with this data or device
        raise ConfigError(f"configs[{name!r}]: {exc}", field=exc.field) from None


def _drop_empty(runs: Dict[str, List[Run]]) -> Dict[str, List[Run]]:
    return {name: rs for name, rs in runs.items() if rs}


class Comparison:
    """The runs of `compare()` and one row of results per config.

    `.rows`: dicts with the COLUMNS keys (means over seeds); `.runs`: name -> [Run per
    seed]; `.figure()`: overlaid loss and LR curves (Plotly). Shown as charts and a
    table in a notebook; `print(cmp)` gives the table as text.
    """

    def __init__(self, runs: Dict[str, List[Run]], target_loss: Optional[float] = None):
        self.runs = runs
        self.target_loss = target_loss if target_loss is not None else default_target(runs)
        self.rows = [row_of(name, rs, self.target_loss) for name, rs in runs.items()]

    def figure(self):
        """Loss against step and against wall time, and the LR, one colour per config."""
        return comparison_figure(self.runs)

    def report(self, path) -> str:
        """One self-contained HTML file: the charts, the table, each config's settings."""
        from ..views.html_report import comparison_report
        return comparison_report(self, path)

    def __repr__(self) -> str:
        return text_table(COLUMNS, self.rows) + f"\n({self._footer()})"

    def _repr_html_(self) -> str:
        return html_table(COLUMNS, self.rows) + f"<p>{self._footer()}</p>"

    def _footer(self) -> str:
        counts = sorted({len(rs) for rs in self.runs.values()})
        if counts in ([], [1]):
            over = "one seed each"
        elif len(counts) == 1:
            over = f"means over {counts[0]} seeds"
        else:
            over = "means over each config's seeds"
        return f"target loss {cell(self.target_loss)}; {over}"

    def _ipython_display_(self) -> None:
        display_with_figure(self, self.figure)


# -- rows ---------------------------------------------------------------------------------
def default_target(runs: Dict[str, List[Run]]) -> float:
    """The lowest train loss every (non-diverged) run reached: each gets a time to it."""
    bests = []
    for rs in runs.values():
        for run in rs:
            losses = [r["loss"] for r in run.records("train")]
            if losses and math.isfinite(losses[-1]):   # a diverged run sets no target
                bests.append(min(v for v in losses if math.isfinite(v)))
    return max(bests) if bests else math.nan


def time_to(run: Run, target: float) -> float:
    """Seconds from the start of training to the first record with loss <= target."""
    for r in run.records("train"):
        if r["loss"] <= target:
            return r["time_s"]
    return math.nan


def peak_mb(summary: dict, baseline_mb: float = 0.0) -> float:
    """GPU: the allocator's peak of the run, less what was allocated before it; CPU: the
    highest RSS seen during the run."""
    if "peak_cuda_mb" in summary:
        return summary["peak_cuda_mb"] - baseline_mb
    return summary["peak_rss_mb"]


def row_of(name: str, runs: List[Run], target: float) -> dict:
    summaries = [run.summary() for run in runs]
    per_seed = {
        "samples_per_s": [s["samples_per_s"] for s in summaries],
        "wall_s": [s["wall_s"] for s in summaries],
        "time_to_target_s": [time_to(run, target) for run in runs],
        "final_loss": [s["final_loss"] for s in summaries],
        "val_loss": [s.get("val_loss", math.nan) for s in summaries],
        "val_acc": [s.get("val_acc", math.nan) for s in summaries],
        "peak_mb": [peak_mb(s, _BASELINE_MB.get(run, 0.0)) for s, run in zip(summaries, runs)],
    }
    row = {"name": name, "seeds": len(runs), "state": runs[-1].state}
    for key, values in per_seed.items():
        row[key] = _mean(values)
        if len(values) > 1:
            row[key + "_std"] = _std(values)
    return row


def _mean(values) -> float:
    # A NaN (never reached the target, no validation) makes the mean NaN: shown as "-".
    return statistics.fmean(values) if values else math.nan


def _std(values) -> float:
    return statistics.stdev(values) if all(math.isfinite(v) for v in values) else math.nan


# -- the figure -----------------------------------------------------------------------------
def comparison_figure(runs: Dict[str, List[Run]]):
    import plotly.graph_objects as go
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=3, subplot_titles=(
        "loss vs step", "loss vs wall time", "learning rate"))
    for i, (name, rs) in enumerate(runs.items()):
        color = qualitative.Plotly[i % len(qualitative.Plotly)]
        for j, run in enumerate(rs):
            train = run.records("train")
            steps = [r["step"] for r in train]
            losses = [r["loss"] for r in train]
            style = dict(line=dict(color=color), legendgroup=name, name=name,
                         mode="lines", showlegend=False)
            fig.add_trace(go.Scatter(x=steps, y=losses, **{**style, "showlegend": j == 0}),
                          row=1, col=1)
            fig.add_trace(go.Scatter(x=[r["time_s"] for r in train], y=losses, **style),
                          row=1, col=2)
            fig.add_trace(go.Scatter(x=steps, y=[r["lr"] for r in train], **style),
                          row=1, col=3)
            val = run.records("val")
            if val:
                fig.add_trace(go.Scatter(
                    x=[r["step"] for r in val], y=[r["val_loss"] for r in val],
                    **{**style, "mode": "markers", "name": f"{name} (val)"}), row=1, col=1)
    fig.update_xaxes(title_text="step", row=1, col=1)
    fig.update_xaxes(title_text="seconds", row=1, col=2)
    fig.update_xaxes(title_text="step", row=1, col=3)
    fig.update_yaxes(type="log", row=1, col=3)   # optimizers' LRs differ by decades
    positive = all(not r["loss"] <= 0 for rs in runs.values() for run in rs
                   for r in run.records("train"))
    scale = "log" if positive else "linear"   # a log axis would hide losses <= 0
    fig.update_yaxes(title_text="loss", type=scale, row=1, col=1)
    fig.update_yaxes(type=scale, row=1, col=2)
    fig.update_layout(height=360, margin=dict(t=40, b=40, l=50, r=20))
    return fig
