"""``siesta bench resume`` in-process: the seed's experiment on an offline engine.

Per arm: warm N distinct long prompts (their KV lands in the host tier), sleep
at level 1 with or without keeping the tier, wake up, replay the same prompts
and read the counter deltas. The two arms use different prompts, so neither
starts warmer than the other. The kept replay's p50 is set against its ordered-load
floor (``siesta.bench.load_floor``), with a decode step measured after the arms.
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

from siesta.bench.common import median, print_table, random_prompts, write_json
from siesta.bench.load_floor import DEFAULT_LINK_GBPS, LoadFloor, equal_shares, loading_gbps
from siesta.bench.probes import GcPauses, cpu_seconds_between, host_cpu_seconds
from siesta.sampling import SamplingParams

DEFAULT_TIER_BYTES = 4 << 30
COUNTERS = ("prefix_cache", "offload", "connector")
HOST_LOAD_BYTES = 'siesta_kv_offload_load_bytes_total{tier="host"}'
HOST_LOAD_SECONDS = 'siesta_kv_offload_load_seconds_total{tier="host"}'
DECODE_PROBE_STEPS = 16  # steps timed for the floor's decode step


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="run against a server over HTTP instead of in-process")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--json", default=None)
    p.add_argument("--link-gbps", type=float, default=DEFAULT_LINK_GBPS,
                   help="host-to-device GB/s the ordered-load floor assumes")  # fmt: skip


def _metrics(llm) -> dict[str, float]:
    return {k: v for k, v in llm.get_metrics().items() if any(c in k for c in COUNTERS)}


def fire_all(
    llm, prompts: list[list[int]], max_tokens: int, step_ends: list[tuple[float, int, int]] | None = None,
    timeline: dict[str, Any] | None = None,
) -> list[float]:
    """Submit every prompt at once; each one's latency is its finish time minus the start.

    ``step_ends`` collects, per engine step, when it ended (seconds from the start) and how
    many requests were then running and loading. ``timeline`` is filled with where the time
    went: when the adds were done, each step's start and end, and per request (in the order
    added) when its tier loads were submitted, first issued and landed, and when it finished.
    """
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    loads = _load_timeline(llm, t0) if timeline is not None else nullcontext(None)
    steps: list[tuple[float, float]] = []
    latency: dict[str, float] = {}
    with loads as traced:
        ids = llm.add_requests([{"prompt_token_ids": p} for p in prompts], params)
        adds_done = time.perf_counter() - t0
        wanted = set(ids)
        while len(latency) < len(ids):
            start = time.perf_counter() - t0
            for out in llm.step():
                if out.finished and out.request_id in wanted:
                    latency[out.request_id] = time.perf_counter() - t0
            end = time.perf_counter() - t0
            steps.append((round(start, 4), round(end, 4)))
            if step_ends is not None:
                sched = llm.engine.scheduler
                step_ends.append((round(end, 4), len(sched.running), len(sched.loading)))
    if timeline is not None:
        jobs = traced.jobs if traced is not None else {}
        timeline.update(adds_done_s=round(adds_done, 4), steps=steps, requests=[
            {**jobs.get(rid, {}), "finished": round(latency[rid], 4)} for rid in ids])  # fmt: skip
    return list(latency.values())


def timeline_marks(timeline: dict[str, Any]) -> dict[str, Any]:
    """The moments a replay's gap to its floor is made of: the adds done, the first step, and
    the first and the middle request (in the order added: loads land in that order)."""
    requests, steps = timeline.get("requests", []), timeline.get("steps", [])
    return {"adds_done_s": timeline.get("adds_done_s"), "first_step_s": steps[0] if steps else None,
            "first": requests[0] if requests else None,
            "middle": requests[(len(requests) - 1) // 2] if requests else None}  # fmt: skip


def _load_timeline(llm, t0: float):
    from siesta.bench.probes import LoadTimeline

    feeder = getattr(llm.engine.connector, "load_feeder", None)  # the host tier's; none without one
    return nullcontext(None) if feeder is None else LoadTimeline(feeder, t0)


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What changed between two counter snapshots (unchanged series left out)."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)}
    return {k: v for k, v in sorted(delta.items()) if v}


def delta_link_gbps(delta: dict[str, float]) -> float | None:
    """The link's rate while a replay's loads were in flight, from its counter deltas."""
    return loading_gbps(delta.get(HOST_LOAD_BYTES, 0.0), delta.get(HOST_LOAD_SECONDS, 0.0))


def _probed_replay(llm, prompts: list[list[int]], max_tokens: int,
                   step_ends: list[tuple[float, int, int]] | None = None) -> tuple[list[float], dict[str, Any]]:  # fmt: skip
    """A replay's latencies, with its timeline, the collector's runs and the machine's CPU
    seconds by kind (steal among them) while it ran."""
    cpu = host_cpu_seconds()
    timeline: dict[str, Any] = {}
    with GcPauses() as pauses:
        latencies = fire_all(llm, prompts, max_tokens, step_ends, timeline)
    return latencies, {"gc": pauses.summary(), "host_cpu_s": cpu_seconds_between(cpu, host_cpu_seconds()),
                       "timeline": timeline}  # fmt: skip


def replay_kept(llm, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """One more kept-tier sleep, wake-up and replay of prompts the tier holds."""
    before = _metrics(llm)
    llm.sleep(level=1, clear_connector_cache=False)
    llm.wake_up()
    replay, probes = _probed_replay(llm, prompts, max_tokens)
    delta = counter_delta(before, _metrics(llm))
    return {"replay_p50_s": median(replay), "replay_latencies_s": sorted(round(x, 4) for x in replay),
            "load_bytes": delta.get(HOST_LOAD_BYTES, 0.0), "link_gbps": delta_link_gbps(delta), **probes}  # fmt: skip


def run_arm(llm, keep_tier: bool, prompts: list[list[int]], max_tokens: int, replays: int = 1) -> dict[str, Any]:
    """The seed's arm; a kept one sleeps, wakes and replays ``replays`` times in all (the first
    is the seed's), so that one replay's noise shows, and reports their p50s' median."""
    warm = fire_all(llm, prompts, max_tokens)
    before = _metrics(llm)  # the seed's snapshot: a finished request's stores are in it
    t0 = time.perf_counter()
    llm.sleep(level=1, clear_connector_cache=not keep_tier)
    llm.wake_up()
    sleep_wake_s = time.perf_counter() - t0
    step_ends: list[tuple[float, int, int]] = []
    replay, probes = _probed_replay(llm, prompts, max_tokens, step_ends)
    delta = counter_delta(before, _metrics(llm))
    arm = {
        "keep_tier": keep_tier,
        "warm_p50_s": median(warm),
        "replay_p50_s": median(replay),
        "replay_latencies_s": sorted(round(x, 4) for x in replay),
        "replay_steps": step_ends,  # (end s, running, loading) per step
        "sleep_wake_s": sleep_wake_s,
        "metric_delta": delta,
        "link_gbps": delta_link_gbps(delta),
        **probes,
        "timeline_marks": timeline_marks(probes["timeline"]),
    }
    if keep_tier:
        arm["replays"] = [replay_kept(llm, prompts, max_tokens) for _ in range(replays - 1)]
        arm["replay_p50_median_s"] = median([arm["replay_p50_s"]] + [r["replay_p50_s"] for r in arm["replays"]])
    return arm


