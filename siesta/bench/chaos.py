"""Chaos against a served siesta: what bad clients and mid-flight control calls cost others.

Client threads send completions (some streamed and dropped after a few chunks, some given
up on by a short client timeout) while a controller pauses, sleeps with the tier kept, wakes
and resumes at random; an oversized fan-out and a 50 MB body arrive meanwhile. Printed, and
written as JSON: requests by outcome, each control call's latency, /health's latency while
the big body travels, dropped tier stores by reason, the gauges once quiet (nothing running,
no KV held), and the memory of the API server and the engine core before and after.

``python -m siesta.bench.chaos --duration 60 --json chaos.json`` (starts its own server with
a small host tier over a disk tier), or ``--url`` for a running one started with --dev-mode.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx

from siesta.bench.common import median
from siesta.client import SiestaClient
from siesta.tiers.base import DropReason

STARTUP_TIMEOUT_S = 300.0
POLL_S = 0.25
CLIENT_TIMEOUT_S = 120.0
GIVE_UP_S = 0.5  # a client that leaves before its answer
BIG_BODY_BYTES = 50 << 20
QUIET_TIMEOUT_S = 60.0
CONTROL_PAUSE_S = (1.0, 3.0)  # between control calls
DROPPED_STORES = "siesta_kv_offload_dropped_stores_total"
PROMPTS = ["Tell me about the sea.", "Write a haiku about sleep.", "List three prime numbers.",
           "Explain why the sky is blue in one paragraph."]  # fmt: skip
# --token-prompts (a model without a tokenizer, as the random shapes on a GPU): prompts of ids.
TOKEN_PROMPT_LENGTHS = (16, 40, 90, 200)
FIRST_PROMPT_ID = 100


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _memory(server_pid: int | None) -> dict[str, float | None]:
    if server_pid is None:
        return {}
    core = [c for c in _children(server_pid) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return {"api_server_mib": _rss_mib(server_pid), "engine_core_mib": _rss_mib(core[0]) if core else None}


def _start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    disk = tempfile.mkdtemp(prefix="siesta-chaos-disk-")
    tier = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": args.host_tier_bytes, "disk_path": disk,
                                          "disk_bytes_to_use": args.disk_tier_bytes}}  # fmt: skip
    cmd = [sys.executable, "-m", "siesta.entrypoints.cli", "serve", "--dev-mode", "--port", str(port),
           "--kv-transfer-config", json.dumps(tier), "--max-model-len", "2048"]  # fmt: skip
    if args.model:
        cmd += ["--model", args.model]
    log = open(Path(tempfile.mkdtemp(prefix="siesta-chaos-")) / "server.log", "w")  # noqa: SIM115 - lives with the server
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"siesta serve exited with {proc.returncode} (log: {log.name})")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(POLL_S)
    proc.kill()
    raise RuntimeError("siesta serve did not become healthy")


class Chaos:
    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url, self.args = url, args
        self.outcomes: Counter[str] = Counter()
        self.controls: dict[str, list[float]] = defaultdict(list)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.rng = random.Random(args.seed)
        self.prompts: list[Any] = list(PROMPTS)
        if args.token_prompts:
            self.prompts = [list(range(FIRST_PROMPT_ID, FIRST_PROMPT_ID + n)) for n in TOKEN_PROMPT_LENGTHS]

    def _count(self, outcome: str) -> None:
        with self.lock:
            self.outcomes[outcome] += 1

    def client(self, index: int) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        while not self.stop.is_set():
            body = {"prompt": rng.choice(self.prompts), "max_tokens": rng.choice([8, 32, 128]), "temperature": 0}
            kind = rng.choice(["whole", "whole", "stream_dropped", "gives_up"])
            try:
                if kind == "stream_dropped":
                    with httpx.stream("POST", f"{self.url}/v1/completions", json=body | {"stream": True},
                                      timeout=CLIENT_TIMEOUT_S) as r:  # fmt: skip
                        for n, _ in enumerate(r.iter_lines()):
                            if n >= rng.randint(1, 6):
                                break
                    self._count("stream_dropped")
                else:
                    timeout = GIVE_UP_S if kind == "gives_up" else CLIENT_TIMEOUT_S
                    r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=timeout)
                    self._count(f"http_{r.status_code}")
            except httpx.TimeoutException:
                self._count("client_gave_up")
            except httpx.HTTPError as e:
                self._count(f"transport_{type(e).__name__}")

    def controller(self) -> None:
        with SiestaClient(self.url) as c:
            while not self.stop.wait(self.rng.uniform(*CONTROL_PAUSE_S)):
                if self.rng.random() < 0.5:
                    self._timed("pause", lambda: c.pause(mode="keep", clear_connector_cache=False))
                    time.sleep(self.rng.uniform(0.1, 0.5))
                    self._timed("resume", c.resume)
                else:
                    self._timed("sleep", lambda: c.sleep(level=1, mode="keep", clear_connector_cache=False))
                    time.sleep(self.rng.uniform(0.1, 0.5))
                    self._timed("wake_up", c.wake_up)

    def _timed(self, name: str, call) -> None:
        t0 = time.perf_counter()
        call()
        with self.lock:
            self.controls[name].append(time.perf_counter() - t0)

    def bad_requests(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        r = httpx.post(f"{self.url}/v1/completions", json={"prompt": ["hi"] * 1024, "n": 128, "max_tokens": 1},
                       timeout=CLIENT_TIMEOUT_S)  # fmt: skip
        out["fan_out_status"] = r.status_code
        health: list[float] = []
        done = threading.Event()

        def probe() -> None:
            while not done.is_set():
                t0 = time.perf_counter()
                httpx.get(f"{self.url}/health", timeout=CLIENT_TIMEOUT_S)
                health.append(time.perf_counter() - t0)
                time.sleep(0.05)

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        t0 = time.perf_counter()
        big = {"prompt": "sea " * (BIG_BODY_BYTES // 4), "max_tokens": 1}
        try:
            r = httpx.post(f"{self.url}/v1/completions", json=big, timeout=CLIENT_TIMEOUT_S)
            out["big_body_status"] = r.status_code
        except httpx.HTTPError as e:
            out["big_body_status"] = f"{type(e).__name__}"
        out["big_body_answer_s"] = time.perf_counter() - t0
        done.set()
        prober.join()
        out["health_during_big_body_max_s"] = max(health) if health else None
        return out

    def run(self) -> dict[str, Any]:
        threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(self.args.clients)]
        threads.append(threading.Thread(target=self.controller, daemon=True))
        for t in threads:
            t.start()
        time.sleep(self.args.duration / 2)
        bad = self.bad_requests()
        time.sleep(self.args.duration / 2)
        self.stop.set()
        for t in threads:
            t.join(CLIENT_TIMEOUT_S)
        controls = {n: {"calls": len(v), "p50_s": median(v), "max_s": max(v), "each_s": [round(x, 4) for x in v]}
                    for n, v in self.controls.items()}  # fmt: skip
        return {"outcomes": dict(self.outcomes), "controls": controls, "bad_requests": bad}


def dropped_stores_by_reason(metrics: dict[str, float]) -> dict[str, float]:
    """Every reason a tier store can be dropped for, with its count summed over the tiers."""
    counts = dict.fromkeys((reason.value for reason in DropReason), 0.0)
    for key, value in metrics.items():
        if key.startswith(DROPPED_STORES + "{"):
            labels = dict(pair.split("=", 1) for pair in key[len(DROPPED_STORES) + 1 : -1].split(","))
            reason = labels["reason"].strip('"')
            counts[reason] = counts.get(reason, 0.0) + value
    return counts


def _quiet(url: str) -> dict[str, Any]:
    deadline = time.monotonic() + QUIET_TIMEOUT_S
    with SiestaClient(url) as c:
        while True:
            m = c.metrics()
            idle = m["siesta_num_requests_running"] == 0 and m["siesta_num_requests_waiting"] == 0
            if idle or time.monotonic() > deadline:
                keys = ("siesta_num_requests_running", "siesta_num_requests_waiting", "siesta_kv_cache_usage_perc")
                return {k: m.get(k, 0.0) for k in keys} | {"dropped_stores": dropped_stores_by_reason(m)}
            time.sleep(POLL_S)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None)
    ap.add_argument("--model", default=None, help="for the server it starts (default: the embedded model)")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--host-tier-bytes", type=int, default=64 << 20)
    ap.add_argument("--disk-tier-bytes", type=int, default=2 << 30)
    ap.add_argument("--token-prompts", action="store_true", help="send token ids (a model without a tokenizer)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    proc, url = (None, args.url) if args.url else _start_server(args)
    pid = None if proc is None else proc.pid
    try:
        result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "args": vars(args), "memory_before": _memory(pid)}
        result |= Chaos(url, args).run()
        result["quiet"] = _quiet(url)
        result["memory_after"] = _memory(pid)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print(json.dumps(result, indent=1))
    counts = result["quiet"]["dropped_stores"]
    print("dropped tier stores by reason:", ", ".join(f"{reason} {n:g}" for reason, n in counts.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
