"""SGLang's weight routes (dev mode only), with SGLang's bodies and answers, on siesta's weight transfer.

``/init_weights_update_group`` and ``/destroy_weights_update_group`` join and leave a trainer's
group through SGLang's rendezvous; ``/update_weights_from_distributed`` (post it while the
trainer broadcasts: it answers once the bytes arrived), ``/update_weights_from_tensor`` and
``/update_weights_from_disk`` are each one whole update; ``/update_weight_version`` renames the
weights. Every answer is SGLang's ``{"success", "message", ...}``: 200 on success, else
``success: false`` with 400 (SGLang's status for any failure), 502 for a trainer that went away
mid-update and 503 for a dead engine core. So a trainer written for SGLang (slime, AReaL, verl)
drives siesta unchanged. DESIGN.md ("Weight transfer") says which fields do what.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from pydantic import BaseModel, ValidationError

from siesta.entrypoints.server.errors import describe_errors, status_for
from siesta.entrypoints.server.jsonio import AsciiJSONResponse
from siesta.entrypoints.server.sglang.weight_protocol import (
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    OneCallFields,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
)
from siesta.entrypoints.server.state import server_state
from siesta.ipc.client import EngineCoreClient
from siesta.ipc.protocol import OneCallOptions

router = APIRouter(tags=["sglang-weights"])
Body = TypeVar("Body", bound=BaseModel)


class _BadBody(ValueError):
    """The body does not parse as the route's: a 400 like any refusal."""


def _core(request: Request) -> EngineCoreClient:
    return server_state(request).core


async def _parse(request: Request, model: type[Body]) -> Body:
    # Parsed here rather than by FastAPI, so that a bad body is answered in SGLang's shape too.
    try:
        data = json.loads(await request.body() or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nested too deep
        raise _BadBody(f"the body is not valid JSON: {e}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _BadBody(describe_errors(e.errors())[0]) from None


def _options(body: OneCallFields) -> OneCallOptions:
    return OneCallOptions(
        weight_version=body.weight_version,
        abort_all_requests=body.abort_all_requests,
        flush_cache=body.flush_cache,
        empty_cache=body.torch_empty_cache,
    )


def _failure(exc: BaseException, extra: dict[str, Any]) -> AsciiJSONResponse:
    status = status_for(exc)
    if status == HTTPStatus.CONFLICT:  # a call at the wrong time: SGLang has no 409
        status = HTTPStatus.BAD_REQUEST
    return AsciiJSONResponse({"success": False, "message": str(exc), **extra}, status_code=status)


async def _answer(
    request: Request, model: type[Body], act: Callable[[EngineCoreClient, Body], Awaitable[dict[str, Any]]],
    on_failure: dict[str, Any] | None = None,
) -> AsciiJSONResponse:  # fmt: skip
    try:
        body = await _parse(request, model)
        return AsciiJSONResponse({"success": True, **await act(_core(request), body)})
    except Exception as e:  # noqa: BLE001 - every failure is answered as SGLang answers it
        return _failure(e, on_failure or {})


def _updated(version: str, missing: int) -> str:
    message = f"weights updated; weight version {version}"
    if missing:
        message += f"; {missing} weight tensors are still to be written before the engine generates"
    return message


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request) -> AsciiJSONResponse:
    async def act(core: EngineCoreClient, body: InitWeightsUpdateGroupRequest) -> dict[str, Any]:
        name = await core.init_weights_update_group(body.model_dump(exclude=set(body.model_extra or {})))
        return {"message": f"joined weight update group {name!r} as rank {body.rank_offset} of {body.world_size}"}

    return await _answer(request, InitWeightsUpdateGroupRequest, act)


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request) -> AsciiJSONResponse:
    async def act(core: EngineCoreClient, body: DestroyWeightsUpdateGroupRequest) -> dict[str, Any]:
        await core.destroy_weights_update_group(body.group_name)
        return {"message": f"left weight update group {body.group_name!r}"}

    return await _answer(request, DestroyWeightsUpdateGroupRequest, act)


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request) -> AsciiJSONResponse:
    async def act(core: EngineCoreClient, body: UpdateWeightsFromDistributedRequest) -> dict[str, Any]:
        result = await core.update_weights_from_distributed(
            body.names, body.dtypes, body.shapes, body.group_name, body.load_format, _options(body)
        )
        return {"message": _updated(result.weight_version, result.missing_tensors)}

    return await _answer(request, UpdateWeightsFromDistributedRequest, act)


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request) -> AsciiJSONResponse:
    async def act(core: EngineCoreClient, body: UpdateWeightsFromTensorRequest) -> dict[str, Any]:
        result = await core.update_weights_from_tensor(body.serialized_named_tensors, body.load_format, _options(body))
        return {"message": _updated(result.weight_version, result.missing_tensors)}

    return await _answer(request, UpdateWeightsFromTensorRequest, act)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> AsciiJSONResponse:
    async def act(core: EngineCoreClient, body: UpdateWeightsFromDiskRequest) -> dict[str, Any]:
        result = await core.update_weights_from_disk(body.model_path, _options(body))
        return {
            "message": _updated(result.weight_version, result.missing_tensors),
            "num_paused_requests": result.kept_requests,
        }

    return await _answer(request, UpdateWeightsFromDiskRequest, act, on_failure={"num_paused_requests": 0})


@router.post("/update_weight_version")
async def update_weight_version(request: Request) -> AsciiJSONResponse:
    async def act(core: EngineCoreClient, body: UpdateWeightVersionRequest) -> dict[str, Any]:
        version = await core.update_weight_version(str(body.new_version), body.abort_all_requests)
        return {
            "message": f"weight version renamed to {version}; the weights and the KV they computed are kept",
            "new_version": version,
        }

    return await _answer(request, UpdateWeightVersionRequest, act)
