"""prime-rl's routes (dev mode): its server (``prime_rl.inference.vllm.server``) adds these to vLLM's.

- ``/update_weights {"weight_dir"}`` (``weight_routes`` hands the body here): without a
  broadcaster, the folder prime-rl's trainer wrote (safetensors shards, an index, no
  ``config.json``) is loaded as a checkpoint of the served model's architecture; with one
  (``/init_broadcaster``), the trainer's broadcast is received instead (prime-rl only uses the
  folder for its ``NCCL_READY`` marker). Either way every tensor goes through the engine's
  checkpoint load, names and shapes checked, and the version advances.
- ``/init_broadcaster {host, port, rank_offset, inference_world_size, timeout, ...}``: join the
  trainer's group (``siesta.weight_transfer.primerl_broadcast``): NCCL where this host has a GPU
  (the API server's rank on the current device, as PyNccl joins), gloo on the CPU.
- ``/liveness``: 200 ``{"status": "ok"}`` once the engine core answers a no-op call, 503
  ``{"status": "engine_unresponsive"}`` otherwise.
- ``/load_lora_adapter`` (and vLLM's ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``):
  siesta serves no LoRA adapters, so each answers what vLLM answers with LoRA off: a 400 saying
  so (prime-rl's client retries 404 and 500 only, so it stops at once).

The broadcast is received by the API server, on a worker thread, into a folder in memory
(``/dev/shm``) that the engine then loads like any checkpoint: the engine core's calls stay as
they are, at the cost of one copy of the weights through shared memory.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from http import HTTPStatus
from pathlib import Path
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictBool
from safetensors.torch import save_file

from siesta.entrypoints.server.errors import APIError
from siesta.entrypoints.server.protocol import Float, Int
from siesta.entrypoints.server.state import server_state
from siesta.model.hf_loader import CONFIG_FILE, INDEX_FILE, SAFETENSORS_GLOB
from siesta.model.loader import resolve_model
from siesta.weight_transfer.primerl_broadcast import (
    BroadcasterInit,
    BroadcastGroup,
    join,
    join_nccl,
    receive_state_dicts,
)
from siesta.weight_transfer.wire import WeightTransferError

router = APIRouter(tags=["prime-rl"])
logger = logging.getLogger(__name__)
# How long /liveness waits for the engine core's answer (prime-rl's --liveness-timeout-seconds).
LIVENESS_TIMEOUT_S = 30.0
SHM_DIR = "/dev/shm"
LORA_OFF = ("LoRA is not enabled: siesta serves the base model only and loads no LoRA adapters; "
            "sync full weights instead (/update_weights)")  # fmt: skip
_BROADCASTER = "primerl_broadcaster"


class InitBroadcasterRequest(BaseModel):
    """prime-rl's ``init_nccl_broadcast`` body."""

    model_config = ConfigDict(extra="ignore")  # prime-rl's server reads these keys, nothing else
    host: str
    port: Int
    rank_offset: Int = 0
    inference_world_size: Int
    timeout: Float = 1200.0
    quantize_in_weight_transfer: StrictBool = False
    session_id: str = "default"


@router.post("/init_broadcaster")
async def init_broadcaster(body: InitBroadcasterRequest, request: Request) -> dict[str, str]:
    if body.quantize_in_weight_transfer:
        raise APIError(HTTPStatus.BAD_REQUEST, "quantize_in_weight_transfer sends fp8 kernel-format weights, which "
                       "siesta does not load; leave it false", "quantize_in_weight_transfer")  # fmt: skip
    init = BroadcasterInit(body.host, body.port, body.rank_offset, body.inference_world_size, body.timeout)
    _drop_broadcaster(request)
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        joining = asyncio.to_thread(join_nccl, init, device)
    else:
        joining = asyncio.to_thread(join, init)
    try:
        # NCCL's rank init has no deadline of its own: a trainer that never joins is a 502 in time.
        group = await asyncio.wait_for(joining, init.timeout_s)
    except WeightTransferError as e:
        raise APIError(HTTPStatus.BAD_REQUEST, str(e)) from None
    except (RuntimeError, TimeoutError) as e:
        raise APIError(HTTPStatus.BAD_GATEWAY, f"could not join the trainer's broadcast group: {e}") from None
    setattr(request.app.state, _BROADCASTER, group)
    return {"status": "ok"}


