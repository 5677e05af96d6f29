"""autotune(): the fastest data-path, precision and batch-size settings, by measurement.

Which settings are fastest depends on the model, the data and the machine, and they
interact (workers x batch size x precision), so autotune measures: short timed trials
of the valid combinations, losers pruned early by successive halving (Jamieson &
Talwalkar 2016). Each round keeps the fastest third and times the survivors three
times longer, so every round costs about the same and the winner is timed about as
long as an exhaustive grid would time it. Two stages: first the settings that move
speed most, then the refinements (prefetch, persistence, pinning) of the winner.

The answer is cached per model, data and machine (a JSON file per key under
`cache_dir()`), so asking again costs one model build.
"""
from __future__ import annotations

import gc
import itertools
import json
import math
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch
from torch.utils.data import DataLoader

from ..auto.devices import resolve_device
from ..config import SETTINGS, TrainConfig, as_config
from ..data.batches import as_tensors
from ..entry import fit, trials, without_validation
from ..machine import available_cores, cpu_bf16_feature, gpu_has_bf16
from ..tables import html_table, text_table
from ..views.display import display_with_figure
from .models import fresh_model
from .tuning_cache import (
    CACHE_VERSION,
    cache_key,
    first_input,
    load_cached,
    save_cached,
)

# What autotune searches, and what it leaves out of its cache key, come from each
# setting's `speed` in config.py: "tuned" fields are searched; fields that do not change
# the speed of a step (and the searched ones) are not part of the key.
TUNABLE = tuple(name for name, meta in SETTINGS.items() if meta.speed == "tuned")
ETA = 3                  # keep the fastest 1/ETA each round; trials grow ETA times longer
MIN_RECORDS = 3          # measured records (after warm-up) a trial needs, however short
MIN_TRIAL_S = 0.05       # shortest measured time per trial, whatever the budget says
RECORD_S = 0.005         # aim for a record per 5 ms of steps (see Trials)
TIE = 0.03               # within 3% of the fastest, the simpler settings win


def autotune(make_model, train_data, loss_fn: Optional[Callable] = None, *, config=None,
             budget_s: float = 30.0, space: Optional[Dict[str, list]] = None,
             cache: bool = True, refresh: bool = False) -> "Tuning":
    """Measure the speed-relevant settings within `budget_s` seconds; return the fastest.

    >>> tuning = nt.autotune(make_cnn, dataset, F.cross_entropy, budget_s=30)
    >>> run = nt.fit(make_cnn(), dataset, F.cross_entropy, config=tuning.config.replace(epochs=5))

    Only settings that can matter here are tried (workers only for per-sample loading,
    pinning only with CUDA, channels_last only for image batches...). `space` narrows
    or widens the candidates, e.g. `space={"batch_size": [64, 256], "amp": ["off"]}`.
    The answer is cached (`cache=False` skips the cache, `refresh=True` re-measures).
    """
    base = as_config(config)
    if not budget_s > 0:
        raise ValueError(f"budget_s must be > 0 seconds; got {budget_s!r}. 30 is usual.")
    device, _ = resolve_device(base.device)
    kind = data_kind(train_data)
    key, about = cache_key(fresh_model(make_model), train_data, kind, base, device, space)
    if cache and not refresh:
        hit = load_cached(key)
        if hit is not None:
            return Tuning(base, hit["trials"], hit["cost_s"], budget_s, about, from_cache=True,
                          notes=hit.get("notes", []))
    candidates = candidate_settings(kind, search_space(kind, train_data, base, device, space))
    measure = Trials(make_model, train_data, loss_fn, base, device)
    busy = busy_note()
    trials, cost_s, notes = search(measure, candidates, budget_s, base)
    busy = busy or busy_note()   # busy as it started, or as it ended
    notes += [busy] if busy else []
    tuning = Tuning(base, trials, cost_s, budget_s, about, from_cache=False, notes=notes)
    if cache and not busy:   # trials timed on a busy machine are not worth serving later
        save_cached(key, {"version": CACHE_VERSION, "about": about, "trials": trials,
                          "cost_s": cost_s, "notes": notes, "created": time.time()})
    return tuning


