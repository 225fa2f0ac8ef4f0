"""SiestaClient / AsyncSiestaClient: what goes on the wire, and how errors come back."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from siesta.client import AsyncSiestaClient, SiestaAPIError, SiestaClient, parse_metrics


class Recorder:
    """A fake server: records each request, answers with a canned response."""

    def __init__(self, status: int = 200, payload=None, text: str | None = None) -> None:
        self.requests: list[httpx.Request] = []
        self.status, self.payload, self.text = status, payload, text

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.text is not None:
            return httpx.Response(self.status, text=self.text)
        if self.payload is None:
            return httpx.Response(self.status)
        return httpx.Response(self.status, json=self.payload)

    @property
    def params(self) -> list[tuple[str, str]]:
        return list(self.requests[-1].url.params.multi_items())


def _client(recorder: Recorder, **kwargs) -> SiestaClient:
    return SiestaClient("http://siesta", transport=httpx.MockTransport(recorder), **kwargs)


def test_sleep_sends_clear_connector_cache_only_when_false():
    rec = Recorder()
    client = _client(rec)
    client.sleep()
    assert rec.requests[-1].method == "POST" and rec.requests[-1].url.path == "/sleep"
    assert rec.params == []  # every argument at its default: nothing an older server could trip on
    client.sleep(clear_connector_cache=False)
    assert rec.params == [("clear_connector_cache", "false")]
    client.sleep(level=2, mode="wait", clear_connector_cache=True)
    assert rec.params == [("level", "2"), ("mode", "wait")]


def test_pause_and_other_control_calls():
    rec = Recorder()
    client = _client(rec)
    client.pause()
    assert rec.params == []
    client.pause(mode="keep", clear_cache=False, clear_connector_cache=False)
    assert rec.params == [("mode", "keep"), ("clear_cache", "false"), ("clear_connector_cache", "false")]
    client.wake_up(tags=["weights", "kv_cache"])
    assert rec.requests[-1].url.path == "/wake_up" and rec.params == [("tags", "weights"), ("tags", "kv_cache")]
    client.wake_up()
    assert rec.params == []
    client.reset_prefix_cache(reset_running_requests=True, reset_external=True)
    assert rec.params == [("reset_running_requests", "true"), ("reset_external", "true")]
    client.resume()
    assert rec.requests[-1].url.path == "/resume"
    client.abort_requests(["cmpl-1"])
    assert json.loads(rec.requests[-1].content) == {"request_ids": ["cmpl-1"]}


def test_query_results_are_unwrapped():
    assert _client(Recorder(payload={"is_sleeping": True})).is_sleeping() is True
    assert _client(Recorder(payload={"is_paused": False})).is_paused() is False
    rec = Recorder(payload={"weight_version": "3"})
    assert _client(rec).update_weights("/models/new", weight_version="3") == "3"
    assert json.loads(rec.requests[-1].content) == {"model_path": "/models/new", "weight_version": "3"}
    _client(rec).update_weights("/models/new")
    assert json.loads(rec.requests[-1].content) == {"model_path": "/models/new"}


def test_errors_carry_the_servers_message():
    error = {"error": {"message": "FakeConnector cannot keep its cache", "type": "BadRequestError",
                       "param": None, "code": 400}}  # fmt: skip
    with pytest.raises(SiestaAPIError) as err:
        _client(Recorder(400, error)).sleep(clear_connector_cache=False)
    assert err.value.status_code == 400 and err.value.message == "FakeConnector cannot keep its cache"
    assert "FakeConnector" in str(err.value) and err.value.type == "BadRequestError"
    with pytest.raises(SiestaAPIError) as err:
        _client(Recorder(502, text="bad gateway")).resume()
    assert err.value.status_code == 502 and err.value.message == "bad gateway"


def test_api_key_is_sent_as_bearer():
    rec = Recorder(payload={"version": "1"})
    _client(rec, api_key="k").version()
    assert rec.requests[-1].headers["authorization"] == "Bearer k"


def test_generation_bodies():
    rec = Recorder(payload={"choices": []})
    client = _client(rec)
    client.completions([1, 2], max_tokens=3, ignore_eos=True)
    assert json.loads(rec.requests[-1].content) == {"prompt": [1, 2], "max_tokens": 3, "ignore_eos": True}
    client.chat([{"role": "user", "content": "hi"}], model="m")
    body = json.loads(rec.requests[-1].content)
    assert body["model"] == "m" and body["messages"][0]["content"] == "hi"


SSE = 'data: {"choices":[{"index":0,"text":"a"}]}\n\ndata: {"choices":[{"index":0,"text":"b"}]}\n\ndata: [DONE]\n\n'


def test_streams_parse_server_sent_events():
    rec = Recorder(text=SSE)
    chunks = list(_client(rec).stream_completions("x", max_tokens=2))
    assert [c["choices"][0]["text"] for c in chunks] == ["a", "b"]
    assert json.loads(rec.requests[-1].content)["stream"] is True
    failing = 'data: {"error":{"message":"engine died","type":"ServiceUnavailableError","code":503}}\n\n'
    with pytest.raises(SiestaAPIError) as err:
        list(_client(Recorder(text=failing)).stream_completions("x"))
    assert err.value.status_code == 503 and err.value.message == "engine died"


def test_async_client_mirrors_the_sync_one():
    rec = Recorder(payload={"is_paused": True})

    async def scenario():
        async with AsyncSiestaClient("http://siesta", transport=httpx.MockTransport(rec)) as client:
            await client.sleep(clear_connector_cache=False)
            params = rec.params
            paused = await client.is_paused()
            return params, paused

    assert asyncio.run(scenario()) == ([("clear_connector_cache", "false")], True)


def test_async_stream():
    async def scenario():
        transport = httpx.MockTransport(Recorder(text=SSE))
        async with AsyncSiestaClient("http://siesta", transport=transport) as client:
            return [c async for c in client.stream_chat([{"role": "user", "content": "x"}])]

    assert len(asyncio.run(scenario())) == 2


def test_parse_metrics():
    text = (
        "# HELP siesta_x_total x\n# TYPE siesta_x_total counter\n"
        'siesta_x_total{tier="host"} 3.0\nsiesta_x_created{tier="host"} 1.7e9\n'
        "# HELP siesta_g g\n# TYPE siesta_g gauge\nsiesta_g 0.5\n"
    )
    assert parse_metrics(text) == {'siesta_x_total{tier="host"}': 3.0, "siesta_g": 0.5}
