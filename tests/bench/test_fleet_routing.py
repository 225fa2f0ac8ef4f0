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


def test_the_order_is_balanced_against_where_each_request_ran() -> None:
    # A warm-up whose requests reached the gateway out of index order: the residues count
    # from the replica each one ran on.
    ran_on = [2, 0, 1, 1, 2, 0, 0, 2, 1, 2, 1, 0]
    order = resume_order(12, 3, 0, ran_on)
    residues = Counter((p - ran_on[i]) % 3 for p, i in enumerate(order))
    assert sorted(order) == list(range(12)) and max(residues.values()) == 4, residues