def measure_decode_step_s(llm, context: int, steps: int = DECODE_PROBE_STEPS) -> float:
    """Seconds of one decode step at batch 1 over ``context`` tokens, the engine's own loop."""
    from siesta.bench.steps import decode_step_s

    seconds = decode_step_s(llm, 1, context, steps)
    while llm.engine.has_work():  # the abort's output, its stores
        llm.step()
    return seconds


def kept_floor(llm, arms: dict[str, dict[str, Any]], requests: int, prompt_tokens: int, max_tokens: int,
               link_gbps: float) -> dict[str, Any]:  # fmt: skip
    """The kept replay's p50 against its ordered-load floor (every prompt has one length)."""
    kept = arms["kept"]
    step_s = measure_decode_step_s(llm, prompt_tokens)
    shares = equal_shares(kept["metric_delta"].get(HOST_LOAD_BYTES, 0.0), requests)
    return floor_report(LoadFloor(link_gbps, step_s, max_tokens), shares, kept)


def floor_report(floor: LoadFloor, shares: list[float], kept: dict[str, Any]) -> dict[str, Any]:
    """The kept replay's p50 over its floor, the replays' median over it, and the floor again at
    the link rate the replays measured (the engine's share of the gap)."""
    report = floor.report(shares, kept["replay_p50_s"])
    report["replay_p50_median_s"] = kept["replay_p50_median_s"]
    report["median_over_floor"] = kept["replay_p50_median_s"] / report["floor_p50_s"]
    rates = [r for r in [kept["link_gbps"]] + [x["link_gbps"] for x in kept["replays"]] if r]
    if rates:
        measured = replace(floor, link_gbps=median(rates))
        report["measured_link"] = measured.report(shares, kept["replay_p50_median_s"])
    return report


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.url:
        from siesta.bench import resume

        return resume.run(args)
    from siesta import LLM
    from siesta.entrypoints.engine_args import engine_kwargs

    kwargs = engine_kwargs(args)
    kwargs.pop("max_waiting_requests")  # a server's bound on its queue: the offline LLM takes none
    if kwargs["kv_transfer_config"] is None:
        kwargs["kv_transfer_config"] = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                        "kv_connector_extra_config": {"cpu_bytes_to_use": DEFAULT_TIER_BYTES}}  # fmt: skip
    llm = LLM(**kwargs)
    vocab = llm.engine.vocab_size
    fire_all(llm, random_prompts(2, 16, 32, vocab, seed=99), 2)  # warm-up
    arms = {}
    for seed, (name, keep) in enumerate((("cleared", False), ("kept", True))):
        prompts = random_prompts(args.requests, args.prompt_tokens, args.prompt_tokens, vocab, seed=seed)
        arms[name] = run_arm(llm, keep, prompts, args.max_tokens)
    result = {"cleared": arms["cleared"], "kept": arms["kept"], "config": {k: str(v) for k, v in vars(args).items()}}
    result["speedup_p50"] = arms["cleared"]["replay_p50_s"] / arms["kept"]["replay_p50_s"]
    result["kept_floor"] = kept_floor(llm, arms, args.requests, args.prompt_tokens, args.max_tokens, args.link_gbps)
    result["verdict"] = "tier reused on resume" if result["speedup_p50"] > 1 else "no measurable difference"
    report(result)
    write_json(args.json, result)
    return result


