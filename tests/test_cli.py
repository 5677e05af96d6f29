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


BROKEN_SCRIPT = '''
import os
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
model = nn.Linear(6, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 6), torch.randn(64, 1)), batch_size=8)
for step, (x, y) in enumerate(loader):
    if step == 2 and os.environ["RANK"] == "1":
        raise ValueError("rank one broke")
    opt.zero_grad(); nn.functional.mse_loss(model(x), y).backward(); opt.step()
'''


def test_nbtrain_run_fails_with_the_ranks_traceback_when_a_rank_fails(tmp_path):
    """A failed rank fails the command (a non-zero status stops a shell script or a CI job),
    its traceback on stderr, the summary on stdout."""
    import subprocess
    import sys
    (tmp_path / "broken.py").write_text(BROKEN_SCRIPT)
    done = subprocess.run([sys.executable, "-m", "nbtrain", "run", "--processes", "2",
                           "broken.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "rank 1 of 2: Traceback" in done.stderr, done.stderr
    assert 'raise ValueError("rank one broke")' in done.stderr
    assert done.stderr.rstrip().endswith("ValueError: rank one broke")
    assert "state       failed" in done.stdout and "Traceback" not in done.stdout
