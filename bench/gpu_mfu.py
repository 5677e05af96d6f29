"""Precision and MFU on a GPU, run by bench/gpu.sh (about two minutes on one H200).

    python bench/gpu_mfu.py        # markdown tables, then each check met or missed

Every case is an nt.fit run with count_flops on: FLOPs per step from FlopCounterMode, the
peak from flops.GPU_PEAKS where the GPU is there (an H200 reads 989.5 TFLOP/s at bf16,
494.5 at TF32, 67 at fp32), else the GEMM probe. Figures are medians over the train
records after the first (the first holds the warm-up); the diagnosis is the last record's.

1. AMP against TF32 and fp32, for a conv net (7 conv-BN-ReLU blocks, 64x64 images) and a
   transformer block (2 nn.TransformerEncoderLayer, d 1024, SDPA): amp bf16, amp fp16
   (GradScaler), amp off with TF32 for matmuls and convolutions, amp off as torch leaves
   it (cuDNN convolutions in TF32, matmuls in fp32: the peak is their FLOP-weighted mix,
   issue 28 bug 4), and full fp32. NVIDIA reports 2.63x for ResNet-50 with AMP over TF32
   on an A100 (its Deep Learning Examples, PyTorch ResNet-50 v1.5 training performance).
2. MFU with the data on the device and with the side-stream prefetch (the data in pinned
   host memory): a count the prefetch hid read "not counted" before (bug 1).
3. The wide MLP (8192-8192-8192 at batch 8192, GEMM-bound: MFU >= 50%) and the tiny MLP
   (64-128-10 at batch 64, launch-bound: MFU < 20%, the diagnosis says so).
"""
from __future__ import annotations

import contextlib
import statistics

import torch
from torch import nn
from torch.nn import functional as F

import nbtrain as nt
from nbtrain.auto.rates import percent

from gpu import check   # bench/gpu.py: the checks bench/gpu.sh collects


class Encoder(nn.Module):
    def __init__(self, d=1024, heads=16, layers=2, vocab=1024):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):          # x: (batch, tokens, d) -> (batch * tokens, vocab)
        return self.head(self.layers(x)).flatten(0, 1)


def token_loss(logits, y):
    return F.cross_entropy(logits, y.flatten())


def conv_net() -> nn.Module:
    """A ResNet-like stack without the skips: 3x3 convolutions do almost all the FLOPs."""
    widths = [(3, 64, 1), (64, 128, 2), (128, 128, 1), (128, 256, 2), (256, 256, 1),
              (256, 512, 2), (512, 512, 1)]
    layers = [m for c_in, c_out, stride in widths for m in (
        nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000))


def images():
    return torch.randn(4096, 3, 64, 64), torch.randint(0, 1000, (4096,))


def tokens():
    return torch.randn(64, 1024, 1024), torch.randint(0, 1024, (64, 1024))


def wide():
    return torch.randn(4 * 8192, 8192), torch.randint(0, 8192, (4 * 8192,))


def tiny():
    return torch.randn(8192, 64), torch.randint(0, 10, (8192,))


MODELS = {
    # name: (model, data, loss, batch, steps)
    "conv net": (conv_net, images, F.cross_entropy, 256, 40),
    "transformer block": (Encoder, tokens, token_loss, 16, 40),
    "wide MLP": (lambda: nn.Sequential(nn.Linear(8192, 8192), nn.GELU(), nn.Linear(8192, 8192)),
                 wide, F.cross_entropy, 8192, 40),
    "tiny MLP": (lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)),
                 tiny, F.cross_entropy, 64, 300),
}

# precision: (amp, fp32 math for amp="off": None as torch leaves it, True TF32, False fp32)
PRECISIONS = {"amp bf16": ("bf16", None), "amp fp16": ("fp16", None), "tf32": ("off", True),
              "off (torch's defaults)": ("off", None), "fp32": ("off", False)}


@contextlib.contextmanager
def fp32_math(tf32):
    """amp="off" runs: matmuls and cuDNN convolutions both in TF32, or both in full fp32
    (torch 2.9+'s per-op fp32_precision, else the legacy allow_tf32 flags); None: as they are."""
    if tf32 is None:
        yield
        return
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    new_api = getattr(getattr(cudnn, "conv", None), "fp32_precision", None) is not None
    if new_api:
        before = (matmul.fp32_precision, cudnn.conv.fp32_precision)
        matmul.fp32_precision = cudnn.conv.fp32_precision = "tf32" if tf32 else "ieee"
    else:
        before = (matmul.allow_tf32, cudnn.allow_tf32)
        matmul.allow_tf32 = cudnn.allow_tf32 = tf32
    try:
        yield
    finally:
        if new_api:
            matmul.fp32_precision, cudnn.conv.fp32_precision = before
        else:
            matmul.allow_tf32, cudnn.allow_tf32 = before


