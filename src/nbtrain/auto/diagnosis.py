"""The diagnosis: the bottleneck named from a record's time split and MFU, and the toggle
that targets it (read by the loop for each train record, and by the report)."""
from __future__ import annotations

import re
from typing import Optional

import torch

from ..machine import available_cores, cpu_bf16_feature, gpu_has_bf16
from . import frameworks
from .compiling import compile_findings
from .precision import OWN_AUTOCAST
from .rates import percent

INPUT_BOUND = 0.25     # a quarter of the step waiting for data is worth fixing first
# MFU bands (see flops.py). Large dense models reach 40-60% on GPUs (PaLM: 46%; nanoGPT's
# GPT-2 on A100s about 50%); a step far below that spends its time launching small kernels
# and in elementwise ops, which more work per kernel (batch) or fusion (compile) fixes.
LAUNCH_BOUND_MFU = 0.2
NEAR_PEAK_MFU = 0.5


def diagnose(fractions: dict, resolved: dict) -> str:
    """Name the bottleneck from the time split and suggest the toggle that targets it;
    then what a loop of your own spends that fit would not (nt.watch's counters, and
    `worst_host_read`: the row of run.host_reads() with the most reads a step)."""
    return "; ".join([_bottleneck(fractions, resolved), *own_loop_findings(fractions),
                      *host_read_findings(resolved), *compile_findings(resolved)])


def host_read_findings(resolved: dict) -> list:
    """Host reads per step that the run's settings imply (nt.watch counts a loop's own)."""
    device = torch.device(str(_value(resolved, "device", "cpu")))
    impl = _value(resolved, "optimizer_impl")
    if _value(resolved, "amp") != "fp16" or device.type == "cpu" or impl == "fused":
        return []
    # GradScaler.step reads its inf check back (found_inf.item() in _maybe_opt_step) unless
    # the optimizer takes the check on the device (_step_supports_amp_scaling: torch's
    # fused Adam, AdamW, SGD and Adagrad); nt.watch's scaler does the same
    # (watcher._hand_scale_to_kernel)
    whose = "your optimizer, unless it is a fused one," if impl == "its own" else \
        "a non-fused optimizer"
    return [f"fp16 with {whose} reads the GradScaler's inf check back to the host every "
            "step (each read waits for the queued kernels) - use optimizer_impl='fused' "
            "(adam, adamw, sgd, adagrad)" + (" or amp='bf16'" if _gpu_bf16(device) else "")]


def _gpu_bf16(device: torch.device) -> bool:
    return device.type == "cuda" and gpu_has_bf16(device)


def own_loop_findings(fractions: dict) -> list:
    """What nt.watch counted in the loop you wrote, each with the line to change."""
    findings = []
    reads = fractions.get("host_reads_per_step", 0.0)
    worst_read = fractions.get("worst_host_read")
    if reads >= 0.5 and worst_read and frameworks.IN_ITS_CODE in worst_read.where:
        findings.append(   # the framework's, not the user's: nothing of theirs to change
            f"the loop reads tensors back to the host {reads:.2g}x per step, the most at "
            f"{worst_read.where} ({worst_read.code}): on a GPU each read waits for every "
            "queued kernel; it is not in your code")
    elif reads >= 0.5:   # about every step (a read after the last step falls outside)
        findings.append(
            f"your loop reads tensors back to the host {reads:.2g}x per step"
            + (f", {_the_line(worst_read)}" if worst_read else " (loss.item(), .cpu(), print)")
            + ": on a GPU each read waits for every queued kernel - accumulate on the "
            f"device and read every log_every steps ({_accumulated(worst_read)}), or take "
            "the loss from run.history")
    if fractions.get("kept_losses_per_step", 0.0) >= 1:
        findings.append(
            "your loop keeps each step's loss with its graph (losses.append(loss)): memory "
            "grows step after step - keep loss.item() or loss.detach()")
    if fractions.get("collated_samples_per_step", 0.0) > 0:
        findings.append(
            "your DataLoader collates in-memory tensors sample by sample (a __getitem__ per "
            "sample, then a stack of the samples per batch) - index them instead (x[idx] for a shuffled idx), or let "
            "nt.watch do it (batched_fetch, on unless optimize=False)")
    return findings


def _the_line(read) -> str:
    return f"the most at {read.where}: {read.code} ({read.per_step:.2g}x per step)"


def _accumulated(read) -> str:
    """The line's replacement: the value it reads, summed on the device and read once
    every log_every steps (a read drains the GPU's queue however little it reads)."""
    value = "value"   # an expression the patterns do not find: the advice's shape
    found = read and re.search(r"([\w.\[\]]+?)\.(?:item|tolist|cpu|numpy)\(", read.code) or \
        read and re.search(r"\b(?:print|float|int)\(([\w.\[\]]+)\)", read.code)
    if found:
        value = found.group(1)
    return f"total += {value}.detach(), then total.item() every log_every steps"


def _bottleneck(fractions: dict, resolved: dict) -> str:
    wait = fractions.get("data_wait_frac", 0.0)
    copy = fractions.get("copy_frac", 0.0)
    if wait >= INPUT_BOUND:
        # on CUDA the data wait is the GPU's idle time while the host fetched (a fetch
        # hidden behind queued work costs nothing: telemetry.CudaTimer); the record then
        # has the host's own time as host_fetch_s
        waited = f"the GPU sat idle {wait:.0%} of each step waiting for data" \
            if "host_fetch_s" in fractions else f"{wait:.0%} of each step waited for data"
        if fractions.get("collated_samples_per_step", 0.0) > 0:   # nt.watch counted it
            return (f"input-bound: {waited}, collating in-memory tensors sample by sample "
                    "- index them instead (see below)")
        return f"input-bound: {waited} - try " + _input_fixes(resolved)
    if copy >= INPUT_BOUND:
        return (f"copy-bound: {copy:.0%} of each step copied batches to the device - try "
                + _copy_fixes(resolved))
    compute = fractions.get("compute_frac", 1.0 - wait - copy)
    mfu = fractions.get("mfu")
    if mfu is not None:
        return _mfu_diagnosis(mfu, resolved)
    return f"compute-bound: {compute:.0%} of each step in forward/backward/update - try " + \
        _compute_fixes(resolved)


