import pytest
import torch
from torch.nn import functional as F

import nbtrain as nt
from nbtrain import ConfigError, TrainConfig
from nbtrain.config import FIELD_NAMES, SETTINGS
from nbtrain.data.batches import epoch_order

from conftest import mlp, quick


@pytest.mark.parametrize("field, value, allowed", [
    ("amp", "fp8", "'off', 'fp16', 'bf16', 'auto'"),
    ("optimizer", "adamx", "did you mean 'adam"),
    ("scheduler", "cosin", "did you mean 'cosine'"),
    ("batch_size", 0, "a whole number >= 1"),
    ("epochs", 2.5, "a whole number >= 1"),
    ("lr", -1.0, "a number > 0"),
    ("device", "gpu", "'cuda:N'"),
    ("num_workers", -1, "'auto' or a whole number >= 0"),
    ("num_threads", 0, "'auto' or a whole number from 1 to 1,024"),
    ("num_threads", 10**9, "'auto' or a whole number from 1 to 1,024"),
    ("lr", float("inf"), "a number > 0"),
    ("weight_decay", float("nan"), "a number >= 0"),
    ("final_div_factor", float("inf"), "a number >= 1"),
    ("seed", 2**64, "a whole number from"),
    ("history_limit", "many", "a whole number >= 10"),
    ("checkpoint_dir", 123, "a folder path"),
    ("pin_memory", "yes", "True, False or 'auto'"),
    ("betas", (0.9, 1.5), "two numbers in [0, 1)"),
    ("on_nan", "ignore", "'stop', 'skip'"),
    ("clip_grad_norm", 0, "None or a number > 0"),
    ("multiprocessing_context", "threads", "'spawn'"),
])
def test_bad_value_names_field_value_and_what_is_allowed(field, value, allowed):
    with pytest.raises(ConfigError) as err:
        TrainConfig(**{field: value})
    text = str(err.value)
    assert f"TrainConfig.{field}={value!r}" in text
    assert allowed in text


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_unknown_name_suggests_the_closest():
    with pytest.raises(ConfigError, match="Did you mean 'warmup_steps'"):
        TrainConfig().replace(warmup_step=10)
    with pytest.raises(ConfigError, match="Did you mean 'batch_size'"):
        TrainConfig.from_dict({"batchsize": 4})


def test_cross_field_rules():
    with pytest.raises(ConfigError, match="nesterov"):
        TrainConfig(optimizer="adam", nesterov=True)
    with pytest.raises(ConfigError, match="min_lr"):
        TrainConfig(lr=1e-3, min_lr=1e-2)
    with pytest.raises(ConfigError, match="persistent_workers"):
        TrainConfig(num_workers=0, persistent_workers=True)


def test_round_trip_and_replace():
    cfg = TrainConfig(epochs=3, amp="bf16", optimizer="sgd", momentum=0.8, nesterov=True,
                      betas=(0.8, 0.9), scheduler="onecycle", num_workers=2)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    changed = cfg.replace(lr=0.5)
    assert changed.lr == 0.5 and cfg.lr != 0.5
    with pytest.raises(ConfigError):
        cfg.replace(lr=0)


def test_replace_checks_the_changed_fields_and_the_rules_and_leaves_the_original():
    cfg = TrainConfig(optimizer="sgd", momentum=0.9, nesterov=True, lr=1e-2, min_lr=1e-3)
    with pytest.raises(ConfigError, match="nesterov"):   # a rule the change breaks
        cfg.replace(optimizer="adam")
    with pytest.raises(ConfigError, match="min_lr"):
        cfg.replace(lr=1e-4)
    with pytest.raises(ConfigError, match="epochs"):   # the changed field itself
        cfg.replace(epochs=0)
    assert cfg == TrainConfig(optimizer="sgd", momentum=0.9, nesterov=True, lr=1e-2, min_lr=1e-3)
    changed = cfg.replace(betas=[0.8, 0.9], nesterov=False, optimizer="adam")
    assert changed == TrainConfig(optimizer="adam", momentum=0.9, lr=1e-2, min_lr=1e-3,
                                  betas=(0.8, 0.9))   # normalised as the constructor does
    assert changed is not cfg and cfg.optimizer == "sgd"


def test_public_names():
    for name in ("TrainConfig", "ConfigError", "fit", "Run", "schedule_preview", "datasets"):
        assert hasattr(nt, name)


