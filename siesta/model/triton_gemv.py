"""Skinny GEMM ("GEMV") in Triton for decode: ``y = x @ W.T (+ bias)`` with few rows in ``x``.

At batch 1..8 a linear layer reads its whole weight to produce a handful of
outputs, so it is bound by HBM bandwidth alone. cuBLAS picks tiles made for large
M and leaves bandwidth unused on mid-sized matrices (split-K plus a separate
reduce on a square 4096x4096, for instance); this kernel is shaped for the job:

* ``x`` is ``[M, K]`` with ``M <= MAX_GEMV_ROWS``, ``W`` is ``[N, K]`` with K
  contiguous (the layout ``nn.Linear`` stores). Each program owns ``block_n`` rows
  of W (output columns) for every row of x and streams them once along K in
  ``block_k`` chunks, so every weight byte is read once, in coalesced runs along K.
  The x chunks it reads next to them are tiny and shared by all programs (L2 hits).
* Products are accumulated in fp32 and rounded once to x's dtype at the end.
* Two ways to reduce over K, picked by ``GemvConfig.tensor_cores``: products
  accumulated elementwise in a ``[M, block_n, block_k]`` fp32 tile on the CUDA cores
  and summed once after the loop (no padding, best for one row), or ``tl.dot`` with
  the rows of x padded to ``DOT_MIN_ROWS`` (the tensor cores do the multiply-adds,
  which wins from 2 rows on). Either way the loads are software-pipelined
  ``num_stages`` deep through shared memory.
* ``split_k > 1`` gives each output tile to ``split_k`` programs, each over a slice
  of K, so that a matrix with few output tiles (N=4096) has more programs. They
  write fp32 partial sums and a second small kernel adds them up in a fixed order
  (deterministic, unlike atomics, and no buffer to zero first). On an H200 it lost
  to deeper pipelining on every Llama-3-8B shape; it stays for other GPUs and shapes.

Measured on an H200 (``python -m siesta.bench.gemv``, bf16, CUDA graphs, weights
beyond L2), at M=1 with the default configs: qkv 1.06x and o_proj 1.11x faster than
cuBLAS, down 1.05x, lm_head 1.02x, gate_up even; one Llama-3-8B decode step's GEMMs
3.92 -> 3.79 ms. At M=2..8 the defaults are within 5% of cuBLAS: ahead on qkv,
o_proj and lm_head, behind on down and (in most runs) gate_up.

Launches never synchronise with the host and only allocate the output (and the
fixed-size partial buffer), so they can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from siesta import pdl
from siesta.model.linear_operands import check_linear_operands

# Most rows of x the kernel takes: beyond this a tiled GEMM (cuBLAS) reuses each
# weight tile across enough rows to win.
MAX_GEMV_ROWS = 8
# tl.dot wants at least 16 rows on its left operand: x is padded up to this.
DOT_MIN_ROWS = 16
# Elements per program of the split-K reduce (fp32 in, x's dtype out).
REDUCE_BLOCK = 1024
REDUCE_NUM_WARPS = 4
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# One row's add and RMSNorm folded into the next GEMV's loads (``add_norm_gemv``), where the
# norm was a launch of its own before it (1.9 us, twice a layer, in H200 run 63a's Qwen3-30B-A3B
# batch-1 step): for the q/k/v projection after a layer's input norm (``RMSNorm.add_norm_linear``).
# Off until a card measures it: the moe bench's ``knobs`` arm ``qkv_norm``.
FUSE_ADD_NORM = False


@dataclass(frozen=True)
class GemvConfig:
    """Tile shape and launch options of one ``gemv`` launch.

    ``block_n``: rows of W (output columns) per program; ``block_k``: K chunk read per
    loop step; ``split_k``: programs sharing one output tile along K (1: no split);
    ``tensor_cores``: reduce with ``tl.dot`` (x padded to 16 rows) instead of ``tl.sum``.
    """

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    tensor_cores: bool = False

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {value}")
        if self.num_stages < 1 or self.split_k < 1:
            raise ValueError(f"GemvConfig needs num_stages >= 1 and split_k >= 1, got {self}")
        if self.tensor_cores and min(self.block_n, self.block_k) < DOT_MIN_ROWS:
            raise ValueError(f"tensor_cores needs block_n and block_k >= {DOT_MIN_ROWS}, got {self}")


# Defaults measured on an H200, bf16, Llama-3-8B decode shapes (N from 4096 to 128256).
_ONE_ROW = GemvConfig(block_n=16, block_k=512, num_warps=4, num_stages=3)
_FEW_ROWS = GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=4, tensor_cores=True)
# Matrices with at least this many outputs (gate_up, lm_head) ran faster one stage shallower.
_WIDE_N = 16384
_FEW_ROWS_WIDE = GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=3, tensor_cores=True)
# They were tuned for 2-byte dtypes: wider elements get proportionally shorter K
# chunks, so that the pipelined tiles still fit in shared memory.
_TUNED_ELEMENT_SIZE = 2


# One-row configs of particular matrices, ``(n, k) -> config`` of 2-byte weights, ahead of the
# rules below: a sweep's winners, which the moe bench's ``knobs`` part sweeps and A/Bs in a real
# decode step. Qwen3-30B-A3B's (H100 run 64b), µs default -> winner: qkv 10.5 -> 9.8, o_proj
# 8.6 -> 7.9, the router 3.3 -> 2.2 (its 128 rows made 8 programs of the default tile),
# lm_head 197.1 -> 196.1; that batch-1 step 1.03x (arm ``gemv``).
ONE_ROW_SHAPES: dict[tuple[int, int], GemvConfig] = {
    (5120, 2048): GemvConfig(block_n=8, block_k=256, num_warps=2, num_stages=4),
    (2048, 4096): GemvConfig(block_n=4, block_k=512, num_warps=4, num_stages=4),
    (128, 2048): GemvConfig(block_n=4, block_k=1024, num_warps=4, num_stages=3),
    (151936, 2048): GemvConfig(block_n=2, block_k=1024, num_warps=4, num_stages=2),
}


def default_config(m: int, n: int, k: int, element_size: int = _TUNED_ELEMENT_SIZE) -> GemvConfig:
    """A good config for ``[m, k] @ [n, k].T``, picked from ``python -m siesta.bench.gemv`` on an H200.

    One row: the tl.sum path, pipelined 3 deep, on small tiles (many programs, long
    K chunks), unless ``ONE_ROW_SHAPES`` names the matrix. More rows: tensor cores on
    64-row tiles. Split-K won no Llama-3-8B shape once the loads were pipelined, so it
    is only used when asked for.
    """
    if m <= 1 and element_size == _TUNED_ELEMENT_SIZE and (n, k) in ONE_ROW_SHAPES:
        return ONE_ROW_SHAPES[(n, k)]
    if m <= 1:
        config = _ONE_ROW
    else:
        config = _FEW_ROWS_WIDE if n >= _WIDE_N else _FEW_ROWS
    if element_size <= _TUNED_ELEMENT_SIZE:
        return config
    return replace(config, block_k=max(DOT_MIN_ROWS, config.block_k * _TUNED_ELEMENT_SIZE // element_size))


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    K_PER_SPLIT,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    TENSOR_CORES: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (n, s) computes ``out[s, :, n*BLOCK_N:(n+1)*BLOCK_N]`` over K slice s.

    With SPLIT_K == 1 ``out`` is y itself (bias added, x's dtype); otherwise an fp32
    ``[SPLIT_K, M, N]`` buffer of partial sums for ``_split_k_reduce_kernel``.
    """
    pdl.wait_for_previous_grid(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    # Out-of-range rows of W read real (repeated) rows instead of masked loads; their
    # results are dropped by the masked store. Padding rows of x are masked instead:
    # a masked row costs no memory traffic, and x is padded 16x for one row on tl.dot.
    rows_w = (offs_n % N).to(tl.int64)
    m_mask = offs_m < M
    k_start = pid_k * K_PER_SPLIT
    offs_k = k_start + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows_w[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]

    if TENSOR_CORES:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # An explicit num_stages makes Triton pipeline the loads through shared memory.
        for k0 in tl.range(0, K_PER_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
            x, w = _chunk(x_ptrs, w_ptrs, m_mask, offs_k, k0, K, EVEN_K)
            # fp32 inputs must not be rounded to tf32: the result would be worse than cuBLAS's.
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
    else:
        acc = summed_products(x_ptrs, w_ptrs, m_mask, offs_k, K, K_PER_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                              NUM_STAGES)  # fmt: skip

    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out_offs = pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows_w).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptr + out_offs, acc, mask=out_mask)


