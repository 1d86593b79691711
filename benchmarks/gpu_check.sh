#!/usr/bin/env bash
# The torch executor on one NVIDIA GPU, in one go (README "GPU check"; benchmarks/gpu_check.py
# says what is checked). Three steps:
#   bash benchmarks/gpu_check.sh wheels     # here, with internet: the GPU machine's missing
#                                           # dependencies as cp312 manylinux wheels in .whl/
#                                           # (<= 40 MiB; benchmarks/gpu_wheels.py)
#   bash benchmarks/gpu_check.sh            # on the GPU: installs .whl/ (if there) into a
#                                           # temporary site dir, runs the check (<= 8 minutes),
#                                           # writes $OUT/gpu_check.json
#   bash benchmarks/gpu_check.sh rehearse   # here, on the CPU: the same path with tiny sizes
# Options after the step go to gpu_check.py (--budget SECONDS, --out FILE).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
step="${1:-run}"
[[ $# -gt 0 ]] && shift
case "$step" in
    wheels)
        exec python3 benchmarks/gpu_wheels.py --dest "${GPU_CHECK_WHEELS:-.whl}" "$@"
        ;;
    rehearse)
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
        exec timeout "${GPU_CHECK_TIMEOUT:-300}" python3 benchmarks/gpu_check.py --rehearse "$@"
        ;;
    run)
        wheels="${GPU_CHECK_WHEELS:-.whl}"
        if compgen -G "$wheels/*.whl" >/dev/null; then
            site="$(mktemp -d /tmp/inferflow-site-XXXX)"
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
                --target "$site" "$wheels"/*.whl
            export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
        fi
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
        if ! python3 -c "import torch, triton, transformers, hydra, litserve, inferflow" 2>/dev/null; then
            echo "gpu_check needs torch (a CUDA build), triton, transformers and inferflow's deps:"
            echo "  bash benchmarks/gpu_check.sh wheels   (on a machine with internet), then carry .whl"
            exit 2
        fi
        exec timeout "${GPU_CHECK_TIMEOUT:-480}" python3 benchmarks/gpu_check.py "$@"
        ;;
    *)
        echo "usage: bash benchmarks/gpu_check.sh [wheels|run|rehearse] [gpu_check.py options]" >&2
        exit 2
        ;;
esac
