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

from siesta import pdl

# Warps of a token's program. On one warp a row of 128 logits is 4 a thread and each of the k
# rounds of max-and-pick reduces by shuffles alone, where more warps add a shared-memory round
# trip to each. One warp against Triton's default 4: a Qwen3-30B-A3B batch-1 step 1.01x (H100
# run 64b, the moe bench's ``knobs`` part, arm ``route1``), and part of its ``all`` arm's 1.07x.
ROUTE_NUM_WARPS = 1


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