def run_case(model: str, precision: str = "amp bf16", **settings) -> dict:
    make, data, loss, batch, steps = MODELS[model]
    amp, tf32 = PRECISIONS[precision]
    torch.manual_seed(0)
    cfg = nt.TrainConfig(max_steps=steps, batch_size=batch, amp=amp, optimizer="adamw",
                         log_every=10, **{"data_on_device": True, **settings})
    with fp32_math(tf32):
        run = nt.fit(make(), data(), loss, config=cfg, progress=False)
    records = run.records("train")[1:]

    def median(field):
        values = [r[field] for r in records if r.get(field) is not None]
        return statistics.median(values) if values else None
    result = {"samples_s": sum(r["samples"] for r in records) / sum(r["interval_s"] for r in records),
              "tflops": median("tflops"), "mfu": median("mfu"),
              "gflop": (run.resolved["flops_per_step"][0] or 0) / 1e9,
              "peak": run.resolved["peak_tflops"][0], "peak_why": run.resolved["peak_tflops"][1],
              "diagnosis": records[-1].get("diagnosis", "") if records else "",
              "prefetch": run.resolved["prefetch_to_device"][0]}
    del run
    torch.cuda.empty_cache()
    return result


def figure(value, fmt="{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def row(label: str, r: dict, against=None) -> str:
    ratio = f"{r['samples_s'] / against:.2f}x" if against else "-"
    return (f"| {label} | {r['samples_s']:,.0f} | {ratio} | {figure(r['tflops'])} | "
            f"{figure(r['peak'])} | {'-' if r['mfu'] is None else percent(r['mfu'])} | "
            f"{r['diagnosis']} |")


HEADER = ("| case | samples/s | vs tf32 | TFLOP/s | peak TFLOP/s | MFU | diagnosis |\n"
          "|---|---:|---:|---:|---:|---:|---|")


def precisions() -> list:
    """Section 1: every precision on the conv net and the transformer block."""
    print(HEADER)
    results = []
    for model in ("conv net", "transformer block"):
        found = {p: run_case(model, p) for p in PRECISIONS}
        for p, r in found.items():
            print(row(f"{model}, {p}", r, found["tf32"]["samples_s"]), flush=True)
            results.append((f"{model}, {p}", r))
        gain = found["amp bf16"]["samples_s"] / found["tf32"]["samples_s"]
        check(f"{model}: amp bf16 over tf32", f"{gain:.2f}x", "NVIDIA: 2.63x, ResNet-50 on an A100",
              None)
    conv = dict(results)["conv net, off (torch's defaults)"]
    check("conv net at amp='off': the peak is cuDNN's TF32 (bug 4)", f"{figure(conv['peak'])} TFLOP/s",
          "the tf32 figure for a conv net", "tf32" in conv["peak_why"])
    return results


def prefetched() -> list:
    """Section 2: MFU with the data on the device, and prefetched from pinned memory."""
    print("\n" + HEADER.replace("vs tf32", "vs on device"))
    results = []
    for model in ("transformer block", "wide MLP"):
        resident = run_case(model, data_on_device=True)
        ahead = run_case(model, data_on_device=False, pin_memory=True)
        print(row(f"{model}, data on the device", resident), flush=True)
        print(row(f"{model}, prefetched (side stream: {ahead['prefetch']})", ahead,
                  resident["samples_s"]), flush=True)
        check(f"{model}: MFU counted with the prefetcher (bug 1)",
              "-" if ahead["mfu"] is None else percent(ahead["mfu"]), "a figure",
              ahead["mfu"] is not None)
        results += [(f"{model}, resident", resident), (f"{model}, prefetched", ahead)]
    return results


def main():
    assert torch.cuda.is_available(), "bench/gpu_mfu.py needs a CUDA device"
    print(f"{torch.cuda.get_device_name()} (compute capability "
          f"{torch.cuda.get_device_capability()}), torch {torch.__version__}\n")
    results = precisions() + prefetched()
    print("\n" + HEADER)
    for model in ("wide MLP", "tiny MLP"):
        r = run_case(model)
        results.append((model, r))
        print(row(f"{model}, amp bf16", r), flush=True)
    found = dict(results)
    print(f"\npeak: {found['wide MLP']['peak_why']}")
    wide_mfu, tiny_mfu = found["wide MLP"]["mfu"] or 0, found["tiny MLP"]["mfu"] or 1
    check("wide MLP MFU at bf16", percent(wide_mfu), ">= 50%", wide_mfu >= 0.5)
    check("tiny MLP reads launch-bound", percent(tiny_mfu), "< 20%", tiny_mfu < 0.2)
    over = [name for name, r in results if (r["mfu"] or 0) > 1]
    check("MFU never above 100%", ", ".join(over) or "none above", "none", not over)


if __name__ == "__main__":
    main()
