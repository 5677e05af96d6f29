"""The user's own optimizer (an Optimizer subclass or a factory) and LR scheduler factory.

PyTorch's MNIST example trains with `Adadelta(params, lr=1.0)` and `StepLR(opt, step_size=1,
gamma=0.7)`; here both come from the user, through fit, the preview, checkpoints and the magic.
"""
import json
import os

import pytest
import torch
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from torch.nn import functional as F

import nbtrain as nt
from nbtrain.ui import magic
from nbtrain.config import ConfigError
from nbtrain.train.schedule import Schedule

from conftest import mlp, quick


def step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)


def mnist_style(**overrides):
    return quick(**{"optimizer": torch.optim.Adadelta, "lr": 1.0, "scheduler": step_lr,
                    "log_every": 1, **overrides})


def test_an_optimizer_class_trains_with_the_scheduler_factorys_rates(blobs):
    cfg = mnist_style(max_steps=12, warmup_steps=2)
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=cfg, progress=False)
    assert type(run.optimizer) is torch.optim.Adadelta and run.state == "finished"
    assert run.records("train")[-1]["loss"] < run.records("train")[0]["loss"]
    applied = [r["lr"] for r in run.records("train")]
    assert applied == pytest.approx(nt.schedule_preview(cfg, 12))
    # warmup, then StepLR's own rates: 1.0 for 4 steps, then 0.7, then 0.49
    assert applied == pytest.approx([0.5, 1.0] + [1.0] * 4 + [0.7] * 4 + [0.49] * 2)
    assert run.resolved["optimizer_impl"][0] == "its own"


def test_a_factory_builds_the_optimizer_its_way(blobs):
    def adadelta(params):
        return torch.optim.Adadelta(params, lr=1.0, rho=0.8)
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=mnist_style(optimizer=adadelta, max_steps=3),
                 progress=False)
    assert run.optimizer.defaults["rho"] == 0.8


def test_a_factory_whose_lr_differs_from_the_configs_says_which_to_set(blobs):
    cfg = quick(optimizer=lambda params: torch.optim.Adadelta(params), max_steps=2)
    with pytest.raises(ConfigError, match=r"lr 1.0, but TrainConfig.lr=0.01.*TrainConfig\(lr=1.0\)"):
        nt.fit(mlp(), blobs, F.cross_entropy, config=cfg, progress=False)


def _decays(run):
    return sorted({group["weight_decay"] for group in run.optimizer.param_groups})


def test_your_optimizer_keeps_its_own_weight_decay(blobs):
    factory = lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05)  # noqa: E731
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=quick(optimizer=factory, max_steps=2),
                 progress=False)
    assert _decays(run) == [0.05]
    run = nt.fit(mlp(), blobs, F.cross_entropy, progress=False,
                 config=quick(optimizer=torch.optim.AdamW, max_steps=2))
    assert _decays(run) == [0.01]   # AdamW's own default


def test_a_set_weight_decay_applies_to_your_optimizer_as_to_a_named_one(blobs):
    factory = lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05)  # noqa: E731
    for optimizer in (factory, torch.optim.AdamW):
        run = nt.fit(mlp(), blobs, F.cross_entropy, progress=False,
                     config=quick(optimizer=optimizer, weight_decay=0.05, max_steps=2))
        assert _decays(run) == [0.0, 0.05]   # matrices only, as for optimizer="adamw"


def test_a_set_weight_decay_unlike_the_factorys_says_which_to_change(blobs):
    factory = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731  (0.01)
    cfg = quick(optimizer=factory, weight_decay=0.1, max_steps=2)
    says = r"weight_decay 0.01, but TrainConfig.weight_decay=0.1.*weight_decay=0.1.*leave"
    with pytest.raises(ConfigError, match=says) as err:
        nt.fit(mlp(), blobs, F.cross_entropy, config=cfg, progress=False)
    assert err.value.field == "weight_decay"


def test_a_set_weight_decay_on_an_optimizer_without_one_is_refused(blobs):
    class Plain(torch.optim.Optimizer):   # an optimizer of your own with no weight decay
        def __init__(self, params, lr):
            super().__init__(params, dict(lr=lr))

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.add_(p.grad, alpha=-group["lr"])
    with pytest.raises(ConfigError, match="Plain has no weight_decay") as err:
        nt.fit(mlp(), blobs, F.cross_entropy, progress=False,
               config=quick(optimizer=Plain, weight_decay=0.1, max_steps=2))
    assert err.value.field == "weight_decay"


