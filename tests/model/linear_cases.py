"""Inputs, the float64 oracle and the library fixture shared by the CPU linear tests
(``test_cpu_linear.py``, ``test_cpu_gemm.py``). Not a conftest.py: the tests' own
``from conftest import ...`` must keep finding tests/conftest.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from siesta.model import cpu_linear

UNIT = 2.0**-24  # fp32's unit roundoff


@pytest.fixture
def library():
    """Sets this process's CPU matmul for one test, then puts the engine's choice back."""
    before = cpu_linear.library()
    yield cpu_linear.set_library
    cpu_linear.set_library(before)


def case(rows: int, n: int, k: int, bias: bool, seed: int = 0):
    """x [rows, k], w [n, k] and b [n] (or None), random from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    return x, w, b


def within_dot_product_bound(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """|out - exact| <= (k + 1) u (|x| |w|^T + |b|): Higham's bound on fp32 dot products of
    length k, whatever order they are summed in."""
    k = x.shape[1]
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    magnitude = F.linear(x.double().abs(), w.double().abs()) + (0 if b is None else b.double().abs())
    return bool(((out.double() - exact).abs() <= (k + 1) * UNIT * magnitude).all())


def at_thread_counts(fn: Callable[[], torch.Tensor], counts: tuple[int, ...] = (1, 2, 3)) -> list[torch.Tensor]:
    """``fn()`` under each torch thread count, the process's count put back after."""
    threads = torch.get_num_threads()
    results = []
    try:
        for n in counts:
            torch.set_num_threads(n)
            results.append(fn())
    finally:
        torch.set_num_threads(threads)
    return results
