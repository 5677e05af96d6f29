"""bf16 "auto": measured on the model's own steps, decided by a rank test, remembered per
model and machine."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import time
from typing import NamedTuple, Optional, Tuple

import torch

from ..data.nested import tensors_in
from ..kinds import Resolved
from ..machine import (
    cache_key,
    cpu_bf16_feature,
    device_name,
    gpu_has_bf16,
    load_moved,
    load_now,
    model_key,
)


def median(values) -> float:
    """The median, with the statistics module loaded at the first: a watch that measures
    nothing never loads it (fractions and decimal come with it, ~3 ms)."""
    from statistics import median as median_of
    return median_of(values)


def resolve_amp(requested: str, device: torch.device) -> Resolved:
    """The one amp ladder, nt.fit's and the watch's: 'off' | 'fp16' | 'bf16' with the
    reason, for `requested` on `device`. bf16 asked of a GPU without bf16 units runs
    emulated where torch can, else is a ConfigError; "auto" is auto_amp's candidate, which
    each engine then measures on the model (bf16_choice; the watch's trial)."""
    from ..config import ConfigError
    if requested == "auto":
        return auto_amp(device)
    if requested == "fp16" and device.type == "cpu":
        return "fp16", "asked for (on CPU fp16 autocast is usually slower than bf16)"
    if requested == "bf16" and device.type == "cuda" and not gpu_has_bf16(device):
        if not torch.cuda.is_bf16_supported():
            raise ConfigError("TrainConfig.amp='bf16' is not supported by this GPU "
                              f"({torch.cuda.get_device_name(device)}): use amp='fp16'.",
                              field="amp")
        return "bf16", "asked for (emulated on this GPU: usually slower than fp16)"
    return requested, "asked for"


def bf16_key(model, device: torch.device, inputs: tuple) -> tuple:
    """What a bf16 gain depends on, the same for nt.fit and the watch (a gain one measured,
    the other finds): the device, the model (machine.model_key), and `inputs`, the shapes
    and dtypes of the tensors its forward takes positionally in a batch (model_inputs)."""
    return "bf16", device_name(device), model_key(model), inputs


def model_inputs(args) -> tuple:
    """((shape, dtype), ...) of the tensors among a forward's positional arguments (two
    levels down: a list batch); a mapping passed as keywords has none."""
    return tuple((tuple(t.shape), t.dtype) for t in tensors_in(args))


def auto_amp(device: torch.device) -> Resolved:
    """The one "auto" precision ladder, nt.fit's and the watch's: bf16 where the device has
    bf16 units (then measured on the model: bf16_choice, the watch's trial), fp16 with a
    GradScaler on a GPU without them, else fp32."""
    if device.type == "cuda":
        if gpu_has_bf16(device):
            return "bf16", "GPU supports bf16 (same range as fp32, no loss scaling needed)"
        return "fp16", "GPU lacks bf16: fp16 with a GradScaler"
    if device.type == "mps":
        return "off", "autocast on MPS rarely pays off; use amp='fp16' to try it"
    flag = cpu_bf16_feature()
    if flag:
        return "bf16", f"CPU has {flag}"
    return "off", f"CPU ({platform.machine()}) has no bf16 matmul units (avx512_bf16/amx)"


# why a watch adds no autocast to a loop that runs its own (watcher/autocast.py says it, with
# the loop's dtype), read by the diagnosis: a loop under its own autocast is advised no amp
OWN_AUTOCAST = "your loop runs its forward under its own autocast"


# bf16 autocast adds a cast per op: it pays for big matmuls and convolutions and costs on
# tiny ones (docs/guide/measured.md), so a CPU takes it only for a clear gain.
MIN_BF16_GAIN = 1.1


class Verdict(NamedTuple):
    """The one bf16 decision: the amp to run, the median gain (fp32 time / bf16 time),
    whether the blocks decided it beyond their noise, and where they did not and their
    medians do not stand apart either (medians_apart), their spread in words (noise_words).
    gain_words says it."""
    amp: str
    gain: float
    decisive: bool
    noise: str = ""


def decide(fp32_s, bf16_s, default: str) -> Verdict:
    """bf16 or fp32 from blocks' times per step: `default` ('off' or 'bf16': what runs when
    nothing is decided) unless a rank test decides it (blocks_decisive)."""
    gain = median(fp32_s) / median(bf16_s)
    decisive = blocks_decisive(fp32_s, bf16_s)
    noise = "" if decisive or medians_apart(fp32_s, bf16_s) else noise_words(fp32_s, bf16_s)
    return Verdict(amp_for(gain, decisive, default), gain, decisive, noise)


def medians_apart(fp32_s, bf16_s) -> bool:
    """Whether either precision's median block lies outside the other's range of blocks: a
    difference larger than the blocks' own spread, which the ratio then says even where the
    rank test cannot decide (3 blocks each, one quick bf16 block: a 2.6x slowdown is slower,
    not noise). Blocks ranging over each other's medians (a busy machine's 2-40 ms against
    0.2-35 ms, docs/guide/measured.md) stand not apart: their ratio is noise."""
    fp32, bf16 = median(fp32_s), median(bf16_s)
    return not (min(fp32_s) <= bf16 <= max(fp32_s) and min(bf16_s) <= fp32 <= max(bf16_s))


def gain_words(verdict: Verdict, where: str = "") -> str:
    """The blocks' verdict in words that agree with its figure, nt.fit's probe's and the
    watch's trial's alike; `where` follows "fp32" (" on this model"). Decided: faster, only
    a little faster, or slower; undecided with the medians apart: the ratio, slower or
    faster, and that the blocks overlap; else each precision's range, never a ratio.

    >>> gain_words(decide([1e-3, 1.02e-3, 1.1e-3], [1.05e-3, 2.6e-3, 2.7e-3], "off"))
    "bf16 0.39x of fp32 (slower, though its blocks overlap fp32's)"
    """
    gain = verdict.gain
    if verdict.noise:
        return f"bf16 against fp32{where}: {verdict.noise}"
    if not verdict.decisive:
        way = "slower" if gain < 1 else "faster"
        return f"bf16 {gain:.2f}x of fp32{where} ({way}, though its blocks overlap fp32's)"
    if gain >= MIN_BF16_GAIN:
        return f"bf16 {gain:.2f}x faster than fp32{where}, beyond the noise of the blocks"
    if gain >= 1:
        return f"bf16 only {gain:.2f}x of fp32{where} (less than {MIN_BF16_GAIN}x)"
    return f"bf16 {gain:.2f}x of fp32{where} (slower)"


def noise_words(fp32_s, bf16_s) -> str:
    """Undecided blocks whose medians stand not apart, in words: each precision's range of
    step times, not the medians' ratio. Such a ratio is noise whatever its size
    (docs/guide/measured.md, the demo on a busy machine), and a ratio reads like a result."""
    return (f"no difference beyond the noise: fp32 steps took {_ms_range(fp32_s)}, bf16 steps "
            f"{_ms_range(bf16_s)}")


def _ms_range(seconds) -> str:
    return f"{min(seconds) * 1e3:.1f}-{max(seconds) * 1e3:.1f} ms"


def amp_for(gain: float, decisive: bool, default: str) -> str:
    """A decided gain of at least MIN_BF16_GAIN takes bf16; where bf16 is the default (a GPU
    under nt.fit: its tensor cores, half the activations' memory) only a decided loss
    turns it off. A measurement within the noise keeps the default."""
    if not decisive:
        return default
    if gain >= MIN_BF16_GAIN or (default == "bf16" and gain >= 1):
        return "bf16"
    return "off"


def default_amp(device: torch.device) -> str:
    """What nt.fit runs before bf16 is measured: bf16 on a GPU (a short run of a large model
    must not lose its tensor cores for want of a measurement), fp32 on a CPU."""
    return "bf16" if device.type == "cuda" else "off"


_BF16_GAINS = {}   # (architecture, batch shapes) -> {"gain", "load"}, for this process


def bf16_choice(step, key, may_measure: str = "",
                device: torch.device = torch.device("cpu")) -> Resolved:
    """nt.fit's amp='auto' on a CPU or GPU with bf16 units: this model's step timed both ways
    (measure_bf16_speedup) and judged by `decide`, or a gain known for `key`.

    A decisive gain is kept per architecture and batch shape on the machine, on disk, with
    the load it was measured under: a re-run cell, a second run or another process (the
    ranks of processes=N, Ray's workers) takes the same answer until the load has moved
    (machine.load_moved). One within the noise is not kept: the next run measures again.
    $NBTRAIN_BF16_GAIN gives the gain instead. `key` says what was measured (the caller's,
    with the device). `may_measure`: '' to measure when nothing is known; else why not (a
    run too short to pay for it)."""
    units, default = bf16_units(device), default_amp(device)
    words = {"bf16": "bf16", "off": "fp32"}[default]
    try:
        gain, source, decisive, said = _bf16_gain(step, key, default,
                                                  measure=not may_measure)
        if gain is None:
            return default, (f"{units}, and bf16 is not measured on this model "
                             f"({may_measure}): {words}")
    except Exception as exc:   # the real first step will report the problem properly
        return default, (f"could not measure bf16 on this model ({type(exc).__name__}): "
                         f"{words}")
    if not decisive:
        return default, f"{units}; {said}: {words} (measured again next run)"
    return decided_amp(gain, source, units, default)


def decided_amp(gain: float, source: str, units: str, default: str) -> Resolved:
    """The amp a decided (or given) gain takes, in words that agree with its figure:
    nt.fit's and the watch's alike."""
    if amp_for(gain, True, default) == "bf16":
        return "bf16", f"{units}; {source} {gain:.2f}x faster than fp32 on this model"
    return "off", (f"{units}, but bf16 {source} {gain:.2f}x of fp32 speed on this "
                   "model" + (" (slower)" if gain < 1 else " (too small to gain)"))


def bf16_units(device: torch.device) -> str:
    """What the device has for bf16, in words."""
    if device.type == "cuda":
        return f"{device_name(device)} has bf16 units"
    return f"CPU has {cpu_bf16_feature()}"


def _bf16_gain(step, key, default: str,
               measure: bool = True) -> Tuple[Optional[float], str, bool, str]:
    """(fp32 time / bf16 time, how it is known, decisive, where not the blocks' verdict in
    words: gain_words) for `key` on this machine; (None, '', False, '') when it is not known
    and not to be measured. A known gain was decisive (only such are kept) or given."""
    gain, source = known_bf16_gain(key)
    if gain is not None or not measure:
        return gain, source, gain is not None, ""
    load = load_now()   # before: the probe's own steps add to it
    verdict = measure_bf16_speedup(step, default)
    if verdict.decisive:
        remember_bf16_gain(key, verdict.gain, load)
    return verdict.gain, "measured", verdict.decisive, gain_words(verdict, " on this model")


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


def remember_bf16_gain(key, gain: float, load: Optional[float] = None) -> None:
    """Keep a measured gain for `key` with the 1-minute load average it was measured under
    (now's where not given), in this process and on disk (a read-only home: in this
    process only)."""
    entry = {"gain": gain, "load": load_now() if load is None else load}
    _BF16_GAINS[key] = entry
    from ..files import atomic_write
    with contextlib.suppress(OSError), atomic_write(_gain_file(key), "w", durable=False) as f:
        json.dump({**entry, "key": repr(key)[:2000]}, f)


def _gain_file(key):
    """Where `key`'s gain is kept on disk; a trial's blocks for it lie next to it
    (_blocks_file)."""
    from ..files import cache_dir
    what = {"bf16 gain": repr(key), "threads": torch.get_num_threads()}
    return cache_dir() / "bf16" / f"{cache_key(what)}.json"


_BF16_BLOCKS = {}   # key -> the blocks of a bf16 trial not yet decided, for this process


def bf16_blocks(key) -> Optional[dict]:
    """The blocks of a bf16 trial on `key` that earlier runs measured but that have not
    decided yet (the watch's short loops measure a few a run): {"off": [...], "bf16":
    [...]} (times per step), "runs" (the runs that measured them), "run_s" (the last
    run's length), "extras" (what bf16 steps cost beyond fp32's) and "load" (the
    first's). None when there are none, or they were measured under another load: like a
    gain, they are this machine's only while the load holds (machine.load_moved)."""
    entry = _BF16_BLOCKS.get(key) or _read_blocks(key)
    if entry is None or load_moved(entry["load"]):
        return None
    _BF16_BLOCKS[key] = entry
    return entry


def _read_blocks(key) -> Optional[dict]:
    """The blocks kept on disk for `key`; None when there are none or they are damaged."""
    try:
        entry = json.loads(_blocks_file(key).read_text())
        off, bf16 = [float(t) for t in entry["off"]], [float(t) for t in entry["bf16"]]
        return {"off": off, "bf16": bf16,
                "runs": int(entry["runs"]), "run_s": float(entry["run_s"]),
                "extras": [float(e) for e in entry["extras"]], "load": float(entry["load"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def keep_bf16_blocks(key, entry: dict) -> None:
    """Keep a trial's blocks for `key` (bf16_blocks' entry) in this process and on disk,
    for the next run of the same model to go on from."""
    _BF16_BLOCKS[key] = entry
    from ..files import atomic_write
    with contextlib.suppress(OSError), atomic_write(_blocks_file(key), "w", durable=False) as f:
        json.dump({**entry, "key": repr(key)[:2000]}, f)


def drop_bf16_blocks(key) -> None:
    """A trial on `key` has decided: its blocks are done with."""
    _BF16_BLOCKS.pop(key, None)
    with contextlib.suppress(OSError):
        _blocks_file(key).unlink(missing_ok=True)


def _blocks_file(key):
    return _gain_file(key).with_suffix(".blocks.json")


# the probe's blocks: fp32 and bf16 in ABBA order, so that a drift of the machine's speed
# weighs on both alike; single steps, since a rank test decides more often with more blocks
BF16_PROBE_ORDER = ("off", "bf16", "bf16", "off") * 4
BF16_PROBE_BLOCK = 1   # steps a block


def measure_bf16_speedup(step, default: str = "off") -> Verdict:
    """`decide` on `step(amp)` (one forward+backward) timed in BF16_PROBE_ORDER's blocks,
    after one warm-up step each."""
    for amp in ("off", "bf16"):
        step(amp)
    per_step = {"off": [], "bf16": []}
    for amp in BF16_PROBE_ORDER:
        start = time.perf_counter()
        for _ in range(BF16_PROBE_BLOCK):
            step(amp)
        per_step[amp].append((time.perf_counter() - start) / BF16_PROBE_BLOCK)
    return decide(per_step["off"], per_step["bf16"], default)


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


