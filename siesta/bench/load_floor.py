"""The ordered-load floor of a kept-tier replay: what its latencies cannot beat.

Tier loads land in admission order, so request i can start computing no sooner than the KV
of requests 0..i has crossed the host link; then it still runs one step per token it
generates. Its floor is therefore

    floor(i) = (KV bytes of requests 0..i) / link bytes per second + new tokens x decode step

with the decode step measured at batch 1 over the replay's context: every step the request
really runs is at least that long (a batch is no faster per step, and its first step
extends a long prefix). The replay's p50 against the floors' p50 says how close the engine
comes to moving only the bytes each request needs, in order, at link speed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import accumulate
from typing import Any

from siesta.bench.common import median

DEFAULT_LINK_GBPS = 55.0  # pinned host-to-device on the H200 (issue 5: 55.4 GB/s measured)
GB = 1e9


@dataclass(frozen=True)
class LoadFloor:
    link_gbps: float
    decode_step_s: float
    new_tokens: int  # each request's generated tokens: one step each

    def per_request(self, kv_bytes: Sequence[float]) -> list[float]:
        """The floor of each request, ``kv_bytes`` listed in admission order."""
        steps_s = self.new_tokens * self.decode_step_s
        return [loaded / (self.link_gbps * GB) + steps_s for loaded in accumulate(kv_bytes)]

    def report(self, kv_bytes: Sequence[float], replay_p50_s: float) -> dict[str, Any]:
        """The floors, their p50 and the replay's p50 over it (the goal: at most 1.15)."""
        floors = self.per_request(kv_bytes)
        floor_p50 = median(floors)
        return asdict(self) | {
            "kv_bytes": list(kv_bytes),
            "floor_s": floors,
            "floor_p50_s": floor_p50,
            "replay_p50_s": replay_p50_s,
            "p50_over_floor": replay_p50_s / floor_p50,
        }


def loading_gbps(load_bytes: float, load_seconds: float) -> float | None:
    """The host link's rate while loads were in flight (the connector's load seconds); None
    when nothing was loaded."""
    return load_bytes / load_seconds / GB if load_seconds > 0 else None


def equal_shares(total_bytes: float, requests: int) -> list[float]:
    """Each request's KV when every prompt has one length: the replay's load bytes split evenly."""
    return [total_bytes / requests] * requests
