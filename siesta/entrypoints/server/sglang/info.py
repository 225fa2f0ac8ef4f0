"""SGLang's read-only routes: the model, the server, the weight version, a generating health
check. Open like SGLang's (no dev mode), and like ``/v1/models``."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from siesta import __version__
from siesta.entrypoints.server.errors import error_response
from siesta.entrypoints.server.generation_io import collect
from siesta.entrypoints.server.prompts import TokenizedPrompt
from siesta.entrypoints.server.state import ServerState, server_state
from siesta.sampling import SamplingParams

router = APIRouter(tags=["sglang"])
# SGLang's health check: one greedy token of a one-token prompt, within this many seconds.
HEALTH_CHECK_TIMEOUT_S = 20.0
HEALTH_PROMPT = [0]
_UNAVAILABLE = 503


def _model_path(state: ServerState) -> str:
    return state.config.model_path or state.info.model_name


@router.get("/get_model_info")
async def get_model_info(request: Request) -> dict[str, Any]:
    state = server_state(request)
    info = await state.core.get_info()
    return {
        "model_path": _model_path(state),
        "tokenizer_path": _model_path(state),
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": info.weight_version,
    }


@router.get("/get_server_info")
async def get_server_info(request: Request) -> dict[str, Any]:
    """SGLang's server_args and scheduler_info keys that describe this server."""
    state = server_state(request)
    info = await state.core.get_info()
    return {
        "model_path": _model_path(state),
        "tokenizer_path": _model_path(state),
        "served_model_name": state.model_names[0],
        "context_length": info.max_model_len,
        "page_size": info.block_size,
        "max_total_num_tokens": info.num_blocks * info.block_size,
        "tp_size": 1,
        "dp_size": 1,
        "skip_tokenizer_init": state.llm.tokenizer is None,
        "weight_version": info.weight_version,
        "version": __version__,
        "engine": "siesta",
    }


@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> dict[str, str]:
    return {"weight_version": (await server_state(request).core.get_info()).weight_version}


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """200 once the engine generates a token; a paused or sleeping engine is healthy, idle."""
    state = server_state(request)
    core = state.core
    if not core.is_alive:
        return error_response(_UNAVAILABLE, core.dead_reason or "the engine core is not running")
    if await core.is_paused() or await core.is_sleeping():
        return Response(status_code=200)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    generation = await state.llm.generate(f"health-{uuid.uuid4().hex}", [TokenizedPrompt(None, HEALTH_PROMPT)], params)
    try:
        await asyncio.wait_for(collect(generation), HEALTH_CHECK_TIMEOUT_S)
    except TimeoutError:
        return error_response(_UNAVAILABLE, f"no token generated within {HEALTH_CHECK_TIMEOUT_S:.0f}s")
    finally:
        generation.close()
    return Response(status_code=200)
