"""The run store (nbtrain.runstore.write) and the trackers (nbtrain.runstore.trackers): every run kept in
SQLite as it goes, listed and loaded after its process is gone; TensorBoard and MLflow
read back with their own libraries."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Optional

import pytest
import torch
from torch.nn import functional as F

import nbtrain as nt
from nbtrain.runstore import pending
from nbtrain.runstore import write as store
from conftest import mlp, quick

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def db(tmp_path):
    return tmp_path / "runs.sqlite"


def fit(blobs, db, **overrides):
    x, y = blobs
    return nt.fit(mlp(), (x, y), F.cross_entropy,
                  config=quick(**{"store": str(db), **overrides}), progress=False)


def plain(value):
    """A value as the store's JSON gives it back (tuples as lists, devices as text)."""
    return json.loads(json.dumps(value, default=str))


def same_run(loaded: nt.Run, live: nt.Run) -> None:
    assert loaded.id == live.id and loaded.kind == live.kind
    assert loaded.history == live.history
    assert loaded.records("val") == live.records("val")
    assert plain(loaded.resolved) == plain(live.resolved)
    assert (loaded.state, loaded.step, loaded.epoch, loaded.total_steps, loaded.message) == \
        (live.state, live.step, live.epoch, live.total_steps, live.message)
    assert loaded.wall_s == pytest.approx(live.wall_s)
    assert loaded.config.to_dict() == live.config.to_dict()
    assert loaded.summary_text() == live.summary_text()


# -- where ---------------------------------------------------------------------------------------
def test_the_suite_stores_under_its_own_home_never_in_the_users():
    home = Path(os.environ["NBTRAIN_HOME"])
    assert store.path_of(True) == home / "runs.sqlite"
    assert Path.home() / ".nbtrain" not in home.parents and home != Path.home() / ".nbtrain"
    assert store.path_of(False) is None


def test_a_relative_store_is_the_working_folder_of_the_runs_start(blobs, tmp_path, monkeypatch):
    """store="runs.sqlite" names the file in the folder the run started in, though the
    writer thread writes it later, after the program changed folder."""
    x, y = blobs
    (tmp_path / "started").mkdir()
    (tmp_path / "later").mkdir()
    monkeypatch.chdir(tmp_path / "started")
    run = nt.fit(mlp(), (x, y), F.cross_entropy, config=quick(max_steps=3, store="runs.sqlite"),
                 progress=False)
    monkeypatch.chdir(tmp_path / "later")
    store.flush_all()
    assert [r["id"] for r in nt.runs(store=tmp_path / "started" / "runs.sqlite")] == [run.id]
    assert list((tmp_path / "later").iterdir()) == []


def test_a_fit_is_stored_by_default_in_nbtrain_home(blobs):
    x, y = blobs
    run = nt.fit(mlp(), (x, y), F.cross_entropy, config=quick(max_steps=10), progress=False)
    assert run.id in nt.runs().ids
    assert nt.load_run(run.id).history == run.history


def test_store_false_keeps_a_run_out(blobs, db):
    fit(blobs, db, max_steps=5, name="first")
    run = fit(blobs, db, max_steps=5, store=False)
    assert run.id is not None and run.id not in nt.runs(store=db).ids
    assert len(nt.runs(store=db)) == 1


# -- stored, listed, loaded ------------------------------------------------------------------------
def test_a_fit_is_stored_listed_and_loaded_equal_to_the_live_run(blobs, db):
    x, y = blobs
    run = nt.fit(mlp(), (x, y), F.cross_entropy, config=quick(epochs=2, name="baseline",
                                                              store=str(db)),
                 val_data=(x[:64], y[:64]), progress=False)
    table = nt.runs(store=db)
    assert len(table) == 1
    row = table[0]
    assert (row["id"], row["name"], row["kind"], row["state"], row["steps"]) == \
        (run.id, "baseline", "fit", "finished", run.step)
    assert row["samples_per_s"] == pytest.approx(run.summary()["samples_per_s"])
    assert row["last_loss"] == pytest.approx(run.records()[-1]["loss"])
    assert (row["device"], row["amp"]) == ("cpu", "off")
    html = table._repr_html_()
    assert run.id in html and "baseline" in html and "<table>" in html
    assert run.id in repr(table)
    assert list(table.to_pandas()["id"]) == [run.id]
    loaded = nt.load_run(run.id, store=db)
    same_run(loaded, run)
    assert loaded.records("val")   # validation records too
    assert nt.load_run(run.id[-4:], store=db).id == run.id   # a unique part of the id


