"""Dev-mode control routes over HTTP: round trips, wait/keep semantics, typed booleans."""

from __future__ import annotations

import time

import httpx
import pytest

from e2e.servers import HTTP_TIMEOUT_S, StreamReader, offline_greedy, wait_for
from siesta.client import SiestaAPIError

PROMPT = "Once upon a time, in a quiet village,"
FROZEN_CHECK_S = 1.5  # a frozen stream must stay silent this long
IN_FLIGHT_GRACE_S = 0.3  # chunks already on their way when the pause replied
ACCEPTED_BOOLS = ("true", "false", "True", "False", "1", "0")


@pytest.fixture
def client(dev_server):
    with dev_server.client() as c:
        yield c
        # Leave the shared server awake and resumed for the next test.
        if c.is_sleeping():
            c.wake_up()
        if c.is_paused():
            c.resume()


def _stream(server, max_tokens: int, **extra) -> StreamReader:
    reader = StreamReader(server, {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0} | extra)
    reader.start()
    return reader


def test_sleep_wake_pause_resume_round_trips(client):
    assert client.is_sleeping() is False and client.is_paused() is False
    client.sleep()
    assert client.is_sleeping() is True
    client.wake_up()
    assert client.is_sleeping() is False
    client.pause(mode="keep")
    assert client.is_paused() is True
    client.resume()
    assert client.is_paused() is False


def test_staged_wake_up_then_generation_still_matches(client, dev_server, offline_llm):
    client.sleep(level=1, clear_connector_cache=False)
    client.wake_up(tags=["weights"])
    assert client.is_sleeping() is True  # the KV cache is still released
    client.wake_up(tags=["kv_cache"])
    assert client.is_sleeping() is False
    out = client.completions(PROMPT, max_tokens=8, temperature=0.0)
    assert out["choices"][0]["text"] == offline_greedy(offline_llm, PROMPT, 8)


def test_control_calls_at_the_wrong_time_are_409(client):
    client.sleep(level=0)
    with pytest.raises(SiestaAPIError) as err:
        client.resume()
    assert err.value.status_code == 409 and "wake_up" in err.value.message
    client.wake_up()
    client.pause(mode="keep")
    client.pause(mode="keep")  # a second pause is never a 409: it is a no-op, or moves to a stronger mode
    client.pause(mode="abort")
    assert client.is_paused() is True
    client.resume()


