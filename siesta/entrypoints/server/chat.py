"""POST /v1/chat/completions: messages through the model's chat template, streamed or not."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from siesta.entrypoints.server.async_llm import Choice
from siesta.entrypoints.server.disconnect import abort_on_disconnect
from siesta.entrypoints.server.generation_io import EVENT_STREAM, collect, sampling_error, stream_events
from siesta.entrypoints.server.jsonio import AsciiJSONResponse
from siesta.entrypoints.server.limits import check_fanout, content_chars
from siesta.entrypoints.server.prompts import chat_prompt
from siesta.entrypoints.server.protocol import ChatCompletionRequest
from siesta.entrypoints.server.responses import (
    chat_logprobs,
    prompt_logprobs_json,
    routed_experts,
    stamp_chunk,
    usage,
    weight_version,
    weight_versions,
)
from siesta.entrypoints.server.sampling_params import chat_params, tokenize_params
from siesta.entrypoints.server.state import request_id, server_state
from siesta.output_processor import OutputProcessor

router = APIRouter()
OBJECT = "chat.completion"
CHUNK_OBJECT = "chat.completion.chunk"
ID_PREFIX = "chatcmpl"
ROLE = "assistant"


@dataclass
class Meta:
    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def envelope(self, choices: list[dict[str, Any]], obj: str = CHUNK_OBJECT) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = server_state(request)
    model = state.check_model(body.model)
    try:
        params = chat_params(body)
        truncate_to = params.prompt_truncation(state.prompt_limit.max_model_len)
        check_fanout(1, body.n, state.config.max_request_fanout)
        params = await asyncio.to_thread(tokenize_params, params, state.llm.tokenizer, state.info.vocab_size)
    except ValueError as e:
        raise sampling_error(e) from None
    params = params.with_routing(state.info.records_routing)
    if truncate_to is None:  # a conversation to be truncated may be longer than the model takes
        state.prompt_limit.check_text(content_chars(body.messages), "messages")
    prompt = await asyncio.to_thread(
        chat_prompt, state.llm.tokenizer, body.messages, body.add_generation_prompt, truncate_to
    )
    state.prompt_limit.check_completion(len(prompt.token_ids), params.max_tokens, params.min_tokens)
    meta = Meta(request_id(request, ID_PREFIX), model)
    generation = await state.llm.generate(meta.id, [prompt], params, body.cache_salt)
    abort_on_disconnect(request, generation)
    if body.stream:
        writer = _DeltaWriter(meta, body.return_token_ids, body.return_tokens_as_token_ids)
        events = stream_events(generation, writer.chunks, meta.envelope, body.stream_options)
        return StreamingResponse(events, media_type=EVENT_STREAM, background=BackgroundTask(generation.close))
    await collect(generation)
    choices = [_choice(c, body.return_token_ids, body.return_tokens_as_token_ids) for c in generation.choices]
    response = meta.envelope(choices, OBJECT) | {"usage": usage(generation), "weight_version": weight_version(generation)}
    if body.return_token_ids:  # vLLM's place for them: the response, not each choice (one prompt)
        response["prompt_token_ids"] = list(prompt.token_ids)
    scored = generation.choices[0].state.prompt_logprobs
    if scored is not None:  # the response's too, as vLLM puts them
        response["prompt_logprobs"] = prompt_logprobs_json(scored, body.return_tokens_as_token_ids)
    return AsciiJSONResponse(response)


def _choice(choice: Choice, return_token_ids: bool, as_ids: bool = False) -> dict[str, Any]:
    out = OutputProcessor.completion(choice.state)
    entry = {
        "index": choice.index,
        "message": {"role": ROLE, "content": out.text},
        "logprobs": chat_logprobs(choice.state, out.token_ids, out.logprobs, as_ids),
        "finish_reason": choice.state.finish_reason,
        "stop_reason": choice.state.stop_reason,
        "weight_versions": weight_versions(choice.state),
    } | routed_experts(choice.state)
    if return_token_ids:
        entry["token_ids"] = out.token_ids
    return entry


class _DeltaWriter:
    """Streaming deltas; a choice's first delta carries the role.

    With ``return_token_ids`` each chunk's choice carries its delta's ``token_ids`` and a
    choice's first chunk the prompt's ``prompt_token_ids`` (on the chunk, as vLLM sends them).
    """

    def __init__(self, meta: Meta, return_token_ids: bool = False, as_ids: bool = False) -> None:
        self.meta = meta
        self.return_token_ids = return_token_ids
        self.as_ids = as_ids
        self.started: set[int] = set()

    def chunks(self, changed: list[Choice]) -> list[dict[str, Any]]:
        out = []
        for choice in changed:
            delta = OutputProcessor.completion(choice.state, delta=True)
            first = choice.index not in self.started
            if not (first or delta.text or delta.token_ids or delta.finish_reason):
                continue
            self.started.add(choice.index)
            message: dict[str, Any] = {"role": ROLE, "content": delta.text} if first else {"content": delta.text}
            entry = {
                "index": choice.index,
                "delta": message,
                "logprobs": chat_logprobs(choice.state, delta.token_ids, delta.logprobs, self.as_ids),
                "finish_reason": choice.state.finish_reason,
                "stop_reason": choice.state.stop_reason,
            }
            chunk = self.meta.envelope([entry])
            if self.return_token_ids:
                entry["token_ids"] = delta.token_ids
                if first:
                    chunk["prompt_token_ids"] = list(choice.prompt.token_ids)
            out.append(stamp_chunk(chunk, entry, choice.state))
        return out
