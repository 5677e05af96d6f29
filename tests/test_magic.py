"""%%fasttrain, run the way a notebook runs it: `run_cell` in a real InteractiveShell.

Tests of how options map onto TrainConfig replace `nbtrain.fit` with a recorder (some
options, such as --compile or --device cuda, cannot train on a CI CPU); the rest train
tiny models with the real engine in well under a second each.
"""
import os
import re
import signal
import sys
import types

import pytest
import torch
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from torch import nn

import nbtrain
from nbtrain.ui import magic
from nbtrain.config import FIELD_NAMES, SETTINGS, ConfigError, TrainConfig

CELL = """
model = nn.Linear(8, 3)
train_data = (torch.randn(256, 8), torch.randint(0, 3, (256,)))
loss_fn = nn.CrossEntropyLoss()
"""


@pytest.fixture
def shell():
    ip = InteractiveShell.instance()
    ip.push({"torch": torch, "nn": nn, "TrainConfig": TrainConfig})
    yield ip
    if "nbtrain" in ip.extension_manager.loaded:
        ip.run_line_magic("unload_ext", "nbtrain")
    magic.unload_ipython_extension(ip)
    for name in set(ip.user_ns) - set(ip.user_ns_hidden):   # what the test defined
        if not name.startswith("__"):   # __name__ & co. are the shell's (classes need it)
            del ip.user_ns[name]


@pytest.fixture
def ip(shell):
    magic.load_ipython_extension(shell)
    return shell


class FakeRun:
    def __init__(self, config, state="finished"):
        self.config, self.state, self.step = config, state, config.max_steps or 0

    def summary_text(self):
        return "SUMMARY TABLE"


@pytest.fixture
def calls(monkeypatch):
    """Replace nbtrain.fit with a recorder; each call's arguments land in the list."""
    recorded = []

    def fake_fit(model, train_data, loss_fn=None, **kwargs):
        recorded.append(dict(model=model, train_data=train_data, loss_fn=loss_fn, **kwargs))
        return FakeRun(kwargs["config"])

    monkeypatch.setattr(nbtrain, "fit", fake_fit)
    return recorded


def usage_error(ip, cell):
    """Run a cell the way a notebook does; return the UsageError it showed."""
    result = ip.run_cell(cell)
    assert type(result.error_in_exec) is UsageError, result.error_in_exec
    return str(result.error_in_exec)


def config_error_text(**settings) -> str:
    with pytest.raises(ConfigError) as info:
        TrainConfig(**settings)
    return str(info.value)


# -- loading ------------------------------------------------------------------------------

def test_load_ext_registers_and_unload_removes_cleanly(shell):
    assert shell.find_cell_magic("fasttrain") is None
    shell.run_line_magic("load_ext", "nbtrain")
    assert shell.find_cell_magic("fasttrain") is not None
    assert shell.find_line_magic("fasttrain") is not None

    shell.run_line_magic("unload_ext", "nbtrain")
    assert shell.find_cell_magic("fasttrain") is None
    assert shell.find_line_magic("fasttrain") is None
    assert "FastTrainMagics" not in shell.magics_manager.registry
    assert shell.find_cell_magic("capture") is not None   # other magics untouched
    assert "not found" in usage_error(shell, "%%fasttrain\nx = 1")

    shell.run_line_magic("load_ext", "nbtrain")   # loads again after an unload
    assert shell.find_cell_magic("fasttrain") is not None


def test_unload_leaves_another_fasttrain_alone(shell):
    shell.register_magic_function(lambda line, cell: None, "cell", "fasttrain")
    magic.unload_ipython_extension(shell)
    assert shell.find_cell_magic("fasttrain") is not None
    del shell.magics_manager.magics["cell"]["fasttrain"]


# -- help -----------------------------------------------------------------------------------

ISSUE_OPTIONS = """--epochs --max-steps --batch-size --amp --pin --no-pin --workers --prefetch
    --persistent --no-persistent --on-device --optimizer --lr --wd --momentum --nesterov
    --betas --scheduler --warmup --min-lr --accum --clip --channels-last --compile
    --log-every --seed --device --config --dashboard --background --out --resume --model
    --data --loss --val""".split()


