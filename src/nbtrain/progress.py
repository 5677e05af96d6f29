"""A progress bar fed by a Run's records: a notebook widget or a terminal line (tqdm.auto)."""
from __future__ import annotations


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
