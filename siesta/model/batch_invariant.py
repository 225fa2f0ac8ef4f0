"""Batch invariance (``--deterministic``): a request's bits do not depend on what else runs.

A row's result may change with the batch around it wherever a kernel picks its reduction
order from the batch's shape. Deterministic mode takes each such place out, in this process:

* linears: on CUDA, cuBLAS without split-K (its one batch-dependent reduction on Hopper and
  later: vLLM's setting) and no one-row GEMV beside it; on the CPU, every fp32 row through
  siesta's kernel (``cpu_gemm.c``: one row against one weight row in a fixed order), in
  chunks, never MKL or oneDNN, whose blocking follows the row count;
* RMSNorm: the mean as a division by the width (torch's CUDA mean multiplies by a factor
  rounded from the row count);
* attention: one kernel, one tiling for prefill and decode rows (``select``).

What it costs is measured by ``bench/gpu.sh`` (decode and prefill against the default) and
said in README.md. Tensor parallelism's all-reduces are outside it: the mode is for one rank.
"""

from __future__ import annotations

import os

import torch

# cuBLAS's workspace: with none to split K into, its GEMMs reduce K in one order for any M.
CUBLAS_WORKSPACE_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}

_enabled = False


def enable() -> None:
    """Deterministic kernels from now on, in this process (there is no way back: a process
    that mixed modes would have computed some KV one way and some the other)."""
    global _enabled
    _enabled = True
    for name, value in CUBLAS_WORKSPACE_ENV.items():
        os.environ.setdefault(name, value)  # read when cuBLAS makes its handle: before the first GEMM
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False


def enabled() -> bool:
    return _enabled