def test_a_watch_is_stored_listed_and_loaded_equal_to_the_live_run(blobs, db):
    x, y = blobs
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    with nt.watch(name="mine", store=str(db), log_every=4, progress=False) as run:
        for _ in range(2):
            for xb, yb in loader:
                opt.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                opt.step()
    assert run.state == "finished" and run.records()
    (row,) = nt.runs(store=db)
    assert (row["id"], row["name"], row["kind"], row["state"]) == (run.id, "mine", "watch",
                                                                  "finished")
    same_run(nt.load_run(run.id, store=db), run)


SHORT_WATCH = textwrap.dedent("""
    import json, os, sys, torch, nbtrain as nt
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nt.watch(optimize=False, progress=False, log_every=1, store=sys.argv[1]) as run:
        for _ in range(20):
            opt.zero_grad(); model(torch.randn(8, 4)).pow(2).mean().backward(); opt.step()
    print(json.dumps([run.id, run.step, len(run.history), "sqlite3" in sys.modules]))
""")


def test_a_run_that_ends_within_its_first_second_never_loads_sqlite_and_is_listed_folded_in(db):
    """Its own pending file, beside the store, until a reader folds it in (~5 ms of a
    short program: SQLite's import, the file's opening and schema)."""
    done = subprocess.run([sys.executable, "-c", SHORT_WATCH, str(db)], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert done.returncode == 0, done.stderr
    run_id, steps, records, sqlite_loaded = json.loads(done.stdout.splitlines()[-1])
    assert (steps, sqlite_loaded) == (20, False)
    folder = pending.folder_of(db)
    assert [p.name for p in folder.iterdir()] == [f"{run_id}.json"] and not db.exists()
    (row,) = nt.runs(store=db)
    assert (row["id"], row["state"], row["steps"], row["records"]) == (run_id, "finished", 20, records)
    assert list(folder.iterdir()) == []
    loaded = nt.load_run(run_id, store=db)
    assert loaded.step == 20 and len(loaded.history) == records
    assert row["pid"] != os.getpid()   # the process that ran it, not the one that folded it


def test_a_pending_file_folded_twice_writes_each_row_once(blobs, db):
    """Two processes may fold one file (each reads it before the other removes it): the
    same rows again, nothing doubled."""
    def stored_records() -> int:
        with contextlib.closing(sqlite3.connect(db)) as conn:
            return conn.execute("SELECT COUNT(*) FROM records").fetchone()[0]

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with nt.watch(store=str(db), log_every=1, progress=False) as run:   # ~5 ms: a pending file
        for xb, yb in zip(blobs[0].split(32), blobs[1].split(32)):
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
    (path,) = pending.folder_of(db).iterdir()
    again = path.read_bytes()
    (row,) = nt.runs(store=db)
    once = stored_records()
    path.write_bytes(again)
    assert nt.runs(store=db).ids == [run.id] and list(pending.folder_of(db).iterdir()) == []
    assert stored_records() == once == len(run.history)   # every record once
    assert dict(nt.runs(store=db)[0]) == dict(row)
    same_run(nt.load_run(run.id, store=db), run)


@pytest.mark.skipif(sys.platform != "linux", reason="Linux's text")
def test_the_stored_machine_says_what_platform_says(blobs, db):
    """The writer builds the platform's text itself (platform.platform() reads the whole
    Python binary for its libc): the same text, on Linux."""
    import platform
    run = fit(blobs, db)
    loaded = nt.load_run(run.id, store=db)
    assert loaded.machine["platform"] == platform.platform()
    assert loaded.machine["python"] == platform.python_version()


def test_a_watch_named_through_its_config(blobs, db):
    x, y = blobs
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with nt.watch(nt.TrainConfig(name="cfg-named", store=str(db)), progress=False) as run:
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    assert run.config.name == "cfg-named"
    assert nt.runs(name="cfg-named", store=db).ids == [run.id]


def test_runs_filter_and_list_newest_first_and_delete(blobs, db):
    a = fit(blobs, db, max_steps=5, name="a")
    b = fit(blobs, db, max_steps=5, name="b")
    c = fit(blobs, db, max_steps=5, name="a")
    assert nt.runs(store=db).ids == [c.id, b.id, a.id]
    assert nt.runs(name="a", store=db).ids == [c.id, a.id]
    assert nt.runs(state="finished", kind="fit", store=db).ids == [c.id, b.id, a.id]
    assert nt.runs(state="failed", store=db).ids == []
    assert nt.delete_runs(b.id, store=db) == 1
    assert nt.delete_runs(name="a", store=db) == 2
    assert len(nt.runs(store=db)) == 0
    with sqlite3.connect(db) as conn:   # the records went with them
        assert conn.execute("SELECT COUNT(*) FROM records").fetchone() == (0,)
    with pytest.raises(ValueError, match="needs ids"):
        nt.delete_runs(store=db)
    with pytest.raises(KeyError, match="no stored run"):
        nt.load_run(a.id, store=db)


def test_discard_removes_a_run_from_the_store(blobs, db):
    keep, drop = fit(blobs, db, max_steps=5), fit(blobs, db, max_steps=5)
    assert drop.discard() is True and drop.discard() is False
    assert nt.runs(store=db).ids == [keep.id]
    assert drop.history   # the Run itself is unchanged


def test_compare_trials_are_marked_and_named(blobs, db):
    x, y = blobs
    nt.compare(mlp, (x, y), F.cross_entropy, configs={
        "sgd": quick(max_steps=5, optimizer="sgd", store=str(db)),
        "adamw": quick(max_steps=5, store=str(db))}, progress=False)
    trials = nt.runs(kind="trial", store=db)
    assert {row["name"] for row in trials} == {"adamw", "sgd"}   # a warm-up run included
    assert len(nt.runs(kind="fit", store=db)) == 0


def test_a_long_history_loads_as_the_live_run_kept_it(blobs, db):
    run = fit(blobs, db, epochs=4, log_every=1, history_limit=10)
    loaded = nt.load_run(run.id, store=db)
    assert loaded.history == run.history and len(run.history) <= 11
    with sqlite3.connect(db) as conn:   # the store keeps every record
        (n,) = conn.execute("SELECT COUNT(*) FROM records WHERE run_id = ?", (run.id,)).fetchone()
    assert n == run.step + 1   # a record a step, and the run's gaps at its end


def test_a_long_run_loads_every_stored_record_with_records_all(blobs, db):
    """history_limit bounds the live run's memory; the store keeps every record, and
    records="all" gives them all back, not merged, whatever the limit was."""
    run = fit(blobs, db, epochs=4, log_every=1, history_limit=10)
    every = nt.load_run(run.id, store=db, records="all")
    assert [r["step"] for r in every.records()] == list(range(1, run.step + 1))
    assert all(r["steps"] == 1 for r in every.records())   # none merged
    assert len(run.history) <= 10 < len(every.history)
    assert nt.load_run(run.id, store=db, records="kept").history == run.history
    assert every.summary()["samples"] == run.summary()["samples"]
    assert (every.state, every.step, every.total_steps) == (run.state, run.step, run.total_steps)


def test_load_run_names_what_records_takes(blobs, db):
    run = fit(blobs, db, max_steps=5)
    with pytest.raises(ValueError, match=r"records='every'\): records is 'kept' .* or 'all'"):
        nt.load_run(run.id, store=db, records="every")


# -- views of a loaded run -------------------------------------------------------------------------
def test_a_loaded_run_draws_its_dashboard_and_writes_its_report(blobs, db, tmp_path):
    pytest.importorskip("plotly")
    pytest.importorskip("ipywidgets")
    run = fit(blobs, db, epochs=2)
    loaded = nt.load_run(run.id, store=db)
    dash = nt.Dashboard(loaded, show=False, live="static")
    dash.flush()
    assert dash.trace("run 1", "loss").x[-1] == run.step
    assert "finished" in dash.table.value and f"{run.step}/{run.total_steps}" in dash.table.value
    dash.close()
    page = Path(loaded.report(tmp_path / "loaded.html")).read_text()
    assert "finished" in page and "samples/s" in page


def test_the_dashboard_of_a_long_stored_run_thins_only_for_drawing(blobs, db):
    """Every record loaded (records="all"): the charts draw at most max_points of them,
    evenly over the steps and ending at the last, and the runs table counts them all."""
    pytest.importorskip("plotly")
    pytest.importorskip("ipywidgets")
    from nbtrain.views.series import MAX_POINTS
    run = fit(blobs, db, max_steps=2 * MAX_POINTS, log_every=1, history_limit=50)
    every = nt.load_run(run.id, store=db, records="all")
    dash = nt.Dashboard(every, show=False, live="static")
    dash.flush()
    steps = list(dash.trace("run 1", "loss").x)
    assert len(steps) <= MAX_POINTS and (steps[0], steps[-1]) == (1, run.step)
    assert len(set(b - a for a, b in zip(steps, steps[1:-1]))) == 1   # evenly spaced
    (slot,) = dash.slots
    assert slot.samples == sum(r["samples"] for r in every.records()) == run.summary()["samples"]
    dash.close()


# -- a process that dies ---------------------------------------------------------------------------
CHILD = textwrap.dedent("""
    import json, sys, torch, nbtrain as nt
    from torch import nn
    from torch.nn import functional as F
    path, name, steps, runs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    limit = {"history_limit": int(sys.argv[5])} if len(sys.argv) > 5 else {}
    torch.manual_seed(0)
    x, y = torch.randn(256, 8), torch.randint(0, 3, (256,))
    kept = {}
    for _ in range(runs):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        cfg = nt.TrainConfig(max_steps=steps, device="cpu", amp="off", batch_size=32,
                             log_every=1, num_workers=0, num_threads=1, store=path, name=name,
                             **limit)
        run = nt.fit(model, (x, y), F.cross_entropy, config=cfg, progress=False)
        kept[run.id] = len(run.history)
    print(json.dumps(kept))
""")


def child(db, name: str, steps: int, runs: int = 1, history_limit: Optional[int] = None,
          **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    limit = [] if history_limit is None else [str(history_limit)]
    return subprocess.Popen([sys.executable, "-c", CHILD, str(db), name, str(steps), str(runs),
                             *limit], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kwargs)


def test_a_fit_killed_mid_run_is_listed_as_crashed_with_its_records(db):
    """Its history merged past history_limit from the 11th record on, on any machine:
    records="all" gives every step up to the last commit, however far it ran."""
    proc = child(db, "doomed", 10**7, history_limit=10)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            rows = nt.runs(store=db) if db.exists() else []
            if rows and (rows[0]["records"] or 0) >= 20:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the child stored no records: " + proc.stderr.read() if proc.poll() else "")
        assert rows[0]["state"] == "running"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    (row,) = nt.runs(store=db)
    assert row["state"] == "crashed" and row["name"] == "doomed"
    assert nt.runs(state="crashed", store=db).ids == [row["id"]]
    assert nt.runs(state="running", store=db).ids == []
    run = nt.load_run(row["id"], store=db, records="all")
    assert run.state == "crashed" and len(run.records()) >= 20
    steps = [r["step"] for r in run.records()]
    assert steps == list(range(1, len(steps) + 1))   # every step up to the last commit
    assert len(nt.load_run(row["id"], store=db).history) <= 10   # as the live run kept it
    assert run.step == steps[-1] and "last record" in run.message and str(row["pid"]) in run.message
    assert row["last_record"] is not None and time.time() - row["last_record"] < 60
    print(run.summary_text())   # a crashed run's summary works too


def test_two_processes_writing_one_store_keep_every_record(db):
    procs = [child(db, name, 150, runs=3) for name in ("left", "right")]
    kept = {}
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        assert "cannot be written" not in err, err
        kept.update(json.loads(out.strip().splitlines()[-1]))
    assert len(kept) == 6
    table = nt.runs(store=db)
    assert sorted(table.ids) == sorted(kept)
    for row in table:
        assert row["state"] == "finished" and row["steps"] == 150
        # a record a step, the run's gaps at its end, and its modules window (steps 21-23)
        assert len(nt.load_run(row["id"], store=db).history) == kept[row["id"]] == 150 + 2


# -- bad files never stop training -------------------------------------------------------------------
def store_warnings(caught, db) -> list:
    return [w for w in caught if str(db) in str(w.message)]


def test_a_corrupted_store_trains_on_with_one_warning(blobs, db):
    junk = b"this is not a database, it was overwritten " * 200
    db.write_bytes(junk)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = fit(blobs, db, epochs=2)
    assert run.state == "finished" and run.step > 0
    (warning,) = store_warnings(caught, db)
    assert "not a readable SQLite database" in str(warning.message)
    assert "mv " in str(warning.message) and "store=False" in str(warning.message)
    assert db.read_bytes() == junk   # left as it was
    with pytest.raises(RuntimeError, match="cannot read the run store"):
        nt.runs(store=db)


READ_ONLY_CHILD = textwrap.dedent("""
    import sys, torch, warnings, nbtrain as nt
    from torch import nn
    from torch.nn import functional as F
    warnings.simplefilter("always")
    x, y = torch.randn(256, 8), torch.randint(0, 3, (256,))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    cfg = nt.TrainConfig(epochs=2, device="cpu", amp="off", batch_size=32, log_every=1,
                         num_workers=0, num_threads=1, store=sys.argv[1])
    run = nt.fit(model, (x, y), F.cross_entropy, config=cfg, progress=False)
    print(run.state, run.step)
""")


def test_a_read_only_store_trains_on_with_one_warning(blobs, db):
    fit(blobs, db, max_steps=5, name="before")   # a good store, then made read-only
    assert len(nt.runs(store=db)) == 1   # the short run folded in from its pending file
    for path in db.parent.iterdir():
        path.chmod(0o444)
    db.parent.chmod(0o555)
    command = [sys.executable, "-c", READ_ONLY_CHILD, str(db)]
    if os.geteuid() == 0:   # root writes anything: drop the capabilities that let it
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: a read-only file is writable")
        command = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner",
                   *command]
    try:
        done = subprocess.run(command, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
                              capture_output=True, text=True, timeout=300)
    finally:
        db.parent.chmod(0o755)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2:] == ["finished", "16"]
    assert done.stderr.count(f"the run store {db} cannot be written") == 1, done.stderr
    assert "read-only" in done.stderr
    assert nt.runs(store=db)[0]["name"] == "before" and len(nt.runs(store=db)) == 1


