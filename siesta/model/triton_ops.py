"""Fused Triton kernels for the decoder's small ops: RMSNorm (+ residual add), SiLU-and-mul, RoPE,
and Qwen3's per-head q/k RMSNorm with RoPE in one launch.

Each replaces a chain of torch ops (and their intermediate tensors) with one kernel
and reproduces the torch code in ``layers.py``/``llama.py`` rounding step by rounding
step, so that a model using them computes the same bits:

* Half types are computed in fp32 and rounded back to the tensor dtype after every
  operation that torch performs as a separate op (torch's half kernels do the same).
  A product of two fp16/bf16 values is exact in fp32, so one rounding gives the
  correctly rounded half product, as torch's does; and fp32 has enough bits
  (24 >= 2 * 11 + 2) that a sum rounded via fp32 equals the correctly rounded half
  sum, which is why LLVM may (and does) turn these pairs into native half ops.
* Divisions use ``div_rn`` (Triton's ``/`` is ``div.full.f32``, off by up to 2 ulp
  on NVIDIA), and launches pass ``enable_fp_fusion=False``: torch runs ``a * b + c``
  as separate ops, so a contracted FMA would round differently in fp32.
* SiLU's ``exp`` is libdevice's ``expf`` on CUDA, the function torch's CUDA SiLU
  calls. (Triton's ``tl.exp`` is an ``ex2.approx`` and differs in the last bit.)

One thing no kernel can reproduce is the order in which torch sums the squares of a
row for RMSNorm's mean: it depends on the device, on the CPU's vector width and, on
CUDA, on the number of rows in the batch (``Reduce.cuh`` picks its block shape from
both sizes). The fp32 sum may then differ in its last bit; everything after the sum
matches torch exactly (on CUDA torch's mean is ``sum * (rows / numel)``, on CPU
``sum / D``; both are reproduced).
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from siesta import pdl
from siesta.attention.triton_kv_write import row_num_warps
from siesta.model import batch_invariant

try:  # Dispatches to the backend's libdevice when compiled (CUDA or HIP).
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older Triton
    libdevice = None

# Columns per program of silu_and_mul: a row of the MLP's intermediate activations
# is long (thousands), so it is split to keep enough programs running for one token.
_SILU_BLOCK = 1024


def _use_libdevice(device: torch.device) -> bool:
    # The interpreter (CPU tensors) cannot call extern libdevice functions.
    return device.type == "cuda" and libdevice is not None


def _fp32(value: float) -> float:
    """``value`` rounded to the nearest float32, as a Python float."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _check_last_dim(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.stride(-1) == 1, "the last dimension must be contiguous"


# --------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    stride_x_row,
    stride_x_head,
    stride_res_row,
    stride_res_head,
    eps,
    mean_factor,
    NUM_HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    MEAN_BY_DIVISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program normalises one token: ``NUM_HEADS`` rows of ``DIM`` (1 for hidden states)."""
    pdl.wait_for_previous_grid(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < DIM
    mask = (offs_h[:, None] < NUM_HEADS) & mask_d[None, :]
    dtype = x_ptr.dtype.element_ty

    x_src = x_ptr + token * stride_x_row + offs_h[:, None] * stride_x_head + offs_d[None, :]
    x = tl.load(x_src, mask=mask, other=0.0)
    # Outputs are fresh contiguous [tokens, NUM_HEADS, DIM] tensors.
    dst = token * (NUM_HEADS * DIM) + offs_h[:, None] * DIM + offs_d[None, :]
    if HAS_RESIDUAL:
        res_src = residual_ptr + token * stride_res_row + offs_h[:, None] * stride_res_head + offs_d[None, :]
        res = tl.load(res_src, mask=mask, other=0.0)
        # torch's ``x + residual``: added in fp32, rounded to the dtype.
        x = (x.to(tl.float32) + res.to(tl.float32)).to(dtype)
        tl.store(sum_ptr + dst, x, mask=mask)

    x32 = x.to(tl.float32)
    # Masked lanes hold zeros, which leave the sum unchanged.
    total = tl.sum(x32 * x32, axis=1)
    if MEAN_BY_DIVISION:
        mean_sq = tl.math.div_rn(total, tl.full(total.shape, DIM, tl.float32))
    else:
        mean_sq = total * mean_factor
    scale = tl.math.rsqrt(mean_sq + eps)
    normed = (x32 * scale[:, None]).to(dtype)
    weight = tl.load(weight_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    out = weight[None, :] * normed.to(tl.float32)
    tl.store(out_ptr + dst, out.to(out_ptr.dtype.element_ty), mask=mask)


def _as_tokens_heads(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[tokens, heads, D]``: 2-D input gets one head, extra leading dims fold into tokens."""
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(1)
    if x.dim() == 3:
        return x
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def mean_factor(rows: int, dim: int) -> float:
    """The factor torch's CUDA mean multiplies the sum by: ``float(rows) / float(rows * dim)`` in fp32.

    (That is ``1/dim`` rounded to fp32 unless ``rows * dim`` is not a float32.) The
    division is done in double and rounded once more, which is exact for a quotient
    of two floats (53 >= 2 * 24 + 2 bits).
    """
    return _fp32(_fp32(float(rows)) / _fp32(float(rows * dim)))


