"""Loader workers and training threads for a CPU run, chosen by measuring them.

No rule ("a worker per spare core; training keeps the other cores") beats the plain loop
on every model and machine (docs/guide/measured.md, "Workers and threads"), so "auto"
times the candidate (workers, threads) pairs on the run's first batches, like the bf16
probe, and keeps the fastest. Measured once per
model, data (what it is, not which object holds it) and machine, and again when the
machine's load has changed a lot; never for longer than a small share of the run.
"""
from __future__ import annotations

import contextlib
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch
from torch.utils.data import DataLoader

from ..data import loader_batches, shippable, unwrapped, worker_settings
from ..data.batches import (
    LoaderBatches,
    TensorBatches,
    length_of,
    signature_of,
    stop_workers,
    workers_collect_none_of_ours,
)
from ..machine import available_cores, load_moved, load_now
from . import budget
from .devices import autocast_context
from .losses import outputs_and_loss
from .memory import leaves_no_trace

Pair = Tuple[int, int]   # (loader workers, training threads)

BUDGET_S = 1.5       # timed steps of all pairs together; worker start-up comes on top
MAX_PROBE_S = 5.0    # a model whose steps would make the probe longer keeps the rules
ROUNDS = 3           # interleaved, median: other processes on the cores slow every pair alike
PROBE_BATCHES = 8    # the first batches of epoch 0, cycled
# Another pair must beat the plain loop's (0 workers, torch's threads) by 5%: two probes
# of the same pair on the shared 2-core machine differed by up to 4%.
MIN_GAIN = 1.05


@dataclass
class Measured:
    step_s: Dict[Pair, float]     # steady-state seconds per step (load + forward/backward)
    startup_s: Dict[int, float]   # starting that many workers, up to their first batch
    load: float                   # os.getloadavg()'s 1-minute figure while measuring
    planned: int = 0              # the steps of the run it was measured for
    untimed: str = ""             # why worker counts were not timed, when they were not
    rounds: Dict[Pair, List[float]] = field(default_factory=dict)   # each round's step_s


_MEASURED: Dict[tuple, Measured] = {}   # (model, data, machine, settings) -> Measured


def settle_workers_and_threads(run, setup, model, key):
    """Measure the candidate (workers, threads) pairs of a CPU run and record the fastest
    in run.resolved; returns the batches to train on: the loader rebuilt when the worker
    count changed. `key()`: what the step time depends on (the model's architecture and
    the batch shapes). The measuring takes at most budget.SHARE of the run it serves."""
    cfg, batches = run.config, setup.batches
    pairs = candidates(cfg, setup.device, batches)
    if len(pairs) < 2:
        return batches   # nothing to choose: the rules' values stand
    key = (key(), data_fingerprint(batches), tuple(pairs), setup.amp, cfg.prefetch_factor,
           cfg.multiprocessing_context, available_cores())
    planned = run.total_steps * cfg.grad_accum_steps   # batches the run will step on
    fewest = _fewest_steps(pairs)
    if planned * budget.SHARE < fewest and key not in _MEASURED:   # not even worth timing a step
        return _plain_loop_choice(run, batches, f"run too short to measure: {planned} steps "
                                  f"(measuring takes about {fewest}, more than "
                                  f"{budget.words()} of them)")
    try:
        found, cached = _measured(key, planned, lambda: measure(
            batches, cfg, pairs, _trial_step(setup), model, planned))
    except TooShort as short:   # the safe choice: loading as the plain loop loads
        return _plain_loop_choice(run, batches, str(short))
    except Exception as exc:   # the real first step reports a broken sample or model properly
        _keep_rules(run, batches, f"could not measure: {exc or type(exc).__name__}")
        return batches
    pairs = [p for p in pairs if p in found.step_s]   # a short run times threads only
    batches_per_start = _batches_per_worker_start(run, batches)
    (workers, threads), reasons = choose(found, pairs, batches_per_start, cached)
    if found.untimed:
        reasons["num_workers"] += f"; {found.untimed}"
    if isinstance(batches, LoaderBatches):
        run.resolved["num_workers"] = (workers, reasons["num_workers"])
        if workers != batches.loader.num_workers:
            batches = loader_batches(batches.dataset, cfg, workers, run.resolved["pin_memory"][0])
    run.resolved["num_threads"] = (threads, reasons["num_threads"])
    return batches