# -- settings --------------------------------------------------------------------------------------
@pytest.mark.parametrize("values, words", [
    (dict(store="off"), "not the text 'off'"),
    (dict(store=""), "not empty"),
    (dict(store=3), "False (not stored)"),
    (dict(name=""), "a name"),
    (dict(report_to="tensorbord"), "did you mean 'tensorboard'"),
    (dict(report_to=("mlflow", "mlflow")), "a tuple of several"),
    (dict(report_dir=""), "not empty"),
])
def test_bad_keeping_settings_are_config_errors(values, words):
    with pytest.raises(nt.ConfigError, match="TrainConfig." + next(iter(values))) as err:
        nt.TrainConfig(**values)
    assert words in str(err.value)
    assert err.value.field == next(iter(values))


def test_report_to_takes_one_or_both_names():
    assert nt.TrainConfig(report_to=["tensorboard", "mlflow"]).report_to == ("tensorboard",
                                                                            "mlflow")
    assert nt.TrainConfig(report_to=("mlflow",)).report_to == "mlflow"
    assert nt.TrainConfig(store="elsewhere.sqlite").store == "elsewhere.sqlite"


@pytest.mark.parametrize("name", ["tensorboard", "mlflow"])
def test_a_missing_tracker_library_names_its_extra(blobs, db, monkeypatch, name):
    from nbtrain.runstore import trackers
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec",
                        lambda module, *a: None if module == name else real(module, *a))
    with pytest.raises(nt.ConfigError, match=rf"pip install 'nbtrain\[{name}\]'") as err:
        fit(blobs, db, max_steps=5, report_to=name)
    assert err.value.field == "report_to"
    assert not db.exists()   # refused before anything ran


