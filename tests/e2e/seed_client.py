"""The seed PR's measurement, as a standalone client: is the offloaded KV tier reused on resume?

Per arm: warm N distinct long prompts concurrently, ``/sleep?level=1`` (the second arm with
``clear_connector_cache=false``), ``/wake_up``, replay the same prompts, and report the
deltas of every /metrics series about prefix caches, offloading or connectors.

Same command line and output as the seed's script: ``--port --host --requests
--prompt-tokens --out``; prints (and writes) JSON with ``cleared``, ``kept`` and ``verdict``.
``--prompt-tokens`` counts words, as the seed's did.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import requests

MODEL = "dsv41"
MAX_TOKENS = 8
TIMEOUT_S = 600
MARKERS = ("prefix_cache", "offload", "connector")
REUSED = "tier reused on resume"
NOT_REUSED = "no measurable difference"


def scrape(base: str) -> dict[str, float]:
    """Tier-related series, summed by name (labels included in the name)."""
    totals: dict[str, float] = {}
    for line in requests.get(f"{base}/metrics", timeout=TIMEOUT_S).text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, _, value = line.rpartition(" ")
        if any(marker in name for marker in MARKERS):
            try:
                totals[name] = totals.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return totals


def make_prompt(index: int, words: int) -> str:
    # Distinct from its first words on, so no two prompts share a cached block.
    return f"session-{index}: " + " ".join(f"w{index}_{i}" for i in range(words))


def timed_completion(base: str, index: int, words: int) -> float:
    start = time.perf_counter()
    body = {"model": MODEL, "prompt": make_prompt(index, words), "max_tokens": MAX_TOKENS, "temperature": 0.0}
    requests.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT_S).raise_for_status()
    return time.perf_counter() - start


def burst(base: str, count: int, words: int) -> list[float]:
    with ThreadPoolExecutor(max_workers=count) as pool:
        return list(pool.map(lambda i: timed_completion(base, i, words), range(count)))


def p50(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def run_arm(base: str, keep_tier: bool, count: int, words: int) -> dict:
    warm = burst(base, count, words)
    before = scrape(base)
    params = {"level": 1, "mode": "abort"}
    if keep_tier:
        params["clear_connector_cache"] = "false"
    requests.post(f"{base}/sleep", params=params, timeout=TIMEOUT_S).raise_for_status()
    requests.post(f"{base}/wake_up", timeout=TIMEOUT_S).raise_for_status()
    replay = burst(base, count, words)
    after = scrape(base)
    changed = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(set(before) | set(after))}
    return {
        "keep_tier": keep_tier,
        "warm_p50_s": p50(warm),
        "replay_p50_s": p50(replay),
        "metric_delta": {k: v for k, v in changed.items() if v},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    base = f"http://{args.host}:{args.port}"
    result = {
        "cleared": run_arm(base, False, args.requests, args.prompt_tokens),
        "kept": run_arm(base, True, args.requests, args.prompt_tokens),
    }
    faster = result["kept"]["replay_p50_s"] < result["cleared"]["replay_p50_s"]
    result["verdict"] = REUSED if faster else NOT_REUSED
    print(json.dumps(result, indent=2))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
