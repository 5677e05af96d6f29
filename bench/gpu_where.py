"""Where the time goes, on a GPU (a stage of bench/gpu.sh): the CUDA paths of run.modules()
(CUDA events read once at the window's end), run.peak() (the allocator at the forward's
end), run.gaps() and run.host_reads(), on a watched loop with planted causes:

- a layer that takes most of the step (a 2048 x 2048 matmul);
- a layer that holds a 64 MiB activation for its backward;
- a loss.item() every step, an evaluation pass over another loader after every epoch.

    python bench/gpu_where.py [--device cpu]

Each check goes to $NBTRAIN_BENCH_CHECKS (bench/gpu.py's `check`). Without a GPU it is
refused unless `--device cpu` asks for a dry run of the checks on the CPU's paths (the test
suite's: tests/test_modules.py, test_gaps.py, test_host_reads.py).
"""
from __future__ import annotations

import argparse
import sys

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import nbtrain as nt
from gpu import check   # bench/gpu.py

MIB = 2**20


class Outer(nn.Module):
    """(batch, 128) -> (batch, 128 * 128): the next Linear saves it for its backward."""

    def forward(self, h):
        return (h[:, :, None] * h[:, None, :]).flatten(1)


def planted() -> nn.Module:
    """Layer "2" is the slow one (2048 x 2048); layer "6" saves 1024 x 16384 x 4 bytes =
    64 MiB (its input, the outer product)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, 128), Outer(), nn.Linear(128 * 128, 10))


def watched(device) -> nt.Run:
    x = torch.randn(16 * 1024, 256)
    y = torch.randint(0, 10, (16 * 1024,))
    train = DataLoader(TensorDataset(x, y), batch_size=1024, shuffle=True)
    val = DataLoader(TensorDataset(x[:2048], y[:2048]), batch_size=1024)
    model = planted().to(device)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    losses = []
    with nt.watch(optimize=False, progress=False, store=False) as run:
        for _ in range(12):
            for xb, yb in train:
                xb, yb = xb.to(device), yb.to(device)
                opt.zero_grad()
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                opt.step()
                losses.append(loss.item())   # planted: a host read every step
            with torch.no_grad():            # planted: an evaluation pass every epoch
                for xb, _ in val:
                    model(xb.to(device))
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu: a dry run")
    device = torch.device(parser.parse_args().device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench/gpu_where.py needs a CUDA device (--device cpu: a dry run on the CPU)")
        return 1
    run = watched(device)
    rows = run.modules()
    top = f"layer {rows[0].name}, {rows[0].share:.0%} of the modules' time" if rows else rows.note
    check("modules: the planted slow layer first", top, 'layer "2"',
          bool(rows) and rows[0].name == "2")
    peak = run.peak()
    part = peak.parts[0] if peak.parts else None
    held = part.bytes / MIB if part is not None else 0.0
    check("peak: the planted 64 MiB activation the largest part",
          f"{part.part if part else '-'} {part.kind if part else ''} {held:.1f} MiB of "
          f"{peak.bytes / MIB:.1f} MiB", 'layer "6", 64 MiB within 25%',
          part is not None and part.part == "6" and abs(held - 64) <= 16)
    gaps = {row["part"]: row["seconds"] for row in run.gaps()}
    check("gaps: the parts add up to the wall time",
          f"{sum(gaps.values()):.3f} s of {run.wall_s:.3f} s; evaluation {gaps['evaluation']:.3f} s",
          "within 3%, evaluation > 0",
          abs(sum(gaps.values()) - run.wall_s) <= 0.03 * run.wall_s and gaps["evaluation"] > 0)
    worst = run.host_reads().worst
    check("host reads: the loss.item() line named",
          f"{worst.code} ({worst.per_step:.2g} a step)" if worst else run.host_reads().note,
          "losses.append(loss.item()), 1 a step",
          worst is not None and "loss.item()" in worst.code and abs(worst.per_step - 1) < 0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