# -- TensorBoard and MLflow, read back with their own libraries ---------------------------------------
def test_tensorboard_event_files_read_back_with_event_accumulator(blobs, db, tmp_path):
    pytest.importorskip("tensorboard", reason="pip install 'nbtrain[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    x, y = blobs
    run = nt.fit(mlp(), (x, y), F.cross_entropy, val_data=(x[:64], y[:64]), progress=False,
                 config=quick(epochs=2, name="tb", store=str(db), report_to="tensorboard",
                              report_dir=str(tmp_path / "tb")))
    log_dir = tmp_path / "tb" / f"tb-{run.id}"
    events = EventAccumulator(str(log_dir))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/samples_per_s", "train/step_time_s",
            "train/data_wait_s", "val/val_loss"} <= set(tags)
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [r["step"] for r in run.records()]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in run.records()], rel=1e-6)
    assert "settings" in "".join(events.Tags()["tensors"])   # the text of the settings


def test_an_mlflow_run_read_back_with_mlflow_client(blobs, db, tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="pip install 'nbtrain[mlflow]'")
    from mlflow import MlflowClient
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)   # artifacts, if any, land here
    x, y = blobs
    run = nt.fit(mlp(), (x, y), F.cross_entropy, val_data=(x[:64], y[:64]), progress=False,
                 config=quick(epochs=2, name="ml", store=str(db), report_to="mlflow"))
    client = MlflowClient(tracking_uri=uri)
    (found,) = client.search_runs(["0"])
    assert found.info.run_name == "ml" and found.info.status == "FINISHED"
    assert found.data.tags["nbtrain.id"] == run.id and found.data.tags["nbtrain.state"] == "finished"
    assert found.data.params["lr"] == "0.01" and found.data.params["used.amp"] == "off"
    assert "why.amp" in found.data.params
    history = client.get_metric_history(found.info.run_id, "loss")
    assert sorted(m.step for m in history) == [r["step"] for r in run.records()]
    assert {"samples_per_s", "lr", "step_time_s", "val_loss"} <= set(found.data.metrics)


