"""Linear layers of a CPU decode step through the compiled kernel (``linear_rows`` in
``siesta/attention/cpu_decode.c``, built with the decode attention kernel).

At a few rows a linear layer only streams its weights. MKL's gemm reads them at about
11 GB/s on the 2-core EPYC whatever the thread count; the kernel (OpenMP over the output
features) at 15-22 GB/s: every linear of a SmolLM2 step at 1 row in 24 ms against 49 ms
(1.9-2.8x at 1-8 rows). Past ``MAX_ROWS`` the product is compute-bound and gemm is the
better code.
"""

from __future__ import annotations

import ctypes

import torch

from siesta.attention.cpu_attention import load_kernel

MAX_ROWS = 8


def _takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if x.is_cuda or x.dim() != 2 or x.shape[0] > MAX_ROWS or x.shape[0] == 0:
        return False
    if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad):
        return False  # the kernel's output has no backward
    tensors = [x, weight] + ([bias] if bias is not None else [])
    fp32 = all(t.dtype == torch.float32 for t in tensors)
    return fp32 and weight.is_contiguous() and x.stride(-1) == 1 and (bias is None or bias.is_contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` for a few fp32 rows on the CPU; None where the kernel does not serve."""
    lib = load_kernel() if _takes(x, weight, bias) else None
    if lib is None or not hasattr(lib, "linear_rows"):
        return None
    n, k = weight.shape
    y = torch.empty((x.shape[0], n), dtype=torch.float32)
    f32 = ctypes.POINTER(ctypes.c_float)
    args = (ctypes.cast(x.data_ptr(), f32), x.stride(0), x.shape[0], ctypes.cast(weight.data_ptr(), f32), k,
            None if bias is None else ctypes.cast(bias.data_ptr(), f32), ctypes.cast(y.data_ptr(), f32), y.stride(0))  # fmt: skip
    lib.linear_rows(*args, 0, n)
    return y
