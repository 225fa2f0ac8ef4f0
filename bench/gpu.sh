#!/usr/bin/env bash
# One GPU call: install the wheels the host lacks, run the GPU-only tests, time, print a table last,
# JSON under $OUT.
# On a host with several GPUs, the tensor-parallel mode (8B and 70B shapes at 1, 2, 4, ... GPUs):
#   bash bench/gpu.sh --sections tensor_parallel [--tp-sizes 2,4,8] [--tp-models random:llama-3-8b]
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
# Tests that only a GPU can run (Triton in bf16, CUDA graphs, virtual-memory sleep).
GPU_TESTS=${SIESTA_GPU_TESTS:-tests/model/test_triton_ops.py tests/model/test_triton_gemv.py tests/model/test_triton_matmul.py tests/model/test_triton_moe.py tests/model/test_triton_router.py tests/tiers/test_transfer.py tests/tiers/test_join_ahead_cuda.py tests/core/test_vmm.py tests/core/test_piecewise_graphs.py tests/core/test_mixed_graphs.py tests/core/test_kept_rows.py tests/core/test_staging.py tests/core/test_argmax.py tests/core/test_sampler.py tests/attention tests/core/test_fp8_engine.py tests/weight_transfer/test_cuda_ipc.py tests/test_pdl.py tests/model/test_l2_prefetch.py tests/test_pinned.py tests/model/test_moe_sort.py tests/model/test_grouped_mm_moe.py}
if [ "$GPU_TESTS" != none ]; then
  timeout "${SIESTA_GPU_TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -x $GPU_TESTS -k "${SIESTA_GPU_TESTS_K:-}" 2>&1 \
    | tee "$OUT/gpu-tests.log" | tail -15
fi
python3 -m siesta.bench.gpu --json "$OUT/gpu.json" "$@" 2>&1 | tee "$OUT/gpu.log"
