"""POST /generate: SGLang's token-in/token-out route (slime and AReaL drive it).

One prompt answers one object; a batch (``text`` or ``input_ids`` as a list of prompts, or
n > 1) answers a list, prompt by prompt and sample by sample. A stream sends cumulative
objects, as SGLang does (a batch's carry their ``index``), then ``[DONE]``. An aborted
request (``/abort_request``, a pause in abort mode) answers 200 with what it generated,
its finish reason ``abort``: slime re-sends such partial rollouts as prompt + output.

``return_logprob`` reports the sampled tokens' logprobs as SGLang does: of the distribution
they were sampled from (penalties applied, over the temperature; greedy: the raw logits), or
of the raw logits when the server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``, as SGLang's;
``logprob_start_len`` >= 0 scores the prompt's tokens from there on too (they take no
prefix-cache hits then). ``max_new_tokens`` 0 scores a prompt and generates nothing.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from siesta.entrypoints.server.async_llm import Generation
from siesta.entrypoints.server.disconnect import abort_on_disconnect
from siesta.entrypoints.server.errors import APIError, error_body
from siesta.entrypoints.server.generation_io import EVENT_STREAM, collect
from siesta.entrypoints.server.jsonio import SSE_DONE, AsciiJSONResponse, sse
from siesta.entrypoints.server.limits import check_fanout
from siesta.entrypoints.server.prompts import TokenizedPrompt, completion_prompts
from siesta.entrypoints.server.sglang.meta import LogprobOptions, answer
from siesta.entrypoints.server.sglang.protocol import OUTPUT_LOGPROBS_ONLY, GenerateRequest, SGLangSamplingParams
from siesta.entrypoints.server.sglang.top_p import CANDIDATES as TOP_P_CANDIDATES
from siesta.entrypoints.server.sglang.top_p import FLAG as TOP_P_FLAG
from siesta.entrypoints.server.sglang.top_p import Nucleus
from siesta.entrypoints.server.state import ServerState, server_state
from siesta.ipc.remote_errors import EngineDeadError
from siesta.sampling import SamplingParams

router = APIRouter(tags=["sglang"])
FINISH_ERROR = "error"
# max_new_tokens 0 (a prompt scored, nothing generated): the engine samples one token, unshown.
PROMPT_ONLY_MAX_TOKENS = 1
# SGLang's switch (RL recipes set it to match a trainer's unscaled logprobs), honoured as is.
ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
_TRUE = ("1", "true", "yes")


def original_logprobs() -> bool:
    return os.environ.get(ORIGINAL_LOGPROB_ENV, "").strip().lower() in _TRUE
# vLLM's SamplingParams names in its errors -> SGLang's, so a 400 names the field sent.
_SGLANG_NAMES = {
    "max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "seed": "sampling_seed",
    "include_stop_str_in_output": "no_stop_trim",
}  # fmt: skip


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(body: GenerateRequest, request: Request) -> Response:
    state = server_state(request)
    prompts = await _prompts(state, body)
    params = [_params(body, prompt, i, len(prompts)) for i, prompt in enumerate(prompts)]
    check_fanout(len(prompts), params[0].n, state.config.max_request_fanout)
    for prompt, p in zip(prompts, params):
        state.prompt_limit.check_completion(len(prompt.token_ids), p.max_tokens, p.min_tokens)
    options = [_logprob_options(body, prompt, i, len(prompts)) for i, prompt in enumerate(prompts)]
    ids = _choice_ids(body.rid, len(prompts), params[0].n)
    # The generation's own id: what /abort_request takes to end all of it.
    http_id = body.rid if isinstance(body.rid, str) else f"gen-{uuid.uuid4().hex}"
    try:
        generation = await state.llm.generate(http_id, prompts, params, body.extra_key, ids)
    except ValueError as e:  # a rid already in flight
        raise APIError(HTTPStatus.BAD_REQUEST, str(e), "rid") from None
    abort_on_disconnect(request, generation)
    per_choice = [options[c.index // generation.n] for c in generation.choices]
    batch = body.is_batch or params[0].n > 1
    if body.stream:
        events = _stream(generation, per_choice, batch)
        return StreamingResponse(events, media_type=EVENT_STREAM, background=BackgroundTask(generation.close))
    await collect(generation)
    answers = [answer(c, o) for c, o in zip(generation.choices, per_choice)]
    return AsciiJSONResponse(answers if batch else answers[0])


async def _prompts(state: ServerState, body: GenerateRequest) -> list[TokenizedPrompt]:
    field = "text" if body.text is not None else "input_ids"
    given = body.text if body.text is not None else body.input_ids
    try:
        return await asyncio.to_thread(
            completion_prompts, state.llm.tokenizer, given, state.info.vocab_size, state.prompt_limit
        )
    except APIError as e:
        raise APIError(e.status, e.message.replace("prompt", field, 1), field) from None


def _per_prompt(value: Any, index: int, count: int, name: str) -> Any:
    """SGLang's batch form: one value for every prompt, or a list of one per prompt."""
    if not isinstance(value, list):
        return value
    if len(value) != count:
        raise APIError(HTTPStatus.BAD_REQUEST, f"{name} holds {len(value)} entries for {count} prompts", name)
    return value[index]


