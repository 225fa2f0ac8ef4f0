"""vLLM's metric names beside siesta's, queue time, sleep and wake-up seconds, and the Grafana
dashboard's queries against what an engine with KV tiers serves (offline: LLM.get_metrics)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from promql import dashboard_series, exposition_samples, series_names

from siesta import LLM, SamplingParams
from siesta.config import SchedulerConfig
from siesta.core.sampler import SampleResult
from siesta.core.scheduler import Scheduler
from siesta.kv.hashing import ExtraKeys
from siesta.kv.kv_manager import KVManager
from siesta.metrics import FINISHED_REASONS, SPECS, VLLM_ALIASES, EngineStats, MetricsRegistry
from siesta.request import Request, RequestStatus

DASHBOARD = Path(__file__).parent.parent / "deploy" / "grafana" / "siesta-tier.json"
MODEL = "random:tiny-llama"
TIER_BLOCK = 32
VLLM = '{{engine="0",model_name="{model}"}}'


# -- the PromQL scanner the dashboard test relies on ------------------------------------


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])', {"vllm:prompt_tokens_total"}),
        ('histogram_quantile(0.99, sum by (le) (rate(a_bucket{x=~"a|b", y!="}"}[5m])))', {"a_bucket"}),
        ("sum by (tier, reason) (increase(drops_total[1h])) / ignoring(reason) group_left sum(x)", {"drops_total", "x"}),
        ("max by (version) (info) == 1 and on (instance) up offset 5m", {"info", "up"}),
        ("sum without (le) (b) * 1e9 + -0.5 > bool 2", {"b"}),
        ('label_replace(m, "dst", "$1", "src", "(.*)")', {"m"}),
        ("topk(3, x) or vector(0)", {"x"}),
    ],
)
def test_series_names_of_promql(expr, names):
    assert series_names(expr) == names


@pytest.mark.parametrize("expr", ["rat(x[5m])", '{__name__=~"siesta_.*"}', 'x{a="unclosed}'])
def test_series_names_refuse_what_they_cannot_see_through(expr):
    with pytest.raises(ValueError):
        series_names(expr)


# -- one stat, two names -----------------------------------------------------------------


def _snapshot() -> EngineStats:
    stats = EngineStats()
    stats.inc("prompt_tokens", 7)
    stats.inc("request_success", 2, finished_reason="length")
    stats.set("num_requests_running", 3)
    stats.observe("request_queue_time_seconds", 0.4)
    return stats


def test_each_stat_feeds_its_siesta_and_its_vllm_series():
    registry = MetricsRegistry(model_name="m")
    registry.apply(_snapshot().drain())
    registry.observe("inter_token_latency_seconds", 0.02)
    got = registry.as_dict()
    v = VLLM.format(model="m")
    assert got["siesta_prompt_tokens_total"] == got[f"vllm:prompt_tokens_total{v}"] == 7
    assert got['siesta_request_success_total{finished_reason="length"}'] == 2
    assert got['vllm:request_success_total{engine="0",finished_reason="length",model_name="m"}'] == 2
    assert got["siesta_num_requests_running"] == got[f"vllm:num_requests_running{v}"] == 3
    assert got["siesta_request_queue_time_seconds_count"] == got[f"vllm:request_queue_time_seconds_count{v}"] == 1
    # vLLM's buckets, not siesta's: 0.4 s falls in vLLM's 0.5 s bucket and not in its 0.3 s one.
    assert got['vllm:request_queue_time_seconds_bucket{engine="0",le="0.3",model_name="m"}'] == 0
    assert got['vllm:request_queue_time_seconds_bucket{engine="0",le="0.5",model_name="m"}'] == 1
    # ITL feeds vLLM's name and the one vLLM's own dashboard still reads.
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert got[f"{name}_sum{v}"] == got["siesta_inter_token_latency_seconds_sum"] == pytest.approx(0.02)


def test_vllm_series_exist_from_the_start_as_vllm_declares_them():
    text = MetricsRegistry(model_name="m").exposition().decode()
    v = VLLM.format(model="m")
    for line in (f"vllm:prompt_tokens_total{v} 0.0", f"vllm:kv_cache_usage_perc{v} 0.0",
                 f"vllm:time_to_first_token_seconds_count{v} 0.0"):  # fmt: skip
        assert line in text
    for reason in FINISHED_REASONS:
        assert f'vllm:request_success_total{{engine="0",finished_reason="{reason}",model_name="m"}} 0.0' in text
    assert "_created" not in text


def test_finished_reasons_are_the_request_statuses_that_finish():
    assert set(FINISHED_REASONS) == {s.value for s in RequestStatus if s.finished}


def test_vllm_names_buckets_and_kinds_are_vllms():
    """As vllm/v1/metrics/loggers.py declares them (names without _total, buckets)."""
    ttft = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0, 160.0, 640.0, 2560.0]  # fmt: skip
    itl = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
    latency = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
    expected = {
        "vllm:prompt_tokens": ("counter", None), "vllm:generation_tokens": ("counter", None),
        "vllm:prefix_cache_queries": ("counter", None), "vllm:prefix_cache_hits": ("counter", None),
        "vllm:external_prefix_cache_queries": ("counter", None), "vllm:external_prefix_cache_hits": ("counter", None),
        "vllm:request_success": ("counter", None), "vllm:num_preemptions": ("counter", None),
        "vllm:num_requests_running": ("gauge", None), "vllm:num_requests_waiting": ("gauge", None),
        "vllm:kv_cache_usage_perc": ("gauge", None),
        "vllm:time_to_first_token_seconds": ("histogram", ttft),
        "vllm:inter_token_latency_seconds": ("histogram", itl),
        "vllm:time_per_output_token_seconds": ("histogram", itl),
        "vllm:e2e_request_latency_seconds": ("histogram", latency),
        "vllm:request_queue_time_seconds": ("histogram", latency),
    }  # fmt: skip
    got = {
        alias.name: (SPECS[stat].kind, list(alias.buckets) if alias.buckets else None)
        for stat, aliases in VLLM_ALIASES.items()
        for alias in aliases
    }
    assert got == expected
    assert SPECS["request_success"].labels == ("finished_reason",)  # vLLM's one extra label


def test_the_model_name_is_set_before_vllm_series_count():
    registry = MetricsRegistry()
    registry.set_model_name("served")
    registry.apply(_snapshot().drain())
    assert registry.as_dict()[f"vllm:prompt_tokens_total{VLLM.format(model='served')}"] == 7
    assert not any('model_name=""' in k for k in registry.as_dict())  # the placeholder's series are gone
    with pytest.raises(RuntimeError, match="served"):
        registry.set_model_name("another")


def test_a_dead_engine_zeroes_the_vllm_gauges_too():
    registry = MetricsRegistry(model_name="m")
    registry.apply(_snapshot().drain())
    registry.engine_died()
    assert registry.as_dict()[f"vllm:num_requests_running{VLLM.format(model='m')}"] == 0


# -- queue time: arrival at the core to first scheduled, once per request ----------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_queue_time_is_arrival_to_first_scheduling_once_per_request(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr("siesta.core.scheduler.time.monotonic", clock)
    cfg = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, enable_chunked_prefill=True)
    cfg.resolve(128)
    stats = EngineStats()
    # 6 blocks of 4 tokens: two 8-token prompts that grow to 20 tokens cannot both keep running.
    sched = Scheduler(cfg, KVManager(6, 4, True), 128, stats)
    waits = {"a": 2.0, "b": 5.0}
    for rid, wait in waits.items():
        r = Request(rid, [100 * len(rid) + ord(rid) + i for i in range(8)], SamplingParams(max_tokens=12, ignore_eos=True),
                    frozenset({2}), arrival_time=clock.now - wait)  # fmt: skip
        r.hash_extra = ExtraKeys("m", "0").encode()
        sched.add_request(r)
    preempted = 0
    while sched.has_unfinished():
        out = sched.schedule()
        preempted += len(out.preempted_req_ids)
        clock.now += 1.0  # later schedulings (a preempted request's return) must not count again
        sched.update(out, {i.request.request_id: SampleResult(7, None, None, []) for i in out.scheduled if i.sample}, "0")
    observed = sorted(v for name, _, v in stats.drain().observations if name == "request_queue_time_seconds")
    assert preempted >= 1
    assert observed == sorted(waits.values())


# -- a real engine with host and disk tiers ----------------------------------------------


def _offload(disk: Path) -> dict:
    extra = {"block_size": TIER_BLOCK, "cpu_bytes_to_use": 1 << 26, "disk_path": str(disk), "disk_bytes_to_use": 1 << 26}
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


@pytest.fixture(scope="module")
def tiered(tmp_path_factory):
    """An engine with host and disk tiers after a warm-up, a replay from the tiers, a store
    cancelled by a tier reset, a sleep and a staged wake-up: every tier series has samples."""
    llm = LLM(MODEL, dtype="float32", kv_cache_bytes=1 << 23, max_model_len=1024,
              kv_transfer_config=_offload(tmp_path_factory.mktemp("disk")))  # fmt: skip
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 900) for _ in range(TIER_BLOCK * (3 + i) + 8)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    before = llm.get_metrics()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.reset_prefix_cache()  # the device cache only: the replay loads from the tiers
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    counted = llm.get_metrics()
    # A store planned, then cancelled by a tier reset: a dropped store with its reason.
    llm.add_request({"prompt_token_ids": [rng.randrange(3, 900) for _ in range(TIER_BLOCK * 2 + 4)]}, params)
    llm.step()
    llm.reset_prefix_cache(reset_connector=True)
    while llm.engine.has_work():
        llm.step()
    llm.sleep(level=1)
    llm.wake_up(tags=["weights"])
    llm.wake_up(tags=["kv_cache"])
    return llm, prompts, params, before, counted


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_vllm_token_counters_equal_siestas_and_the_counted_tokens(tiered):
    llm, prompts, params, before, after = tiered
    v = VLLM.format(model=llm.engine.source.name)
    runs = 2  # the warm-up and the replay
    prompt_tokens = runs * sum(len(p) for p in prompts)
    assert _delta(after, before, f"vllm:prompt_tokens_total{v}") == prompt_tokens
    assert _delta(after, before, "siesta_prompt_tokens_total") == prompt_tokens
    generated = runs * len(prompts) * params.max_tokens
    assert _delta(after, before, f"vllm:generation_tokens_total{v}") == generated
    assert _delta(after, before, "siesta_generation_tokens_total") == generated
    finished = 'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{}"}}'
    assert _delta(after, before, finished.format(llm.engine.source.name)) == runs * len(prompts)
    for stat in ("prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache_queries",
                 "external_prefix_cache_hits", "num_preemptions"):  # fmt: skip
        assert _delta(after, before, f"vllm:{stat}_total{v}") == _delta(after, before, f"siesta_{stat}_total"), stat
    # The replay loaded every full tier block of its prompts: the tier counters moved.
    loaded = sum(len(p) // TIER_BLOCK * TIER_BLOCK for p in prompts)
    assert _delta(after, before, f"vllm:external_prefix_cache_hits_total{v}") == loaded
    queued = "siesta_request_queue_time_seconds_count"
    assert _delta(after, before, queued) == _delta(after, before, f"vllm:request_queue_time_seconds_count{v}")
    assert _delta(after, before, queued) == runs * len(prompts)


def test_sleep_and_wake_seconds_per_call_and_the_last(tiered):
    llm = tiered[0]
    got = llm.get_metrics()
    # One sleep, at level 1: its one observation is what the counter sums and the last gauge holds.
    assert got['siesta_sleep_duration_seconds_count{level="1"}'] == 1
    assert got['siesta_sleep_duration_seconds_sum{level="1"}'] == pytest.approx(got["siesta_sleep_seconds_total"])
    assert got['siesta_last_sleep_seconds{level="1"}'] == pytest.approx(got["siesta_sleep_seconds_total"])
    # A staged wake-up: one observation per call, by what it restored.
    for tags in ("weights", "kv_cache"):
        assert got[f'siesta_wake_duration_seconds_count{{tags="{tags}"}}'] == 1
        assert got[f'siesta_last_wake_seconds{{tags="{tags}"}}'] == pytest.approx(
            got[f'siesta_wake_duration_seconds_sum{{tags="{tags}"}}'])  # fmt: skip
    calls = sum(got[f'siesta_wake_duration_seconds_sum{{tags="{t}"}}'] for t in ("weights", "kv_cache"))
    assert calls == pytest.approx(got["siesta_wake_seconds_total"])


def test_every_series_the_dashboard_queries_is_served_with_tiers(tiered):
    llm = tiered[0]
    llm.get_metrics()  # the engine's last stats, applied
    served = exposition_samples(llm.metrics.exposition().decode())
    wanted = dashboard_series(DASHBOARD)
    assert {"siesta_kv_offload_load_bytes_total", "vllm:time_to_first_token_seconds_bucket"} <= wanted
    assert sorted(wanted - served) == []
    text = llm.metrics.exposition().decode()
    assert 'siesta_kv_offload_dropped_stores_total{reason="cache_reset",tier="host"}' in text
    assert "_created" not in text


def test_the_weight_version_info_keeps_only_the_live_series():
    # 2,000 renames once gave 2,001 series: /metrics grew with every push of an RL run.
    registry = MetricsRegistry()
    stats = EngineStats()
    for i in range(50):
        stats.set("weight_version_info", 1.0, version=str(i))
        if i % 7 == 0:
            registry.apply(stats.drain())
    for name in ("3", "4", "3"):  # back to an earlier name, within one drain
        stats.set("weight_version_info", 1.0, version=name)
    registry.apply(stats.drain())
    series = {k: v for k, v in registry.as_dict().items() if k.startswith("siesta_weight_version_info")}
    assert series == {'siesta_weight_version_info{version="3"}': 1.0}
