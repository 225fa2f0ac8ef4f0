"""The seed's client, unchanged, against ``siesta serve`` on loopback: the resume over HTTP.

``siesta serve`` runs in a subprocess with the OffloadingConnector (a host tier large enough
for every arm) and a tokenizer from a folder (random weights have none); the seed's own
script (``tests/e2e/seed_client.py``) runs in another subprocess, exactly as a user runs it,
and its JSON is the result. The server's log is kept for when it fails.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from siesta.bench.common import median
from siesta.bench.resume_offline import HOST_LOAD_BYTES, counter_delta, delta_link_gbps

REPO_ROOT = Path(__file__).resolve().parents[2]
SEED_CLIENT = REPO_ROOT / "tests" / "e2e" / "seed_client.py"
DEFAULT_TOKENIZER = REPO_ROOT / "bench" / "tokenizer" / "smollm2"
SERVED_NAME = "dsv41"  # the seed client's model name
HOST = "127.0.0.1"
# An 8B model on a cold page cache, its graphs captured: minutes, not more.
STARTUP_TIMEOUT_S = 900.0
HEALTH_POLL_S = 0.5
HEALTH_TIMEOUT_S = 2.0
STOP_TIMEOUT_S = 60.0
CLIENT_TIMEOUT_S = 1800.0
LOG_TAIL_CHARS = 6000
HTTP_OK = 200


@dataclass
class ServeOptions:
    """What ``siesta serve`` is started with: the model, its tokenizer and the tier."""

    model: str
    tokenizer: str = str(DEFAULT_TOKENIZER)
    dtype: str = "bfloat16"
    max_model_len: int = 32768
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    tier_block_size: int = 128
    tier_bytes: int = 48 << 30
    gpu_memory_utilization: float = 0.9
    device: str | None = None
    kv_cache_bytes: int | None = None  # set on the CPU, where there is no GPU share to fill
    extra_flags: list[str] = field(default_factory=list)

    def tier_config(self) -> str:
        return json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"block_size": self.tier_block_size,
                                                         "cpu_bytes_to_use": self.tier_bytes}})  # fmt: skip

    def command(self, port: int) -> list[str]:
        cmd = [sys.executable, "-m", "siesta.entrypoints.cli", "serve", self.model, "--host", HOST, "--port", str(port),
               "--dev-mode", "--served-model-name", SERVED_NAME, "--tokenizer", self.tokenizer, "--dtype", self.dtype,
               "--max-model-len", str(self.max_model_len), "--max-num-batched-tokens", str(self.max_num_batched_tokens),
               "--max-num-seqs", str(self.max_num_seqs), "--kv-transfer-config", self.tier_config(),
               "--uvicorn-log-level", "warning"]  # fmt: skip
        if self.kv_cache_bytes is not None:
            cmd += ["--kv-cache-bytes", str(self.kv_cache_bytes)]
        else:
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.device is not None:
            cmd += ["--device", self.device]
        return cmd + self.extra_flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    """``siesta serve`` in a subprocess, its output in a log file; a context manager. ``options``
    gives the command for a port (``command(port)``), and the port itself if it has one."""

    def __init__(self, options: ServeOptions, env: dict[str, str] | None = None) -> None:
        self.options = options
        self.port = getattr(options, "port", None) or free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log_path = Path(tempfile.mkdtemp(prefix="siesta-resume-http-")) / "server.log"
        self._env = os.environ | (env or {})
        self.process: subprocess.Popen | None = None
        self.startup_s = 0.0

    def __enter__(self) -> Self:
        t0 = time.perf_counter()
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(self.options.command(self.port), stdout=log, stderr=subprocess.STDOUT,
                                            env=self._env, cwd=REPO_ROOT)  # fmt: skip
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"siesta serve exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=HEALTH_TIMEOUT_S) as r:
                    if r.status == HTTP_OK:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(HEALTH_POLL_S)
        raise RuntimeError(f"siesta serve was not healthy within {STARTUP_TIMEOUT_S:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)  # what Ctrl-C does: the engine core stops with it
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def run_seed_client(url: str, requests: int, prompt_words: int) -> dict[str, Any]:
    """The seed's script as a user runs it; its JSON (``cleared``, ``kept``, ``verdict``)."""
    port = url.rsplit(":", 1)[1]
    with tempfile.TemporaryDirectory(prefix="siesta-seed-client-") as tmp:
        out = Path(tmp) / "seed.json"
        cmd = [sys.executable, str(SEED_CLIENT), "--host", HOST, "--port", port, "--requests", str(requests),
               "--prompt-tokens", str(prompt_words), "--out", str(out)]  # fmt: skip
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S, cwd=REPO_ROOT)
        if done.returncode != 0:
            raise RuntimeError(f"the seed client failed ({done.returncode}):\n{done.stderr[-LOG_TAIL_CHARS:]}")
        return json.loads(out.read_text())