def _fewest_steps(pairs: List[Pair]) -> int:
    """The steps measuring the thread counts takes at the least: a warm-up, a step timed
    per end of the range, then ROUNDS rounds of two steps per count."""
    threads = [p for p in pairs if p[0] == 0]
    return 5 + ROUNDS * 2 * len(threads)


def _plain_loop_choice(run, batches, why: str):
    """Not measured: 0 workers (the plain loop's loading, which a worker's start-up
    cannot lose to), torch's threads; the batches to train on."""
    cfg = run.config
    if isinstance(batches, LoaderBatches) and cfg.num_workers == "auto":
        run.resolved["num_workers"] = (0, f"the plain loop's: loading in this process ({why})")
        if batches.loader.num_workers:
            batches = loader_batches(batches.dataset, cfg, 0, run.resolved["pin_memory"][0])
        if cfg.num_threads == "auto":
            run.resolved["num_threads"] = (torch.get_num_threads(), "torch's setting: no "
                                           "worker process shares the cores with training")
    else:
        _keep_rules(run, batches, why)
    return batches


def _keep_rules(run, batches, why: str) -> None:
    """No measurement: the rules' values stand, saying why."""
    for name in ("num_workers", "num_threads") if isinstance(batches, LoaderBatches) \
            else ("num_threads",):
        value, rule = run.resolved[name]
        run.resolved[name] = (value, f"{rule} ({why})")


