"""Batch invariance (``--deterministic``): a request's bits do not depend on what else runs.

A row's result may change with the batch around it wherever a kernel picks its reduction
order from the batch's shape. Deterministic mode takes each such place out, in this process:

* linears: on CUDA, every product through siesta's Triton GEMM (``triton_matmul``: one tile
  config per weight shape, K reduced in one order, rows independent), never cuBLAS, which picks
  its kernel by the row count; the MoE experts on one tile set (``triton_moe``); on the CPU,
  every fp32 row through siesta's kernel (``cpu_gemm.c``: one row against one weight row in a
  fixed order), in chunks, never MKL or oneDNN, whose blocking follows the row count;
* RMSNorm: the mean as a division by the width (torch's CUDA mean multiplies by a factor
  rounded from the row count);
* attention: one kernel, one tiling for prefill and decode rows (``select``);
* the sampler's softmax and log-softmax over the vocabulary: rows laid out 16-byte aligned
  whatever their index (``log_softmax``, ``softmax`` below).

What it costs is measured by ``bench/gpu.sh`` (decode and prefill against the default) and
said in README.md. Tensor parallelism's all-reduces are outside it: the mode is for one rank.
"""

from __future__ import annotations

import os

import torch

# cuBLAS's workspace: with none, no split-K in whatever GEMM still reaches it (a product that
# wants a backward). Not enough on its own: on an H100 cuBLAS's choice of kernel by M changed a
# row's bits (bench/results/gpu-h100-2026-12-06-run46c-*), hence ``triton_matmul``.
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


# torch's CUDA (log_)softmax over a row longer than 1024 reads it in 16-byte vectors from the
# row's first 16-byte boundary: which thread sums which element follows the row's address. Rows
# of V fp32 logits with V % 4 != 0 start at offsets that follow their index in the batch.
ROW_ALIGN_BYTES = 16


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """``x.log_softmax(dim=-1)``, each row's sums independent of its place in the batch."""
    if not _needs_aligned_rows(x):
        return x.log_softmax(dim=-1)
    return _aligned_rows(x).log_softmax(dim=-1)[..., : x.shape[-1]].contiguous()


def softmax(x: torch.Tensor) -> torch.Tensor:
    """``x.softmax(dim=-1)``, each row's sums independent of its place in the batch."""
    if not _needs_aligned_rows(x):
        return x.softmax(dim=-1)
    return _aligned_rows(x).softmax(dim=-1)[..., : x.shape[-1]].contiguous()


def _needs_aligned_rows(x: torch.Tensor) -> bool:
    return _enabled and x.is_cuda and (x.shape[-1] * x.element_size()) % ROW_ALIGN_BYTES != 0


def _aligned_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` copied into rows a multiple of 16 bytes long, padded with -inf (exp(-inf) = 0 adds
    nothing to a row's sum; its max is unchanged): every row then starts where the first does."""
    per_vector = ROW_ALIGN_BYTES // x.element_size()
    pad = -x.shape[-1] % per_vector
    return torch.nn.functional.pad(x, (0, pad), value=float("-inf"))
