"""POST /collective_rpc (dev mode): vLLM's call into every worker, for the worker-extension
methods RL frameworks name (vLLM's body ``{method, args, kwargs, timeout}``, its answer
``{"results": [one per engine rank]}``).

- verl's ``update_weights_from_ipc`` (``vLLMColocateWorkerExtension``): the trainer's bucket
  buffer and its ``bucket_meta`` messages over verl's ZeroMQ socket (``weight_transfer.
  verl_buckets``), each bucket written as one SGLang-style tensor update; the first publishes the
  next version, the rest write under it (KV cached between two buckets is dropped, invariant 6).
  ``peft_config`` (LoRA) is refused; siesta's ``zmq_handle`` kwarg names the socket where no GPU
  UUID does (the CPU). verl's ``sleep {level}`` and ``wake_up {tags}`` are the engine's.
- SkyRL's ``NewInferenceWorkerWrap``: ``skyrl_start_weight_update``, ``update_weights_ipc`` and
  ``update_weights_nccl`` (vLLM's ``update_info``, through the configured backend),
  ``skyrl_finish_weight_update``; ``skyrl_sleep_for_weight_sync {offload_kv}`` sleeps at level 1
  in keep mode (the frozen requests recompute or load their KV after the wake-up) and
  ``skyrl_wake_for_weight_sync {tags}`` wakes what the tags name.
- ``liveness_probe``: a no-op call to the engine core (prime-rl's).

Any other method is a 400 naming it and the ones served.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import torch
import zmq
import zmq.asyncio
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from siesta.entrypoints.server.errors import APIError
from siesta.entrypoints.server.protocol import Float
from siesta.entrypoints.server.state import ServerState, server_state
from siesta.ipc.protocol import OneCallOptions
from siesta.weight_transfer.verl_buckets import Bucket, SharedBuffer, serialized_entry, socket_path
from siesta.weight_transfer.wire import WeightTransferError

router = APIRouter(tags=["dev"])
logger = logging.getLogger(__name__)
# A silent trainer ends the call after this long when vLLM's ``timeout`` is not given.
DEFAULT_TIMEOUT_S = 300.0
ACK = b""
KEEP, ABORT = "keep", "abort"
SKYRL_SLEEP_LEVEL = 1  # weights kept in host memory: a partial sync (LoRA) leaves the rest whole


class CollectiveRpcRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    timeout: Float | None = None


Method = Callable[[ServerState, dict[str, Any], float], Awaitable[Any]]


@router.post("/collective_rpc")
async def collective_rpc(body: CollectiveRpcRequest, request: Request) -> dict[str, Any]:
    method = METHODS.get(body.method)
    if method is None:
        raise APIError(HTTPStatus.BAD_REQUEST, f"method {body.method!r} is not a worker method siesta serves; it "
                       f"serves {', '.join(sorted(METHODS))}", "method")  # fmt: skip
    if body.args:
        raise APIError(HTTPStatus.BAD_REQUEST, f"{body.method} takes keyword arguments (kwargs), not args", "args")
    state = server_state(request)
    result = await method(state, body.kwargs, body.timeout or DEFAULT_TIMEOUT_S)
    return {"results": [result] * await state.core.get_world_size()}


def _kwarg(kwargs: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = kwargs.get(name, default)
    if value is not None and not isinstance(value, kind):
        raise APIError(HTTPStatus.BAD_REQUEST, f"kwargs.{name} must be {getattr(kind, '__name__', kind)}, got "
                       f"{type(value).__name__}", f"kwargs.{name}")  # fmt: skip
    return value


def _only(kwargs: dict[str, Any], names: set[str], method: str) -> None:
    extra = sorted(set(kwargs) - names)
    if extra:
        raise APIError(HTTPStatus.BAD_REQUEST, f"{method} does not take kwargs {extra}", f"kwargs.{extra[0]}")


# -- verl ---------------------------------------------------------------------------------


async def update_weights_from_ipc(state: ServerState, kwargs: dict[str, Any], timeout_s: float) -> None:
    _only(kwargs, {"peft_config", "base_sync_done", "zmq_handle"}, "update_weights_from_ipc")
    if kwargs.get("peft_config"):
        raise APIError(HTTPStatus.BAD_REQUEST, "peft_config: siesta loads no LoRA adapters; sync the merged "
                       "weights (peft_config null)", "kwargs.peft_config")  # fmt: skip
    address = _kwarg(kwargs, "zmq_handle", str) or _gpu_socket()
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        buffer = SharedBuffer.parse(await _recv(sock, timeout_s))
        await sock.send(ACK)
        version: str | None = None
        while True:
            bucket = Bucket.parse(await _recv(sock, timeout_s))
            if bucket.tensors:
                version = await _write_bucket(state, buffer, bucket, version)
            await sock.send(ACK)  # the trainer refills the buffer only now
            if bucket.is_last:
                return
    except WeightTransferError as e:
        raise APIError(HTTPStatus.BAD_REQUEST, str(e)) from None
    finally:
        sock.close()


async def _write_bucket(state: ServerState, buffer: SharedBuffer, bucket: Bucket, version: str | None) -> str:
    entry = serialized_entry(buffer, bucket)
    ranks = await state.core.get_world_size()
    result = await state.core.update_weights_from_tensor([entry] * ranks, None, OneCallOptions(weight_version=version))
    return result.weight_version


async def _recv(sock: zmq.asyncio.Socket, timeout_s: float) -> bytes:
    try:
        return await asyncio.wait_for(sock.recv(), timeout_s)
    except TimeoutError:
        raise APIError(HTTPStatus.BAD_GATEWAY, f"the trainer sent nothing on verl's socket within {timeout_s:.0f}s; "
                       "the buckets written so far stay") from None  # fmt: skip


def _gpu_socket() -> str:
    if not torch.cuda.is_available():
        raise APIError(HTTPStatus.BAD_REQUEST, "no GPU names verl's socket here: give kwargs.zmq_handle (the "
                       "trainer's ipc:// address)", "kwargs.zmq_handle")  # fmt: skip
    return socket_path(f"GPU-{torch.cuda.get_device_properties(0).uuid}")


async def sleep(state: ServerState, kwargs: dict[str, Any], timeout_s: float) -> None:
    _only(kwargs, {"level"}, "sleep")
    await state.core.sleep(_kwarg(kwargs, "level", int, 1), ABORT, True)


async def wake_up(state: ServerState, kwargs: dict[str, Any], timeout_s: float) -> None:
    _only(kwargs, {"tags"}, "wake_up")
    await state.core.wake_up(_kwarg(kwargs, "tags", list))


# -- SkyRL --------------------------------------------------------------------------------


async def skyrl_sleep_for_weight_sync(state: ServerState, kwargs: dict[str, Any], timeout_s: float) -> None:
    _only(kwargs, {"offload_kv"}, "skyrl_sleep_for_weight_sync")
    await state.core.sleep(SKYRL_SLEEP_LEVEL, KEEP, not state.info.retains_tier)


async def skyrl_start_weight_update(state: ServerState, kwargs: dict[str, Any], timeout_s: float) -> None:
    _only(kwargs, {"is_checkpoint_format"}, "skyrl_start_weight_update")
    await state.core.start_weight_update(bool(kwargs.get("is_checkpoint_format", True)))


async def update_weights_backend(state: ServerState, kwargs: dict[str, Any], timeout_s: float) -> None:
    _only(kwargs, {"update_info"}, "update_weights_ipc")
    await state.core.update_weights({"update_info": _kwarg(kwargs, "update_info", dict)})


async def skyrl_finish_weight_update(state: ServerState, kwargs: dict[str, Any], timeout_s: float) -> None:
    _only(kwargs, set(), "skyrl_finish_weight_update")
    await state.core.finish_weight_update()


async def liveness_probe(state: ServerState, kwargs: dict[str, Any], timeout_s: float) -> None:
    await asyncio.wait_for(state.core.get_info(), timeout_s)


METHODS: dict[str, Method] = {
    "update_weights_from_ipc": update_weights_from_ipc,
    "sleep": sleep,
    "wake_up": wake_up,
    "skyrl_sleep_for_weight_sync": skyrl_sleep_for_weight_sync,
    "skyrl_wake_for_weight_sync": wake_up,
    "skyrl_start_weight_update": skyrl_start_weight_update,
    "update_weights_ipc": update_weights_backend,
    "update_weights_nccl": update_weights_backend,
    "skyrl_finish_weight_update": skyrl_finish_weight_update,
    "liveness_probe": liveness_probe,
}
