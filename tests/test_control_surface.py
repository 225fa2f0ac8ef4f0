"""Every copy of the control surface against its one declaration, ``siesta.control.EngineControl``.

Each implementation has every verb with the protocol's parameter names, order and defaults
(``inspect.signature``); it may add parameters of its own after them, each with a default. The
IPC client's verbs are coroutines; return types differ as ``siesta.control`` documents. The IPC
layer has one message a verb, whose fields are the verb's arguments and reach the engine under
their names; the dev routes expose every verb, the query routes with its arguments and defaults;
the HTTP and fleet clients call each verb on its route. The API server imports no engine.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import warnings
from typing import Any

import httpx
import msgspec
import pytest

from siesta import LLM
from siesta.client import AsyncSiestaClient, SiestaClient
from siesta.control import (
    CONTROL_VERBS,
    HTTP_NAMES,
    HTTP_ROUTES,
    QUERY_VERBS,
    WEIGHT_TRANSFER_VERBS,
    EngineControl,
    init_info_of,
)
from siesta.core.deferred import Deferred
from siesta.core.engine_core import EngineCore
from siesta.entrypoints.server.app import build_app
from siesta.entrypoints.server.state import ServerConfig
from siesta.fleet.client import FleetClient
from siesta.fleet.rl_plane import Outcome, Replica
from siesta.ipc.client import EngineCoreClient
from siesta.ipc.handler import CallHandler
from siesta.ipc.protocol import CONTROL_CALLS, CallCodec, EngineInfo, GetInfo
from siesta.weight_transfer.sender import WeightTransferClient

IMPLEMENTATIONS = [EngineCore, LLM, EngineCoreClient, SiestaClient, AsyncSiestaClient, FleetClient]
HTTP_CLIENTS = (SiestaClient, AsyncSiestaClient, FleetClient)
# The wire holds these arguments otherwise: a path or an update_info for update_weights' weights,
# the bare init info for init_weight_transfer_engine's request (siesta.control.init_info_of).
WIRE_FORMS = {
    "update_weights": {"weights": ("model_path", "update_info")},
    "init_weight_transfer_engine": {"request": ("init_info",)},
}
# Arguments each verb is tried with, none at its default.
SAMPLES: dict[str, Any] = {
    "mode": "keep", "clear_cache": False, "clear_connector_cache": False, "level": 2, "tags": ["kv_cache"],
    "reset_running_requests": True, "reset_connector": True, "request_ids": ["r1", "r2"],
    "is_checkpoint_format": False, "weight_version": "v7", "new_version": "v8", "abort_all_requests": False,
}  # fmt: skip


def _params(fn: Any) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def _declared(verb: str) -> list[inspect.Parameter]:
    return _params(getattr(EngineControl, verb))


def _http_name(verb: str, name: str) -> str:
    return HTTP_NAMES.get(verb, {}).get(name, name)


def test_the_protocol_declares_every_verb_once_with_vllms_defaults():
    assert set(WEIGHT_TRANSFER_VERBS) < set(CONTROL_VERBS) and len(set(CONTROL_VERBS)) == len(CONTROL_VERBS)
    assert set(HTTP_ROUTES) == set(CONTROL_VERBS)
    defaults = {p.name: p.default for verb in CONTROL_VERBS for p in _declared(verb) if p.default is not p.empty}
    assert defaults["clear_connector_cache"] is True  # invariant 5, on every path
    assert WeightTransferClient is not None and all(hasattr(WeightTransferClient, v) for v in WEIGHT_TRANSFER_VERBS)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("verb", CONTROL_VERBS)
def test_every_implementation_has_the_verb_with_its_names_and_defaults(impl, verb):
    method = getattr(impl, verb, None)
    assert callable(method), f"{impl.__name__} has no {verb}"
    got = _params(method)
    declared = _declared(verb)
    assert len(got) >= len(declared), f"{impl.__name__}.{verb}{inspect.signature(method)}"
    for want, have in zip(declared, got, strict=False):
        name = _http_name(verb, want.name) if impl in HTTP_CLIENTS else want.name
        assert (have.name, have.default) == (name, want.default), f"{impl.__name__}.{verb}{inspect.signature(method)}"
        assert have.kind in (have.POSITIONAL_OR_KEYWORD, want.kind)
    for extra in got[len(declared) :]:  # its own additions: never required
        assert extra.default is not extra.empty or extra.kind is extra.VAR_KEYWORD, f"{impl.__name__}.{verb}"
    if impl is EngineCoreClient:
        assert inspect.iscoroutinefunction(method)


def test_llms_keywords_are_the_engine_flags():
    from siesta.config import EngineFlags

    assert [p.name for p in _params(LLM)] == [f.name for f in EngineFlags.__dataclass_fields__.values()]


# -- the IPC layer ------------------------------------------------------------------------


class RecordingEngine:
    """Any engine method: records what it was called with under the verb the protocol names."""

    weight_version = "0"

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            if name.startswith("begin_"):
                return Deferred(lambda: True, lambda: None)
            return True

        return call


def _handled(message: Any) -> tuple[str, dict[str, Any]]:
    """What the handler asked of the engine for ``message``, as arguments of the protocol's verb."""
    engine = RecordingEngine()
    CallHandler(engine, lambda: EngineInfo("m", 64, 100, 16, 4)).handle(message)
    ((name, args, kwargs),) = engine.calls
    verb = {"begin_weight_transfer_engine": "init_weight_transfer_engine"}.get(name, name)
    if verb in WIRE_FORMS:
        return verb, {"args": args, **kwargs}
    bound = inspect.signature(getattr(EngineControl, verb)).bind(None, *args[: len(_declared(verb))])
    bound.apply_defaults()
    return verb, {k: v for k, v in bound.arguments.items() if k != "self"}


