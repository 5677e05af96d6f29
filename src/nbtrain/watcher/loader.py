"""What a watch sees of the loop's DataLoaders and what it changes there: the data wait
(the time inside their iterator), the epochs of the training loader, its samples, and with
optimize=True the batched fetch of a TensorDataset and worker processes for a per-sample
loader that waits for data. `DataLoader.__iter__` is wrapped for the watch only
(Watcher.install); the batches the loop gets are the ones its loader makes, in its order,
drawing what it draws from the RNG."""
from __future__ import annotations

import functools
import time
import weakref

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
    default_collate,
)

from ..auto import budget, frameworks
from ..data.batches import (
    batch_chunks,
    pinned_rows,
    stop_workers,
    workers_collect_none_of_ours,
)
from ..data.nested import batch_len
from ..machine import available_cores
from .edge import StopWatching
from .settings import AS_WRITTEN

WAITS_FOR_DATA = 0.25   # a quarter of an epoch waiting for data: worker processes may pay
WORKERS_KEPT = 1.10     # a trial epoch with workers is kept only this much faster per batch


class Loader:
    """The watch's part that wraps DataLoader.__iter__: it times the data wait, counts the
    training loader's epochs, batches and samples, and changes where batches come from
    (the batched fetch, workers). It hands the batches to the copies part and starts a
    FLOP count due (the measuring part) at a training batch."""

    def __init__(self, edge, copies, measure, between, ranks=None):
        self.edge, self.copies, self.measure, self.ranks = edge, copies, measure, ranks
        self.between = between          # between.py: an evaluation pass, an epoch's start
        self.training = None            # weakref to the loader the loop trains on
        self.collates_tensors = False   # the loop's DataLoader collates tensors sample by sample
        self._last_loader = None        # weakref to the loader iterated last (adopt)
        self._epoch_wait = None         # the share of the last whole epoch spent waiting for data
        self._epoch_s = 0.0             # how long that epoch took
        self._per_batch_s = None        # its time per batch, its first batch left out
        self._chosen_workers = None     # None: not decided yet; 0: none (or tried, and lost)
        self._worker_trial = None       # (workers, the epoch before's per batch) while tried
        self._other_samples = 0         # the last batch of another loader, until the first backward
        self._pass_started_at = 0       # the Run's step as the training loader's pass began
        self.epoch_owed = False         # a new loader's pass: an epoch at its first backward
        self._shadows = weakref.WeakKeyDictionary()           # your loader -> one with workers
        self._shadow_iterators = weakref.WeakKeyDictionary()  # your loader -> that one's iterator
        self._foreign = ()              # (framework, its own loader class), those loaded

    def install(self) -> None:
        patches = self.edge.patches
        patches.patch(DataLoader, "__iter__", self._wrap_iter)
        # a framework's own loader (fastai's) is timed and counted alike, and left as it is
        self._foreign = frameworks.loader_classes()
        for _, cls in self._foreign:
            patches.patch(cls, "__iter__", functools.partial(self._wrap_iter, foreign=True))
        patches.keep(self.stop_workers)   # undone first: before torch's iterator is back

    def _wrap_iter(self, original, foreign: bool = False):
        part, edge = self, self.edge

        def __iter__(loader):
            if edge.inside:
                return original(loader)
            batches = part._timed_batches(loader, original, foreign)
            if part._evaluates(loader):
                return part.between.timed_evaluation(batches)
            return batches
        return __iter__

    def _evaluates(self, loader) -> bool:
        """A pass over a loader other than the training one, between steps of a loop that
        has trained: an evaluation (before the first backward, any loader may turn out to
        be the training one: adopt)."""
        training = self.training() if self.training is not None else None
        tally = self.edge.tally
        return tally.trained and tally.at_boundary and training is not None \
            and training is not loader

    def _timed_batches(self, loader, original, foreign: bool):
        """The loader's batches, timed and counted; `foreign`: a framework's own loader,
        whose batches come as it makes them (nothing changed there)."""
        self._new_epoch(loader)
        edge, copies, measure, between = self.edge, self.copies, self.measure, self.between
        tally = edge.tally
        training = self.training() is loader
        if foreign:
            batches = iter(original(loader))
        else:
            with workers_collect_none_of_ours():   # iter() forks the workers
                batches = self.ranks.shard(loader) if self._sharded(loader, training) \
                    else iter(self._source(loader, original))
        if training and copies.ahead is not None and not foreign:
            batches = copies.copied_ahead(batches)
        clock = time.perf_counter   # locals: they run every batch
        stop_asked = edge.stop_asked
        epoch_start, waited, fetched, first_s = clock(), 0.0, 0, 0.0
        while True:
            if tally.at_boundary and stop_asked():   # Edge.stop_if_asked, inlined
                raise StopWatching()
            start = clock()
            try:
                batch = next(batches)
            except StopIteration:
                if training:   # a whole epoch: what it waited
                    tally.ran_out()
                    self._epoch_done(waited, clock() - epoch_start, fetched, first_s)
                return
            finally:
                wait = clock() - start
                if not fetched:   # a worker's start: left out of the per-batch figure
                    first_s = clock() - epoch_start
                    if training:   # the step starts with the pass, its iterator's start a gap
                        between.epoch_started(epoch_start, first_s)
                waited += wait
                edge.waited_s += wait
                interval = edge.interval
                if interval is not None:
                    interval.data_wait_s += wait
            fetched += 1
            if training:   # the samples of a step are its training batches' (a GAN's once)
                if tally.at_boundary:
                    between.step_starts(start)
                tally.batch(_batch_samples(batch))
                if edge.marks_steps:   # CUDA: the step's work starts with its batch
                    interval.step_starts()
                if measure.count is not None:
                    measure.step_starts()
                if copies.pending and not foreign:
                    batches = copies.follow(batch, batches, loader,
                                            edge.run.resolved["batched_fetch"][0])
            elif not tally.trained:   # another loader's batch may be the first one trained on
                self._other_samples = _batch_samples(batch)
            yield batch

    def _sharded(self, loader, training: bool) -> bool:
        """One rank of N: the passes that may train are split: the training loader's,
        and, until the loop has trained, any other; never one under no_grad (an
        evaluation, on every sample on every rank)."""
        return self.ranks is not None and torch.is_grad_enabled() and (
            training or not self.edge.tally.trained)

    def _source(self, loader, original):
        """Where this pass's batches come from: one index op per batch, the loader's
        batches loaded by worker processes, or the loader as it is."""
        if self._batched(loader):
            return self._fetch_batched(loader)
        workers = self._workers_for(loader)
        if not workers:
            return original(loader)
        shadow = self._shadows.get(loader)
        if shadow is None or shadow.num_workers != workers:
            ahead = self.copies.ahead
            pin = loader.pin_memory or ahead is not None and ahead.pin
            shadow = self._shadows[loader] = _served_by_workers(loader, workers,
                                                                self.edge.run.config, pin)
        elif loader in self._shadow_iterators:
            # kept workers reset their iterator without its base-seed draw: draw it as the
            # loader's own new iterator would, so the sampler's order stays the loader's
            torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
        self._shadow_iterators[loader] = iterator = original(shadow)   # torch's own iterator
        return iterator

    def _workers_for(self, loader) -> int:
        """Worker processes for the loop's per-sample loader: as asked, or, with "auto",
        once a whole epoch of the loop itself waited for data a real share of its time
        (measured on the loop's own steps: nothing is run to find out)."""
        run = self.edge.run
        cfg = run.config
        if not self.edge.plan.may("num_workers") or self.training() is not loader \
                or _batchable(loader) or isinstance(loader.dataset, IterableDataset) \
                or loader.batch_sampler is None:
            return 0
        if cfg.num_workers != "auto":
            run.resolved["num_workers"] = (cfg.num_workers, "asked for: your loader's batches "
                                           "loaded by that many worker(s), for the watch only")
            return cfg.num_workers
        if self._chosen_workers is None and self._epoch_wait is not None and not loader.num_workers:
            self._chosen_workers = self._choose_workers(self._epoch_wait)
        return self._chosen_workers or 0

    def _choose_workers(self, share: float):
        """Workers to try for the epoch starting now, 0 (never) or None (not yet): a trial
        epoch that loses costs about the data wait it was to hide and the workers' start,
        so it starts once that is at most the measuring budget of the time run so far."""
        cores = available_cores()
        if share < WAITS_FOR_DATA or cores < 2:
            return 0
        if self.measure.undecided():   # its trial would time both epochs: after it
            return None
        from ..auto.workers import WORKER_START_S   # loaded only where the loop waits
        run = self.edge.run
        workers, epoch = min(8, cores - 1), run.epoch   # fit's rule: training keeps a core
        risk_s = share * self._epoch_s + WORKER_START_S   # the wait to hide, the workers' start
        waited = f"the loop waited for data {share:.0%} of epoch {epoch}"
        if not self.measure.affords(risk_s, time.perf_counter()):
            run.resolved["num_workers"] = (0, (
                f"{waited}: {workers} worker(s) are tried for an epoch once what a trial that "
                f"loses could cost (that wait and the workers' start, {risk_s:.2f} s) is at "
                f"most {budget.words()} of the time run so far"))
            return None
        self._worker_trial = (workers, self._per_batch_s)
        run.resolved["num_workers"] = (workers, (
            f"{waited}: epoch {epoch + 1} is loaded by {workers} worker(s) (your loader's "
            f"sampler, generator and collate; for the watch only), kept if its batches come "
            f"{WORKERS_KEPT:.2f}x as fast"))
        return workers

    def _epoch_done(self, waited: float, elapsed: float, batches: int, first_s: float) -> None:
        """A whole epoch of the training loader: its data wait and time per batch; the
        verdict on the workers it was loaded by, when they were on trial."""
        self._epoch_wait = waited / max(elapsed, 1e-9)
        self._epoch_s = elapsed
        per_batch = (elapsed - first_s) / max(batches - 1, 1)
        if self._worker_trial is not None and self._per_batch_s is not None:
            self._judge_workers(per_batch)
        self._per_batch_s = per_batch

    def _judge_workers(self, per_batch: float) -> None:
        run = self.edge.run
        (workers, before), epoch = self._worker_trial, run.epoch + 1
        self._worker_trial = None
        gain = before / max(per_batch, 1e-12)
        if gain >= WORKERS_KEPT:
            run.resolved["num_workers"] = (workers, (
                f"{workers} worker(s) tried in epoch {epoch}: {gain:.2f}x the batches per "
                f"second of epoch {epoch - 1}, kept (your loader's sampler, generator and "
                "collate; for the watch only)"))
            return
        self._chosen_workers = 0
        self.stop_workers()
        run.resolved["num_workers"] = (0, (
            f"{workers} worker(s) tried in epoch {epoch}: {gain:.2f}x the batches per second "
            f"of epoch {epoch - 1}, not {WORKERS_KEPT:.2f}x: your loader as it is again "
            f"from epoch {epoch + 1}"))

    def stop_workers(self) -> None:
        for loader, iterator in list(self._shadow_iterators.items()):
            stop_workers(iterator, self._shadows.get(loader))
        self._shadows.clear()

    def _new_epoch(self, loader) -> None:
        """Each pass over the training loader starts an epoch. Until the loop's first
        backward, the training loader is the first one iterated (adopt checks it)."""
        if not self.edge.tally.trained:
            self._last_loader = weakref.ref(loader)
        if self.training is None:
            self.training = weakref.ref(loader)
            self._describe(loader)
        elif self.training() is loader:
            self._next_pass()
        elif self.training() is None:   # a loop that makes its loader each epoch
            self.training = weakref.ref(loader)
            self._describe(loader)
            self.epoch_owed = True

    def pay_owed_epoch(self) -> None:
        """A loader made anew starts an epoch at its pass's first backward, not at its
        first batch: a pass that trains nothing (skorch's predict after fit, a new loader
        iterated with gradients on) is no epoch."""
        self.epoch_owed = False
        self.edge.run.next_epoch()

    def _next_pass(self) -> None:
        """A new pass over the training loader: an epoch where the last pass made a step;
        else that pass was a look at a batch (a tutorial's `next(iter(loader))` before
        training), and its batches were no step's."""
        edge = self.edge
        if edge.run.step > self._pass_started_at:
            edge.run.next_epoch()
        else:
            edge.tally.looked_at()
        self._pass_started_at = edge.run.step

    def adopt(self) -> None:
        """At the loop's first backward: the loader whose batch it trains on is the one
        iterated last (a loop that evaluates on its test loader first trains on another)."""
        last = self._last_loader() if self._last_loader is not None else None
        self._last_loader = None
        if last is None or self.training is None or self.training() is last:
            return
        self.training = weakref.ref(last)
        self._describe(last)
        # the first loader's batches were no step's
        self.edge.tally.other_loader(self._other_samples)

    def _describe(self, loader) -> None:
        self._epoch_wait = self._per_batch_s = self._worker_trial = None   # another loader's
        self._epoch_s = 0.0
        edge = self.edge
        resolved, cfg = edge.run.resolved, edge.run.config
        framework = next((f for f, cls in self._foreign if isinstance(loader, cls)), None)
        if framework is not None:
            self._describe_foreign(loader, framework)
            return
        resolved["num_workers"] = (loader.num_workers, AS_WRITTEN)
        self.copies.describe(loader)
        why_not, refused = _why_not_batchable(loader), edge.plan.why_not("batched_fetch")
        possible = not why_not
        if cfg.batched_fetch is True and not possible:
            why = "not possible for this DataLoader: " + why_not
        else:
            why = refused or why_not or (
                "a TensorDataset with the default collate: one index op per batch instead "
                "of a __getitem__ per sample, the same batches in the same order")
        resolved["batched_fetch"] = (possible and not refused, why)
        self.collates_tensors = possible and not resolved["batched_fetch"][0]

    def _describe_foreign(self, loader, framework) -> None:
        """A framework's own loader: its settings as they are, for its own knobs."""
        resolved = self.edge.run.resolved
        resolved["num_workers"] = (frameworks.loader_workers(framework, loader), AS_WRITTEN)
        resolved["batched_fetch"] = (False, f"{framework.name}'s own DataLoader: its "
                                     "batches as it makes them")
        self.copies.describe(loader)
        if self.copies.pending:
            self.copies.none(f"{framework.name}'s own DataLoader moves its batches itself")
        self.collates_tensors = False

    def _batched(self, loader) -> bool:
        return self.training() is loader and self.edge.run.resolved["batched_fetch"][0]

    def _fetch_batched(self, loader):
        """The DataLoader's batches, each with one index op per tensor: what its own
        iterator makes (default_collate of a TensorDataset's rows: a list of stacked
        tensors), drawing the same numbers from its RNG (the iterator's base seed, then
        its sampler's order), so the batches and the RNG after them are the loader's own."""
        torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
        tensors = loader.dataset.tensors
        pin = loader.pin_memory and torch.cuda.is_available()
        for index in _batch_indices(loader):
            if pin or self.copies.pin:
                yield [pinned_rows(t, index) for t in tensors]
            else:
                yield [t.index_select(0, index) for t in tensors]   # = t[index], at half its cost


