"""SGLang's control routes (dev mode): abort, pause and continue, flush, release and resume
memory, mapped onto the engine's pause, sleep and cache calls.

- ``/pause_generation`` ``abort`` ends in-flight requests, ``retract`` freezes them and lets
  their device KV go (they load it from a tier, or recompute, on continue), ``in_place``
  freezes them with their KV. None of them drops the prefix cache or the tiers: aborted
  partial rollouts come back as prompt + output and should hit them.
- ``/release_memory_occupation`` is a level-2 sleep (SGLang discards the weights too; siesta
  reloads them from the model source if none are pushed before the wake-up). ``["kv_cache"]``
  alone keeps the weights on the device. ``cuda_graph`` names nothing of its own here: graphs
  live in the memory they were captured on and are captured again on wake-up.
  ``clear_connector_cache`` (siesta's, default true) keeps the KV tiers through it when false.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from siesta.entrypoints.server.sglang.protocol import AbortRequest, MemoryOccupationRequest, PauseGenerationRequest
from siesta.entrypoints.server.state import server_state

router = APIRouter(tags=["sglang"])
# sleep level of a release: weights and KV cache discarded (tags narrow it).
RELEASE_LEVEL = 2
_KINDS = ("weights", "kv_cache")  # what siesta's sleep and wake-up move; cuda_graph is not one
FLUSHED = "Cache flushed.\n"


def _ok(message: str) -> dict[str, str]:
    return {"message": message, "status": "ok"}


@router.post("/abort_request")
async def abort_request(body: AbortRequest, request: Request) -> Response:
    llm = server_state(request).llm
    if body.abort_all:
        await llm.abort_all()
    elif body.rid:
        await llm.abort([body.rid])
    return Response(status_code=200)


@router.post("/pause_generation")
async def pause_generation(request: Request, body: PauseGenerationRequest | None = None) -> dict[str, str]:
    state = server_state(request)
    mode = (body or PauseGenerationRequest()).mode
    keep_tier = state.info.retains_tier
    if mode == "abort":
        await state.core.pause("abort", clear_cache=False, clear_connector_cache=not keep_tier)
    else:
        await state.core.pause("keep", clear_cache=mode == "retract", clear_connector_cache=not keep_tier)
    return _ok("Generation paused successfully.")


@router.post("/continue_generation")
async def continue_generation(request: Request) -> dict[str, str]:
    core = server_state(request).core
    if await core.is_sleeping():
        # SGLang's continue only clears the pause flag, memory released or not; slime pauses
        # and continues around a push between its memory resumes. Here the last resume (the
        # engine's wake-up) continues generation.
        return _ok("Generation continues once the memory occupation is resumed.")
    await core.resume()
    return _ok("Generation continued successfully.")


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    # Blocks that running requests hold stay theirs; every cached block, on the device and in
    # the tiers, is forgotten. Unlike SGLang, this works while requests run.
    await server_state(request).core.reset_prefix_cache(reset_connector=True)
    return PlainTextResponse(FLUSHED)


@router.api_route("/release_memory_occupation", methods=["GET", "POST"])
async def release_memory_occupation(request: Request, body: MemoryOccupationRequest | None = None) -> Response:
    body = body or MemoryOccupationRequest()
    kinds = _kinds(body.tags)
    if kinds:
        tags = None if set(kinds) == set(_KINDS) else kinds
        await server_state(request).core.sleep(RELEASE_LEVEL, "abort", body.clear_connector_cache, tags)
    return Response(status_code=200)


@router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def resume_memory_occupation(request: Request, body: MemoryOccupationRequest | None = None) -> Response:
    kinds = _kinds((body or MemoryOccupationRequest()).tags)
    if kinds:
        await server_state(request).core.wake_up(kinds)
    return Response(status_code=200)


def _kinds(tags: list[str] | None) -> list[str]:
    return list(_KINDS) if tags is None else [t for t in _KINDS if t in tags]
