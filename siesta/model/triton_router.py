"""A mixture-of-experts router's tail in one Triton kernel: softmax over the experts' logits in
fp32, the top k, renormalised where the model says so, cast to the activations' dtype.

In torch that is six launches a layer (softmax, topk, sum, divide, two casts); on an H100,
Qwen3-30B-A3B at batch 1 spent ~0.7 ms of a 6.3 ms step on them, device time alone, and a
step's 1,024 launches cost ~1.5 us of gap each besides (run 48b, ``bench/gpu.sh --sections
moe``). Here one program per token holds its row of logits in registers and picks the k largest
one after another: the largest first, the lowest expert index first among equal weights.

The program reads and writes only its own token's row, so a token's route does not depend on the
batch around it (deterministic mode takes it too). Against torch the weights may differ in the
last bit of fp32 (another exp and another order of the sum), which can only reorder picks that
are tied to within that bit; the tests count none on random logits. Exact ties are common, though:
bf16 logits of 128 experts put the 8th and 9th in one bf16 step for roughly one token-layer in
ten. Where such a tie crosses the k-th place this kernel keeps the lower expert index, as torch's
CUDA top-k does for rows this short (``TensorTopK.cu``'s single-block ``gatherTopK``: a radix
select of the k-th value, then the values equal to it taken "first seen", in index order). A GPU
test compares the two sets on 4,096 bf16 rows; it passed on an H100 (run 49a), where the kernel
took the batch-1 step from 146 to 191 tok/s (run 49b).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from siesta import arrivals, pdl
from siesta.model import triton_gemv

# Warps of a token's program. On one warp a row of 128 logits is 4 a thread and each of the k
# rounds of max-and-pick reduces by shuffles alone, where more warps add a shared-memory round
# trip to each. One warp against Triton's default 4: a Qwen3-30B-A3B batch-1 step 1.01x (H100
# run 64b, the moe bench's ``knobs`` part, arm ``route1``), and part of its ``all`` arm's 1.07x.
ROUTE_NUM_WARPS = 1
# One token: the router's logits and its tail in one launch (``_linear_route_kernel``), where the
# one-row GEMV (2.2 us) and the tail (3.3 us) were two a layer in H200 run 63a's batch-1 step.
# The GEMV's loop, so the logits' bits; the tail's code on the GEMV's warps, whose reductions gave
# the one-warp kernel's bits on four (``test_one_warp_and_four_give_the_same_bits``, H100 run
# 64a). Off until a card measures it: the moe bench's ``knobs`` arm ``route_fused``.
FUSE_ONE_ROW = False


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, E, stride_l,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, NORMALIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program t: token t's k (weight, expert) pairs, the largest weight first."""
    pdl.wait_for_previous_grid(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + t * stride_l + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    _route_row(logits, weights_ptr, ids_ptr, t, E, TOP_K, BLOCK_E, BLOCK_K, NORMALIZE)


@triton.jit
def _route_row(logits, weights_ptr, ids_ptr, t, E, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
               BLOCK_K: tl.constexpr, NORMALIZE: tl.constexpr):  # fmt: skip
    """Token ``t``'s route from its fp32 logits ``[BLOCK_E]`` (-inf past E), stored at row t."""
    offs = tl.arange(0, BLOCK_E)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    # A NaN ranks above every probability, as in torch's top-k: a row gone non-finite keeps
    # expert ids in range (an id of E would trip an index assert that ends the engine's CUDA
    # context) and NaN weights that carry the fault to its request's output.
    # 2.0: above every probability (at most 1, give or take a rounding of the division, hence 1.5 below).
    left = tl.where(probs != probs, 2.0, probs)
    left = tl.where(offs < E, left, -1.0)  # past E: below every probability, never picked
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(left, axis=0)
        pick = tl.min(tl.where(left == best, offs, BLOCK_E), axis=0)  # the lowest index among ties
        weights = tl.where(slots == j, tl.where(best > 1.5, float("nan"), best), weights)
        ids = tl.where(slots == j, pick.to(tl.int64), ids)
        left = tl.where(offs == pick, -2.0, left)
    if NORMALIZE:
        weights = weights / tl.sum(weights, axis=0)  # the unused slots hold 0.0
    keep = slots < TOP_K
    tl.store(weights_ptr + t * TOP_K + slots, weights.to(weights_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + t * TOP_K + slots, ids, mask=keep)


@triton.jit
def _linear_route_kernel(
    x_ptr, w_ptr, logits_ptr, weights_ptr, ids_ptr, counter_ptr, E, K,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOP: tl.constexpr, NORMALIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """One token's router: program n computes logits ``[n * BLOCK_N, (n + 1) * BLOCK_N)`` as the
    one-row GEMV does (its loop, so its bits) and stores them; the last program to arrive
    (``siesta/arrivals.py``) reads the row back and routes it as ``_route_kernel`` does."""
    pdl.wait_for_previous_grid(USE_PDL)
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_w = (offs_n % E).to(tl.int64)  # past E: real rows again, dropped by the masked store
    w_ptrs = w_ptr + rows_w[:, None] * K + offs_k[None, :]
    x_ptrs = (x_ptr + offs_k)[None, :]
    one_row = tl.full((1,), True, tl.int1)
    acc = triton_gemv.summed_products(x_ptrs, w_ptrs, one_row, offs_k, K, K, 1, BLOCK_N, BLOCK_K, EVEN_K, NUM_STAGES)
    tl.store(logits_ptr + offs_n[None, :], acc.to(logits_ptr.dtype.element_ty), mask=(offs_n < E)[None, :])
    if arrivals.arrive(counter_ptr) == tl.num_programs(0) - 1:
        offs = tl.arange(0, BLOCK_E)
        logits = tl.load(logits_ptr + offs, mask=offs < E, other=float("-inf"), cache_modifier=".cg")
        _route_row(logits.to(tl.float32), weights_ptr, ids_ptr, 0, E, TOP_K, BLOCK_E, BLOCK_TOP, NORMALIZE)
        arrivals.reset(counter_ptr)


def fuses_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear_route`` serves a router call whose ``linear`` takes the GEMV
    (``layers.takes_gemv``, the caller's check): ``FUSE_ONE_ROW`` on, one row, a weight whose rows
    follow each other, and the GEMV's one-row tl.sum path (whose loop gives the logits their bits)."""
    if not (FUSE_ONE_ROW and x.shape[0] == 1 and weight.stride(0) == weight.shape[1]):
        return False
    return triton_gemv.sum_path(triton_gemv.default_config(1, weight.shape[0], weight.shape[1], x.element_size()))


def linear_route(x: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """``route(linear(x, weight), ...)`` for one token in one launch (``fuses_linear``), or None
    where the arrival counters cannot be had (the caller routes apart)."""
    experts, hidden = weight.shape
    if not 0 < top_k <= experts:
        raise ValueError(f"top_k must be in 1..{experts} (the experts), got {top_k}")
    counters = arrivals.counters(x.device, 1)
    if counters is None:
        return None
    config = triton_gemv.default_config(1, experts, hidden, x.element_size())
    logits = torch.empty((1, experts), dtype=x.dtype, device=x.device)
    weights = torch.empty((1, top_k), dtype=dtype, device=x.device)
    ids = torch.empty((1, top_k), dtype=torch.int64, device=x.device)
    _linear_route_kernel[(triton.cdiv(experts, config.block_n),)](
        x, weight, logits, weights, ids, counters, experts, hidden,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=hidden % config.block_k == 0,
        NUM_STAGES=config.num_stages, TOP_K=top_k, BLOCK_E=triton.next_power_of_2(experts),
        BLOCK_TOP=triton.next_power_of_2(top_k), NORMALIZE=normalize, num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl.launch(x.device),
    )  # fmt: skip
    return weights, ids


def route(logits: torch.Tensor, top_k: int, normalize: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] in dtype, expert ids [T, k] int64)`` from router logits ``[T, E]``, as
    ``moe.route_reference`` computes them."""
    tokens, experts = logits.shape
    if not 0 < top_k <= experts:
        raise ValueError(f"top_k must be in 1..{experts} (the experts), got {top_k}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty((tokens, top_k), dtype=dtype, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](
            logits, weights, ids, experts, logits.stride(0),
            TOP_K=top_k, BLOCK_E=triton.next_power_of_2(experts), BLOCK_K=triton.next_power_of_2(top_k),
            NORMALIZE=normalize, num_warps=ROUTE_NUM_WARPS, **pdl.launch(logits.device),
        )  # fmt: skip
    return weights, ids