def samples_in(args, kwargs, batch_dim: int = 0) -> int:
    """Samples in a forward's arguments (`model(x)`, `model(batch)`, `model(**batch)`);
    `batch_dim` 1: a sequence-first model's (seq, batch, ...) input."""
    if batch_dim and args and isinstance(args[0], torch.Tensor) and args[0].dim() > 1:
        return args[0].shape[batch_dim]
    return _batch_samples(args if args else dict(kwargs))


def batch_dim_of(model) -> int:
    """1 for a sequence-first model (an nn.LSTM, GRU, Transformer or attention layer of
    it with batch_first=False, torch's default), else 0."""
    sequence_first = (torch.nn.RNNBase, torch.nn.Transformer, torch.nn.TransformerEncoderLayer,
                      torch.nn.TransformerDecoderLayer, torch.nn.MultiheadAttention)
    return int(any(isinstance(m, sequence_first) and not m.batch_first for m in model.modules()))


def _batch_samples(batch) -> int:
    """Samples in a batch (a loader's, or a forward's arguments): its first element's
    length when that is a tensor, the common case, cheaply; else batch_len's answer."""
    first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if isinstance(first, torch.Tensor) and first.shape:   # not 0-dim
        return first.shape[0]
    try:
        return batch_len(batch)
    except Exception:
        return 0


