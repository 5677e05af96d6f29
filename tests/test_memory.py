"""Memory tools leave nothing behind: trial steps and released runs."""
import gc
import weakref

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nbtrain as nt
from nbtrain.auto.memory import leaves_no_trace, release

from conftest import mlp, quick


def test_max_batch_size_leaves_no_gradients_and_same_weights():
    model = mlp(dropout=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    data = (torch.randn(100, 8), torch.randint(0, 3, (100,)))
    assert nt.max_batch_size(model, data, F.cross_entropy, config=quick(), limit=64) == 64
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


class OutOfMemoryAbove(torch.Tensor):
    """Data whose batch copy runs out of memory above 40 rows (a device copy that fails)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and isinstance(args[1], torch.Tensor) \
                and len(args[1]) > 40:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_max_batch_size_counts_a_failed_batch_copy_as_too_big():
    x = torch.randn(100, 8).as_subclass(OutOfMemoryAbove)
    data = (x, torch.randint(0, 3, (100,)))
    assert nt.max_batch_size(nn.Linear(8, 3), data, F.cross_entropy, config=quick()) == 40


class FailsAbove(nn.Linear):
    """A layer whose library call fails as cuBLAS or cuDNN do when a batch is too big."""

    def __init__(self, rows, message):
        super().__init__(8, 3)
        self.rows, self.message = rows, message

    def forward(self, x):
        if len(x) > self.rows:
            raise RuntimeError(self.message)
        return super().forward(x)


@pytest.mark.parametrize("message", [
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED"])
def test_max_batch_size_treats_library_allocation_failures_as_too_big(message):
    data = (torch.randn(100, 8), torch.randint(0, 3, (100,)))
    assert nt.max_batch_size(FailsAbove(40, message), data, F.cross_entropy, config=quick()) == 40


def test_max_batch_size_raises_a_real_bug():
    data = (torch.randn(100, 8), torch.randint(0, 3, (100,)))
    with pytest.raises(RuntimeError, match="a real bug"):
        nt.max_batch_size(FailsAbove(40, "a real bug"), data, F.cross_entropy, config=quick())


def test_leaves_no_trace_restores_the_cpu_rng():
    model = mlp(dropout=0.5)
    expected = torch.get_rng_state()
    with leaves_no_trace(model):
        model(torch.randn(4, 8)).sum().backward()
    assert torch.equal(torch.get_rng_state(), expected)
    assert all(p.grad is None for p in model.parameters())


def test_release_frees_what_the_failed_steps_frames_hold(blobs):
    held = []

    def failing_loss(out, target):
        scratch = torch.zeros(1000, 1000)   # like a step's activations: only a local holds it
        held.append(weakref.ref(scratch))   # the FLOP count's call first, then the step's
        raise RuntimeError("boom")
    with pytest.raises(nt.TrainingError, match="boom") as info:
        nt.fit(mlp(), blobs, failing_loss, config=quick(max_steps=3), progress=False)
    run = info.value.run
    gc.collect()
    assert held[-1]() is not None   # kept by the error's traceback: %debug still sees it
    release(run)
    gc.collect()
    assert held[-1]() is None
    assert run.error is not None and "boom" in str(run.error)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_leaves_no_trace_restores_the_cuda_rng():
    model = mlp(dropout=0.5).cuda()   # dropout on the GPU draws from the GPU's generator
    expected = torch.cuda.get_rng_state()
    with leaves_no_trace(model):
        model(torch.randn(4, 8, device="cuda")).sum().backward()
    assert torch.equal(torch.cuda.get_rng_state(), expected)
