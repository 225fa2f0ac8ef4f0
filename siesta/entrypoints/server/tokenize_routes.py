"""vLLM's /tokenize and /detokenize: the server's own tokenizer, so a client's token ids are
exactly the ones the engine would use (RL frameworks send token ids, never text).

``/tokenize`` takes a ``prompt`` (with ``add_special_tokens``) or chat ``messages`` (with
``add_generation_prompt``) and answers ``count``, ``max_model_len``, ``tokens`` and, when
``return_token_strs``, ``token_strs``. ``/detokenize`` takes ``tokens`` and answers ``prompt``.
Fields of vLLM's that siesta does not implement are refused by name.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, StrictBool, model_validator
from transformers import PreTrainedTokenizerBase

from siesta.entrypoints.server.errors import APIError
from siesta.entrypoints.server.limits import content_chars
from siesta.entrypoints.server.prompts import chat_prompt
from siesta.entrypoints.server.protocol import ChatMessage, TokenId
from siesta.entrypoints.server.state import ServerState, server_state

router = APIRouter(tags=["tokenizer"])


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None  # vLLM: True for a prompt, False for messages
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[TokenId]


def _tokenizer(state: ServerState) -> PreTrainedTokenizerBase:
    if state.llm.tokenizer is None:
        raise APIError(HTTPStatus.BAD_REQUEST, "this model has no tokenizer: it takes and returns token ids only")
    return state.llm.tokenizer


def _encode(tokenizer: PreTrainedTokenizerBase, body: TokenizeRequest) -> list[int]:
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        try:
            return list(tokenizer.encode(body.prompt, add_special_tokens=special))
        except Exception as e:  # noqa: BLE001 - tokenizers raise many types on odd text (lone surrogates, ...)
            raise APIError(HTTPStatus.BAD_REQUEST, f"cannot tokenize the prompt: {e}", "prompt") from None
    if body.add_special_tokens:
        raise APIError(HTTPStatus.BAD_REQUEST, "add_special_tokens with messages is not supported: the chat "
                       "template places the special tokens", "add_special_tokens")  # fmt: skip
    return chat_prompt(tokenizer, body.messages, body.add_generation_prompt).token_ids


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state = server_state(request)
    state.check_model(body.model)
    tokenizer = _tokenizer(state)
    chars = len(body.prompt) if body.prompt is not None else content_chars(body.messages)
    state.prompt_limit.check_text(chars, "prompt" if body.prompt is not None else "messages")
    ids = await asyncio.to_thread(_encode, tokenizer, body)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": state.info.max_model_len, "tokens": ids}
    out["token_strs"] = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return out


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    state = server_state(request)
    state.check_model(body.model)
    tokenizer = _tokenizer(state)
    bad = next((t for t in body.tokens if not 0 <= t < state.info.vocab_size), None)
    if bad is not None:
        raise APIError(HTTPStatus.BAD_REQUEST, f"token id {bad} is outside the vocabulary [0, {state.info.vocab_size})",
                       "tokens")  # fmt: skip
    return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens)}
