"""Let torchvision's Python parts import where its C++ ops cannot load.

The torchvision wheel on PyPI is built against the CUDA torch: with the CPU torch
(torch==2.13.0+cpu) its `_C.so` fails to load (it links libtorch_cuda), and
torchvision/_meta_registrations.py then registers fake kernels for `torchvision::nms`
and `torchvision::qnms`, which raises "operator torchvision::nms does not exist". The
corpus uses only torchvision's datasets (FakeData), transforms, utils and models, none of
which calls those ops, so declaring their two schemas is all the import needs. Where the
library does load (a matching CUDA or CPU build), nothing is declared: its own
TORCH_LIBRARY would clash with a second definition.

This module imports nothing of nbtrain: the pickle test's fresh interpreter uses it too.
"""
import glob
import importlib.util
import os

import torch

# torchvision/csrc/ops/nms.cpp and quantized/cpu/qnms_kernel.cpp declare these
MISSING_SCHEMAS = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


def declare_missing_ops() -> bool:
    """Declare torchvision's nms/qnms schemas where its C++ library cannot load; True
    where it declared them. Safe to call twice, and before torchvision is imported."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or _has_op("nms"):
        return False
    libraries = glob.glob(os.path.join(os.path.dirname(spec.origin), "_C*.so"))
    try:
        if libraries:
            torch.ops.load_library(libraries[0])
            return False
    except OSError:
        pass
    for name, schema in MISSING_SCHEMAS.items():
        torch.library.define(f"torchvision::{name}", schema)
    return True


def _has_op(name: str) -> bool:
    try:
        getattr(torch.ops.torchvision, name)
        return True
    except (AttributeError, RuntimeError):
        return False
