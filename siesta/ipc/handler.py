"""What each call does to the engine core, kept apart from sockets so it is testable in-process."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from siesta.control import EngineControl
from siesta.core.deferred import Deferred
from siesta.ipc.protocol import (
    AbortRequests,
    AddRequest,
    AddRequests,
    CoreCall,
    DestroyWeightsUpdateGroup,
    EngineInfo,
    FinishWeightUpdate,
    GetInfo,
    GetWorldSize,
    InitWeightsUpdateGroup,
    InitWeightTransfer,
    IsPaused,
    IsSleeping,
    Pause,
    ResetPrefixCache,
    Resume,
    Shutdown,
    Sleep,
    StartWeightUpdate,
    UpdateWeights,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensor,
    UpdateWeightVersion,
    WakeUp,
)

WAIT_MODE = "wait"


class Engine(EngineControl, Protocol):
    """The part of ``EngineCore`` the calls reach (a fake stands in for it in tests): the control
    verbs (siesta.control), and the loop's and SGLang's weight calls besides."""

    weight_version: str  # every message's CoreState carries it

    def has_work(self) -> bool: ...
    def step(self) -> Any: ...
    def drain_outputs(self) -> Any: ...
    def add_request(self, req: Any) -> None: ...
    def add_requests(self, reqs: list[Any]) -> None: ...
    def abort_requests(self, request_ids: list[str], stopped: bool = ...) -> None: ...
    def begin_weight_transfer_engine(self, init_info: Any) -> Deferred: ...
    def begin_weights_update_group(self, init_info: Any) -> Deferred: ...
    def destroy_weights_update_group(self, group_name: str = ...) -> None: ...
    def update_weights_from_distributed(self, names: Any, dtypes: Any, shapes: Any, group_name: str = ...,
                                        load_format: str | None = ..., **options: Any) -> Any: ...  # fmt: skip
    def update_weights_from_tensor(self, serialized: list[Any], load_format: str | None = ..., **o: Any) -> Any: ...
    def update_weights_from_disk(self, model_path: str, **options: Any) -> Any: ...


@dataclass
class Outcome:
    """A call's result; ``ready`` set means the reply waits until it returns True (a draining
    pause, a join), and then is ``finish()`` when given (a join's result, or its error)."""

    result: Any = None
    ready: Callable[[], bool] | None = None
    # Whether a pause or sleep that waits on in-flight requests may be over (resume, wake-up).
    ends_pauses: bool = False
    finish: Callable[[], Any] | None = None
    # Whether only steps can make ``ready`` true (a draining pause); a join ends on its own thread.
    needs_steps: bool = True


def deferred(call: Deferred) -> Outcome:
    """A call that answers later, while the engine steps: the loop polls it between steps."""
    if call.done():
        return Outcome(call.finish())
    return Outcome(ready=call.done, finish=call.finish, needs_steps=False)


class CallHandler:
    def __init__(self, engine: Engine, info: Callable[[], EngineInfo]) -> None:
        self.engine = engine
        self.info = info
        self.stopping = False
        self._table: dict[type[CoreCall], Callable[[Any], Outcome]] = {
            AddRequest: self._add,
            AddRequests: self._add_many,
            AbortRequests: self._abort,
            Pause: self._pause,
            Resume: self._resume,
            IsPaused: lambda _: Outcome(self.engine.is_paused()),
            Sleep: self._sleep,
            WakeUp: self._wake_up,
            IsSleeping: lambda _: Outcome(self.engine.is_sleeping()),
            ResetPrefixCache: self._reset_prefix_cache,
            UpdateWeights: self._update_weights,
            InitWeightTransfer: self._init_weight_transfer,
            StartWeightUpdate: self._start_weight_update,
            FinishWeightUpdate: self._finish_weight_update,
            GetWorldSize: lambda _: Outcome(self.engine.get_world_size()),
            GetInfo: lambda _: Outcome(self.info()),
            Shutdown: self._shutdown,
            InitWeightsUpdateGroup: lambda c: deferred(self.engine.begin_weights_update_group(c.init_info)),
            DestroyWeightsUpdateGroup: self._destroy_weights_update_group,
            UpdateWeightsFromDistributed: self._update_weights_from_distributed,
            UpdateWeightsFromTensor: self._update_weights_from_tensor,
            UpdateWeightsFromDisk: self._update_weights_from_disk,
            UpdateWeightVersion: lambda c: Outcome(self.engine.update_weight_version(c.new_version,
                                                                                      c.abort_all_requests)),
        }  # fmt: skip

    def handle(self, call: CoreCall) -> Outcome:
        """Runs one call; exceptions propagate to the caller, which sends them back typed."""
        return self._table[type(call)](call)

    def _add(self, call: AddRequest) -> Outcome:
        self.engine.add_request(call.request)
        return Outcome()

    def _add_many(self, call: AddRequests) -> Outcome:
        self.engine.add_requests(list(call.requests))
        return Outcome()

    def _abort(self, call: AbortRequests) -> Outcome:
        self.engine.abort_requests(list(call.request_ids), stopped=call.stopped)
        return Outcome()

    def _pause(self, call: Pause) -> Outcome:
        self.engine.pause(call.mode, call.clear_cache, call.clear_connector_cache)
        return self._maybe_deferred(call.mode)

    def _resume(self, _: Resume) -> Outcome:
        self.engine.resume()
        return Outcome(ends_pauses=True)

    def _sleep(self, call: Sleep) -> Outcome:
        self.engine.sleep(call.level, call.mode, call.clear_connector_cache, call.tags)
        return self._maybe_deferred(call.mode)

    def _wake_up(self, call: WakeUp) -> Outcome:
        self.engine.wake_up(None if call.tags is None else list(call.tags))
        return Outcome(ends_pauses=True)

    def _maybe_deferred(self, mode: str) -> Outcome:
        # A waiting pause completes in a later step, once in-flight requests finish.
        if mode == WAIT_MODE and not self.engine.is_paused():
            return Outcome(ready=self.engine.is_paused)
        return Outcome()

    def _reset_prefix_cache(self, call: ResetPrefixCache) -> Outcome:
        return Outcome(self.engine.reset_prefix_cache(call.reset_running_requests, call.reset_connector))

    def _update_weights(self, call: UpdateWeights) -> Outcome:
        if (call.model_path is None) == (call.update_info is None):
            raise ValueError("update_weights takes exactly one of model_path and update_info")
        weights = call.model_path if call.update_info is None else {"update_info": call.update_info}
        return Outcome(self.engine.update_weights(weights, call.weight_version))

    def _init_weight_transfer(self, call: InitWeightTransfer) -> Outcome:
        return deferred(self.engine.begin_weight_transfer_engine(call.init_info))

    def _start_weight_update(self, call: StartWeightUpdate) -> Outcome:
        self.engine.start_weight_update(call.is_checkpoint_format)
        return Outcome()

    def _finish_weight_update(self, call: FinishWeightUpdate) -> Outcome:
        return Outcome(self.engine.finish_weight_update(call.weight_version))

    def _destroy_weights_update_group(self, call: DestroyWeightsUpdateGroup) -> Outcome:
        self.engine.destroy_weights_update_group(call.group_name)
        return Outcome()

    def _update_weights_from_distributed(self, call: UpdateWeightsFromDistributed) -> Outcome:
        options = msgspec.structs.asdict(call.options)
        return Outcome(self.engine.update_weights_from_distributed(
            call.names, call.dtypes, call.shapes, call.group_name, call.load_format, **options))  # fmt: skip

    def _update_weights_from_tensor(self, call: UpdateWeightsFromTensor) -> Outcome:
        options = msgspec.structs.asdict(call.options)
        return Outcome(self.engine.update_weights_from_tensor(list(call.serialized), call.load_format, **options))

    def _update_weights_from_disk(self, call: UpdateWeightsFromDisk) -> Outcome:
        return Outcome(self.engine.update_weights_from_disk(call.model_path, **msgspec.structs.asdict(call.options)))

    def _shutdown(self, _: Shutdown) -> Outcome:
        self.stopping = True
        return Outcome()


def engine_info(engine: Any) -> EngineInfo:
    """The loaded model as the server sees it."""
    return EngineInfo(
        model_name=engine.source.name,
        max_model_len=engine.max_model_len,
        vocab_size=engine.vocab_size,
        block_size=engine.config.cache.block_size,
        num_blocks=engine.kv.pool.num_blocks,
        weight_version=engine.weight_version,
        pid=os.getpid(),
        retains_tier=engine.connector is None or engine.connector.supports_retained_cache_on_pause,
        records_routing=engine.runner.routed is not None,
        numerics_key=engine.numerics_key,
    )