@triton.jit
def _chunk(x_ptrs, w_ptrs, m_mask, offs_k, k0, K, EVEN_K: tl.constexpr):
    """One K chunk of x's rows and W's rows (past K: zeros; padding rows of x: zeros, no traffic)."""
    if EVEN_K:
        return tl.load(x_ptrs, mask=m_mask[:, None], other=0.0), tl.load(w_ptrs)
    k_mask = (offs_k + k0) < K
    x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    return x, tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)


@triton.jit
def summed_products(x_ptrs, w_ptrs, m_mask, offs_k, K, K_PER_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr):  # fmt: skip
    """The tl.sum path's ``[BLOCK_M, BLOCK_N]`` fp32 products over one K slice, from the tiles at
    ``x_ptrs`` and ``w_ptrs`` (also the fused router's, ``triton_router``, so its logits are the
    GEMV's bits)."""
    # Elementwise products are summed over K only after the loop: a reduction per chunk would
    # cost shuffles (and shared memory across warps) on every step. An explicit num_stages makes
    # Triton pipeline the loads through shared memory (it only does so by itself for loads that
    # feed a tl.dot).
    acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K_PER_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
        x, w = _chunk(x_ptrs, w_ptrs, m_mask, offs_k, k0, K, EVEN_K)
        acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return tl.sum(acc3, axis=2)