async def update_from_weight_dir(request: Request, weight_dir: str) -> dict[str, str]:
    """prime-rl's ``/update_weights``: the broadcast if a broadcaster is joined, else the folder."""
    state = server_state(request)
    group: BroadcastGroup | None = getattr(request.app.state, _BROADCASTER, None)
    config = await asyncio.to_thread(_served_config, request)
    folder = Path(tempfile.mkdtemp(prefix="siesta-prime-rl-", dir=SHM_DIR if os.path.isdir(SHM_DIR) else None))
    try:
        if group is not None:
            await _receive(request, group, folder)
        else:
            await asyncio.to_thread(_link_checkpoint, Path(weight_dir), folder)
        config.to_json_file(str(folder / CONFIG_FILE))
        version = await state.core.update_weights(str(folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"status": "ok", "weight_version": version}


async def _receive(request: Request, group: BroadcastGroup, folder: Path) -> None:
    def receive() -> None:
        for index, tensors in enumerate(receive_state_dicts(group)):
            if tensors:
                save_file(tensors, str(folder / f"broadcast-{index:05d}.safetensors"))

    try:
        await asyncio.to_thread(receive)
    except WeightTransferError as e:
        _drop_broadcaster(request)  # out of step with the trainer: it must init again
        raise APIError(HTTPStatus.BAD_REQUEST, f"{e}; call /init_broadcaster again") from None
    except (RuntimeError, TimeoutError) as e:
        _drop_broadcaster(request)
        raise APIError(HTTPStatus.BAD_GATEWAY, f"the weight broadcast failed ({e}); nothing was written, the "
                       "weights are unchanged; call /init_broadcaster again") from None  # fmt: skip


def _link_checkpoint(source: Path, folder: Path) -> None:
    """The trainer's shards (and index) beside the served model's config, linked, not copied."""
    if not source.is_dir():
        raise APIError(HTTPStatus.BAD_REQUEST, f"weight_dir {str(source)!r} is not a directory", "weight_dir")
    names = [p.name for p in source.glob(SAFETENSORS_GLOB)]
    if not names:
        raise APIError(HTTPStatus.BAD_REQUEST, f"weight_dir {str(source)!r} holds no {SAFETENSORS_GLOB} shards",
                       "weight_dir")  # fmt: skip
    if (source / INDEX_FILE).is_file():
        names.append(INDEX_FILE)
    for name in names:
        (folder / name).symlink_to((source / name).resolve())


def _served_config(request: Request) -> Any:
    """The served model's config (prime-rl writes none): its architecture reads the shards."""
    cached = getattr(request.app.state, "served_hf_config", None)
    if cached is None:
        cached = resolve_model(server_state(request).config.model_path).hf_config
        request.app.state.served_hf_config = cached
    return cached


def _drop_broadcaster(request: Request) -> None:
    group: BroadcastGroup | None = getattr(request.app.state, _BROADCASTER, None)
    if group is not None:
        group.close()
        setattr(request.app.state, _BROADCASTER, None)


@router.get("/liveness")
async def liveness(request: Request) -> JSONResponse:
    core = server_state(request).core
    try:
        await asyncio.wait_for(core.get_info(), LIVENESS_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - a dead core or no answer: either way not live
        return JSONResponse({"status": "engine_unresponsive"}, status_code=HTTPStatus.SERVICE_UNAVAILABLE)
    return JSONResponse({"status": "ok"})


@router.post("/load_lora_adapter")
@router.post("/v1/load_lora_adapter")
@router.post("/v1/unload_lora_adapter")
async def lora_adapter(request: Request) -> None:
    raise APIError(HTTPStatus.BAD_REQUEST, LORA_OFF, "lora_name")
