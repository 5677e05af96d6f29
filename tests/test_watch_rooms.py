"""The watch's rooms have locks: read from the source of src/nbtrain/watcher, since a
write from the wrong room runs just as well until two rooms disagree.

- The step in progress (edge.Tally: samples, backwards, batches, trained, at_boundary) is
  changed only by the Tally's own methods, and "nbtrain's own code runs" (`inside`) only
  by `with edge.own:`, which restores what it found.
- No part writes another part's attributes, and the edge's own fields have one writer each.
- Each field of run.resolved that a watch writes is written by one part, and the amp by one
  method (Autocast.settle).
- Whether a watch changes, observes, keeps or refuses a setting is declared on the
  setting; the lists are derived from the declarations.
"""
import ast
from pathlib import Path

import pytest
import torch

import nbtrain as nt
from nbtrain import config
from nbtrain.watcher import OWN_LOOP_FIELDS
from nbtrain.watcher.edge import Edge, OwnCode

WATCHER = Path(nt.__file__).parent / "watcher"
TALLY = {"samples", "backwards", "batches", "trained", "at_boundary"}
PARTS = {"loader", "autocast", "scaling", "measure", "steps", "records", "copies", "ranks",
         "forward", "edge"}
# the edge's fields a part sets, and the one module that may
EDGE_WRITERS = {"model": "core.py", "device": "core.py", "interval": "core.py",
                "marks_steps": "core.py", "waited_s": "loader.py", "inside": "edge.py"}


def _modules():
    for path in sorted(WATCHER.glob("*.py")):
        yield path.name, ast.parse(path.read_text())


def _assigned(tree):
    """(target node, line) of every assignment target in `tree`, tuples unpacked."""
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            stack = [target]
            while stack:
                t = stack.pop()
                if isinstance(t, (ast.Tuple, ast.List)):
                    stack.extend(t.elts)
                else:
                    yield t, node.lineno


def test_the_tally_and_inside_are_written_only_by_their_own_methods():
    wrong = [f"{name}:{line} {ast.unparse(t)}" for name, tree in _modules() if name != "edge.py"
             for t, line in _assigned(tree)
             if isinstance(t, ast.Attribute) and t.attr in TALLY | {"inside"}]
    assert not wrong, wrong


def test_no_part_writes_another_parts_attributes():
    wrong = []
    for name, tree in _modules():
        for t, line in _assigned(tree):
            if not isinstance(t, ast.Attribute) or not isinstance(t.value, ast.Attribute):
                continue
            owner = t.value.attr   # self.<part>.<field> = ...
            if owner in PARTS - {"edge"}:
                wrong.append(f"{name}:{line} {ast.unparse(t)}")
            elif owner == "edge" and EDGE_WRITERS.get(t.attr) != name:
                wrong.append(f"{name}:{line} {ast.unparse(t)}")
        for t, line in _assigned(tree):   # edge = self.edge; edge.<field> = ...
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and \
                    t.value.id == "edge" and EDGE_WRITERS.get(t.attr) != name:
                wrong.append(f"{name}:{line} {ast.unparse(t)}")
    assert not wrong, wrong


def _resolved_writes(tree):
    """The run.resolved keys a module writes: `resolved[key] = ...`, setdefault, update."""
    keys = []
    for t, _ in _assigned(tree):
        if isinstance(t, ast.Subscript) and ast.unparse(t.value).endswith("resolved") and \
                isinstance(t.slice, ast.Constant):
            keys.append(t.slice.value)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr == "setdefault" and ast.unparse(node.func.value).endswith("resolved"):
            keys.append(node.args[0].value)
    return keys


def test_each_resolved_field_has_one_writing_part_and_amp_one_method():
    writers = {}
    for name, tree in _modules():
        for key in set(_resolved_writes(tree)):
            writers.setdefault(key, []).append(name)
    shared = {key: names for key, names in writers.items() if len(names) > 1}
    assert not shared, shared
    autocast = ast.parse((WATCHER / "autocast.py").read_text())
    assert _resolved_writes(autocast).count("amp") == 1   # Autocast.settle


def test_the_own_code_flag_is_restored_on_every_way_out():
    edge = Edge.__new__(Edge)
    edge.inside = False
    own = OwnCode(edge)
    with own:
        with own:
            assert edge.inside
        assert edge.inside   # the inner one restored the outer's True, not False
    assert edge.inside is False
    with pytest.raises(ZeroDivisionError), own:
        1 / 0
    assert edge.inside is False


