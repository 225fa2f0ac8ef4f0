"""If the engine-core process dies, the server says so (requests fail with 503), then exits non-zero."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from e2e.servers import HTTP_TIMEOUT_S, SERVER_KV_CACHE_BYTES, StreamReader, start_server, stop_server, wait_for
from siesta.entrypoints.server.app import EXIT_ENGINE_DEAD

EXIT_BOUND_S = 30.0


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
    assert httpx.get(f"{server.url}/health", timeout=HTTP_TIMEOUT_S).status_code == 200
    reader = StreamReader(server, {"prompt": [1, 2, 3], "max_tokens": None, "ignore_eos": True})  # to the context's end
    reader.start()
    wait_for(lambda: reader.chunks, what="the first token")

    os.kill(_engine_core_pid(server.process.pid), signal.SIGKILL)
    reader.finish()  # the stream ended with an error event, not a hang
    assert reader.chunks[-1]["error"]["code"] == 503
    assert "engine core" in reader.chunks[-1]["error"]["message"]
    try:  # until it exits, the server answers 503 naming the exit
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 503 and "engine core" in r.json()["error"]["message"]
    except httpx.TransportError:
        pass  # already gone
    # Then it exits, non-zero, saying why: a supervisor restarts it (vLLM's behaviour).
    assert server.process.wait(EXIT_BOUND_S) == EXIT_ENGINE_DEAD
    assert "the engine core died" in server.log() and "exits" in server.log()