def report(result: dict[str, Any]) -> None:
    rows = []
    for name in ("cleared", "kept"):
        arm = result[name]
        d = arm["metric_delta"]
        rows.append([
            name,
            f"{d.get('siesta_external_prefix_cache_hits_total', 0):,.0f} / {d.get('siesta_external_prefix_cache_queries_total', 0):,.0f}",
            d.get('siesta_kv_offload_load_bytes_total{tier="host"}', 0.0) / 1e6,
            d.get('siesta_kv_offload_store_bytes_total{tier="host"}', 0.0) / 1e6,
            arm["warm_p50_s"],
            arm["replay_p50_s"],
        ])  # fmt: skip
    print_table("replay after wake-up", ["arm", "external hits / queried", "load MB", "store MB", "warm p50 s",
                                         "replay p50 s"], rows)  # fmt: skip
    print(f"\nkept-tier replay is {result['speedup_p50']:.1f}x faster at p50 ({result['verdict']})")
    print_floor(result["kept_floor"])


def print_floor(floor: dict[str, Any]) -> None:
    print(f"kept replay p50 {floor['replay_p50_s']:.4f} s against its ordered-load floor {floor['floor_p50_s']:.4f} s "
          f"(at {floor['link_gbps']:g} GB/s, decode step {floor['decode_step_s'] * 1e3:.2f} ms): "
          f"{floor['p50_over_floor']:.2f}x the floor")
