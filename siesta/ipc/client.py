"""The API server's side of the engine core: spawn it, send it calls, route its outputs.

One asyncio task reads everything the core sends: step outputs go to the per-request
``OutputStream`` they belong to (their stats to the metrics registry), replies resolve the
future of their call. The process's sentinel is watched by the event loop, so a core that dies
fails every waiting request and call at once with ``EngineDeadError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import shutil
import tempfile
from collections.abc import Callable, Iterable
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from siesta.config import EngineConfig
from siesta.control import OneCallResult, init_info_of, update_info_of
from siesta.ipc.protocol import (
    AbortRequests,
    AddRequest,
    AddRequests,
    CallCodec,
    CoreCall,
    CoreState,
    DestroyWeightsUpdateGroup,
    EngineInfo,
    Fatal,
    FinishWeightUpdate,
    GetInfo,
    GetWorldSize,
    InitWeightsUpdateGroup,
    InitWeightTransfer,
    IsPaused,
    IsSleeping,
    MessageCodec,
    OneCallOptions,
    Pause,
    Ready,
    RemoteError,
    Reply,
    ResetPrefixCache,
    Resume,
    Shutdown,
    Sleep,
    StartWeightUpdate,
    StepOutputs,
    UpdateWeights,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensor,
    UpdateWeightVersion,
    WakeUp,
)
from siesta.ipc.remote_errors import EngineDeadError, from_remote
from siesta.metrics import MetricsRegistry
from siesta.request import EngineCoreOutput, EngineCoreRequest

logger = logging.getLogger(__name__)

# Loading an 8B model from a slow disk takes minutes; a core that is silent longer is stuck.
STARTUP_TIMEOUT_S = 900.0
# While waiting for Ready, how often to look whether the process already died.
STARTUP_POLL_S = 0.5
SHUTDOWN_GRACE_S = 10.0
KILL_WAIT_S = 5.0
EXIT_REAP_S = 1.0
# Unbounded send queue: a send never blocks the event loop (the core drains its input every turn).
UNBOUNDED_HWM = 0


class OutputStream:
    """The outputs of one HTTP request's engine requests, in arrival order."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[list[EngineCoreOutput] | BaseException] = asyncio.Queue()
        self._error: BaseException | None = None

    def put(self, outputs: list[EngineCoreOutput]) -> None:
        self._queue.put_nowait(outputs)

    def fail(self, exc: BaseException) -> None:
        self._queue.put_nowait(exc)

    async def get(self) -> list[EngineCoreOutput]:
        """Everything that arrived since the last call (waits for at least one batch)."""
        if self._error is not None:
            raise self._error
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._error = item
            raise item
        batch = list(item)
        while not self._queue.empty():
            nxt = self._queue.get_nowait()
            if isinstance(nxt, BaseException):
                self._error = nxt  # raised by the next get, after this batch is handled
                break
            batch.extend(nxt)
        return batch


