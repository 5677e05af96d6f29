"""compare(): same weights, same data order, one row per config, charts and a table."""
import math
import sys

import pytest
import torch
from torch.nn import functional as F

import nbtrain as nt
from nbtrain.tools.compare import COLUMNS, Comparison
from nbtrain.tools.compare import compare as compare_runs

from conftest import mlp, quick


def compare(*args, **kwargs):
    """compare() without progress bars."""
    return compare_runs(*args, progress=False, **kwargs)


def test_identical_configs_give_identical_curves(blobs):
    """Same initial weights, data order and dropout masks: nothing differs but settings."""
    built = []

    def make_model():
        built.append(1)
        return mlp(dropout=0.2)

    cmp = compare(make_model, blobs, F.cross_entropy, configs={"a": {}, "b": {}},
                  base=quick(epochs=2))
    a, b = cmp.runs["a"][0], cmp.runs["b"][0]
    assert [r["loss"] for r in a.records()] == [r["loss"] for r in b.records()]
    assert torch.equal(a.model[0].weight, b.model[0].weight)
    assert len(built) == 4   # warm-up, the build whose weights all copy, one per config


def test_rows_have_the_fixed_columns_and_real_results(blobs):
    cmp = compare(mlp, blobs, F.cross_entropy, val_data=blobs, base=quick(epochs=2),
                  configs={"sgd": {"optimizer": "sgd", "lr": 0.1},
                           "adamw": quick(epochs=2, optimizer="adamw")})
    assert [row["name"] for row in cmp.rows] == ["sgd", "adamw"]
    for row in cmp.rows:
        for _, key in COLUMNS:
            assert key in row
        assert row["samples_per_s"] > 0 and row["wall_s"] > 0 and row["peak_mb"] > 0
        assert row["val_acc"] > 0.8 and row["final_loss"] < 1.0
        assert math.isfinite(row["time_to_target_s"])   # the default target: every run reaches it
    assert cmp.runs["sgd"][0].optimizer.__class__.__name__ == "SGD"
    assert cmp.runs["sgd"][0].config.lr == 0.1


def test_text_table_is_deterministic_in_structure(blobs):
    cmp = compare(mlp, blobs, F.cross_entropy, configs={"x": {}}, base=quick(max_steps=10))
    lines = repr(cmp).splitlines()
    assert lines[0].split() == ["config", "samples/s", "wall", "s", "to", "target", "s",
                                "final", "loss", "val", "loss", "val", "acc", "peak", "MB"]
    assert lines[1].startswith("x ") and lines[1].split()[5:7] == ["-", "-"]   # no val data
    assert "target loss" in lines[-1]


def test_seeds_change_weights_and_order_and_rows_average(blobs):
    cmp = compare(mlp, blobs, F.cross_entropy, configs={"a": {}}, seeds=(0, 1),
                  base=quick(max_steps=10, log_every=5))
    first, second = cmp.runs["a"]
    assert first.config.seed == 0 and second.config.seed == 1
    assert first.records()[0]["loss"] != second.records()[0]["loss"]
    row = cmp.rows[0]
    assert row["seeds"] == 2 and "final_loss_std" in row
    assert row["final_loss"] == pytest.approx(
        (first.summary()["final_loss"] + second.summary()["final_loss"]) / 2)


def test_unreachable_target_shows_as_missing(blobs):
    cmp = compare(mlp, blobs, F.cross_entropy, configs={"a": {}}, target_loss=-1.0,
                  base=quick(max_steps=5))
    assert math.isnan(cmp.rows[0]["time_to_target_s"])
    assert cmp.target_loss == -1.0


def test_a_given_model_is_copied_not_trained(blobs):
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cmp = compare(model, blobs, F.cross_entropy, configs={"a": {}}, base=quick(max_steps=5))
    assert cmp.runs["a"][0].model is not model
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_figure_overlays_every_config(blobs):
    pytest.importorskip("plotly")
    cmp = compare(mlp, blobs, F.cross_entropy, val_data=blobs, base=quick(epochs=1),
                  configs={"sgd": {"optimizer": "sgd", "lr": 0.1}, "adamw": {}})
    fig = cmp.figure()
    names = {trace.name for trace in fig.data}
    assert {"sgd", "adamw", "sgd (val)", "adamw (val)"} <= names
    assert len(fig.data) == 2 * 4   # per config: loss/step, loss/time, lr, val loss
    assert [t.name for t in fig.data if t.showlegend] == ["sgd", "adamw"]