def busy_note(sample_s: float = 0.25) -> str:
    """A note when other processes keep the CPUs busy: they slow trials unevenly.

    Sampled now, while this process is idle between runs; not the load average,
    which still counts this process's own training of the last minute.
    """
    import psutil
    busy = psutil.cpu_percent(interval=sample_s)   # % of all cores, every process
    if busy < 50:
        return ""
    return (f"other processes kept the CPUs {busy:.0f}% busy while tuning: they slow trials "
            "unevenly, so this answer is not cached. Re-run when the machine is idle.")


# -- what to try ----------------------------------------------------------------------------
def data_kind(data) -> str:
    if isinstance(data, DataLoader):
        return "loader"
    return "tensors" if as_tensors(data) is not None else "dataset"




def _is_image(data, kind: str) -> bool:
    x, batched = first_input(data, kind)
    return x is not None and x.dim() == (4 if batched else 3)   # (N,) C, H, W


def _amp_choices(device: torch.device) -> list:
    if device.type == "cuda":
        return ["off", "bf16", "fp16"] if gpu_has_bf16(device) else ["off", "fp16"]
    if device.type == "cpu":   # bf16 autocast without bf16 units is slower: not worth a trial
        return ["off", "bf16"] if cpu_bf16_feature() else ["off"]
    return ["off", "fp16"]


def _worker_counts() -> list:
    cores = available_cores()
    return sorted({0, cores, *(w for w in (1, 2, 4, 8, 16) if w <= cores)})


def search_space(kind: str, data, base: TrainConfig, device: torch.device,
                 space: Optional[dict]) -> dict:
    """Candidate values per setting for this data and device; `space` overrides them."""
    accelerator = device.type != "cpu"
    per_sample = kind == "dataset"
    space = dict(space or {})
    out = {
        "num_workers": _worker_counts(),
        "prefetch_factor": [None, 4] if per_sample else [None],
        "persistent_workers": [False, True] if per_sample else [False],
        "pin_memory": [True, False] if device.type == "cuda" else [False],
        # elsewhere "auto": the data is where the loop wants it, or cannot be moved
        "data_on_device": [True, False] if accelerator and kind == "tensors" else ["auto"],
        "batched_fetch": [True, False],   # tensors only: whole-batch indexing or per sample
        "amp": space.get("amp") or _amp_choices(device),
        "channels_last": [False, True] if _is_image(data, kind) else [False],
        "batch_size": [base.batch_size, 2 * base.batch_size],
    }
    for name, values in space.items():
        if name not in TUNABLE:
            raise ValueError(f"autotune cannot tune {name!r}: space may set "
                             f"{', '.join(TUNABLE)}.")
        if not isinstance(values, (list, tuple)) or not values:
            raise ValueError(f"space[{name!r}] must be a non-empty list of values; got {values!r}.")
        out[name] = list(values)
    return out


def candidate_settings(kind: str, space: dict) -> List[dict]:
    """Every valid combination: the data paths x precision x memory format x batch size."""
    rest = [{"amp": a, "channels_last": c} for a, c in
            itertools.product(space["amp"], space["channels_last"])]
    if kind != "loader":   # a given DataLoader fixes its own batch size
        rest = [{**r, "batch_size": b} for r in rest for b in space["batch_size"]]
    return [{**path, **r} for path in _data_paths(kind, space) for r in rest]


def _data_paths(kind: str, space: dict) -> List[dict]:
    if kind == "loader":   # your DataLoader's workers and pinning are its own
        return [{}]
    if kind == "dataset":
        return _loader_paths(space, per_sample={})
    batched = _batched_paths(space) if True in space["batched_fetch"] else []
    per_sample = _loader_paths(space, per_sample={"batched_fetch": False}) \
        if False in space["batched_fetch"] else []
    return batched + per_sample


def _batched_paths(space: dict) -> List[dict]:
    """Tensors indexed a whole batch at a time, in the main process (no workers)."""
    return [dict(batched_fetch=True, num_workers=0, prefetch_factor=None,
                 persistent_workers=False, data_on_device=on_device, pin_memory=pin)
            for on_device, pin in itertools.product(space["data_on_device"], space["pin_memory"])
            if not (on_device is True and pin)]   # data on the device is never copied


