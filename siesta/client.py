"""Python client for a siesta server: generation and every control route, sync and async.

Control methods are ``siesta.control.EngineControl``'s verbs, with its names and defaults
(``sleep(level=1, mode="abort", clear_connector_cache=True)``, ...), on its routes
(``HTTP_ROUTES``); ``tests/test_control_surface.py`` holds them to it. An optional argument is
sent only when it differs from its default, so a newer client still drives an older server:
``sleep()`` sends no ``clear_connector_cache`` at all, ``sleep(clear_connector_cache=False)``
sends ``false``.

Generation methods speak the OpenAI API, so they also work against vLLM or any compatible
server. Every 4xx/5xx raises ``SiestaAPIError`` carrying the server's message.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Self

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from siesta.control import HTTP_ROUTES, init_info_of

DEFAULT_URL = "http://127.0.0.1:8000"
# Control calls may wait for in-flight requests (mode=wait) or a weight load.
DEFAULT_TIMEOUT_S = 600.0
_SSE_PREFIX = "data:"
_SSE_DONE = "[DONE]"
_FIRST_ERROR_STATUS = 400
_CREATED_SUFFIX = "_created"  # prometheus_client's per-series timestamps: not measurements


class SiestaAPIError(Exception):
    """The server refused or failed a call; ``message`` is the server's own."""

    def __init__(self, status_code: int, message: str, type: str | None = None, param: str | None = None) -> None:
        super().__init__(f"{status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param


@dataclass(frozen=True)
class HTTPCall:
    """One route call, built once and run by either client."""

    method: str
    path: str
    params: list[tuple[str, str]] = field(default_factory=list)
    body: Any = None
    extract: Callable[[Any], Any] = lambda payload: payload


def _wire(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _query(**values: tuple[Any, Any]) -> list[tuple[str, str]]:
    """name=(value, default): sent only when value differs from default; lists repeat the name."""
    out: list[tuple[str, str]] = []
    for name, (value, default) in values.items():
        if value == default:
            continue
        items = value if isinstance(value, (list, tuple)) else [value]
        out.extend((name, _wire(v)) for v in items)
    return out


def _key(name: str) -> Callable[[Any], Any]:
    return lambda payload: payload[name]


def _verb(verb: str, params: list[tuple[str, str]] | None = None, body: Any = None,
          extract: Callable[[Any], Any] | None = None) -> HTTPCall:  # fmt: skip
    """The call of one control verb, on its route."""
    method, path = HTTP_ROUTES[verb]
    return HTTPCall(method, path, params or [], body, extract or (lambda payload: payload))


# -- the calls (shared by both clients) ------------------------------------------------------


class _Routes:
    """Every method returns what ``_run`` returns: a value (sync) or an awaitable (async)."""

    def _run(self, call: HTTPCall) -> Any:
        raise NotImplementedError

    def sleep(
        self, level: int = 1, mode: str = "abort", clear_connector_cache: bool = True, tags: list[str] | None = None
    ) -> Any:
        """Pause and hand device memory back; ``clear_connector_cache=False`` keeps the KV tier,
        ``tags=["kv_cache"]`` the weights on the device."""
        params = _query(level=(level, 1), mode=(mode, "abort"), clear_connector_cache=(clear_connector_cache, True),
                        tags=(tags, None))  # fmt: skip
        return self._run(_verb("sleep", params))

    def wake_up(self, tags: list[str] | None = None) -> Any:
        """Restore ``weights`` and/or ``kv_cache`` (default both)."""
        return self._run(_verb("wake_up", _query(tags=(tags, None))))

    def is_sleeping(self) -> Any:
        return self._run(_verb("is_sleeping", extract=_key("is_sleeping")))

    def pause(self, mode: str = "abort", clear_cache: bool = True, clear_connector_cache: bool = True) -> Any:
        params = _query(
            mode=(mode, "abort"), clear_cache=(clear_cache, True), clear_connector_cache=(clear_connector_cache, True)
        )
        return self._run(_verb("pause", params))

    def resume(self) -> Any:
        return self._run(_verb("resume"))

    def is_paused(self) -> Any:
        return self._run(_verb("is_paused", extract=_key("is_paused")))

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_external: bool = False) -> Any:
        """``reset_external`` is the route's name (vLLM's) for the engine's ``reset_connector``: the KV tiers."""
        params = _query(reset_running_requests=(reset_running_requests, False), reset_external=(reset_external, False))
        return self._run(_verb("reset_prefix_cache", params))

    def update_weights(self, weights: str | dict[str, Any], weight_version: str | None = None) -> Any:
        """A model path on the server's host (loaded, version advanced), or a weight-transfer
        call: ``{"update_info": {...}}`` (vLLM's shape; the bytes travel through the backend).
        Returns the weight version."""
        if isinstance(weights, dict):
            body: dict[str, Any] = weights if set(weights) == {"update_info"} else {"update_info": weights}
        else:
            body = {"model_path": weights}
        if weight_version is not None:
            body = body | {"weight_version": weight_version}
        return self._run(_verb("update_weights", body=body, extract=_key("weight_version")))

    def init_weight_transfer_engine(self, request: dict[str, Any]) -> Any:
        """``{"init_info": {...}}`` (or the bare init info); nccl: blocks until the trainer joins."""
        return self._run(_verb("init_weight_transfer_engine", body={"init_info": init_info_of(request)}))

    def start_weight_update(self, is_checkpoint_format: bool = True) -> Any:
        return self._run(_verb("start_weight_update", body={"is_checkpoint_format": is_checkpoint_format}))

    def finish_weight_update(self, weight_version: str | None = None) -> Any:
        """Publish the update's version (the next one unless named); returns it."""
        body = {} if weight_version is None else {"weight_version": weight_version}
        return self._run(_verb("finish_weight_update", body=body, extract=_key("weight_version")))

    def get_world_size(self) -> Any:
        return self._run(_verb("get_world_size", extract=_key("world_size")))

    def get_weight_version(self) -> Any:
        return self._run(_verb("get_weight_version", extract=_key("weight_version")))

    def weight_version(self) -> Any:
        """``get_weight_version`` (the name this client had first)."""
        return self.get_weight_version()

    def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> Any:
        """Rename the weights (SGLang's route); returns the new version."""
        body: dict[str, Any] = {"new_version": new_version}
        if not abort_all_requests:
            body["abort_all_requests"] = False
        return self._run(_verb("update_weight_version", body=body, extract=_key("new_version")))

    def abort_requests(self, request_ids: list[str]) -> Any:
        """Abort requests by the ``id`` of their responses."""
        return self._run(_verb("abort_requests", body={"request_ids": list(request_ids)}))

    def models(self) -> Any:
        return self._run(HTTPCall("GET", "/v1/models", extract=lambda p: [m["id"] for m in p["data"]]))

    def version(self) -> Any:
        return self._run(HTTPCall("GET", "/version", extract=_key("version")))

    def metrics(self) -> Any:
        """Every sample of /metrics: ``name{label="v",...}`` -> value."""
        return self._run(HTTPCall("GET", "/metrics", extract=parse_metrics))

    def completions(self, prompt: Any, model: str | None = None, **params: Any) -> Any:
        """POST /v1/completions (not streamed); ``params`` are body fields (max_tokens, ...)."""
        return self._run(HTTPCall("POST", "/v1/completions", body=_body(params, model, prompt=prompt)))

    def chat(self, messages: list[dict[str, Any]], model: str | None = None, **params: Any) -> Any:
        return self._run(HTTPCall("POST", "/v1/chat/completions", body=_body(params, model, messages=messages)))


def _body(params: dict[str, Any], model: str | None, **fields: Any) -> dict[str, Any]:
    body = dict(params) | fields
    if model is not None:
        body["model"] = model
    return body


def _stream_body(params: dict[str, Any], model: str | None, **fields: Any) -> dict[str, Any]:
    return _body(params, model, **fields) | {"stream": True}


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(_CREATED_SUFFIX):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return out


def _payload(response: httpx.Response) -> Any:
    if response.status_code >= _FIRST_ERROR_STATUS:
        raise _api_error(response.status_code, response.text)
    if not response.content:
        return None
    if response.headers.get("content-type", "").startswith("application/json"):
        return response.json()
    return response.text


def _api_error(status: int, text: str) -> SiestaAPIError:
    try:
        error = json.loads(text)["error"]
        return SiestaAPIError(status, str(error["message"]), error.get("type"), error.get("param"))
    except (ValueError, KeyError, TypeError):
        return SiestaAPIError(status, text or f"HTTP {status}")


def _sse_event(line: str) -> dict[str, Any] | None:
    """A chunk, or None for lines that are not data and for the end marker."""
    if not line.startswith(_SSE_PREFIX):
        return None
    data = line[len(_SSE_PREFIX) :].strip()
    if data == _SSE_DONE:
        return None
    event = json.loads(data)
    if "error" in event:
        error = event["error"]
        raise SiestaAPIError(int(error.get("code") or 500), str(error.get("message")), error.get("type"))
    return event


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _json_content(body: Any) -> dict[str, Any]:
    """A call's JSON body as request arguments. Encoded by msgspec: a MoE push declares ~19k
    tensors in ~7 MB of JSON, which httpx's ``json.dumps`` wrote in 25 ms here, msgspec in 3."""
    if body is None:
        return {}
    return {"content": msgspec.json.encode(body), "headers": {"Content-Type": "application/json"}}


# -- the clients -----------------------------------------------------------------------------


class SiestaClient(_Routes):
    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.http = httpx.Client(base_url=base_url, headers=_headers(api_key), timeout=timeout, transport=transport)

    def _run(self, call: HTTPCall) -> Any:
        response = self.http.request(call.method, call.path, params=call.params, **_json_content(call.body))
        return call.extract(_payload(response))

    def health(self) -> bool:
        return self.http.get("/health").status_code < _FIRST_ERROR_STATUS

    def stream_completions(self, prompt: Any, model: str | None = None, **params: Any) -> Iterator[dict[str, Any]]:
        return self._stream("/v1/completions", _stream_body(params, model, prompt=prompt))

    def stream_chat(
        self, messages: list[dict[str, Any]], model: str | None = None, **params: Any
    ) -> Iterator[dict[str, Any]]:
        return self._stream("/v1/chat/completions", _stream_body(params, model, messages=messages))

    def _stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        with self.http.stream("POST", path, json=body) as response:
            if response.status_code >= _FIRST_ERROR_STATUS:
                raise _api_error(response.status_code, response.read().decode(errors="replace"))
            for line in response.iter_lines():
                event = _sse_event(line)
                if event is not None:
                    yield event

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncSiestaClient(_Routes):
    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.http = httpx.AsyncClient(
            base_url=base_url, headers=_headers(api_key), timeout=timeout, transport=transport
        )

    async def _run(self, call: HTTPCall) -> Any:
        response = await self.http.request(call.method, call.path, params=call.params, **_json_content(call.body))
        return call.extract(_payload(response))

    async def health(self) -> bool:
        return (await self.http.get("/health")).status_code < _FIRST_ERROR_STATUS

    def stream_completions(self, prompt: Any, model: str | None = None, **params: Any) -> AsyncIterator[dict[str, Any]]:
        return self._stream("/v1/completions", _stream_body(params, model, prompt=prompt))

    def stream_chat(
        self, messages: list[dict[str, Any]], model: str | None = None, **params: Any
    ) -> AsyncIterator[dict[str, Any]]:
        return self._stream("/v1/chat/completions", _stream_body(params, model, messages=messages))

    async def _stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        async with self.http.stream("POST", path, json=body) as response:
            if response.status_code >= _FIRST_ERROR_STATUS:
                raise _api_error(response.status_code, (await response.aread()).decode(errors="replace"))
            async for line in response.aiter_lines():
                event = _sse_event(line)
                if event is not None:
                    yield event

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