def test_notebook_display_shows_figure_then_table(blobs, monkeypatch):
    pio = pytest.importorskip("plotly.io")
    import IPython.display
    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, **kw: shown.append((obj, kw)))
    monkeypatch.setattr(pio.renderers, "default", "plotly_mimetype")   # as in JupyterLab
    cmp = compare(mlp, blobs, F.cross_entropy, configs={"a": {}}, base=quick(max_steps=5))
    cmp._ipython_display_()
    assert type(shown[0][0]).__name__ == "Figure"
    bundle, kw = shown[1]
    assert kw == {"raw": True} and "<table>" in bundle["text/html"]
    assert bundle["text/plain"] == repr(cmp)
    shown.clear()
    monkeypatch.setattr(pio.renderers, "default", "")   # a terminal: no figure JSON dump
    cmp._ipython_display_()
    assert len(shown) == 1 and shown[0][1] == {"raw": True}


@pytest.mark.parametrize("configs, error, words", [
    ({"a": {"seed": 3}}, nt.ConfigError, "seeds=(...)"),
    ({"a": {"optimiser": "sgd"}}, nt.ConfigError, "configs['a']: TrainConfig has no "
                                                   "setting 'optimiser'. Did you mean 'optimizer'?"),
    ({"a": {"lr": -1}}, nt.ConfigError, "configs['a']: TrainConfig.lr=-1"),
    ({"a": 3}, TypeError, "TrainConfig or a dict"),
    ({}, TypeError, "non-empty dict"),
])
def test_bad_configs_say_what_to_do(blobs, configs, error, words):
    with pytest.raises(error, match=None) as info:
        compare(mlp, blobs, F.cross_entropy, configs=configs, base=quick(max_steps=2))
    assert words in str(info.value)


def test_a_failing_config_names_itself(blobs):
    with pytest.raises(nt.TrainingError) as info:
        compare(mlp, blobs, lambda out, y: out.sum(dim=1), configs={"broken": {}},
                base=quick(max_steps=2))
    assert "config 'broken' (seed 0)" in str(info.value)


def test_a_config_that_does_not_fit_the_data_names_itself(blobs):
    with pytest.raises(nt.ConfigError) as info:
        compare(mlp, blobs, F.cross_entropy, base=quick(max_steps=2),
                configs={"ok": {}, "bad": {"batched_fetch": True, "num_workers": 2}})
    assert str(info.value).startswith("configs['bad']: TrainConfig.batched_fetch=True")


def test_comparison_of_existing_runs(blobs):
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=quick(max_steps=10), progress=False)
    cmp = Comparison({"mine": [run]})
    assert cmp.rows[0]["name"] == "mine" and cmp.rows[0]["final_loss"] == run.summary()["final_loss"]


def test_without_plotly_the_table_still_shows_and_says_how_to_get_charts(blobs, monkeypatch):
    import IPython.display
    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, **kw: shown.append(obj))
    monkeypatch.setattr(sys.modules["nbtrain.views.display"], "_warned_plotly", False)
    monkeypatch.setitem(sys.modules, "plotly.io", None)   # import plotly.io -> ImportError
    cmp = compare(mlp, blobs, F.cross_entropy, configs={"a": {}}, base=quick(max_steps=5))
    with pytest.warns(UserWarning, match="pip install plotly"):
        cmp._ipython_display_()
    assert len(shown) == 1 and "<table>" in shown[0]["text/html"]


def test_plateau_trains_with_val_data_after_a_warm_up_that_validates_nothing(blobs):
    cmp = compare(mlp, blobs, F.cross_entropy, configs={"plateau": {"scheduler": "plateau"}},
                  base=quick(max_steps=3), val_data=blobs)
    assert cmp.runs["plateau"][0].state == "finished"


def test_the_table_says_how_many_seeds_its_figures_are_over():
    from nbtrain.tools.compare import Comparison

    class Done:   # what row_of reads of a finished run is not needed for the footer
        pass
    one = Comparison.__new__(Comparison)
    one.runs, one.target_loss = {"a": [Done()], "b": [Done()]}, 0.5
    assert one._footer().endswith("one seed each")
    one.runs = {"a": [Done(), Done()], "b": [Done(), Done()]}
    assert one._footer().endswith("means over 2 seeds")
