"""Every GPU check in one run (a few minutes on one GPU); never run by the tests.

    python bench/gpu.py            # prints markdown tables

1. Host-to-device bandwidth: pinned vs pageable memory, 256 MiB copies.
2. The side-stream prefetcher on an input-heavy step: copy/compute overlap, achieved
   copy bandwidth against (1), and GPU idle share of a step (targets: >= 80% of pinned
   bandwidth, idle <= 5%).
3. data_on_device against copying every step, and nbtrain auto against a plain loop,
   with fp32/bf16 for each.
"""
from __future__ import annotations

import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import nbtrain as nt


def bandwidth(pinned: bool, mib: int = 256, repeats: int = 10) -> float:
    host = torch.empty(mib * 2**20, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty_like(host, device="cuda")
    dev.copy_(host, non_blocking=pinned)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        dev.copy_(host, non_blocking=pinned)
    torch.cuda.synchronize()
    return mib * repeats / 1024 / (time.perf_counter() - start)   # GiB/s


def input_heavy():
    """Large inputs, light model: the copy is a big share of each step."""
    x = torch.randn(16_384, 3, 64, 64)
    y = torch.randint(0, 10, (16_384,))
    model = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(16, 10))
    return model, x, y


def run_config(name, **overrides):
    model, x, y = input_heavy()
    cfg = nt.TrainConfig(epochs=2, batch_size=512, amp="off", log_every=8, **overrides)
    run = nt.fit(model, (x, y), F.cross_entropy, config=cfg, progress=False)
    s = run.summary()
    train = run.records("train")[1:]   # skip the warm-up interval
    steps = sum(r["steps"] for r in train)
    copy_s = sum(r["copy_s"] * r["steps"] for r in train)
    busy = sum(r["interval_s"] for r in train)
    compute = sum(r["compute_s"] * r["steps"] for r in train)
    batch_bytes = 512 * 3 * 64 * 64 * 4
    return {"name": name, "samples/s": s["samples_per_s"], "copy ms/step": copy_s / steps * 1e3,
            "GPU idle %": max(0.0, 1 - compute / busy) * 100,
            "copy GiB/s": batch_bytes * steps / max(copy_s, 1e-9) / 2**30,
            "settings": {k: v for k, (v, _) in run.resolved.items()
                         if k in ("pin_memory", "data_on_device", "prefetch_to_device")}}


def plain_loop_rate() -> float:
    model, x, y = input_heavy()
    model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(x, y), batch_size=512, shuffle=True)
    n, start = 0, None
    for epoch in range(2):
        for i, (xb, yb) in enumerate(loader):
            if epoch == 0 and i == 8:
                torch.cuda.synchronize()
                start, n = time.perf_counter(), 0
            xb, yb = xb.cuda(), yb.cuda()
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
            n += len(xb)
    torch.cuda.synchronize()
    return n / (time.perf_counter() - start)


def main():
    assert torch.cuda.is_available(), "bench/gpu.py needs a CUDA device"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    pinned, pageable = bandwidth(True), bandwidth(False)
    print("| host-to-device copy | GiB/s |\n|---|---:|")
    print(f"| pinned | {pinned:.1f} |\n| pageable | {pageable:.1f} |\n")
    rows = [run_config("copy every step, pageable", pin_memory=False, data_on_device=False,
                       prefetch_to_device=False),
            run_config("pinned, non_blocking", pin_memory=True, data_on_device=False,
                       prefetch_to_device=False),
            run_config("pinned + side-stream prefetch", pin_memory=True, data_on_device=False,
                       prefetch_to_device=True),
            run_config("data_on_device", data_on_device=True),
            run_config("nbtrain auto")]
    plain = plain_loop_rate()
    print("| input-heavy step (512x3x64x64) | samples/s | vs plain | copy GiB/s | "
          "% of pinned bw | GPU idle % | resolved |\n|---|---:|---:|---:|---:|---:|---|")
    print(f"| plain loop (DataLoader, .cuda()) | {plain:,.0f} | 1.00x | | | | |")
    for r in rows:
        print(f"| {r['name']} | {r['samples/s']:,.0f} | {r['samples/s'] / plain:.2f}x | "
              f"{r['copy GiB/s']:.1f} | {r['copy GiB/s'] / pinned:.0%} | {r['GPU idle %']:.1f} | "
              f"{r['settings']} |", flush=True)


if __name__ == "__main__":
    main()
