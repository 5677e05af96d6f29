"""run.host_reads(): the lines of the user's code that read tensors to the host, counted by
nt.watch over the loop's first steps (watcher/records.py), named in the diagnosis and
the summary, live, at the end and after nt.load_run."""
from __future__ import annotations

import contextlib
import sqlite3

import pytest
import torch
from IPython.core.interactiveshell import InteractiveShell
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import nbtrain as nt
from nbtrain.watcher.records import COPIES, READS, READS_COUNTED_FOR, SHOWN

QUIET = dict(optimize=False, progress=False, count_flops=False, log_every=10)
SOURCE = open(__file__).read().splitlines()


def line_of(marker: str) -> int:
    """The line of this file that carries `marker` in a comment."""
    (found,) = [n for n, text in enumerate(SOURCE, 1) if text.rstrip().endswith(f"# {marker}")]
    return found


def where(marker: str) -> str:
    return f"{__file__}:{line_of(marker)}"


def loader(steps: int = 60) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(steps * 8, 16, generator=g), torch.randint(0, 4, (steps * 8,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def model_and_opt():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def trained():
    """Each step's loss, after its update: the tutorial's step, read by the tests' loops."""
    model, opt = model_and_opt()
    for xb, yb in loader():
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        yield loss


def the_loop(run, seen=None, own=None):
    """loss.item() every step, print(loss) every 10, a CPU index's item() every step;
    `seen`: run.host_reads() at steps 5 and 40; `own`: nbtrain's own code reads too."""
    losses, index = [], torch.arange(4)
    for step, loss in enumerate(trained()):
        losses.append(loss.item())   # reads: item
        if step % 10 == 0:
            print(loss)   # reads: print
        index[torch.tensor(step % 4)].item()   # a CPU index's item(): no host read
        if own is not None:
            with own:
                loss.item()   # nbtrain's own
        if seen is not None and step in (5, 40):
            seen[step] = run.host_reads()
        del loss   # not kept into the next step (the watch would say so: a graph kept)
    return losses


def test_each_line_that_reads_is_a_row_the_most_first(capsys):
    seen = {}
    with nt.watch(**QUIET) as run:
        the_loop(run, seen)
    rows = run.host_reads()
    assert [row.where for row in rows] == [where("reads: item"), where("reads: print")]
    assert rows[0].code == "losses.append(loss.item())   # reads: item"
    assert rows[1].code == "print(loss)   # reads: print"
    assert rows[0].per_step == pytest.approx(1.0) and rows[1].per_step == pytest.approx(0.1)
    assert rows.worst == rows[0] and "counted over steps 11-30" in rows.note
    assert "tensor(" in capsys.readouterr().out   # the loop's print printed as written
    # live: words before the table is counted, the table from step 30 on
    assert list(seen[5]) == [] and seen[5].note.startswith("not counted yet")
    assert list(seen[40]) == list(rows)


def test_nbtrains_own_reads_are_not_counted():
    watch = nt.watch(**QUIET)
    with watch as run:   # the own-code flag nbtrain's records set around their reads
        the_loop(run, own=watch._watcher.edge.own)
    assert [row.where for row in run.host_reads()] == [where("reads: item"),
                                                       where("reads: print")]


def test_float_format_and_a_read_through_a_frame_in_a_folder_named_nbtrain():
    # a loop whose file lives in a folder named nbtrain is still the user's code
    elsewhere = compile("def read(t):\n    return t.tolist()\n", "/checkout/nbtrain/loop.py",
                        "exec")
    space = {}
    exec(elsewhere, space)
    with nt.watch(**QUIET) as run:
        for loss in trained():
            text = f"{loss:.3f} {float(loss)}"   # reads: format and float
            space["read"](loss)
    rows = {row.where: row.per_step for row in run.host_reads()}
    assert rows == {where("reads: format and float"): pytest.approx(2.0),
                    "/checkout/nbtrain/loop.py:2": pytest.approx(1.0)}
    assert text


def test_the_patches_are_torchs_own_again_after_the_watch():
    names = (*READS, *SHOWN, *COPIES)
    before = {name: (getattr(torch.Tensor, name), name in torch.Tensor.__dict__) for name in names}
    during = {}
    with nt.watch(**QUIET) as run:
        for step, _ in enumerate(trained()):
            during[step] = [getattr(torch.Tensor, name) is before[name][0] for name in names]
    assert during[5] == [False] * len(names)   # counted over the first steps
    assert during[READS_COUNTED_FOR + 5] == [True] * len(names)
    assert {name: (getattr(torch.Tensor, name), name in torch.Tensor.__dict__)
            for name in names} == before
    assert list(run.host_reads()) == [] and run.host_reads().note.startswith("none:")


def test_the_diagnosis_and_the_summary_name_the_worst_line_and_its_replacement(capsys):
    with nt.watch(**QUIET) as run:
        the_loop(run)
    text = run.summary_text()
    line = f"{where('reads: item')}: losses.append(loss.item())"
    assert f"host reads          1.1 a step; the most at {line}" in text
    diagnosis = run.summary()["diagnosis"]
    assert f"reads tensors back to the host 1.1x per step, the most at {line}" in diagnosis
    assert "total += loss.detach(), then total.item() every log_every steps" in diagnosis
    assert f"the most at {line}" in run.records("train")[-1]["diagnosis"]   # live, too


CELL = """with nt.watch(**QUIET) as run:
    for loss in trained():
        seen = loss.item()
"""


def test_a_loop_in_a_notebook_cell_names_the_cell():
    shell = InteractiveShell.instance()
    shell.push({"nt": nt, "QUIET": QUIET, "trained": trained})
    number = shell.execution_count
    result = shell.run_cell(CELL, store_history=True)
    assert result.success, result.error_in_exec
    (row,) = shell.user_ns["run"].host_reads()
    assert (row.where, row.code) == (f"cell {number}, line 3", "seen = loss.item()")
    for name in ("run", "loss", "seen", "nt", "QUIET", "trained"):
        shell.user_ns.pop(name, None)


def test_a_stored_watch_gives_its_table_back_or_says_why_not(tmp_path, capsys):
    db = tmp_path / "runs.sqlite"
    with nt.watch(store=str(db), **QUIET) as run:
        the_loop(run)
    loaded = nt.load_run(run.id, store=db)
    assert list(loaded.host_reads()) == list(run.host_reads())
    assert loaded.host_reads().note == run.host_reads().note
    assert loaded.summary_text() == run.summary_text()
    # a run stored without the table (an earlier nbtrain): words, not an empty table
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        gone = conn.execute("DELETE FROM records WHERE record LIKE ?", ('%"kind":"host_reads"%',))
    assert gone.rowcount == 1
    older = nt.load_run(run.id, store=db).host_reads()
    assert list(older) == [] and older.note.startswith("not known:")
    assert repr(older) == older.note


def test_under_fit_the_table_says_why_it_is_empty():
    model, _ = model_and_opt()
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
    run = nt.fit(model, data, F.cross_entropy, progress=False,
                 config=nt.TrainConfig(max_steps=4, batch_size=16, device="cpu", amp="off",
                                       store=False))
    reads = run.host_reads()
    assert list(reads) == [] and reads.note.startswith("not counted under nt.fit")
