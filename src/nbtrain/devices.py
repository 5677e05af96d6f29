"""Resolve "auto" device and precision settings to concrete values, each with a reason."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import statistics
import time
from typing import Optional, Tuple

import torch

Choice = Tuple[object, str]   # (value, why it was chosen)


def resolve_device(requested: str) -> Tuple[torch.device, str]:
    if requested != "auto":
        return _indexed(_checked_device(requested)), "asked for"
    if torch.cuda.is_available():
        device = _indexed(torch.device("cuda"))
        return device, f"CUDA available: {torch.cuda.get_device_name(device)}"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps"), "Apple MPS available"
    return torch.device("cpu"), "no CUDA or MPS device found"


def resolve_device_type(requested: str) -> str:
    """The type of device resolve_device(requested) gives ('cuda', 'mps', 'cpu'), without
    choosing a GPU: a rank sets its own (torch.cuda.set_device) before anything asks for
    the current one, which would open a context on GPU 0."""
    if requested != "auto":
        return torch.device(requested).type
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def _indexed(device: torch.device) -> torch.device:
    """'cuda' as 'cuda:N': the current device is per thread, and a background run's thread
    starts on device 0 whatever the notebook's thread chose with torch.cuda.set_device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def gpu_has_bf16(device: torch.device) -> bool:
    """Native bf16 (compute capability 8.0, Ampere, and later). torch.cuda.is_bf16_supported()
    also counts emulated bf16 (T4, V100), which is slower than fp16 there."""
    return torch.cuda.get_device_capability(device)[0] >= 8


def _checked_device(name: str) -> torch.device:
    from .config import ConfigError
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"TrainConfig.device={name!r} is not available: this PyTorch "
                          "sees no CUDA device. Use device='auto' or 'cpu'.", field="device")
    if device.type == "cuda" and device.index is not None \
            and device.index >= torch.cuda.device_count():
        raise ConfigError(f"TrainConfig.device={name!r} is not available: only "
                          f"{torch.cuda.device_count()} CUDA device(s). Use 'cuda:0'.", field="device")
    if device.type == "mps" and not (getattr(torch.backends, "mps", None)
                                     and torch.backends.mps.is_available()):
        raise ConfigError(f"TrainConfig.device={name!r} is not available on this machine. "
                          "Use device='auto' or 'cpu'.", field="device")
    return device


