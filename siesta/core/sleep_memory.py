"""Device memory a sleep gives back and a wake-up maps again, on every rank at once.

Level 1 releases the KV cache and keeps the weights in host memory; level 2 releases both (the
weights are then written or reloaded before generating); ``tags`` narrows what a level releases
(DESIGN.md, invariant 7). A wake-up restores the weights and the KV cache separately, so a
trainer can write new weights before the KV memory comes back. What each part moved is kept in
``reports`` (sleep_weights, wake_kv_cache, ...) and counted in the metrics.
"""

from __future__ import annotations

import logging
import time

from siesta.core.device_memory import MemoryReport
from siesta.core.model_runner import ModelRunner
from siesta.core.ranks import RankedMemory, Ranks
from siesta.metrics import EngineStats
from siesta.tiers.base import KVConnector
from siesta.weight_transfer.state import WeightState

logger = logging.getLogger(__name__)


class SleepMemory:
    def __init__(
        self,
        memory: RankedMemory,
        ranks: Ranks,
        runner: ModelRunner,
        connector: KVConnector | None,
        weights: WeightState,
        stats: EngineStats,
    ) -> None:
        self.memory = memory
        self.ranks = ranks
        self.runner = runner
        self.connector = connector
        self.weights = weights
        self.stats = stats
        self.reports: dict[str, MemoryReport] = {}  # what the last sleep and wake moved, part by part

    def release(self, level: int, releases: list[str]) -> None:
        """Give back what a sleep at ``level`` releases (``releases``: the tags it narrowed to)."""
        t0 = time.perf_counter()
        released = 0
        if level >= 1:
            if self.connector is not None:
                self.connector.wait_for_stores(self.runner.kv_cache)  # nothing may read the cache once it is gone
            self.reports["sleep_kv_cache"] = self.memory.release_kv_cache()
            released = self.reports["sleep_kv_cache"].bytes
            self._moved()
            if "weights" in releases:
                self.reports["sleep_weights"] = self.memory.release_weights(backup=level == 1)
                released += self.reports["sleep_weights"].bytes
                if level == 2:
                    self.weights.released()
        self.stats.inc("sleeps", level=str(level))
        self._record_seconds("sleep", time.perf_counter() - t0, level=str(level))
        self.stats.set("device_bytes_released", released)
        logger.info("asleep at level %d: released %.2f GiB in %.2fs", level, released / 2**30, time.perf_counter() - t0)

    def restore(self, tags: list[str]) -> bool:
        """Map back what ``tags`` name; whether everything is back (else a staged wake goes on)."""
        t0 = time.perf_counter()
        if "weights" in tags:
            self.reports["wake_weights"], _ = self.memory.restore_weights()
        if "kv_cache" in tags:
            mapped_again = self.memory.kv_released
            self.reports["wake_kv_cache"] = self.memory.restore_kv_cache()
            if mapped_again:
                # Fresh memory may hold NaN bit patterns: each block is zeroed by the first step
                # that uses it, on every rank (its plan names them), unless a tier load writes it whole.
                self.runner.kv_cache.forget_contents()
        self._moved()
        self._record_seconds("wake", time.perf_counter() - t0, tags=",".join(sorted(set(tags))))
        return not (self.memory.weights_released or self.memory.kv_released)

    def recapture_graphs(self) -> None:
        """After the weights are back (capture runs the model), where memory came back elsewhere."""
        if not self.memory.keeps_addresses:
            self.ranks.run("recapture_graphs")

    def _moved(self) -> None:
        # Without virtual memory management released memory comes back at other addresses.
        if not self.memory.keeps_addresses:
            self.ranks.run("memory_moved")

    def _record_seconds(self, what: str, seconds: float, **labels: str) -> None:
        """One sleep's or wake-up call's device-memory seconds: summed, per call (p50) and the last."""
        self.stats.inc(f"{what}_seconds", seconds)
        self.stats.observe(f"{what}_duration_seconds", seconds, **labels)
        self.stats.set(f"last_{what}_seconds", seconds, **labels)