def test_help_lists_every_option_with_its_default(ip, capsys):
    ip.run_cell("%%fasttrain?")
    text = capsys.readouterr().out
    for option in ISSUE_OPTIONS:
        assert re.search(re.escape(option) + r"(?![\w-])", text), option
    for default in ("(default: adamw)", "(default: 0.001)", "(default: 64)",
                    "(default: auto)", "(default: 0.9,0.999)", "(default: run,",
                    "(default: model)", "(default: train_data)", "(default: constant)"):
        assert default in text, default
    help_lines = [ln for ln in text.splitlines() if ln.strip().startswith("--")]
    assert len(help_lines) == len(magic.FastTrainMagics.fasttrain.parser._actions)


def test_help_defaults_follow_trainconfig():
    doc = magic.FastTrainMagics.fasttrain.__doc__
    cfg = TrainConfig()
    assert f"(default: {cfg.epochs})" in doc
    assert f"(default: {cfg.log_every})" in doc
    assert f"(default: {cfg.optimizer})" in doc


# -- every option reaches the config --------------------------------------------------------

OPTIONS = [
    ("--epochs 3", dict(epochs=3)),
    ("--max-steps 7", dict(max_steps=7)),
    ("--batch-size 32", dict(batch_size=32)),
    ("--amp bf16", dict(amp="bf16")),
    ("--amp off", dict(amp="off")),
    ("--pin", dict(pin_memory=True)),
    ("--no-pin", dict(pin_memory=False)),
    ("--workers 2", dict(num_workers=2)),
    ("--workers auto", dict(num_workers="auto")),
    ("--threads 1", dict(num_threads=1)),
    ("--workers 2 --prefetch 4", dict(num_workers=2, prefetch_factor=4)),
    ("--workers 2 --persistent", dict(num_workers=2, persistent_workers=True)),
    ("--no-persistent", dict(persistent_workers=False)),
    ("--on-device", dict(data_on_device=True)),
    ("--no-on-device", dict(data_on_device=False)),
    ("--optimizer sgd", dict(optimizer="sgd")),
    ("--lr 0.05", dict(lr=0.05)),
    ("--lr 3e-4", dict(lr=3e-4)),
    ("--wd 0.01", dict(weight_decay=0.01)),
    ("--optimizer sgd --momentum 0.8", dict(optimizer="sgd", momentum=0.8)),
    ("--optimizer sgd --nesterov", dict(optimizer="sgd", nesterov=True)),
    ("--no-nesterov", dict(nesterov=False)),
    ("--betas 0.9,0.95", dict(betas=(0.9, 0.95))),
    ("--scheduler cosine", dict(scheduler="cosine")),
    ("--warmup 5", dict(warmup_steps=5)),
    ("--min-lr 1e-5", dict(min_lr=1e-5)),
    ("--accum 4", dict(grad_accum_steps=4)),
    ("--clip 1.0", dict(clip_grad_norm=1.0)),
    ("--channels-last", dict(channels_last=True)),
    ("--no-channels-last", dict(channels_last=False)),
    ("--compile", dict(compile=True)),
    ("--no-compile", dict(compile=False)),
    ("--log-every 5", dict(log_every=5)),
    ("--seed 7", dict(seed=7)),
    ("--device cpu", dict(device="cpu")),
    ("--device cuda:1", dict(device="cuda:1")),
    ("--drop-last", dict(drop_last=True)),
    ("--no-shuffle", dict(shuffle=False)),
    ("--processes 2", dict(processes=2)),
    ("--processes auto", dict(processes="auto")),
    ("--cluster ray --processes 2", dict(cluster="ray", processes=2)),
    ("--gpus-per-worker 1", dict(gpus_per_worker=1)),
    ("--activation-checkpointing 2", dict(activation_checkpointing=2)),
    ("--activation-checkpointing true", dict(activation_checkpointing=True)),
    ("--workers 2 --multiprocessing-context spawn",
     dict(num_workers=2, multiprocessing_context="spawn")),
    ("--no-batched-fetch", dict(batched_fetch=False)),
    ("--prefetch-to-device", dict(prefetch_to_device=True)),
    ("--decay-norm-and-bias", dict(decay_norm_and_bias=True)),
    ("--eps 1e-6", dict(eps=1e-6)),
    ("--optimizer-impl foreach", dict(optimizer_impl="foreach")),
    ("--step-size 50", dict(step_size=50)),
    ("--gamma 0.5", dict(gamma=0.5)),
    ("--cycle-steps 40", dict(cycle_steps=40)),
    ("--pct-start 0.2", dict(pct_start=0.2)),
    ("--div-factor 10", dict(div_factor=10.0)),
    ("--final-div-factor 100", dict(final_div_factor=100.0)),
    ("--plateau-patience 3", dict(plateau_patience=3)),
    ("--plateau-factor 0.5", dict(plateau_factor=0.5)),
    ("--on-nan skip", dict(on_nan="skip")),
    ("--no-telemetry", dict(telemetry=False)),
    ("--no-count-flops", dict(count_flops=False)),
    ("--history-limit 100", dict(history_limit=100)),
    ("--release-previous", dict(release_previous=True)),
    ("--checkpoint-dir ckpts --checkpoint-every 5",
     dict(checkpoint_dir="ckpts", checkpoint_every=5)),
    ("--name baseline", dict(name="baseline")),
    ("--store false", dict(store=False)),
    ("--store elsewhere.sqlite", dict(store="elsewhere.sqlite")),
    ("--report-to tensorboard,mlflow --report-dir tb",
     dict(report_to=("tensorboard", "mlflow"), report_dir="tb")),
]


