#!/usr/bin/env bash
# Every GPU check in one call to the GPU machine: under 10 minutes of command time on one
# H200, each stage under its own timeout (a slow stage cannot eat the rest; the demo gets
# what is left of 585 s, at most its 100), e.g. from the device tool:   bash bench/gpu.sh
# That machine's python3 already has torch with CUDA, pytest, numpy, psutil, tqdm,
# scikit-learn, joblib and cloudpickle; nbtrain runs from src/ without an install. Logs go
# to $OUT when it is set: stages.log (every stage's output, its own tables included),
# checks.jsonl and summary.md. The last thing printed is one table of every check.
#
#   gpu            the GPU, the driver, torch                                     15 s
#   tests          the CUDA tests (syncs per step under set_sync_debug_mode, the
#                  workers' fork, amp measured on the GPU)                       130 s
#   sanitizer      the prefetch tests under TORCH_CUDA_SANITIZER=1 (stream races
#                  raise)                                                          60 s
#   data_paths     bench/gpu.py: pinned vs pageable GB/s, each data path's
#                  samples/s, GPU idle (profiler) against nbtrain's data wait,
#                  copy/compute overlap with prefetch against a plain-torch
#                  side-stream copy, copies by name (pinned/pageable), MFU, the
#                  diagnosis; a copy-bound case; syncs per step and their lines  150 s
#   precision_mfu  bench/gpu_mfu.py: AMP bf16/fp16 against TF32 and fp32 for a
#                  conv net and a transformer block, MFU with the prefetch on    150 s
#   own_loop       bench/own_loop.py --device cuda: nt.watch on the tutorial loop
#                  (its batches copied ahead from pinned memory, bf16), fp16
#                  with the watch's GradScaler too                               90 s
#   where_time_goes bench/gpu_where.py: run.modules() by CUDA events, run.peak() from the
#                  allocator, run.gaps(), run.host_reads() on planted causes  (unrun) 60 s
#   demo           `nbtrain demo` on the GPU: its rows add batched fetch, workers,
#                  pinned copies, prefetch, data on the GPU, bf16, the fused
#                  optimizer one at a time, each measured                        100 s
#   processes      bench/processes.py, only with several GPUs (one GPU each; with
#                  one it would time the CPU)                                     90 s
#   cell_processes bench/cell_processes.py, only with several GPUs: a hand-written loop
#                  cell on every GPU (%%fasttrain --processes auto) against one    90 s
set -uo pipefail
out=${OUT:-/tmp}
export PYTHONPATH=src PYTHONUNBUFFERED=1 NBTRAIN_BENCH_CHECKS="$out/checks.jsonl"
: > "$NBTRAIN_BENCH_CHECKS"
: > "$out/stages.log"

stage() {   # stage NAME SECONDS COMMAND...: run it under its timeout, log it, note how it ended
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  printf '\n## %s\n' "$name" | tee -a "$out/stages.log"
  timeout --kill-after=5 "$limit" "$@" 2>&1 | tee -a "$out/stages.log"   # one file: the
  # device tool brings back 8 at most
  local rc=${PIPESTATUS[0]} took=$((SECONDS - start)) what verdict=met
  what="exit $rc"
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then what="TIMED OUT"; fi
  if [ "$rc" != 0 ]; then verdict=MISSED; fi
  printf '{"check": "stage %s", "value": "%s after %d s", "target": "exit 0 within %d s", "verdict": "%s"}\n' \
    "$name" "$what" "$took" "$limit" "$verdict" >> "$NBTRAIN_BENCH_CHECKS"
}

stage gpu 15 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  python3 -c "import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda)"'
# the tests first, the benches even if one fails: both results are needed to fix anything
stage tests 130 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/test_cuda.py \
  tests/test_data.py::test_prefetcher_yields_batches_on_the_device \
  tests/test_data.py::test_loader_workers_never_collect_the_parents_garbage \
  tests/test_memory.py::test_leaves_no_trace_restores_the_cuda_rng
# the stream tests again under torch's CUDA sanitizer (a race on a side stream raises); on
# its own: on torch 2.11 it segfaulted in a generator's finalizer and took the suite along
stage sanitizer 60 env TORCH_CUDA_SANITIZER=1 python3 -X faulthandler -m pytest -q \
  -p no:cacheprovider -o addopts="-ra" tests/test_cuda.py -k "prefetch" \
  tests/test_data.py::test_prefetcher_yields_batches_on_the_device
stage data_paths 150 python3 bench/gpu.py
stage precision_mfu 150 python3 bench/gpu_mfu.py
stage own_loop 90 python3 bench/own_loop.py --device cuda --repeats 3 --epochs 3   # ~70 steps a call
stage where_time_goes 60 bash -c 'cd bench && PYTHONPATH=../src python3 gpu_where.py'
left=$((585 - SECONDS))   # the one call's 600 s, less the summary's
if [ "$left" -gt 10 ]; then   # never 0: `timeout 0` sets no limit at all
  stage demo $((left < 100 ? left : 100)) python3 -m nbtrain demo
fi
if [ "$(nvidia-smi -L | grep -c '^GPU')" -gt 1 ]; then
  stage processes 90 python3 bench/processes.py --repeats 3
  stage cell_processes 90 python3 bench/cell_processes.py --repeats 3
fi

echo
echo "## every check"
python3 bench/gpu.py --summary "$NBTRAIN_BENCH_CHECKS" | tee "$out/summary.md"
