"""Linear layers on the CPU (fp32, inference): a compiled kernel up to ``MAX_ROWS`` rows (decode
steps, small mixed steps), MKL's or oneDNN's matmul for more.

Over a model's layers, a product of a few dozen rows streams every weight from memory and
does little work per weight. The BLAS libraries first wait for the weights and then
compute. The kernel (``linear_tiled`` in ``cpu_gemm.c``) prefetches the next weights while
it computes, so the two overlap. Its vector width and register tiles are the build target's
(AVX-512, AVX2, NEON); in_features must be a whole number of its vectors (``gemm_vec``). On
the 2-core EPYC (AVX-512, ~190 GFLOP/s fp32, 25 GB/s from memory), over SmolLM2's 30 layers
with weights cold as in a step, it runs:
- 1-8 rows, reading the weights at 23-28 GB/s, where oneDNN reads them at 11-15;
- 32 rows at 156 GFLOP/s against oneDNN's 107 and MKL's 78;
- 128 rows at 182 GFLOP/s against oneDNN's 163.
``python -m siesta.bench.cpu_linear`` times the paths, in cache and cold
(``bench/results/cpu-linear-amd-epyc-2core-2026-12-04.json``). Built for AVX2 (x86-64-v3) on
the 2-core Xeon, against MKL and oneDNN held to AVX2, cold: 84 GFLOP/s at 8 rows against 44,
153 at 32 against 108, even at 128 (195); in cache MKL's is ahead at 1 row (85 against 50)
and at 128 (0.92-1.0x) (``...-intel-xeon-2core-2026-12-04-avx2.json``).

Past ``MAX_ROWS`` the product is compute-bound, and which library is faster depends on the CPU:
- on the 2-core AMD EPYC, MKL's sgemm (what ``F.linear`` calls) takes a generic code path
  and oneDNN's matmul (the ``mkldnn`` build inside torch, JIT-compiled for the CPU it finds)
  is 1.4-1.6x faster at a 2,048-token prefill (~195 GFLOP/s);
- on a 2-core Intel Xeon (AVX-512, 2026-12-03) oneDNN runs at 0.8-1.0x MKL, at about
  300 GFLOP/s each (``bench/results/cpu-linear-intel-xeon-2core-2026-12-03.json``), and a
  2,000-token prefill is 5% faster on MKL.
So ``auto`` (``CpuConfig.matmul``) takes oneDNN on AMD CPUs and MKL elsewhere: a rule of the
CPU's vendor rather than a timing at start-up, so that every process on a machine multiplies
with the same library and rounds the same way. All three read the plain row-major weight, so
weights written in place (a weight push, a reload) are what they multiply: nothing is packed
or cached.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from siesta import c_kernels
from siesta.c_kernels import CFLAGS, NATIVE
from siesta.config import CPU_MATMULS
from siesta.cpu_info import cpu_vendor
from siesta.model import batch_invariant

SOURCE = Path(__file__).with_name("cpu_gemm.c")
# Its sums are written out as vectors; without reassociation the compiler keeps each one's
# order as written, the same in every row count's inlined copy (a row's bits, whatever its batch).
FLAGS = tuple(f for f in CFLAGS if f != "-fassociative-math")
_AMD_VENDOR = "AuthenticAMD"
# Rows up to which the kernel serves, where it beats the library. On the 2-core EPYC it is
# ahead of oneDNN up to ~256 rows on the layers' matrices and ~128 on the output head's. On the
# 2-core Xeon (AVX-512) it leads MKL at 32 rows (202 against 148 GFLOP/s, weights cold) and
# trails it at 128 (257 against 273): MKL's AVX-512 sgemm is the better one there sooner
# (bench/results/cpu-linear-intel-xeon-2core-2026-12-04-native.json).
_MAX_ROWS_BY_VENDOR = {_AMD_VENDOR: 128}
_MAX_ROWS_DEFAULT = 64
MAX_ROWS = _MAX_ROWS_BY_VENDOR.get(cpu_vendor(), _MAX_ROWS_DEFAULT)
# Deterministic mode's rows per kernel call: as many as it serves in the default mode on AMD,
# in cache on either vendor (a whole prefill chunk at once reads x from memory per tile).
INVARIANT_CHUNK_ROWS = 128
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
    if batch_invariant.enabled():
        return invariant_linear(x, weight, bias)
    if _takes_rows(x, weight, bias):
        out = linear_tiled(x, weight, bias)
        if out is not None:
            return out
    matmul = onednn_matmul() if library() == "onednn" else None
    return None if matmul is None else matmul(x, weight, bias, "none", [], "")


_I64, _F32P = ctypes.c_int64, ctypes.POINTER(ctypes.c_float)
_TILED_ARGTYPES = [
    _F32P, _I64, _I64,  # x, its row stride, rows
    _F32P, _I64, _I64, _F32P,  # weight [N, K], K, N, bias (or None)
    _F32P, _I64,  # y, its row stride
]  # fmt: skip


@functools.cache
def load_gemm(march: str = NATIVE) -> ctypes.CDLL | None:
    """The compiled kernel (``cpu_gemm.c``) for ``march`` (the engine's: this machine's), built
    once per source, flags and ISA; None without a C compiler or where it does not build."""
    lib = c_kernels.build("cpu_gemm", SOURCE.read_bytes(), c_kernels.with_march(FLAGS, march))
    if lib is not None:
        lib.linear_tiled.argtypes = _TILED_ARGTYPES
        lib.linear_tiled.restype = ctypes.c_int
        lib.gemm_vec.argtypes = []
        lib.gemm_vec.restype = ctypes.c_int
        lib.vec = lib.gemm_vec()  # floats a vector: 16 under AVX-512, 8 under AVX2, 4 on NEON
    return lib


def linear_tiled(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 lib: ctypes.CDLL | None = None) -> torch.Tensor | None:  # fmt: skip
    """The kernel's ``F.linear(x, weight, bias)`` (fp32, 2-d x with contiguous rows, a contiguous
    weight); None without a compiler or where in_features is not a whole number of the build's
    vectors. ``lib``: another build than ``load_gemm()``'s (a test's or a benchmark's)."""
    lib = lib or load_gemm()
    if lib is None:
        return None
    n, k = weight.shape
    if k == 0 or k % lib.vec:
        return None
    y = torch.empty((x.shape[0], n), dtype=torch.float32)
    if lib.linear_tiled(_ptr(x), x.stride(0), x.shape[0], _ptr(weight), k, n, _ptr(bias), _ptr(y), y.stride(0)):
        return None
    return y


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Every row through the kernel, ``INVARIANT_CHUNK_ROWS`` at a time (its rows' bits do not
    depend on how many there are), whatever the row count: deterministic mode's linear."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight, bias = weight.contiguous(), None if bias is None else bias.contiguous()
    chunks = [linear_tiled(x[i : i + INVARIANT_CHUNK_ROWS], weight, bias) for i in range(0, x.shape[0], INVARIANT_CHUNK_ROWS)]
    if any(c is None for c in chunks):
        raise RuntimeError(f"deterministic mode: the CPU linear kernel cannot take a [{x.shape[0]}, {weight.shape[1]}] "
                           f"x [{weight.shape[1]}, {weight.shape[0]}] product (checked at start-up: a bug)")  # fmt: skip
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def invariant_refusal(in_features: set[int]) -> str | None:
    """Why deterministic mode cannot run this model's linears on the CPU, or None."""
    lib = load_gemm()
    if lib is None:
        return "deterministic mode on the CPU needs its C linear kernel, and no C compiler built it"
    odd = sorted(k for k in in_features if k % lib.vec)
    return f"deterministic mode: the CPU linear kernel takes widths that are multiples of {lib.vec}, not {odd}" if odd else None


def _ptr(t: torch.Tensor | None):
    return None if t is None else ctypes.cast(t.data_ptr(), _F32P)
