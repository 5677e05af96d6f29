#!/usr/bin/env bash
# Every GPU check in one call to the GPU machine (about 6 minutes), e.g. from the device
# tool:   bash bench/gpu.sh
# That machine's python3 already has torch with CUDA, pytest, numpy, psutil, tqdm,
# scikit-learn, joblib and cloudpickle; nbtrain runs from src/ without an install, and the
# LMDB tests are left out (no lmdb there). Logs go to $OUT when it is set.
set -uo pipefail
out=${OUT:-/tmp}
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
# tests first, the bench even if one fails: both results are needed to fix anything
python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" -k "not lmdb" \
    tests/test_cuda.py tests/test_data.py tests/test_gpu_bench.py 2>&1 | tee "$out/tests.log"
python3 bench/gpu.py 2>&1 | tee "$out/gpu.md"
python3 bench/gpu_mfu.py 2>&1 | tee "$out/mfu.md"   # bf16 MFU against the table peak (issue 17)
# processes=N: scaling over the visible GPUs (one process each); with one GPU, the CPU table
python3 bench/processes.py --repeats 3 2>&1 | tee "$out/processes.md"