def test_one_message_a_verb_and_the_handler_serves_each():
    assert set(CONTROL_CALLS) == set(CONTROL_VERBS)
    assert len(set(CONTROL_CALLS.values())) == len(CONTROL_CALLS)
    table = CallHandler(RecordingEngine(), lambda: None)._table
    assert all(cls in table for cls in CONTROL_CALLS.values())


@pytest.mark.parametrize("verb", CONTROL_VERBS)
def test_each_message_holds_the_verbs_arguments_under_its_names_and_defaults(verb):
    fields = {f.name: f for f in msgspec.structs.fields(CONTROL_CALLS[verb])}
    for p in _declared(verb):
        for name in WIRE_FORMS.get(verb, {}).get(p.name, (p.name,)):
            assert name in fields, f"{CONTROL_CALLS[verb].__name__} has no {name}"
            if p.name not in WIRE_FORMS.get(verb, {}) and p.default is not p.empty:
                assert fields[name].default == p.default, f"{CONTROL_CALLS[verb].__name__}.{name}"


@pytest.mark.parametrize("verb", [v for v in CONTROL_VERBS if v not in WIRE_FORMS and v != "get_weight_version"])
def test_each_message_reaches_the_engines_verb_with_its_arguments(verb):
    codec = CallCodec()
    declared = _declared(verb)
    for given in ([p.name for p in declared], [p.name for p in declared if p.default is p.empty]):  # then defaults
        args = {name: SAMPLES[name] for name in given}
        message = codec.decode_body(codec.decode_envelope(codec.encode(1, CONTROL_CALLS[verb](**args))))
        want = {p.name: args.get(p.name, p.default) for p in declared}
        assert _handled(message) == (verb, want)


def test_the_wire_forms_reach_the_engine():
    from siesta.ipc.protocol import InitWeightTransfer, UpdateWeights

    assert _handled(UpdateWeights(model_path="/m", weight_version="v7")) == ("update_weights", {"args": ("/m", "v7")})
    verb, got = _handled(UpdateWeights(update_info={"names": []}))
    assert (verb, got) == ("update_weights", {"args": ({"update_info": {"names": []}}, None)})
    assert _handled(InitWeightTransfer(init_info={"a": 1})) == ("init_weight_transfer_engine", {"args": ({"a": 1},)})
    assert init_info_of({"init_info": {"a": 1}}) == init_info_of({"a": 1}) == {"a": 1}
    served = EngineInfo("m", 64, 100, 16, 4, weight_version="v3")
    assert CallHandler(RecordingEngine(), lambda: served).handle(GetInfo()).result.weight_version == "v3"


