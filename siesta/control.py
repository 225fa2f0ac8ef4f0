"""The engine's control surface, declared once: every verb, its arguments and defaults, its errors.

``EngineControl`` is the one declaration. What implements it, and how each is held to it by
``tests/test_control_surface.py`` (parameter names and defaults, with ``inspect.signature``):

- ``siesta.core.engine_core.EngineCore`` and the offline ``siesta.LLM``: in process, the return
  types below.
- ``siesta.ipc.client.EngineCoreClient``: the API server's side of the engine-core process, each
  verb ``async`` with the same result; one IPC message a verb (``siesta.ipc.protocol.CONTROL_CALLS``).
- The HTTP dev routes (``HTTP_ROUTES``), and the clients of them: ``siesta.client.SiestaClient``
  (a verb answers the route's JSON, unwrapped to the value where there is one;
  ``AsyncSiestaClient`` awaits it) and ``siesta.fleet.client.FleetClient`` (every replica at once:
  actions answer a ``FleetResult``, queries one value a replica).

Where the copies disagreed, vLLM's names and defaults won, with two renames kept where a caller
already writes them: HTTP's ``reset_external`` is ``reset_connector`` (vLLM's own two names,
``HTTP_NAMES``), and ``init_weight_transfer_engine`` takes vLLM's ``request`` (``{"init_info":
{...}}`` or the bare init info) everywhere, the engine core included. ``clear_connector_cache``
defaults to true on every path (DESIGN.md, invariant 5).

Below the engine and its clients both (standard library and msgspec only): the API server and a
trainer's client import it without importing the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Protocol, get_args

import msgspec

PauseMode = Literal["abort", "wait", "keep"]
WakeTag = Literal["weights", "kv_cache"]
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)
WAKE_TAGS: tuple[str, ...] = get_args(WakeTag)  # what a sleep releases and a wake-up restores
SLEEP_LEVELS = (0, 1, 2)
INIT_INFO = "init_info"
UPDATE_INFO = "update_info"


# -- errors (they cross the IPC boundary by name: siesta.ipc.remote_errors) -----------------


class RequestRejected(ValueError):
    """A request that can never run here; the message says why. Nothing else is affected."""


class ConnectorRetentionError(ValueError):
    """``clear_connector_cache=False`` with a connector that cannot keep its cache across a pause."""


class EngineStateError(RuntimeError):
    """A control call that does not fit the engine's state (e.g. resume while asleep)."""


class EngineOverloaded(RuntimeError):
    """More requests wait than ``max_waiting_requests``: retry later (HTTP 429)."""


# -- the verbs --------------------------------------------------------------------------


class WeightTransferControl(Protocol):
    """vLLM's weight-transfer calls: what a trainer's sender needs (``siesta.weight_transfer.WeightSender``)."""

    def init_weight_transfer_engine(self, request: Any) -> None:
        """``{"init_info": {...}}`` or the bare init info; nccl joins the trainer's group (``init_info_of``)."""

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        """Open an update: nothing is generated until ``finish_weight_update``."""

    def update_weights(self, weights: Any, weight_version: str | None = None) -> str:
        """``{"update_info": {...}}`` (the bytes come through the backend), a model path, or in
        process tensors; returns the weight version."""

    def finish_weight_update(self, weight_version: str | None = None) -> str:
        """Publish the update's version (the next one unless named); returns it."""

    def get_world_size(self) -> int:
        """Engine ranks that join a weight-transfer group."""