@triton.jit
def _add_norm_gemv_kernel(
    h_ptr, res_ptr, norm_ptr, w_ptr, bias_ptr, out_ptr, sum_ptr, N, K, stride_wn, eps, mean_factor,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_ROW: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """One row's ``linear(norm(h + res))``: program n computes outputs ``[n * BLOCK_N, ...)``.

    Each program first takes the row's sum ``s = h + res`` (rounded to the dtype, as torch's add)
    whole, for its mean square; program 0 stores ``s``, the residual stream's next value. Its K
    loop then builds each chunk of the normed row as ``_rms_norm_kernel`` does, ``norm * (s *
    rsqrt(mean(s^2) + eps))`` rounded where it rounds, and multiplies it as the tl.sum path does
    (``summed_products``'s accumulator). Not the two launches' bits: the mean square's sum runs in
    another order, and here with the fused multiply-adds the GEMV's products take (the norm
    kernel is compiled without), so a normed value may round the other way."""
    pdl.wait_for_previous_grid(USE_PDL)
    pid_n = tl.program_id(0)
    dtype = h_ptr.dtype.element_ty
    offs_row = tl.arange(0, BLOCK_ROW)
    row_mask = offs_row < K
    s = (tl.load(h_ptr + offs_row, mask=row_mask, other=0.0).to(tl.float32)
         + tl.load(res_ptr + offs_row, mask=row_mask, other=0.0).to(tl.float32)).to(dtype)  # fmt: skip
    if pid_n == 0:
        tl.store(sum_ptr + offs_row, s, mask=row_mask)
    s32 = s.to(tl.float32)
    scale = tl.math.rsqrt(tl.sum(s32 * s32, axis=0) * mean_factor + eps)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + (offs_n % N).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc3 = tl.zeros((1, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + offs_k
        k_mask = kk < K
        if EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
        sk = (tl.load(h_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
              + tl.load(res_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)).to(dtype)  # fmt: skip
        normed = (sk.to(tl.float32) * scale).to(dtype)
        x = (tl.load(norm_ptr + kk, mask=k_mask, other=0.0).to(tl.float32) * normed.to(tl.float32)).to(dtype)
        acc3 += x.to(tl.float32)[None, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K
    acc = tl.sum(acc3, axis=2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + (offs_n % N)).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=(offs_n < N)[None, :])


@triton.jit
def _split_k_reduce_kernel(
    partial_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``y = sum_s partial[s] (+ bias)``, summed in split order so results are reproducible."""
    pdl.wait_for_previous_grid(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        total += tl.load(partial_ptr + s * M * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


def sum_path(config: GemvConfig) -> bool:
    """Whether ``config`` is the one-row tl.sum path in one pass (no split over K): the loop the
    fused kernels here and in ``triton_router`` follow."""
    return config.split_k == 1 and not config.tensor_cores


def add_norm_gemv(h: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                  bias: torch.Tensor | None, mean_factor: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(linear(rms_norm(h + residual)), h + residual)`` for one row ``h`` ``[1, K]`` in one launch
    (``_add_norm_gemv_kernel``): the add and the norm folded into the GEMV's loads. ``mean_factor``:
    what the norm multiplies the sum of squares by (``triton_ops.mean_factor``). The config is the
    one-row rule's (``sum_path`` of it; the caller checks)."""
    check_linear_operands("add_norm_gemv", h, weight, bias, SUPPORTED_DTYPES, 1)
    n, k = weight.shape
    if residual.shape != h.shape or residual.dtype != h.dtype or norm_weight.shape != (k,):
        raise ValueError(f"add_norm_gemv: h {tuple(h.shape)}, residual {tuple(residual.shape)} and a norm of "
                         f"{tuple(norm_weight.shape)} do not make one row of {k}")  # fmt: skip
    config = default_config(1, n, k, h.element_size())
    out = torch.empty((1, n), dtype=h.dtype, device=h.device)
    summed = torch.empty_like(h, memory_format=torch.contiguous_format)
    _add_norm_gemv_kernel[(triton.cdiv(n, config.block_n),)](
        h.contiguous(), residual.contiguous(), norm_weight, weight, bias if bias is not None else weight, out, summed,
        n, k, weight.stride(0), eps, mean_factor,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, BLOCK_ROW=triton.next_power_of_2(k),
        EVEN_K=k % config.block_k == 0, HAS_BIAS=bias is not None, NUM_STAGES=config.num_stages,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch(h.device),
    )  # fmt: skip
    return out, summed


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: GemvConfig | None = None
) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)`` for ``x`` of 1..MAX_GEMV_ROWS rows.

    ``x`` is ``[M, K]``, ``weight`` ``[N, K]`` (each contiguous along K, rows may be
    strided), ``bias`` ``[N]`` or None. Returns a new contiguous ``[M, N]`` tensor of
    x's dtype, accumulated in fp32.
    """
    check_linear_operands("gemv", x, weight, bias, SUPPORTED_DTYPES, MAX_GEMV_ROWS)
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if config is None:
        config = default_config(m, n, k, x.element_size())
    # Each split covers a whole number of K chunks; the last may run past K (masked).
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    even_k = k % (config.block_k * config.split_k) == 0
    block_m = DOT_MIN_ROWS if config.tensor_cores else triton.next_power_of_2(m)
    if config.split_k == 1:
        target = out
    else:
        target = torch.empty((config.split_k, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, config.block_n), config.split_k)
    _gemv_kernel[grid](
        x,
        weight,
        bias if bias is not None else x,  # never read without HAS_BIAS
        target,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        k_per_split,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        EVEN_K=even_k,
        HAS_BIAS=bias is not None,
        SPLIT_K=config.split_k,
        TENSOR_CORES=config.tensor_cores,
        NUM_STAGES=config.num_stages,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl.launch(x.device),
    )
    if config.split_k > 1:
        _split_k_reduce_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
            target,
            bias if bias is not None else target,
            out,
            m,
            n,
            SPLIT_K=config.split_k,
            HAS_BIAS=bias is not None,
            BLOCK=REDUCE_BLOCK,
            num_warps=REDUCE_NUM_WARPS,
            **pdl.launch(x.device),
        )
    return out
