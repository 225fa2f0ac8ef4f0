"""Control routes (dev mode only): sleep, wake up, pause, resume, caches, aborts.

Names and defaults are siesta.control.EngineControl's (tests/test_control_surface.py holds them
to it); ``clear_connector_cache`` defaults to true everywhere. ``sleep``'s ``tags`` narrows what
it releases (``kv_cache``, ``weights``), as SGLang's release_memory_occupation does.
A pause or sleep with ``mode=wait`` answers once the in-flight requests have finished.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from siesta.entrypoints.server.protocol import AbortRequestsRequest
from siesta.entrypoints.server.query_types import MAX_SLEEP_LEVEL, MIN_SLEEP_LEVEL, PauseMode, QueryBool, WakeTag
from siesta.entrypoints.server.state import server_state
from siesta.ipc.client import EngineCoreClient

router = APIRouter(tags=["dev"])
SleepLevel = Annotated[int, Query(ge=MIN_SLEEP_LEVEL, le=MAX_SLEEP_LEVEL)]


def _core(request: Request) -> EngineCoreClient:
    return server_state(request).core


def _ok() -> Response:
    return Response(status_code=200)


@router.post("/sleep")
async def sleep(
    request: Request,
    level: SleepLevel = 1,
    mode: PauseMode = "abort",
    clear_connector_cache: QueryBool = True,
    tags: Annotated[list[WakeTag] | None, Query()] = None,
) -> Response:
    await _core(request).sleep(level, mode, clear_connector_cache, None if tags is None else list(tags))
    return _ok()


@router.post("/wake_up")
async def wake_up(request: Request, tags: Annotated[list[WakeTag] | None, Query()] = None) -> Response:
    await _core(request).wake_up(None if tags is None else list(tags))
    return _ok()


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict[str, bool]:
    return {"is_sleeping": await _core(request).is_sleeping()}


@router.post("/pause")
async def pause(
    request: Request, mode: PauseMode = "abort", clear_cache: QueryBool = True, clear_connector_cache: QueryBool = True
) -> Response:
    await _core(request).pause(mode, clear_cache, clear_connector_cache)
    return _ok()


@router.post("/resume")
async def resume(request: Request) -> Response:
    await _core(request).resume()
    return _ok()


@router.get("/is_paused")
async def is_paused(request: Request) -> dict[str, bool]:
    return {"is_paused": await _core(request).is_paused()}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(
    request: Request, reset_running_requests: QueryBool = False, reset_external: QueryBool = False
) -> Response:
    await _core(request).reset_prefix_cache(reset_running_requests, reset_connector=reset_external)
    return _ok()


@router.post("/abort_requests")
async def abort_requests(body: AbortRequestsRequest, request: Request) -> Response:
    await server_state(request).llm.abort(body.request_ids)
    return _ok()
