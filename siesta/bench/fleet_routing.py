"""``python -m siesta.bench.fleet_routing``: after a fleet sleep(keep)/wake, what fraction of
the resumed tokens hit a replica's tier, with the gateway's tier-aware policy against round-robin?

A resumed request is what slime sends after a pause that aborted it: the same ``rid``, its
prompt plus the tokens it had, so its KV is in the tier of the replica that ran it, and only
there. Per arm, on the same replicas (each arm its own gateway, its own prompts):

1. warm: every prompt through the gateway's ``/generate``, all at once (a rollout burst),
2. the fleet sleeps keeping its tiers (``sleep(level=1, mode="keep", clear_connector_cache=
   False)``: device KV is released, so a hit can only be a tier hit), then wakes,
3. resume: each prompt plus its output, same rid, all at once, in a shuffled order (requests
   come back in the order they were cut off, not sent),
4. each replica's own ``/metrics``: tier-hit tokens (``siesta_external_prefix_cache_hits_total``)
   over resumed prompt tokens, and over the tokens a tier could have held at all (full blocks
   before each resumed prompt's last token, which is always computed).

``cache_aware`` is smg's prefix tree per replica of the prompts it routed there; for siesta that
tree is what the replica's tier holds, since the tier keeps what it computed across sleep.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from siesta.bench.common import machine, print_table, write_json
from siesta.bench.resume import EXTERNAL_HITS, expected_hits, make_prompts, metric_sum
from siesta.client import SiestaClient
from siesta.fleet.client import FleetClient
from siesta.fleet.gateway import Gateway, GatewayConfig, free_port
from siesta.fleet.replicas import LocalReplica, ReplicaSpec, launch_local

DEFAULT_JSON = "bench/results/fleet-routing-cpu-2core.json"
# (gateway policy, sticky sessions): smg's sticky override pins a request to where its routing key
# went before (a header, else its request-id lineage: the rid), on any policy. Round-robin with
# it on is not round-robin for resumed requests, so the baseline runs without it.
ARMS = {"cache_aware": ("cache_aware", False), "round_robin": ("round_robin", False),
        "sticky_rid": ("round_robin", True), "cache_aware+sticky": ("cache_aware", True)}
BLOCK = 16
PROMPT_TOKENS = "siesta_prompt_tokens_total"
# Replicas on the CPU: tiny random weights (routing, not compute, is measured), fp32, a tier
# that holds every arm's KV, one thread each.
TIER = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"block_size": BLOCK, "cpu_bytes_to_use": 200_000_000}})  # fmt: skip
SERVE_ARGS = ("random:tiny-llama", "--dtype", "float32", "--kv-cache-bytes", str(32 << 20), "--max-model-len", "1024",
              "--kv-transfer-config", TIER)  # fmt: skip
REPLICA_ENV = {"OMP_NUM_THREADS": "1"}
HTTP_TIMEOUT_S = 120.0


def generate(url: str, input_ids: list[int], rid: str, max_new_tokens: int, headers: dict[str, str] | None = None,
             timeout_s: float = HTTP_TIMEOUT_S) -> dict[str, Any]:  # fmt: skip
    """SGLang's /generate (what slime sends): greedy, token ids in, ids and meta_info out."""
    body = {"input_ids": input_ids, "rid": rid,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}}  # fmt: skip
    response = httpx.post(f"{url}/generate", json=body, headers=headers, timeout=timeout_s)
    response.raise_for_status()
    return response.json()


def replica_metrics(urls: list[str]) -> list[dict[str, float]]:
    """Each replica's own counters: the evidence, read beside the gateway, not through it."""
    out = []
    for url in urls:
        with SiestaClient(url, timeout=HTTP_TIMEOUT_S) as c:
            out.append(c.metrics())
    return out


@dataclass
class Arm:
    arm: str
    policy: str
    sticky: bool
    replicas: int
    prompts: int
    prompt_len: int
    warm_tokens: int
    resumed_tokens: int
    tier_hit_tokens: int
    tier_possible_tokens: int
    hit_fraction: float  # of the resumed prompt tokens
    hit_fraction_of_possible: float  # of the full blocks a tier could hold
    per_replica_hits: list[int]
    per_replica_warm_tokens: list[int]
    sleep_wake_s: float


# Seeded shuffles tried for the resume order (resume_order).
SHUFFLE_TRIES = 64


def resume_order(num_prompts: int, num_replicas: int, seed: int, ran_on: list[int] | None = None) -> list[int]:
    """The order the resumed requests are sent in: a shuffle that gives round robin no luck.

    Request ``i`` ran on replica ``ran_on[i]`` (by default ``i``: the warm-up in index order), so
    a round-robin gateway sends it, resumed at position ``p``, back there exactly when
    ``(p - ran_on[i]) mod replicas`` equals the rotation the gateway's counter happens to be at
    (health checks and control calls move it). A plain shuffle can put most requests on one
    residue, and round robin then "finds" the tier by luck; of a few seeded shuffles this takes
    the one whose residues are most even, so every rotation lands about 1/replicas of the
    requests where they ran."""
    ran_on = list(range(num_prompts)) if ran_on is None else ran_on
    rng = random.Random(seed)
    best: list[int] = []
    best_worst = num_prompts + 1
    for _ in range(SHUFFLE_TRIES):
        order = list(range(num_prompts))
        rng.shuffle(order)
        residues = Counter((p - ran_on[i]) % num_replicas for p, i in enumerate(order))
        worst = max(residues.get(r, 0) for r in range(num_replicas))
        if worst < best_worst:
            best, best_worst = order, worst
    return best


