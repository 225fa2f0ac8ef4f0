"""``siesta bench resume``: over HTTP, does the KV tier survive a sleep, and does a replay reuse it?

Two arms against one running server (``siesta serve --dev-mode --kv-transfer-config ...``);
without ``--url`` the same experiment runs in-process (``siesta.bench.resume_offline``):

1. warm N distinct long prompts, concurrently (their KV lands in the tier),
2. ``/sleep?level=1``: the ``cleared`` arm with the default, the ``kept`` arm with
   ``clear_connector_cache=false``; then ``/wake_up``,
3. replay the same prompts, concurrently, timing each,
4. read the counter deltas from ``/metrics``: every series whose name mentions
   ``prefix_cache``, ``offload`` or ``connector``.

Each arm has its own prompts, so neither starts warmer than the other. Prompts are token
ids of exact lengths: the hits a kept tier should give are known in advance (every full
block before each prompt's last token). The counters are the evidence; the latencies show
what they are worth, and the kept replay's p50 is set against its ordered-load floor
(``siesta.bench.load_floor``), with a decode step timed over the same HTTP path.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from siesta.bench.common import median, print_table, write_json
from siesta.bench.load_floor import LoadFloor, equal_shares
from siesta.client import AsyncSiestaClient

DEFAULT_JSON = "bench/results/resume_http.json"
# Prompt token ids come from this range: ordinary tokens in every vocabulary siesta loads.
TOKEN_ID_RANGE = (100, 1000)
TIER_METRIC_MARKERS = ("prefix_cache", "offload", "connector")
EXTERNAL_HITS = "siesta_external_prefix_cache_hits_total"
EXTERNAL_QUERIES = "siesta_external_prefix_cache_queries_total"
LOAD_BYTES = "siesta_kv_offload_load_bytes_total"
STORE_BYTES = "siesta_kv_offload_store_bytes_total"
ARM_SEED_STRIDE = 1_000_003  # arms draw from different seeds: no shared prefixes
DECODE_PROBE_STEPS = 16  # a decode step is timed as (1 + this many tokens) minus one token, over this many
DECODE_PROBE_REPS = 3  # medians of this many of each


@dataclass
class ArmResult:
    keep_tier: bool
    warm_s: list[float]
    replay_s: list[float]
    expected_hits: int  # full blocks before each prompt's last token, summed
    warm_delta: dict[str, float] = field(default_factory=dict)  # warm-up through the sleep
    replay_delta: dict[str, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return "kept" if self.keep_tier else "cleared"

    def summary(self) -> dict[str, float]:
        return {
            "external_hits": metric_sum(self.replay_delta, EXTERNAL_HITS),
            "external_queries": metric_sum(self.replay_delta, EXTERNAL_QUERIES),
            "expected_hits": float(self.expected_hits),
            "replay_load_bytes": metric_sum(self.replay_delta, LOAD_BYTES),
            "replay_store_bytes": metric_sum(self.replay_delta, STORE_BYTES),
            "warm_store_bytes": metric_sum(self.warm_delta, STORE_BYTES),
            "warm_p50_s": median(self.warm_s),
            "replay_p50_s": median(self.replay_s),
        }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The HTTP-only options; ``--url``, ``--requests``, ``--prompt-tokens``, ``--max-tokens``
    and ``--json`` come from ``resume_offline`` and ``--model``/``--block-size`` from the engine
    flags (over HTTP: the model name requests carry, the server's block size)."""
    p.add_argument("--api-key", default=None)
    p.add_argument("--prompt-seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="PNG plot (default: beside the JSON)")


def metric_sum(values: dict[str, float], name: str) -> float:
    """A metric summed over its label sets (``name`` or ``name{...}``)."""
    return sum(v for k, v in values.items() if k == name or k.startswith(name + "{"))


def tier_metrics(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if any(marker in k for marker in TIER_METRIC_MARKERS)}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    keys = sorted(set(before) | set(after))
    out = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in keys}
    return {k: v for k, v in out.items() if v}


def make_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*TOKEN_ID_RANGE) for _ in range(length)] for _ in range(num)]


