"""The fused mixture-of-experts kernels (``siesta.model.triton_moe``) against an independent oracle.

* ``align``: checked against its documented contract on hand-made and random routings (experts
  with no pair, one pair, several row tiles of pairs): every (token, k) pair sorted exactly once,
  each row tile in use holds pairs of its ``tile_expert`` only, padding is ``num_pairs`` and
  sits at the end of an expert's run, tiles past the padded total carry ``num_experts``, and
  every shape follows from the token count alone (what lets CUDA graphs capture it).
* ``fused_moe``: against a float64 oracle written here from the definition (einsum over the
  stacked weights: ``sum_k w[t, k] * down[e] @ (silu(gate[e] @ x) * (up[e] @ x))``) and against
  ``moe.experts_reference``, in fp32. The kernels multiply fp32 with ``input_precision="ieee"``,
  so the tolerance is fp32's (1e-5 of the output's scale; measured errors ~4e-7), which TF32
  (a 10-bit mantissa, ~2e-3 here) would miss by far. ``fused_moe`` takes its buffers from
  ``torch.empty``, which the tests make return NaN, so whatever a kernel leaves unwritten shows.

Without a GPU the kernels run in Triton's interpreter (small shapes keep the file fast). bf16,
no host sync, and CUDA-graph capture and replay need a GPU and are skipped on the CPU.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

# @triton.jit reads TRITON_INTERPRET when a kernel is defined: a module imported before the
# flag was set must be loaded again.
for _name in ("siesta.model.triton_moe", "siesta.model.triton_router"):
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])

from siesta.model import batch_invariant, triton_moe, triton_router
from siesta.model.moe import experts_reference, sum_over_k
from siesta.model.triton_moe import (
    DECODE_TILES,
    DETERMINISTIC_TILES,
    LARGE_PREFILL_PAIRS_PER_EXPERT,
    LARGE_PREFILL_TILES,
    PAIR_PATH_MAX_TOKENS,
    PREFILL_PAIRS_PER_EXPERT,
    PREFILL_TILES,
    Alignment,
    MoeTiles,
    align,
    fused_moe,
    step_tiles,
    tiles_for,
    uses_pair_path,
)

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
GPU_ONLY = pytest.mark.skipif(not ON_GPU, reason="needs CUDA (bench/gpu.sh runs it on the GPU host)")
# fp32 with ieee dots: sums of a few hundred products, each rounded at 2**-24.
FP32_TOL = 1e-5
# bf16: x, the weights, the activations between the GEMMs and each pair's output rounded at 2**-9
# (a CPU emulation of those roundings: ~5e-3 of the scale).
BF16_TOL = 2e-2
# Two loads of the same tiles into the same fp32 sums: a few ulps of the output's scale.
TILING_TOL = 1e-6


# ---------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Case:
    tokens: int
    top_k: int
    experts: int
    hidden: int
    inter: int
    skew: bool = False  # every token's top-k on the first k experts: several row tiles an expert

    @property
    def id(self) -> str:
        skew = "-skew" if self.skew else ""
        return f"T{self.tokens}-k{self.top_k}of{self.experts}-H{self.hidden}-I{self.inter}{skew}"


def _gen(case: Case, salt: int = 0) -> torch.Generator:
    seed = [case.tokens, case.top_k, case.experts, case.hidden, case.inter, case.skew, salt]
    return torch.Generator().manual_seed(int("".join(str(int(v)) for v in seed)) % 2**31)


def _routing(
    tokens: int, top_k: int, experts: int, gen: torch.Generator, skew: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] fp32, ids [T, k] int64)`` as the router makes them: distinct experts per
    token, weights renormalised over the top k."""
    logits = torch.randn(tokens, experts, generator=gen)
    if skew:
        logits[:, :top_k] += 20.0
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def _inputs(case: Case, dtype: torch.dtype, salt: int = 0) -> tuple[torch.Tensor, ...]:
    """x, routing weights, ids, gate_up ``[E, 2I, H]``, down ``[E, H, I]``, scaled so that every
    stage's values are O(1)."""
    gen = _gen(case, salt)
    x = torch.randn(case.tokens, case.hidden, generator=gen)
    weights, ids = _routing(case.tokens, case.top_k, case.experts, gen, case.skew)
    gate_up = torch.randn(case.experts, 2 * case.inter, case.hidden, generator=gen) / case.hidden**0.5
    down = torch.randn(case.experts, case.hidden, case.inter, generator=gen) / case.inter**0.5
    on = [t.to(dtype).to(DEVICE) for t in (x, weights, gate_up, down)]
    return on[0], on[1], ids.to(DEVICE), on[2], on[3]


# ---------------------------------------------------------------------------- oracles