def _rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert weight.dim() == 1 and weight.shape[0] == x.shape[-1], "weight must be [D]"
    assert weight.stride(0) == 1 or weight.shape[0] == 1, "weight must be contiguous"
    assert x.device == weight.device, "x and weight must be on the same device"
    _check_last_dim(x)
    # Same result dtype as torch's ``weight * normed``.
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    summed = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    x3 = _as_tokens_heads(x)
    num_tokens, num_heads, dim = x3.shape
    if x.numel() == 0:
        return out, summed
    if residual is not None:
        res3 = _as_tokens_heads(residual)
    else:
        res3 = x3  # unused
    block_h = triton.next_power_of_2(num_heads)
    block_d = triton.next_power_of_2(dim)
    _rms_norm_kernel[(num_tokens,)](
        x3,
        res3,
        weight,
        out,
        summed if summed is not None else out,
        x3.stride(0),
        x3.stride(1),
        res3.stride(0),
        res3.stride(1),
        eps,
        mean_factor(num_tokens * num_heads, dim),
        NUM_HEADS=num_heads,
        DIM=dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        HAS_RESIDUAL=residual is not None,
        # Deterministic mode: the division, since torch's CUDA factor follows the row count.
        MEAN_BY_DIVISION=x.device.type == "cpu" or batch_invariant.enabled(),
        num_warps=row_num_warps(block_h * block_d),
        enable_fp_fusion=False,
        **pdl.launch(x.device),
    )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm.forward``: ``weight * (x32 * rsqrt(mean(x32**2) + eps)).to(x.dtype)``.

    ``x`` is ``[..., D]``; every leading index is a row (``[T, D]`` hidden states or
    ``[T, H, D]`` q/k heads, which may be strided views). Returns a new contiguous
    tensor of dtype ``promote_types(weight.dtype, x.dtype)``.
    """
    return _rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` and ``rms_norm(s)`` in one pass; returns ``(normed, s)``, both new tensors."""
    assert x.shape == residual.shape, "x and residual must have the same shape"
    assert x.dtype == residual.dtype, "x and residual must have the same dtype"
    assert x.device == residual.device, "x and residual must be on the same device"
    _check_last_dim(residual)
    normed, summed = _rms_norm(x, residual, weight, eps)
    assert summed is not None
    return normed, summed


# ----------------------------------------------------------------------- SiLU-and-mul


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_row,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (row, b) computes columns ``[b * BLOCK, (b + 1) * BLOCK)`` of one row."""
    pdl.wait_for_previous_grid(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    dtype = gate_up_ptr.dtype.element_ty
    src = gate_up_ptr + row * stride_row + cols
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + INTER, mask=mask, other=0.0).to(tl.float32)
    # F.silu: x / (1 + exp(-x)) in fp32, rounded to the dtype; then the product rounds again.
    if USE_LIBDEVICE:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    act = tl.math.div_rn(gate, 1.0 + e).to(dtype)
    out = (act.to(tl.float32) * up).to(dtype)
    tl.store(out_ptr + row * INTER + cols, out, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for ``gate, up = gate_up.split([I, I], -1)``; ``gate_up`` is ``[T, 2I]``.

    Returns a new contiguous ``[T, I]`` tensor.
    """
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, "gate_up must be [T, 2I]"
    _check_last_dim(gate_up)
    num_tokens, width = gate_up.shape
    inter = width // 2
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    block = min(_SILU_BLOCK, triton.next_power_of_2(inter))
    use_libdevice = _use_libdevice(gate_up.device)
    # NVIDIA: libdevice without flush-to-zero, the expf torch (built without -ftz) runs.
    # (A CUDA-only option: other backends reject it.)
    options = {"enable_reflect_ftz": False} if use_libdevice and torch.version.hip is None else {}
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        gate_up,
        out,
        gate_up.stride(0),
        INTER=inter,
        BLOCK=block,
        USE_LIBDEVICE=use_libdevice,
        num_warps=row_num_warps(block),
        enable_fp_fusion=False,
        **options,
        **pdl.launch(gate_up.device),
    )
    return out


