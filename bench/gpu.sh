#!/usr/bin/env bash
# One GPU call: install the wheels the host lacks, check, time, print a table last, JSON under $OUT.
#   (here) ../shared/gpu/bundle-wheels .whl msgspec   # then run with carry [".whl"]
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1 SIESTA_CACHE_DIR=/tmp/siesta-cache
OUT=${OUT:-bench/results}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m siesta.bench.gpu --json "$OUT/gpu.json" "$@" 2>&1 | tee "$OUT/gpu.log"
