"""What the routes share: the server's settings, the engine, and the served model names."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field

from starlette.requests import Request

from siesta.entrypoints.server.async_llm import AsyncLLM
from siesta.entrypoints.server.errors import APIError
from siesta.entrypoints.server.limits import PromptLimit
from siesta.ipc.client import EngineCoreClient
from siesta.ipc.protocol import EngineInfo

DEV_MODE_ENV = "SIESTA_SERVER_DEV_MODE"
# vLLM's name for it: a vLLM serve line pasted with its environment opens the same routes.
VLLM_DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
API_KEY_ENV = "SIESTA_API_KEY"
REQUEST_ID_HEADER = "x-request-id"
_NOT_FOUND = 404
_TRUE_ENV_VALUES = ("1", "true", "yes")


def dev_mode_from_env() -> bool:
    return any(os.environ.get(name, "").strip().lower() in _TRUE_ENV_VALUES for name in (DEV_MODE_ENV, VLLM_DEV_MODE_ENV))


# prompts x n per HTTP request: a whole prompt batch of the OpenAI API, but not a queue's worth.
DEFAULT_MAX_REQUEST_FANOUT = 1024
# Far above 1,024 prompts of 4k tokens as ids; a 50 MB prompt is refused before it is parsed.
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 << 20


@dataclass
class ServerConfig:
    served_model_names: list[str] = field(default_factory=list)  # empty: the model's own name
    api_key: str | None = None
    dev_mode: bool = False
    model_path: str | None = None  # what ``siesta serve`` was given (None: the embedded model)
    # What one HTTP request may cost (siesta.entrypoints.server.limits).
    max_request_fanout: int = DEFAULT_MAX_REQUEST_FANOUT
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES


@dataclass
class ServerState:
    config: ServerConfig
    core: EngineCoreClient
    llm: AsyncLLM
    prompt_limit: PromptLimit
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def info(self) -> EngineInfo:
        assert self.core.info is not None  # set once the core is ready
        return self.core.info

    @property
    def model_names(self) -> list[str]:
        return self.config.served_model_names or [self.info.model_name]

    def check_model(self, name: str | None) -> str:
        """The served name a request addresses; 404 (as vLLM) for a model not served here."""
        if name is None or name in self.model_names:
            return name or self.model_names[0]
        raise APIError(_NOT_FOUND, f"The model `{name}` does not exist.", "model")


def server_state(request: Request) -> ServerState:
    return request.app.state.siesta


def request_id(request: Request, prefix: str) -> str:
    """The client's X-Request-Id, or a fresh one (the response's ``id``; /abort_requests takes it)."""
    given = request.headers.get(REQUEST_ID_HEADER)
    return given if given else f"{prefix}-{uuid.uuid4().hex}"