def _loader_paths(space: dict, per_sample: dict) -> List[dict]:
    """A DataLoader: no workers (datasets only: tensors have batched fetch for that), or
    workers with each prefetch depth and persistence."""
    paths = []
    for workers in space["num_workers"]:
        if workers == 0:
            if not per_sample:
                paths += [dict(num_workers=0, prefetch_factor=None, persistent_workers=False,
                               data_on_device="auto", pin_memory=pin) for pin in space["pin_memory"]]
            continue
        for prefetch, persistent, pin in itertools.product(
                space["prefetch_factor"], space["persistent_workers"], space["pin_memory"]):
            paths.append(dict(per_sample, num_workers=workers, prefetch_factor=prefetch,
                              persistent_workers=persistent, data_on_device="auto",
                              pin_memory=pin))
    return paths


# -- measuring -------------------------------------------------------------------------------
class Trials:
    """Runs one timed trial: a fresh model trained until enough steps have been timed."""

    def __init__(self, make_model, data, loss_fn, base: TrainConfig, device: torch.device):
        self.make_model, self.data, self.loss_fn, self.base = make_model, data, loss_fn, base
        # Records time the steps: one per step times finely, but each costs memory stats
        # (on a GPU a host sync), a real share of a tiny model's step. So start at
        # 1 (5 on a GPU) and, once a step has been timed, log every ~RECORD_S seconds.
        self.log_every = 1 if device.type == "cpu" else 5
        self.adapted = False
        self.tuned_keys: List[str] = []

    def __call__(self, settings: Optional[dict], seconds: float) -> dict:
        """`settings=None`: the config as given (its "auto" values resolved by fit)."""
        start = time.perf_counter()
        try:
            cfg = without_validation(self.base).replace(
                **(settings or {}), max_steps=10**9, log_every=self.log_every,
                checkpoint_dir=None, checkpoint_every=None)
            clock = TrialClock(seconds)
            with trials("autotune"):
                run = fit(fresh_model(self.make_model), self.data, self.loss_fn, config=cfg,
                          progress=False, on_start=clock.attach)
            if run.state == "interrupted":   # Ctrl-C / the stop button: stop tuning, not a trial
                raise KeyboardInterrupt
            result = dict(clock.result(run), settings=self._effective(run, cfg), error=None)
        except Exception as exc:   # a setting this machine cannot run: it just loses
            result = dict(samples_per_s=0.0, measured_s=0.0, steps=0, settings=dict(settings or {}),
                          error=f"{type(exc).__name__}: {exc}")
        finally:
            # Run <-> TrialClock is a cycle (not the only one of a run): dropping the names frees
            # the trial's model and optimizer state only at a collection. Collect before
            # empty_cache, else it hands back nothing of this trial; only with CUDA, as a
            # collection costs ~0.1 s, a large share of a short CPU trial.
            run = clock = None
            if torch.cuda.is_available():
                gc.collect()
                torch.cuda.empty_cache()
        result["as_given"] = settings is None
        result["wall_s"] = time.perf_counter() - start
        self._adapt(result)
        return result

    def _adapt(self, result: dict) -> None:
        step_s = result.get("step_s", math.nan)
        if not self.adapted and math.isfinite(step_s) and step_s > 0:
            self.log_every = max(1, min(10, round(RECORD_S / step_s)))
            self.adapted = True

    def _effective(self, run, cfg: TrainConfig) -> dict:
        """The values the run really used (an "auto" shows as what it resolved to)."""
        return {k: run.resolved[k][0] if k in run.resolved else getattr(cfg, k)
                for k in self.tuned_keys}


