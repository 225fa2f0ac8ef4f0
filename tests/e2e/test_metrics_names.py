"""/metrics of a real server: vLLM's names beside siesta's, with the served model name; stop
strings counted as stopped; sleep and wake-up seconds; no _created series; and every series
the Grafana dashboard queries served (those of a KV tier declared: this server has none;
tests/test_metrics_names.py checks them on an engine with tiers)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from promql import dashboard_series, exposition_families, exposition_samples

from siesta.metrics import PREFIX, SPECS

DASHBOARD = Path(__file__).parent.parent.parent / "deploy" / "grafana" / "siesta-tier.json"
MAX_TOKENS = 4
COUNT_WAIT_S = 10.0
PROMPT_LENGTHS = (17, 40, 63)
VOCAB_LOW, VOCAB_HIGH = 1000, 20000  # plain tokens of the embedded vocabulary, no special ones


@pytest.fixture(scope="module")
def model_name(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def _metrics(http) -> tuple[str, dict[str, float]]:
    from siesta.client import parse_metrics

    text = http.get("/metrics").text
    return text, parse_metrics(text)


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _vllm(name: str, model: str, **labels: str) -> str:
    pairs = {"engine": "0", "model_name": model, **labels}
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(pairs.items())) + "}"


def test_vllm_counters_equal_siestas_and_the_counted_tokens(http, model_name):
    rng = random.Random(15)
    prompts = [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)] for n in PROMPT_LENGTHS]
    _, before = _metrics(http)
    for p in prompts:
        body = {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
    _, after = _metrics(http)
    prompt_tokens = sum(len(p) for p in prompts)  # counted here, from the ids sent
    assert _delta(after, before, _vllm("vllm:prompt_tokens_total", model_name)) == prompt_tokens
    assert _delta(after, before, "siesta_prompt_tokens_total") == prompt_tokens
    generated = len(prompts) * MAX_TOKENS
    assert _delta(after, before, _vllm("vllm:generation_tokens_total", model_name)) == generated
    assert _delta(after, before, "siesta_generation_tokens_total") == generated
    finished = _vllm("vllm:request_success_total", model_name, finished_reason="length")
    assert _delta(after, before, finished) == len(prompts)
    for stat in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions"):
        assert _delta(after, before, _vllm(f"vllm:{stat}_total", model_name)) == _delta(
            after, before, f"siesta_{stat}_total"), stat  # fmt: skip
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        count = _delta(after, before, _vllm(f"vllm:{hist}_count", model_name))
        assert count == _delta(after, before, f"siesta_{hist}_count") == len(prompts), hist
    itl = _delta(after, before, _vllm("vllm:inter_token_latency_seconds_count", model_name))
    assert itl == len(prompts) * (MAX_TOKENS - 1)  # one interval between each two tokens
    assert itl == _delta(after, before, _vllm("vllm:time_per_output_token_seconds_count", model_name))


def test_a_stop_string_is_counted_as_stopped_under_both_names(http, model_name):
    body = {"prompt": "Count: one, two, three, four, five, six,", "max_tokens": 24, "temperature": 0.0}
    full = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = full.split()[2]  # a word the greedy output is known to contain
    _, before = _metrics(http)
    choice = http.post("/v1/completions", json=body | {"stop": [stop]}).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == full[: full.index(stop)]
    # The front end ends the request on the stop string before the engine has counted it: the
    # count arrives with the engine's next report.
    deadline = time.monotonic() + COUNT_WAIT_S
    key = 'siesta_request_success_total{finished_reason="stop"}'
    _, after = _metrics(http)
    while _delta(after, before, key) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
        _, after = _metrics(http)
    for reason, want in (("stop", 1), ("abort", 0)):
        assert _delta(after, before, f'siesta_request_success_total{{finished_reason="{reason}"}}') == want, reason
        assert _delta(after, before, _vllm("vllm:request_success_total", model_name, finished_reason=reason)) == want


def _sleep_and_wake(http) -> None:
    try:
        assert http.post("/sleep", params={"level": 1}).status_code == 200
    finally:
        assert http.post("/wake_up").status_code == 200  # the shared server stays awake


def test_sleep_and_wake_seconds_per_call(http):
    _, before = _metrics(http)
    _sleep_and_wake(http)
    _, after = _metrics(http)
    assert _delta(after, before, 'siesta_sleep_duration_seconds_count{level="1"}') == 1
    slept = _delta(after, before, 'siesta_sleep_duration_seconds_sum{level="1"}')
    assert slept == pytest.approx(_delta(after, before, "siesta_sleep_seconds_total"))
    assert after['siesta_last_sleep_seconds{level="1"}'] == pytest.approx(slept)
    both = 'tags="kv_cache,weights"'
    assert _delta(after, before, f"siesta_wake_duration_seconds_count{{{both}}}") == 1
    woke = _delta(after, before, f"siesta_wake_duration_seconds_sum{{{both}}}")
    assert woke == pytest.approx(_delta(after, before, "siesta_wake_seconds_total"))
    assert after[f"siesta_last_wake_seconds{{{both}}}"] == pytest.approx(woke)


def _needs_a_tier(series: str) -> bool:
    """Whether a siesta series is labelled by tier: this server has no KV tier to fill it."""
    for spec in SPECS.values():
        base = PREFIX + spec.name
        if series in (base, base + "_total") and "tier" in spec.labels:
            return True
    return False


def test_every_series_the_dashboard_queries_is_in_metrics(http):
    _sleep_and_wake(http)  # the labelled sleep and wake-up series get their samples
    assert http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0.0}).status_code == 200
    text, _ = _metrics(http)
    assert "_created" not in text  # as vLLM: no timestamp series beside the counters
    wanted = dashboard_series(DASHBOARD)
    tiered = {s for s in wanted if _needs_a_tier(s)}
    assert tiered, "the dashboard shows the tiers"
    assert sorted(wanted - tiered - exposition_samples(text)) == []
    assert sorted(tiered - exposition_families(text)) == []  # declared, with no sample until a tier exists