def test_what_a_watch_does_with_a_setting_is_declared_on_it():
    assert OWN_LOOP_FIELDS == config.watched_as("changes") + config.watched_as("observes")
    assert "amp" in config.watched_as("changes") and "log_every" in config.watched_as("observes")
    assert config.watch_refusal("persistent_workers")
    with pytest.raises(nt.ConfigError, match="persistent_workers.*kept across epochs"):
        with nt.watch(persistent_workers=True):
            pass
    with pytest.raises(nt.ConfigError, match="belongs to your loop"):
        with nt.watch(lr=0.1):
            pass


def test_optimize_is_decided_once_and_each_part_says_it_the_same_way():
    """optimize=False: every setting the watch could change says the Plan's one reason."""
    from torch.utils.data import DataLoader, TensorDataset
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 2)), batch_size=4)
    with nt.watch(optimize=False, progress=False, store=False, count_flops=False) as run:
        for xb, yb in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
    from nbtrain.watcher.settings import OPTIMIZE_OFF
    for name in ("amp", "batched_fetch", "optimizer_impl", "prefetch_to_device"):
        assert run.resolved[name][1] == OPTIMIZE_OFF, (name, run.resolved[name])


@pytest.mark.parametrize("has_bf16, emulates", [(False, False), (False, True), (True, True)])
@pytest.mark.parametrize("requested", ["bf16", "auto", "fp16", "off"])
def test_fit_and_the_watch_climb_one_amp_ladder(monkeypatch, requested, has_bf16, emulates):
    """The same request on the same GPU gets the same answer from nt.fit's resolve_amp and
    the watch's: the same ConfigError for bf16 where torch cannot emulate it, the same
    emulation where it can, fp16 for "auto" on a GPU without bf16 units (the watch scales
    its loss through the hooks)."""
    from nbtrain.auto import precision as ladder
    from nbtrain.watcher import autocast
    from nbtrain.watcher.autocast import watch_amp
    monkeypatch.setattr(ladder, "gpu_has_bf16", lambda device: has_bf16)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: emulates)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "an old GPU")
    monkeypatch.setattr(ladder, "device_name", lambda device: "an old GPU")
    monkeypatch.setattr(autocast, "known_bf16_gain", lambda key: (1.5, "measured"))
    monkeypatch.setattr(autocast, "clip_out_of_reach", lambda: "")   # see the test below
    gpu = torch.device("cuda", 0)

    def answer(resolve):
        try:
            return resolve()[0]
        except nt.ConfigError as error:
            return f"ConfigError: {error}"
    fit = answer(lambda: ladder.resolve_amp(requested, gpu))
    watch = answer(lambda: watch_amp(requested, gpu, "", lambda: ("key",), False))
    assert fit == watch
    if requested == "bf16" and not has_bf16:
        assert fit == ("bf16" if emulates else
                       "ConfigError: TrainConfig.amp='bf16' is not supported by this GPU "
                       "(an old GPU): use amp='fp16'.")
    if requested == "auto":
        assert fit == ("bf16" if has_bf16 else "fp16")


def test_auto_keeps_fp32_where_a_name_bound_before_the_watch_holds_torchs_clip(monkeypatch):
    """`from torch.nn.utils import clip_grad_norm_` before the watch: the watch's patched
    clip cannot reach that name, which would clip fp16's scaled gradients, so "auto" on a
    GPU without bf16 keeps fp32 and says which name; asked for, fp16 is the user's."""
    from nbtrain.auto import precision as ladder
    from nbtrain.watcher.autocast import watch_amp
    monkeypatch.setattr(ladder, "gpu_has_bf16", lambda device: False)
    gpu = torch.device("cuda", 0)
    monkeypatch.setitem(globals(), "held_clip", torch.nn.utils.clip_grad_norm_)
    amp, why = watch_amp("auto", gpu, "", lambda: ("key",), False)
    assert amp == "off" and "`held_clip`" in why and "torch.nn.utils.clip_grad_norm_(" in why
    assert watch_amp("fp16", gpu, "", lambda: ("key",), False)[0] == "fp16"
    monkeypatch.delitem(globals(), "held_clip")
    assert "held_clip" not in watch_amp("auto", gpu, "", lambda: ("key",), False)[1]
