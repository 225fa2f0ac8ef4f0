"""Real servers on loopback: ``siesta serve`` in a subprocess on a free port, and helpers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from threads import single_thread

from siesta.client import SiestaClient

STARTUP_TIMEOUT_S = 180.0
POLL_S = 0.25
STOP_TIMEOUT_S = 20.0
STREAM_TIMEOUT_S = 120.0
# A plain call to a test server: a first completion on a loaded 2-core machine (the suite runs
# two workers) took over httpx's 5 s default.
HTTP_TIMEOUT_S = 60.0
# Where the servers' logs go: set per session to a pytest temp folder (pytest keeps the last few
# runs' and removes older ones); the system's temp folder when run outside pytest.
LOG_ROOT: Path | None = None
LOG_TAIL_CHARS = 4000
# Small, so the suite stays fast; generous enough for the longest prompt a test sends.
DEV_MAX_MODEL_LEN = 1024
# KV cache sizes: a full GiB per engine takes seconds to allocate and is never needed here.
SERVER_KV_CACHE_BYTES = 256 * 2**20
OFFLINE_KV_CACHE_BYTES = 64 * 2**20
# The servers share the machine with the test process: one torch thread each keeps them
# from descheduling each other's OpenMP workers (ten times slower on two busy cores).
SERVER_ENV = {"OMP_NUM_THREADS": "1"}
# The seed's connector, sized for CPU: 16-token chunks, a 1 GB host tier.
OFFLOAD_CONFIG = (
    '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",'
    '"kv_connector_extra_config":{"block_size":16,"cpu_bytes_to_use":1000000000}}'
)


@dataclass
class Server:
    url: str
    port: int
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]

    def client(self, **kwargs) -> SiestaClient:
        return SiestaClient(self.url, **kwargs)

    def metrics(self) -> dict[str, float]:
        with self.client() as c:
            return c.metrics()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*flags: str, env: dict[str, str] | None = None) -> Server:
    port = free_port()
    log_path = Path(tempfile.mkdtemp(prefix="siesta-e2e-", dir=LOG_ROOT)) / "server.log"
    cmd = [sys.executable, "-m", "siesta.entrypoints.cli", "serve", "--port", str(port), *flags]
    full_env = os.environ | SERVER_ENV | (env or {})
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    server = Server(f"http://127.0.0.1:{port}", port, process, log_path)
    _wait_healthy(server)
    return server


def _wait_healthy(server: Server) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"siesta serve exited with {server.process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(POLL_S)
    stop_server(server)
    pytest.fail(f"siesta serve was not healthy within {STARTUP_TIMEOUT_S:.0f}s:\n{server.log()}")


def stop_server(server: Server) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGINT)
        try:
            server.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()


def offline_greedy(llm, prompt, max_tokens: int) -> str:
    from siesta import SamplingParams

    with single_thread():
        out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
    return out[0].outputs[0].text


def offline_chat(llm, messages, max_tokens: int) -> str:
    from siesta import SamplingParams

    with single_thread():
        out = llm.chat(messages, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
    return out[0].outputs[0].text


class StreamReader(threading.Thread):
    """Reads one streamed completion in the background, keeping every chunk."""

    def __init__(self, server: Server, body: dict, headers: dict | None = None) -> None:
        super().__init__(daemon=True)
        self.server, self.body, self.headers = server, body | {"stream": True}, headers or {}
        self.chunks: list[dict] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.server.url}/v1/completions", json=self.body, headers=self.headers,
                              timeout=STREAM_TIMEOUT_S) as response:  # fmt: skip
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.chunks.append(json.loads(line[len("data: ") :]))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    @property
    def text(self) -> str:
        return "".join(c["choices"][0]["text"] for c in self.chunks if c.get("choices"))

    @property
    def finish_reason(self) -> str | None:
        reasons = [c["choices"][0]["finish_reason"] for c in self.chunks if c.get("choices")]
        return reasons[-1] if reasons else None

    def finish(self) -> None:
        self.join(STREAM_TIMEOUT_S)
        assert not self.is_alive(), "the stream did not end"
        assert self.error is None, self.error


def wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(POLL_S)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
