"""One registry of Prometheus metrics.

The engine core counts into ``EngineStats`` (plain numbers, cheap to send over
IPC); the frontend applies each drained snapshot to its ``MetricsRegistry``,
which prometheus_client renders for ``/metrics`` and ``LLM.get_metrics()``.

Beside siesta's own ``siesta_`` names the registry serves vLLM's ``vllm:`` names
for the stats both engines have (``VLLM_ALIASES``), so that dashboards built for
vLLM read siesta unchanged. Each stat is applied once and feeds every name it has.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from siesta import fidelity_report

PREFIX = "siesta_"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
# Step times, 0.5 ms to ~30 s, each bucket 1.5x the last: the bucket of the slowest step bounds
# it within 1.5x (what a control call waits for; the latency buckets are up to 5x apart).
_STEP_BUCKET_FIRST_S = 0.0005
_STEP_BUCKET_RATIO = 1.5
_STEP_BUCKET_COUNT = 28
_STEP_BUCKETS = tuple(round(_STEP_BUCKET_FIRST_S * _STEP_BUCKET_RATIO**i, 6) for i in range(_STEP_BUCKET_COUNT))
# Sleeps and wake-ups take from milliseconds (level 0, a kept KV cache) to tens of seconds (the
# first pin of a 16 GB weight backup): the step buckets span that, each bound within 1.5x.
_SLEEP_WAKE_BUCKETS = _STEP_BUCKETS

# vLLM's buckets (vllm/v1/metrics/loggers.py), kept as vLLM has them so that its dashboards'
# quantiles read the same from either engine.
_VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                      20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                     40.0, 80.0)  # fmt: skip
_VLLM_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                                 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# vLLM labels every series with the served model and the engine core's index; siesta serves
# one engine core per API server.
VLLM_LABELS = ("model_name", "engine")
VLLM_ENGINE_INDEX = "0"
# Values of finished_reason (RequestStatus's finished values). As vLLM does, every one has a
# vllm:request_success series from the start, so a rate over it never begins missing.
FINISHED_REASONS = ("stop", "length", "abort", "error")


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
        MetricSpec("kv_offload_load_seconds", "counter", "Wall seconds with loads out of a KV tier in flight: "
                   "load_bytes over it is the link's rate while loading.", ("tier",)),
        MetricSpec("kv_offload_evictions", "counter", "KV tier entries evicted.", ("tier",)),
        MetricSpec("kv_offload_dropped_stores", "counter", "Tier stores not made, by tier and reason "
                   "(no_space, parent_missing, io_error, version_stale, cache_reset).", ("tier", "reason")),
        MetricSpec("kv_offload_damaged_entries", "counter", "Tier files found cut off, damaged or not of siesta's "
                   "format (wrong fields or types), deleted instead of served.", ("tier",)),
        MetricSpec("kv_offload_bytes_used", "gauge", "Bytes held by a KV tier.", ("tier",)),
        MetricSpec("kv_offload_bytes_capacity", "gauge", "Byte budget of a KV tier.", ("tier",)),
        MetricSpec("pauses", "counter", "Completed pauses (sleep included).", ("mode",)),
        MetricSpec("sleeps", "counter", "Sleeps.", ("level",)),
        MetricSpec("wakes", "counter", "Completed wake-ups."),
        MetricSpec("sleep_seconds", "counter", "Seconds spent releasing device memory for sleep."),
        MetricSpec("wake_seconds", "counter", "Seconds spent restoring device memory on wake-up."),
        MetricSpec("sleep_duration_seconds", "histogram",
                   "Seconds one sleep spent releasing device memory (what sleep_seconds sums), by level.",
                   ("level",), buckets=_SLEEP_WAKE_BUCKETS),
        MetricSpec("wake_duration_seconds", "histogram",
                   "Seconds one wake-up call spent restoring device memory (what wake_seconds sums), "
                   "by the tags it restored.", ("tags",), buckets=_SLEEP_WAKE_BUCKETS),
        MetricSpec("last_sleep_seconds", "gauge", "Seconds the latest sleep of each level spent releasing device memory.",
                   ("level",)),
        MetricSpec("last_wake_seconds", "gauge", "Seconds the latest wake-up call spent restoring device memory, "
                   "by the tags it restored.", ("tags",)),
        MetricSpec("device_bytes_released", "gauge", "Device bytes released by the latest sleep."),
        MetricSpec("weight_updates", "counter", "Weight updates applied."),
        MetricSpec("weight_transfer_bytes", "counter", "Bytes of weights received from a trainer.", ("backend",)),
        MetricSpec("weight_transfer_seconds", "counter", "Seconds spent receiving weights from a trainer.", ("backend",)),
        MetricSpec("weight_transfer_failures", "counter", "Weight transfers that broke off mid-way.", ("backend",)),
        MetricSpec("weight_version", "gauge", "The current weight version, where it is a number."),
        MetricSpec("weight_version_info", "gauge", "1, labelled with the current weight version: the only series "
                   "(earlier versions' are removed, or an RL run's pushes would grow /metrics without bound).",
                   ("version",)),
        MetricSpec("logprob_floor_ratio", "gauge", "The last logprob-oracle run (siesta.bench.fidelity) on this "
                   "engine's architecture and arithmetic: in a bucket of positions, the largest |logprob - the "
                   "trainer's fp32 logprob| over the trainer's own bf16 error there. No series until a run matches.",
                   ("run", "kind", "bucket")),
        MetricSpec("logprob_floor_ratio_worst", "gauge", "The largest logprob_floor_ratio of each run of that report.",
                   ("run",)),
        MetricSpec("engine_step_seconds", "histogram",
                   "Wall time of one engine-core step: the longest a control call waits before it is handled.",
                   buckets=_STEP_BUCKETS),
        MetricSpec("time_to_first_token_seconds", "histogram", "Arrival to first token."),
        MetricSpec("inter_token_latency_seconds", "histogram", "Time between consecutive output tokens."),
        MetricSpec("e2e_request_latency_seconds", "histogram", "Arrival to finish."),
        MetricSpec("request_queue_time_seconds", "histogram",
                   "Arrival at the engine core to first scheduled (paused and asleep time included)."),
    ]
}


@dataclass(frozen=True)
class VllmAlias:
    """vLLM's name for a siesta stat: same kind and labels, plus ``VLLM_LABELS``."""

    name: str  # as vLLM declares it: counters without _total
    buckets: tuple[float, ...] | None = None  # vLLM's, for histograms