class TrialClock:
    """Stops a trial once `seconds` of steady-state steps have been timed.

    Warm-up, not timed: the first step (first-call overheads, workers starting), then
    with workers `num_workers * prefetch_factor` more steps: the batches the workers
    could have queued while the first step ran, which arrive at once and would
    overstate the steady rate of a short trial. The timed part is at least as many
    steps again: if the main process is held up later (another process's load), the
    workers refill the queue, and a burst of queued batches must not be the whole
    measurement. Totals are kept as records arrive: no pass over the history per record.
    """

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.run = None
        self.warm_steps = 1
        self.min_steps = MIN_RECORDS
        self.timed = dict(seconds=0.0, samples=0, steps=0, records=0)
        self.all = dict(seconds=0.0, samples=0, steps=0, records=0)

    def attach(self, run) -> None:
        self.run = run
        workers = run.resolved.get("num_workers", (0,))[0]
        queued = workers * (run.config.prefetch_factor or 2) if isinstance(workers, int) else 0
        self.warm_steps = 1 + queued
        self.min_steps = max(MIN_RECORDS, queued)   # a late burst from the queue: at most half
        run.subscribe(self.on_record)

    def on_record(self, record: dict) -> None:
        if record["kind"] != "train":
            return
        totals = [self.all] + ([self.timed] if record["step"] - record["steps"] >= self.warm_steps
                               else [])
        for t in totals:
            t["seconds"] += record["interval_s"]
            t["samples"] += record["samples"]
            t["steps"] += record["steps"]
            t["records"] += 1
        enough = (self.timed["seconds"] >= self.seconds and self.timed["records"] >= MIN_RECORDS
                  and self.timed["steps"] >= self.min_steps)
        too_slow = record["time_s"] > 4 * self.seconds + 2   # a very slow step: stop anyway
        if enough or too_slow:
            self.run.stop()

    def result(self, run) -> dict:
        t = self.timed if self.timed["records"] else self.all   # too slow to warm up: use all
        return dict(samples_per_s=t["samples"] / t["seconds"] if t["seconds"] else 0.0,
                    measured_s=t["seconds"], steps=run.step,
                    step_s=t["seconds"] / t["steps"] if t["steps"] else math.nan)


def search(measure: Trials, candidates: List[dict], budget_s: float, base: TrainConfig):
    """(all trials: dicts with `stage` and `round`, the seconds spent, notes).

    Stage 1 halves over the settings that change speed most (workers, batched fetch,
    data on device, precision, memory format, batch size), each with the refinements
    (prefetch, persistent workers, pinning) at their first values; stage 2 halves over
    the refinements of stage 1's winner. Trying every refinement of every data path in
    stage 1 would multiply its trials by 4 for differences that are mostly noise.
    """
    measure.tuned_keys = sorted({k for c in candidates for k in c}, key=TUNABLE.index)
    groups: Dict[tuple, List[dict]] = {}
    for c in candidates:
        groups.setdefault(_major(c), []).append(c)
    first = [group[0] for group in groups.values()]   # refinements at their first values
    plan = Plan(budget_s, [_counts(len(first) + 1), _counts(max(map(len, groups.values())))])
    trials: List[dict] = []
    winner = _halve(measure, [None] + first, plan, 0, trials, base)   # None: as given
    group = groups[_major(winner["candidate"])] if winner["candidate"] is not None else []
    plan.stages[1] = _counts(len(group)) if len(group) > 1 else []
    if plan.stages[1] and plan.affordable(len(group), len(plan.stages[1]) == 1):
        _halve(measure, group, plan, 1, trials, base)
    elif plan.stages[1]:
        plan.out_of_time = True
    for t in trials:
        del t["candidate"]
    notes = ["the budget ran out before the last rounds: a larger budget_s measures the "
             "best candidates longer"] if plan.out_of_time else []
    return trials, time.perf_counter() - plan.start, notes


MINOR = ("prefetch_factor", "persistent_workers", "pin_memory")


def _major(settings: dict) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in settings.items() if k not in MINOR))


def _counts(n: int) -> List[int]:
    """Trials per round when each round keeps the fastest 1/ETA: 13 -> [13, 5, 2]."""
    counts = [n]
    while counts[-1] > ETA:
        counts.append(math.ceil(counts[-1] / ETA))
    return counts


def _halve(measure: Trials, alive: list, plan: "Plan", stage: int, trials: List[dict],
           base: TrainConfig) -> dict:
    """Successive halving over `alive`; returns the winning trial of the last round."""
    counts, first_round = plan.stages[stage], len(plan.stages[0]) if stage else 0
    results: List[dict] = []
    for j in range(len(counts)):
        final = j + 1 == len(counts)
        if results and not plan.affordable(len(alive), final):
            plan.out_of_time = True   # the budget is spent: the last round's best wins
            return pick(results, base)
        results = [dict(r, stage=stage + 1, round=first_round + j, candidate=c) for c, r in
                   zip(alive, _measure_round(measure, alive, plan, stage, j, final))]
        trials += results
        if final:
            return pick(results, base)
        keep = sorted(results, key=lambda r: -r["samples_per_s"])[:counts[j + 1]]
        simplest = pick(results, base)   # a tie on speed must not prune the simpler setting
        if simplest not in keep:
            keep[-1] = simplest
        alive = [r["candidate"] for r in keep]