class EngineControl(WeightTransferControl, Protocol):
    """Every control verb of the engine, with its defaults. ``reset_prefix_cache`` is also the
    flush (SGLang's ``/flush_cache`` is it with ``reset_connector=True``)."""

    def pause(self, mode: str = "abort", clear_cache: bool = True, clear_connector_cache: bool = True) -> None:
        """Stop generating: ``abort`` ends requests in flight, ``wait`` lets them finish, ``keep`` freezes them."""

    def resume(self) -> None:
        """Generate again after a pause (a sleep ends with ``wake_up``)."""

    def is_paused(self) -> bool:
        """Whether a pause (or sleep) has taken effect."""

    def sleep(
        self, level: int = 1, mode: str = "abort", clear_connector_cache: bool = True, tags: list[str] | None = None
    ) -> None:
        """Pause, then hand device memory back: level 1 the KV cache (weights to host memory),
        level 2 both, level 0 none; ``tags`` narrows what level 1 or 2 releases."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore ``weights`` and/or ``kv_cache`` (default both); once both are back, resume."""

    def is_sleeping(self) -> bool:
        """Whether the engine is asleep (at any level)."""

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Drop the device prefix cache (and the KV tiers with ``reset_connector``)."""

    def abort_requests(self, request_ids: list[str]) -> None:
        """End requests by id; their blocks are freed at once."""

    def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> str:
        """Rename the weights (SGLang's): outputs report ``new_version``; cached KV stays reachable."""

    def get_weight_version(self) -> str:
        """The version outputs report for the weights serving now."""


def _verbs(*protocols: type) -> tuple[str, ...]:
    names: list[str] = []
    for protocol in protocols:
        names += [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_") and n not in names]
    return tuple(names)


WEIGHT_TRANSFER_VERBS = _verbs(WeightTransferControl)
CONTROL_VERBS = _verbs(WeightTransferControl, EngineControl)

# Each verb's dev route (vLLM's paths and bodies; update_weight_version is SGLang's). pause,
# sleep, wake_up and reset_prefix_cache take their arguments as query parameters, the rest a
# JSON body.
HTTP_ROUTES: dict[str, tuple[str, str]] = {
    "init_weight_transfer_engine": ("POST", "/init_weight_transfer_engine"),
    "start_weight_update": ("POST", "/start_weight_update"),
    "update_weights": ("POST", "/update_weights"),
    "finish_weight_update": ("POST", "/finish_weight_update"),
    "get_world_size": ("GET", "/get_world_size"),
    "pause": ("POST", "/pause"),
    "resume": ("POST", "/resume"),
    "is_paused": ("GET", "/is_paused"),
    "sleep": ("POST", "/sleep"),
    "wake_up": ("POST", "/wake_up"),
    "is_sleeping": ("GET", "/is_sleeping"),
    "reset_prefix_cache": ("POST", "/reset_prefix_cache"),
    "abort_requests": ("POST", "/abort_requests"),
    "update_weight_version": ("POST", "/update_weight_version"),
    "get_weight_version": ("GET", "/weight_version"),
}
QUERY_VERBS = ("pause", "sleep", "wake_up", "reset_prefix_cache")
# Arguments HTTP spells otherwise: vLLM's route says reset_external where its engine says reset_connector.
HTTP_NAMES: dict[str, dict[str, str]] = {"reset_prefix_cache": {"reset_connector": "reset_external"}}


def init_info_of(request: Any) -> Any:
    """The init info of ``init_weight_transfer_engine``'s argument: vLLM's ``{"init_info": {...}}`` or the bare one."""
    if isinstance(request, Mapping) and set(request) == {INIT_INFO}:
        return request[INIT_INFO]
    return request


def update_info_of(weights: Any) -> Any:
    """The update_info of an ``update_weights`` mapping: ``{"update_info": {...}}``, or the bare one."""
    if isinstance(weights, Mapping) and set(weights) == {UPDATE_INFO}:
        return weights[UPDATE_INFO]
    return weights


# -- SGLang's one-call weight updates answer this ---------------------------------------


class OneCallResult(msgspec.Struct, omit_defaults=True):
    weight_version: str
    kept_requests: int = 0  # requests in flight that were kept across the update (SGLang's num_paused_requests)
    missing_tensors: int = 0  # still to be written before the engine generates (a torn or released engine)
