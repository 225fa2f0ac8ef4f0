"""``python -m siesta.bench.fleet_fanout``: how long one fleet control call takes at 2, 4 and 8
replicas, on the CPU over loopback, through the gateway's fan-out (``siesta.fleet.FleetClient``).

The replicas start once; each size gets a gateway of its own over the first N. Per verb, the
wall time of the client's call, repeated: ``pause(keep)``, ``resume``, ``sleep(keep, tier
kept)``, ``wake_up``, the version read, a weight update from disk (the whole transaction:
pause, write, read the versions back, relabel the gateway, resume), and a trainer's push over
gloo into every replica at once (one broadcast group, rank offsets per replica; same
transaction). Beside each, the same engine route called on every replica straight from this
process, all at once (what a framework without a gateway does: prime-rl's asyncio.gather), so
the gateway's share is the difference. The replicas are idle: the figure is the control path,
not a step in flight (a call waits for at most the step running when it arrives).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import httpx
import torch

from siesta.bench.common import machine, median, percentile, print_table, write_json
from siesta.fleet.client import FleetClient
from siesta.fleet.gateway import Gateway, GatewayConfig, free_port
from siesta.fleet.replicas import LocalReplica, ReplicaSpec, launch_local

DEFAULT_JSON = "bench/results/fleet-fanout-cpu-2core.json"
SIZES = (2, 4, 8)
TIER = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"block_size": 16, "cpu_bytes_to_use": 50_000_000}})  # fmt: skip
SERVE_ARGS = ("random:tiny-llama", "--dtype", "float32", "--kv-cache-bytes", str(16 << 20), "--max-model-len", "512",
              "--kv-transfer-config", TIER,
              "--weight-transfer-config", json.dumps({"backend": "nccl", "timeout_s": 60.0}))  # fmt: skip
REPLICA_ENV = {"OMP_NUM_THREADS": "1"}
# The same routes, straight to each replica: (method, path, query).
DIRECT = {
    "pause": ("POST", "/pause", {"mode": "keep"}),
    "resume": ("POST", "/resume", {}),
    "sleep": ("POST", "/sleep", {"level": "1", "mode": "keep", "clear_connector_cache": "false"}),
    "wake_up": ("POST", "/wake_up", {}),
    "weight_version": ("GET", "/weight_version", {}),
}


@dataclass
class Timing:
    verb: str
    replicas: int
    path: str  # "gateway" (FleetClient through smg's fan-out) or "direct" (every replica from here)
    reps: int
    p50_ms: float
    p90_ms: float
    max_ms: float


def _timed(fn: Callable[[], object], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _timing(verb: str, n: int, path: str, ms: list[float]) -> Timing:
    return Timing(verb, n, path, len(ms), median(ms), percentile(ms, 90), max(ms))


def _direct(urls: list[str], method: str, path: str, params: dict[str, str], pool: ThreadPoolExecutor,
            http: httpx.Client) -> None:  # fmt: skip
    def one(url: str) -> None:
        http.request(method, url + path, params=params).raise_for_status()

    list(pool.map(one, urls))


def measure(replicas: list[LocalReplica], reps: int, push_reps: int) -> list[Timing]:
    n = len(replicas)
    fleet = f"n{n}"
    gateway = Gateway.start(GatewayConfig(port=free_port()))
    out: list[Timing] = []
    try:
        for r in replicas:
            gateway.register(r.url, fleet, r.spec.index)
        client = FleetClient(gateway.url, fleet, gateway=gateway)
        # One version on all first: replicas an earlier size updated serve another, and the
        # fleet refuses to resume on mixed versions.
        client.update_weights("random:tiny-llama", weight_version=str(1000 * n))
        pairs = [("pause", lambda: client.pause(mode="keep"), "resume", client.resume),
                 ("sleep", lambda: client.sleep(level=1, mode="keep", clear_connector_cache=False),
                  "wake_up", client.wake_up)]  # fmt: skip
        for first, do, second, undo in pairs:
            a, b = [], []
            for _ in range(reps):
                a += _timed(do, 1)
                b += _timed(undo, 1)
            out += [_timing(first, n, "gateway", a), _timing(second, n, "gateway", b)]
        out.append(_timing("weight_version", n, "gateway", _timed(client.weight_versions, reps)))
        out.append(_timing("update_from_disk", n, "gateway",
                           _timed(lambda: client.update_weights("random:tiny-llama"), push_reps)))  # fmt: skip
        out.append(_timing("push_gloo", n, "gateway", _push(client, push_reps)))
        client.close()
        urls = [r.url for r in replicas]
        with ThreadPoolExecutor(n) as pool, httpx.Client(timeout=120.0) as http:
            for first, second in (("pause", "resume"), ("sleep", "wake_up")):
                a, b = [], []
                for _ in range(reps):
                    a += _timed(lambda verb=first: _direct(urls, *DIRECT[verb], pool, http), 1)
                    b += _timed(lambda verb=second: _direct(urls, *DIRECT[verb], pool, http), 1)
                out += [_timing(first, n, "direct", a), _timing(second, n, "direct", b)]
            ms = _timed(lambda: _direct(urls, *DIRECT["weight_version"], pool, http), reps)
            out.append(_timing("weight_version", n, "direct", ms))
    finally:
        gateway.stop()
    return out


def _push(client: FleetClient, reps: int) -> list[float]:
    """A transformers model of the served shape pushed into every replica over gloo."""
    from transformers import AutoModelForCausalLM

    from siesta.model.random_init import RANDOM_SHAPES
    from siesta.weight_transfer import WeightSender

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(RANDOM_SHAPES["tiny-llama"].config()).float().eval()
    sender = WeightSender(client, "nccl", timeout_s=120.0)
    sender.init()
    try:
        return _timed(lambda: client.push(sender, model), reps)
    finally:
        sender.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--push-reps", type=int, default=5)
    ap.add_argument("--json", default=DEFAULT_JSON)
    args = ap.parse_args(argv)
    specs = [ReplicaSpec(i, "127.0.0.1", free_port(), None) for i in range(max(args.sizes))]
    t0 = time.perf_counter()
    replicas = launch_local(specs, SERVE_ARGS, env=os.environ | REPLICA_ENV)
    started_s = time.perf_counter() - t0
    try:
        timings = [t for n in args.sizes for t in measure(replicas[:n], args.reps, args.push_reps)]
    finally:
        for r in replicas:
            r.stop()
    print_table("fleet control calls (ms)", ["verb", "replicas", "path", "p50", "p90", "max"],
                [[t.verb, t.replicas, t.path, t.p50_ms, t.p90_ms, t.max_ms] for t in timings])  # fmt: skip
    from importlib.metadata import version

    write_json(args.json, {"bench": "fleet_fanout", "machine": machine(), "gateway": f"smg {version('smg')}",
                           "replicas_started_s": started_s, "args": vars(args),
                           "timings": [asdict(t) for t in timings]})  # fmt: skip


if __name__ == "__main__":
    main()
