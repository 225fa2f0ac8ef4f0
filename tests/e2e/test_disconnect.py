"""A client that goes away aborts its request and frees its blocks, streaming or not."""

from __future__ import annotations

import time

import httpx
import pytest

from e2e.servers import wait_for

ABORTED = 'siesta_request_success_total{finished_reason="abort"}'
LONG = {"prompt": "Tell me a very long story about the sea.", "max_tokens": 400, "ignore_eos": True}
CLIENT_GIVES_UP_S = 1.5


def _aborts(server) -> float:
    return server.metrics().get(ABORTED, 0.0)


def _blocks_freed(server) -> bool:
    m = server.metrics()
    return m["siesta_num_requests_running"] == 0 and m["siesta_kv_cache_usage_perc"] == 0


def _read_some_then_hang_up(server, chunks: int) -> None:
    with httpx.stream("POST", f"{server.url}/v1/completions", json=LONG | {"stream": True}, timeout=60) as response:
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data: ")
            if seen >= chunks:
                break  # leaving the block closes the connection mid-stream


def test_streaming_client_disconnect_aborts_and_frees_blocks(dev_server):
    before = _aborts(dev_server)
    _read_some_then_hang_up(dev_server, chunks=3)
    wait_for(lambda: _aborts(dev_server) == before + 1, what="the abort")
    wait_for(lambda: _blocks_freed(dev_server), what="running 0 and KV usage 0")


def test_non_streaming_client_disconnect_aborts_and_frees_blocks(dev_server):
    before = _aborts(dev_server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{dev_server.url}/v1/completions", json=LONG, timeout=CLIENT_GIVES_UP_S)
    wait_for(lambda: _aborts(dev_server) == before + 1, what="the abort")
    wait_for(lambda: _blocks_freed(dev_server), what="running 0 and KV usage 0")


def test_disconnect_while_frozen_aborts_too(dev_server):
    with dev_server.client() as client:
        before = _aborts(dev_server)
        with httpx.stream("POST", f"{dev_server.url}/v1/completions", json=LONG | {"stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            client.pause(mode="keep")
        try:
            wait_for(lambda: _aborts(dev_server) == before + 1, what="the abort while paused")
        finally:
            client.resume()
        wait_for(lambda: _blocks_freed(dev_server), what="running 0 and KV usage 0")
        time.sleep(0.2)
        assert client.completions("Hi", max_tokens=1)["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_waiting_request_left_by_its_client_is_aborted_on_either_route(dev_server, route):
    """A request held by a pause writes nothing and, not streamed, has no streaming response
    to see the client go: only the route's disconnect watcher aborts it."""
    body = LONG
    if route.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": LONG["prompt"]}], "max_tokens": 400, "ignore_eos": True}
    with dev_server.client() as client:
        before = _aborts(dev_server)
        client.pause(mode="keep")
        try:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{dev_server.url}{route}", json=body, timeout=CLIENT_GIVES_UP_S)
            wait_for(lambda: _aborts(dev_server) == before + 1, what="the abort while paused")
        finally:
            client.resume()
        wait_for(lambda: _blocks_freed(dev_server), what="running 0 and KV usage 0")
