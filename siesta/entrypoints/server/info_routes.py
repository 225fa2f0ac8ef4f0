"""Routes that describe the server: models, health, version, Prometheus metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from siesta import __version__
from siesta.entrypoints.server.errors import error_response
from siesta.entrypoints.server.state import server_state

router = APIRouter()
OWNER = "siesta"
_UNAVAILABLE = 503


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = server_state(request)
    root = state.config.model_path or state.info.model_name
    version = (await state.core.get_info()).weight_version  # siesta's: the weights serving now
    cards = [
        {"id": name, "object": "model", "created": state.created, "owned_by": OWNER, "root": root, "parent": None,
         "max_model_len": state.info.max_model_len, "weight_version": version}
        for name in state.model_names
    ]  # fmt: skip
    return {"object": "list", "data": cards}


@router.get("/health")
async def health(request: Request) -> Response:
    core = server_state(request).core
    if not core.is_alive:
        return error_response(_UNAVAILABLE, core.dead_reason or "the engine core is not running")
    return Response(status_code=200)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(server_state(request).core.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