# siesta stat -> its vLLM names. The counters and gauges are vLLM's for the same quantity;
# vLLM's own dashboard still reads time_per_output_token_seconds, which vLLM fed with the
# inter-token latencies before renaming it inter_token_latency_seconds.
VLLM_ALIASES: dict[str, tuple[VllmAlias, ...]] = {
    "prompt_tokens": (VllmAlias("vllm:prompt_tokens"),),
    "generation_tokens": (VllmAlias("vllm:generation_tokens"),),
    "prefix_cache_queries": (VllmAlias("vllm:prefix_cache_queries"),),
    "prefix_cache_hits": (VllmAlias("vllm:prefix_cache_hits"),),
    "external_prefix_cache_queries": (VllmAlias("vllm:external_prefix_cache_queries"),),
    "external_prefix_cache_hits": (VllmAlias("vllm:external_prefix_cache_hits"),),
    "request_success": (VllmAlias("vllm:request_success"),),
    "num_preemptions": (VllmAlias("vllm:num_preemptions"),),
    "num_requests_running": (VllmAlias("vllm:num_requests_running"),),
    "num_requests_waiting": (VllmAlias("vllm:num_requests_waiting"),),
    "kv_cache_usage_perc": (VllmAlias("vllm:kv_cache_usage_perc"),),
    "time_to_first_token_seconds": (VllmAlias("vllm:time_to_first_token_seconds", _VLLM_TTFT_BUCKETS),),
    "inter_token_latency_seconds": (
        VllmAlias("vllm:inter_token_latency_seconds", _VLLM_ITL_BUCKETS),
        VllmAlias("vllm:time_per_output_token_seconds", _VLLM_ITL_BUCKETS),
    ),
    "e2e_request_latency_seconds": (VllmAlias("vllm:e2e_request_latency_seconds", _VLLM_REQUEST_LATENCY_BUCKETS),),
    "request_queue_time_seconds": (VllmAlias("vllm:request_queue_time_seconds", _VLLM_REQUEST_LATENCY_BUCKETS),),
}

LabelKey = tuple[str, tuple[tuple[str, str], ...]]
# Gauges of one live series: setting one removes the others (the weight version's info series,
# whose label is the version: one per push would grow without bound).
_SINGLE_SERIES = frozenset({"weight_version_info"})
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
        key = _key(name, labels)
        if name in _SINGLE_SERIES:  # only the last set of a drain counts, in any order
            for other in [k for k in self._gauges if k[0] == name]:
                del self._gauges[other]
        self._gauges[key] = value

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


Metric = Counter | Gauge | Histogram


def _make(spec: MetricSpec, name: str, labels: tuple[str, ...], buckets: tuple[float, ...],
          registry: CollectorRegistry) -> Metric:  # fmt: skip
    if spec.kind == "counter":
        return Counter(name, spec.help, labels, registry=registry)
    if spec.kind == "gauge":
        return Gauge(name, spec.help, labels, registry=registry)
    return Histogram(name, spec.help, labels, buckets=buckets, registry=registry)


