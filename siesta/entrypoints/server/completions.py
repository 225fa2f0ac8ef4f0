"""POST /v1/completions: prompts as text or token ids, streamed (SSE) or not.

With ``echo`` a choice's text starts with its prompt's, and its logprobs (when asked for) cover
the prompt's tokens first: the first null, the others scored as prompt logprobs. A stream sends
the prompt in each choice's first chunk.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask
from transformers import PreTrainedTokenizerBase

from siesta.entrypoints.server.async_llm import Choice
from siesta.entrypoints.server.disconnect import abort_on_disconnect
from siesta.entrypoints.server.generation_io import EVENT_STREAM, collect, sampling_error, stream_events
from siesta.entrypoints.server.jsonio import AsciiJSONResponse
from siesta.entrypoints.server.limits import check_fanout
from siesta.entrypoints.server.prompts import TokenizedPrompt, completion_prompts, prompt_count
from siesta.entrypoints.server.protocol import CompletionRequest
from siesta.entrypoints.server.responses import (
    json_logprob,
    prompt_logprobs_json,
    routed_experts,
    stamp_chunk,
    token_text,
    usage,
    weight_version,
    weight_versions,
)
from siesta.entrypoints.server.sampling_params import completion_params, echo_only, tokenize_params
from siesta.entrypoints.server.state import request_id, server_state
from siesta.output_processor import OutputProcessor
from siesta.request import Logprob

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
    params = params.with_routing(state.info.records_routing)
    tokenizer = state.llm.tokenizer
    prompts = await asyncio.to_thread(
        completion_prompts, tokenizer, body.prompt, state.info.vocab_size, state.prompt_limit, truncate_to
    )
    for prompt in prompts:
        state.prompt_limit.check_completion(len(prompt.token_ids), params.max_tokens, params.min_tokens)
    echo = None
    if body.echo:
        texts = await asyncio.to_thread(_prompt_texts, tokenizer, prompts)
        echo = _Echo(texts, body.n, echo_only(body))
    meta = Meta(request_id(request, ID_PREFIX), model)
    generation = await state.llm.generate(meta.id, prompts, params, body.cache_salt)
    abort_on_disconnect(request, generation)
    as_ids = body.return_tokens_as_token_ids
    logprob_writer = functools.partial(_LogprobWriter, state.llm.processor.decode_token, body.logprobs or 0, as_ids)
    if body.stream:
        writer = _ChunkWriter(meta, logprob_writer, body.return_token_ids, echo)
        events = stream_events(generation, writer.chunks, meta.envelope, body.stream_options)
        return StreamingResponse(events, media_type=EVENT_STREAM, background=BackgroundTask(generation.close))
    await collect(generation)
    choices = [_choice(c, logprob_writer(), body.return_token_ids, echo, as_ids) for c in generation.choices]
    extra = {"usage": usage(generation), "weight_version": weight_version(generation)}
    return AsciiJSONResponse(meta.envelope(choices) | extra)


def _prompt_texts(tokenizer: PreTrainedTokenizerBase | None, prompts: list[TokenizedPrompt]) -> list[str]:
    """Each prompt's text as sent, or its token ids decoded (nothing without a tokenizer)."""
    def text(prompt: TokenizedPrompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return "" if tokenizer is None else tokenizer.decode(prompt.token_ids)

    return [text(p) for p in prompts]


_Entries = list[dict[int, Logprob] | None] | None


@dataclass
class _Echo:
    """What echo puts before each choice's completion: its prompt's text, tokens and their logprobs."""

    texts: list[str]  # per prompt
    n: int  # choices per prompt
    only: bool  # max_tokens 0: the prompt alone, the sampled token left out

    def prepend(self, choice: Choice, text: str, token_ids: list[int], entries: _Entries) -> tuple[str, list[int], _Entries]:
        prompt_ids = list(choice.prompt.token_ids)
        prompt_text = self.texts[choice.index // self.n]
        prompt_entries = None if entries is None else self._prompt_entries(choice, len(prompt_ids))
        if self.only:
            return prompt_text, prompt_ids, prompt_entries
        return prompt_text + text, prompt_ids + token_ids, None if entries is None else prompt_entries + entries

    @staticmethod
    def _prompt_entries(choice: Choice, num_prompt_tokens: int) -> list[dict[int, Logprob] | None]:
        # Complete once a token was sampled; a choice aborted before that has fewer.
        scored = choice.state.prompt_logprobs or [None]
        return scored + [None] * (num_prompt_tokens - len(scored))


def _choice(
    choice: Choice, logprobs: _LogprobWriter, return_token_ids: bool, echo: _Echo | None, as_ids: bool
) -> dict[str, Any]:
    out = OutputProcessor.completion(choice.state)
    text, token_ids, entries = out.text, out.token_ids, out.logprobs
    if echo is not None:
        text, token_ids, entries = echo.prepend(choice, text, token_ids, entries)
    entry = _choice_json(choice, text, token_ids, entries, logprobs)
    entry["weight_versions"] = weight_versions(choice.state)
    entry |= routed_experts(choice.state)
    if return_token_ids:
        entry |= {"token_ids": out.token_ids, "prompt_token_ids": list(choice.prompt.token_ids)}
    if choice.state.prompt_logprobs is not None:
        entry["prompt_logprobs"] = prompt_logprobs_json(choice.state.prompt_logprobs, as_ids)
    return entry


def _choice_json(choice: Choice, text: str, token_ids: list[int], entries: _Entries, logprobs: _LogprobWriter) -> dict[str, Any]:
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
    first chunk its ``prompt_token_ids`` (null in the later ones), as vLLM's stream does. With
    ``echo`` a choice's first chunk starts with its prompt (and its logprobs with the prompt's).
    """

    def __init__(
        self,
        meta: Meta,
        new_writer: Callable[[], _LogprobWriter],
        return_token_ids: bool = False,
        echo: _Echo | None = None,
    ) -> None:
        self.meta = meta
        self.new_writer = new_writer
        self.return_token_ids = return_token_ids
        self.echo = echo
        self.logprobs: dict[int, _LogprobWriter] = {}

    def chunks(self, changed: list[Choice]) -> list[dict[str, Any]]:
        out = []
        for choice in changed:
            delta = OutputProcessor.completion(choice.state, delta=True)
            if not (delta.text or delta.token_ids or delta.finish_reason):
                continue  # e.g. a prefill chunk's prompt logprobs: nothing to show yet
            first = choice.index not in self.logprobs
            if first:
                self.logprobs[choice.index] = self.new_writer()
            text, token_ids, entries = delta.text, delta.token_ids, delta.logprobs
            if first and self.echo is not None:
                text, token_ids, entries = self.echo.prepend(choice, text, token_ids, entries)
            entry = _choice_json(choice, text, token_ids, entries, self.logprobs[choice.index])
            if self.return_token_ids:
                prompt_ids = list(choice.prompt.token_ids) if first else None
                entry |= {"prompt_token_ids": prompt_ids, "token_ids": delta.token_ids}
            out.append(stamp_chunk(self.meta.envelope([entry]), entry, choice.state))
        return out


class _LogprobWriter:
    """OpenAI's legacy logprobs object: tokens, their logprobs, top alternatives, text offsets.

    An entry of None (an echoed prompt's first token) has a null logprob and null alternatives.
    A position shows at most ``top_n + 1`` alternatives, its own token first among a prompt
    token's (vLLM's order), the top ``top_n`` and the sampled token among a sampled one's.
    """

    def __init__(self, decode: Callable[[int], str | None], top_n: int, as_ids: bool = False) -> None:
        self.offset = 0
        self.decode = decode
        self.top_n = top_n
        self.as_ids = as_ids  # return_tokens_as_token_ids

    def format(self, token_ids: list[int], entries: list[dict[int, Logprob] | None]) -> dict[str, Any]:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries):
            if entry is None:
                text = token_text(Logprob(0.0, decoded_token=self.decode(token_id)), token_id, self.as_ids)
                token_logprobs.append(None)
                top.append(None)
            else:
                sampled = entry[token_id]
                text = token_text(sampled, token_id, self.as_ids)
                token_logprobs.append(json_logprob(sampled.logprob))
                shown = itertools.islice(entry.items(), self.top_n + 1)
                top.append({token_text(lp, tid, self.as_ids): json_logprob(lp.logprob) for tid, lp in shown})
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
