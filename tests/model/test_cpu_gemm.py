"""``cpu_gemm.c``'s ``linear_tiled`` against a float64 oracle: every tail of its passes of rows
(6 under AVX-512, 2 under AVX2) and 4-row weight tiles, strided rows, bias, thread counts, a
row's bits whatever batch it is in, what it refuses, and weights read as they are now. Every
test runs on each build the machine can run (c_marches.MARCHES: native, and AVX2 on x86-64)."""

from __future__ import annotations

import ctypes

import pytest
import torch
from c_marches import MARCHES, kernel_for, serving
from linear_cases import at_thread_counts, case, library, within_dot_product_bound  # noqa: F401 (a fixture)

from siesta.model import cpu_linear

_F32P = ctypes.POINTER(ctypes.c_float)


@pytest.fixture(scope="module", params=MARCHES)
def lib(request: pytest.FixtureRequest):
    """The build for ``request.param``, which cpu_linear's own paths then call too."""
    with serving(cpu_linear, "load_gemm", kernel_for(request.param, cpu_linear.load_gemm)) as built:
        yield built


@pytest.fixture(autouse=True)
def _each_build(lib: ctypes.CDLL) -> None:
    """Every test below, once per build."""


def _call(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, y: torch.Tensor) -> int:
    ptr = lambda t: None if t is None else ctypes.cast(t.data_ptr(), _F32P)  # noqa: E731
    return lib.linear_tiled(ptr(x), x.stride(0), x.shape[0], ptr(w), w.shape[1], w.shape[0], ptr(b), ptr(y), y.stride(0))


# Rows: one pass and every tail of it (1-5), several passes with and without a tail; n: whole
# tiles and tails of 1-3 features; k: one AVX-512 vector (two AVX2 ones), SmolLM2's two widths.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 11, 12, 37, 64, 128])
@pytest.mark.parametrize("n,k,bias", [(4, 16, False), (7, 576, True), (962, 576, False), (45, 1536, True)])
def test_within_the_dot_product_bound_of_float64(rows: int, n: int, k: int, bias: bool) -> None:
    x, w, b = case(rows, n, k, bias, seed=rows)
    out = cpu_linear.linear_tiled(x, w, b)
    assert out is not None
    assert within_dot_product_bound(out, x, w, b)


def test_strided_rows_are_read_and_only_the_outputs_written(lib: ctypes.CDLL) -> None:
    x, w, b = case(13, 10, 64, True)
    wide_x = torch.full((13, 100), float("nan"))
    wide_x[:, :64] = x  # row stride 100: the NaNs past each row must never be read
    y = torch.full((13, 30), -7.0)
    assert _call(lib, wide_x[:, :64], w, b, y[:, 5:15]) == 0
    assert torch.equal(y[:, :5], torch.full((13, 5), -7.0)) and torch.equal(y[:, 15:], torch.full((13, 15), -7.0))
    assert within_dot_product_bound(y[:, 5:15], x, w, b)


def test_any_thread_count_gives_the_same_bits() -> None:
    x, w, b = case(20, 333, 128, True)
    results = at_thread_counts(lambda: cpu_linear.linear_tiled(x, w, b))
    assert all(torch.equal(r, results[0]) for r in results)


def test_a_rows_bits_do_not_depend_on_its_batch() -> None:
    """Alone, first, in a pass's tail or mid-batch: the same row gives the same bits (a sequence
    decodes the same whatever else shares its step)."""
    x, w, b = case(40, 70, 576, True)
    full = cpu_linear.linear_tiled(x, w, b)
    for start, stop in ((0, 1), (17, 18), (3, 10), (30, 40), (5, 37)):
        part = cpu_linear.linear_tiled(x[start:stop], w, b)
        assert torch.equal(part, full[start:stop]), (start, stop)


def test_a_nan_weight_row_spoils_only_its_own_outputs() -> None:
    """The shuffle tree sums four tiles' accumulators together: a lane crossing over would spread it."""
    x, w, _ = case(9, 12, 64, False)
    w[5, 3] = float("nan")
    out = cpu_linear.linear_tiled(x, w, None)
    assert bool(out[:, 5].isnan().all())
    others = torch.cat([out[:, :5], out[:, 6:]], dim=1)
    assert not bool(others.isnan().any())


@pytest.mark.parametrize("vectors", [0, 0.5, 4.8])
def test_in_features_that_are_not_whole_vectors_are_refused_untouched(lib: ctypes.CDLL, vectors: float) -> None:
    k = int(vectors * lib.vec)
    x, w, b = case(3, 8, k, True)
    y = torch.full((3, 8), 5.0)
    assert _call(lib, x, w, b, y) == -1
    assert torch.equal(y, torch.full((3, 8), 5.0))
    assert cpu_linear.linear_tiled(x, w, b) is None


def test_a_weight_written_in_place_is_what_it_multiplies() -> None:
    x, w, b = case(8, 16, 32, True)
    before = cpu_linear.linear_tiled(x, w, b)
    with torch.no_grad():
        w.mul_(2.0)
    after = cpu_linear.linear_tiled(x, w, b)
    torch.testing.assert_close(after - b, 2.0 * (before - b), rtol=1e-5, atol=1e-4)


def test_linear_takes_the_kernel_up_to_max_rows(monkeypatch: pytest.MonkeyPatch, library) -> None:
    assert library("mkl") == "mkl"
    calls: list[int] = []
    kernel = cpu_linear.linear_tiled
    monkeypatch.setattr(cpu_linear, "linear_tiled", lambda x, w, b: calls.append(x.shape[0]) or kernel(x, w, b))
    with torch.inference_mode():
        for rows in (1, cpu_linear.MAX_ROWS, cpu_linear.MAX_ROWS + 1):
            x, w, b = case(rows, 8, 32, True)
            out = cpu_linear.linear(x, w, b)
            assert (out is not None) == (rows <= cpu_linear.MAX_ROWS)  # past it: MKL's F.linear
    assert calls == [1, cpu_linear.MAX_ROWS]