def _measure_round(measure: Trials, alive: list, plan: "Plan", stage: int, rnd: int,
                   final: bool) -> List[dict]:
    """One trial per candidate; in a final round, two half-length passes, interleaved.

    Of the two, the faster counts: another process's burst of load can slow a trial
    but never speed it up, so the faster of two is the better estimate (as `timeit`
    reports the fastest repeat), and interleaving spreads a burst over the candidates.
    """
    passes: List[List[dict]] = []
    done = 0
    for _ in range(2 if final and len(alive) > 1 else 1):
        passes.append([])
        for c in alive:
            result = measure(c, plan.seconds(stage, rnd, done))
            plan.observe(result)
            passes[-1].append(result)
            done += 1
    if len(passes) == 1:
        return passes[0]
    return [dict(max(a, b, key=lambda r: r["samples_per_s"]),
                 repeats=[a["samples_per_s"], b["samples_per_s"]],
                 measured_s=a["measured_s"] + b["measured_s"], wall_s=a["wall_s"] + b["wall_s"])
            for a, b in zip(*passes)]


class Plan:
    """Timed seconds per trial, so that the trials left fit in what is left of the budget.

    Every stage's last round times its trials for the same T, each earlier round
    ETA times shorter (and has ~ETA times more trials: each round costs about the
    same); a last round of two or more runs in two passes of T/2. Each trial also
    costs an overhead (setup, workers starting, warm-up): its running median is
    re-measured after every trial, and the plan re-solved before every trial, so an
    early misjudgement is paid back by the trials after it, not by the budget.
    """

    def __init__(self, budget_s: float, stages: List[List[int]]):
        self.start, self.budget_s, self.stages = time.perf_counter(), budget_s, stages
        self.overhead_s = 0.2   # a guess, until the first trial has been measured
        self.overheads: List[float] = []
        self.out_of_time = False

    def _rounds(self, stage: int, rnd: int):
        """(stage, round, trials, each one's timed seconds as a fraction of T) from here on."""
        for s in range(stage, len(self.stages)):
            counts = self.stages[s]
            for j in range(rnd if s == stage else 0, len(counts)):
                back = len(counts) - 1 - j   # rounds before this stage's last
                two_passes = back == 0 and counts[j] > 1
                yield s, j, 2 * counts[j] if two_passes else counts[j], \
                    0.5 if two_passes else ETA ** -back

    def seconds(self, stage: int, rnd: int, done: int = 0) -> float:
        """Timed seconds for the next trial of round `rnd`, `done` of whose trials ran."""
        trials, per_t, now = 0, 0.0, 1.0
        for s, j, n, fraction in self._rounds(stage, rnd):
            if (s, j) == (stage, rnd):
                n, now = n - done, fraction
            trials += n
            per_t += n * fraction
        t_last = (self.left_s() - self.overhead_s * trials) / per_t
        return max(MIN_TRIAL_S, t_last * now)

    def left_s(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def affordable(self, count: int, final: bool) -> bool:
        """Whether a round of `count` trials fits, each at the shortest trial length."""
        trials = 2 * count if final and count > 1 else count
        return self.left_s() >= trials * (self.overhead_s + MIN_TRIAL_S)

    def observe(self, result: dict) -> None:
        self.overheads.append(result["wall_s"] - result["measured_s"])
        # the median: the first trial in a process also pays one-time costs (imports,
        # thread pools) that no later trial pays
        self.overhead_s = statistics.median(self.overheads)


# -- the answer ------------------------------------------------------------------------------
def _simplicity(settings: dict, base: TrainConfig) -> tuple:
    """Lower is simpler: fewer processes, batched fetch, fp32, the batch size asked for."""
    return (settings.get("num_workers", 0) or 0,
            settings.get("batched_fetch") is False,
            settings.get("amp", "off") != "off",
            bool(settings.get("channels_last")),
            abs(math.log2(settings.get("batch_size", base.batch_size) / base.batch_size)),
            bool(settings.get("persistent_workers")),
            settings.get("prefetch_factor") is not None,
            bool(settings.get("pin_memory")))


def pick(trials: List[dict], base: TrainConfig) -> dict:
    """The fastest trial of the last round of `trials`; within TIE of it, the simplest.

    Trials are noisy (a few percent on an idle machine, more on a busy one): a worker
    process or lower precision must earn its place by more than noise.
    """
    last = max(t["round"] for t in trials)
    final = [t for t in trials if t["round"] == last and not t["error"]]
    if not final:
        raise RuntimeError("autotune: every trial failed; the first error was: "
                           f"{trials[0]['error']}. Check that nt.fit runs with this config.")
    best = max(t["samples_per_s"] for t in final)
    near = [t for t in final if t["samples_per_s"] >= (1 - TIE) * best]
    return min(near, key=lambda t: (_simplicity(t["settings"], base), -t["samples_per_s"]))


class Tuning:
    """autotune's answer: `.config` (the fastest settings on top of yours), `.trials`."""

    def __init__(self, base: TrainConfig, trials: List[dict], cost_s: float, budget_s: float,
                 about: dict, from_cache: bool, notes=()):
        self.trials, self.cost_s, self.budget_s = trials, cost_s, budget_s
        self.notes = list(notes)
        self.about, self.from_cache = about, from_cache
        self.best = pick(trials, base)
        self.settings = dict(self.best["settings"])
        self.config = base.replace(**self.settings)
        self.rows = self._rows()

    @property
    def samples_per_s(self) -> float:
        return self.best["samples_per_s"]

    @property
    def speedup(self) -> float:
        """Fastest settings over your config as given (measured in the same session)."""
        given = [t for t in self.trials if t["as_given"] and not t["error"]]
        last = max(given, key=lambda t: t["round"], default=None)
        return self.samples_per_s / last["samples_per_s"] if last and last["samples_per_s"] \
            else math.nan

    def _rows(self) -> List[dict]:
        """One row per candidate, its longest measurement, fastest first."""
        latest: Dict[str, dict] = {}
        for t in self.trials:
            key = "given" if t["as_given"] else json.dumps(t["settings"], sort_keys=True)
            if key not in latest or t["round"] >= latest[key]["round"]:
                latest[key] = t
        rows = [dict(t["settings"], samples_per_s=t["samples_per_s"], round=t["round"] + 1,
                     chosen="*" if t is self.best else "",
                     trial="your config" if t["as_given"] else "")
                for t in latest.values()]
        return sorted(rows, key=lambda r: (-r["round"], -r["samples_per_s"]))

    def _columns(self):
        varying = [k for k in TUNABLE if len({str(r.get(k)) for r in self.rows}) > 1]
        return ([("", "chosen"), ("samples/s", "samples_per_s"), ("round", "round")]
                + [(k, k) for k in varying] + [("", "trial")])

    def _header(self) -> str:
        where = "from the cache" if self.from_cache else f"in {self.cost_s:.1f} s"
        speedup = f", {self.speedup:.2f}x your config" if math.isfinite(self.speedup) else ""
        chosen = ", ".join(f"{k}={v!r}" for k, v in self.settings.items())
        notes = "".join(f"\nnote: {n}" for n in self.notes)
        return (f"autotune: {len(self.trials)} trials {where} (budget {self.budget_s:g} s)\n"
                f"fastest: {chosen}\n         {self.samples_per_s:,.0f} samples/s{speedup}{notes}")

    def __repr__(self) -> str:
        shown = self.rows[:12]
        more = f"\n... {len(self.rows) - len(shown)} slower candidates" if len(self.rows) > 12 else ""
        return self._header() + "\n\n" + text_table(self._columns(), shown) + more

    def _repr_html_(self) -> str:
        import html
        return f"<pre>{html.escape(self._header())}</pre>" + html_table(self._columns(), self.rows)

    def _ipython_display_(self) -> None:
        display_with_figure(self)   # a table says it best: no chart