def test_set_lr_scales_the_scheduler_factorys_curve():
    schedule = Schedule(mnist_style(), 10)
    before = [schedule.lr(s) for s in range(10)]
    schedule.base_lr = 2.0
    assert [schedule.lr(s) for s in range(10)] == pytest.approx([2 * lr for lr in before])


def test_schedulers_that_cannot_be_previewed_say_why():
    plateau = mnist_style(scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    with pytest.raises(ConfigError, match="scheduler='plateau'"):
        nt.schedule_preview(plateau, 10)
    short = mnist_style(scheduler=lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, 1.0, total_steps=3, cycle_momentum=False))
    with pytest.raises(ConfigError, match="failed at step 4 of 10.*once per optimizer step"):
        nt.schedule_preview(short, 10)
    cycling = mnist_style(scheduler=lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, 1.0, total_steps=10))   # Adadelta has no momentum to cycle
    with pytest.raises(ConfigError, match="failed on a Adadelta.*momentum"):
        nt.schedule_preview(cycling, 10)


def test_the_config_stores_its_name_and_asks_for_the_code_again():
    values = mnist_style().to_dict()
    assert values["optimizer"] == "custom:Adadelta" and values["scheduler"] == "custom:step_lr"
    json.dumps(values)
    with pytest.raises(ConfigError, match="Pass it again to resume"):
        nt.TrainConfig.from_dict(values)


def test_a_named_optimizer_still_suggests_its_closest_name():
    with pytest.raises(ConfigError, match="did you mean 'adamw'"):
        nt.TrainConfig(optimizer="AdamW")


def test_resume_from_a_checkpoint_with_the_same_factory_is_bit_identical(blobs, tmp_path):
    cfg = mnist_style(max_steps=20, checkpoint_dir=str(tmp_path), checkpoint_every=9)

    def new_model():
        torch.manual_seed(1)
        return mlp(dropout=0.3)
    straight = new_model()
    nt.fit(straight, blobs, F.cross_entropy, config=cfg, progress=False)
    first = nt.fit(new_model(), blobs, F.cross_entropy, config=cfg.replace(max_steps=9),
                   progress=False)
    assert first.step == 9
    path = os.path.join(tmp_path, "last.pt")
    with pytest.raises(ConfigError, match="custom:Adadelta"):   # the code must come again
        nt.fit(new_model(), blobs, F.cross_entropy, resume=path, progress=False)
    resumed_model = new_model()
    torch.rand(10)   # the user's own random calls in between must not matter
    resumed = nt.fit(resumed_model, blobs, F.cross_entropy, config=cfg, resume=path,
                     progress=False)
    assert resumed.step == 20
    for a, b in zip(straight.state_dict().values(), resumed_model.state_dict().values()):
        assert torch.equal(a, b)
    assert [r["lr"] for r in resumed.records("train")] == pytest.approx(
        nt.schedule_preview(cfg, 20))


def test_resume_from_a_run_keeps_its_own_optimizer(blobs):
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=mnist_style(max_steps=3), progress=False)
    more = nt.fit(run.model, blobs, F.cross_entropy, resume=run, progress=False)
    assert more.config.optimizer is torch.optim.Adadelta and more.config.scheduler is step_lr


def test_resuming_with_another_optimizer_is_refused(blobs):
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=mnist_style(max_steps=3), progress=False)
    with pytest.raises(ConfigError, match="'adamw' cannot resume a run trained with 'custom:Adadelta'"):
        nt.fit(run.model, blobs, F.cross_entropy, config=quick(max_steps=6), resume=run,
               progress=False)


@pytest.fixture
def ip():
    shell = InteractiveShell.instance()
    magic.load_ipython_extension(shell)
    shell.push({"torch": torch, "F": F, "mlp": mlp})
    yield shell
    magic.unload_ipython_extension(shell)
    for name in ("run", "model", "train_data", "loss_fn", "Adadelta", "decay", "torch", "F",
                 "mlp", "blobs", "ran"):
        shell.user_ns.pop(name, None)


def test_fasttrain_takes_the_optimizer_and_scheduler_from_cell_variables(ip, blobs):
    ip.push({"blobs": blobs})
    result = ip.run_cell(
        "%%fasttrain --optimizer Adadelta --lr 1.0 --scheduler decay --max-steps 6 "
        "--device cpu --amp off --log-every 1\n"
        "from torch.optim import Adadelta\n"
        "decay = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)\n"
        "model, train_data, loss_fn = mlp(), blobs, F.cross_entropy\n")
    assert result.success, result.error_in_exec
    run = ip.user_ns["run"]
    assert type(run.optimizer) is torch.optim.Adadelta
    assert [r["lr"] for r in run.records("train")] == pytest.approx([1.0] * 4 + [0.5] * 2)


