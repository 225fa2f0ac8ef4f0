"""The fused router tail (``siesta.model.triton_router``) against ``moe.route_reference`` (torch's
softmax and topk, transformers' Qwen3-MoE arithmetic): the same experts in the same order and
the same weights within fp32's last bits, with and without renormalisation, expert counts that are
and are not powers of two, and ties broken towards the lowest expert index.

Without a GPU the kernel runs in Triton's interpreter."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")
if "siesta.model.triton_router" in sys.modules:  # @triton.jit reads TRITON_INTERPRET at definition
    importlib.reload(sys.modules["siesta.model.triton_router"])

from siesta.model.moe import route_reference  # noqa: E402
from siesta.model.triton_router import route  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")


@pytest.mark.parametrize("experts,top_k", [(128, 8), (60, 4), (8, 2), (5, 5)])
@pytest.mark.parametrize("normalize", [True, False], ids=["norm_topk_prob", "raw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_torch_softmax_and_topk(experts: int, top_k: int, normalize: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(experts * 10 + top_k)
    logits = (torch.randn(37, experts, generator=gen) * 3).to(dtype).to(DEVICE)
    weights, ids = route(logits, top_k, normalize, dtype)
    want_w, want_ids = route_reference(logits, top_k, normalize, dtype)
    assert ids.dtype == torch.int64 and weights.dtype == dtype and weights.shape == (37, top_k)
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: one rounding of the same fp32 value, at most
    torch.testing.assert_close(weights.float(), want_w.float(), rtol=tol, atol=tol)
    if dtype == torch.float32:
        assert torch.equal(ids, want_ids)
    else:
        # bf16 logits tie exactly (8-bit mantissas): torch orders tied experts its own way. Each
        # pick must still be an expert whose probability is at least the k-th largest, each once.
        probs = torch.softmax(logits.float(), dim=-1)
        kth = probs.topk(top_k, dim=-1).values[:, -1:]
        assert (probs.gather(1, ids) >= kth).all()
        assert all(len(set(row)) == top_k for row in ids.tolist())
        untied = (probs >= kth).sum(-1) == top_k  # no tie across the k-th place: the same set
        assert torch.equal(ids[untied].sort(-1).values, want_ids[untied].sort(-1).values)
    if normalize:
        torch.testing.assert_close(weights.float().sum(-1), torch.ones(37, device=DEVICE), rtol=2e-2, atol=2e-2)


def test_ties_go_to_the_lowest_expert_and_each_expert_once() -> None:
    logits = torch.zeros(3, 16, device=DEVICE)
    logits[1, [3, 9, 12]] = 2.0
    logits[2] = torch.arange(16.0, device=DEVICE).flip(0)  # expert 0 largest
    weights, ids = route(logits, 4, False, torch.float32)
    assert ids[0].tolist() == [0, 1, 2, 3]
    assert ids[1].tolist() == [3, 9, 12, 0]
    assert ids[2].tolist() == [0, 1, 2, 3]
    assert torch.allclose(weights[0], torch.full((4,), 1 / 16, device=DEVICE))


@pytest.mark.parametrize("normalize", [True, False], ids=["norm_topk_prob", "raw"])
def test_a_non_finite_row_keeps_its_ids_in_range_and_its_weights_nan(normalize: bool) -> None:
    """A token whose hidden state went non-finite must not pick expert E (past the last): the
    sort by expert indexes with that id, and the device assert it trips ends the engine's CUDA
    context (an H100 run did so). NaN ranks first, as in torch's top-k; the weights stay NaN,
    so the fault reaches that token's output and no other row changes."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 128, generator=gen).to(DEVICE)
    logits[0, 9] = 30.0  # a probability of 1 (to the division's rounding) stays a weight, not NaN
    logits[1, 7] = float("nan")
    logits[2] = float("nan")
    logits[3, 40] = float("inf")  # inf - max is NaN for that lane: the row's softmax is NaN
    logits[4] = float("-inf")
    weights, ids = route(logits, 8, normalize, torch.float32)
    assert ((ids >= 0) & (ids < 128)).all(), ids
    assert all(len(set(row)) == 8 for row in ids.tolist())
    assert torch.isnan(weights[1:]).all()
    want_w, want_ids = route_reference(logits[:1], 8, normalize, torch.float32)
    assert torch.equal(ids[:1], want_ids)
    torch.testing.assert_close(weights[:1], want_w, rtol=1e-6, atol=1e-6)


