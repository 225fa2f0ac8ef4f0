"""Weight routes (dev mode only): vLLM's weight-transfer API, checkpoint loads, the version.

``/init_weight_transfer_engine`` {"init_info"}, ``/start_weight_update``
{"is_checkpoint_format"}, ``/update_weights`` {"update_info"} (or siesta's {"model_path"}),
``/finish_weight_update`` {"weight_version"}, ``/get_world_size``: the bodies are vLLM's, so
a trainer written for vLLM's routes drives siesta. With the nccl backend ``/update_weights``
answers once the trainer's broadcasts have arrived: post it while broadcasting.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from siesta.entrypoints.server import primerl_routes
from siesta.entrypoints.server.protocol import (
    FinishWeightUpdateRequest,
    InitWeightTransferRequest,
    StartWeightUpdateRequest,
    UpdateWeightsRequest,
)
from siesta.entrypoints.server.state import server_state
from siesta.ipc.client import EngineCoreClient

router = APIRouter(tags=["weights"])


def _core(request: Request) -> EngineCoreClient:
    return server_state(request).core


def _version(value: str | int | None) -> str | None:
    return None if value is None else str(value)


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(body: InitWeightTransferRequest, request: Request) -> dict[str, str]:
    await _core(request).init_weight_transfer_engine(body.init_info)
    return {"message": "weight transfer initialised"}


@router.post("/start_weight_update")
async def start_weight_update(request: Request, body: StartWeightUpdateRequest | None = None) -> dict[str, str]:
    await _core(request).start_weight_update((body or StartWeightUpdateRequest()).is_checkpoint_format)
    return {"message": "weight update started"}


@router.post("/update_weights")
async def update_weights(body: UpdateWeightsRequest, request: Request) -> dict[str, str]:
    if body.weight_dir is not None:
        return await primerl_routes.update_from_weight_dir(request, body.weight_dir)
    weights = body.model_path if body.update_info is None else {"update_info": body.update_info}
    version = await _core(request).update_weights(weights, _version(body.weight_version))
    return {"weight_version": version}


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request, body: FinishWeightUpdateRequest | None = None) -> dict[str, str]:
    version = await _core(request).finish_weight_update(_version((body or FinishWeightUpdateRequest()).weight_version))
    return {"weight_version": version}


@router.get("/get_world_size")
async def get_world_size(request: Request) -> dict[str, int]:
    return {"world_size": await _core(request).get_world_size()}


@router.get("/weight_version")
async def weight_version(request: Request) -> dict[str, str]:
    return {"weight_version": await _core(request).get_weight_version()}
