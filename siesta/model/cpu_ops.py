"""A decoder layer's small ops on the CPU through ``cpu_ops.c``: RMSNorm (with the residual
add), rotary and SiLU-and-multiply, each one pass in place of torch's chain of ops.

Each function returns None where it does not serve (no C compiler, a dtype other than fp32,
a layout it does not take, a backward wanted): the caller's torch code runs instead.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from siesta import c_kernels
from siesta.c_kernels import CFLAGS, NATIVE

SOURCE = Path(__file__).with_name("cpu_ops.c")
# No fused multiply-adds and no reassociation (which would regroup products as well as
# sums): every product and sum rounds as torch's (see cpu_ops.c). The sums of squares still
# vectorize, as their `omp simd reduction` allows.
FLAGS = (*(f for f in CFLAGS if f != "-fassociative-math"), "-ffp-contract=off")

_I64, _F32P, _I64P = ctypes.c_int64, ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int64)
_SIGNATURES = {
    "rms_norm": [_F32P, _I64, _F32P, _I64, _F32P, _I64, _I64, _F32P, ctypes.c_float, _F32P],
    "rope": [_F32P, _I64, _I64, _I64, ctypes.c_int, ctypes.c_int, _I64P, _F32P, _F32P, _F32P],
    "silu_and_mul": [_F32P, _I64, _I64, _I64, _F32P],
}


@functools.cache
def load_ops(march: str = NATIVE) -> ctypes.CDLL | None:
    """The compiled ops for ``march`` (the engine's: this machine's); None without a C compiler
    or where they do not build."""
    lib = c_kernels.build("cpu_ops", SOURCE.read_bytes(), c_kernels.with_march(FLAGS, march))
    if lib is not None:
        for name, argtypes in _SIGNATURES.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = None
    return lib


def _ptr(t: torch.Tensor | None, kind=_F32P):
    return None if t is None else ctypes.cast(t.data_ptr(), kind)


def _serves(*tensors: torch.Tensor) -> bool:
    if any(t.dtype != torch.float32 or t.is_cuda for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def _rows(x: torch.Tensor) -> bool:
    """2-d with contiguous rows (any row stride)."""
    return x.dim() == 2 and x.stride(1) == 1


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(norm(x + residual), x + residual)`` (``residual`` None: ``(norm(x), x)``), or None."""
    tensors = [x, weight] + ([] if residual is None else [residual])
    lib = load_ops()
    if lib is None or not _serves(*tensors) or not all(_rows(t) for t in [x] + tensors[2:]):
        return None
    if not weight.is_contiguous() or weight.shape != x.shape[1:]:
        return None
    if residual is not None and residual.shape != x.shape:
        return None
    rows, dim = x.shape
    out = torch.empty((rows, dim), dtype=x.dtype)
    total = x if residual is None else torch.empty((rows, dim), dtype=x.dtype)
    lib.rms_norm(_ptr(x), x.stride(0), _ptr(residual), 0 if residual is None else residual.stride(0),
                 None if residual is None else _ptr(total), rows, dim, _ptr(weight), eps, _ptr(out))  # fmt: skip
    return out, total


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``q`` and ``k`` [tokens, heads, head_dim] rotated by ``positions``' rows of the tables, or None."""
    lib = load_ops()
    if lib is None or not _serves(q, k, cos, sin) or not all(_heads(t, q.shape[0], cos) for t in (q, k)):
        return None
    if positions.dtype != torch.int64 or not positions.is_contiguous() or positions.shape != q.shape[:1]:
        return None
    if not (cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape):
        return None
    if len(positions) and not 0 <= int(positions.min()) <= int(positions.max()) < cos.shape[0]:
        return None  # torch's indexing then raises for a position past the tables
    outs = []
    for x in (q, k):
        out = torch.empty(x.shape, dtype=x.dtype)
        lib.rope(_ptr(x), x.stride(0), x.stride(1), x.shape[0], x.shape[1], x.shape[2], _ptr(positions, _I64P),
                 _ptr(cos), _ptr(sin), _ptr(out))  # fmt: skip
        outs.append(out)
    return outs[0], outs[1]


def _heads(x: torch.Tensor, tokens: int, table: torch.Tensor) -> bool:
    """[tokens, heads, head_dim] with contiguous heads, head_dim even and the tables' width."""
    shape_ok = x.dim() == 3 and x.shape[0] == tokens and x.shape[2] % 2 == 0 and table.shape[1] == x.shape[2]
    return shape_ok and x.stride(2) == 1


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` for the two halves of each row, or None."""
    lib = load_ops()
    if lib is None or not _serves(gate_up) or not _rows(gate_up) or gate_up.shape[1] % 2:
        return None
    rows, dim = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, dim), dtype=gate_up.dtype)
    lib.silu_and_mul(_ptr(gate_up), gate_up.stride(0), rows, dim, _ptr(out))
    return out