def run_arm(arm: str, replicas: list[LocalReplica], num_prompts: int, prompt_len: int, max_new_tokens: int,
            seed: int, fleet: str = "bench") -> Arm:  # fmt: skip
    """One gateway of ``arm``'s policy over ``replicas``: warm, sleep(keep)/wake, resume, count."""
    policy, sticky = ARMS[arm]
    config = GatewayConfig(port=free_port(), policy=policy, session_header="x-session-id" if sticky else None)
    gateway = Gateway.start(config)
    try:
        for r in replicas:
            gateway.register(r.url, fleet, r.spec.index)
        client = FleetClient(gateway.url, fleet, gateway=gateway)
        urls = [r.url for r in replicas]
        prompts = make_prompts(num_prompts, prompt_len, seed)
        rids = [f"{arm}-{i}" for i in range(num_prompts)]
        before = replica_metrics(urls)
        ran_on = None
        if policy == "round_robin" and not sticky:
            outs, ran_on = _warm_one_at_a_time(gateway.url, urls, prompts, rids, max_new_tokens)
        else:  # at once: a cache-aware gateway spreads what is in flight together
            with ThreadPoolExecutor(num_prompts) as pool:
                outs = list(pool.map(lambda i: generate(gateway.url, prompts[i], rids[i], max_new_tokens),
                                     range(num_prompts)))  # fmt: skip
        warm = replica_metrics(urls)
        t0 = time.perf_counter()
        client.sleep(level=1, mode="keep", clear_connector_cache=False)
        client.wake_up()
        sleep_wake_s = time.perf_counter() - t0
        resumed = [prompts[i] + outs[i]["output_ids"] for i in range(num_prompts)]
        # One at a time: a round-robin gateway then sees them in ``order`` (12 threads at once
        # arrived in whatever order the threads ran, and once lined ten of twelve up with the
        # warm-up's replicas: round robin "found" the tier by luck).
        for i in resume_order(num_prompts, len(replicas), seed, ran_on):
            generate(gateway.url, resumed[i], rids[i], 1)
        after = replica_metrics(urls)
        client.close()
    finally:
        gateway.stop()
    hits = [int(metric_sum(a, EXTERNAL_HITS) - metric_sum(w, EXTERNAL_HITS)) for a, w in zip(after, warm)]
    warm_tokens = [int(metric_sum(w, PROMPT_TOKENS) - metric_sum(b, PROMPT_TOKENS)) for w, b in zip(warm, before)]
    resumed_tokens = sum(len(p) for p in resumed)
    possible = expected_hits(resumed, BLOCK)
    return Arm(arm, policy, sticky, len(replicas), num_prompts, prompt_len, sum(warm_tokens), resumed_tokens,
               sum(hits), possible, sum(hits) / resumed_tokens, sum(hits) / possible, hits, warm_tokens,
               sleep_wake_s)  # fmt: skip


def _warm_one_at_a_time(gateway_url: str, urls: list[str], prompts: list[list[int]], rids: list[str],
                        max_new_tokens: int) -> tuple[list[dict[str, Any]], list[int]]:  # fmt: skip
    """Each warm-up request alone, and the replica it ran on (whose prompt-token counter grew).
    Twelve threads at once reached a round-robin gateway in any order, so the resume order,
    balanced against index order, once lined nine of twelve up with where they ran."""
    outs, ran_on = [], []
    tokens = [metric_sum(m, PROMPT_TOKENS) for m in replica_metrics(urls)]
    for prompt, rid in zip(prompts, rids):
        outs.append(generate(gateway_url, prompt, rid, max_new_tokens))
        before, tokens = tokens, [metric_sum(m, PROMPT_TOKENS) for m in replica_metrics(urls)]
        ran_on.append(max(range(len(urls)), key=lambda r: tokens[r] - before[r]))
    return outs, ran_on


def start_replicas(count: int) -> list[LocalReplica]:
    specs = [ReplicaSpec(i, "127.0.0.1", free_port(), None) for i in range(count)]
    return launch_local(specs, SERVE_ARGS, env=os.environ | REPLICA_ENV)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=DEFAULT_JSON)
    args = ap.parse_args(argv)
    replicas = start_replicas(args.replicas)
    try:
        arms = [run_arm(arm, replicas, args.prompts, args.prompt_len, args.max_new_tokens, args.seed + 1000 * k)
                for k, arm in enumerate(args.arms)]  # fmt: skip
    finally:
        for r in replicas:
            r.stop()
    print_table("tier hits of resumed requests after a fleet sleep(keep)/wake",
                ["arm", "replicas", "resumed tok", "tier hits", "of resumed", "of possible", "per replica"],
                [[a.arm, a.replicas, a.resumed_tokens, a.tier_hit_tokens, a.hit_fraction,
                  a.hit_fraction_of_possible, a.per_replica_hits] for a in arms])  # fmt: skip
    write_json(args.json, {"bench": "fleet_routing", "machine": machine(), "gateway": _gateway_version(),
                           "args": vars(args), "arms": [asdict(a) for a in arms]})  # fmt: skip


def _gateway_version() -> str:
    from importlib.metadata import version

    return f"smg {version('smg')}"


if __name__ == "__main__":
    main()
