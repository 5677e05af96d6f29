"""MFU of GPU runs at bf16 against the table peak (issue 17), run by bench/gpu.sh.

    python bench/gpu_mfu.py        # a markdown table, then the target met or missed

Each case is an nt.fit run with amp="bf16" and count_flops on: FLOPs per step from
FlopCounterMode, the peak from flops.GPU_PEAKS where the GPU is there (an H200 reads
989.5 TFLOP/s, "NVIDIA H200" as the driver names it), else the GEMM probe. The table
shows the median over the train records after the first (the first holds the warm-up).

- "wide MLP": 8192-8192-8192 at batch 8192: six large bf16 GEMMs a step (five with the
  input gradient skipped). Target: MFU >= 50% (a dense GEMM-bound step).
- "transformer": 4 nn.TransformerEncoderLayer (d 1024, 16 heads, SDPA) on 16 x 1024
  tokens: attention, norms and GELUs between the GEMMs; reads lower.
- "tiny MLP": 64-128-10 at batch 64: launch-bound; the diagnosis says so.

Written without a GPU at hand: unrun until a device session runs bench/gpu.sh.
"""
from __future__ import annotations

import statistics

import torch
from torch import nn
from torch.nn import functional as F

import nbtrain as nt
from nbtrain.flops import peak_tflops, percent


class Encoder(nn.Module):
    def __init__(self, d=1024, heads=16, layers=4, vocab=1024):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):          # x: (batch, tokens, d) -> (batch * tokens, vocab)
        return self.head(self.layers(x)).flatten(0, 1)


def token_loss(logits, y):
    return F.cross_entropy(logits, y.flatten())


CASES = [
    # name, model, inputs, targets, loss, batch, steps
    ("wide MLP", lambda: nn.Sequential(nn.Linear(8192, 8192), nn.GELU(), nn.Linear(8192, 8192)),
     lambda: torch.randn(4 * 8192, 8192), lambda n: torch.randint(0, 8192, (n,)),
     F.cross_entropy, 8192, 60),
    ("transformer", Encoder, lambda: torch.randn(64, 1024, 1024),
     lambda n: torch.randint(0, 1024, (n, 1024)), token_loss, 16, 60),
    ("tiny MLP", lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)),
     lambda: torch.randn(8192, 64), lambda n: torch.randint(0, 10, (n,)), F.cross_entropy, 64, 300),
]


def run_case(make, inputs, targets, loss, batch, steps):
    torch.manual_seed(0)
    x = inputs()
    cfg = nt.TrainConfig(max_steps=steps, batch_size=batch, amp="bf16", optimizer="adamw",
                         data_on_device=True, log_every=10)
    run = nt.fit(make(), (x, targets(len(x))), loss, config=cfg, progress=False)
    records = run.records("train")[1:]
    return run, statistics.median(r["tflops"] for r in records), \
        statistics.median(r["mfu"] for r in records)


def main():
    assert torch.cuda.is_available(), "bench/gpu_mfu.py needs a CUDA device"
    name = torch.cuda.get_device_name()
    print(f"{name} (compute capability {torch.cuda.get_device_capability()}), torch "
          f"{torch.__version__}, amp=bf16\n")
    print("| case | GFLOP/step | TFLOP/s | peak TFLOP/s | MFU | diagnosis |\n"
          "|---|---:|---:|---:|---:|---|")
    results = {}
    for case, *args in CASES:
        run, tflops, mfu = run_case(*args)
        results[case] = mfu
        print(f"| {case} | {run.resolved['flops_per_step'][0] / 1e9:,.1f} | {tflops:.1f} | "
              f"{run.resolved['peak_tflops'][0]:.1f} | {percent(mfu)} | "
              f"{run.records('train')[-1]['diagnosis']} |", flush=True)
        del run
        torch.cuda.empty_cache()
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"\npeak: {peak_tflops(device, 'bf16', threads=1)[1]}")
    print("\ntargets:")
    print(f"- wide MLP at {percent(results['wide MLP'])} MFU (>= 50%): "
          f"{'met' if results['wide MLP'] >= 0.5 else 'MISSED'}")
    print(f"- tiny MLP reads low ({percent(results['tiny MLP'])} < 20%): "
          f"{'met' if results['tiny MLP'] < 0.2 else 'MISSED'}")


if __name__ == "__main__":
    main()