def test_fasttrain_refuses_a_name_neither_a_choice_nor_a_variable_before_the_body(ip, blobs):
    ip.push({"blobs": blobs})
    result = ip.run_cell("%%fasttrain --optimizer Adadelt --max-steps 2\n"
                         "ran = True\n"
                         "from torch.optim import Adadelta\n"
                         "model, train_data, loss_fn = mlp(), blobs, F.cross_entropy\n")
    assert type(result.error_in_exec) is UsageError and "ran" not in ip.user_ns
    assert "TrainConfig.optimizer='Adadelt' is not allowed" in str(result.error_in_exec)
    assert "torch.optim.Optimizer subclass" in str(result.error_in_exec)


def test_fasttrain_takes_a_factory_defined_in_an_earlier_cell(ip, blobs):
    ip.push({"blobs": blobs, "mine": lambda params: torch.optim.Adadelta(params, lr=1.0)})
    result = ip.run_cell("%%fasttrain --optimizer mine --lr 1 --max-steps 2\n"
                         "model, train_data, loss_fn = mlp(), blobs, F.cross_entropy\n")
    assert result.success, result.error_in_exec
    assert type(ip.user_ns["run"].optimizer) is torch.optim.Adadelta
    del ip.user_ns["mine"]


def test_the_panels_optimizer_and_schedule_dropdowns_hold_your_own(blobs):
    pytest.importorskip("ipywidgets")
    pytest.importorskip("anywidget")
    pytest.importorskip("plotly")
    from nbtrain.ui.panel import Panel
    panel = Panel(mlp(), blobs, F.cross_entropy, config=mnist_style(max_steps=6))
    try:
        optimizer = panel.controls["optimizer"].widget
        assert optimizer.label == "custom:Adadelta" and optimizer.value is torch.optim.Adadelta
        assert ("adamw", "adamw") in optimizer.options
        assert panel.controls["scheduler"].widget.label == "custom:step_lr"
        optimizer.value = "sgd"   # a name can still be chosen
        assert panel.config.optimizer == "sgd"
    finally:
        panel.dashboard.close()


def test_the_dashboard_and_panel_name_your_own_optimizer_and_schedule():
    from nbtrain.views.dashboard import _settings_text
    from nbtrain.ui.panel import _config_text
    cfg = nt.TrainConfig(optimizer=torch.optim.Adadelta, lr=1.0,
                         scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10))
    run = nt.Run(cfg)
    assert "custom:Adadelta" in _settings_text(run) and "custom:" in _config_text(cfg)


# -- which kernel "auto" gives an optimizer on a CPU -------------------------------------------
@pytest.mark.parametrize("make, impl", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), "its own"),                  # plain SGD: one op a tensor
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "fused"),
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3), "fused"),
])
def test_auto_gives_the_fused_kernel_only_where_it_pays_on_a_cpu(make, impl):
    """Plain SGD's fused CPU kernel gains at most 1.10x and loses on a busy machine: under
    "auto" the watch leaves it as written; asked for by name, it is fused all the same."""
    from nbtrain.train.optim import impl_for
    model = torch.nn.Linear(8, 2)
    cpu = torch.device("cpu")
    assert impl_for(make(model.parameters()), cpu, "auto")[0] == impl
    assert impl_for(make(model.parameters()), cpu, "fused")[0] == "fused"
    opt = make(model.parameters())
    seen = []
    with nt.watch(progress=False, store=False) as run:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            seen.append(bool(opt.param_groups[0].get("fused")))
    assert run.resolved["optimizer_impl"][0] == impl and seen[-1] == (impl == "fused")


def test_fit_keeps_plain_sgds_own_kernel_on_a_cpu():
    from nbtrain.train.optim import resolve_impl
    cpu = torch.device("cpu")
    assert resolve_impl(nt.TrainConfig(optimizer="sgd", momentum=0.0), cpu)[0] == "for-loop"
    assert resolve_impl(nt.TrainConfig(optimizer="sgd"), cpu)[0] == "fused"   # momentum 0.9
    assert resolve_impl(nt.TrainConfig(optimizer="sgd", momentum=0.0,
                                       optimizer_impl="fused"), cpu)[0] == "fused"