def _oracle(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The definition in float64 on the CPU, from the inputs as they are (already rounded): one
    expert at a time over the (token, slot) pairs that chose it, no sorting or padding."""
    x, weights, gate_up, down = (t.detach().cpu().double() for t in (x, weights, gate_up, down))
    ids = ids.cpu()
    inter = gate_up.shape[1] // 2
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        token, slot = (ids == expert).nonzero(as_tuple=True)
        h = torch.einsum("oh,mh->mo", gate_up[expert], x[token])
        act = F.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, token, weights[token, slot, None] * torch.einsum("hi,mi->mh", down[expert], act))
    return out


def _assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Within ``tol`` of the reference's scale everywhere (the sums' rounding error scales with
    the terms, not with the sum, which can cancel to near zero)."""
    out64, ref64 = out.detach().cpu().double(), ref.detach().cpu().double()
    assert out64.shape == ref64.shape
    assert torch.isfinite(out64).all(), "NaN or inf in the output: an element was left unwritten"
    scale = ref64.abs().max().item()
    err = (out64 - ref64).abs().max().item()
    assert err <= tol * scale, f"max error {err:.3g} over scale {scale:.3g} ({err / scale:.3g} > {tol})"


@contextmanager
def _poisoned_empty() -> Iterator[None]:
    """``torch.empty`` returning NaN-filled floats while the kernels run: ``fused_moe`` takes its
    activation and per-pair buffers from it, so whatever a kernel leaves unwritten shows."""
    real = torch.empty

    def empty(*args, **kwargs) -> torch.Tensor:
        out = real(*args, **kwargs)
        return out.fill_(math.nan) if out.is_floating_point() else out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", empty)
        yield


def _fused(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    tiles: MoeTiles | None = None,
) -> torch.Tensor:
    with _poisoned_empty():
        return fused_moe(x, weights, ids, gate_up, down, tiles)


# ---------------------------------------------------------------------------- align


def _expected_max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The bound ``align`` documents: every expert with pairs padded by under a tile."""
    return -(-(num_pairs + min(num_pairs, num_experts) * (block_m - 1)) // block_m)


def _check_alignment(a: Alignment, ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    flat = ids.reshape(-1).cpu()
    n = flat.numel()
    max_tiles = _expected_max_tiles(n, num_experts, block_m)
    # Shapes and dtypes from (T, k, E, block_m) alone: no count read back to size them.
    assert a.sorted_pairs.shape == (max_tiles * block_m,) and a.sorted_pairs.dtype == torch.int32
    assert a.tile_expert.shape == (max_tiles,) and a.tile_expert.dtype == torch.int32
    assert a.num_padded.shape == (1,) and a.num_padded.dtype == torch.int32
    assert a.max_tiles == max_tiles
    pairs, tile_expert = a.sorted_pairs.cpu().tolist(), a.tile_expert.cpu().tolist()
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    used_tiles = sum(-(-c // block_m) for c in counts)
    assert a.num_padded.item() == used_tiles * block_m

    # Every pair exactly once; everything else is the padding value num_pairs.
    assert sorted(p for p in pairs if p != n) == list(range(n))
    assert all(0 <= p <= n for p in pairs)

    runs: dict[int, list[int]] = {}  # each expert's rows, over its tiles
    for tile in range(used_tiles):
        rows = pairs[tile * block_m : (tile + 1) * block_m]
        expert = tile_expert[tile]
        assert 0 <= expert < num_experts
        assert any(p != n for p in rows), f"tile {tile} in use holds no pair (its expert's weights read for nothing)"
        assert all(flat[p] == expert for p in rows if p != n), f"tile {tile} mixes experts"
        runs.setdefault(expert, []).extend(rows)
    # Each expert's pairs in one run of ceil(count / block_m) tiles, in expert order, padded at its end.
    assert sorted(runs) == [e for e, c in enumerate(counts) if c]
    for expert, rows in runs.items():
        count = counts[expert]
        assert len(rows) == -(-count // block_m) * block_m
        assert n not in rows[:count] and rows[count:] == [n] * (len(rows) - count), f"expert {expert}: padding inside"
    assert tile_expert[:used_tiles] == sorted(tile_expert[:used_tiles])
    assert tile_expert[used_tiles:] == [num_experts] * (max_tiles - used_tiles)
    assert pairs[used_tiles * block_m :] == [n] * ((max_tiles - used_tiles) * block_m)


def _hand_ids() -> torch.Tensor:
    """24 tokens, top 2 of 8: expert 0 every token's first (24 pairs: two tiles of 16, the second
    padded), expert 3 one token's second, experts 1, 2 and 4 the rest; 5, 6 and 7 (the last
    experts, where searchsorted's end lies) none."""
    second = torch.tensor([3] + [1, 2, 4] * 7 + [1, 2])
    return torch.stack([torch.zeros(24, dtype=torch.int64), second], dim=1)


ALIGN_CASES = [
    pytest.param(_hand_ids(), 8, 16, id="hand-T24-k2of8"),
    pytest.param(_hand_ids(), 8, 64, id="hand-T24-k2of8-bm64"),
    pytest.param(torch.full((40, 1), 2), 4, 16, id="one-expert-middle"),
    pytest.param(torch.tensor([[7, 0]]), 8, 16, id="T1-first-and-last"),
    pytest.param(torch.arange(16).view(2, 8), 16, 16, id="every-expert-one-pair"),
]


PLACEMENTS = ("kernel", "one-hot", "sort")


