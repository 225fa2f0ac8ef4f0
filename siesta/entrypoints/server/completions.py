"""POST /v1/completions: prompts as text or token ids, streamed (SSE) or not."""

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
from siesta.entrypoints.server.limits import check_fanout
from siesta.entrypoints.server.prompts import completion_prompts, prompt_count
from siesta.entrypoints.server.protocol import CompletionRequest
from siesta.entrypoints.server.responses import json_logprob, token_text, usage, weight_version, weight_versions
from siesta.entrypoints.server.sampling_params import completion_params, tokenize_params
from siesta.entrypoints.server.state import request_id, server_state
from siesta.output_processor import OutputProcessor

router = APIRouter()
OBJECT = "text_completion"
ID_PREFIX = "cmpl"


@dataclass
class Meta:
    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": OBJECT, "created": self.created, "model": self.model, "choices": choices}


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = server_state(request)
    model = state.check_model(body.model)
    try:
        params = completion_params(body)
        truncate_to = params.prompt_truncation(state.prompt_limit.max_model_len)
        check_fanout(prompt_count(body.prompt), body.n, state.config.max_request_fanout)
        params = await asyncio.to_thread(tokenize_params, params, state.llm.tokenizer, state.info.vocab_size)
    except ValueError as e:
        raise sampling_error(e) from None
    prompts = await asyncio.to_thread(
        completion_prompts, state.llm.tokenizer, body.prompt, state.info.vocab_size, state.prompt_limit, truncate_to
    )
    for prompt in prompts:
        state.prompt_limit.check_completion(len(prompt.token_ids), params.max_tokens)
    meta = Meta(request_id(request, ID_PREFIX), model)
    generation = await state.llm.generate(meta.id, prompts, params, body.cache_salt)
    abort_on_disconnect(request, generation)
    if body.stream:
        writer = _ChunkWriter(meta, body.return_token_ids, body.return_tokens_as_token_ids)
        events = stream_events(generation, writer.chunks, meta.envelope, body.stream_options)
        return StreamingResponse(events, media_type=EVENT_STREAM, background=BackgroundTask(generation.close))
    await collect(generation)
    as_ids = body.return_tokens_as_token_ids
    choices = [_choice(c, _LogprobWriter(as_ids), body.return_token_ids) for c in generation.choices]
    extra = {"usage": usage(generation), "weight_version": weight_version(generation)}
    return AsciiJSONResponse(meta.envelope(choices) | extra)


def _choice(choice: Choice, logprobs: _LogprobWriter, return_token_ids: bool) -> dict[str, Any]:
    out = OutputProcessor.completion(choice.state)
    entry = _choice_json(choice, out.text, out.token_ids, out.logprobs, logprobs)
    entry["weight_versions"] = weight_versions(choice.state)
    if return_token_ids:
        entry |= {"token_ids": out.token_ids, "prompt_token_ids": list(choice.prompt.token_ids)}
    return entry


def _choice_json(choice: Choice, text: str, token_ids: list[int], entries, logprobs: _LogprobWriter) -> dict[str, Any]:
    state = choice.state
    return {
        "index": choice.index,
        "text": text,
        "logprobs": None if entries is None else logprobs.format(token_ids, entries),
        "finish_reason": state.finish_reason,
        "stop_reason": state.stop_reason,
    }


class _ChunkWriter:
    """Streaming deltas; keeps each choice's text offset for its logprobs.

    With ``return_token_ids`` every chunk carries its delta's ``token_ids``, and a choice's
    first chunk its ``prompt_token_ids`` (null in the later ones), as vLLM's stream does.
    """

    def __init__(self, meta: Meta, return_token_ids: bool = False, as_ids: bool = False) -> None:
        self.meta = meta
        self.return_token_ids = return_token_ids
        self.as_ids = as_ids
        self.logprobs: dict[int, _LogprobWriter] = {}

    def chunks(self, changed: list[Choice]) -> list[dict[str, Any]]:
        out = []
        for choice in changed:
            delta = OutputProcessor.completion(choice.state, delta=True)
            if not (delta.text or delta.token_ids or delta.finish_reason):
                continue
            first = choice.index not in self.logprobs
            writer = self.logprobs.setdefault(choice.index, _LogprobWriter(self.as_ids))
            entry = _choice_json(choice, delta.text, delta.token_ids, delta.logprobs, writer)
            if self.return_token_ids:
                prompt_ids = list(choice.prompt.token_ids) if first else None
                entry |= {"prompt_token_ids": prompt_ids, "token_ids": delta.token_ids}
            out.append(self.meta.envelope([entry]))
        return out


class _LogprobWriter:
    """OpenAI's legacy logprobs object: tokens, their logprobs, top alternatives, text offsets."""

    def __init__(self, as_ids: bool = False) -> None:
        self.offset = 0
        self.as_ids = as_ids  # return_tokens_as_token_ids

    def format(self, token_ids: list[int], entries: list) -> dict[str, Any]:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries):
            sampled = entry[token_id]
            text = token_text(sampled, token_id, self.as_ids)
            tokens.append(text)
            token_logprobs.append(json_logprob(sampled.logprob))
            top.append({token_text(lp, tid, self.as_ids): json_logprob(lp.logprob) for tid, lp in entry.items()})
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
