"""One registry of Prometheus metrics.

The engine core counts into ``EngineStats`` (plain numbers, cheap to send over
IPC); the frontend applies each drained snapshot to its ``MetricsRegistry``,
which prometheus_client renders for ``/metrics`` and ``LLM.get_metrics()``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

PREFIX = "siesta_"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
# Step times, 0.5 ms to ~30 s, each bucket 1.5x the last: the bucket of the slowest step bounds
# it within 1.5x (what a control call waits for; the latency buckets are up to 5x apart).
_STEP_BUCKET_FIRST_S = 0.0005
_STEP_BUCKET_RATIO = 1.5
_STEP_BUCKET_COUNT = 28
_STEP_BUCKETS = tuple(round(_STEP_BUCKET_FIRST_S * _STEP_BUCKET_RATIO**i, 6) for i in range(_STEP_BUCKET_COUNT))


@dataclass(frozen=True)
class MetricSpec:
    name: str  # without the siesta_ prefix and, for counters, without _total
    kind: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = _LATENCY_BUCKETS  # histograms only


SPECS: dict[str, MetricSpec] = {
    s.name: s
    for s in [
        MetricSpec("prefix_cache_queries", "counter", "Tokens looked up in the device prefix cache."),
        MetricSpec("prefix_cache_hits", "counter", "Tokens found in the device prefix cache."),
        MetricSpec("prompt_tokens", "counter", "Prompt tokens of admitted requests."),
        MetricSpec("generation_tokens", "counter", "Tokens generated."),
        MetricSpec("request_success", "counter", "Finished requests.", ("finished_reason",)),
        MetricSpec("num_preemptions", "counter", "Requests preempted (their KV freed, recomputed later)."),
        MetricSpec("num_requests_running", "gauge", "Requests in the running batch."),
        MetricSpec("num_requests_waiting", "gauge", "Requests waiting to be scheduled."),
        MetricSpec("kv_cache_usage_perc", "gauge", "Fraction of device KV blocks in use."),
        MetricSpec("engine_alive", "gauge", "1 while the engine core runs, 0 once it has died (the server exits)."),
        MetricSpec("external_prefix_cache_queries", "counter", "Tokens of admitted requests looked up in the KV tiers."),
        MetricSpec("external_prefix_cache_hits", "counter", "Tokens loaded from the KV tiers instead of computed."),
        MetricSpec("kv_offload_store_bytes", "counter", "Bytes stored into a KV tier.", ("tier",)),
        MetricSpec("kv_offload_load_bytes", "counter", "Bytes loaded out of a KV tier.", ("tier",)),
        MetricSpec("kv_offload_evictions", "counter", "KV tier entries evicted.", ("tier",)),
        MetricSpec("kv_offload_dropped_stores", "counter", "Tier stores not made, by tier and reason "
                   "(no_space, parent_missing, io_error, version_stale, cache_reset).", ("tier", "reason")),
        MetricSpec("kv_offload_bytes_used", "gauge", "Bytes held by a KV tier.", ("tier",)),
        MetricSpec("kv_offload_bytes_capacity", "gauge", "Byte budget of a KV tier.", ("tier",)),
        MetricSpec("pauses", "counter", "Completed pauses (sleep included).", ("mode",)),
        MetricSpec("sleeps", "counter", "Sleeps.", ("level",)),
        MetricSpec("wakes", "counter", "Completed wake-ups."),
        MetricSpec("sleep_seconds", "counter", "Seconds spent releasing device memory for sleep."),
        MetricSpec("wake_seconds", "counter", "Seconds spent restoring device memory on wake-up."),
        MetricSpec("device_bytes_released", "gauge", "Device bytes released by the latest sleep."),
        MetricSpec("weight_updates", "counter", "Weight updates applied."),
        MetricSpec("weight_transfer_bytes", "counter", "Bytes of weights received from a trainer.", ("backend",)),
        MetricSpec("weight_transfer_seconds", "counter", "Seconds spent receiving weights from a trainer.", ("backend",)),
        MetricSpec("weight_transfer_failures", "counter", "Weight transfers that broke off mid-way.", ("backend",)),
        MetricSpec("weight_version", "gauge", "The current weight version, where it is a number."),
        MetricSpec("weight_version_info", "gauge", "1 for the current weight version, 0 for earlier ones.", ("version",)),
        MetricSpec("engine_step_seconds", "histogram",
                   "Wall time of one engine-core step: the longest a control call waits before it is handled.",
                   buckets=_STEP_BUCKETS),
        MetricSpec("time_to_first_token_seconds", "histogram", "Arrival to first token."),
        MetricSpec("inter_token_latency_seconds", "histogram", "Time between consecutive output tokens."),
        MetricSpec("e2e_request_latency_seconds", "histogram", "Arrival to finish."),
    ]
}

LabelKey = tuple[str, tuple[tuple[str, str], ...]]
# Gauges of the engine's present state, zeroed when it dies.
_ENGINE_GAUGES = ("engine_alive", "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")


def _key(name: str, labels: dict[str, str]) -> LabelKey:
    if name not in SPECS:
        raise KeyError(f"unknown metric {name!r}")
    return name, tuple(sorted((k, str(v)) for k, v in labels.items()))


class StatsSnapshot(msgspec.Struct, omit_defaults=True):
    """What changed since the last drain: counter increments, gauge values, histogram samples."""

    counters: list[tuple[str, list[tuple[str, str]], float]] = []
    gauges: list[tuple[str, list[tuple[str, str]], float]] = []
    observations: list[tuple[str, list[tuple[str, str]], float]] = []

    def is_empty(self) -> bool:
        return not (self.counters or self.gauges or self.observations)


class EngineStats:
    """Core-side accumulator; no prometheus objects, so it crosses processes as plain data."""

    def __init__(self) -> None:
        self._counters: dict[LabelKey, float] = defaultdict(float)
        self._gauges: dict[LabelKey, float] = {}
        self._observations: list[tuple[LabelKey, float]] = []

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        if value:
            self._counters[_key(name, labels)] += value

    def set(self, name: str, value: float, **labels: str) -> None:
        self._gauges[_key(name, labels)] = value

    def observe(self, name: str, value: float, **labels: str) -> None:
        self._observations.append((_key(name, labels), value))

    def drain(self) -> StatsSnapshot:
        snap = StatsSnapshot(
            counters=[(n, list(lab), v) for (n, lab), v in self._counters.items()],
            gauges=[(n, list(lab), v) for (n, lab), v in self._gauges.items()],
            observations=[(n, list(lab), v) for (n, lab), v in self._observations],
        )
        self._counters.clear()
        self._gauges.clear()
        self._observations.clear()
        return snap


class MetricsRegistry:
    """Frontend-side prometheus metrics, fed by ``StatsSnapshot``s and by the frontend's own timings."""

    def __init__(self) -> None:
        disable_created_metrics()  # as vLLM: no _created timestamp series beside the counters
        self.registry = CollectorRegistry()
        self._metrics: dict[str, Counter | Gauge | Histogram] = {}
        for spec in SPECS.values():
            full = PREFIX + spec.name
            if spec.kind == "counter":
                m = Counter(full, spec.help, spec.labels, registry=self.registry)
            elif spec.kind == "gauge":
                m = Gauge(full, spec.help, spec.labels, registry=self.registry)
            else:
                m = Histogram(full, spec.help, spec.labels, buckets=spec.buckets, registry=self.registry)
            self._metrics[spec.name] = m
        self._metrics["engine_alive"].set(1.0)

    def _child(self, name: str, labels: list[tuple[str, str]] | tuple[tuple[str, str], ...]):
        m = self._metrics[name]
        return m.labels(**dict(labels)) if labels else m

    def apply(self, snap: StatsSnapshot) -> None:
        for name, labels, value in snap.counters:
            self._child(name, labels).inc(value)
        for name, labels, value in snap.gauges:
            self._child(name, labels).set(value)
        for name, labels, value in snap.observations:
            self._child(name, labels).observe(value)

    def observe(self, name: str, value: float, **labels: str) -> None:
        self._child(name, tuple(labels.items())).observe(value)

    def engine_died(self) -> None:
        """The engine is gone: what it last reported running, waiting and holding is not so."""
        for name in _ENGINE_GAUGES:
            self._metrics[name].set(0.0)

    def as_dict(self) -> dict[str, float]:
        """Sample name (with labels, Prometheus style) -> value; ``_created`` timestamps left out."""
        out: dict[str, float] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return out

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