def _served_by_workers(loader, workers: int, cfg, pin: bool) -> DataLoader:
    """A DataLoader that loads `loader`'s batches with `workers` processes: its batch
    sampler (so the same batches in the same order), generator, collate and worker init;
    pinned (in its pin thread) where `pin`; workers kept across epochs."""
    from ..data.sources import shippable   # nt.fit's data path: loaded where workers are tried
    dataset = shippable(loader.dataset, cfg.multiprocessing_context)
    return DataLoader(dataset, batch_sampler=loader.batch_sampler, num_workers=workers,
                      collate_fn=loader.collate_fn, pin_memory=pin,
                      generator=loader.generator, worker_init_fn=loader.worker_init_fn,
                      timeout=loader.timeout, persistent_workers=True,
                      prefetch_factor=cfg.prefetch_factor,
                      multiprocessing_context=cfg.multiprocessing_context)


def _batch_indices(loader):
    """The index tensor of each batch the loader's batch sampler lists, in its order. For
    torch's own samplers, the epoch's order made at once and split, drawing from the RNG
    what they draw and when (torch/utils/data/sampler.py): a Python int per sample and a
    tensor made of a list per batch would cost more than a small model's step."""
    sampler, batches = loader.sampler, loader.batch_sampler
    if type(batches) is BatchSampler and batches.sampler is sampler:
        n, size, drop_last = len(loader.dataset), batches.batch_size, batches.drop_last
        if type(sampler) is SequentialSampler:
            chunks = batch_chunks(torch.arange(n), size)
            yield from chunks[:n // size] if drop_last else chunks
            return
        if type(sampler) is RandomSampler and not sampler.replacement \
                and sampler.num_samples == n:
            yield from _random_sampler_batches(sampler.generator, n, size, drop_last)
            return
    for indices in batches:
        yield torch.as_tensor(indices)


def _random_sampler_batches(generator, n: int, size: int, drop_last: bool):
    """RandomSampler's batches as BatchSampler groups them: a seed from the global RNG
    where the sampler has no generator, one permutation of the epoch, then a second one,
    empty, drawn when the batch sampler asks past the first one's end (before a shorter
    last batch, or after the last full one)."""
    if generator is None:
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        generator = torch.Generator()
        generator.manual_seed(seed)
    chunks = batch_chunks(torch.randperm(n, generator=generator), size)
    full = n // size
    yield from chunks[:full]
    torch.randperm(n, generator=generator)
    if len(chunks) > full and not drop_last:
        yield chunks[full]


def _batchable(loader) -> bool:
    return not _why_not_batchable(loader)


def _why_not_batchable(loader) -> str:
    if type(loader.dataset) is not TensorDataset:
        return f"a {type(loader.dataset).__name__}: samples are read one by one"
    if loader.batch_sampler is None:
        return "batch_size=None: samples unbatched"
    if loader.collate_fn is not default_collate:
        return "its own collate_fn"
    if loader.num_workers:
        return f"{loader.num_workers} worker(s) of its own"
    return ""
