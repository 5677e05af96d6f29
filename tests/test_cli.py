"""The command line: `nbtrain --version`, `nbtrain demo --help`."""
import pytest

import nbtrain
from nbtrain.ui.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"nbtrain {nbtrain.__version__}"


def test_demo_help_gives_every_options_help_and_default(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--epochs EPOCHS passes over the digits data in each row's full run, the one " \
        "where every auto measures (fewer than 15: too short for the threads probe to " \
        "measure) (default: 16)" in out
    assert "--max-rounds MAX_ROUNDS timing rounds at most, one short run of each row a " \
        "round, the order alternating (at least 12 unless they would take over 158 s; " \
        "fewer once every row's rate has a 95% interval at most 10% wide and every ratio " \
        "4%, or 79 s into the demo); the table gives their median (default: 400)" in out
    assert "--progress show a progress bar per full run (default: False)" in out


def test_the_demo_runs_every_row_and_the_own_loop_and_prints_the_table(capsys, monkeypatch,
                                                                       tmp_path):
    """The whole path, made short (one round of one epoch): its figures mean nothing here,
    its structure is the demo's (tests/test_demo.py checks the verdicts)."""
    from nbtrain.tools import demo, demo_text
    monkeypatch.setenv("NBTRAIN_HOME", str(tmp_path))   # a store of its own, to see it empty
    monkeypatch.setattr(demo_text, "load_now", lambda: 99.0)
    result = demo.run_demo(epochs=1, max_rounds=1, min_rounds=1, own_loop_epochs=1,
                           own_loop_rounds=1)
    out = capsys.readouterr().out
    assert result.finished and result.rounds == 1 and len(result.rows) == 5
    timed = [row for row in result.rows if row.same_as is None]
    assert all(len(row.runs) == 1 for row in timed)          # one timing run a round
    assert all(row.runs == [] for row in result.rows if row.same_as is not None)
    assert all(row.first.summary()["steps"] == 23 for row in result.rows)   # one epoch
    labels = [line.label for line in result.lines]
    assert labels == ["plain loop"] + [t.label for t in demo.CPU_TOGGLES]
    table = out[out.index("samples/s"):]
    assert all(label in table for label in labels) and "the machine is busy" in out
    assert "what each row's toggle resolved to, and why:" in out
    assert "num_threads=" in out and "optimizer_impl=fused" in out
    assert "your own loop, the same CNN" in out and "under nt.watch()" in out
    assert result.own_loop["state"] == "finished"
    assert len(nbtrain.runs()) == 0   # its runs are the table's measurements: none stored
