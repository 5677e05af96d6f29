"""What activation checkpointing saves: bytes kept for backward, measured exactly.

    python bench/memory.py

A deep MLP (16 blocks of Linear 1024 + GELU) at batch 512, fp32. `saved_tensors_hooks`
sees every tensor autograd keeps for backward, so the total is the activation memory
(device-independent: the same bytes would sit in GPU memory). Also reports the step
time, the price of recomputing. Each setting runs in a fresh subprocess.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import torch
from torch import nn
from nbtrain.machine import machine_line


def model():
    torch.manual_seed(0)
    blocks = []
    for _ in range(16):
        blocks += [nn.Linear(1024, 1024), nn.GELU()]
    return nn.Sequential(*blocks, nn.Linear(1024, 10))


def measure(setting) -> dict:
    from nbtrain.auto.memory import checkpointed_forward, saved_for_backward_bytes
    net = model()
    forward = checkpointed_forward(net, setting) if setting else net
    x = torch.randn(512, 1024)
    saved = saved_for_backward_bytes(forward, x)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        forward(x).sum().backward()
        times.append(time.perf_counter() - start)
    return {"saved_mb": saved / 2**20, "step_ms": sorted(times)[2] * 1e3}


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        setting = json.loads(sys.argv[2])
        print(json.dumps(measure(setting)))
        return
    print(machine_line())   # the caption: which CPU, its bf16 units, the load
    print("| activation_checkpointing | saved for backward MiB | step ms |")
    print("|---|---:|---:|")
    for setting in (False, True, 2):
        out = subprocess.run([sys.executable, __file__, "--one", json.dumps(setting)],
                             capture_output=True, text=True, check=True).stdout
        r = json.loads(out)
        print(f"| {setting} | {r['saved_mb']:.0f} | {r['step_ms']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
