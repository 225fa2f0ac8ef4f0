"""What one request may cost a served siesta: fan-out, queue, body and prompt sizes are
bounded, refused by name before the cost is paid, and other clients are served meanwhile."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from e2e.servers import HTTP_TIMEOUT_S, start_server, stop_server, wait_for

FANOUT = 64
WAITING = 16
BODY_BYTES = 1 << 20
CHUNK = 64 << 10


@pytest.fixture(scope="module")
def server():
    server = start_server("random:tiny-llama", "--dev-mode", "--kv-cache-bytes", str(32 << 20),
                          "--max-request-fanout", str(FANOUT), "--max-waiting-requests", str(WAITING),
                          "--max-request-body-bytes", str(BODY_BYTES), "--max-num-seqs", "4")  # fmt: skip
    yield server
    stop_server(server)


def post(server, body, **kw):
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60, **kw)


def gauges(server) -> tuple[float, float]:
    m = server.metrics()
    return m["siesta_num_requests_running"], m["siesta_num_requests_waiting"]


def test_a_fan_out_past_the_cap_is_refused_by_name(server):
    r = post(server, {"prompt": [[1, 2]] * 1024, "n": 128, "max_tokens": 1})
    assert r.status_code == 400
    assert "131072 engine requests; at most 64" in r.json()["error"]["message"]
    assert "--max-request-fanout" in r.json()["error"]["message"]
    assert gauges(server) == (0, 0)  # nothing was queued
    assert post(server, {"prompt": [1, 2], "max_tokens": 2}).status_code == 200


def test_a_full_queue_answers_429_with_retry_after_and_serves_on(server):
    # Held by a pause, n choices fill the queue; one more request does not fit.
    httpx.post(f"{server.url}/pause", params={"mode": "keep"}, timeout=30).raise_for_status()
    try:
        box = {}
        held = threading.Thread(
            target=lambda: box.update(r=post(server, {"prompt": [3, 4], "n": WAITING, "max_tokens": 2}))
        )
        held.start()
        wait_for(lambda: gauges(server)[1] == WAITING or "r" in box, what="the choices to wait")
        r = post(server, {"prompt": [5, 6], "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert "at most 16 may wait" in r.json()["error"]["message"]
    finally:
        httpx.post(f"{server.url}/resume", timeout=30).raise_for_status()
    held.join(60)
    assert box["r"].status_code == 200 and len(box["r"].json()["choices"]) == WAITING
    assert post(server, {"prompt": [5, 6], "max_tokens": 2}).status_code == 200


def test_all_choices_are_queued_at_once_and_a_disconnect_frees_them(server):
    body = {"prompt": [7, 8, 9], "n": FANOUT // 4, "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):  # the first token: every choice is in the engine already
                running, waiting = gauges(server)
                assert (running, waiting) == (4, FANOUT // 4 - 4)  # max_num_seqs run, the rest wait
                break  # leaving the stream closes it: a disconnect
    wait_for(lambda: gauges(server) == (0, 0), what="the disconnect to free every choice")
    assert server.metrics()["siesta_kv_cache_usage_perc"] == 0


def _slow_body(total: int, progress: list[int]):
    sent = 0
    head = b'{"prompt": "'
    yield head
    while sent < total:
        yield b"x" * CHUNK
        sent += CHUNK
        progress.append(sent)
        time.sleep(0.01)
    yield b'", "max_tokens": 1}'


def test_a_body_past_the_limit_is_refused_while_others_are_served(server):
    # Declared: refused from the header, before a byte of it is read.
    r = httpx.post(f"{server.url}/v1/completions", content=b"x" * (BODY_BYTES + 1),
                   headers={"content-type": "application/json"}, timeout=60)  # fmt: skip
    assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["error"]["message"]
    # Streamed with no length: refused once past the limit; meanwhile the server answers others.
    progress: list[int] = []
    box = {}

    def upload() -> None:
        try:
            box["r"] = httpx.post(f"{server.url}/v1/completions", content=_slow_body(4 * BODY_BYTES, progress),
                                  headers={"content-type": "application/json"}, timeout=60)  # fmt: skip
        except httpx.HTTPError as e:  # the server may close the connection once it has answered
            box["error"] = e

    thread = threading.Thread(target=upload)
    thread.start()
    wait_for(lambda: progress, what="the upload to start")
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert post(server, {"prompt": [1, 2], "max_tokens": 2}).status_code == 200
    thread.join(60)
    assert "error" in box or box["r"].status_code == 413
    assert post(server, {"prompt": [1, 2], "max_tokens": 2}).status_code == 200


def test_a_token_list_too_long_is_refused_before_the_engine(server):
    r = post(server, {"prompt": list(range(1, 60000)), "max_tokens": 1})
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]


def test_a_text_too_long_to_fit_is_refused_untokenized(dev_server):
    """The embedded model's tokenizer: a 10 MB text (under the default body limit) cannot fit."""
    t0 = time.monotonic()
    r = httpx.post(f"{dev_server.url}/v1/completions", json={"prompt": "sea " * 2_500_000, "max_tokens": 1},
                   timeout=60)  # fmt: skip
    assert r.status_code == 400 and "characters, so at least" in r.json()["error"]["message"]
    assert httpx.get(f"{dev_server.url}/health", timeout=HTTP_TIMEOUT_S).status_code == 200
    assert time.monotonic() - t0 < 30  # never tokenized: 2.5M tokens would take far longer on the CPU


def test_max_tokens_past_the_context_is_a_400_as_in_vllm(dev_server):
    """Not a silent cut: an 8,190-token prompt with max_tokens 100 once returned 2 tokens."""
    prompt = [5] * 1000  # the dev server's max_model_len is 1024
    r = httpx.post(f"{dev_server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 100}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "maximum context length is 1024 tokens" in r.json()["error"]["message"]
    assert "1100 tokens (1000 in the prompt, 100 in the completion)" in r.json()["error"]["message"]
    ok = httpx.post(f"{dev_server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 24}, timeout=60)
    assert ok.status_code == 200
