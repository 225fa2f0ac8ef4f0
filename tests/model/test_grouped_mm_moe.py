"""``grouped_mm_moe``: the experts through torch's grouped GEMM equal the torch reference
(``experts_reference``) and the fused Triton kernels, in fp32, on a tiny shape with experts left
untouched and with one expert taking every token."""

from __future__ import annotations

import pytest
import torch

from siesta.model import grouped_mm_moe, triton_moe
from siesta.model.moe import experts_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not grouped_mm_moe.available(), reason="this torch has no F.grouped_mm")


def _inputs(tokens: int, experts: int, hidden: int, inter: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.rand(tokens, experts, generator=g).topk(k, dim=-1).indices
    weights = torch.rand(tokens, k, generator=g).softmax(-1)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    return x, weights, ids, gate_up, down


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_equals_the_reference_and_the_fused_kernels(tokens: int) -> None:
    x, weights, ids, gate_up, down = _inputs(tokens, 8, 64, 32, 2, tokens)
    out = grouped_mm_moe.grouped_mm_moe(x, weights, ids, gate_up, down)
    ref = experts_reference(x, weights, ids, gate_up, down)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # The fused kernels where they run: the GPU, else Triton's interpreter (conftest).
    fused = triton_moe.fused_moe(*(a.to(DEVICE) for a in (x, weights, ids, gate_up, down)),
                                 tiles=triton_moe.PREFILL_TILES)  # fmt: skip
    torch.testing.assert_close(out, fused.cpu(), rtol=1e-5, atol=1e-5)


def test_one_expert_takes_every_pair() -> None:
    x, weights, _, gate_up, down = _inputs(6, 4, 32, 16, 1, 0)
    ids = torch.full((6, 1), 2)
    out = grouped_mm_moe.grouped_mm_moe(x, weights, ids, gate_up, down)
    ref = weights * ((torch.nn.functional.silu(x @ gate_up[2, :16].T) * (x @ gate_up[2, 16:].T)) @ down[2].T)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