def _place_by(monkeypatch: pytest.MonkeyPatch, placement: str) -> None:
    monkeypatch.setattr(triton_moe, "ALIGN_KERNEL_MAX_PAIRS", 1 << 30 if placement == "kernel" else 0)
    monkeypatch.setattr(triton_moe, "ONE_HOT_MAX_PAIRS", 1 << 30 if placement == "one-hot" else 0)


@pytest.fixture(params=PLACEMENTS)
def placement(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``align`` places pairs by one Triton program up to ALIGN_KERNEL_MAX_PAIRS, else by a one-hot
    running count up to ONE_HOT_MAX_PAIRS, by a sort past it: each test runs all three ways."""
    _place_by(monkeypatch, request.param)
    return request.param


@pytest.mark.parametrize("ids,num_experts,block_m", ALIGN_CASES)
def test_align_hand_made(ids: torch.Tensor, num_experts: int, block_m: int, placement: str) -> None:
    ids = ids.to(DEVICE)
    _check_alignment(align(ids, num_experts, block_m), ids, num_experts, block_m)


@pytest.mark.parametrize("block_m", [DECODE_TILES.block_m, PREFILL_TILES.block_m, LARGE_PREFILL_TILES.block_m])
@pytest.mark.parametrize(
    "tokens,top_k,experts,skew",
    [(1, 2, 8, False), (7, 8, 128, False), (33, 2, 16, False), (300, 8, 128, False), (200, 2, 8, True),
     (60, 4, 300, False)],  # fmt: skip
)
def test_align_random(tokens: int, top_k: int, experts: int, skew: bool, block_m: int, placement: str) -> None:
    """Router-like ids: few pairs over many experts (idle ones, single pairs), many over few
    (several tiles an expert), and a skew onto two experts."""
    gen = torch.Generator().manual_seed(tokens * 131 + experts)
    _, ids = _routing(tokens, top_k, experts, gen, skew)
    ids = ids.to(DEVICE)
    _check_alignment(align(ids, experts, block_m), ids, experts, block_m)


@pytest.mark.parametrize("tokens,top_k,experts", [(1, 8, 128), (16, 8, 128), (300, 8, 128), (200, 2, 8), (60, 4, 300)])
def test_both_placements_give_the_same_alignment(tokens: int, top_k: int, experts: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The Triton program, the one-hot count and the stable sort put every pair in the same row:
    an expert's pairs in their original order."""
    _, ids = _routing(tokens, top_k, experts, torch.Generator().manual_seed(tokens))
    ids = ids.to(DEVICE)
    runs = []
    for placement in PLACEMENTS:
        _place_by(monkeypatch, placement)
        runs.append(align(ids, experts, DECODE_TILES.block_m))
    for run in runs[1:]:
        for name in ("sorted_pairs", "tile_expert", "num_padded"):
            assert torch.equal(getattr(runs[0], name), getattr(run, name)), name


def test_each_placement_takes_its_own_path(placement: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The knobs choose the path: the Triton program only where ``placement`` names it, the sort
    only past the one-hot's limit (so the equality tests above compare three real paths)."""
    from siesta.model import triton_align

    calls = []
    program, sort = triton_align.align_pairs, triton_moe.sort_by_expert
    monkeypatch.setattr(triton_align, "align_pairs", lambda *a: (calls.append("kernel"), program(*a))[1])
    monkeypatch.setattr(triton_moe, "sort_by_expert", lambda *a: (calls.append("sort"), sort(*a))[1])
    align(torch.tensor([[3, 1], [1, 0]], device=DEVICE), 4, 16)
    assert calls == {"kernel": ["kernel"], "one-hot": [], "sort": ["sort"]}[placement]


def test_align_shapes_depend_on_token_count_only() -> None:
    """Two routings of the same step size, one spread over all experts, one on two of them:
    the same buffers, so one captured graph serves both."""
    spread = torch.arange(32).view(16, 2) % 16
    crowded = torch.tensor([[0, 1]]).expand(16, 2)
    a, b = (align(ids.to(DEVICE), 16, 16) for ids in (spread, crowded))
    for name in ("sorted_pairs", "tile_expert", "num_padded"):
        assert getattr(a, name).shape == getattr(b, name).shape, name
    assert a.num_padded.item() == 16 * 16 and b.num_padded.item() == 2 * 16


# ---------------------------------------------------------------------------- fused_moe, fp32

DECODE_CASES = [
    Case(1, 2, 8, 64, 32),
    Case(3, 2, 16, 96, 48),
    Case(8, 2, 128, 200, 48),
    Case(2, 8, 8, 64, 32),  # k = E: every expert
    Case(5, 8, 16, 96, 40),
    Case(8, 8, 128, 64, 32),
    Case(4, 2, 8, 64, 768),  # many feature tiles in gate/up, a long reduction in down
    Case(20, 2, 16, 200, 48, skew=True),  # 20 pairs on each of two experts: two row tiles each
]
# Pairs >= PREFILL_PAIRS_PER_EXPERT * experts: the prefill tiles.
PREFILL_CASES = [
    Case(128, 2, 8, 96, 48),
    Case(160, 2, 8, 200, 80),  # H and I multiples of neither 64 nor 128
    Case(96, 2, 4, 64, 32, skew=True),  # 96 pairs on each of two experts: a full and a padded tile
]
# Pairs >= LARGE_PREFILL_PAIRS_PER_EXPERT * experts: the 128-row tiles.
LARGE_PREFILL_CASES = [
    Case(256, 2, 4, 96, 48),
    Case(300, 2, 4, 200, 80, skew=True),  # 300 pairs on each of two experts: two full tiles and a padded one
]


def _expected_tiles(case: Case) -> MoeTiles:
    if case in LARGE_PREFILL_CASES:
        return LARGE_PREFILL_TILES
    return PREFILL_TILES if case in PREFILL_CASES else DECODE_TILES


@pytest.mark.parametrize("case", DECODE_CASES + PREFILL_CASES + LARGE_PREFILL_CASES, ids=lambda c: c.id)
def test_fused_moe_fp32(case: Case) -> None:
    x, weights, ids, gate_up, down = _inputs(case, torch.float32)
    expected_tiles = _expected_tiles(case)
    assert tiles_for(case.tokens * case.top_k, case.experts) == expected_tiles
    out = _fused(x, weights, ids, gate_up, down)
    assert out.shape == (case.tokens, case.hidden) and out.dtype == torch.float32
    _assert_close(out, _oracle(x, weights, ids, gate_up, down), FP32_TOL)
    _assert_close(out, experts_reference(x, weights, ids, gate_up, down), FP32_TOL)


@pytest.mark.parametrize("tiles", [DECODE_TILES, PREFILL_TILES, LARGE_PREFILL_TILES],
                         ids=["decode-tiles", "prefill-tiles", "large-prefill-tiles"])  # fmt: skip
def test_fused_moe_either_tiles(tiles: MoeTiles) -> None:
    """Either tile set gives the oracle's result (to fp32 error: BLOCK_K sets the reduction's
    chunks, so the bits differ): the prefill tiles at decode sizes, mostly padding, included."""
    case = Case(6, 2, 16, 200, 80)
    x, weights, ids, gate_up, down = _inputs(case, torch.float32)
    _assert_close(_fused(x, weights, ids, gate_up, down, tiles), _oracle(x, weights, ids, gate_up, down), FP32_TOL)


@pytest.mark.parametrize("case", [Case(6, 2, 16, 200, 80), Case(300, 2, 4, 200, 80, skew=True)], ids=lambda c: c.id)
@pytest.mark.parametrize("tiles", [DECODE_TILES, LARGE_PREFILL_TILES], ids=["decode-tiles", "large-prefill-tiles"])
def test_persistent_kernels_give_the_tiles_own_bits(case: Case, tiles: MoeTiles) -> None:
    """The persistent launch (a few programs walking the row tiles in use, their feature tiles
    in turn; most of the bound's row tiles are padding at decode sizes, several an expert under
    the skew) computes every tile the one-tile-a-program launch does, with the same sums."""
    x, weights, ids, gate_up, down = _inputs(case, torch.float32)
    persistent = replace(tiles, persistent=True)
    one_a_program = replace(tiles, persistent=False, persistent_down=False)
    programs = triton_moe.persistent_programs(DEVICE)
    assert triton_moe._grid(50, 3, True, DEVICE) == ((programs,), programs) != triton_moe._grid(50, 3, False, DEVICE)
    out = _fused(x, weights, ids, gate_up, down, persistent)
    assert torch.equal(out, _fused(x, weights, ids, gate_up, down, one_a_program))
    down_only = replace(one_a_program, persistent_down=True)
    assert torch.equal(_fused(x, weights, ids, gate_up, down, down_only), out)
    _assert_close(out, _oracle(x, weights, ids, gate_up, down), FP32_TOL)


@pytest.mark.parametrize("case", [Case(300, 2, 4, 200, 80, skew=True), Case(40, 2, 4, 600, 48)], ids=lambda c: c.id)
def test_the_down_gemms_own_feature_tile(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """The down GEMM on a feature tile wider than gate/up's (past H, and H in several tiles with
    a tail), persistent or not, with its own stage count: the oracle's result, and launched on
    that tile while gate/up keeps its own."""
    x, weights, ids, gate_up, down = _inputs(case, torch.float32)
    expected = _oracle(x, weights, ids, gate_up, down)
    launched: list[tuple[str, int, int]] = []

    def recording(name: str, kernel):
        class Launch:
            def __getitem__(self, grid):
                def launch(*args, **kw):
                    launched.append((name, kw["BLOCK_N"], kw["num_stages"]))
                    return kernel[grid](*args, **kw)

                return launch

        return Launch()

    monkeypatch.setattr(triton_moe, "_down_kernel", recording("down", triton_moe._down_kernel))
    monkeypatch.setattr(triton_moe, "_gate_up_kernel", recording("gate_up", triton_moe._gate_up_kernel))
    wide = replace(LARGE_PREFILL_TILES, down_block_n=256, down_num_stages=1)
    for tiles in (wide, replace(wide, persistent_down=False)):
        launched.clear()
        _assert_close(_fused(x, weights, ids, gate_up, down, tiles), expected, FP32_TOL)
        gate_up_stages = min(tiles.num_stages, triton_moe.WIDE_MAX_STAGES)  # fp32 experts
        assert launched == [("gate_up", tiles.block_n, gate_up_stages), ("down", 256, 1)]


@pytest.mark.parametrize("case", [Case(6, 2, 16, 200, 80), Case(300, 2, 4, 200, 80, skew=True), Case(40, 2, 4, 600, 48)],
                         ids=lambda c: c.id)  # fmt: skip
@pytest.mark.parametrize("tiles", [DECODE_TILES, PREFILL_TILES, LARGE_PREFILL_TILES],
                         ids=["decode-tiles", "prefill-tiles", "large-prefill-tiles"])  # fmt: skip
def test_tma_tiles_give_the_pointer_tiles_result(case: Case, tiles: MoeTiles) -> None:
    """Weights (and down's activations) read through TMA descriptors: the pointer loads' result.
    The cases' H and I are not multiples of the tiles, so a gate tile runs into the up rows, the
    last expert's past the end (zeros), and the K chunks past H or I read the descriptor's zero
    fill where the pointer loads mask. (Not bit for bit here: the interpreter's numpy dot sums a
    transposed tile in another order, a few fp32 ulps.)"""
    x, weights, ids, gate_up, down = _inputs(case, torch.float32)
    assert triton_moe._tma_ready(gate_up, down)
    out = _fused(x, weights, ids, gate_up, down, replace(tiles, tma=True))
    _assert_close(out, _fused(x, weights, ids, gate_up, down, replace(tiles, tma=False)), TILING_TOL)
    _assert_close(out, _oracle(x, weights, ids, gate_up, down), FP32_TOL)


def test_tma_tiles_fall_back_to_pointer_loads_for_strided_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights a descriptor cannot describe (a view with other strides) take the pointer loads."""
    case = Case(6, 2, 8, 64, 48)
    x, weights, ids, gate_up, down = _inputs(case, torch.float32)
    strided = down.transpose(1, 2).contiguous().transpose(1, 2)
    assert not triton_moe._tma_ready(gate_up, strided)
    launched: list[bool] = []
    kernel = triton_moe._down_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.append(kw["TMA"])
                return kernel[grid](*args, **kw)

            return launch

    monkeypatch.setattr(triton_moe, "_down_kernel", Recording())
    tma = replace(PREFILL_TILES, tma=True)
    _assert_close(_fused(x, weights, ids, gate_up, strided, tma), _oracle(x, weights, ids, gate_up, down), FP32_TOL)
    _fused(x, weights, ids, gate_up, down, tma)
    assert launched == [False, True]


def test_fused_moe_strided_inputs() -> None:
    """x as a column slice of a wider tensor and the weights as views with other strides (the
    kernels take strides, copying only x)."""
    case = Case(4, 2, 8, 64, 48)
    x, weights, ids, gate_up, down = _inputs(case, torch.float32)
    wide = torch.cat([x, torch.full_like(x, math.nan)], dim=1)[:, : case.hidden]
    gate_up_t = gate_up.transpose(1, 2).contiguous().transpose(1, 2)  # H-major storage
    down_t = down.transpose(1, 2).contiguous().transpose(1, 2)
    out = _fused(wide, weights.t().contiguous().t(), ids.t().contiguous().t(), gate_up_t, down_t)
    _assert_close(out, _oracle(x, weights, ids, gate_up, down), FP32_TOL)


def test_fused_moe_no_tokens() -> None:
    case = Case(0, 2, 8, 64, 32)
    x, weights, ids, gate_up, down = _inputs(case, torch.float32)
    out = fused_moe(x, weights, ids, gate_up, down)
    assert out.shape == (0, 64)


@pytest.mark.parametrize("tokens,bad", [(2, [0]), (12, [1, 11]), (40, [0, 17, 39])], ids=["pairs", "T12", "T40"])
def test_non_finite_rows_stay_in_their_own_rows_through_the_router_and_experts(tokens: int, bad: list[int]) -> None:
    """A whole-step mixed graph pads a step to its bucket; attention skips the padding tokens, so
    their rows carry whatever the graph pool's memory held, NaN included, through every sparse
    layer. The layer routes and sorts every row together: such a row must not stop the step (an
    expert id of E trips the sort's indexing, and on a GPU that assert ends the CUDA context, as
    on an H100) nor change any other row. The router and the experts both run here (Triton's
    interpreter without a GPU); the finite rows get what a step without the bad ones gives."""
    case = Case(tokens, 2, 8, 64, 32)
    x, _, _, gate_up, down = _inputs(case, torch.float32)
    router = torch.randn(case.experts, case.hidden, generator=_gen(case, salt=1)).to(DEVICE)
    x[bad[0]] = math.nan
    if len(bad) > 1:
        x[bad[1], 3] = math.inf
        x[bad[2:], :] = -math.inf
    weights, ids = triton_router.route(x @ router.T, case.top_k, True, torch.float32)
    assert ((ids >= 0) & (ids < case.experts)).all()
    out = _fused(x, weights, ids, gate_up, down)
    good = torch.tensor([t for t in range(tokens) if t not in bad], device=DEVICE)
    assert torch.isnan(out[bad]).all(dim=-1).all()
    x_good = x[good]
    w_good, ids_good = triton_router.route(x_good @ router.T, case.top_k, True, torch.float32)
    assert torch.equal(ids[good], ids_good)
    _assert_close(out[good], _oracle(x_good, w_good, ids_good, gate_up, down), FP32_TOL)


# ---------------------------------------------------------------------------- one or two tokens

PAIR_CASES = [
    Case(1, 8, 128, 256, 96),  # Qwen3-MoE's k and E
    Case(1, 2, 8, 200, 80),  # H and I multiples of no tile (ragged K chunks in both kernels)
    Case(2, 8, 16, 512, 512),  # two K chunks in each kernel; two tokens out of 16 experts share some
    Case(2, 4, 8, 64, 32, skew=True),  # both tokens on the same four experts: each read twice
]


@pytest.mark.parametrize("case", PAIR_CASES, ids=lambda c: c.id)
def test_one_or_two_tokens_take_the_pair_kernels(case: Case) -> None:
    """No sort at one or two tokens: each (token, k) pair streams its expert's rows; the oracle's
    result to fp32 error, every output written (the buffers start as NaN)."""
    x, weights, ids, gate_up, down = _inputs(case, torch.float32)
    assert uses_pair_path(case.tokens, gate_up, down)
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        import siesta.model.triton_moe as tm

        mp.setattr(tm, "align", lambda *a, **kw: calls.append(a) or align(*a, **kw))
        out = _fused(x, weights, ids, gate_up, down)
    assert not calls, "the pair path sorted the pairs"
    _assert_close(out, _oracle(x, weights, ids, gate_up, down), FP32_TOL)
    _assert_close(out, experts_reference(x, weights, ids, gate_up, down), FP32_TOL)


@pytest.mark.parametrize("tiles", [(8, 64, 2, 2), (32, 128, 8, 5)], ids=str)
def test_the_pair_kernels_tiles_are_knobs(tiles: tuple, monkeypatch: pytest.MonkeyPatch, launch_grids) -> None:
    """``GATE_UP_PAIR_TILES`` and ``DOWN_SUM_TILES``: each kernel's grid follows its tile, and
    the oracle's result holds at any tile (H and I of no tile's multiple: ragged last ones)."""
    case = Case(2, 8, 16, 200, 80)
    x, weights, ids, gate_up, down = _inputs(case, torch.float32)
    pair = triton_moe.PairTiles(*tiles)
    monkeypatch.setattr(triton_moe, "GATE_UP_PAIR_TILES", pair)
    monkeypatch.setattr(triton_moe, "DOWN_SUM_TILES", replace(pair, block_n=pair.block_n * 2))
    grids = launch_grids(triton_moe, "_gate_up_pair_kernel", "_down_sum_kernel")
    out = _fused(x, weights, ids, gate_up, down)
    assert grids == [(2 * 8, -(-80 // pair.block_n)), (2, -(-200 // (2 * pair.block_n)))]
    _assert_close(out, _oracle(x, weights, ids, gate_up, down), FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", PAIR_CASES, ids=lambda c: c.id)
def test_down_and_sum_split_over_the_experts_gives_the_one_kernels_bits(case: Case, dtype: torch.dtype, launch_grids,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """``DOWN_SUM_SPLIT``: a program a (pair, feature tile), the last of a token's k to arrive
    summing their outputs, gives the one-program-a-token kernel's bits; twice in a row, so the
    counters it leaves (all zero) serve the next launch."""
    from siesta import arrivals

    x, weights, ids, gate_up, down = _inputs(case, dtype)
    monkeypatch.setattr(arrivals, "_counters", {})
    whole = _fused(x, weights, ids, gate_up, down)
    monkeypatch.setattr(triton_moe, "DOWN_SUM_SPLIT", True)
    grids = launch_grids(triton_moe, "_down_pair_kernel", "_down_sum_kernel")
    split = [_fused(x, weights, ids, gate_up, down) for _ in range(2)]
    tiles = -(-case.hidden // triton_moe.DOWN_SUM_TILES.block_n)
    assert grids == [(case.tokens * case.top_k, tiles)] * 2  # the split kernel only
    assert torch.equal(split[0], whole) and torch.equal(split[1], whole)
    assert arrivals._counters[x.device].count_nonzero() == 0


def test_the_pair_path_is_for_few_tokens_in_the_default_mode_only(monkeypatch: pytest.MonkeyPatch) -> None:
    case = Case(1, 2, 8, 64, 32)
    x, weights, ids, gate_up, down = _inputs(case, torch.float32)
    monkeypatch.setattr(batch_invariant, "_enabled", False)
    assert [uses_pair_path(t, gate_up, down) for t in (0, 1, PAIR_PATH_MAX_TOKENS, PAIR_PATH_MAX_TOKENS + 1)] == [
        False, True, True, False]  # fmt: skip
    # Weights not contiguous along the reduction take the sorted path, which reads any strides.
    assert not uses_pair_path(1, gate_up.transpose(1, 2).contiguous().transpose(1, 2), down)
    assert not uses_pair_path(1, gate_up, down.transpose(1, 2).contiguous().transpose(1, 2))
    monkeypatch.setattr(batch_invariant, "_enabled", True)  # one tile set for every step
    assert not uses_pair_path(1, gate_up, down)


def test_the_pair_path_reads_a_strided_x() -> None:
    case = Case(2, 2, 8, 64, 48)
    x, weights, ids, gate_up, down = _inputs(case, torch.float32)
    wide = torch.cat([x, torch.full_like(x, math.nan)], dim=1)[:, : case.hidden]
    _assert_close(_fused(wide, weights, ids, gate_up, down), _oracle(x, weights, ids, gate_up, down), FP32_TOL)


# ---------------------------------------------------------------------------- CUDA


BF16_CASES = [
    Case(1, 8, 128, 256, 96),  # the pair kernels
    Case(2, 8, 128, 2048, 768),  # the pair kernels at Qwen3-30B-A3B's H and I
    Case(8, 2, 16, 200, 48),
    Case(8, 8, 128, 512, 768),
    Case(20, 2, 16, 200, 48, skew=True),
    Case(512, 8, 64, 1024, 256),  # prefill tiles
    Case(160, 2, 8, 200, 80),
]


@GPU_ONLY
@pytest.mark.parametrize("case", BF16_CASES, ids=lambda c: c.id)
def test_fused_moe_bf16_cuda(case: Case) -> None:
    x, weights, ids, gate_up, down = _inputs(case, torch.bfloat16)
    out = _fused(x, weights, ids, gate_up, down)
    assert out.dtype == torch.bfloat16
    _assert_close(out, _oracle(x, weights, ids, gate_up, down), BF16_TOL)
    _assert_close(out, experts_reference(x, weights, ids, gate_up, down), BF16_TOL)


@GPU_ONLY
@pytest.mark.parametrize("case", BF16_CASES, ids=lambda c: c.id)
def test_tma_tiles_bf16_cuda(case: Case) -> None:
    """On the card, the TMA loads feed the MMAs the same tiles as the pointer loads: the same
    bits, for every tile set the step could take."""
    x, weights, ids, gate_up, down = _inputs(case, torch.bfloat16)
    for tiles in (DECODE_TILES, PREFILL_TILES, LARGE_PREFILL_TILES):
        out = _fused(x, weights, ids, gate_up, down, replace(tiles, tma=True))
        assert torch.equal(out, _fused(x, weights, ids, gate_up, down, replace(tiles, tma=False))), tiles
        _assert_close(out, _oracle(x, weights, ids, gate_up, down), BF16_TOL)


@GPU_ONLY
def test_fused_moe_no_host_sync_cuda() -> None:
    case = Case(8, 8, 128, 256, 96)
    inputs = _inputs(case, torch.bfloat16)
    fused_moe(*inputs)  # compiles outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fused_moe(*inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _assert_close(out, _oracle(*inputs), BF16_TOL)


@GPU_ONLY
@pytest.mark.parametrize("case", [Case(1, 8, 128, 256, 96), Case(8, 8, 128, 256, 96), Case(256, 2, 16, 200, 80),
                                  Case(300, 2, 4, 256, 128, skew=True)],  # the large tiles: TMA descriptors
                         ids=lambda c: c.id)  # fmt: skip
def test_fused_moe_cuda_graph_replay(case: Case) -> None:
    """Captured once, replayed with new routings copied into the captured buffers (other experts,
    and a skewed one that fills more row tiles): the eager result each time, bit for bit."""
    x, weights, ids, gate_up, down = _inputs(case, torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(x, weights, ids, gate_up, down)  # compiles and warms the allocator outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, weights, ids, gate_up, down)
    for salt, skew in [(1, False), (2, True), (3, False)]:
        new = Case(case.tokens, case.top_k, case.experts, case.hidden, case.inter, skew)
        nx, nw, nids, _, _ = _inputs(new, torch.bfloat16, salt)
        for buf, val in ((x, nx), (weights, nw), (ids, nids)):
            buf.copy_(val)
        graph.replay()
        torch.cuda.synchronize()
        eager = fused_moe(nx, nw, nids, gate_up, down)
        assert torch.equal(out, eager), f"replay {salt} differs from eager"
        _assert_close(out, _oracle(nx, nw, nids, gate_up, down), BF16_TOL)


# ---------------------------------------------------------------------------- the library path


@pytest.mark.skipif(not triton_moe.grouped_mm_moe.available(), reason="this torch has no F.grouped_mm")
def test_large_steps_take_the_library_path_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    case = Case(40, 2, 8, 64, 32)
    x, weights, ids, gate_up, down = _inputs(case, torch.float32)
    monkeypatch.setattr(batch_invariant, "_enabled", False)
    assert not triton_moe.uses_library(10**6)  # off by default
    monkeypatch.setattr(triton_moe, "LIBRARY_MIN_PAIRS", 80)
    assert [triton_moe.uses_library(n) for n in (79, 80)] == [False, True]
    calls = []
    real = triton_moe.grouped_mm_moe.grouped_mm_moe
    monkeypatch.setattr(triton_moe.grouped_mm_moe, "grouped_mm_moe", lambda *a: calls.append(1) or real(*a))
    out = fused_moe(x, weights, ids, gate_up, down)
    assert calls == [1]
    _assert_close(out, _oracle(x, weights, ids, gate_up, down), FP32_TOL)
    fused_moe(x[:39], weights[:39], ids[:39], gate_up, down)  # 78 pairs: the fused kernels
    assert calls == [1]
    monkeypatch.setattr(batch_invariant, "_enabled", True)  # deterministic mode keeps its one tile set
    assert not triton_moe.uses_library(10**6)


@GPU_ONLY
@pytest.mark.skipif(not triton_moe.grouped_mm_moe.available(), reason="this torch has no F.grouped_mm")
def test_the_library_path_bf16_without_host_sync_and_in_a_graph_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_moe, "LIBRARY_MIN_PAIRS", 1)
    case = Case(256, 2, 16, 256, 96)
    x, weights, ids, gate_up, down = _inputs(case, torch.bfloat16)
    _assert_close(fused_moe(x, weights, ids, gate_up, down), _oracle(x, weights, ids, gate_up, down), BF16_TOL)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe(x, weights, ids, gate_up, down)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, weights, ids, gate_up, down)
    nx, nw, nids, _, _ = _inputs(Case(256, 2, 16, 256, 96, True), torch.bfloat16, 1)
    for buf, val in ((x, nx), (weights, nw), (ids, nids)):
        buf.copy_(val)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_moe(nx, nw, nids, gate_up, down))


# ---------------------------------------------------------------------------- deterministic mode


@pytest.fixture
def deterministic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_invariant, "_enabled", True)


def test_deterministic_mode_runs_one_tile_set_whatever_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = (1, 16, PREFILL_PAIRS_PER_EXPERT * 8, LARGE_PREFILL_PAIRS_PER_EXPERT * 8 - 1, 100_000)
    monkeypatch.setattr(batch_invariant, "_enabled", False)
    assert [step_tiles(n, 8) for n in sizes] == [DECODE_TILES] * 2 + [PREFILL_TILES] * 2 + [LARGE_PREFILL_TILES]
    assert all(step_tiles(n, 8) == tiles_for(n, 8) for n in sizes)
    monkeypatch.setattr(batch_invariant, "_enabled", True)
    assert {step_tiles(n, 8) for n in sizes} == {DETERMINISTIC_TILES}


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if ON_GPU else []), ids=str)
def test_deterministic_mode_gives_a_token_the_same_bits_in_any_batch(deterministic, dtype: torch.dtype) -> None:
    """One token's output alone, and at the start, middle and end of batches of 5 and 70 whose
    tokens crowd onto its experts (sharing its row tiles, at other places in them) or spread
    over all of them: the same bits. 70 tokens make 140 pairs over 4 experts, where the default
    mode would switch to the prefill tiles (another BLOCK_K, other bits)."""
    experts, hidden, inter = 4, 96, 80
    assert tiles_for(2, experts) != tiles_for(140, experts)
    x, weights, ids, gate_up, down = _inputs(Case(8, 2, experts, hidden, inter), dtype)
    target = slice(3, 4)
    alone = fused_moe(x[target], weights[target], ids[target], gate_up, down)
    for tokens, skew in ((5, False), (70, True), (70, False)):
        bx, bw, bids, _, _ = _inputs(Case(tokens, 2, experts, hidden, inter, skew=skew), dtype, salt=tokens)
        places = sorted({0, tokens // 2, tokens - 1})  # the token at each place at once
        for buf, val in ((bx, x), (bw, weights), (bids, ids)):
            buf[places] = val[target]
        out = fused_moe(bx, bw, bids, gate_up, down)
        for at in places:
            assert torch.equal(out[at], alone[0]), f"{tokens} tokens (skew={skew}), at {at}"


def test_sum_over_k_in_k_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deterministic mode: k = 0, 1, ... into one fp32 sum, rounded once; default: torch's sum."""
    per_pair = (torch.randn(6, 8, 33, generator=torch.Generator().manual_seed(5)) * 100).to(torch.float16)
    monkeypatch.setattr(batch_invariant, "_enabled", False)
    assert torch.equal(sum_over_k(per_pair), per_pair.sum(dim=1))
    monkeypatch.setattr(batch_invariant, "_enabled", True)
    total = per_pair[:, 0].float()
    for j in range(1, 8):
        total = total + per_pair[:, j].float()
    before = per_pair.clone()
    assert torch.equal(sum_over_k(per_pair), total.to(torch.float16))
    assert torch.equal(per_pair, before), "the input was written to"
    fp32 = per_pair.float()
    assert torch.equal(sum_over_k(fp32[:, :1]), fp32[:, 0]) and sum_over_k(fp32[:, :1]).data_ptr() != fp32.data_ptr()
