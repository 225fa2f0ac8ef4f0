"""If the engine-core process dies, the server says so: /health is 503, requests fail clearly."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from e2e.servers import SERVER_KV_CACHE_BYTES, StreamReader, start_server, stop_server, wait_for


@pytest.fixture(scope="module")
def server():
    server = start_server("random:tiny-llama", "--dev-mode", "--kv-cache-bytes", str(SERVER_KV_CACHE_BYTES))
    yield server
    stop_server(server)


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


def _engine_core_pid(server_pid: int) -> int:
    for child in _children(server_pid):
        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():  # not the resource tracker
            return child
    raise AssertionError("no engine-core child process")


def test_core_death_is_reported_and_fails_requests(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    reader = StreamReader(server, {"prompt": [1, 2, 3], "max_tokens": 100000, "ignore_eos": True})
    reader.start()
    wait_for(lambda: reader.chunks, what="the first token")

    os.kill(_engine_core_pid(server.process.pid), signal.SIGKILL)
    wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 503, what="/health to turn 503")

    health = httpx.get(f"{server.url}/health").json()["error"]
    assert "engine core" in health["message"] and "exit" in health["message"]
    reader.finish()  # the stream ended with an error event, not a hang
    assert reader.chunks[-1]["error"]["code"] == 503
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
    assert r.status_code == 503 and "engine core" in r.json()["error"]["message"]
    r = httpx.get(f"{server.url}/is_paused")
    assert r.status_code == 503
    assert server.process.poll() is None  # the API server itself is still up
