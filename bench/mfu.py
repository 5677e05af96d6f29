"""MFU on this CPU: a step that is one large matmul against a tiny MLP, and what nt.fit says.

    python bench/mfu.py [--repeats 5] [--threads 1]

Both cases run through nt.fit with count_flops on (the default): FLOPs per step counted
by FlopCounterMode before step 1, the peak measured by flops.py's GEMM probe (cached per
machine). Each repeat is a fresh run; the table shows medians over repeats of each run's
train records after its first (the first interval holds the warm-up).

- "one matmul": nn.Linear(1024, 1024) at batch 2048, MSE, SGD: forward and the weight
  gradient are two 1024x1024x2048 matmuls; the loss and the update are a few passes over
  8 MiB. Target (issue 17): MFU >= 50%.
- "tiny MLP": 64-128-10 at batch 64 (bench/overhead.py's case): microseconds of matmul
  per op against the fixed cost of each op and of the loop. Reads low.

One thread by default: the bench machine's 2 cores are shared, and a second thread only
adds spin-waits there (bench/threads.py).
"""
from __future__ import annotations

import argparse
import statistics

import torch
from torch import nn
from torch.nn import functional as F

import nbtrain as nt
from nbtrain.machine import machine_line
from nbtrain.machine import cpu_model
from nbtrain.auto.rates import percent

CASES = {
    "one matmul": dict(make=lambda: nn.Linear(1024, 1024), inputs=(4096, 1024),
                       targets=lambda n: torch.randn(n, 1024), loss=F.mse_loss, batch=2048,
                       steps=10),
    "tiny MLP": dict(make=lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)),
                     inputs=(8192, 64), targets=lambda n: torch.randint(0, 10, (n,)),
                     loss=F.cross_entropy, batch=64, steps=128),
}


def one_run(case: dict, threads: int):
    torch.manual_seed(0)
    x = torch.randn(*case["inputs"])
    y = case["targets"](len(x))
    cfg = nt.TrainConfig(max_steps=case["steps"], batch_size=case["batch"], optimizer="sgd",
                         lr=1e-3, amp="off", device="cpu", num_threads=threads,
                         log_every=max(case["steps"] // 4, 1))
    run = nt.fit(case["make"](), (x, y), case["loss"], config=cfg, progress=False)
    records = run.records("train")[1:]
    return run, statistics.median(r["tflops"] for r in records), \
        statistics.median(r["mfu"] for r in records)


def main(argv=None):
    print(machine_line())   # the caption: which CPU, its bf16 units, the load
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    print(f"CPU {cpu_model()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"median of {args.repeats} runs\n")
    print("| case | GFLOP/step | achieved GFLOP/s | peak GFLOP/s | MFU | diagnosis |\n"
          "|---|---:|---:|---:|---:|---|")
    for name, case in CASES.items():
        runs = [one_run(case, args.threads) for _ in range(args.repeats)]
        run = runs[-1][0]
        tflops = statistics.median(r[1] for r in runs)
        mfu = statistics.median(r[2] for r in runs)
        peak = run.resolved["peak_tflops"][0]
        print(f"| {name} | {run.resolved['flops_per_step'][0] / 1e9:.3g} | {tflops * 1e3:.1f} | "
              f"{peak * 1e3:.1f} | {percent(mfu)} | {run.records('train')[-1]['diagnosis']} |",
              flush=True)
    print(f"\npeak: {run.resolved['peak_tflops'][1]}")


if __name__ == "__main__":
    main()