# -- HTTP ---------------------------------------------------------------------------------


def _dev_routes() -> dict[tuple[str, str], dict[str, Any]]:
    """(method, path) -> the route's query parameters and their defaults, from the app's OpenAPI schema."""

    async def start():  # never called: the app is not started
        raise AssertionError

    with warnings.catch_warnings():  # SGLang's GET-or-POST routes share operation ids
        warnings.simplefilter("ignore")
        schema = build_app(ServerConfig(dev_mode=True), start).openapi()
    return {
        (method.upper(), path): {q["name"]: q["schema"].get("default") for q in op.get("parameters", [])
                                 if q["in"] == "query"}
        for path, ops in schema["paths"].items()
        for method, op in ops.items()
    }  # fmt: skip


@pytest.mark.parametrize("verb", CONTROL_VERBS)
def test_a_dev_route_serves_each_verb_query_routes_with_its_arguments(verb):
    routes = _dev_routes()
    assert HTTP_ROUTES[verb] in routes, f"no route {HTTP_ROUTES[verb]}"
    if verb in QUERY_VERBS:
        assert routes[HTTP_ROUTES[verb]] == {_http_name(verb, p.name): p.default for p in _declared(verb)}


def _call_each_verb(client: Any) -> None:
    for verb in CONTROL_VERBS:
        if verb == "finish_weight_update":
            continue  # after the update it finishes, below
        args = [SAMPLES.get(p.name, "x") for p in _declared(verb) if p.default is p.empty]
        if verb == "update_weights":
            args = [{"update_info": {"names": []}}]
        elif verb == "init_weight_transfer_engine":
            args = [{"init_info": {}}]
        getattr(client, verb)(*args)
    client.finish_weight_update("v9")


def test_the_http_client_calls_each_verb_on_its_route():
    seen: list[tuple[str, str]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path))
        return httpx.Response(200, json={"is_paused": True, "is_sleeping": True, "weight_version": "1",
                                         "world_size": 1, "new_version": "v8"})  # fmt: skip

    _call_each_verb(SiestaClient("http://siesta", transport=httpx.MockTransport(answer)))
    assert set(seen) == {HTTP_ROUTES[v] for v in CONTROL_VERBS}


class FakePlane:
    """smg's RL control plane with one replica that answers every call."""

    def __init__(self) -> None:
        self.paths: list[tuple[str, str]] = []
        self.replica = Replica("w0", "http://r0", 0, 1, "healthy", "1")

    def replicas(self, fleet: str) -> list[Replica]:
        return [self.replica]

    def _outcome(self, method: str, path: str) -> Outcome:
        self.paths.append((method, "/" + path.lstrip("/")))
        body = {"is_paused": False, "is_sleeping": False, "weight_version": "1", "world_size": 1}
        return Outcome("w0", "http://r0", 200, body)

    def fanout(self, fleet: str, method: str, path: str, params=None, body=None, only=None) -> list[Outcome]:
        return [self._outcome(method, path)]

    def call(self, worker_id: str, method: str, path: str, params=None, body=None) -> Outcome:
        return self._outcome(method, path)


class FakeGateway:
    def relabel(self, worker_id: str, labels: dict[str, str]) -> None:
        pass


def test_the_fleet_client_calls_each_verb_on_its_route():
    fleet = FleetClient("http://gateway", gateway=FakeGateway())
    fleet.plane = FakePlane()
    _call_each_verb(fleet)
    assert set(fleet.plane.paths) == {HTTP_ROUTES[v] for v in CONTROL_VERBS}


# -- the API server's imports -------------------------------------------------------------


@pytest.mark.parametrize("module", ["siesta.entrypoints.server.app", "siesta.ipc.client", "siesta.client"])
def test_the_api_server_and_the_clients_do_not_import_the_engine(module):
    code = f"import sys, {module}; print('siesta.core.engine_core' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "False"