def test_a_strided_view_and_no_tokens() -> None:
    base = torch.randn(6, 40, device=DEVICE)
    view = base[:, :20]  # rows 40 apart
    assert torch.equal(route(view, 3, True, torch.float32)[1], route_reference(view, 3, True, torch.float32)[1])
    weights, ids = route(torch.empty(0, 20, device=DEVICE), 3, True, torch.float32)
    assert weights.shape == ids.shape == (0, 3)
    with pytest.raises(ValueError, match="top_k"):
        route(base, 41, True, torch.float32)


@pytest.mark.skipif(not ON_GPU, reason="torch's CUDA top-k is the trainer's on the GPU (bench/gpu.sh runs it)")
def test_on_cuda_ties_across_the_kth_place_pick_what_torch_picks() -> None:
    """bf16 router logits tie exactly (one bf16 step is ~1/8 of the usual gap between the 8th and
    9th of 128); a trainer's torch.topk then picks among them, and the engine must pick the same
    experts, or its logprobs leave the trainer's wherever the tied experts differ."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4096, 128, generator=gen).to(torch.bfloat16).to(DEVICE)
    _, ids = route(logits, 8, True, torch.bfloat16)
    _, want = route_reference(logits, 8, True, torch.bfloat16)
    assert torch.equal(ids.sort(-1).values, want.sort(-1).values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_warp_and_four_give_the_same_bits(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ROUTE_NUM_WARPS``: the reductions change shape with the warps (shuffles only on one, a
    shared-memory round trip on four), not what they pick or sum. On a GPU this compares two
    compiled kernels, ties included; the interpreter ignores warps."""
    from siesta.model import triton_router

    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(40, 128, generator=gen) * 3).to(dtype)
    logits[:4, :16] = 1.0  # exact ties across the k-th place
    logits = logits.to(DEVICE)
    runs = []
    for warps in (1, 4):
        monkeypatch.setattr(triton_router, "ROUTE_NUM_WARPS", warps)
        runs.append(route(logits, 8, True, dtype))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("experts,hidden,top_k", [(128, 2048, 8), (60, 200, 4)], ids=["qwen3-30b-a3b", "ragged"])
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if ON_GPU else []), ids=str)
def test_one_tokens_router_in_one_launch_gives_the_two_launches_bits(experts: int, hidden: int, top_k: int,
                                                                     dtype: torch.dtype, launch_grids,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """``FUSE_ONE_ROW``: the GEMV's programs store the logits, the last to arrive routes them. The
    one-row GEMV and the tail kernel's bits (the logits through the GEMV's own loop), torch's
    experts, twice in a row (the arrival counter back at zero), in one launch (60 experts: a ragged
    last feature tile; H 200: a ragged last K chunk)."""
    from siesta import arrivals
    from siesta.model import triton_gemv, triton_router

    monkeypatch.setattr(arrivals, "_counters", {})
    monkeypatch.setattr(triton_router, "FUSE_ONE_ROW", True)
    gen = torch.Generator().manual_seed(experts + hidden)
    x = torch.randn(1, hidden, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.randn(experts, hidden, generator=gen) * hidden**-0.5).to(dtype).to(DEVICE)
    assert triton_router.fuses_linear(x, weight)
    apart = route(triton_gemv.gemv(x, weight), top_k, True, dtype)
    grids = launch_grids(triton_router, "_linear_route_kernel", "_route_kernel")
    fused = [triton_router.linear_route(x, weight, top_k, True, dtype) for _ in range(2)]
    block_n = triton_gemv.default_config(1, experts, hidden, x.element_size()).block_n
    assert grids == [(-(-experts // block_n),)] * 2
    for weights, ids in fused:
        assert torch.equal(ids, apart[1]) and torch.equal(weights, apart[0])
    assert arrivals._counters[x.device].count_nonzero() == 0
    want = route_reference(torch.nn.functional.linear(x.double(), weight.double()), top_k, True, dtype)
    assert torch.equal(fused[0][1], want[1])
    torch.testing.assert_close(fused[0][0], want[0], rtol=1e-5, atol=1e-6)


def test_the_fused_router_is_for_one_row_and_the_gemvs_sum_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from siesta.model import triton_router

    x, w = torch.zeros(2, 64), torch.zeros(16, 64)
    monkeypatch.setattr(triton_router, "FUSE_ONE_ROW", False)
    assert not triton_router.fuses_linear(x[:1], w)  # shipped off
    monkeypatch.setattr(triton_router, "FUSE_ONE_ROW", True)
    assert triton_router.fuses_linear(x[:1], w)
    assert not triton_router.fuses_linear(x, w)  # two rows: the GEMV's tensor-core path
    assert not triton_router.fuses_linear(x[:1], torch.zeros(16, 128)[:, :64])  # rows not back to back
