"""``moe.sort_by_expert``, the sort both expert paths share, against a count by hand: a stable
int64 argsort and per-expert counts. Past 256 experts the keys need two bytes; past 32,768 (int16's top), four."""

from __future__ import annotations

import pytest
import torch

from siesta.model.moe import narrow_keys, sort_by_expert


@pytest.mark.parametrize("pairs,experts", [(1, 8), (64, 128), (5000, 128), (900, 300), (700, 70_000)])
def test_matches_a_stable_int64_sort_and_a_count(pairs: int, experts: int) -> None:
    g = torch.Generator().manual_seed(pairs + experts)
    # Skewed: a few experts take most pairs, many take none.
    flat = (torch.rand(pairs, generator=g) ** 3 * experts).long().clamp(max=experts - 1)
    flat[0] = experts - 1  # the widest id is there, so a key type too narrow would wrap it
    order, experts_sorted, first = sort_by_expert(flat, experts)
    assert torch.equal(order, torch.argsort(flat, stable=True))
    assert torch.equal(experts_sorted, flat[order])
    counts = torch.bincount(flat, minlength=experts)
    assert first.shape == (experts + 1,) and first[0] == 0 and first[-1] == pairs
    assert torch.equal(first.diff(), counts)


def test_keys_are_the_narrowest_type_that_holds_every_id() -> None:
    ids = torch.tensor([0, 5])
    assert [narrow_keys(ids, e).dtype for e in (256, 257, 32_768, 32_769)] == [
        torch.uint8, torch.int16, torch.int16, torch.int32]  # fmt: skip
