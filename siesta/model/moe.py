"""A sparse mixture-of-experts block: a router picks each token's top-k experts, each expert is
a SiLU-gated MLP, and the token's output is the routing-weighted sum of its experts' outputs.

The experts are stacked as transformers 5 holds them: ``gate_up_proj`` ``[experts, 2 * I, H]``
(gate rows, then up rows) and ``down_proj`` ``[experts, H, I]``. Under tensor parallelism every
expert is cut along its intermediate features (vLLM's default): a rank holds ``I / size`` gate,
up and down features of every expert, its partial sums are all-reduced once, after the weighted
sum, as a row-parallel layer's are.

On CUDA the experts run as one fused Triton kernel pair (``triton_moe``: tokens sorted by
expert, a grouped GEMM with gate/up fused and SiLU applied, then down with the routing weight),
which CUDA graphs capture; elsewhere the torch reference below, a loop over the experts a step
touches. Both compute the same thing from the same router, whose softmax, top k and
renormalisation are one Triton kernel on CUDA (``triton_router``) and torch ops elsewhere.
"""

from __future__ import annotations

import torch
from torch import nn

from siesta.model import batch_invariant
from siesta.model.interface import RoutingSink
from siesta.model.layers import linear, silu_and_mul, takes_gemv
from siesta.parallel import TensorParallel


class TopKRouter(nn.Module):
    """``weight`` ``[experts, H]`` (checkpoints' ``mlp.gate.weight``): a softmax over the experts'
    logits in fp32, the top k, renormalised to sum to one where ``norm_topk_prob`` says so."""

    def __init__(self, num_experts: int, hidden_size: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] in x's dtype, expert ids [T, k] int64)``, the largest weight first."""
        if x.is_cuda:
            from siesta.model import triton_router  # one launch for what route_reference takes six

            if takes_gemv(x, self.weight) and triton_router.fuses_linear(x, self.weight):
                routed = triton_router.linear_route(x, self.weight, self.top_k, self.norm_topk_prob, x.dtype)
                if routed is not None:
                    return routed
            logits = linear(x, self.weight)
            return triton_router.route(logits, self.top_k, self.norm_topk_prob, x.dtype)
        logits = linear(x, self.weight)
        return route_reference(logits, self.top_k, self.norm_topk_prob, x.dtype)


def route_reference(
    logits: torch.Tensor, top_k: int, normalize: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` -> ``(weights [T, k] in dtype, expert ids [T, k] int64)``: a softmax
    in fp32, the top k, renormalised to sum to one where ``normalize`` says (transformers'
    Qwen3-MoE router's arithmetic); the CPU path, and ``triton_router``'s oracle."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


class Experts(nn.Module):
    """This rank's features of every expert."""

    def __init__(self, num_experts: int, hidden_size: int, local_intermediate: int) -> None:
        super().__init__()
        self.num_experts, self.local_intermediate = num_experts, local_intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * local_intermediate, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, local_intermediate))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])``: this rank's partial sum ``[T, H]``."""
        if x.is_cuda:
            from siesta.model import triton_moe

            return triton_moe.fused_moe(x, weights, ids, self.gate_up_proj, self.down_proj)
        return experts_reference(x, weights, ids, self.gate_up_proj, self.down_proj)

    def weight_keys(self, pname: str) -> list[str]:
        """What a complete checkpoint writes into ``pname`` (see ``CausalLM.expected_weight_names``):
        every expert's gate and up rows, or its down columns, each counted apart, so per-expert
        tensors and stacked ones make the same set."""
        if pname.endswith("gate_up_proj"):
            return [f"{pname}:{shard}:{e}" for e in range(self.num_experts) for shard in ("gate", "up")]
        return [f"{pname}:{e}" for e in range(self.num_experts)]


def experts_reference(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The experts in torch: the (token, k) pairs sorted by expert, each expert touched run once
    over its tokens (reading its rows once, as a step's linears do), then the weighted sum of
    each token's k outputs in k order. The host reads the experts' counts: the CPU path."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    pair_out = x.new_empty(t * k, x.shape[1])
    start = 0
    for expert, n in enumerate(counts):
        if not n:
            continue
        pairs = order[start : start + n]
        h = silu_and_mul(linear(x[pairs // k], gate_up[expert]))
        pair_out[pairs] = linear(h, down[expert])
        start += n
    return weighted_sum(pair_out, weights)


def sort_by_expert(flat: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs of ``flat`` (one expert id a pair) in expert order, on the device with no host
    read: the stable order, the ids in it, and each expert's first index among them
    (``num_experts + 1`` entries; an expert's count is their difference). The fused kernels and
    the library's grouped GEMM sort alike, so their A/B times the GEMMs, not two sorts.

    The counts are read off the sorted ids: a scatter_add of n ones into E counters contends on
    their atomics (1.27 ms of an 8k prefill on an H100 against 0.25, run 58a)."""
    order = torch.argsort(narrow_keys(flat, num_experts), stable=True)
    experts_sorted = flat[order]
    first = torch.searchsorted(experts_sorted, torch.arange(num_experts + 1, device=flat.device))
    return order, experts_sorted, first


def narrow_keys(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Expert ids in the narrowest integer type that holds them: a radix sort passes over every
    byte of its keys (cub, under torch's sort on CUDA), so int64 ids took eight passes where one
    byte (up to 256 experts) takes one (2.4 ms of an 8k prefill against 0.37, run 58a). The
    order is the same: the values are."""
    for dtype in (torch.uint8, torch.int16, torch.int32):
        if num_experts - 1 <= torch.iinfo(dtype).max:
            return ids.to(dtype)
    return ids


def weighted_sum(pair_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[T * k, H]`` expert outputs -> ``[T, H]``, each token's k outputs weighted and summed
    (``sum_over_k``)."""
    t, k = weights.shape
    return sum_over_k(pair_out.view(t, k, -1) * weights.unsqueeze(-1))


def sum_over_k(per_pair: torch.Tensor) -> torch.Tensor:
    """``[T, k, H]`` -> ``[T, H]``: each token's k rows summed, in fp32, rounded once.

    Default mode: torch's sum, whose order is fixed by k and the tensor's layout but chosen
    inside its reduction kernel (accumulators per thread, vectorisation by alignment).
    Deterministic mode: the order written down, k = 0, 1, ... into one fp32 accumulator, so
    that no kernel heuristic stands between a token's sum and the batch around it."""
    if not batch_invariant.enabled():
        return per_pair.sum(dim=1)
    total = per_pair[:, 0].to(torch.float32, copy=True)
    for j in range(1, per_pair.shape[1]):
        total += per_pair[:, j]  # promoted to fp32 before the add
    return total.to(per_pair.dtype)


class SparseMoeBlock(nn.Module):
    """What follows attention in a sparse layer: ``gate`` (the router) and ``experts``, named as
    checkpoints name them, so ``mlp.gate.weight`` and ``mlp.experts.*`` land in place."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        top_k: int,
        norm_topk_prob: bool,
        local_intermediate: int,
        layer_idx: int,
        tp: TensorParallel,
        sink: RoutingSink,
    ) -> None:
        super().__init__()
        self.gate = TopKRouter(num_experts, hidden_size, top_k, norm_topk_prob)
        self.experts = Experts(num_experts, hidden_size, local_intermediate)
        self.layer_idx, self.tp = layer_idx, tp
        self._sink = sink  # not a module: shared by every sparse layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        self._sink.write(self.layer_idx, ids)
        return self.tp.all_reduce(self.experts(x, weights, ids))
