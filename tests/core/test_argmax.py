"""The greedy argmax kernels against torch.argmax: first index of the maximum, NaN largest.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets it up)."""

from __future__ import annotations

import pytest
import torch

from siesta.core.argmax import CHUNK, MAX_CHUNKS, argmax_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def check(logits: torch.Tensor) -> None:
    got = argmax_rows(logits, use_kernels=True)
    assert got.dtype == torch.int64
    assert torch.equal(got.cpu(), logits.cpu().argmax(dim=-1))


@pytest.mark.parametrize("vocab", [1, 7, CHUNK, CHUNK + 1, 3 * CHUNK - 5])
def test_random_rows(vocab):
    g = torch.Generator().manual_seed(vocab)
    check(torch.randn(5, vocab, generator=g).to(DEVICE))


def test_ties_take_the_first_index_also_across_chunks():
    vocab = 3 * CHUNK + 17
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0))
    logits[0, [5, CHUNK + 3, 2 * CHUNK]] = 9.0  # the same top in three chunks
    logits[1, [CHUNK - 1, CHUNK]] = 9.0  # either side of a chunk boundary
    logits[2, [2 * CHUNK + 1, vocab - 1]] = 9.0  # in the last, ragged chunk
    logits[3] = 0.0  # all equal
    logits[4] = float("-inf")  # nothing allowed
    logits[5, : CHUNK + 4] = float("-inf")  # a whole chunk banned
    check(logits.to(DEVICE))


def test_nan_counts_as_the_largest():
    vocab = 2 * CHUNK + 3
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    logits[0, CHUNK + 9] = float("nan")
    logits[1, [7, CHUNK + 2]] = float("nan")
    logits[1, 3] = float("inf")
    logits[2, :] = float("nan")
    check(logits.to(DEVICE))


def test_what_the_kernels_do_not_serve_falls_back_to_torch():
    strided = torch.randn(4, 2 * CHUNK)[:, ::2]  # non-contiguous rows
    check(strided.to(DEVICE))
    check(torch.randn(2, 100, dtype=torch.float64).to(DEVICE))
    check(torch.randn(1, CHUNK * MAX_CHUNKS + 1).to(DEVICE))
    with pytest.raises(ValueError, match="rows, vocab"):
        argmax_rows(torch.randn(3))
