"""The FastAPI application: OpenAI routes, info routes, dev-mode control routes, API key."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from transformers import PreTrainedTokenizerBase

from siesta import __version__
from siesta.config import EngineConfig
from siesta.entrypoints.server import (
    chat,
    collective_rpc,
    completions,
    dev_routes,
    generate_tokens,
    info_routes,
    primerl_routes,
    tokenize_routes,
    weight_routes,
)
from siesta.entrypoints.server.async_llm import AsyncLLM
from siesta.entrypoints.server.auth import ApiKeyMiddleware
from siesta.entrypoints.server.errors import install_error_handlers
from siesta.entrypoints.server.jsonio import AsciiJSONResponse
from siesta.entrypoints.server.limits import BodySizeLimit, PromptLimit
from siesta.entrypoints.server.sglang import control as sglang_control
from siesta.entrypoints.server.sglang import generate as sglang_generate
from siesta.entrypoints.server.sglang import info as sglang_info
from siesta.entrypoints.server.sglang import loads as sglang_loads
from siesta.entrypoints.server.sglang import weights as sglang_weights
from siesta.entrypoints.server.state import ServerConfig, ServerState
from siesta.ipc.client import EngineCoreClient
from siesta.model.loader import resolve_model

EngineStarter = Callable[[], Awaitable[tuple[EngineCoreClient, PreTrainedTokenizerBase | None]]]
logger = logging.getLogger(__name__)
# Exit code of an API server whose engine core died; the grace lets failed streams end first.
EXIT_ENGINE_DEAD = 3
ENGINE_DEATH_GRACE_S = 1.0


def build_app(config: ServerConfig, start_engine: EngineStarter) -> FastAPI:
    """The app; the engine starts with the app's lifespan and stops with it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        core, tokenizer = await start_engine()
        core.on_death = lambda reason: _exit_after_engine_death(app, reason)
        limit = await asyncio.to_thread(PromptLimit.of, tokenizer, core.info.max_model_len)
        app.state.siesta = ServerState(config, core, AsyncLLM(core, tokenizer), limit)
        core.metrics.set_model_name(app.state.siesta.model_names[0])  # vLLM's model_name label: the served name
        core.metrics.serve_fidelity(core.info.numerics_key)
        try:
            yield
        finally:
            await core.shutdown()

    app = FastAPI(title="siesta", version=__version__, lifespan=lifespan, default_response_class=AsciiJSONResponse)
    install_error_handlers(app)
    app.include_router(info_routes.router)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(tokenize_routes.router)
    app.include_router(generate_tokens.router)
    app.include_router(sglang_generate.router)
    app.include_router(sglang_info.router)
    app.include_router(sglang_loads.router)
    if config.dev_mode:
        app.include_router(dev_routes.router)
        app.include_router(weight_routes.router)
        app.include_router(sglang_control.router)
        app.include_router(sglang_weights.router)
        app.include_router(primerl_routes.router)
        app.include_router(collective_rpc.router)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_body_bytes)  # outermost: before any parsing
    return app


def _exit_after_engine_death(app: FastAPI, reason: str) -> None:
    """As vLLM does: the API server exits, non-zero, so that a supervisor restarts it. The
    requests that were in flight have their 503 already; a moment more lets it reach them."""
    logger.error("the engine core died (%s): the API server exits in %.0f s with code %d",
                 reason, ENGINE_DEATH_GRACE_S, EXIT_ENGINE_DEAD)  # fmt: skip
    app.state.exit_code = EXIT_ENGINE_DEAD
    stop = getattr(app.state, "stop_server", None)
    if stop is not None:
        asyncio.get_running_loop().call_later(ENGINE_DEATH_GRACE_S, stop)


def engine_starter(engine_config: EngineConfig) -> EngineStarter:
    """Spawns the engine core and, meanwhile, loads the tokenizer in this process."""

    async def start() -> tuple[EngineCoreClient, PreTrainedTokenizerBase | None]:
        tokenizer = asyncio.create_task(asyncio.to_thread(load_tokenizer, engine_config))
        try:
            core = await EngineCoreClient.start(engine_config)
        except BaseException:
            tokenizer.cancel()
            raise
        try:
            return core, await tokenizer
        except BaseException:
            await core.shutdown()
            raise

    return start


def load_tokenizer(engine_config: EngineConfig) -> PreTrainedTokenizerBase | None:
    model = engine_config.model
    return resolve_model(model.model, model.seed, model.tokenizer).load_tokenizer()
