"""What the watch's parts share: the step's edge (Edge, with its Tally of the step in
progress and the plan of what the watch may change) and the undo list of every hook and
patch (Patches). Each part keeps the rest of its state to itself, and no part writes
another's attributes: the Tally's counts change only through its named methods, and
"nbtrain's own code runs" only inside `with edge.own:`, which restores what it found."""
from __future__ import annotations

import time


class Patches:
    """Every hook and patch of one watch, each with the call that undoes it."""

    def __init__(self):
        self._undo = []

    def keep(self, undo) -> None:
        self._undo.append(undo)

    def patch(self, owner, name: str, make):
        """Replace `owner.name` with `make(original)` until undo_all(); an inherited one (a
        C method of TensorBase) is removed again rather than set, so that lookup finds the
        very object it found before. Returns the function that undoes it."""
        own = name in owner.__dict__
        original = owner.__dict__[name] if own else getattr(owner, name)
        setattr(owner, name, make(getattr(owner, name)))
        undone = []

        def undo() -> None:   # once: some patches are undone early (host reads, copies)
            if not undone:
                undone.append(True)
                setattr(owner, name, original) if own else delattr(owner, name)
        self._undo.append(undo)
        return undo

    def undo_all(self) -> None:
        """Undo every one, last first, whatever else fails."""
        while self._undo:
            try:
                self._undo.pop()()
            except Exception:   # the next undo still runs
                pass


class Tally:
    """The step in progress, as every part sees it (Accelerate's GradientState is the
    model): the parts read its fields and change them only through its named methods (the
    loader part tells it of training batches, the forward part of a forward's samples
    without a DataLoader, the watcher of each backward, and the steps part closes the
    step). tests/test_watch_rooms.py checks that no other code assigns them: plain slots,
    since the loop's every batch and backward reads them.

    A loader that fetches one batch ahead (Accelerate's prepared loader, Lightning's
    fetcher, timm's prefetcher: the next batch is read before the current one is handed
    over; Hugging Face's Trainer also reads a step's micro-batches before the first) is
    told from the first two steps: the first saw one batch more than the second. As the
    second ends, the batch the first fetched ahead is moved to it, and the one the second
    fetched ahead is held back (`moved`: the records follow). From then on a backward
    after new batches trains on the one held back and holds back the newest; the pass's
    last batch is trained on after the loader ran out."""

    __slots__ = ("samples", "backwards", "batches", "trained", "at_boundary", "fresh",
                 "ahead", "held", "newest", "_first", "_was_holding", "_moved")

    def __init__(self, moved):
        self.samples = 0           # samples of the step's batches not yet added to a loss
        self.backwards = 0         # backward() calls since the last step
        self.batches = 0           # training batches since the last step
        self.trained = False       # the loop's first sign of training has come
        self.at_boundary = True    # between two steps: where Stop ends the loop
        self.fresh = False         # a training batch came since the last backward
        self.ahead = None          # batches the loader fetches ahead: None until told
        self.held = 0              # samples of the batch fetched ahead, not trained on yet
        self.newest = 0            # samples of the last training batch
        self._first = None         # (batches, backwards, newest) of the first step
        self._was_holding = 0      # a batch was held back as the step began
        self._moved = moved        # (from the first step, off this one): the records follow

    # -- what comes in: batches, forwards, backwards ---------------------------------------
    def batch(self, samples: int) -> None:
        """A batch of the training loader (a GAN's counted once: its loader's)."""
        self.samples += samples
        self.batches += 1
        self.newest = samples
        self.fresh = True

    def ran_out(self) -> None:
        """The training loader's pass ended: a batch held back is the next backward's."""
        self.newest = 0
        self.fresh = self.held > 0

    def forward(self, samples: int) -> None:
        """A forward's samples, where no DataLoader tells them (a policy's states)."""
        self.samples += samples

    def other_loader(self, samples: int) -> None:
        """The training loader turned out to be another one (Loader.adopt): the step's
        samples are that one's last batch, not the batches seen before."""
        self.samples = samples

    def looked_at(self) -> None:
        """A pass over the training loader that made no step was a look at a batch (a
        tutorial's `next(iter(loader))`): its batches are no step's."""
        if not self.backwards:
            self.samples = self.batches = 0

    def backward(self) -> int:
        """A backward of the loop's: the step has begun; returns the samples of its
        micro-batch (a loss's), which the next micro-batch does not count again."""
        if self.ahead:
            samples = self._trained_on_the_held()
        else:
            samples, self.samples = self.samples, 0
        self.fresh = False
        self.backwards += 1
        self.at_boundary = False
        return samples

    def _trained_on_the_held(self) -> int:
        if not self.fresh:   # the same batch's backward again (a GAN's second)
            samples = 0
        else:   # the batch held back is trained on; the newest is held back
            samples = self.held + self.samples - self.newest
            self.held = self.newest
        self.samples = 0
        return samples

    def _tell_ahead(self, batches: int) -> None:
        """As the second step ends: whether the loader runs a batch ahead. If so, the batch
        the first step fetched ahead is this one's, and the one this one fetched ahead the
        next one's."""
        first_batches, first_newest = self._first
        self.ahead = int(first_batches == batches + 1 and batches >= 1)
        if self.ahead:
            self._moved(first_newest, self.newest)
            self.held, self._was_holding = self.newest, 1

    def reevaluated(self) -> None:
        """A closure's backward after its first (LBFGS): the same step's evaluation, no
        samples of its own."""
        self.samples = 0

    def training(self) -> None:
        """The loop's first sign of training without a backward (an optimizer's step)."""
        self.trained = True

    # -- what the steps part does at a step's end ------------------------------------------
    def joined(self) -> None:
        """A second optimizer stepped on the same batch (a GAN): its backwards are the
        step's, already counted."""
        self.backwards = 0

    def take_samples(self) -> int:
        """A step without backward: its batch's samples, taken."""
        samples, self.samples = self.samples, 0
        return samples

    def close(self, boundary: bool = True) -> tuple:
        """The step ends: (batches, backwards) it trained on, and the counts start again;
        `boundary`: the loop is between steps (with several optimizers a step, only after
        the last of them)."""
        batches = self.batches
        if self.ahead:   # the batch held back is the next step's, the one held before this one's
            holding = int(self.held > 0)
            batches += self._was_holding - holding
            self._was_holding = holding
        elif self._first is None:
            self._first = batches, self.newest
        elif self.ahead is None:
            self._tell_ahead(batches)
        seen = batches, self.backwards
        self.backwards = self.batches = 0
        self.at_boundary = boundary
        return seen

    def boundary(self, between: bool) -> None:
        self.at_boundary = between