# ------------------------------------------------------------------------------ RoPE


@triton.jit
def _round_mul(a, b, dtype: tl.constexpr):
    """``a * b`` as torch computes it in ``dtype`` (inputs already hold ``dtype`` values), back in fp32."""
    return (a * b).to(dtype).to(tl.float32)


@triton.jit
def _rope_heads(
    src,
    stride_head,
    dst,
    cos_lo,
    cos_hi,
    sin_lo,
    sin_hi,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotate one token's heads: ``x * cos + rotate_half(x) * sin``, each op rounded like torch's."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    dtype = src.dtype.element_ty
    lo_src = src + offs_h[:, None] * stride_head + offs_d[None, :]
    x_lo = tl.load(lo_src, mask=mask, other=0.0).to(tl.float32)
    x_hi = tl.load(lo_src + HALF, mask=mask, other=0.0).to(tl.float32)
    _rotate_store(x_lo, x_hi, dst, cos_lo, cos_hi, sin_lo, sin_hi, HALF, BLOCK_H, BLOCK_HALF, mask, dtype)


@triton.jit
def _rotate_store(x_lo, x_hi, dst, cos_lo, cos_hi, sin_lo, sin_hi, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr, mask, dtype: tl.constexpr):  # fmt: skip
    """Store ``x * cos + rotate_half(x) * sin`` of heads held as fp32 halves (``dtype`` values)
    into contiguous ``[heads, 2 * HALF]`` rows at ``dst``, each op rounded like torch's."""
    # rotate_half(x) = cat(-x_hi, x_lo).
    out_lo = _round_mul(x_lo, cos_lo[None, :], dtype) + _round_mul(-x_hi, sin_lo[None, :], dtype)
    out_hi = _round_mul(x_hi, cos_hi[None, :], dtype) + _round_mul(x_lo, sin_hi[None, :], dtype)
    lo_dst = dst + tl.arange(0, BLOCK_H)[:, None] * (2 * HALF) + tl.arange(0, BLOCK_HALF)[None, :]
    tl.store(lo_dst, out_lo.to(dtype), mask=mask)
    tl.store(lo_dst + HALF, out_hi.to(dtype), mask=mask)


@triton.jit
def _rope_table(positions_ptr, cos_ptr, sin_ptr, token, stride_cos, stride_sin, dtype: tl.constexpr,
                HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):  # fmt: skip
    """``token``'s cos and sin halves: the fp32 tables rounded to the model dtype (torch:
    ``cos[positions].to(q.dtype)``), back in fp32."""
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    cos_row = cos_ptr + pos * stride_cos + offs_d
    sin_row = sin_ptr + pos * stride_sin + offs_d
    cos_lo = tl.load(cos_row, mask=mask_d, other=0.0).to(dtype).to(tl.float32)
    cos_hi = tl.load(cos_row + HALF, mask=mask_d, other=0.0).to(dtype).to(tl.float32)
    sin_lo = tl.load(sin_row, mask=mask_d, other=0.0).to(dtype).to(tl.float32)
    sin_hi = tl.load(sin_row + HALF, mask=mask_d, other=0.0).to(dtype).to(tl.float32)
    return cos_lo, cos_hi, sin_lo, sin_hi


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_cos,
    stride_sin,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program rotates every q and k head of one token."""
    pdl.wait_for_previous_grid(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cos_lo, cos_hi, sin_lo, sin_hi = _rope_table(
        positions_ptr, cos_ptr, sin_ptr, token, stride_cos, stride_sin, q_ptr.dtype.element_ty, HALF, BLOCK_HALF
    )
    _rope_heads(
        q_ptr + token * stride_q_token,
        stride_q_head,
        q_out_ptr + token * (NUM_Q_HEADS * 2 * HALF),
        cos_lo,
        cos_hi,
        sin_lo,
        sin_hi,
        NUM_Q_HEADS,
        HALF,
        BLOCK_HQ,
        BLOCK_HALF,
    )
    _rope_heads(
        k_ptr + token * stride_k_token,
        stride_k_head,
        k_out_ptr + token * (NUM_K_HEADS * 2 * HALF),
        cos_lo,
        cos_hi,
        sin_lo,
        sin_hi,
        NUM_K_HEADS,
        HALF,
        BLOCK_HK,
        BLOCK_HALF,
    )


def _rope_outputs(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation's arguments checked, and its fresh contiguous outputs."""
    assert q.dim() == 3 and k.dim() == 3, "q and k must be [T, heads, head_dim]"
    num_tokens, _, head_dim = q.shape
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim, "q and k must agree on T and head_dim"
    assert head_dim % 2 == 0, "head_dim must be even"
    assert q.dtype == k.dtype, "q and k must have the same dtype"
    assert positions.shape == (num_tokens,), "positions must be [T]"
    assert cos.dim() == 2 and cos.shape[1] == head_dim and sin.shape == cos.shape, "cos/sin must be [P, head_dim]"
    assert len({t.device for t in (q, k, positions, cos, sin)}) == 1, "all tensors must be on one device"
    _check_last_dim(q, k, cos, sin)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``RotaryEmbedding.forward``: rotate ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hk, D]`` at ``positions`` ``[T]``.

    ``cos``/``sin`` are the fp32 ``[max_positions, D]`` tables (rotate-half layout).
    ``q``/``k`` may be strided views (e.g. of a fused qkv projection); the results
    are new contiguous tensors.
    """
    q_out, k_out = _rope_outputs(q, k, positions, cos, sin)
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return q_out, k_out
    num_k_heads = k.shape[1]
    half = head_dim // 2
    block_hq = triton.next_power_of_2(num_q_heads)
    block_hk = triton.next_power_of_2(num_k_heads)
    block_half = triton.next_power_of_2(half)
    _rope_kernel[(num_tokens,)](
        q,
        k,
        positions,
        cos,
        sin,
        q_out,
        k_out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=num_k_heads,
        HALF=half,
        BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk,
        BLOCK_HALF=block_half,
        num_warps=row_num_warps(2 * block_hq * block_half),
        enable_fp_fusion=False,
        **pdl.launch(q.device),
    )
    return q_out, k_out


# ------------------------------------------------------------------- q/k norm + RoPE

# q heads per program of ``qk_norm_rope`` (None: all of a token's), its k heads one program more.
# One program for all 32 q heads and 4 k heads of a Qwen3-30B-A3B token took 3.2 us a layer of a
# batch-1 decode step (H200, run 63a): one SM's loads and reductions, one after another. 8 a
# program: that step 1.01x (H100 run 64b, the moe bench's ``knobs`` arm ``qk8``), the same bits.
QK_NORM_Q_HEADS_PER_PROGRAM: int | None = 8


@triton.jit
def _norm_rope_heads(
    src,
    stride_head,
    dst,
    w_ptr,
    eps,
    mean_factor,
    cos_lo,
    cos_hi,
    sin_lo,
    sin_hi,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    MEAN_BY_DIVISION: tl.constexpr,
):
    """``num_heads`` (at most BLOCK_H) heads of one token: ``_rms_norm_kernel``'s norm, then
    ``_rope_heads``' rotation, each rounded as those kernels round; the norm's output never leaves
    registers. Its sum of squares adds the two halves' sums, an order of its own (see the
    module's note on the sum)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    mask = (offs_h[:, None] < num_heads) & mask_d[None, :]
    dtype = src.dtype.element_ty
    lo_src = src + offs_h[:, None] * stride_head + offs_d[None, :]
    x_lo = tl.load(lo_src, mask=mask, other=0.0).to(tl.float32)
    x_hi = tl.load(lo_src + HALF, mask=mask, other=0.0).to(tl.float32)
    total = tl.sum(x_lo * x_lo, axis=1) + tl.sum(x_hi * x_hi, axis=1)
    if MEAN_BY_DIVISION:
        mean_sq = tl.math.div_rn(total, tl.full(total.shape, 2 * HALF, tl.float32))
    else:
        mean_sq = total * mean_factor
    scale = tl.math.rsqrt(mean_sq + eps)[:, None]
    w_lo = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    w_hi = tl.load(w_ptr + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    y_lo = _round_mul(w_lo, (x_lo * scale).to(dtype).to(tl.float32), dtype)
    y_hi = _round_mul(w_hi, (x_hi * scale).to(dtype).to(tl.float32), dtype)
    _rotate_store(y_lo, y_hi, dst, cos_lo, cos_hi, sin_lo, sin_hi, HALF, BLOCK_H, BLOCK_HALF, mask, dtype)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_cos,
    stride_sin,
    q_eps,
    k_eps,
    q_mean_factor,
    k_mean_factor,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    MEAN_BY_DIVISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (t, g) norms and rotates token t's q heads ``[g * BLOCK_HQ, (g + 1) * BLOCK_HQ)``,
    or, as the last g, its k heads: each head is its own norm, so the split changes no bits."""
    pdl.wait_for_previous_grid(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cos_lo, cos_hi, sin_lo, sin_hi = _rope_table(
        positions_ptr, cos_ptr, sin_ptr, token, stride_cos, stride_sin, q_ptr.dtype.element_ty, HALF, BLOCK_HALF
    )
    if group * BLOCK_HQ < NUM_Q_HEADS:
        first = group * BLOCK_HQ
        _norm_rope_heads(
            q_ptr + token * stride_q_token + first * stride_q_head, stride_q_head,
            q_out_ptr + (token * NUM_Q_HEADS + first) * (2 * HALF), q_weight_ptr, q_eps, q_mean_factor,
            cos_lo, cos_hi, sin_lo, sin_hi, NUM_Q_HEADS - first, HALF, BLOCK_HQ, BLOCK_HALF, MEAN_BY_DIVISION,
        )  # fmt: skip
    else:
        _norm_rope_heads(
            k_ptr + token * stride_k_token, stride_k_head, k_out_ptr + token * (NUM_K_HEADS * 2 * HALF), k_weight_ptr,
            k_eps, k_mean_factor, cos_lo, cos_hi, sin_lo, sin_hi, NUM_K_HEADS, HALF, BLOCK_HK, BLOCK_HALF,
            MEAN_BY_DIVISION,
        )  # fmt: skip


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    q_eps: float,
    k_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rope(rms_norm(q, q_weight), rms_norm(k, k_weight))`` in one launch (Qwen3's per-head
    q/k norm): the same roundings, up to the norm's sum of squares (its last bit, as between
    ``rms_norm`` and torch). The weights must have q's dtype, so the norm's output keeps it."""
    assert q_weight.dtype == q.dtype and k_weight.dtype == q.dtype, "the norm weights must have q's dtype"
    assert q_weight.shape == (q.shape[-1],) and k_weight.shape == (q.shape[-1],), "weights must be [head_dim]"
    assert q_weight.is_contiguous() and k_weight.is_contiguous(), "weights must be contiguous"
    q_out, k_out = _rope_outputs(q, k, positions, cos, sin)
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return q_out, k_out
    num_k_heads = k.shape[1]
    block_hq = triton.next_power_of_2(min(num_q_heads, QK_NORM_Q_HEADS_PER_PROGRAM or num_q_heads))
    block_half = triton.next_power_of_2(head_dim // 2)
    _qk_norm_rope_kernel[(num_tokens, triton.cdiv(num_q_heads, block_hq) + 1)](
        q, k, positions, cos, sin, q_weight, k_weight, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        q_eps, k_eps, mean_factor(num_tokens * num_q_heads, head_dim), mean_factor(num_tokens * num_k_heads, head_dim),
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HALF=head_dim // 2, BLOCK_HQ=block_hq,
        BLOCK_HK=triton.next_power_of_2(num_k_heads), BLOCK_HALF=block_half,
        MEAN_BY_DIVISION=q.device.type == "cpu" or batch_invariant.enabled(),
        num_warps=row_num_warps(2 * block_hq * block_half), enable_fp_fusion=False, **pdl.launch(q.device),
    )  # fmt: skip
    return q_out, k_out
