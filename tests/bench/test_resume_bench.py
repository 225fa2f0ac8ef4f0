"""The GPU bench's resume section on the CPU, in a tiny config: the seed's arms, the kept
replay's p50 against its ordered-load floor, the floor checked against counted bytes."""

from __future__ import annotations

import argparse
import statistics

import pytest

from siesta.bench import gpu
from siesta.bench.load_floor import LoadFloor, equal_shares

MODEL = "random:tiny-llama"
REQUESTS = 3
PROMPT_TOKENS = 150
TIER_BLOCK = 32
BF16_BYTES = 2


def test_floor_of_each_request_is_the_kv_before_it_and_its_own_at_link_speed_plus_its_steps() -> None:
    floor = LoadFloor(link_gbps=2.0, decode_step_s=0.01, new_tokens=4)
    kv = [1e9, 3e9, 2e9]  # in admission order
    assert floor.per_request(kv) == pytest.approx([0.5 + 0.04, 2.0 + 0.04, 3.0 + 0.04])
    report = floor.report(kv, replay_p50_s=4.16)
    assert report["floor_p50_s"] == pytest.approx(2.04)
    assert report["p50_over_floor"] == pytest.approx(4.16 / 2.04)
    assert equal_shares(6e9, 3) == [2e9, 2e9, 2e9]


def _args() -> argparse.Namespace:
    return argparse.Namespace(**(vars(gpu.build_parser().parse_args([])) | dict(
        model=MODEL, device="cpu", max_model_len=512, max_num_batched_tokens=256, resume_requests=REQUESTS,
        resume_tokens=PROMPT_TOKENS, tier_block_size=TIER_BLOCK, tier_bytes=1 << 26, load_window_mib=None,
    )))  # fmt: skip


def test_resume_section_runs_on_the_cpu_and_reports_the_floor_from_counted_bytes() -> None:
    from siesta.model.loader import resolve_model

    cfg = resolve_model(MODEL).hf_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * BF16_BYTES
    per_request = (PROMPT_TOKENS - 1) // TIER_BLOCK * TIER_BLOCK * kv_per_token  # what a kept replay loads

    res = gpu.resume(_args())

    kept = res["kept"]["metric_delta"]
    assert kept.get('siesta_kv_offload_store_bytes_total{tier="host"}', 0.0) == 0, "the kept replay stores nothing"
    assert kept['siesta_kv_offload_load_bytes_total{tier="host"}'] == REQUESTS * per_request
    floor = res["kept_floor"]
    assert floor["kv_bytes"] == [per_request] * REQUESTS
    assert floor["decode_step_s"] > 0 and floor["new_tokens"] == gpu.RESUME_NEW_TOKENS
    expected = [(i + 1) * per_request / 55e9 + gpu.RESUME_NEW_TOKENS * floor["decode_step_s"] for i in range(REQUESTS)]
    assert floor["floor_s"] == pytest.approx(expected)
    assert floor["floor_p50_s"] == pytest.approx(statistics.median(expected))
    assert res["kept_p50_over_floor"] == pytest.approx(res["kept"]["replay_p50_s"] / floor["floor_p50_s"])
    assert res["speedup_p50"] == pytest.approx(res["cleared"]["replay_p50_s"] / res["kept"]["replay_p50_s"])
    rows = {row[0]: row for row in gpu.summary({"resume": res})}
    assert rows["resume kept p50 / ordered-load floor p50"][1] == res["kept_p50_over_floor"]
    assert res["kept"]["device"] == {"forward_ms": [], "start_ms": []}  # no CUDA events on the CPU


def test_kept_replays_each_load_the_prompts_again_and_report_the_link_while_loading() -> None:
    args = _args()
    args.resume_variants = False
    args.resume_pieces_arm = args.resume_join_arm = args.resume_added_first_arm = True
    res = gpu.resume(args)
    kept = res["kept"]
    arms = {"cleared", "kept", "kept_pieces", "kept_no_join", "kept_added_first"}
    assert set(res) >= arms and "kept_sync" not in res
    first_p50 = res["kept_added_first"]["replay_p50_s"]
    assert res["kept_added_first_p50_over_floor"] == pytest.approx(first_p50 / res["kept_floor"]["floor_p50_s"])
    pieces_p50 = res["kept_pieces"]["replay_p50_s"]
    assert res["kept_pieces_p50_over_floor"] == pytest.approx(pieces_p50 / res["kept_floor"]["floor_p50_s"])
    assert res["kept_pieces_over_kept_p50"] == pytest.approx(pieces_p50 / kept["replay_p50_s"])
    load = kept["metric_delta"]['siesta_kv_offload_load_bytes_total{tier="host"}']
    seconds = kept["metric_delta"]['siesta_kv_offload_load_seconds_total{tier="host"}']
    assert kept["link_gbps"] == pytest.approx(load / seconds / 1e9)
    assert len(kept["replays"]) == args.resume_replays - 1
    for replay in kept["replays"]:
        assert replay["load_bytes"] == load, "every replay loads the same prompts' KV again"
        assert replay["link_gbps"] > 0 and len(replay["replay_latencies_s"]) == REQUESTS
    p50s = [kept["replay_p50_s"]] + [r["replay_p50_s"] for r in kept["replays"]]
    assert kept["replay_p50_median_s"] == statistics.median(p50s)
    floor = res["kept_floor"]
    assert floor["median_over_floor"] == pytest.approx(kept["replay_p50_median_s"] / floor["floor_p50_s"])
    measured = floor["measured_link"]
    rates = [kept["link_gbps"]] + [r["link_gbps"] for r in kept["replays"]]
    assert measured["link_gbps"] == statistics.median(rates)
    assert measured["decode_step_s"] == floor["decode_step_s"] and measured["kv_bytes"] == floor["kv_bytes"]
    _check_timeline(kept["timeline"], kept["replay_latencies_s"])
    assert kept["timeline_marks"]["first"] == kept["timeline"]["requests"][0]


def _check_timeline(timeline: dict, latencies: list[float]) -> None:
    """Each request's loads go submitted, issued, landed, then it finishes; loads land in the
    order added; the first step starts once every request is added."""
    requests = timeline["requests"]
    assert len(requests) == REQUESTS
    assert sorted(r["finished"] for r in requests) == latencies
    for r in requests:
        assert r["submitted"] <= r["issued"] <= r["landed"] <= r["finished"]
    landed = [r["landed"] for r in requests]
    assert landed == sorted(landed)
    steps = timeline["steps"]
    assert timeline["adds_done_s"] <= steps[0][0] and all(a <= b for a, b in steps)


def test_device_times_are_each_forwards_span_and_its_start_after_the_first() -> None:
    """``_device_ms`` on stand-in events at known times (ms): what the resume arms report as the
    device's own step timeline (none on the CPU)."""

    class At:
        def __init__(self, ms: float) -> None:
            self.ms, self.synced = ms, False

        def elapsed_time(self, later: "At") -> float:
            return later.ms - self.ms

        def synchronize(self) -> None:
            self.synced = True

    events = [(At(10.0), At(35.5)), (At(36.0), At(44.25)), (At(60.0), At(61.0))]
    assert gpu._device_ms(events) == {"forward_ms": [25.5, 8.25, 1.0], "start_ms": [0.0, 26.0, 50.0]}
    assert events[-1][1].synced  # read once the last forward is done
    assert gpu._device_ms([]) == {"forward_ms": [], "start_ms": []}