@functools.lru_cache(maxsize=None)
def cpuinfo(field: str) -> Optional[str]:
    """The value of /proc/cpuinfo's first `field` line ("flags", "model name"); None where
    there is no /proc (macOS, Windows) or no such line."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(field)), None)
    except OSError:
        return None
    return line.split(":", 1)[1].strip() if line else None


@functools.lru_cache(maxsize=None)
def cpu_bf16_feature() -> str:
    """The CPU flag that makes bf16 matmuls fast here ('' when there is none; without
    /proc: macOS, where Apple silicon's bf16 autocast is slow, and Windows).
    $NBTRAIN_CPU_BF16 names one instead: the tests make any CPU take the bf16 path (CPU
    autocast runs bf16 everywhere, only slower without the instructions)."""
    if os.environ.get("NBTRAIN_CPU_BF16") is not None:
        return os.environ["NBTRAIN_CPU_BF16"]
    flags = (cpuinfo("flags") or "").split()
    for flag in ("amx_bf16", "avx512_bf16"):
        if flag in flags:
            return flag
    return ""


def resolve_amp(requested: str, device: torch.device) -> Choice:
    """'off' | 'fp16' | 'bf16' with the reason, for `requested` on `device`."""
    from .config import ConfigError
    if requested != "auto":
        if requested == "fp16" and device.type == "cpu":
            return "fp16", "asked for (on CPU fp16 autocast is usually slower than bf16)"
        if requested == "bf16" and device.type == "cuda" and not gpu_has_bf16(device):
            if not torch.cuda.is_bf16_supported():
                raise ConfigError("TrainConfig.amp='bf16' is not supported by this GPU "
                                  f"({torch.cuda.get_device_name(device)}): use amp='fp16'.",
                                  field="amp")
            return "bf16", "asked for (emulated on this GPU: usually slower than fp16)"
        return requested, "asked for"
    if device.type == "cuda":
        if gpu_has_bf16(device):
            return "bf16", "GPU supports bf16 (same range as fp32, no loss scaling needed)"
        return "fp16", "GPU lacks bf16: fp16 with a GradScaler"
    if device.type == "mps":
        return "off", "autocast on MPS rarely pays off; use amp='fp16' to try it"
    flag = cpu_bf16_feature()
    if flag:   # the loop measures whether this model gains from it: see bf16_choice
        return "bf16", f"CPU has {flag}"
    return "off", f"CPU ({platform.machine()}) has no bf16 matmul units (avx512_bf16/amx)"


# bf16 autocast adds a cast per op: it pays for big matmuls/convs and costs on tiny ones
# (bench/overhead.py: MLP 64-128-10 at batch 64 ran 1.65x slower, the digits CNN 2x faster).
MIN_BF16_GAIN = 1.1


_BF16_GAINS = {}   # (architecture, batch shapes) -> {"gain", "load"}, for this process


def bf16_choice(step, key, may_measure: str = "",
                device: torch.device = torch.device("cpu")) -> Choice:
    """'auto' on a CPU with bf16 units or a GPU with native bf16: measure this model's step
    both ways, keep the faster. On a GPU too: a small model's step is launch-bound, and
    autocast's casts are kernels of their own (the demo's CNN ran 1.18x slower in bf16 on
    an H200).

    bf16 only where the measurement's blocks decide it (blocks_decisive) and it gains at
    least MIN_BF16_GAIN: one noisy timing on a shared machine is no evidence, and fp32 is
    the program as written. A decisive gain is kept per architecture and batch shape on
    the machine, on disk, with the load it was measured under: a re-run cell, a second
    run or another process (the ranks of processes=N, Ray's workers) takes the same
    answer, until the load has moved by load_change_that_counts(). One within the noise
    is not kept: the next run measures again. $NBTRAIN_BF16_GAIN gives the gain instead.
    `key` says what was measured (the caller's, with the device). `may_measure`: '' to
    measure when nothing is known; else why not (a run too short to pay for it).

    Where nothing decided it, the device's default stays: fp32 on a CPU (bf16 there pays
    only on its units and for large enough ops), bf16 on a GPU (its tensor cores: 3.17x
    over TF32 on a transformer block on an H200, and half the activations' memory; a
    short run of a large model must not lose that for want of a measurement). On a GPU a
    decided gain under MIN_BF16_GAIN keeps bf16 too; only a decided loss turns it off.
    """
    units, gpu = bf16_units(device), device.type == "cuda"
    default = ("bf16", "bf16") if gpu else ("off", "fp32")
    try:
        gain, source, decisive = _bf16_gain(step, key, measure=not may_measure)
        if gain is None:
            return default[0], (f"{units}, and bf16 is not measured on this model "
                                f"({may_measure}): {default[1]}")
    except Exception as exc:   # the real first step will report the problem properly
        return default[0], (f"could not measure bf16 on this model ({type(exc).__name__}): "
                            f"{default[1]}")
    if not decisive:
        return default[0], (f"{units}; bf16 measured {gain:.2f}x of fp32 speed on this model, "
                            f"within the noise of the steps: {default[1]} (measured again "
                            "next run)")
    if gain >= MIN_BF16_GAIN or (gpu and gain >= 1):
        return "bf16", f"{units}; {source} {gain:.2f}x faster than fp32 on this model"
    return "off", (f"{units}, but bf16 {source} {gain:.2f}x of fp32 speed on this "
                   "model" + (" (slower)" if gain < 1 else " (too small to gain)"))


def bf16_units(device: torch.device) -> str:
    """What the device has for bf16, in words."""
    if device.type == "cuda":
        return f"{device_name(device)} has bf16 units"
    return f"CPU has {cpu_bf16_feature()}"


def device_name(device: torch.device) -> str:
    """Which device a measurement was made on, for its cache key: a GPU's gain is not its
    host CPU's."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _bf16_gain(step, key, measure: bool = True) -> Tuple[Optional[float], str, bool]:
    """(fp32 time / bf16 time, how it is known, decisive) for `key` on this machine;
    (None, '', False) when it is not known and not to be measured. A known gain was
    decisive (only such are kept) or given."""
    gain, source = known_bf16_gain(key)
    if gain is not None or not measure:
        return gain, source, gain is not None
    load = load_now()   # before: the probe's own steps add to it
    gain, decisive = measure_bf16_speedup(step)
    if decisive:
        remember_bf16_gain(key, gain, load)
    return gain, "measured", decisive


def known_bf16_gain(key) -> Tuple[Optional[float], str]:
    """(gain, how it is known) for `key` from $NBTRAIN_BF16_GAIN, this process or the disk;
    (None, '') when it was never measured here, or measured under another load."""
    if os.environ.get("NBTRAIN_BF16_GAIN"):
        return float(os.environ["NBTRAIN_BF16_GAIN"]), "given ($NBTRAIN_BF16_GAIN)"
    entry, source = _BF16_GAINS.get(key), "measured"
    if entry is None:
        entry, source = _read_gain(key), "measured (earlier, on this machine)"
    if entry is None or load_moved(entry["load"]):
        return None, ""
    _BF16_GAINS[key] = entry
    return entry["gain"], source


def _read_gain(key) -> Optional[dict]:
    """The gain kept on disk for `key`, with its load; None when there is none, it is
    damaged, or it is from before gains carried their load (measured again)."""
    try:
        entry = json.loads(_gain_file(key).read_text())
        return {"gain": float(entry["gain"]), "load": float(entry["load"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_now() -> float:
    """The 1-minute load average; 0 where the platform keeps none (Windows)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def load_moved(load: float) -> bool:
    """Whether the load has moved since a timing taken under `load`, by more than
    load_change_that_counts(): other processes on the cores change what a step costs, so
    such a timing (the bf16 gain, probe.py's workers and threads) is not this machine's
    now."""
    return abs(load_now() - load) > load_change_that_counts()


def remember_bf16_gain(key, gain: float, load: Optional[float] = None) -> None:
    """Keep a measured gain for `key` with the 1-minute load average it was measured under
    (now's where not given), in this process and on disk (a read-only home: in this
    process only)."""
    entry = {"gain": gain, "load": load_now() if load is None else load}
    _BF16_GAINS[key] = entry
    from .files import atomic_write
    with contextlib.suppress(OSError), atomic_write(_gain_file(key), "w") as f:
        json.dump({**entry, "key": repr(key)[:2000]}, f)


def _gain_file(key):
    from .files import cache_dir
    machine = (repr(key), cpuinfo("model name"), platform.node(), torch.__version__,
               torch.get_num_threads())
    digest = hashlib.sha256(repr(machine).encode()).hexdigest()[:20]
    return cache_dir() / "bf16" / f"{digest}.json"


def seed_all(seed: int) -> None:
    """torch.manual_seed(seed), without its cost on a machine with only a CPU: there it also
    queues a seed for each absent accelerator with a formatted stack trace (lazy init),
    half a millisecond a call, which a short fit in a re-run cell pays every time."""
    xpu = getattr(torch, "xpu", None)
    if torch.cuda.is_available() or torch.backends.mps.is_available() or \
            (xpu is not None and xpu.is_available()):
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


_NO_AUTOCAST = contextlib.nullcontext()   # reusable: nothing to set up per step


def autocast_context(amp: str, device: torch.device):
    """A context manager for one forward pass: a fresh autocast, or nothing at all."""
    if amp == "off":
        return _NO_AUTOCAST
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


# the probe's blocks, fp32 and bf16 in ABBA order so that a drift of the machine's speed
# weighs on both alike, as in the watch's Bf16Trial; 2 + 16 = 18 steps in all, at most 5%
# of the demo's 368-step runs (prepare.BF16_PROBE_STEPS). Single steps: for a rank test,
# 8 blocks each decide a real 1.2x where 4 blocks of 2 steps left it within the noise in
# one demo of five (bench/demo_stability.py)
BF16_PROBE_ORDER = ("off", "bf16", "bf16", "off") * 4
BF16_PROBE_BLOCK = 1   # steps a block


def measure_bf16_speedup(step) -> Tuple[float, bool]:
    """(fp32 time / bf16 time of `step(amp)` (one forward+backward), decisive): the median
    of each precision's blocks' time per step, after one warm-up step each, and whether
    the blocks decide it beyond their noise (blocks_decisive)."""
    for amp in ("off", "bf16"):
        step(amp)
    per_step = {"off": [], "bf16": []}
    for amp in BF16_PROBE_ORDER:
        start = time.perf_counter()
        for _ in range(BF16_PROBE_BLOCK):
            step(amp)
        per_step[amp].append((time.perf_counter() - start) / BF16_PROBE_BLOCK)
    fp32, bf16 = per_step["off"], per_step["bf16"]
    return statistics.median(fp32) / statistics.median(bf16), blocks_decisive(fp32, bf16)


def blocks_decisive(fp32_s, bf16_s, level: float = 0.05) -> bool:
    """Whether the blocks' times put bf16 faster or slower than fp32 beyond their noise: an
    exact rank test (Mann-Whitney's U: the pairs of blocks where bf16's was faster,
    against how often each U comes by chance alone over every order of the blocks), at
    `level` either way. With 3 blocks each that asks every bf16 block faster than every
    fp32 one (or every one slower: 1 order of 20); with 8 each, at most 15 of the 64 pairs
    the other way round. Anything else is within the noise of the blocks, whatever the
    medians say."""
    faster = sum(b < f for b in bf16_s for f in fp32_s)   # pairs where bf16's block won
    slower = sum(b > f for b in bf16_s for f in fp32_s)   # a tie counts for neither
    counts = _u_counts(len(fp32_s), len(bf16_s))          # symmetric: one tail serves both
    tail = min(sum(counts[faster:]), sum(counts[slower:]))
    return tail * 1000 <= round(level * 1000) * sum(counts)   # in integers: 3 each sit on 5%


@functools.lru_cache(maxsize=None)
def _u_counts(m: int, n: int) -> tuple:
    """counts[u]: the orders of m fp32 and n bf16 blocks with U = u. The slowest block is
    fp32 (it loses to all n bf16 blocks: u - n from the rest) or bf16 (it beats none)."""
    if m == 0 or n == 0:
        return (1,)
    size = m * n + 1
    counts = [0] * size
    for u, c in enumerate(_u_counts(m - 1, n)):
        counts[u + n] += c
    for u, c in enumerate(_u_counts(m, n - 1)):
        counts[u] += c
    return tuple(counts)


@contextlib.contextmanager
def intra_op_threads(threads: int):
    """torch's thread count for the run, then the notebook's again (it is process-wide)."""
    before = torch.get_num_threads()
    if threads != before:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def available_cores() -> int:
    """CPUs this process may use: its affinity mask and any cgroup CPU quota (Docker,
    Kubernetes, Binder), which `os.cpu_count()` ignores. joblib (a scikit-learn
    dependency) reads both; LOKY_MAX_CPU_COUNT caps it by hand. Reading the cgroup files
    costs about 0.3 ms, and the diagnosis asks once per record: the answer is kept until
    the cap or the affinity mask changes."""
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return _cores(os.environ.get("LOKY_MAX_CPU_COUNT"), frozenset(affinity or ()))


@functools.lru_cache(maxsize=8)
def _cores(cap, affinity) -> int:
    import joblib
    return joblib.cpu_count()


def load_change_that_counts() -> float:
    """How far the 1-minute load average must move before a timing taken under the old load
    is measured again (probe.py's workers and threads, flops.py's peak): half the cores,
    at least 1, since the load of a busy machine wanders by about one core anyway."""
    return max(1.0, available_cores() / 2)


def resolve_threads(requested, device: torch.device, workers: int) -> Choice:
    """Intra-op threads for the run. Worker processes load on the same cores as a CPU
    run's matmuls: both at full width oversubscribe them (bench/threads.py: 1 worker on
    2 cores ran 1.8x faster with 1 training thread than with 2)."""
    current = torch.get_num_threads()
    if requested != "auto":
        return requested, "asked for"
    if device.type != "cpu" or workers == 0:
        return current, "torch's setting: no worker process shares the cores with training"
    cores = available_cores()
    threads = max(1, min(current, cores - workers))
    return threads, (f"{workers} worker process(es) load on the other cores: training keeps "
                     f"{threads} of {cores}")
