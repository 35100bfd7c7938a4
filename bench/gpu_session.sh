#!/usr/bin/env bash
# The GPU checks of one short lease, in one call: bench/gpu.py (ViT-B/32 at 224 px: the figures that
# `mergeflow plan --calibration` reads) and tests/test_cuda.py, on a machine that has its own torch and timm but
# not this project's environment (pydantic, where it lacks it, from .whl when that folder travels with the call).
#
#   bash bench/gpu_session.sh                      # on the GPU machine; files under $OUT (default: gpu-out)
#   bash bench/gpu_session.sh --tiny --device cpu  # a dry run here: a 2-block ViT on the CPU (the tests skip)
#
# .whl (git-ignored) is made where pip reaches the package index, for the GPU machine's Python 3.12:
#   python -m pip download -d .whl --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types typing-inspection
#
# Writes gpu.txt (the GPU, driver, torch and timm), gpu-bench.json and bench.log, cuda-tests.log. Each part has a
# time limit (BENCH_TIMEOUT, TESTS_TIMEOUT seconds) so that one hung part leaves the other's figures.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
if ! python3 -c "import pydantic" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    python3 -c "import torch, timm; print('torch', torch.__version__, 'timm', timm.__version__, 'cuda', torch.cuda.is_available())"
} | tee "$out/gpu.txt"
timeout "${BENCH_TIMEOUT:-330}" python3 bench/gpu.py --json "$out/gpu-bench.json" "$@" 2>&1 | tee "$out/bench.log"
bench=$?
timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_cuda.py 2>&1 | tee "$out/cuda-tests.log"
tests=$?
echo "bench/gpu.py: exit $bench; tests/test_cuda.py: exit $tests; files in $out"
exit $((bench || tests))
