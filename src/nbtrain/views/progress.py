"""A progress bar fed by a Run's records: a notebook widget or a terminal line (tqdm.auto)."""
from __future__ import annotations

import contextlib
import threading

SETUP_LINE_AFTER_S = 1.0   # a setup quicker than this shows no line
SETUP_LINE_EVERY_S = 0.25


@contextlib.contextmanager
def setup_line(run, after_s: float = SETUP_LINE_AFTER_S):
    """While the block runs (fit's setup): after `after_s`, a line with what the setup
    measures ("nbtrain: measuring threads and workers ... 2s"), gone when the block ends,
    however it ends. A thread that sleeps between redraws: the probes it waits on time
    steps of tens of milliseconds, a redraw takes microseconds."""
    done = threading.Event()
    thread = threading.Thread(target=_show_setup, args=(run, done, after_s),
                              name="nbtrain-setup-line", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _show_setup(run, done: threading.Event, after_s: float) -> None:
    from tqdm.auto import tqdm
    if done.wait(after_s):
        return
    line = tqdm(total=None, desc=_setup_text(run), bar_format="{desc} {elapsed}",
                leave=False, dynamic_ncols=True)
    line.start_t -= after_s   # its clock counts the setup from its start
    try:
        while not done.wait(SETUP_LINE_EVERY_S):
            line.set_description_str(_setup_text(run), refresh=True)
    finally:
        line.close()


def _setup_text(run) -> str:
    what = run.measuring
    return f"nbtrain: measuring {what} ..." if what else "nbtrain: setting up ..."


def attach_progress(run) -> None:
    """Show steps, loss and samples/s as records arrive; tqdm throttles the redraws."""
    from tqdm.auto import tqdm

    setup_s = run.resolved.get("setup_s", (0.0, ""))[0]   # what measuring took before step 1
    desc = f"nbtrain (setup {setup_s:.1f} s)" if setup_s >= 0.1 else "nbtrain"
    bar = tqdm(total=run.total_steps, initial=run.step, unit="step", desc=desc,
               dynamic_ncols=True, leave=True)

    def on_record(record: dict) -> None:
        if record["kind"] == "train":
            bar.update(record["step"] - bar.n)
            bar.set_postfix(loss=f"{record['loss']:.4g}",
                            samples_s=f"{record['samples_per_s']:,.0f}", refresh=False)
        elif record["kind"] == "end":
            bar.update(record["step"] - bar.n)
            bar.close()
            run.unsubscribe(on_record)

    run.subscribe(on_record)
