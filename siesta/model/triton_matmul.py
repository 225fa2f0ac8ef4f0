"""Batch-invariant GEMM in Triton: ``y = x @ W.T (+ bias)``, deterministic mode's linears on CUDA.

Why not cuBLAS: it picks its kernel (tile shape, warp layout, the order a K step's products are
summed in, split-K or not) from the problem's shape, M included, so a row's bits follow the
number of rows beside it. Taking its workspace away (``batch_invariant.CUBLAS_WORKSPACE_ENV``)
removes split-K but not the choice of kernel: on an H100 one request decoded alone and in a batch
of 64 differed from the first decode step (``bench/results/gpu-h100-2026-12-06-run46c-*``).

What makes this kernel invariant:

* A row's bits are fixed by the reduction alone: each output element is reduced by one program,
  over K in BLOCK_K chunks taken in order from k = 0, each chunk one ``tl.dot`` (its k16 MMA steps
  in order) into the same fp32 accumulator: no split-K, no atomics, no second pass. BLOCK_K is one
  value per dtype (``HALF_BLOCK_K``, ``FP32_BLOCK_K``) for every row count. The K tail is masked to
  zeros in both operands (adds exact zeros), and whether there is a tail depends on K alone.
* The tile's rows and columns (BLOCK_M x BLOCK_N, warps, pipeline stages) only decide which
  outputs a program computes, so they may follow M (``config_for``): small tiles for decode, whose
  few rows need many column tiles to spread the weight reads over the SMs, large ones for prefill.
  That the tile leaves an element's sum alone is the MMA's property (an element's k16 dot is the
  same datapath whatever the instruction's M and N), measured rather than proven: on an H100,
  tiles of 16 to 128 rows (16 rows: Ampere's mma.sync; 64 and up: Hopper's wgmma), 16 to 256
  columns, 4 or 8 warps, 3 to 8 stages, loaded by cp.async or by TMA in the persistent variant,
  gave every Llama-3-8B matrix the same bits at M = 1, 64, 256 and 8192
  (``python -m siesta.bench.invariant_matmul --candidates ...``, runs 47h and 48a under
  ``bench/results/``), and the GPU tests hold a
  row to its bits across every bucket of ``config_for``.
* Rows are independent: a tensor-core MMA computes each output row from its own row of x alone,
  whatever row of the tile it sits in; rows past M are masked to zeros and never stored.
* ``M`` is not specialised (``do_not_specialize``): Triton would otherwise compile other
  variants for M == 1 or M % 16 == 0. What it does specialise on (pointer and stride alignment)
  changes how tiles are loaded (cp.async vectors or plain loads), never the MMA or its order.

Which program computes which tile (the grouped order that keeps W tiles in L2) does depend on M;
it moves work between SMs, never the arithmetic of an element.

Cost against cuBLAS, end to end (``bash bench/gpu.sh --sections deterministic``, Llama-3-8B
shape, H100), every case bit-identical:

| tiles | decode b1 | b64 | b256 | prefill 8k |
|---|---|---|---|---|
| one 64x128 tile (run 47d) | +37.5 % | +27.1 % | +50.7 % | +72.7 % |
| by M, cp.async only (run 48a) | +29.8 % | +22.6 % | +46.0 % | +29.1 % |
| 6-stage decode tiles, persistent TMA from 65 rows (run 48b) | +16.7 % | +19.7 % | +41.2 % | +4.7 % |
| the same, the weights' backup no longer pinned beside the steps (run 51a) | +15.0 % | +9.2 % | +24.2 % | +4.6 % |
| ``config_for``'s now: 64x128 at 65-256 rows of N=4096, 2-warp 10-stage one-row tile (run 51e) | +8.7 % | +9.4 % | +17.7 % | +7.0 % |

Per matrix (runs 48a, 51b, 51d) today's tiles run 0.97-1.08x cuBLAS at 1 row, 1.04-1.14x at 64
and 1.0-1.3x at 256 rows, and 0.92-1.17x at 8k rows. At b1 the default mode's own GEMV kernel
(``triton_gemv``) is faster than cuBLAS, which is what the +0.30 ms of GEMM left at b1 is against;
at b256 most of what is left (1.9 of 2.6 ms) is attention (``triton_tiles.INVARIANT_DECODE_TILES``).
vLLM reports -0.6 % to -20 % end to end for its persistent version of the same idea; SGLang ~34 %.

Launches never synchronise with the host and allocate only the output: CUDA graphs capture them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from siesta.model.linear_operands import check_linear_operands

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
    # One program per SM looping over tiles, its operands fetched by the Hopper copy engine (TMA):
    # which program computes a tile and how its bytes arrive, never the sum (see the docstring).
    persistent_tma: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "group_m", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"MatmulConfig.{name} must be a power of two, got {value}")
        if self.num_stages < 1:
            raise ValueError(f"MatmulConfig.num_stages must be >= 1, got {self.num_stages}")
        if min(self.block_m, self.block_n, self.block_k) < DOT_MIN:
            raise ValueError(f"MatmulConfig blocks must be >= {DOT_MIN} (tl.dot's minimum), got {self}")


# The reduction chunk: fixed per dtype, for every row count (it orders a row's sum).
HALF_BLOCK_K = 64
FP32_BLOCK_K = 32
# bf16/fp16 tiles by row count: the fastest of the candidates timed on an H100 (run 48a,
# Llama-3-8B's matrices against cuBLAS; every candidate gave the shipped bits at every M):
# - up to 16 rows: 16x32 on two warps, 10 stages: 40 KiB of weights in flight an SM (runs
#   51b, 51d: a layer's four matrices at one row in 0.98x cuBLAS's time, 0.94x the 4-warp 6-stage
#   tile's; 0.97x cuBLAS for lm_head);
# - up to 64 rows: 64x32, 6 stages: N=4096 gives 128 column tiles to stream the weights
#   (1.06-1.15x; 4 stages ran 1.2-1.4x);
# - up to 256 rows of a narrow N (o_proj, down: 4096): 64x128 persistent TMA, 6 stages. 128x128
#   would make 64 tiles for 132 SMs; this makes 128 (run 51b, 256 rows: o_proj 1.01x cuBLAS and
#   down 1.05x, where 128x128 ran 1.37x and 1.46x; qkv, gate_up and lm_head ran slower on it);
# - up to 512 rows: 128x128 persistent TMA, 4 stages, or 128x256 for wide N (1.1-1.3x);
# - prefill: 128x256 persistent TMA, 3 stages: 1.0-1.2x cuBLAS at 8k rows, where the plain
#   128x128 kernel ran 1.35-1.47x.
SMALL_DECODE_ROWS = 16
DECODE_ROWS = 64
NARROW_MID_ROWS = 256
NARROW_N = 4096
MID_ROWS = 512
WIDE_N = 16384
HALF_SMALL_DECODE = MatmulConfig(block_m=16, block_n=32, block_k=HALF_BLOCK_K, group_m=8, num_warps=2, num_stages=10)
HALF_DECODE = MatmulConfig(block_m=64, block_n=32, block_k=HALF_BLOCK_K, group_m=8, num_warps=4, num_stages=6)
HALF_NARROW_MID = MatmulConfig(block_m=64, block_n=128, block_k=HALF_BLOCK_K, group_m=8, num_warps=4, num_stages=6,
                               persistent_tma=True)  # fmt: skip
HALF_MID = MatmulConfig(block_m=128, block_n=128, block_k=HALF_BLOCK_K, group_m=8, num_warps=8, num_stages=4,
                        persistent_tma=True)  # fmt: skip
HALF_WIDE = MatmulConfig(block_m=128, block_n=256, block_k=HALF_BLOCK_K, group_m=8, num_warps=8, num_stages=3,
                         persistent_tma=True)  # fmt: skip
# fp32 (``--head-dtype float32``'s LM head, fp32 models): IEEE products on the CUDA cores (no
# TF32, whose 10-bit mantissa would be worse than cuBLAS's fp32), so smaller tiles; one for all M.
FP32_CONFIG = MatmulConfig(block_m=64, block_n=64, block_k=FP32_BLOCK_K, group_m=8, num_warps=4, num_stages=3)


def config_for(n: int, k: int, m: int, dtype: torch.dtype) -> MatmulConfig:
    """The tile of ``[m, k] @ [n, k].T`` in ``dtype``. Its BLOCK_K, which orders every sum, is the
    dtype's alone; the rest follows the shape, M included (see the module's docstring)."""
    if dtype in _HALF_TYPES:
        if m <= SMALL_DECODE_ROWS:
            return HALF_SMALL_DECODE
        if m <= DECODE_ROWS:
            return HALF_DECODE
        if m <= NARROW_MID_ROWS and n <= NARROW_N:
            return HALF_NARROW_MID
        if m <= MID_ROWS and n < WIDE_N:
            return HALF_MID
        return HALF_WIDE
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


@triton.jit(do_not_specialize=["M"])
def _matmul_tma_kernel(
    x_desc, w_desc, bias_ptr, out_ptr,
    M, N, K, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """(PROGRAMS is a constant, as measured in run 48b: a kernel compiles per program count, at
    most a few per matrix, min(SMs, tiles).) ``_matmul_kernel``'s arithmetic, persistent: program ``pid`` computes tiles pid, pid +
    PROGRAMS, ... Each tile is one fp32 accumulator over K in BLOCK_K chunks in order, as there; the
    descriptors fill reads past M, N or K with zeros, which is what the masks do there."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, PROGRAMS, flatten=True):
        first_m = (tile // per_group) * GROUP_M
        group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % group_rows
        pid_n = (tile % per_group) // group_rows
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = x_desc.load([pid_m * BLOCK_M, k0])
            w = w_desc.load([pid_n * BLOCK_N, k0])
            acc = tl.dot(x, w.T, acc, input_precision=PRECISION)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & n_mask[None, :])