class OwnCode:
    """`with edge.own:`: nbtrain's own code runs (a record's reads, the scaler's calls), so
    the watch's wrappers let its calls through uncounted; the flag is restored to what it
    was on the way out, so nested uses and errors leave it as found."""

    __slots__ = ("edge", "_saved")

    def __init__(self, edge):
        self.edge, self._saved = edge, []

    def __enter__(self):
        self._saved.append(self.edge.inside)
        self.edge.inside = True

    def __exit__(self, *exc) -> None:
        self.edge.inside = self._saved.pop()


class Edge:
    """Where a step of the loop stands, as every part sees it: the Run and its interval,
    the model and its device (set once, by the watcher, when it finds them), the step in
    progress (`tally`), what the watch may change (`plan`), and whether nbtrain's own code
    runs now (`inside`, read here, set only by `with edge.own:`)."""

    __slots__ = ("run", "plan", "patches", "model", "device", "interval", "inside", "own",
                 "tally", "started", "stop_asked", "marks_steps", "waited_s")

    def __init__(self, run, plan):
        self.run, self.plan, self.patches = run, plan, Patches()
        self.model = self.device = self.interval = None
        self.inside = False        # nbtrain's own code runs: its calls are not the loop's
        self.own = OwnCode(self)
        self.tally = Tally(moved=self._moved)
        self.started = time.perf_counter()
        self.stop_asked = run.stop_check()
        self.marks_steps = False   # the interval's timer marks each step's start
        self.waited_s = 0.0        # the whole watch's data wait (the loader part adds to it)

    @property
    def trained(self) -> bool:
        return self.tally.trained

    def _moved(self, into: int, out: int) -> None:
        """A loader that fetches ahead, told as the second step ends (Tally): `into` samples
        move from the first step to it, `out` move from it to the next."""
        self.interval.take_back(into)
        self.interval.add_samples(into - out)

    def stop_if_asked(self) -> None:
        """End the loop at the step boundary: after a finished step, before the next one
        has changed anything (its batch may be loaded; its forward has not run). Called
        only at a boundary: the callers, which run every step, check it first."""
        if self.stop_asked():   # Run.stop_requested, one call where the property makes two
            raise StopWatching()


class StopWatching(BaseException):
    """Raised into the user's loop at a step boundary after Stop or Ctrl-C; the watch
    swallows it. A BaseException, as KeyboardInterrupt, so `except Exception` in the loop
    does not catch it (nor does `except KeyboardInterrupt`)."""