def _mfu_diagnosis(mfu: float, resolved: dict) -> str:
    if mfu < LAUNCH_BOUND_MFU:
        tips = _batch_and_compile(resolved)
        return (f"compute-bound at {percent(mfu)} MFU: the step is {_overhead_bound(resolved)}"
                f" - try {' or '.join(tips)}")
    if mfu >= NEAR_PEAK_MFU:
        return f"compute-bound at {percent(mfu)} MFU: near the hardware" + _near_peak_tip(resolved)
    return f"compute-bound at {percent(mfu)} MFU - try " + _compute_fixes(resolved)


def _overhead_bound(resolved: dict) -> str:
    """Why a step far below the peak is slow: a GPU waits on kernel launches; a CPU has no
    launch, its cost is each operation's overhead (Python, dispatch) next to little work."""
    if str(_value(resolved, "device", "cpu")).startswith("cpu"):
        return "overhead-bound (too little work per operation for its Python and dispatch)"
    return "launch-bound (too little work per kernel)"


def _near_peak_tip(resolved: dict) -> str:
    amp = _amp_to_try(resolved)
    if amp:   # the peak itself is higher at half precision
        return f" for fp32 - amp={amp} raises the ceiling"
    return " - only less work (a smaller model, fewer steps) makes it faster"


def _value(resolved: dict, name: str, default=None):
    return resolved.get(name, (default, ""))[0]


def _input_fixes(resolved: dict) -> str:
    workers = _value(resolved, "num_workers", 0)
    framework = frameworks.framework_of(resolved)
    more = min(max((workers or 0) * 2, 2), available_cores())
    if framework is not None:   # its own knob, as its users write it
        return framework.workers.format(n=more)
    if _value(resolved, "loop") == frameworks.OWN:   # nt.watch: the line to change is the user's
        return (f"DataLoader(..., num_workers={more}, persistent_workers=True) in your loop, "
                "or a packed format (nt.data.pack_lmdb)")
    tips = []
    batched, why_batched = resolved.get("batched_fetch", (None, ""))
    if batched is False and workers == 0 and why_batched.startswith("batched_fetch off"):
        tips.append("batched_fetch=True")   # tensors loaded per sample: one index op instead
    if workers is not None and batched is False:
        tips.append(f"num_workers={min(max(workers * 2, 2), available_cores())}")
    if not _value(resolved, "data_on_device", True):
        tips.append("data_on_device=True")
    if workers:
        tips.append("prefetch_factor=4 / persistent_workers=True")
    elif "(packed " not in why_batched:   # not advised for what is packed already
        tips.append("a packed format (nt.data.pack_lmdb)")
    return " or ".join(tips or [f"num_workers={min(2, available_cores())}"])


def _copy_fixes(resolved: dict) -> str:
    """What moves fewer bytes per step, leaving out what the run already has."""
    tips = _not_on(resolved, data_on_device="data_on_device=True", pin_memory="pin_memory=True")
    return " or ".join(tips + ["a smaller input dtype (uint8 images, cast on the device)"])


def _compute_fixes(resolved: dict) -> str:
    amp = _amp_to_try(resolved)
    framework = frameworks.framework_of(resolved)
    if framework is not None:   # its own knobs, as its users write them
        tips = [framework.amp.format(amp=amp)] if amp else []
        return " / ".join(tips + _batch_and_compile(resolved)[::-1])
    if _value(resolved, "loop") == frameworks.OWN:   # nt.watch: what applies to your loop
        tips = [f"nt.watch(amp='{amp}')"] if amp else []
        return " / ".join(tips + _batch_and_compile(resolved)[::-1])
    tips = [f"amp={amp}"] if amp else []
    tips += _not_on(resolved, channels_last="channels_last=True (conv nets)")
    return " / ".join(tips + _batch_and_compile(resolved)[::-1])


def _batch_and_compile(resolved: dict) -> list:
    """A larger batch and torch.compile, as the run's loop takes them: nt.fit's settings,
    the line of the user's own loop, or the framework's knobs."""
    framework = frameworks.framework_of(resolved)
    if framework is not None:
        return [framework.batch, framework.compile]
    if _value(resolved, "loop") == frameworks.OWN:
        return ["a larger batch_size in your DataLoader", "model = torch.compile(model)"]
    return ["a larger batch_size"] + _not_on(resolved, compile="compile=True")


def _not_on(resolved: dict, **tips: str) -> list:
    """The tips (setting name -> advice) for settings the run does not have on: the
    advice never names what the run already has."""
    return [tip for name, tip in tips.items() if not _value(resolved, name)]


def _amp_to_try(resolved: dict) -> Optional[str]:
    """The autocast this machine runs fast, for a run without one; None where "auto"
    found none (a CPU without bf16 units, MPS) or measured bf16 slower on this model, or
    the loop runs its own autocast, so the advice never contradicts the reason shown
    beside amp."""
    amp, why = resolved.get("amp", (None, ""))
    if amp != "off" or "measured" in why or OWN_AUTOCAST in why:
        return None
    device = torch.device(str(_value(resolved, "device", "cpu")))
    if device.type == "cuda":
        return "bf16" if gpu_has_bf16(device) else "fp16"
    return "bf16" if device.type == "cpu" and cpu_bf16_feature() else None