# TMA wants 16-byte aligned base addresses and row strides.
TMA_ALIGN_BYTES = 16
# The interpreter has no SMs to count; a few programs still walk the persistent loop.
INTERPRETER_PROGRAMS = 4


def tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether each 2-D tensor (contiguous along its rows) can back a TMA descriptor."""
    return all(t.data_ptr() % TMA_ALIGN_BYTES == 0 and t.stride(0) * t.element_size() % TMA_ALIGN_BYTES == 0
               for t in tensors)  # fmt: skip


def persistent_programs(device: torch.device) -> int:
    """Programs of a persistent launch: one an SM (a few under the interpreter)."""
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch_tma(x, weight, bias, out, config: MatmulConfig) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = weight.shape[0]
    programs = min(persistent_programs(x.device), triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n))
    _matmul_tma_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [config.block_m, config.block_k]),
        TensorDescriptor.from_tensor(weight, [config.block_n, config.block_k]),
        bias if bias is not None else x, out,
        m, n, k, out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        PROGRAMS=programs, HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: MatmulConfig | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` ``[M, K]``, ``weight`` ``[N, K]`` (each contiguous
    along K), ``bias`` ``[N]`` or None: a new contiguous ``[M, N]`` tensor of x's dtype, summed in
    fp32, each row's bits independent of M and of the other rows. ``config`` is for tests."""
    check_linear_operands("matmul", x, weight, bias, SUPPORTED_DTYPES)
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    config = config or config_for(n, k, m, x.dtype)
    if config.persistent_tma and tma_ready(x, weight):
        _launch_tma(x, weight, bias, out, config)
        return out
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