def expected_hits(prompts: list[list[int]], block_size: int) -> int:
    # The last prompt token is always computed, so only blocks that end before it can hit.
    return sum((len(p) - 1) // block_size * block_size for p in prompts)


async def _fire(client: AsyncSiestaClient, prompt: list[int], args: argparse.Namespace,
                max_tokens: int | None = None) -> float:  # fmt: skip
    max_tokens = args.max_tokens if max_tokens is None else max_tokens
    t0 = time.perf_counter()
    await client.completions(prompt, model=args.model, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return time.perf_counter() - t0


async def decode_step_s(client: AsyncSiestaClient, prompt: list[int], args: argparse.Namespace) -> float:
    """One decode step at batch 1, end to end: a request of 1 + DECODE_PROBE_STEPS tokens
    against one of 1, on a prompt the device cache holds (the same prefill for both)."""
    await _fire(client, prompt, args, max_tokens=1)  # its KV in the device cache
    short = [await _fire(client, prompt, args, max_tokens=1) for _ in range(DECODE_PROBE_REPS)]
    long = [await _fire(client, prompt, args, max_tokens=1 + DECODE_PROBE_STEPS) for _ in range(DECODE_PROBE_REPS)]
    return max(median(long) - median(short), 0.0) / DECODE_PROBE_STEPS


async def _burst(client: AsyncSiestaClient, prompts: list[list[int]], args: argparse.Namespace) -> list[float]:
    return list(await asyncio.gather(*(_fire(client, p, args) for p in prompts)))


async def run_arm(client: AsyncSiestaClient, keep_tier: bool, args: argparse.Namespace) -> ArmResult:
    prompts = make_prompts(args.requests, args.prompt_tokens, args.prompt_seed + int(keep_tier) * ARM_SEED_STRIDE)
    before = tier_metrics(await client.metrics())
    warm = await _burst(client, prompts, args)
    await client.sleep(level=1, clear_connector_cache=not keep_tier)
    await client.wake_up()
    awake = tier_metrics(await client.metrics())
    replay = await _burst(client, prompts, args)
    after = tier_metrics(await client.metrics())
    return ArmResult(
        keep_tier, warm, replay, expected_hits(prompts, args.block_size), delta(before, awake), delta(awake, after)
    )


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    async with AsyncSiestaClient(args.url, api_key=args.api_key) as client:
        arms = [await run_arm(client, keep, args) for keep in (False, True)]
        probe = make_prompts(1, args.prompt_tokens, args.prompt_seed + 2 * ARM_SEED_STRIDE)[0]
        step_s = await decode_step_s(client, probe, args)
    cleared, kept = (a.summary() for a in arms)
    floor = LoadFloor(args.link_gbps, step_s, args.max_tokens)
    reused = (
        kept["external_hits"] > 0 and kept["replay_load_bytes"] > 0 and kept["replay_p50_s"] < cleared["replay_p50_s"]
    )
    return {
        "config": {k: str(v) for k, v in vars(args).items() if k not in ("func", "api_key")},
        "arms": {a.name: asdict(a) | {"summary": a.summary()} for a in arms},
        "speedup_p50": cleared["replay_p50_s"] / kept["replay_p50_s"],
        "kept_floor": floor.report(equal_shares(kept["replay_load_bytes"], args.requests), kept["replay_p50_s"]),
        "verdict": "tier reused on resume" if reused else "no measurable reuse",
    }


def _print(result: dict[str, Any]) -> None:
    headers = ["arm", "ext hits", "expected", "ext queries", "replay load B", "replay store B", "warm store B",
               "warm p50 s", "replay p50 s"]  # fmt: skip
    rows = []
    for name, arm in result["arms"].items():
        s = arm["summary"]
        rows.append([name, s["external_hits"], s["expected_hits"], s["external_queries"], s["replay_load_bytes"],
                     s["replay_store_bytes"], s["warm_store_bytes"], s["warm_p50_s"], s["replay_p50_s"]])  # fmt: skip
    print_table("replay after sleep(level=1) -> wake_up", headers, rows)
    print(f"\nverdict: {result['verdict']}; kept-tier replay {result['speedup_p50']:.1f}x faster at p50")
    from siesta.bench.resume_offline import print_floor

    print_floor(result["kept_floor"])


def plot(result: dict[str, Any], path: str) -> None:
    try:
        import matplotlib
    except ModuleNotFoundError:  # the results are already printed and written
        print("no plot: matplotlib is missing (pip install 'siesta[bench]')")
        return

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    names = list(result["arms"])
    summaries = [result["arms"][n]["summary"] for n in names]
    fig, (lat, io) = plt.subplots(1, 2, figsize=(10, 4))
    lat.bar(names, [s["replay_p50_s"] for s in summaries], color=["tab:gray", "tab:green"])
    lat.set_title("replay p50 latency after wake-up")
    lat.set_ylabel("seconds")
    width = 0.4
    xs = range(len(names))
    io.bar([x - width / 2 for x in xs], [s["replay_load_bytes"] / 1e6 for s in summaries], width, label="loaded")
    io.bar([x + width / 2 for x in xs], [s["replay_store_bytes"] / 1e6 for s in summaries], width, label="stored")
    io.set_xticks(list(xs), names)
    io.set_title("KV tier traffic during the replay")
    io.set_ylabel("MB")
    io.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """``siesta bench resume --url URL`` (``resume_offline.run`` hands over here)."""
    result = asyncio.run(measure(args))
    _print(result)
    json_path = args.json or DEFAULT_JSON
    write_json(json_path, result)
    plot(result, args.plot or str(Path(json_path).with_suffix(".png")))
    return result
