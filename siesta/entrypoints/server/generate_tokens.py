"""POST /inference/v1/generate: vLLM's token-in/token-out route (prime-rl drives it).

The body is ``token_ids`` and vLLM's ``sampling_params`` object, field for field; the answer
is each choice's ``token_ids`` with chat-style ``logprobs``, the ``prompt_logprobs`` when
asked, the usage and the weight version. No text is produced or returned: the caller owns
the tokenizer, so it never re-tokenizes what the policy sampled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import logging
import uuid
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.background import BackgroundTask

from siesta.entrypoints.server.async_llm import Choice
from siesta.entrypoints.server.disconnect import abort_on_disconnect
from siesta.entrypoints.server.errors import APIError
from siesta.entrypoints.server.generation_io import EVENT_STREAM, collect, stream_events
from siesta.entrypoints.server.jsonio import AsciiJSONResponse
from siesta.entrypoints.server.limits import check_fanout
from siesta.entrypoints.server.prompts import completion_prompts
from siesta.entrypoints.server.protocol import Int, StreamOptions, TokenId
from siesta.entrypoints.server.responses import (
    chat_logprobs,
    prompt_logprobs_json,
    routed_experts,
    stamp_chunk,
    usage,
    weight_version,
    weight_versions,
)
from siesta.entrypoints.server.sampling_params import token_id_keys
from siesta.entrypoints.server.state import REQUEST_ID_HEADER, server_state
from siesta.output_processor import OutputProcessor
from siesta.sampling import SamplingParams

router = APIRouter()
_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# vLLM's SamplingParams fields siesta does not implement (refused by name unless left at off).
NOT_IMPLEMENTED = frozenset({
    "best_of", "logit_bias", "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "output_kind",
    "detokenize", "guided_decoding", "structured_outputs", "logits_processors", "extra_args", "flat_logprobs",
    "logprob_token_ids", "skip_clone",
})  # fmt: skip
_OFF_VALUES: tuple[Any, ...] = (None, False, [], {}, 1)
CACHE_SALT = "cache_salt"
# How alike an unknown field and a sampling field must be for the first to read as a misspelling.
TYPO_CUTOFF = 0.8
logger = logging.getLogger(__name__)


class TokensGenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # vLLM's GenerateRequest; kv_transfer_params et al. are refused

    token_ids: list[TokenId]
    sampling_params: dict[str, Any] = {}
    request_id: str | None = None
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: Int = 0


@router.post("/inference/v1/generate")
async def generate_tokens(body: TokensGenerateRequest, request: Request) -> Response:
    state = server_state(request)
    state.check_model(body.model)
    if body.priority != 0:
        raise APIError(HTTPStatus.BAD_REQUEST, "priority scheduling is not supported by siesta; leave priority at 0",
                       "priority")  # fmt: skip
    params = _sampling_params(body.sampling_params).with_routing(state.info.records_routing)
    cache_salt = body.cache_salt if body.cache_salt is not None else _salt_in(body.sampling_params)
    check_fanout(1, params.n, state.config.max_request_fanout)
    prompts = await asyncio.to_thread(
        completion_prompts, state.llm.tokenizer, body.token_ids, state.info.vocab_size, state.prompt_limit
    )
    state.prompt_limit.check_completion(len(prompts[0].token_ids), params.max_tokens, params.min_tokens)
    rid = body.request_id or request.headers.get(REQUEST_ID_HEADER) or f"gen-{uuid.uuid4().hex}"
    generation = await state.llm.generate(rid, prompts, params, cache_salt)
    abort_on_disconnect(request, generation)

    def envelope(choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"request_id": rid, "choices": choices}

    if body.stream:
        events = stream_events(generation, _DeltaWriter().chunks(envelope), envelope, body.stream_options)
        return StreamingResponse(events, media_type=EVENT_STREAM, background=BackgroundTask(generation.close))
    await collect(generation)
    scored = generation.choices[0].state.prompt_logprobs
    return AsciiJSONResponse(
        envelope([_choice(c) for c in generation.choices])
        | {
            "prompt_logprobs": None if scored is None else prompt_logprobs_json(scored),
            "kv_transfer_params": None,
            "usage": usage(generation),
            "weight_version": weight_version(generation),
        }
    )


def _salt_in(given: dict[str, Any]) -> str | None:
    """prime-rl's client merges its extra_body into sampling_params, so the salt arrives there."""
    salt = given.get(CACHE_SALT)
    if salt is not None and not isinstance(salt, str):
        raise APIError(HTTPStatus.BAD_REQUEST, f"sampling_params.{CACHE_SALT} must be a string, got "
                       f"{type(salt).__name__}", f"sampling_params.{CACHE_SALT}")  # fmt: skip
    return salt


def _sampling_params(given: dict[str, Any]) -> SamplingParams:
    for name, value in given.items():
        if name in _FIELDS:
            continue
        if name in NOT_IMPLEMENTED:
            if value in _OFF_VALUES:
                continue
            raise APIError(HTTPStatus.BAD_REQUEST, f"sampling_params.{name} is not supported by siesta yet; leave it out",
                           f"sampling_params.{name}")  # fmt: skip
        if name == CACHE_SALT:
            continue
        # vLLM decodes sampling_params with msgspec, which drops fields it does not know
        # (a framework's own additions): so does siesta, saying so. One that reads
        # as a misspelt sampling field would change the result silently: refused, naming it.
        close = difflib.get_close_matches(name, _FIELDS, n=1, cutoff=TYPO_CUTOFF)
        if close:
            raise APIError(HTTPStatus.BAD_REQUEST, f"sampling_params.{name} is not a vLLM sampling parameter; "
                           f"did you mean {close[0]}?", f"sampling_params.{name}")  # fmt: skip
        logger.warning("ignoring the unknown field sampling_params.%s", name)
    try:
        fields = {k: v for k, v in given.items() if k in _FIELDS}
        if isinstance(fields.get("logit_bias"), dict):  # JSON keys are strings: vLLM's msgspec reads them as ids
            fields["logit_bias"] = token_id_keys(fields["logit_bias"])
        return SamplingParams(**fields)
    except (ValueError, TypeError) as e:
        first = str(e).split(" ", 1)[0]
        name = f"sampling_params.{first}" if first in _FIELDS else "sampling_params"
        raise APIError(HTTPStatus.BAD_REQUEST, f"sampling_params.{e}" if first in _FIELDS else str(e), name) from None


def _choice(choice: Choice) -> dict[str, Any]:
    out = OutputProcessor.completion(choice.state)
    return {
        "index": choice.index,
        "logprobs": chat_logprobs(choice.state, out.token_ids, out.logprobs),
        "finish_reason": out.finish_reason,
        "token_ids": out.token_ids,
        "weight_versions": weight_versions(choice.state),
    } | routed_experts(choice.state)


class _DeltaWriter:
    """vLLM's stream: each chunk a choice's new token ids and their logprobs."""

    def chunks(self, envelope):
        def write(changed: list[Choice]) -> list[dict[str, Any]]:
            out = []
            for choice in changed:
                delta = OutputProcessor.completion(choice.state, delta=True)
                if not (delta.token_ids or delta.finish_reason):
                    continue
                entry = {
                    "index": choice.index,
                    "logprobs": chat_logprobs(choice.state, delta.token_ids, delta.logprobs),
                    "finish_reason": delta.finish_reason,
                    "token_ids": delta.token_ids,
                }
                out.append(stamp_chunk(envelope([entry]), entry, choice.state))
            return out

        return write
