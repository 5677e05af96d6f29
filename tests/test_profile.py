"""nt.profile: a run's steps under torch.profiler (profiling.py)."""
import json

import pytest
import torch
from torch.nn import functional as F

import nbtrain as nt
from nbtrain.tools.profiling import MATMUL, MOVEMENT, ELEMENTWISE, category

from conftest import mlp, quick


def test_profile_records_the_steps_after_warmup(blobs, tmp_path):
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    prof = nt.profile(model, blobs, F.cross_entropy, config=quick(), steps=3, warmup=2,
                      folder=str(tmp_path))
    assert prof.run.step == 2 + 1 + 3   # warm-up, the profiler's warm-up step, the recorded
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))   # a copy trained
    names = {op["name"]: op for op in prof.operators}
    assert names["aten::addmm"]["category"] == MATMUL
    assert names["aten::addmm"]["calls"] == 3 * 2   # two Linear layers, three recorded steps
    assert sum(prof.shares.values()) == pytest.approx(1.0)
    assert prof.shares[MATMUL] > 0
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert trace["traceEvents"] and prof.trace_path == str(tmp_path / "trace.json")
    assert prof.memory_snapshot is None   # CUDA only
    text, page = repr(prof), prof._repr_html_()
    assert "aten::addmm" in text and "matmul/conv" in text and "perfetto" in text
    assert "<table>" in page and "aten::addmm" in page
    pytest.importorskip("plotly")
    assert prof.figure().data


@pytest.mark.parametrize("name, kind", [
    ("aten::addmm", MATMUL), ("aten::convolution_backward", MATMUL),
    ("aten::_scaled_dot_product_flash_attention", MATMUL), ("aten::copy_", MOVEMENT),
    ("aten::cat", MOVEMENT), ("aten::relu", ELEMENTWISE), ("aten::_fused_adamw_", ELEMENTWISE),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", MATMUL), ("Memcpy HtoD (Pinned -> Device)", MOVEMENT),
])
def test_operators_are_sorted_into_kinds(name, kind):
    assert category(name) == kind


def test_profile_refuses_no_steps(blobs):
    with pytest.raises(ValueError, match="steps >= 1"):
        nt.profile(mlp, blobs, F.cross_entropy, config=quick(), steps=0)