def test_config_error_carries_the_field():
    with pytest.raises(ConfigError) as err:
        TrainConfig(num_workers=0, prefetch_factor=2)
    assert err.value.field == "prefetch_factor"
    with pytest.raises(ConfigError) as err:
        TrainConfig(lr="fast")
    assert err.value.field == "lr"


def test_every_field_is_declared_once_with_what_the_tools_need():
    from nbtrain.config import GROUPS, SETTINGS
    flags = [meta.flag for meta in SETTINGS.values()]
    assert len(set(flags)) == len(flags)   # one option per field
    for name, meta in SETTINGS.items():
        assert meta.group in GROUPS and meta.help and meta.speed in (True, False, "tuned")
        assert meta.kind.accepts(getattr(TrainConfig(), name)), name   # the default is allowed
        if meta.when:
            assert meta.when[0] in SETTINGS


def test_every_config_error_raised_in_the_engine_names_its_field():
    """The panel shows a ConfigError beside the control of `.field`: every raise sets it."""
    import ast
    from pathlib import Path
    src = Path(nt.__file__).parent
    unnamed = []
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ConfigError" \
                    and not any(k.arg == "field" for k in node.keywords):
                unnamed.append(f"{path.name}:{node.lineno}")
    assert not unnamed, unnamed


def test_a_field_set_after_construction_is_checked_then_and_by_fit():
    cfg = TrainConfig()
    with pytest.raises(ConfigError, match="TrainConfig.lr=-1"):
        cfg.lr = -1
    cfg.optimizer = "adam"
    cfg.nesterov = True   # valid alone; the rule between fields is fit's to check
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    with pytest.raises(ConfigError, match="nesterov"):
        nt.fit(torch.nn.Linear(3, 2), (x, y), torch.nn.functional.cross_entropy, config=cfg)


def test_a_misspelt_keyword_in_the_constructor_suggests_the_field():
    with pytest.raises(ConfigError, match="Did you mean 'epochs'"):
        TrainConfig(epoch=3)


def test_a_choice_differing_only_in_case_suggests_that_one():
    with pytest.raises(ConfigError, match="did you mean 'adamw'"):
        TrainConfig(optimizer="adamW")


def test_checkpoint_every_needs_a_folder():
    with pytest.raises(ConfigError, match="checkpoint_dir"):
        TrainConfig(checkpoint_every=10)
    assert TrainConfig(checkpoint_every=10, checkpoint_dir="ckpts").checkpoint_every == 10


def test_a_list_of_betas_from_json_becomes_the_tuple():
    assert TrainConfig.from_dict({"betas": [0.8, 0.9]}).betas == (0.8, 0.9)


def test_every_accepted_seed_shuffles_without_overflowing_torchs_seed():
    low, high = SETTINGS["seed"].kind.low, SETTINGS["seed"].kind.high
    for seed, epoch in ((low, 0), (high, 0), (high, 2**40)):   # 2**40: more than any run's epochs
        assert len(epoch_order(4, True, seed, epoch)) == 4
    for seed in (low - 1, high + 1, 2**63):
        with pytest.raises(ConfigError, match=f"from {low:,} to {high:,}") as err:
            TrainConfig(seed=seed)
        assert err.value.field == "seed"


def test_the_highest_seed_trains_shuffled(blobs):
    high = SETTINGS["seed"].kind.high
    run = nt.fit(mlp(), blobs, F.cross_entropy, config=quick(seed=high, max_steps=2),
                 progress=False)
    assert run.state == "finished"


def test_a_config_is_built_by_keyword_and_compares_and_prints_by_its_fields():
    """TrainConfig's __init__, __eq__ and __repr__ are written once, not generated (a
    watch's import would compile them): the same signature, equality and text."""
    import inspect
    params = inspect.signature(TrainConfig).parameters
    assert list(params) == list(FIELD_NAMES)
    assert all(p.kind is p.KEYWORD_ONLY for p in params.values())
    assert params["epochs"].default == 1 and params["amp"].default == "auto"
    with pytest.raises(TypeError):
        TrainConfig(3)
    a, b = TrainConfig(epochs=3, lr=0.01), TrainConfig(epochs=3, lr=0.01)
    assert a == b and a != b.replace(lr=0.02) and a != "TrainConfig" and a.__hash__ is None
    assert repr(a).startswith("TrainConfig(epochs=3, max_steps=None, ") and "lr=0.01" in repr(a)
    assert eval(repr(a), {"TrainConfig": TrainConfig}) == a
