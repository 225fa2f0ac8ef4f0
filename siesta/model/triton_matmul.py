"""Batch-invariant GEMM in Triton: ``y = x @ W.T (+ bias)``, deterministic mode's linears on CUDA.

Why not cuBLAS: it picks its kernel (tile shape, warp layout, the order a K step's products are
summed in, split-K or not) from the problem's shape, M included, so a row's bits follow the
number of rows beside it. Taking its workspace away (``batch_invariant.CUBLAS_WORKSPACE_ENV``)
removes split-K but not the choice of kernel: on an H100 one request decoded alone and in a batch
of 64 differed from the first decode step (``bench/results/gpu-h100-2026-12-06-run46c-*``).

What makes this kernel invariant:

* One tile config per ``(N, K, dtype)`` (``config_for``), never a function of M: the same
  BLOCK_M x BLOCK_N x BLOCK_K tile, warps and instruction shape for a 1-row decode and an
  8k-row prefill.
* Each output element is reduced by one program, over K in BLOCK_K chunks taken in order from
  k = 0, each chunk one ``tl.dot`` into the same fp32 accumulator: no split-K, no atomics, no
  second pass. The K tail is masked to zeros in both operands (adds exact zeros), and whether
  there is a tail depends on K alone.
* Rows are independent: a tensor-core MMA computes each output row from its own row of x alone,
  whatever row of the tile it sits in; rows past M are masked to zeros and never stored. So a
  row's result does not depend on M, on its position, or on the rows around it.
* ``M`` is not specialised (``do_not_specialize``): Triton would otherwise compile other
  variants for M == 1 or M % 16 == 0. What it does specialise on (pointer and stride alignment)
  changes how tiles are loaded (cp.async vectors or plain loads), never the MMA or its order.

Which program computes which tile (the grouped order that keeps W tiles in L2) does depend on M;
it moves work between SMs, never the arithmetic of an element.

Cost against cuBLAS, not measured yet (no GPU since it was written): ``bash bench/gpu.sh
--sections deterministic`` gives decode b1/b64/b256 and an 8k prefill for each mode, and
``python -m siesta.bench.invariant_matmul`` each Llama-3-8B matrix at M = 1, 64, 256, 8192.
vLLM reports -0.6% to -20% end to end for its persistent version of the same idea (128x128x64
tiles). Expected here, bf16: at decode the kernel is bound by the weight reads, as cuBLAS is,
but an N=4096 matrix (o_proj, down) has only 32 column tiles, so 32 SMs stream it where cuBLAS
spreads it wider: o_proj and down maybe 1.2-1.6x slower at M=1, gate_up and the LM head (224
and 1002 tiles) near even. At prefill a 64x128 tile on one warpgroup reaches less of the tensor
cores' rate than cuBLAS's larger tiles: the linears maybe 1.2-1.4x slower. BLOCK_N per shape is
the lever if the figures disagree (wider for prefill, narrower for decode parallelism): any
value is invariant as long as it is chosen from (N, K, dtype) only.

Launches never synchronise with the host and allocate only the output: CUDA graphs capture them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HALF_TYPES = (torch.float16, torch.bfloat16)
# tl.dot's smallest operand side.
DOT_MIN = 16


@dataclass(frozen=True)
class MatmulConfig:
    """Tile shape and launch options: ``block_m`` rows of x, ``block_n`` rows of W (output
    columns), ``block_k`` the reduction chunk; ``group_m`` row tiles per group of the launch
    order (L2 reuse of W tiles only: no effect on the bits)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "group_m", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"MatmulConfig.{name} must be a power of two, got {value}")
        if self.num_stages < 1:
            raise ValueError(f"MatmulConfig.num_stages must be >= 1, got {self.num_stages}")
        if min(self.block_m, self.block_n, self.block_k) < DOT_MIN:
            raise ValueError(f"MatmulConfig blocks must be >= {DOT_MIN} (tl.dot's minimum), got {self}")


# bf16/fp16: one warpgroup on a 64x128 tile (Hopper's wgmma m64n128k16), 4 stages of 24 KiB in
# shared memory. 64 rows, not 128: at decode (M <= 64) no MMA work is wasted on padding rows,
# which at 128 rows would cap an SM's rate below what its share of HBM bandwidth delivers.
HALF_CONFIG = MatmulConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4)
# fp32 (``--head-dtype float32``'s LM head, fp32 models): IEEE products on the CUDA cores (no
# TF32, whose 10-bit mantissa would be worse than cuBLAS's fp32), so smaller tiles.
FP32_CONFIG = MatmulConfig(block_m=64, block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=3)


def config_for(n: int, k: int, dtype: torch.dtype) -> MatmulConfig:
    """The one config of ``[*, k] @ [n, k].T`` in ``dtype``. Never takes M: that is the invariance.

    ``n`` and ``k`` are in the signature so that per-shape tuning needs no change of callers.
    """
    del n, k  # one config per dtype until the GPU figures say otherwise
    if dtype in _HALF_TYPES:
        return HALF_CONFIG
    if dtype == torch.float32:
        return FP32_CONFIG
    raise ValueError(f"invariant matmul takes {SUPPORTED_DTYPES}, got {dtype}")


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Program ``pid`` computes one BLOCK_M x BLOCK_N tile of ``out`` over the whole of K."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped launch order: GROUP_M row tiles sweep the same W tiles while they sit in L2.
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    # Columns past N read real (repeated) rows of W, dropped by the masked store; rows past M
    # are masked instead, so that a decode step's padding rows cost no memory traffic.
    rows_w = (offs_n % N).to(tl.int64)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + rows_w[:, None] * stride_wn + offs_k[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_mask = (offs_k + k0) < K
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_w).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & (offs_n[None, :] < N))


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"matmul needs x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"matmul: K mismatch, x is {tuple(x.shape)} and weight {tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"matmul needs x and weight of one dtype among {SUPPORTED_DTYPES}, got {x.dtype}, {weight.dtype}"
        )
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("matmul needs x and weight contiguous along K (stride 1 in the last dimension)")
    if x.device != weight.device:
        raise ValueError(f"matmul: x is on {x.device} and weight on {weight.device}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.stride(0) != 1 or bias.device != x.device):
        raise ValueError(f"matmul needs a contiguous bias of shape ({weight.shape[0]},) on {x.device}")


def matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: MatmulConfig | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` ``[M, K]``, ``weight`` ``[N, K]`` (each contiguous
    along K), ``bias`` ``[N]`` or None: a new contiguous ``[M, N]`` tensor of x's dtype, summed in
    fp32, each row's bits independent of M and of the other rows. ``config`` is for tests."""
    _check_inputs(x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    config = config or config_for(n, k, x.dtype)
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    _matmul_kernel[grid](
        x, weight, bias if bias is not None else x, out,  # bias is never read without HAS_BIAS
        m, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        EVEN_K=k % config.block_k == 0, HAS_BIAS=bias is not None,
        # fp32 must not be rounded to TF32 (Triton's default for fp32 dots); ignored for 16-bit.
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for ``x`` of any leading shape ``[..., K]``: rows flattened, then ``matmul``."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if bias is not None and bias.stride(-1) != 1:
        bias = bias.contiguous()
    return matmul(rows, weight, bias).view(*lead, weight.shape[0])