@pytest.mark.parametrize("value", ACCEPTED_BOOLS)
def test_typed_booleans_accept_exactly_six_spellings(client, dev_server, value):
    r = httpx.post(f"{dev_server.url}/sleep", params={"level": 0, "clear_connector_cache": value}, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200, r.text
    client.wake_up()


@pytest.mark.parametrize(
    ("route", "param"),
    [("/sleep", "clear_connector_cache"), ("/pause", "clear_cache"), ("/pause", "clear_connector_cache"),
     ("/reset_prefix_cache", "reset_running_requests"), ("/reset_prefix_cache", "reset_external")],
)  # fmt: skip
@pytest.mark.parametrize("value", ["yes", "no", "on", "2", "", "FALSE"])
def test_bad_booleans_are_422_naming_the_parameter(client, dev_server, route, param, value):
    r = httpx.post(f"{dev_server.url}{route}", params={param: value}, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 422
    error = r.json()["error"]
    assert error["param"] == param
    assert param in error["message"] and "true, false, True, False, 1, 0" in error["message"]
    assert client.is_paused() is False and client.is_sleeping() is False  # nothing happened


def test_bad_level_mode_and_tags_are_422(dev_server):
    for route, params in [("/sleep", {"level": 3}), ("/sleep", {"mode": "later"}), ("/pause", {"mode": "x"}),
                          ("/wake_up", {"tags": "gpu"})]:  # fmt: skip
        r = httpx.post(f"{dev_server.url}{route}", params=params, timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 422, (route, params, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_pause_wait_replies_only_after_in_flight_requests_finish(client, dev_server):
    before = dev_server.metrics()
    reader = _stream(dev_server, 24, ignore_eos=True)
    wait_for(lambda: reader.chunks, what="the first token")
    client.pause(mode="wait")
    after = dev_server.metrics()
    # By the time the reply came, the request had run to its length and nothing was running.
    key = 'siesta_request_success_total{finished_reason="length"}'
    assert after.get(key, 0) - before.get(key, 0) == 1
    assert after["siesta_num_requests_running"] == 0
    assert client.is_paused() is True
    reader.finish()
    assert reader.finish_reason == "length"
    client.resume()


def test_sleep_wait_waits_too(client, dev_server):
    reader = _stream(dev_server, 16, ignore_eos=True)
    wait_for(lambda: reader.chunks, what="the first token")
    client.sleep(level=1, mode="wait")
    assert reader.chunks and dev_server.metrics()["siesta_num_requests_running"] == 0
    reader.finish()
    assert reader.finish_reason == "length"
    client.wake_up()


@pytest.mark.parametrize("how", ["pause", "sleep"])
def test_keep_freezes_a_stream_that_then_continues_exactly(client, dev_server, offline_llm, how):
    max_tokens = 24
    reader = _stream(dev_server, max_tokens, ignore_eos=True)
    wait_for(lambda: len(reader.chunks) >= 3, what="three tokens")
    if how == "pause":
        client.pause(mode="keep")
    else:
        client.sleep(level=1, mode="keep", clear_connector_cache=False)
    time.sleep(IN_FLIGHT_GRACE_S)
    frozen_at = len(reader.chunks)
    time.sleep(FROZEN_CHECK_S)
    assert len(reader.chunks) == frozen_at, "tokens arrived while paused"
    assert reader.is_alive()
    client.resume() if how == "pause" else client.wake_up()
    reader.finish()
    assert reader.finish_reason == "length"
    assert reader.text == offline_greedy(offline_llm, PROMPT, max_tokens)


def test_pause_abort_ends_in_flight_requests(client, dev_server):
    reader = _stream(dev_server, 200, ignore_eos=True)
    wait_for(lambda: reader.chunks, what="the first token")
    client.pause()  # mode=abort
    reader.finish()
    assert reader.finish_reason == "abort"
    client.resume()


def test_requests_sent_while_paused_run_after_resume(client, dev_server):
    client.pause(mode="keep")
    reader = _stream(dev_server, 4)
    time.sleep(FROZEN_CHECK_S)
    assert reader.chunks == [] and reader.is_alive()
    client.resume()
    reader.finish()
    assert reader.finish_reason in ("length", "stop")


def test_abort_requests_by_response_id(client, dev_server):
    reader = StreamReader(dev_server, {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True},
                          headers={"X-Request-Id": "e2e-abort-me"})  # fmt: skip
    reader.start()
    wait_for(lambda: reader.chunks, what="the first token")
    assert reader.chunks[0]["id"] == "e2e-abort-me"
    client.abort_requests(["e2e-abort-me"])
    reader.finish()
    assert reader.finish_reason == "abort"


def test_reset_prefix_cache(client):
    prompt = "Cache me if you can, a sentence long enough to fill a block. " * 4
    client.completions(prompt, max_tokens=1)
    assert client.completions(prompt, max_tokens=1)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    client.reset_prefix_cache(reset_running_requests=True)
    assert client.completions(prompt, max_tokens=1)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_update_weights_from_a_path(client, offline_llm):
    from siesta.model.loader import default_model_path

    assert client.update_weights(default_model_path(), weight_version="7") == "7"
    assert client.weight_version() == "7"
    client.finish_weight_update()
    out = client.completions(PROMPT, max_tokens=6, temperature=0.0)
    assert out["choices"][0]["text"] == offline_greedy(offline_llm, PROMPT, 6)  # same weights, same text
    with pytest.raises(SiestaAPIError) as err:
        client.update_weights("/nonexistent/model.gguf")
    assert err.value.status_code == 400 and "is not a model siesta can load" in err.value.message  # nor says why