def candidates(cfg, device: torch.device, batches) -> List[Pair]:
    """The pairs worth timing: workers only for a per-sample dataset with
    num_workers='auto' (tensors keep batched fetch, 0 workers); threads from torch's count
    down to half of it (with others busy on the cores fewer threads can win)."""
    if device.type != "cpu":
        return []
    if isinstance(batches, LoaderBatches) and cfg.num_workers == "auto":
        # beyond the cores only for loading that waits (I/O): the probe tells
        workers = [w for w in (0, 1, 2, 4, 8) if w <= max(2, min(8, available_cores()))]
    elif isinstance(batches, TensorBatches) and cfg.num_threads == "auto":
        workers = [0]
    else:
        return []
    top = torch.get_num_threads()

    def threads(w: int) -> List[int]:
        if cfg.num_threads != "auto":
            return [cfg.num_threads]
        return sorted({top, max(1, top - w), max(1, top // 2)}, reverse=True)
    return [(w, t) for w in workers for t in threads(w)]


def choose(found: Measured, pairs: List[Pair], batches_per_start: int,
           cached: bool = False) -> Tuple[Pair, Dict[str, str]]:
    """The fastest pair, worker start-up spread over the batches each start serves; the
    plain loop's pair unless the fastest beats it by MIN_GAIN, by the median and in every
    round (no other pair is tried in its place). With the reasons."""
    startup = {w: s / batches_per_start for w, s in found.startup_s.items()}
    cost = {p: found.step_s[p] + startup[p[0]] for p in pairs}
    plain = pairs[0]   # 0 workers, torch's thread count
    best = min(pairs, key=cost.get)
    if cost[plain] <= cost[best] * MIN_GAIN:
        best = plain
    split = _not_every_round(found, best, plain, startup[best[0]] - startup[plain[0]])
    if split:
        best = plain
    when = (f"load {found.load:.1f} on {available_cores()} cores"
            + (", measured earlier in this session" if cached else ""))
    by_workers = {}
    for p in pairs:   # each worker count at its best thread count
        if p[0] not in by_workers or cost[p] < cost[by_workers[p[0]]]:
            by_workers[p[0]] = p
    workers = ", ".join(f"{w}: {_ms(cost[p])}" for w, p in by_workers.items())
    threads = ", ".join(f"{t}: {_ms(cost[(w, t)])}" for w, t in pairs if w == best[0])
    start = (f"; a worker start ({_ms(found.startup_s[best[0]])}) is spread over "
             f"{batches_per_start} batches" if best[0] else "")
    kept = (f"; {split[3]} thread(s) with {split[2]} worker(s), fastest by the median, beat "
            f"the plain loop's by {MIN_GAIN:.2f}x in only {split[0]} of {split[1]} rounds: "
            "the plain loop's stay" if split else "")
    return best, {
        "num_workers": f"measured ms/step by workers {workers}{start}{kept} ({when})",
        "num_threads": f"measured ms/step by threads with {best[0]} worker(s) {threads}{kept} "
                       f"({when})"}


def _not_every_round(found: Measured, pair: Pair, plain: Pair, extra_s: float):
    """() where `pair` beat the plain loop's by MIN_GAIN in every round both were timed
    in (its `extra_s` of worker start-up a step added), else (rounds won, rounds compared,
    *pair); () too for a measurement without rounds, whose median then decides. One slow
    spell of a shared machine can make a median lie; every round rarely does."""
    ours, theirs = found.rounds.get(pair, []), found.rounds.get(plain, [])
    compared = min(len(ours), len(theirs))
    won = sum((o + extra_s) * MIN_GAIN < t for o, t in zip(ours, theirs))
    return () if pair == plain or won == compared else (won, compared, *pair)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


WORKER_START_S = 0.3    # about what starting a worker count costs (bench: 0.2-0.5 s on 2 cores)
WAITS_FOR_DATA = 0.25   # loading a batch that takes this share of a step: workers may pay


OVER_BUDGET = "timing them would cost more than"   # Measured.untimed: a longer run may afford them


class TooShort(Exception):
    """Measuring would not pay for itself in this run; the message says why."""


def measure(batches, cfg, pairs: List[Pair], step, model, planned: int = 10**9) -> Measured:
    """Time `step` on the first batches for each pair: workers started once per count
    (their start-up timed apart), pairs interleaved in ROUNDS, the median kept. Leaves
    no trace: gradients, buffers, RNGs and torch's thread count as they were.

    Bounded by the run it serves (`planned` batches): the first steps estimate the run's
    length, and the pairs measured cost at most budget.SHARE of it. Worker counts are
    timed only where loading a batch takes a real share of a step; a run too short for
    even the thread counts raises TooShort."""
    load = load_now()
    feeds, untimed = {}, ""
    try:
        with _nothing_changes(model):
            feeds[0] = Feed(batches, cfg, 0)
            step(feeds[0].next())   # a warm-up step: first-call allocations
            one_step = min(_time_pair(feeds[0], t, step, 1) for t in {pairs[0][1], pairs[-1][1]})
            if one_step * ROUNDS * len(pairs) * 2 > MAX_PROBE_S:
                raise TimeoutError(f"a step takes {_ms(one_step)}: too slow to probe")
            pairs, untimed = _affordable(pairs, feeds[0], one_step, planned)
            for w in sorted({w for w, _ in pairs} - {0}):
                feeds[w] = Feed(batches, cfg, w)
            reps = max(1, min(8, int(BUDGET_S / (ROUNDS * len(pairs) * one_step)) - 1))
            rounds = _timed_rounds(feeds, pairs, step, reps)
    finally:
        for feed in feeds.values():
            feed.close()
    return Measured({p: statistics.median(v) for p, v in rounds.items()},
                    {w: feed.startup_s for w, feed in feeds.items()}, load, planned, untimed,
                    rounds)


def _affordable(pairs: List[Pair], feed, one_step: float, planned: int) -> Tuple[List[Pair], str]:
    """The pairs worth their cost, and why worker counts among them were not kept ('' when
    they were, or there were none): the run's own time is about `planned` steps of
    `one_step`; worker counts only when loading a batch waits, and only when their
    start-up and steps fit the budget. Raises TooShort when nothing worth measuring fits."""
    allowed_s = budget.SHARE * planned * one_step
    start = time.perf_counter()
    feed.next()
    load_s = time.perf_counter() - start   # one batch loaded in this process
    threads = [p for p in pairs if p[0] == 0]

    def cost(chosen) -> float:   # measure's timed rounds are capped at BUDGET_S
        starts = len({w for w, _ in chosen} - {0})
        return min(BUDGET_S, ROUNDS * len(chosen) * 2 * one_step) + WORKER_START_S * starts
    waits = load_s >= WAITS_FOR_DATA * one_step
    if waits and cost(pairs) <= allowed_s:
        return pairs, ""
    if len(threads) > 1 and cost(threads) <= allowed_s:
        if len(threads) == len(pairs):
            return threads, ""
        return threads, (f"worker counts not timed: {OVER_BUDGET} {budget.words()} of this "
                         "run" if waits else
                         f"worker counts not timed: loading a batch takes {_ms(load_s)} of a "
                         f"{_ms(one_step)} step, so no worker would pay")
    if not waits and len(threads) < 2:
        raise TooShort(f"loading a batch takes {_ms(load_s)} of a {_ms(one_step)} step: no "
                       "worker would pay, nothing else to measure")
    share = cost(pairs if waits else threads) / max(planned * one_step, 1e-9)
    raise TooShort(f"run too short to measure: {planned} steps of about {_ms(one_step)} "
                   f"(measuring would cost about {share:.0%} of them)")


def _timed_rounds(feeds, pairs: List[Pair], step, reps: int) -> Dict[Pair, List[float]]:
    """Seconds per step of each pair in each of up to ROUNDS interleaved rounds (fewer
    when a round outlasts BUDGET_S: a busy machine must not stretch the probe)."""
    times = {p: [] for p in pairs}
    start = time.perf_counter()
    for r in range(ROUNDS):
        for w, t in pairs[r % len(pairs):] + pairs[:r % len(pairs)]:   # none always first
            best = min((min(v) for v in times.values() if v), default=float("inf"))
            times[(w, t)].append(_time_pair(feeds[w], t, step, reps, give_up_s=3 * best))
        if time.perf_counter() - start > BUDGET_S:
            break
    return times


def _time_pair(feed, threads: int, step, reps: int, give_up_s: float = float("inf")) -> float:
    """Seconds per step with `threads` on `feed`; a pair slower than `give_up_s` per step
    stops early: too many threads on busy cores can be many times slower than one."""
    torch.set_num_threads(threads)
    step(feed.next())   # untimed: the first op on a new thread count starts its threads
    feed.drain()        # what the workers loaded ahead meanwhile is no steady state
    # after the drain the workers load together: whole rounds of them, 2 at least
    steps = max(reps, 2 * feed.workers)
    steps += -steps % max(1, feed.workers)
    start = time.perf_counter()
    for done in range(1, steps + 1):
        step(feed.next())
        if time.perf_counter() - start > give_up_s * steps:
            break
    return (time.perf_counter() - start) / done


class Feed:
    """The first batches of epoch 0 over and over, loaded as the run would load them
    with `workers` processes; `startup_s`: starting them, up to their first batch."""

    def __init__(self, batches, cfg, workers: int):
        self.workers = workers
        self.ahead = workers * (cfg.prefetch_factor or 2)   # batches the workers load ahead
        self.iterator = None
        start = time.perf_counter()
        if isinstance(batches, TensorBatches):
            first = [b for _, b in zip(range(PROBE_BATCHES), batches.epoch(0))]
            self.iterator = _forever(first)
        else:
            plan = [batches.sample_indices(0, b) for b in range(min(PROBE_BATCHES, len(batches)))]
            dataset = unwrapped(batches.dataset)
            if workers:
                dataset = shippable(dataset, cfg.multiprocessing_context)
            loader = DataLoader(dataset, batch_sampler=_Forever(plan), num_workers=workers,
                                collate_fn=batches.loader.collate_fn, generator=torch.Generator(),
                                **worker_settings(cfg, workers))
            with workers_collect_none_of_ours():   # iter() forks the workers
                self.iterator = iter(loader)
        self.first = next(self.iterator)
        self.startup_s = time.perf_counter() - start if workers else 0.0

    def next(self):
        batch, self.first = self.first, None
        return next(self.iterator) if batch is None else batch

    def drain(self) -> None:
        for _ in range(self.ahead):
            self.next()

    def close(self) -> None:
        stop_workers(self.iterator)   # the sampler never ends: stop the workers now


class _Forever:
    """A batch sampler that repeats its plan: the probe takes what it needs."""

    def __init__(self, plan):
        self.plan = plan

    def __iter__(self):
        return _forever(self.plan)


def _forever(items):
    while True:
        yield from items


def _trial_step(setup):
    """One forward and backward of the run's model on a batch, under the run's precision."""
    def step(batch):
        with autocast_context(setup.amp, setup.device):
            _, loss = outputs_and_loss(setup.forward, setup.loss_fn, setup.move(batch))
        loss.backward()
    return step


@contextlib.contextmanager
def _nothing_changes(model):
    """leaves_no_trace, plus what a dataset's __getitem__ may draw from (Python's and
    numpy's RNG) and torch's thread count: a cached probe must leave the run the same."""
    threads, py_state = torch.get_num_threads(), random.getstate()
    numpy = sys.modules.get("numpy")
    np_state = numpy.random.get_state() if numpy is not None else None
    try:
        with leaves_no_trace(model):
            yield
    finally:
        torch.set_num_threads(threads)
        random.setstate(py_state)
        if np_state is not None:
            numpy.random.set_state(np_state)


def _measured(key: tuple, planned: int, measure_now) -> Tuple[Measured, bool]:
    """The cached measurement for `key` (True), or a new one (False) when there is none,
    the load has since changed by more than half the cores (at least 1), or it left the
    worker counts untimed for want of budget and this run is longer (it may afford them)."""
    found = _MEASURED.get(key)
    outgrown = found is not None and OVER_BUDGET in found.untimed \
        and planned > found.planned
    if found is not None and not outgrown and not load_moved(found.load):
        return found, True
    found = _MEASURED[key] = measure_now()
    return found, False


def data_fingerprint(batches) -> tuple:
    """What the step time depends on in the data, not which object holds it: a cell that
    builds the same Dataset again measures nothing again. The data's class, its length,
    one sample's structure (shapes and dtypes), and for data read from files their paths,
    sizes and modification times."""
    if isinstance(batches, TensorBatches):
        return ("tensors", tuple((tuple(t.shape), t.dtype) for t in batches.tensors))
    data = _data_of(batches)
    try:
        sample = signature_of(data[0])
    except Exception:   # an IterableDataset, or a sample that fails: the real step says so
        sample = None
    return (type(data).__module__, type(data).__qualname__, length_of(data), sample,
            _files_of(data))


def _files_of(data) -> tuple:
    """(path, size, mtime) of the files a dataset names in its usual attributes."""
    named = []
    for attr in ("path", "paths", "files", "root", "filename", "filenames"):
        value = getattr(data, attr, None)
        values = value if isinstance(value, (list, tuple)) else [value]
        named += [v for v in values[:1000] if isinstance(v, (str, os.PathLike))]
    out = []
    for path in named:
        try:
            stat = os.stat(path)
            out.append((os.fspath(path), stat.st_size, stat.st_mtime_ns))
        except OSError:
            out.append((os.fspath(path), None, None))
    return tuple(out)


def _data_of(batches):
    """The user's dataset, or the first of the tensors."""
    return batches.tensors[0] if isinstance(batches, TensorBatches) else unwrapped(batches.dataset)


def _batches_per_worker_start(run, batches) -> int:
    """Batches each start of the workers serves: every epoch restarts them unless they
    persist."""
    total = run.total_steps * run.config.grad_accum_steps
    return max(1, total if run.config.persistent_workers else min(len(batches), total))
