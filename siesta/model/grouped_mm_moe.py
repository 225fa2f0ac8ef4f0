"""The experts through torch's grouped GEMM (``F.grouped_mm``: CUTLASS on Hopper), for prefill.

The same sum as ``triton_moe.fused_moe``, ``sum_k w[t, k] * down_e(silu(gate_e x_t) * up_e x_t)``,
in library calls: the (token, k) pairs sorted by expert (a stable sort, no host read), x's rows
gathered into that order, one grouped GEMM for gate/up over every expert's run (``offs``: the
runs' ends), ``silu(gate) * up``, one grouped GEMM for down, each pair's output scaled by its
weight and put back in pair order for ``moe.sum_over_k``. It costs the gather and three
pair-sized intermediates that the fused kernels keep on chip; it would pay where the library's
GEMMs beat the fused ones by more than that. The ``moe`` bench's ``library_prefill`` part times
both: on an H100 an 8k prefill ran at 0.81x the fused path (run 54a), so it is off
(``triton_moe.LIBRARY_MIN_PAIRS``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from siesta.model.moe import sort_by_expert, sum_over_k


def available() -> bool:
    return hasattr(F, "grouped_mm")


def grouped_mm_moe(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """``x`` ``[T, H]``, ``weights``/``ids`` ``[T, k]``, ``gate_up`` ``[E, 2I, H]``, ``down``
    ``[E, H, I]`` -> ``[T, H]``."""
    t, k = ids.shape
    num_experts, two_i, _ = gate_up.shape
    flat = ids.reshape(-1).to(torch.int64)
    order, _, first = sort_by_expert(flat, num_experts)
    offs = first[1:].to(torch.int32)  # each expert's run's end
    rows = x.index_select(0, order // k)
    h = F.grouped_mm(rows, gate_up.transpose(1, 2), offs=offs)
    gate, up = h.split(two_i // 2, dim=-1)
    act = F.silu(gate) * up
    out = F.grouped_mm(act, down.transpose(1, 2), offs=offs)
    out = out * weights.reshape(-1)[order, None].to(out.dtype)
    per_pair = torch.empty_like(out).index_copy_(0, order, out)
    return sum_over_k(per_pair.view(t, k, -1))
