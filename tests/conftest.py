import contextlib
import os
import sys
import tempfile
from collections.abc import Mapping

# Every run is stored (nbtrain.runstore.write): the suite's go to a folder of its own, never to
# ~/.nbtrain. Subprocesses, ranks and the notebooks' kernels inherit it: pytest loads this
# file before it collects anything, testpaths' notebooks/ included (a conftest.py there
# would shadow this one for `from conftest import ...`).
os.environ["NBTRAIN_HOME"] = tempfile.mkdtemp(prefix="nbtrain-home-")

import pytest
import torch
torch.set_num_threads(1)  # tiny test models: threads only add spin-waits on 2 busy cores
from torch import nn

import nbtrain as nt
from nbtrain.auto import budget

# The suite loads nbtrain's engine once, here: no test's watch loaded it, so none counts
# that loading as spent (a process's first watch does: auto/budget.py), whatever runs first.
nt.watch
budget.take_loading_s()

CORPUS = str(__import__("pathlib").Path(__file__).parent / "corpus")
sys.path.insert(0, CORPUS)
from torchvision_ops import declare_missing_ops  # noqa: E402

declare_missing_ops()   # before transformers (tests/test_hf.py) or a program imports torchvision


def _kernels_declare_missing_ops() -> None:
    """The notebooks' kernels (nbval's, JupyterLab's) run the same declaration at their
    start, from a startup file of the suite's own IPython folder (notebook 09 imports
    transformers, which imports torchvision); the kernels inherit IPYTHONDIR."""
    ipython_dir = tempfile.mkdtemp(prefix="nbtrain-ipython-")
    startup = os.path.join(ipython_dir, "profile_default", "startup")
    os.makedirs(startup)
    with open(os.path.join(startup, "00-torchvision-ops.py"), "w") as f:
        f.write(f"import sys\nsys.path.insert(0, {CORPUS!r})\n"
                "from torchvision_ops import declare_missing_ops\n"
                f"declare_missing_ops()\nsys.path.remove({CORPUS!r})\n")
    os.environ["IPYTHONDIR"] = ipython_dir


_kernels_declare_missing_ops()


@pytest.fixture(autouse=True)
def _keep_main_module():
    """IPython's InteractiveShell (the magic's tests) puts a module without __spec__ in
    sys.modules["__main__"]; spawned DataLoader workers of later tests then fail to start.
    Each test gets the interpreter's own __main__ back."""
    main = sys.modules["__main__"]
    yield
    sys.modules["__main__"] = main


@pytest.fixture
def blobs():
    """A small, learnable 3-class problem: (inputs (512, 8), targets (512,))."""
    gen = torch.Generator().manual_seed(0)
    centers = torch.randn(3, 8, generator=gen) * 3
    y = torch.randint(0, 3, (512,), generator=gen)
    x = centers[y] + torch.randn(512, 8, generator=gen)
    return x, y


class Clock:
    """A time.perf_counter that only the test moves (a model's forward, the loop's body),
    so that what nbtrain times is known exactly."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Samples(torch.utils.data.Dataset):
    """A map-style dataset over tensors (the DataLoader path); sample `bad` raises."""

    def __init__(self, x, y, bad=None):
        self.x, self.y, self.bad = x, y, bad

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError("corrupt record")
        return self.x[i], self.y[i]


@pytest.fixture
def bf16_cpu(monkeypatch):
    """This CPU as one with avx512_bf16 on which bf16 measures 1.5x faster, on any machine
    (CPU autocast runs bf16 everywhere, only slower without the instructions): "auto"
    takes the bf16 path, its probes included, in this process and in the ranks (the
    NBTRAIN_ variables travel with a run's payload), so what breaks a bf16 machine fails
    CI too, and no choice depends on a timing."""
    from nbtrain import machine
    monkeypatch.setenv("NBTRAIN_CPU_BF16", "avx512_bf16")
    monkeypatch.setenv("NBTRAIN_BF16_GAIN", "1.5")
    machine.cpu_bf16_feature.cache_clear()
    yield
    machine.cpu_bf16_feature.cache_clear()   # the next call reads the environment put back


@pytest.fixture
def torch_threads(request):
    """torch's thread count set to the test's parameter (indirect=True), then back."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield
    torch.set_num_threads(before)


class Encoding(Mapping):
    """What transformers' BatchEncoding is: a Mapping, not a dict."""

    def __init__(self, **data):
        self.data = data

    def __getitem__(self, key):
        return self.data[key]

    def __iter__(self):
        return iter(self.data)

    def __len__(self):
        return len(self.data)


def mlp(dropout: float = 0.0) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.ReLU(), nn.Dropout(dropout),
                         nn.Linear(32, 3))


class EndsOnce(nn.Module):
    """Dropout model whose forward number `at` raises `error` (once)."""

    def __init__(self, error=None, at=None):
        super().__init__()
        self.body, self.error, self.at, self.calls = mlp(dropout=0.3), error, at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at and self.error is not None:
            raise self.error("injected")
        return self.body(x)


def same_state(a, b) -> None:
    """Runs `a` and `b` hold the same weights and optimizer state, bit for bit."""
    for (name, p), q in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(p, q), name
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    for key in sa:
        for field in sa[key]:
            assert torch.equal(torch.as_tensor(sa[key][field]), torch.as_tensor(sb[key][field]))


def quick(**overrides) -> nt.TrainConfig:
    """A config for fast CPU tests: fp32 unless a test asks, no progress bar noise."""
    base = dict(device="cpu", amp="off", batch_size=32, lr=1e-2, log_every=5)
    base.update(overrides)
    return nt.TrainConfig(**base)


class FakeStreams:
    """torch.cuda's stream calls on a CPU-only build, logged in order (the prefetcher's
    view of the GPU). `describe(tensor)` names a tensor in the log's "... used on" lines."""

    def __init__(self, monkeypatch, describe=lambda t: str(t.tolist())):
        self.log, self.active = [], "main"
        log = self

        class Stream:
            def __init__(self, device=None, name="side"):
                self.name = name

            def wait_stream(self, other):
                log.log.append(f"{self.name} waits for {other.name}")

        @contextlib.contextmanager
        def on(stream):   # torch.cuda.stream(s): `s` is current inside
            log.active = stream.name
            try:
                yield
            finally:
                log.active = "main"

        self.main = Stream(name="main")
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", on)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.main)
        monkeypatch.setattr(torch.Tensor, "record_stream",
                            lambda t, s: log.log.append(f"{describe(t)} used on {s.name}"))

    def move(self, batch):
        """A mover that logs the copy of batch k (its first tensor starts with k)."""
        self.log.append(f"copy batch {int(batch[0][0])} on {self.active}")
        return batch
