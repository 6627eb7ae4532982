#!/usr/bin/env bash
# Issue 16's check on a CUDA machine, from the repo root: the CUDA tests, then the GPU benchmark.
#
#   bash bench/gpu_check.sh OUTDIR
#
# Writes OUTDIR/tests.log, OUTDIR/bench.log and OUTDIR/gpu_results.json. Exit status: non-zero
# when the tests or the benchmark failed.
set -uo pipefail
out="${1:?usage: bash bench/gpu_check.sh OUTDIR}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
nvidia-smi -L
ls /proc/driver/nvidia/gpus 2>&1 | head -3
"$PY" -c "import torch, grpc, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda,
      torch.cuda.is_available(), torch.cuda.device_count(), 'grpc', grpc.__version__, 'numpy', numpy.__version__)"
timeout 330 "$PY" -m pytest -p no:cacheprovider -q -k "cuda or gpus" \
    tests/test_gpus.py tests/test_adapters.py tests/test_examples.py 2>&1 | tee "$out/tests.log"
tests=${PIPESTATUS[0]}
timeout 300 "$PY" -m bench.gpu --seconds 10 --out "$out/gpu_results.json" 2>&1 | tee "$out/bench.log"
bench=${PIPESTATUS[0]}
echo "tests exit $tests, bench exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
