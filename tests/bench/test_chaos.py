"""The chaos bench's summary of dropped tier stores, from a real /metrics exposition."""

from siesta.bench.chaos import dropped_stores_by_reason
from siesta.client import parse_metrics
from siesta.metrics import EngineStats, MetricsRegistry
from siesta.tiers.base import DropReason


def test_dropped_stores_are_summed_per_reason_over_the_tiers():
    counted = {("host", DropReason.NO_SPACE): 2, ("disk", DropReason.NO_SPACE): 3, ("disk", DropReason.IO_ERROR): 5,
               ("host", DropReason.CACHE_RESET): 7}  # fmt: skip
    stats = EngineStats()
    for (tier, reason), n in counted.items():
        stats.inc("kv_offload_dropped_stores", n, tier=tier, reason=reason.value)
    registry = MetricsRegistry()
    registry.apply(stats.drain())
    got = dropped_stores_by_reason(parse_metrics(registry.exposition().decode()))
    expected = {reason.value: sum(n for (_, r), n in counted.items() if r is reason) for reason in DropReason}
    assert got == expected
    assert got["no_space"] == 5 and got["version_stale"] == 0  # every reason is listed, counted or not
