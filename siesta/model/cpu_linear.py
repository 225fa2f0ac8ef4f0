"""Linear layers on the CPU (fp32, inference): a compiled kernel for a decode step's few rows,
MKL's or oneDNN's matmul for more.

At a few rows a linear layer only streams its weights. MKL's gemm reads them at about
11 GB/s on the 2-core EPYC whatever the thread count; the kernel (``linear_rows`` in
``siesta/attention/cpu_decode.c``, OpenMP over the output features) at 15-22 GB/s: every
linear of a SmolLM2 step at 1 row in 24 ms against 49 ms (1.9-2.8x at 1-8 rows). Past
``MAX_ROWS`` the product is compute-bound, and which library is faster depends on the CPU:
- on a 2-core AMD EPYC (AVX-512), MKL's sgemm (what ``F.linear`` calls) reaches about
  200 GFLOP/s at SmolLM2's shapes and oneDNN's matmul (the ``mkldnn`` build inside torch,
  JIT-compiled for the CPU it finds) 400-470, from 9 rows to a 2,048-token prefill;
- on a 2-core Intel Xeon (AVX-512, 2026-12-03) oneDNN runs at 0.8-1.0x MKL, at about
  300 GFLOP/s each (``bench/results/cpu-linear-intel-xeon-2core-2026-12-03.json``), and a
  2,000-token prefill is 5% faster on MKL.
So ``auto`` (``CpuConfig.matmul``) takes oneDNN on AMD CPUs, where MKL is known to take a
generic code path, and MKL elsewhere: a rule of the CPU's vendor rather than a timing at
start-up, so that every process on a machine multiplies with the same library and rounds the
same way. ``python -m siesta.bench.cpu_linear`` measures the three on a new CPU. Both read
the plain row-major weight, so weights written in place (a weight push, a reload) are what
they multiply: nothing is packed or cached.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from siesta.attention.cpu_attention import load_kernel
from siesta.config import CPU_MATMULS
from siesta.cpu_info import cpu_vendor

MAX_ROWS = 8
_AMD_VENDOR = "AuthenticAMD"
_library: str | None = None  # of products past MAX_ROWS: set_library's choice (None: auto's, when first asked)


def _fp32_inference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if x.is_cuda or x.dim() != 2 or x.shape[0] == 0:
        return False
    if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad):
        return False  # neither kernel's output has a backward
    tensors = [x, weight] + ([bias] if bias is not None else [])
    return all(t.dtype == torch.float32 for t in tensors)


def _takes_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    contiguous = weight.is_contiguous() and x.stride(-1) == 1 and (bias is None or bias.is_contiguous())
    return x.shape[0] <= MAX_ROWS and contiguous


@functools.cache
def onednn_matmul():
    """torch's oneDNN linear (``mkldnn::_linear_pointwise``), or None in a build without oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):  # an op torch does not register in this build
        return None


def resolve_library(name: str, vendor: str | None = None) -> str:
    """``mkl`` or ``onednn`` for a ``CpuConfig.matmul`` setting; ``auto`` by the CPU's vendor."""
    if name not in CPU_MATMULS:
        raise ValueError(f"the CPU matmul must be one of {', '.join(CPU_MATMULS)}, got {name!r}")
    if name == "auto":
        name = "onednn" if (cpu_vendor() if vendor is None else vendor) == _AMD_VENDOR else "mkl"
    if name == "onednn" and onednn_matmul() is None:
        return "mkl"  # this torch build has no oneDNN: F.linear is MKL's
    return name


def set_library(name: str) -> str:
    """Multiply rows past ``MAX_ROWS`` with ``name`` (see ``resolve_library``) in this process; the choice made."""
    global _library
    _library = resolve_library(name)
    return _library


def library() -> str:
    global _library
    if _library is None:
        _library = resolve_library("auto")
    return _library


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` for fp32 rows on the CPU; None where F.linear itself (MKL) serves."""
    if not _fp32_inference(x, weight, bias):
        return None
    if _takes_rows(x, weight, bias):
        out = _linear_rows(x, weight, bias)
        if out is not None:
            return out
    matmul = onednn_matmul() if library() == "onednn" else None
    return None if matmul is None else matmul(x, weight, bias, "none", [], "")


def _linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    lib = load_kernel()
    if lib is None or not hasattr(lib, "linear_rows"):
        return None
    n, k = weight.shape
    y = torch.empty((x.shape[0], n), dtype=torch.float32)
    f32 = ctypes.POINTER(ctypes.c_float)
    args = (ctypes.cast(x.data_ptr(), f32), x.stride(0), x.shape[0], ctypes.cast(weight.data_ptr(), f32), k,
            None if bias is None else ctypes.cast(bias.data_ptr(), f32), ctypes.cast(y.data_ptr(), f32), y.stride(0))  # fmt: skip
    lib.linear_rows(*args, 0, n)
    return y
