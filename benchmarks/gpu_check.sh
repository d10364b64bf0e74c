#!/usr/bin/env bash
# The model tests that one CUDA GPU can run, with a table of the results:
# TP=1 on cuda:0, uni and mp, float32 and bfloat16, greedy tokens checked
# against transformers on the same GPU (benchmarks/gpu_check.py), then the
# CUDA-only unit tests (tests that skip without a GPU).
#
#   benchmarks/gpu_check.sh             the project venv (.venv), or $PYTHON
#   benchmarks/gpu_check.sh --install   first make .venv-gpu and install the
#                                       project into it (pip; the PyPI torch
#                                       wheel for Linux is a CUDA build)
#
# Without an NVIDIA GPU, or with a torch that has no CUDA, it says so and
# exits 0 (skipped).  Exit 1: a check failed.
set -u
cd "$(dirname "$0")/.."

python="${PYTHON:-}"
if [ "${1:-}" = "--install" ]; then
    python3 -m venv .venv-gpu || exit 1
    .venv-gpu/bin/pip install -q -e ".[model,test]" || exit 1
    python=.venv-gpu/bin/python
    shift
fi
if [ -z "$python" ]; then
    if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi

if ! ls /dev/nvidia0 >/dev/null 2>&1 && ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: skipped: no NVIDIA GPU on this machine"
    exit 0
fi
if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" \
        2>/dev/null; then
    version=$("$python" -c "import torch; print(torch.__version__)" 2>/dev/null || echo none)
    echo "gpu_check: skipped: torch ($version) in $python sees no CUDA device" \
         "(a CPU build? run with --install, or set PYTHON to a venv with CUDA torch)"
    exit 0
fi
command -v nvidia-smi >/dev/null 2>&1 && \
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

status=0
PYTHONPATH="$PWD/src" "$python" benchmarks/gpu_check.py "$@" || status=1
# The unit tests written for a GPU (each skips without one), one at a time.
for test in "tests/models/test_sampler.py::test_to_host_list_from_cuda_goes_through_pinned_memory"; do
    if PYTHONPATH="$PWD/src" timeout 600 "$python" -m pytest -q -p no:cacheprovider "$test" \
            >/tmp/gpu_check_pytest.log 2>&1; then
        printf '%-80s PASS\n' "$test"
    else
        printf '%-80s FAIL (see /tmp/gpu_check_pytest.log)\n' "$test"
        status=1
    fi
done
exit $status
