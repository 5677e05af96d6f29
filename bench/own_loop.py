"""Your own loop under nt.watch, against the same loop unwatched, in the same process.

    python bench/own_loop.py [--repeats 9] [--epochs 3] [--device cuda] [--case MLP]
                             [--log-every 100]

The loop is the tutorial one (a DataLoader, `.to(device)` per batch, AdamW, `loss.item()`
every step), written once below and run three ways per repeat, interleaved so machine
noise hits all alike:
as written; inside `nt.watch(optimize=False)` (watched only); inside `nt.watch()` (the
defaults: bf16 where measured faster, batched fetch for tensors, the fused AdamW). Each
call is timed whole, the watch's setup included (its probes are cached after the first
call of a process, as a re-run cell finds them: one warm-up round is not counted).
Printed: the median ms per step, the median of the per-round ratios to the loop as
written with their min-max spread (the order of the ways rotates from round to round:
bench/rounds.py), and the watch's diagnosis of the loop. Targets (issue 24):
watched only <= 1.03x; the defaults never slower, and <= 0.85x on the CNN where bf16 pays
(a CPU with avx512_bf16). `--device cuda` (bench/gpu.sh) runs the same loop on the GPU:
the model there, each batch moved by the loop, the watch timing it with CUDA events, and
a fourth way, `nt.watch(amp='fp16')` (autocast and the watch's GradScaler).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import nbtrain as nt
from nbtrain.tools.demo import digits_cnn
from nbtrain.machine import machine_line
from real_models import Images   # the per-sample Dataset a first custom one is (bench/)
from rounds import interleaved, paired   # bench/rounds.py: the order rotates each round


def the_loop(model, loader, epochs: int, device: str = "cpu") -> int:
    """What the tutorials write; returns its steps."""
    opt = torch.optim.AdamW(model.parameters(), 3e-3)
    losses = []
    for _ in range(epochs):
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)   # on the CPU: the tensor itself
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return len(losses)


def cases():
    gen = torch.Generator().manual_seed(0)
    mlp_x, mlp_y = torch.randn(8192, 64, generator=gen), torch.randint(0, 10, (8192,), generator=gen)
    dx, dy = nt.datasets.digits("train")

    def mlp():
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    yield "digits CNN, TensorDataset", digits_cnn, lambda: TensorDataset(dx, dy)
    yield "MLP 64-128-10, TensorDataset", mlp, lambda: TensorDataset(mlp_x, mlp_y)
    yield "digits CNN, per-sample Dataset", digits_cnn, lambda: Images(dx, dy)


WAYS = {
    "as written": None,
    "nt.watch(optimize=False)": dict(optimize=False, progress=False),
    "nt.watch() defaults": dict(progress=False),
}
# on a GPU also fp16 with the watch's GradScaler (what a GPU without bf16 would ask for)
CUDA_WAYS = {**WAYS, "nt.watch(amp='fp16')": dict(progress=False, amp="fp16")}


def ways_on(device: str) -> dict:
    return WAYS if device == "cpu" else CUDA_WAYS


def one_call(make_model, make_data, way, epochs: int, device: str = "cpu") -> tuple:
    """(seconds per step of one whole call: the model, the loader and the loop; the
    watch's Run, None unwatched)."""
    torch.manual_seed(0)
    model = make_model().to(device)
    loader = DataLoader(make_data(), batch_size=64, shuffle=True,
                        generator=torch.Generator().manual_seed(1))
    start, run = time.perf_counter(), None
    if way is None:
        steps = the_loop(model, loader, epochs, device)
    else:
        with nt.watch(**way) as run:
            steps = the_loop(model, loader, epochs, device)
    if device != "cpu":
        torch.cuda.synchronize()   # the call's queued work is part of it
    seconds = (time.perf_counter() - start) / steps
    return seconds, run


def measure(make_model, make_data, repeats: int, epochs: int, device: str = "cpu") -> tuple:
    """(seconds per step of each way over the repeats, each way's last Run)."""
    ways = ways_on(device)
    for way in ways.values():   # warm-up: allocator, kernels, the watch's cached probes
        one_call(make_model, make_data, way, epochs, device)
    runs = {}

    def measure_one(name) -> float:
        seconds, runs[name] = one_call(make_model, make_data, ways[name], epochs, device)
        return seconds
    return interleaved(list(ways), repeats, measure_one), runs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="where the loop trains: cpu or cuda")
    parser.add_argument("--case", default="", help="only the cases whose name holds this "
                        "(more rounds of one case in the same time)")
    parser.add_argument("--log-every", type=int, action="append", default=[],
                        help="also nt.watch(optimize=False, log_every=N): what the records cost")
    args = parser.parse_args(argv)
    for n in args.log_every:
        for ways in (WAYS, CUDA_WAYS):
            ways[f"nt.watch(optimize=False, log_every={n})"] = dict(
                optimize=False, progress=False, log_every=n)
    if args.device != "cpu" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this PyTorch sees no CUDA device")
    print(f"{machine_line()}\nmedian of {args.repeats} interleaved whole calls of "
          f"{args.epochs} epochs on {args.device} (batch 64, AdamW, loss.item() every step)\n")
    print("| case | way | ms/step | vs as written | spread | diagnosis |\n"
          "|---|---|---:|---:|---:|---|")
    for label, make_model, make_data in cases():
        if args.case not in label:
            continue
        times, runs = measure(make_model, make_data, args.repeats, args.epochs, args.device)
        ratios = {}
        for name, values in times.items():
            ratio, low, high = paired(times, name, "as written")
            ratios[name] = ratio
            spread = f"{low:.2f}-{high:.2f}" if name != "as written" else ""
            print(f"| {label} | {name} | {statistics.median(values) * 1e3:.3f} | {ratio:.3f}x | "
                  f"{spread} | {diagnosis_of(runs[name])} |", flush=True)
        if args.device != "cpu":
            own_loop_checks(label, ratios, runs["nt.watch() defaults"])


def diagnosis_of(run) -> str:
    return run.summary().get("diagnosis", "") if run is not None else ""


def own_loop_checks(label: str, ratios: dict, defaults_run) -> None:
    """Issue 24's targets on the GPU, into bench/gpu.sh's table."""
    from gpu import check   # bench/gpu.py, beside this file
    watched, defaults = ratios["nt.watch(optimize=False)"], ratios["nt.watch() defaults"]
    check(f"own loop on CUDA, {label}: watched only", f"{watched:.2f}x", "<= 1.03x",
          watched <= 1.03)
    check(f"own loop on CUDA, {label}: nt.watch() defaults", f"{defaults:.2f}x",
          "<= 1.00x (never slower)", defaults <= 1.0)
    # the loop moves its whole batch (.to(device)): the watch copies it ahead, pinned
    resolved = defaults_run.resolved
    ahead, pinned = resolved["prefetch_to_device"][0], resolved["pin_memory"][0]
    check(f"own loop on CUDA, {label}: copies ahead, pinned", f"{ahead}, {pinned}",
          "True, True", ahead is True and pinned is True)


if __name__ == "__main__":
    main()