@pytest.mark.parametrize("options, changes", OPTIONS, ids=[o for o, _ in OPTIONS])
def test_option_reaches_config(ip, calls, options, changes, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # --store and --report-dir name files in the working folder
    ip.run_cell(f"%%fasttrain {options}\n{CELL}")
    assert len(calls) == 1
    assert calls[0]["config"] == TrainConfig(**changes)
    assert ip.user_ns["run"].config == TrainConfig(**changes)


def test_every_config_field_is_an_option_and_tested():
    """The options are generated from TrainConfig's declarations: each field has one, and
    a new field needs a row in OPTIONS."""
    parser = magic.FastTrainMagics.fasttrain.parser
    in_magic = {a.dest for a in parser._actions if a.dest in FIELD_NAMES}
    tested = {name for _, changes in OPTIONS for name in changes}
    assert in_magic == tested == set(FIELD_NAMES)


def test_help_names_every_config_field_with_its_flag_and_default(ip, capsys):
    ip.run_cell("%%fasttrain?")
    text = capsys.readouterr().out
    assert "%%fasttrain [--model NAME]" in text   # the cell magic's own name in its usage
    unwrapped = re.sub(r"\s+", "", text)   # argparse wraps long lines, also at hyphens
    for name, meta in SETTINGS.items():
        assert re.search(re.escape(meta.flag) + r"(?![\w-])", text), name
        assert re.sub(r"\s+", "", f"{meta.help} (default: ") in unwrapped, name


def test_defaults_come_from_trainconfig(ip, calls):
    ip.run_cell(f"%%fasttrain\n{CELL}")
    (call,) = calls
    ns = ip.user_ns
    assert call["config"] == TrainConfig()
    assert call["model"] is ns["model"]
    assert call["train_data"] is ns["train_data"]
    assert call["loss_fn"] is ns["loss_fn"]
    assert call["val_data"] is None and call["resume"] is None
    assert call["background"] is False and call["progress"] == "auto"
    assert ns["run"].config == TrainConfig()


def test_without_loss_fn_the_model_returns_the_loss(ip, calls):
    ip.run_cell("%%fasttrain\nmodel = nn.Linear(8, 1)\ntrain_data = torch.randn(16, 8)")
    assert calls[0]["loss_fn"] is None


def test_val_data_is_used_when_defined(ip, calls):
    ip.run_cell(f"%%fasttrain\n{CELL}\nval_data = (torch.randn(32, 8), torch.zeros(32).long())")
    assert calls[0]["val_data"] is ip.user_ns["val_data"]


def test_other_variable_names(ip, calls):
    ip.run_cell("%%fasttrain --model net --data xy --loss crit --val held_out\n"
                "net = nn.Linear(8, 3)\n"
                "xy = (torch.randn(64, 8), torch.randint(0, 3, (64,)))\n"
                "crit = nn.CrossEntropyLoss()\n"
                "held_out = (torch.randn(16, 8), torch.randint(0, 3, (16,)))\n")
    ns, (call,) = ip.user_ns, calls
    assert call["model"] is ns["net"] and call["train_data"] is ns["xy"]
    assert call["loss_fn"] is ns["crit"] and call["val_data"] is ns["held_out"]


def test_option_values_expand_python_variables(ip, calls):
    ip.push({"steps": 9, "lr": 0.02})
    ip.run_cell("%%fasttrain --max-steps {steps} --lr $lr\n" + CELL)
    assert calls[0]["config"].max_steps == 9 and calls[0]["config"].lr == 0.02


# -- --config, --out, --background, --dashboard ----------------------------------------------

def test_config_is_the_base_and_only_given_options_override_it(ip, calls):
    base = TrainConfig(optimizer="sgd", lr=0.1, epochs=5, momentum=0.5)
    ip.push({"base": base})
    ip.run_cell(f"%%fasttrain --config base --epochs 2 --nesterov\n{CELL}")
    assert calls[0]["config"] == base.replace(epochs=2, nesterov=True)
    assert base.epochs == 5 and base.nesterov is False   # the user's config is not changed


def test_config_can_come_from_the_cell_body(ip, calls):
    ip.run_cell(f"%%fasttrain --config cfg\ncfg = TrainConfig(lr=0.5)\n{CELL}")
    assert calls[0]["config"] == TrainConfig(lr=0.5)


def test_config_must_name_a_trainconfig(ip, calls):
    ip.push({"cfg": {"lr": 0.1}, "good": TrainConfig()})
    message = usage_error(ip, f"%%fasttrain --config cfg\n{CELL}")
    assert "--config cfg: expected a TrainConfig, found dict" in message
    message = usage_error(ip, f"%%fasttrain --config nope\n{CELL}")
    assert "'nope'" in message and "TrainConfigs in the namespace: good" in message
    assert calls == []


def test_out_names_the_run_variable(ip, calls):
    ip.run_cell(f"%%fasttrain --out first\n{CELL}")
    assert isinstance(ip.user_ns["first"], FakeRun) and "run" not in ip.user_ns
    assert "--out '2nd': expected a Python variable name" in usage_error(
        ip, f"%%fasttrain --out 2nd\n{CELL}")


def test_background_puts_the_run_in_the_namespace_at_once(ip, calls, capsys):
    ip.run_cell(f"%%fasttrain --background\n{CELL}")
    assert calls[0]["background"] is True
    out = capsys.readouterr().out
    assert "the Run is in `run`" in out and "run.stop()" in out
    assert "SUMMARY TABLE" not in out   # not finished yet: no summary


def test_dashboard_falls_back_to_the_progress_bar(ip, calls, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "nbtrain.views.dashboard", None)   # import fails
    ip.run_cell(f"%%fasttrain --dashboard\n{CELL}")
    assert calls[0]["progress"] == "auto"
    out = capsys.readouterr().out
    assert out.count("needs plotly, anywidget and ipywidgets") == 1
    assert "SUMMARY TABLE" in out


def test_dashboard_hands_the_dashboard_to_fit(ip, calls, capsys, monkeypatch):
    module = types.ModuleType("nbtrain.views.dashboard")
    module.Dashboard = type("Dashboard", (), {})
    monkeypatch.setitem(sys.modules, "nbtrain.views.dashboard", module)
    ip.run_cell(f"%%fasttrain --dashboard\n{CELL}")
    assert calls[0]["progress"] is module.Dashboard
    assert "needs plotly" not in capsys.readouterr().out


# -- user errors: a UsageError with the fix, no traceback ----------------------------------

@pytest.mark.parametrize("options, settings", [
    ("--amp fp8", dict(amp="fp8")),
    ("--optimizer adamm", dict(optimizer="adamm")),
    ("--scheduler cosin", dict(scheduler="cosin")),
    ("--lr -1", dict(lr=-1.0)),
    ("--epochs 0", dict(epochs=0)),
    ("--nesterov", dict(nesterov=True)),
    ("--workers 0 --persistent", dict(num_workers=0, persistent_workers=True)),
    ("--betas 0.9,1.5", dict(betas=(0.9, 1.5))),
    ("--device gpu", dict(device="gpu")),
])
def test_bad_value_shows_the_configerror_text_before_the_body_runs(
        ip, calls, capsys, options, settings):
    message = usage_error(ip, f"%%fasttrain {options}\nran = True\n{CELL}")
    assert message == config_error_text(**settings)
    assert "ran" not in ip.user_ns and calls == []
    err = capsys.readouterr().err
    assert f"UsageError: {message}" in err and "Traceback" not in err


def test_bad_value_over_a_config_shows_the_configerror_text(ip, calls):
    ip.push({"cfg": TrainConfig(optimizer="sgd", momentum=0.0)})
    message = usage_error(ip, f"%%fasttrain --config cfg --nesterov\n{CELL}")
    assert message == config_error_text(optimizer="sgd", momentum=0.0, nesterov=True)


@pytest.mark.parametrize("options, expected", [
    ("--epochs three", "argument --epochs: expected a whole number >= 1, got 'three'"),
    ("--workers many", "argument --workers: expected 'auto' or a whole number"),
    ("--betas 0.9", "argument --betas: expected two numbers separated by a comma"),
    ("--betas a,b", "argument --betas: expected two numbers separated by a comma"),
    ("--lr", "argument --lr: expected one argument"),
    ("--epoch-count 3", "unrecognized arguments: --epoch-count 3"),
    ("--learning-rate 3e-4", "--learning-rate: did you mean --lr?"),
    ("--batchsize 8", "--batchsize: did you mean --batch-size?"),
])
def test_malformed_option_is_a_usage_error(ip, calls, options, expected):
    assert expected in usage_error(ip, f"%%fasttrain {options}\n{CELL}")
    assert calls == []


def test_missing_model_names_it_and_lists_what_the_cell_defined(ip, calls, capsys):
    message = usage_error(ip, "%%fasttrain\nimport math\nnet = nn.Linear(8, 3)\n"
                              "train_data = (torch.randn(8, 8), torch.zeros(8).long())\n")
    assert message == ("No variable named 'model' (the model). The cell defined: "
                       "net (Linear), train_data (tuple). Define 'model', or pass "
                       "--model NAME to use another variable.")
    assert "Traceback" not in capsys.readouterr().err
    assert calls == []


def test_missing_data_with_an_empty_cell(ip, calls):
    ip.push({"model": nn.Linear(8, 3)})
    message = usage_error(ip, "%%fasttrain\n# nothing here\n")
    assert "No variable named 'train_data' (the training data)" in message
    assert "The cell defined: none" in message and "--data NAME" in message


def test_missing_named_loss_and_val(ip, calls):
    assert "No variable named 'crit' (the loss)" in usage_error(
        ip, f"%%fasttrain --loss crit\n{CELL}")
    assert "No variable named 'held' (the validation data)" in usage_error(
        ip, f"%%fasttrain --val held\n{CELL}")
    assert calls == []


def test_model_must_be_a_module(ip, calls):
    message = usage_error(ip, "%%fasttrain\nmodel = torch.randn(3)\ntrain_data = torch.ones(4)")
    assert message.startswith("'model' is a Tensor, not a torch.nn.Module")


def test_failing_body_stops_before_training(ip, calls, capsys):
    message = usage_error(ip, f"%%fasttrain\n{CELL}\n1 / 0\n")
    assert "The cell body failed" in message
    shown = capsys.readouterr()
    assert "ZeroDivisionError" in shown.out + shown.err   # the user's own error, as usual
    assert calls == []


def test_configerror_from_the_engine_is_a_usage_error(ip, monkeypatch):
    def fit(*args, **kwargs):
        raise ConfigError("TrainConfig.device='cuda' is not allowed: expected a visible GPU.")
    monkeypatch.setattr(nbtrain, "fit", fit)
    assert usage_error(ip, f"%%fasttrain\n{CELL}") == (
        "TrainConfig.device='cuda' is not allowed: expected a visible GPU.")


def test_resume_must_name_a_run_or_a_checkpoint(ip, calls):
    ip.push({"old": FakeRun(TrainConfig()), "x": 3, "busy": FakeRun(TrainConfig(), "running")})
    assert "--resume busy: that Run is still training. Call busy.stop()" in usage_error(
        ip, f"%%fasttrain --resume busy\n{CELL}")
    message = usage_error(ip, f"%%fasttrain --resume nope\n{CELL}")
    assert "No variable named 'nope' (a Run to continue)" in message
    assert "Runs in the namespace: old, busy" in message
    assert "--resume x: expected a Run" in usage_error(ip, f"%%fasttrain --resume x\n{CELL}")
    assert calls == []


# -- the real engine --------------------------------------------------------------------------

def test_trains_and_prints_the_summary(ip, capsys):
    ip.run_cell(f"%%fasttrain --max-steps 4 --device cpu --log-every 2 --lr 0.01\n{CELL}")
    run = ip.user_ns["run"]
    assert run.state == "finished" and run.step == 4
    assert run.config == TrainConfig(max_steps=4, device="cpu", log_every=2, lr=0.01)
    assert run.model is ip.user_ns["model"]
    out = capsys.readouterr().out
    assert run.summary_text() in out
    assert re.search(r"^state +finished$", out, re.M)


class Interrupting(nn.Module):
    """A model whose forward raises KeyboardInterrupt on call `at`, as a kernel interrupt would."""

    def __init__(self, at: int):
        super().__init__()
        self.lin, self.calls, self.at = nn.Linear(8, 3), 0, at

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.lin(x)


def test_interrupt_leaves_a_run_ready_to_resume(ip, capsys):
    ip.push({"Interrupting": Interrupting})
    # --no-count-flops: the FLOP count's forward would be the model's first call
    result = ip.run_cell("%%fasttrain --max-steps 8 --device cpu --amp off --lr 0.01 --log-every 1 "
                         "--no-count-flops\n"
                         + CELL.replace("nn.Linear(8, 3)", "Interrupting(at=4)"))
    assert result.success
    run = ip.user_ns["run"]
    assert run.state == "interrupted" and run.step == 3
    out = capsys.readouterr().out
    assert "Interrupted at step 3; the Run is in `run`." in out
    assert "%fasttrain --resume run" in out

    ip.run_cell("%fasttrain --resume run")   # the line form needs no cell body
    resumed = ip.user_ns["run"]
    assert resumed.state == "finished" and resumed.step == 8
    assert resumed.config == run.config   # the interrupted run's settings carry over
    assert [r["step"] for r in resumed.records("train")] == list(range(1, 9))


class SendsSigint(Interrupting):
    """Sends the process a real SIGINT, as the notebook's stop button does to the kernel."""

    def forward(self, x):
        if self.calls + 1 == self.at:
            os.kill(os.getpid(), signal.SIGINT)
            self.calls += 1
            return self.lin(x)
        return super().forward(x)


def test_kernel_interrupt_stops_at_the_step_boundary(ip, capsys):
    ip.push({"SendsSigint": SendsSigint})
    result = ip.run_cell("%%fasttrain --max-steps 8 --device cpu --amp off --no-count-flops\n"
                         + CELL.replace("nn.Linear(8, 3)", "SendsSigint(at=3)"))
    assert result.success
    run = ip.user_ns["run"]
    assert run.state == "interrupted" and run.step == 3   # the step in flight completed
    assert "Interrupted at step 3" in capsys.readouterr().out
    ip.run_cell("%fasttrain --resume run")
    assert ip.user_ns["run"].state == "finished" and ip.user_ns["run"].step == 8


def test_interrupt_hint_repeats_the_variable_names(ip, capsys):
    ip.push({"Interrupting": Interrupting})
    ip.run_cell("%%fasttrain --max-steps 4 --device cpu --amp off --model net --loss crit --out r\n"
                + CELL.replace("model = nn.Linear(8, 3)", "net = Interrupting(at=2)")
                .replace("loss_fn", "crit"))
    assert ip.user_ns["r"].state == "interrupted"
    hint = "Continue it with: %fasttrain --resume r --model net --loss crit"
    assert hint in capsys.readouterr().out
    ip.run_cell(hint.split(": ", 1)[1])
    assert ip.user_ns["r"].state == "finished" and ip.user_ns["r"].step == 4


def test_resume_with_overrides_in_cell_form(ip):
    ip.run_cell(f"%%fasttrain --max-steps 3 --device cpu --lr 0.01\n{CELL}")
    ip.run_cell("%%fasttrain --resume run --max-steps 6 --out longer\npass\n")
    first, longer = ip.user_ns["run"], ip.user_ns["longer"]
    assert first.step == 3 and longer.step == 6 and longer.state == "finished"
    assert longer.config == first.config.replace(max_steps=6)


def test_resume_from_a_checkpoint_path(ip, tmp_path):
    ip.run_cell(f"%%fasttrain --max-steps 3 --device cpu --lr 0.01\n{CELL}")
    path = ip.user_ns["run"].save(tmp_path / "last.pt")
    ip.push({"ckpt": path})
    ip.run_cell("%fasttrain --resume ckpt --max-steps 5")
    run = ip.user_ns["run"]
    assert run.step == 5 and run.config.lr == 0.01 and run.config.max_steps == 5
    missing = tmp_path / "nope.pt"
    ip.push({"ckpt": str(missing)})
    assert usage_error(ip, "%fasttrain --resume ckpt").startswith(
        f"--resume {missing}: no checkpoint at {missing}")


def test_training_failure_keeps_the_failed_run(ip, capsys):
    ip.push({"Interrupting": Interrupting})
    message = usage_error(ip, "%%fasttrain --max-steps 4 --device cpu\n"
                              "model = nn.Linear(5, 3)\n"   # wrong input width
                              "train_data = (torch.randn(64, 8), torch.zeros(64).long())\n"
                              "loss_fn = nn.CrossEntropyLoss()\n")
    assert message.startswith("Training failed: the training step failed on batch 0")
    assert message.endswith("The failed Run is in `run`.")
    assert ip.user_ns["run"].state == "failed"
    assert "Traceback" not in capsys.readouterr().err


def test_background_run_finishes(ip):
    ip.run_cell(f"%%fasttrain --background --max-steps 3 --device cpu\n{CELL}")
    run = ip.user_ns["run"].wait(timeout=60)
    assert run.state == "finished" and run.step == 3


def test_compare_trains_one_run_per_value(ip, capsys):
    result = ip.run_cell("%%fasttrain --max-steps 6 --device cpu --amp off --log-every 2 "
                         "--out cmp --compare optimizer=sgd,adamw\n" + CELL)
    assert result.success
    cmp = ip.user_ns["cmp"]
    assert [row["name"] for row in cmp.rows] == ["optimizer=sgd", "optimizer=adamw"]
    runs = [rs[0] for rs in cmp.runs.values()]
    assert [r.config.optimizer for r in runs] == ["sgd", "adamw"]
    assert all(r.config.max_steps == 6 and r.state == "finished" for r in runs)
    assert "optimizer=sgd" in capsys.readouterr().out


def test_compare_parses_values_like_the_options(ip):
    ip.run_cell("%%fasttrain --max-steps 2 --device cpu --amp off --out c "
                "--compare batch-size=8,16\n" + CELL)
    assert [rs[0].config.batch_size for rs in ip.user_ns["c"].runs.values()] == [8, 16]


@pytest.mark.parametrize("spec, expected", [
    ("optimizer", "expected OPTION=V1,V2"),
    ("optimizer=sgd", "two or more values"),
    ("colour=red,blue", "'colour' is not a training option"),
    ("lr=fast,slow", "'fast'"),
    ("amp=fp8,bf16", "TrainConfig.amp='fp8'"),
])
def test_compare_spec_errors(ip, capsys, spec, expected):
    result = ip.run_cell(f"%%fasttrain --max-steps 2 --device cpu --compare {spec}\n" + CELL)
    assert not result.success
    assert expected in str(result.error_in_exec)


# -- a cell with a loop of its own: run once inside nt.watch ----------------------------------

OWN_LOOP = """
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
opt = torch.optim.AdamW(net.parameters(), 3e-3)
loader = DataLoader(TensorDataset(torch.randn(256, 8), torch.randint(0, 3, (256,))),
                    batch_size=32, shuffle=True)
steps = 0
for epoch in range(2):
    for xb, yb in loader:
        opt.zero_grad()
        loss = F.cross_entropy(net(xb), yb)
        loss.backward()
        opt.step()
        steps += 1   # the cell's own counter
"""


def test_an_own_loop_cell_runs_once_inside_a_watch_and_the_run_lands(ip, capsys):
    result = ip.run_cell(f"%%fasttrain --log-every 4 --no-count-flops\n{OWN_LOOP}")
    assert result.error_in_exec is None, result.error_in_exec
    run = ip.user_ns["run"]
    assert ip.user_ns["steps"] == run.step == 16   # the loop ran once, every step watched
    assert run.state == "finished" and run.model is ip.user_ns["net"]
    assert run.config.log_every == 4 and len(run.records()) == 4
    assert "batched_fetch" in capsys.readouterr().out   # the summary, with its reasons


def test_an_option_the_own_loop_decides_is_not_applied_and_the_cell_says_so(ip, capsys):
    result = ip.run_cell(f"%%fasttrain --epochs 3 --amp off\n{OWN_LOOP}")
    assert result.error_in_exec is None, result.error_in_exec
    assert ip.user_ns["steps"] == ip.user_ns["run"].step == 16   # the loop's own 2 epochs
    out = capsys.readouterr().out
    assert "Not applied: --epochs" in out and "--amp" in out


def test_a_stop_ends_the_own_loop_quietly_at_a_step_boundary(ip, capsys):
    cell = OWN_LOOP.replace("steps += 1   # the cell's own counter",
                            "steps += 1\n        if steps == 5:\n            run.stop()")
    result = ip.run_cell(f"%%fasttrain --out run\n{cell}")
    assert result.error_in_exec is None, result.error_in_exec
    run = ip.user_ns["run"]
    assert run.state == "stopped" and run.step == ip.user_ns["steps"] == 5
    assert "StopWatching" not in capsys.readouterr().out


def test_the_own_loops_error_is_shown_fails_the_cell_and_the_failed_run_kept(ip, capsys):
    """The loop's traceback is shown as in any cell, and the magic's cell fails too:
    "Run all" and papermill stop there."""
    cell = OWN_LOOP.replace("steps += 1   # the cell's own counter",
                            "steps += 1\n        if steps == 3:\n            raise KeyError('x')")
    message = usage_error(ip, f"%%fasttrain\n{cell}")
    assert message == "The loop failed (error above); the failed Run is in `run`."
    run = ip.user_ns["run"]
    assert run.state == "failed" and isinstance(run.error, KeyError) and run.step == 3
    assert "KeyError" in capsys.readouterr().out   # the loop's traceback, as IPython shows it


QUICKSTART_FUNCTIONS = """
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
training = DataLoader(TensorDataset(torch.randn(128, 8), torch.randint(0, 3, (128,))), batch_size=16)
testing = DataLoader(TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,))), batch_size=16)
net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
opt = torch.optim.SGD(net.parameters(), 1e-2)

def train(dataloader, model, loss_fn, optimizer):
    model.train()
    for X, y in dataloader:
        loss = loss_fn(model(X), y)
        loss.backward()   # the text is in this cell, the call in the next one
        optimizer.step()
        optimizer.zero_grad()

def test(dataloader, model, loss_fn):
    model.eval()
    with torch.no_grad():
        return sum(loss_fn(model(X), y).item() for X, y in dataloader)
"""


def test_a_cell_that_trains_through_a_function_it_calls_is_watched(ip, capsys):
    """The PyTorch quickstart's shape: train() defined in one cell, called in the next."""
    ip.run_cell(QUICKSTART_FUNCTIONS)
    result = ip.run_cell("%%fasttrain --no-count-flops\nfor t in range(3):\n"
                         "    train(training, net, nn.CrossEntropyLoss(), opt)\n"
                         "    test(testing, net, nn.CrossEntropyLoss())")
    assert result.error_in_exec is None, result.error_in_exec
    run = ip.user_ns["run"]
    assert run.state == "finished" and run.step == 3 * 8 and run.model is ip.user_ns["net"]
    assert sum(r["samples"] for r in run.records()) == 3 * 128   # the test loader's are not
    assert run.epoch == 2


def test_a_cell_that_only_defines_is_trained_by_fit_and_leaves_no_watch(ip):
    result = ip.run_cell("%%fasttrain --max-steps 3 --no-count-flops\n"
                         "model = nn.Linear(8, 3)  # s = 'x.backward()' in a comment\n"
                         "train_data = (torch.randn(64, 8), torch.randint(0, 3, (64,)))\n"
                         "loss_fn = nn.CrossEntropyLoss()")
    assert result.error_in_exec is None, result.error_in_exec
    run = ip.user_ns["run"]
    assert run.step == 3 and "your own" not in run.resolved.get("loop", ("fit's",))[0]
