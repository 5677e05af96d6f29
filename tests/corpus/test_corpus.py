"""Public training programs, run verbatim-in-shape three ways: as written, inside
`nt.watch(optimize=False)` and inside `nt.watch()` (tests/corpus/harness.py).

What a watch promises (docs/guide/own-loop.md): watching only leaves the weights bit for
bit those of the loop as written; the Run's steps and samples are the loop's; nothing of
torch, the models, the optimizers or the loaders is left patched or hooked; the defaults
train to finite weights and loss; a watched model can be saved, pickled and copied.
"""
import copy
import functools
import math

import pytest

from harness import (BY_NAME, CORPUS, different_weights, dump_inside, expected_counts,
                     hand_count, import_frameworks,
                     load_in_fresh_python, lookup, module_surface, not_finite, object_surfaces,
                     run_counts, run_program, surface_changes, surface_diff)


def with_skips(programs):
    """Each program's name, skipped where a framework it imports is not installed."""
    return [pytest.param(p.name, marks=pytest.mark.skipif(
        p.missing() is not None,
        reason=f"needs {p.missing()} (pip install -c .ci/constraints.txt -e '.[frameworks]')"))
        for p in programs]


NAMES = with_skips(CORPUS)
# main() programs: their classes live in a module importable by name, so the watched
# model itself can be pickled and loaded elsewhere (a script's classes are __main__'s)
PICKLED = with_skips([p for p in CORPUS if p.entry == "main"])


@pytest.fixture(scope="module", autouse=True)
def _forget_the_runs():
    """The runs' namespaces (models, loaders, data of every program, three ways) are let go
    after this module: the suite's later tests fork workers from a smaller process."""
    yield
    result.cache_clear()
    import gc
    gc.collect()


@pytest.fixture(scope="module", autouse=True)
def _one_world(request):
    """The frameworks of the programs this session runs, imported before its first run:
    a framework that patches torch at import (Lightning's torch.compile) would otherwise
    part a program's earlier runs from its later ones (harness.import_frameworks)."""
    names = {item.callspec.params.get("name") for item in request.session.items
             if hasattr(item, "callspec")}
    import_frameworks([BY_NAME[n] for n in names if n in BY_NAME])


@functools.lru_cache(maxsize=None)
def result(name: str, way: str):
    """Each program runs once each way per session; the tests read the same runs."""
    program = BY_NAME[name]
    inside = dump_inside(lambda ns: ({n: lookup(ns, n) for n in program.models},
                                     {n: lookup(ns, n) for n in program.optimizers}),
                         pickles=program.entry == "main")
    return run_program(program, way, inside=inside if way == "defaults" else None)


@pytest.mark.parametrize("name", NAMES)
def test_hand_counts_are_the_programs(name):
    """The harness's arithmetic of steps is what the program, as written, did."""
    written = result(name, "as written")
    assert hand_count(written) == written.program.steps


@pytest.mark.parametrize("name", NAMES)
def test_watching_only_leaves_the_weights_bit_for_bit(name):
    written, watched = result(name, "as written"), result(name, "watched")
    assert watched.run.state == "finished", (watched.run.state, watched.run.message)
    for model in written.program.models:
        assert different_weights(written.models()[model], watched.models()[model]) == [], model


@pytest.mark.parametrize("way", ["watched", "defaults"])
@pytest.mark.parametrize("name", NAMES)
def test_steps_and_samples_are_the_loops(name, way):
    got = result(name, way)
    program = got.program
    assert run_counts(got.run) == expected_counts(program)


@pytest.mark.parametrize("way", ["watched", "defaults"])
@pytest.mark.parametrize("name", NAMES)
def test_nothing_left_patched_or_hooked(name, way):
    written, got = result(name, "as written"), result(name, way)
    assert surface_changes(got.torch_before, got.torch_after) == []
    assert surface_diff(object_surfaces(written), object_surfaces(got)) == []


@pytest.mark.parametrize("name", NAMES)
def test_defaults_train_to_finite_weights_and_loss(name):
    got = result(name, "defaults")
    assert got.run.state == "finished", (got.run.state, got.run.message)
    for model_name, model in got.models().items():
        assert not_finite(model) == [], model_name
    if "loss" in got.program.seen:
        assert math.isfinite(got.run.summary()["final_loss"])
    else:   # the Run says why it has no loss
        assert "no backward" in got.run.resolved["loss"][1]


@pytest.mark.parametrize("name", NAMES)
def test_a_copy_made_inside_the_watch_keeps_no_hook(name):
    """copy.deepcopy of a watched model, after the watch: as bare as the model as written."""
    written, got = result(name, "as written"), result(name, "defaults")
    for model_name, copied in got.inside["deepcopies"].items():
        # a deepcopy of a compiled model drops what torch.compile set on it: compare copies
        original = written.models()[model_name]
        expected = module_surface(copy.deepcopy(original))
        assert surface_diff({"copy": expected}, {"copy": module_surface(copied)}) == []


@pytest.mark.parametrize("name", PICKLED)
def test_saved_inside_the_watch_loads_where_nbtrain_never_was(name):
    """torch.save(model), pickle.dumps(model) and torch.save(optimizer.state_dict()) made
    inside the watch load in a fresh interpreter that never imports nbtrain, with the
    weights they had and no hook."""
    got = result(name, "defaults")
    assert "error" not in got.inside, got.inside.get("error")
    done = load_in_fresh_python(got.inside["blobs"], got.inside["weights"])
    assert done.returncode == 0, done.stderr[-3000:]