def _seed_client():
    """The seed's script as a module (its prompts, bursts and scrapes)."""
    sys.path.insert(0, str(SEED_CLIENT.parent))
    try:
        import seed_client
    finally:
        sys.path.remove(str(SEED_CLIENT.parent))
    return seed_client


def seed_prompt_tokens(tokenizer_path: str, prompt_words: int) -> int:
    """Tokens of the seed client's first prompt under the served tokenizer, as the server counts them."""
    from siesta.model.hf_loader import load_tokenizer_from
    from siesta.tokenizer import encode

    return len(encode(load_tokenizer_from(tokenizer_path), _seed_client().make_prompt(0, prompt_words)))


def kept_replays(url: str, requests: int, prompt_words: int, replays: int) -> list[dict[str, Any]]:
    """After the seed's arms, its kept-tier sleep, wake-up and replay ``replays`` times more,
    through the seed's own burst and scrape, each replay's latencies and link rate kept.
    The tier still holds the prompts' KV (the seed's replay stored nothing new)."""
    seed = _seed_client()
    out = []
    for _ in range(replays):
        before = seed.scrape(url)
        seed.requests.post(f"{url}/sleep", params={"level": 1, "mode": "abort", "clear_connector_cache": "false"},
                           timeout=seed.TIMEOUT_S).raise_for_status()  # fmt: skip
        seed.requests.post(f"{url}/wake_up", timeout=seed.TIMEOUT_S).raise_for_status()
        latencies = seed.burst(url, requests, prompt_words)
        delta = counter_delta(before, seed.scrape(url))
        out.append({"replay_p50_s": seed.p50(latencies), "replay_latencies_s": sorted(round(x, 4) for x in latencies),
                    "load_bytes": delta.get(HOST_LOAD_BYTES, 0.0), "link_gbps": delta_link_gbps(delta)})  # fmt: skip
    return out


def measure(options: ServeOptions, requests: int, prompt_words: int, replays: int = 1) -> dict[str, Any]:
    """Start the server, run the seed client (then ``replays`` - 1 more kept replays), stop the
    server: the client's JSON, the replays and the timings."""
    with ServerProcess(options) as server:
        t0 = time.perf_counter()
        try:
            seed = run_seed_client(server.url, requests, prompt_words)
            client_s = time.perf_counter() - t0
            more = kept_replays(server.url, requests, prompt_words, replays - 1)
        except BaseException:
            print(server.log_tail(), file=sys.stderr)
            raise
    speedup = seed["cleared"]["replay_p50_s"] / seed["kept"]["replay_p50_s"]
    kept = seed["kept"]
    kept_p50s = [kept["replay_p50_s"]] + [r["replay_p50_s"] for r in more]
    return {"seed_client": seed, "speedup_p50": speedup, "server_startup_s": server.startup_s,
            "client_s": client_s, "command": options.command(server.port),
            "seed_kept_link_gbps": delta_link_gbps(kept["metric_delta"]),
            "kept_replays": more, "kept_replay_p50_median_s": median(kept_p50s)}  # fmt: skip
