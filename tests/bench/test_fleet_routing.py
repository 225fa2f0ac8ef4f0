"""The fleet routing bench's resume order: no rotation of a round-robin gateway sends more than its
share of the resumed requests back where they ran (so round robin's figure is not luck)."""

from __future__ import annotations

from collections import Counter

import pytest

from siesta.bench.fleet_routing import resume_order


@pytest.mark.parametrize("prompts,replicas", [(12, 3), (24, 3), (16, 4), (10, 3)])
def test_every_rotation_gets_its_share(prompts: int, replicas: int) -> None:
    for seed in range(5):
        order = resume_order(prompts, replicas, seed)
        assert sorted(order) == list(range(prompts))
        residues = Counter((p - i) % replicas for p, i in enumerate(order))
        assert max(residues.values()) <= -(-prompts // replicas), (seed, residues)
    assert resume_order(prompts, replicas, 7) == resume_order(prompts, replicas, 7)
