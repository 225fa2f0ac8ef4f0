"""Time to first token of ``siesta serve`` on a machine whose cores are busy with other work.

A served engine on the CPU used to start one thread per core beside the API server; on a
loaded 2-core machine a 16-token ``/generate`` took 24-46 s. This starts the server once per
arm (its ``--cpu-threads``, or the default: the cores less one for the API server), loads the
machine with ``--load-procs`` processes that spin, and streams short completions one at a time,
timing the first token and the whole answer. The arms run in turn, each with the same load.

    python -m siesta.bench.loaded_ttft --arms default,2 --requests 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from typing import Any

import httpx

from siesta.bench.common import machine
from siesta.bench.resume_http import ServerProcess

PROMPT = "Write one sentence about the sea."
NEW_TOKENS = 16


class ServeArm:
    """``siesta serve`` (the embedded model) with ``--cpu-threads`` when given."""

    def __init__(self, threads: int | None, kv_bytes: str) -> None:
        self.threads, self.kv_bytes = threads, kv_bytes

    def command(self, port: int) -> list[str]:
        import sys

        cmd = [sys.executable, "-m", "siesta.entrypoints.cli", "serve", "--port", str(port), "--kv-cache-bytes",
               self.kv_bytes, "--uvicorn-log-level", "warning"]  # fmt: skip
        return cmd + ([] if self.threads is None else ["--cpu-threads", str(self.threads)])


def _spin(stop) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def one_request(url: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    first = None
    body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and first is None and line != "data: [DONE]":
                first = time.perf_counter() - t0
    return first or float("nan"), time.perf_counter() - t0


def run_arm(threads: int | None, args: argparse.Namespace) -> dict[str, Any]:
    with ServerProcess(ServeArm(threads, args.kv_cache_bytes)) as server:
        one_request(server.url)  # warm-up, unloaded
        stop = mp.Event()
        load = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.load_procs)]
        for p in load:
            p.start()
        try:
            times = [one_request(server.url) for _ in range(args.requests)]
        finally:
            stop.set()
            for p in load:
                p.join()
    ttft, total = [t for t, _ in times], [t for _, t in times]
    return {"cpu_threads": threads or "default", "ttft_p50_s": statistics.median(ttft), "ttft_max_s": max(ttft),
            "latency_p50_s": statistics.median(total), "latency_max_s": max(total), "ttft_s": ttft}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arms", default="default,2", help="cpu threads per arm; 'default' for the engine's choice")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--load-procs", type=int, default=2, help="spinning processes beside the server")
    ap.add_argument("--kv-cache-bytes", default="256M")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    arms = [None if a == "default" else int(a) for a in args.arms.split(",")]
    out = {"machine": machine(), "load_procs": args.load_procs, "requests": args.requests,
           "arms": [run_arm(t, args) for t in arms]}  # fmt: skip
    for arm in out["arms"]:
        print(f"cpu threads {arm['cpu_threads']}: TTFT p50 {arm['ttft_p50_s']:.2f} s (max {arm['ttft_max_s']:.2f}), "
              f"16 tokens p50 {arm['latency_p50_s']:.2f} s (max {arm['latency_max_s']:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