class MetricsRegistry:
    """Frontend-side prometheus metrics, fed by ``StatsSnapshot``s and by the frontend's own timings.

    ``model_name`` is vLLM's label of the ``vllm:`` series: the served model name. A server
    learns it once its engine is up (``set_model_name``), before it serves a request.
    """

    def __init__(self, model_name: str = "") -> None:
        disable_created_metrics()  # as vLLM: no _created timestamp series beside the counters
        self.registry = CollectorRegistry()
        self._metrics: dict[str, Metric] = {}
        # stat -> its vLLM-named metrics, each labelled VLLM_LABELS + the stat's own labels
        self._vllm: dict[str, list[Metric]] = {}
        for spec in SPECS.values():
            self._metrics[spec.name] = _make(spec, PREFIX + spec.name, spec.labels, spec.buckets, self.registry)
            self._vllm[spec.name] = [
                _make(spec, alias.name, VLLM_LABELS + spec.labels, alias.buckets or spec.buckets, self.registry)
                for alias in VLLM_ALIASES.get(spec.name, ())
            ]
        self._metrics["engine_alive"].set(1.0)
        self.model_name = model_name
        self._vllm_written = False
        self._declare_vllm_series()
        self._fidelity_key = ""
        self._fidelity_stamp: float | None = None  # the served report's mtime

    def set_model_name(self, model_name: str) -> None:
        """Label the vllm: series with the served model name; refused once they hold data
        under another name (they would split into two models' series)."""
        if model_name == self.model_name:
            return
        if self._vllm_written:
            raise RuntimeError(f"the vllm: series already count under model_name={self.model_name!r}; "
                               "set the served model name before the engine reports stats")  # fmt: skip
        for metrics in self._vllm.values():
            for m in metrics:
                m.clear()
        self.model_name = model_name
        self._declare_vllm_series()

    def serve_fidelity(self, numerics_key: str) -> None:
        """Serve the logprob oracle's last report for ``numerics_key`` (``siesta.fidelity_report``),
        read again whenever the metrics are read and the report has changed."""
        self._fidelity_key = numerics_key
        self._fidelity_stamp = None
        self._refresh_fidelity()

    def _refresh_fidelity(self) -> None:
        if not self._fidelity_key:
            return
        try:
            stamp = fidelity_report.report_path(self._fidelity_key).stat().st_mtime
        except OSError:
            return
        if stamp == self._fidelity_stamp:
            return
        report = fidelity_report.load(self._fidelity_key)
        if report is None:
            return
        self._fidelity_stamp = stamp
        ratio, worst = self._metrics["logprob_floor_ratio"], self._metrics["logprob_floor_ratio_worst"]
        ratio.clear()
        worst.clear()
        worst_of: dict[str, float] = {}
        for labels, value in fidelity_report.floor_ratios(report):
            ratio.labels(**labels).set(value)
            worst_of[labels["run"]] = max(value, worst_of.get(labels["run"], value))
        for run, value in worst_of.items():
            worst.labels(run=run).set(value)

    def _declare_vllm_series(self) -> None:
        """Every vllm: series exists from the start, at zero, as vLLM creates them."""
        for name, metrics in self._vllm.items():
            spec = SPECS[name]
            label_sets = [{"finished_reason": r} for r in FINISHED_REASONS] if spec.labels == ("finished_reason",) else []
            if spec.labels and not label_sets:
                continue  # an open label set: its series appear with their first sample
            for m in metrics:
                for labels in label_sets or [{}]:
                    m.labels(model_name=self.model_name, engine=VLLM_ENGINE_INDEX, **labels)

    def _children(self, name: str, labels: list[tuple[str, str]] | tuple[tuple[str, str], ...]) -> list:
        """The stat's siesta series and each of its vLLM-named series, for these labels."""
        own = dict(labels)
        m = self._metrics[name]
        children = [m.labels(**own) if own else m]
        if self._vllm[name]:
            self._vllm_written = True
            vllm_labels = {"model_name": self.model_name, "engine": VLLM_ENGINE_INDEX, **own}
            children.extend(v.labels(**vllm_labels) for v in self._vllm[name])
        return children

    def apply(self, snap: StatsSnapshot) -> None:
        for name, labels, value in snap.counters:
            for child in self._children(name, labels):
                child.inc(value)
        for name, labels, value in snap.gauges:
            if name in _SINGLE_SERIES:
                self._clear(name)
            for child in self._children(name, labels):
                child.set(value)
        for name, labels, value in snap.observations:
            for child in self._children(name, labels):
                child.observe(value)

    def _clear(self, name: str) -> None:
        """Drop every series of ``name`` (under siesta's and vLLM's names)."""
        for metric in (self._metrics[name], *self._vllm[name]):
            metric.clear()

    def observe(self, name: str, value: float, **labels: str) -> None:
        for child in self._children(name, tuple(labels.items())):
            child.observe(value)

    def engine_died(self) -> None:
        """The engine is gone: what it last reported running, waiting and holding is not so."""
        for name in _ENGINE_GAUGES:
            for child in self._children(name, ()):
                child.set(0.0)

    def as_dict(self) -> dict[str, float]:
        """Sample name (with labels, Prometheus style) -> value; ``_created`` timestamps left out."""
        self._refresh_fidelity()
        out: dict[str, float] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return out

    def exposition(self) -> bytes:
        self._refresh_fidelity()
        return generate_latest(self.registry)