def test_a_tracker_that_fails_gives_one_warning_and_the_run_trains_on(blobs, db, monkeypatch):
    pytest.importorskip("tensorboard", reason="pip install 'nbtrain[tensorboard]'")
    from nbtrain.runstore import trackers

    class Broken(trackers.TensorBoardSink):
        def records(self, records):
            raise OSError("disk gone")
    monkeypatch.setitem(trackers.SINKS, "tensorboard", Broken)
    monkeypatch.chdir(db.parent)   # report_dir="runs": here, not in the repository
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = fit(blobs, db, epochs=2, report_to="tensorboard")
    assert run.state == "finished"
    (warning,) = [w for w in caught if "report_to" in str(w.message)]
    assert "disk gone" in str(warning.message)


# -- the other engines ---------------------------------------------------------------------------
def test_a_run_of_two_processes_is_stored_from_the_notebooks_run(blobs, db):
    x, y = blobs
    run = nt.fit(mlp(), (x, y), F.cross_entropy, progress=False,
                 config=quick(processes=2, max_steps=20, store=str(db), name="ranks"))
    assert run.state == "finished"
    (row,) = nt.runs(store=db)
    assert (row["name"], row["steps"], row["state"]) == ("ranks", 20, "finished")
    same_run(nt.load_run(run.id, store=db), run)