class EngineCoreClient:
    def __init__(self, process: BaseProcess, ipc_dir: str, metrics: MetricsRegistry) -> None:
        self.process = process
        self.metrics = metrics
        self.info: EngineInfo | None = None
        self.state: CoreState | None = None  # the core's, as of its last message
        self._ipc_dir = ipc_dir
        self._ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context()
        self._input = self._sync_ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, UNBOUNDED_HWM)
        self._output = self._ctx.socket(zmq.PULL)
        self._input.bind(_address(ipc_dir, "input"))
        self._output.bind(_address(ipc_dir, "output"))
        self._calls_codec = CallCodec()
        self._messages = MessageCodec()
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._streams: dict[str, OutputStream] = {}
        self._dispatcher: asyncio.Task[None] | None = None
        self._dead: str | None = None  # why, once the process is gone
        self._fatal: RemoteError | None = None
        self._closing = False
        # Called once if the core dies while serving (not at shutdown): the server exits then.
        self.on_death: Callable[[str], None] | None = None

    # -- lifecycle -------------------------------------------------------------------

    @classmethod
    async def start(
        cls, config: EngineConfig, metrics: MetricsRegistry | None = None, startup_timeout: float = STARTUP_TIMEOUT_S
    ) -> EngineCoreClient:
        """Spawn the core, wait until its model is loaded; raises why it could not start."""
        ipc_dir = tempfile.mkdtemp(prefix="siesta-ipc-")
        ctx = multiprocessing.get_context("spawn")
        process = ctx.Process(
            target=_run_engine_core,
            args=(config, _address(ipc_dir, "input"), _address(ipc_dir, "output")),
            name="siesta-engine-core",
        )
        client = cls(process, ipc_dir, metrics or MetricsRegistry())
        process.start()
        try:
            client.info = await client._wait_ready(startup_timeout)
        except BaseException:
            await client.shutdown()
            raise
        client._watch()
        return client

    async def _wait_ready(self, timeout: float) -> EngineInfo:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            try:
                data = await asyncio.wait_for(self._output.recv(), STARTUP_POLL_S)
            except TimeoutError:
                if not self.process.is_alive():
                    raise EngineDeadError(f"the engine core exited during startup (exit code {self.process.exitcode})")
                continue
            message = self._messages.decode(data)
            if isinstance(message, Ready):
                return message.info
            if isinstance(message, Fatal):
                raise from_remote(message.error)
        raise EngineDeadError(f"the engine core did not become ready within {timeout:.0f}s")

    def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self.process.sentinel, self._on_process_exit)
        self._dispatcher = loop.create_task(self._dispatch(), name="siesta-output-dispatch")

    async def shutdown(self) -> None:
        """Ask the core to stop, then make sure it did; safe to call more than once."""
        self._closing = True
        if self._dead is None and self.process.is_alive() and self.info is not None:
            with contextlib.suppress(EngineDeadError):
                self._send(next(self._ids), Shutdown())
        await asyncio.to_thread(self._stop_process)
        self._mark_dead("the server is shutting down")
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dispatcher
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._sync_ctx.term()
        self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def _stop_process(self) -> None:
        if self.process.pid is None:
            return
        self.process.join(SHUTDOWN_GRACE_S)
        if self.process.is_alive():
            logger.warning("the engine core did not stop in %.0fs; terminating it", SHUTDOWN_GRACE_S)
            self.process.terminate()
            self.process.join(KILL_WAIT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(KILL_WAIT_S)

    # -- health ------------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self._dead is None

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def _on_process_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        self.process.join(EXIT_REAP_S)  # the sentinel fires a moment before the exit code is readable
        reason = f"the engine core process exited (exit code {self.process.exitcode})"
        if self._fatal is not None:
            reason += f": {self._fatal.type}: {self._fatal.message}"
        if not self._closing:
            logger.error("%s", reason)
        self._mark_dead(reason)
        if not self._closing and self.on_death is not None:
            self.on_death(reason)

    def _mark_dead(self, reason: str) -> None:
        if self._dead is not None:
            return
        self._dead = reason
        self.metrics.engine_died()  # no stale gauges: nothing runs, waits or holds KV any more
        error = EngineDeadError(reason)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
        for stream in set(self._streams.values()):
            stream.fail(error)
        self._streams.clear()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    # -- sending -------------------------------------------------------------------------

    def _send(self, call_id: int, body: CoreCall) -> None:
        try:
            data = self._calls_codec.encode(call_id, body)
        except (OverflowError, msgspec.EncodeError) as e:  # an int beyond 64 bits, say
            raise ValueError(f"the request holds a value the engine cannot take: {e}") from None
        try:
            self._input.send(data, zmq.NOBLOCK)
        except zmq.Again:
            raise EngineDeadError("the engine core is not reachable") from None

    async def call(self, body: CoreCall) -> Any:
        """Run one operation in the core and return its result, or raise its error (typed)."""
        self._check_alive()
        call_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            self._send(call_id, body)
            return await future
        finally:
            self._calls.pop(call_id, None)

    def cast(self, body: CoreCall) -> None:
        """Send without waiting for the reply (aborts from cleanup code that must not await)."""
        if self._dead is None:
            with contextlib.suppress(EngineDeadError):
                self._send(next(self._ids), body)

    # -- requests ------------------------------------------------------------------------

    def open_stream(self, request_ids: Iterable[str]) -> OutputStream:
        """One stream for several engine requests (the n choices of one HTTP request)."""
        self._check_alive()
        stream = OutputStream()
        for rid in request_ids:
            self._streams[rid] = stream
        return stream

    def close_stream(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._streams.pop(rid, None)

    async def add_request(self, request: EngineCoreRequest) -> None:
        """Queue one request (its stream must be open); raises RequestRejected with the core's reason."""
        await self.call(AddRequest(request=request))

    async def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Queue all of them in one message, or none (RequestRejected, EngineOverloaded)."""
        await self.call(AddRequests(requests=requests))

    def abort_nowait(self, request_ids: list[str], stopped: bool = False) -> None:
        if request_ids:
            self.cast(AbortRequests(request_ids=request_ids, stopped=stopped))

    async def abort_requests(self, request_ids: list[str]) -> None:
        await self.call(AbortRequests(request_ids=request_ids))

    # -- control (siesta.control.EngineControl: its names and defaults, each verb awaited) -----

    async def pause(self, mode: str = "abort", clear_cache: bool = True, clear_connector_cache: bool = True) -> None:
        await self.call(Pause(mode=mode, clear_cache=clear_cache, clear_connector_cache=clear_connector_cache))

    async def resume(self) -> None:
        await self.call(Resume())

    async def is_paused(self) -> bool:
        # As of the core's last message (it sends one after every call and every step that
        # changed anything): at once, not behind the step in flight.
        if self.state is not None:
            self._check_alive()
            return self.state.paused
        return bool(await self.call(IsPaused()))

    async def sleep(
        self, level: int = 1, mode: str = "abort", clear_connector_cache: bool = True, tags: list[str] | None = None
    ) -> None:
        await self.call(Sleep(level=level, mode=mode, clear_connector_cache=clear_connector_cache, tags=tags))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.call(WakeUp(tags=tags))

    async def is_sleeping(self) -> bool:
        if self.state is not None:
            self._check_alive()
            return self.state.sleeping
        return bool(await self.call(IsSleeping()))

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return bool(
            await self.call(
                ResetPrefixCache(reset_running_requests=reset_running_requests, reset_connector=reset_connector)
            )
        )

    async def update_weights(self, weights: str | dict[str, Any], weight_version: str | None = None) -> str:
        """A model path the core loads, or a weight-transfer call (``{"update_info": {...}}`` or
        the bare update_info): tensors do not cross the process boundary."""
        if isinstance(weights, str):
            call = UpdateWeights(model_path=weights, weight_version=weight_version)
        else:
            call = UpdateWeights(update_info=update_info_of(weights), weight_version=weight_version)
        return str(await self.call(call))

    async def init_weight_transfer_engine(self, request: Any) -> None:
        """vLLM's ``{"init_info": {...}}`` or the bare init info."""
        await self.call(InitWeightTransfer(init_info=init_info_of(request)))

    async def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        await self.call(StartWeightUpdate(is_checkpoint_format=is_checkpoint_format))

    async def finish_weight_update(self, weight_version: str | None = None) -> str:
        return str(await self.call(FinishWeightUpdate(weight_version=weight_version)))

    async def get_world_size(self) -> int:
        return int(await self.call(GetWorldSize()))

    # -- SGLang's weight calls ---------------------------------------------------------------

    async def init_weights_update_group(self, init_info: dict[str, Any]) -> str:
        return str(await self.call(InitWeightsUpdateGroup(init_info=init_info)))

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self.call(DestroyWeightsUpdateGroup(group_name=group_name))

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
        load_format: str | None, options: OneCallOptions,
    ) -> OneCallResult:  # fmt: skip
        call = UpdateWeightsFromDistributed(names=names, dtypes=dtypes, shapes=shapes, group_name=group_name,
                                            load_format=load_format, options=options)  # fmt: skip
        return msgspec.convert(await self.call(call), OneCallResult)

    async def update_weights_from_tensor(
        self, serialized: list[str], load_format: str | None, options: OneCallOptions
    ) -> OneCallResult:
        call = UpdateWeightsFromTensor(serialized=serialized, load_format=load_format, options=options)
        return msgspec.convert(await self.call(call), OneCallResult)

    async def update_weights_from_disk(self, model_path: str, options: OneCallOptions) -> OneCallResult:
        return msgspec.convert(await self.call(UpdateWeightsFromDisk(model_path=model_path, options=options)),
                               OneCallResult)  # fmt: skip

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> str:
        return str(await self.call(UpdateWeightVersion(new_version=new_version, abort_all_requests=abort_all_requests)))

    async def get_weight_version(self) -> str:
        return (await self.get_info()).weight_version

    async def get_info(self) -> EngineInfo:
        """The model as the core described it at start, with the weight version of its last message."""
        if self.state is not None and self.info is not None:
            self._check_alive()
            return msgspec.structs.replace(self.info, weight_version=self.state.weight_version)
        return msgspec.convert(await self.call(GetInfo()), EngineInfo)

    # -- receiving -----------------------------------------------------------------------

    async def _dispatch(self) -> None:
        while True:
            data = await self._output.recv()
            try:
                self._route(self._messages.decode(data))
            except Exception:  # one bad message must not stop the dispatch
                logger.exception("could not route a message from the engine core")

    def _route(self, message: Any) -> None:
        state = getattr(message, "state", None)
        if state is not None:
            self.state = state  # before the reply resolves: a pause's caller then reads paused
        if isinstance(message, StepOutputs):
            self._route_outputs(message)
        elif isinstance(message, Reply):
            self._resolve(message)
        elif isinstance(message, Fatal):
            self._fatal = message.error
            logger.error("engine core fatal error: %s: %s", message.error.type, message.error.message)

    def _route_outputs(self, message: StepOutputs) -> None:
        self.metrics.apply(message.stats)
        batches: dict[int, tuple[OutputStream, list[EngineCoreOutput]]] = {}
        for out in message.outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:  # else its HTTP request already ended
                batches.setdefault(id(stream), (stream, []))[1].append(out)
        for stream, outputs in batches.values():
            stream.put(outputs)

    def _resolve(self, reply: Reply) -> None:
        future = self._calls.get(reply.call_id)
        if future is None or future.done():
            return  # a cast, or a caller that stopped waiting
        if reply.error is not None:
            future.set_exception(from_remote(reply.error))
        else:
            future.set_result(reply.result)


def _run_engine_core(config: EngineConfig, input_address: str, output_address: str) -> None:
    """The spawned process's target: the engine is imported there, never in the API server."""
    from siesta.ipc.core_proc import run_engine_core

    run_engine_core(config, input_address, output_address)


def _address(ipc_dir: str, name: str) -> str:
    return f"ipc://{ipc_dir}/{name}"
