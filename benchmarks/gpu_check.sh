#!/usr/bin/env bash
# The torch executor on one NVIDIA GPU, in one go (at most 6 minutes): greedy parity with
# transformers (fp32, bf16), the Triton paged decode kernel, CUDA-graph replay, decode tok/s at
# batch 1/32/128 and a short serving run. See benchmarks/gpu_check.py; results in
# $OUT/gpu_check.json (or benchmarks/results/gpu_check.json).
#   bash benchmarks/gpu_check.sh
#   GPU_CHECK_TIMEOUT=900 bash benchmarks/gpu_check.sh --device cpu    # a rehearsal on the CPU
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 -c "import torch, triton, transformers, inferflow" 2>/dev/null; then
    echo "gpu_check needs torch (a CUDA build), triton, transformers and inferflow's deps:"
    echo "  pip install -e '.[torch]' transformers"
    exit 2
fi
exec timeout "${GPU_CHECK_TIMEOUT:-360}" python3 benchmarks/gpu_check.py "$@"
