"""Building blocks shared by the decoder: RMSNorm, rotary embeddings, fused projections.

On CUDA the small ops (norms, residual adds, rotary, SiLU-and-multiply) run as one
Triton kernel each (``triton_ops``), on the CPU in fp32 as one C kernel each
(``cpu_ops``), both matching the torch code here (the fallback, and the reference) bit
for bit except for the summation order of RMSNorm's fp32 sum of squares (and, on the
CPU, SiLU's exp). Fewer kernels per layer is what a batch-1 decode step and an
eager mixed step are short of.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from siesta.model import batch_invariant


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return _triton_ops().rms_norm(x, self.weight, self.eps)
        fused = _cpu_ops().rms_norm(x, self.weight, self.eps)
        return self._reference(x) if fused is None else fused[0]

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``: the residual stream's next value and its norm."""
        if x.is_cuda:
            return _triton_ops().fused_add_rms_norm(x, residual, self.weight, self.eps)
        fused = _cpu_ops().rms_norm(x, self.weight, self.eps, residual)
        if fused is not None:
            return fused
        total = x + residual
        return self._reference(total), total

    def add_norm_linear(self, x: torch.Tensor, residual: torch.Tensor, proj: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """``(proj(norm(x + residual)), x + residual)``, ``proj`` a ``Linear`` or ``MergedLinear``.
        With ``triton_gemv.FUSE_ADD_NORM``, a CUDA row that ``linear`` would send through the GEMV's
        one-row sum path has the add and the norm folded into that GEMV's loads: one launch fewer."""
        if folds_add_norm(x, proj.weight, self.weight):
            gemv = _triton_gemv()
            mean_factor = _triton_ops().mean_factor(1, x.shape[-1])
            return gemv.add_norm_gemv(x, residual, self.weight, self.eps, proj.weight, proj.bias, mean_factor)
        h, total = self.add_and_norm(x, residual)
        return proj(h), total

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, scale in the model dtype: the reference implementation's rounding.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings of a transformers config, old (rope_scaling) or new (rope_parameters) style."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def inverse_frequencies(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_type {kind!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions``, applied in the rotate-half layout."""

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.params = head_dim, max_positions, params
        self.build_tables(None)

    def build_tables(self, device: torch.device | None) -> None:
        """(Re)compute the fp32 tables, e.g. after the module was materialised from the meta device."""
        # Computed on the CPU, then moved: where the default device is meta, torch would trace
        # this through its decompositions, whose first use imports torch._dynamo (0.6 s).
        device = torch.get_default_device() if device is None else device
        inv_freq = inverse_frequencies(self.head_dim, self.params)
        freqs = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if q.is_cuda:
            return _triton_ops().apply_rope(q, k, positions, self.cos, self.sin)
        fused = _cpu_ops().rope(q, k, positions, self.cos, self.sin)
        if fused is not None:
            return fused
        cos = self.cos[positions].to(q.dtype)[:, None, :]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def norm_and_rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: RMSNorm,
                        k_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``self(positions, q_norm(q), k_norm(k))``; on CUDA one launch where there were three
        (96 fewer in a Qwen3-30B-A3B step, whose launches cost ~1.9 us of gap each, run 49d)."""
        if q.is_cuda and q_norm.weight.dtype == q.dtype == k_norm.weight.dtype:
            return _triton_ops().qk_norm_rope(q, k, positions, self.cos, self.sin, q_norm.weight, k_norm.weight,
                                              q_norm.eps, k_norm.eps)  # fmt: skip
        return self(positions, q_norm(q), k_norm(k))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for the two halves of a fused gate/up projection."""
    if gate_up.is_cuda:
        return _triton_ops().silu_and_mul(gate_up)
    fused = _cpu_ops().silu_and_mul(gate_up)
    if fused is not None:
        return fused
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; on the CPU a decode step's few fp32 rows go through a compiled kernel,
    on CUDA a single half-precision row through the Triton GEMV, and in deterministic mode every
    product through the batch-invariant Triton GEMM (``triton_matmul``)."""
    # The flag first: the default mode pays one read for the check.
    if batch_invariant.enabled() and use_invariant_matmul(x.device, _wants_grad(x, weight)):
        return _triton_matmul().linear(x, weight, bias)
    if not x.is_cuda:
        out = _cpu_linear().linear(x, weight, bias)
        if out is not None:
            return out
    elif takes_gemv(x, weight):
        return _triton_gemv().gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def use_invariant_matmul(device: torch.device, wants_grad: bool = False) -> bool:
    """Whether a linear on ``device`` takes the batch-invariant GEMM: deterministic mode on CUDA,
    where cuBLAS picks its kernel (and so a row's reduction order) by the row count. The CPU's
    deterministic mode has its own kernel (``cpu_linear``: ``cpu_gemm.c``). A product that needs a
    backward stays with torch: the kernel has none, and serving never asks for one."""
    return batch_invariant.enabled() and device.type == "cuda" and not wants_grad


def _wants_grad(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)


# Rows the Triton GEMV serves. H200, Llama-3-8B shapes, bf16 (``python -m siesta.bench.gemv``):
# at one row it beats cuBLAS on every matrix (qkv 1.06x, o_proj 1.11x, down 1.05x, lm_head
# 1.02x, gate_up even: a decode step's GEMMs 3.92 -> 3.79 ms); from two rows on it is even.
GEMV_ROWS = 1
_HALF_TYPES = (torch.float16, torch.bfloat16)


def takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` sends this product through the Triton GEMV."""
    if _wants_grad(x, weight):
        return False  # the kernel's output has no backward
    if batch_invariant.enabled():
        return False  # one row through it, more through another kernel: two reduction orders
    return (
        x.dim() == 2
        and x.shape[0] <= GEMV_ROWS
        and x.dtype in _HALF_TYPES
        and weight.dtype == x.dtype
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )


def folds_add_norm(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor) -> bool:
    """Whether ``RMSNorm.add_norm_linear`` folds its add and norm into the GEMV (the knob on, and
    a CUDA row the GEMV's one-row sum path takes, its norm weight of its dtype)."""
    if not x.is_cuda:
        return False
    gemv = _triton_gemv()
    if not (gemv.FUSE_ADD_NORM and takes_gemv(x, weight) and x.shape[0] == 1 and norm_weight.dtype == x.dtype):
        return False
    return gemv.sum_path(gemv.default_config(1, weight.shape[0], weight.shape[1], x.element_size()))


def _triton_gemv():
    # Imported on first CUDA use, as ``_triton_ops``.
    from siesta.model import triton_gemv

    return triton_gemv


def _triton_matmul():
    # Imported on first use in deterministic mode on CUDA, as ``_triton_ops``.
    from siesta.model import triton_matmul

    return triton_matmul


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) through ``linear``. Not initialised: every
    weight is loaded (see ``Embedding``)."""

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def fp32_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The product in fp32 (inputs, weights and sums), whatever the weights' dtype."""
        bias = None if self.bias is None else self.bias.float()
        return linear(x.float(), self.weight.float(), bias)


class Embedding(nn.Embedding):
    """``nn.Embedding``, not initialised: every weight is loaded. (Its normal init on the meta
    device goes through torch's decompositions, whose first use imports ``torch._dynamo``: 0.6 s
    of every engine process's start.)"""

    def reset_parameters(self) -> None:
        pass


def _cpu_linear():
    # Imported on first CPU use: it loads (and may build) the CPU kernels.
    from siesta.model import cpu_linear

    return cpu_linear


def _triton_ops():
    # Imported on first CUDA use: CPU-only installs never load Triton for these.
    from siesta.model import triton_ops

    return triton_ops


def _cpu_ops():
    # Imported on first CPU use: it loads (and may build) the CPU kernels.
    from siesta.model import cpu_ops

    return cpu_ops


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class MergedLinear(nn.Module):
    """One matmul for several projections of the same input (q/k/v, gate/up).

    Checkpoints store the parts separately; ``offsets`` says which rows each one's take
    (``CausalLM.weight_target`` cuts them into place).
    """

    def __init__(self, in_features: int, out_sizes: dict[str, int], bias: bool) -> None:
        super().__init__()
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in out_sizes.items():
            self.offsets[name] = (start, size)
            start += size
        self.weight = nn.Parameter(torch.empty(start, in_features))
        self.bias = nn.Parameter(torch.zeros(start)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