def _params(body: GenerateRequest, prompt: TokenizedPrompt, index: int, count: int) -> SamplingParams:
    sp = _per_prompt(body.sampling_params, index, count, "sampling_params") or SGLangSamplingParams()
    options = _logprob_options(body, prompt, index, count)
    if isinstance(body.sampling_params, list) and len({p.n for p in body.sampling_params}) > 1:
        raise APIError(HTTPStatus.BAD_REQUEST, "every prompt's sampling_params must have the same n", "sampling_params")
    logprobs = options.top_logprobs_num if options.return_logprob else None
    scaled = not original_logprobs()
    if options.top_p is not None:
        if not scaled and options.return_logprob:
            raise APIError(HTTPStatus.BAD_REQUEST, f"sampling_params.custom_params.{TOP_P_FLAG} with return_logprob "
                           f"needs the sampled distribution's logprobs, and {ORIGINAL_LOGPROB_ENV}=1 asks for the raw "
                           "ones: siesta reports one of them per request", f"sampling_params.custom_params.{TOP_P_FLAG}")  # fmt: skip
        logprobs, scaled = TOP_P_CANDIDATES, True  # the sets are read off the likeliest tokens
    try:
        return SamplingParams(
            n=sp.n, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
            seed=sp.sampling_seed, presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty, max_tokens=PROMPT_ONLY_MAX_TOKENS if options.prompt_only
            else sp.max_new_tokens, min_tokens=sp.min_new_tokens, stop=sp.stop, stop_token_ids=sp.stop_token_ids,
            ignore_eos=sp.ignore_eos, logprobs=logprobs, prompt_logprobs=None if options.input_start is None
            else options.top_logprobs_num, skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens, include_stop_str_in_output=sp.no_stop_trim,
            scaled_logprobs=scaled, return_routed_experts=body.return_routed_experts,
            routed_experts_prompt_start=body.routed_experts_start_len,
        )  # fmt: skip
    except ValueError as e:
        raise _sampling_error(e) from None


def _sampling_error(exc: ValueError) -> APIError:
    message = str(exc)
    first = message.split(" ", 1)[0]
    if first == "logprobs":
        return APIError(HTTPStatus.BAD_REQUEST, message.replace("logprobs", "top_logprobs_num", 1), "top_logprobs_num")
    if first == "routed_experts_prompt_start":
        return APIError(HTTPStatus.BAD_REQUEST, message.replace(first, "routed_experts_start_len", 1),
                        "routed_experts_start_len")  # fmt: skip
    name = f"sampling_params.{_SGLANG_NAMES.get(first, first)}"
    return APIError(HTTPStatus.BAD_REQUEST, message.replace(first, name, 1), name)


def _logprob_options(body: GenerateRequest, prompt: TokenizedPrompt, index: int, count: int) -> LogprobOptions:
    sp = _per_prompt(body.sampling_params, index, count, "sampling_params") or SGLangSamplingParams()
    return_logprob = bool(_per_prompt(body.return_logprob, index, count, "return_logprob"))
    start = _per_prompt(body.logprob_start_len, index, count, "logprob_start_len")
    if return_logprob and start != OUTPUT_LOGPROBS_ONLY and not 0 <= start < len(prompt.token_ids):
        raise APIError(
            HTTPStatus.BAD_REQUEST,
            f"logprob_start_len must be -1 (output tokens only) or in [0, {len(prompt.token_ids)}) for this prompt, "
            f"got {start}",
            "logprob_start_len",
        )
    return LogprobOptions(
        return_logprob=return_logprob,
        top_logprobs_num=_per_prompt(body.top_logprobs_num, index, count, "top_logprobs_num") or 0,
        return_text=body.return_text_in_logprobs,
        input_start=start if return_logprob and start != OUTPUT_LOGPROBS_ONLY else None,
        prompt_only=sp.max_new_tokens == 0,
        top_p=Nucleus.of(sp) if sp.wants_top_p_sets else None,
    )


def _choice_ids(rid: str | list[str] | None, prompts: int, n: int) -> list[str] | None:
    """SGLang's request ids: ``rid`` for one prompt, ``rid_i`` per prompt of a batch, or one
    given per prompt; n samples of a prompt add ``_j``. None: siesta picks them."""
    if rid is None:
        return None
    if isinstance(rid, list):
        if len(rid) != prompts:
            raise APIError(HTTPStatus.BAD_REQUEST, f"rid holds {len(rid)} ids for {prompts} prompts", "rid")
        per_prompt = list(rid)
    else:
        per_prompt = [rid] if prompts == 1 else [f"{rid}_{i}" for i in range(prompts)]
    return per_prompt if n == 1 else [f"{r}_{j}" for r in per_prompt for j in range(n)]


async def _stream(generation: Generation, options: list[LogprobOptions], batch: bool) -> AsyncIterator[str]:
    index_of = {c.request_id: i for i, c in enumerate(generation.choices)}
    try:
        async for changed in generation.updates():
            failed = None
            for choice in changed:
                i = index_of[choice.request_id]
                yield sse(answer(choice, options[i], i if batch else None))
                if choice.state.finish_reason == FINISH_ERROR:
                    failed = choice.state.error
            if failed is not None:
                yield sse(error_body(HTTPStatus.INTERNAL_SERVER_ERROR, f"generation failed in the engine: {failed}"))
                break
    except EngineDeadError as e:
        yield sse(error_body(HTTPStatus.SERVICE_UNAVAILABLE, str(e)))
    finally:
        generation.close()
    yield SSE_DONE
