"""SGLang's answer to a generate request: ``text``, ``output_ids`` and ``meta_info``.

``meta_info`` carries what RL frameworks read back: the request id, the finish reason as
SGLang shapes it (``{"type": "stop", "matched": ...}``, ``{"type": "length", "length": N}``,
``{"type": "abort", "message": ...}``), token counts, prefix-cache hits, the weight version,
and, when asked, the sampled tokens' logprobs as ``[logprob, token_id, text]`` triples.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from siesta.entrypoints.server.async_llm import Choice
from siesta.entrypoints.server.responses import json_logprob, top_entries, weight_versions
from siesta.entrypoints.server.sglang.top_p import Nucleus, TopPSets
from siesta.output_processor import RequestState
from siesta.request import Logprob

ABORT_MESSAGE = "the request was aborted"


@dataclass(frozen=True)
class LogprobOptions:
    """What one prompt's answer reports (SGLang's per-request fields)."""

    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_text: bool = False  # return_text_in_logprobs
    input_start: int | None = None  # logprob_start_len, when the prompt's tokens are scored too
    prompt_only: bool = False  # max_new_tokens 0: the engine's one sampled token is not shown
    top_p: Nucleus | None = None  # slime's custom_params.return_top_p_token_ids: the rule its sets follow


def finish_reason(state: RequestState) -> dict[str, Any] | None:
    reason = state.finish_reason
    if reason is None:
        return None
    if reason == "stop":
        # A stop string or stop token is siesta's stop_reason; EOS is none, and is the last token.
        matched = state.stop_reason if state.stop_reason is not None else (state.token_ids or [None])[-1]
        return {"type": "stop", "matched": matched}
    if reason == "length":
        return {"type": "length", "length": len(state.token_ids)}
    return {"type": "abort", "message": state.error or ABORT_MESSAGE}


def answer(choice: Choice, options: LogprobOptions, index: int | None = None) -> dict[str, Any]:
    """The whole answer so far (SGLang's stream chunks are cumulative too)."""
    state = choice.state
    shown = 0 if options.prompt_only else len(state.token_ids)
    out: dict[str, Any] = {
        "text": "" if options.prompt_only else state.text,
        "output_ids": list(state.token_ids[:shown]),
        "meta_info": _meta(choice, options, shown),
    }
    if index is not None:
        out["index"] = index
    return out


def _meta(choice: Choice, options: LogprobOptions, shown: int) -> dict[str, Any]:
    state = choice.state
    reason = finish_reason(state)
    if options.prompt_only and reason is not None and reason["type"] != "abort":
        reason = {"type": "length", "length": 0}
    meta: dict[str, Any] = {
        "id": choice.request_id,
        "finish_reason": reason,
        "prompt_tokens": len(choice.prompt.token_ids),
        "completion_tokens": shown,
        "cached_tokens": max(state.num_cached_tokens, 0),
        "weight_version": state.weight_version,
        "weight_versions": weight_versions(state),  # siesta's: which version sampled which tokens
    }
    sets = _top_p_sets(state, options, shown)
    if options.return_logprob:
        meta |= _output_logprobs(state, options, shown, sets) | _input_logprobs(state, options)
    if sets is not None:
        meta |= sets.meta()
    if state.routed_experts is not None:  # SGLang's layout: base64 of int32 [rows, layers, top_k]
        meta["routed_experts"] = state.routed_experts.sglang_base64()
        meta["routed_experts_start_len"] = state.routed_experts.start
    if state.finished:
        meta["e2e_latency"] = time.monotonic() - state.arrival
    return meta


def _top_p_sets(state: RequestState, options: LogprobOptions, shown: int) -> TopPSets | None:
    """The sampled tokens' top-p sets, once the request finished (as slime's patch sends them)."""
    if options.top_p is None or not state.finished or not shown:
        return None
    return TopPSets.of(options.top_p, list(state.token_ids[:shown]), (state.logprobs or [])[:shown])


def _output_logprobs(state: RequestState, options: LogprobOptions, shown: int, sets: TopPSets | None) -> dict[str, Any]:
    entries = (state.logprobs or [])[:shown]
    triples = [_triple(t, e[t], options.return_text) for t, e in zip(state.token_ids, entries)]
    if sets is not None:  # SGLang's patch: each logprob over the token's set
        for i, (t, e) in enumerate(zip(state.token_ids, entries)):
            triples[i][0] = json_logprob(sets.renormalised(i, t, e))
    out: dict[str, Any] = {"output_token_logprobs": triples}
    if options.top_logprobs_num > 0:
        out["output_top_logprobs"] = [_top(e, options) for e in entries]
    return out


def _input_logprobs(state: RequestState, options: LogprobOptions) -> dict[str, Any]:
    """The prompt's tokens from ``logprob_start_len`` on; the first prompt token has none."""
    if options.input_start is None or state.prompt_logprobs is None:
        return {}
    positions = range(options.input_start, len(state.prompt_logprobs))
    prompt = state.prompt_token_ids
    triples = []
    for i in positions:
        entry = state.prompt_logprobs[i]
        triples.append([None, prompt[i], None] if entry is None else _triple(prompt[i], entry[prompt[i]], options.return_text))
    out: dict[str, Any] = {"input_token_logprobs": triples}
    if options.top_logprobs_num > 0:
        out["input_top_logprobs"] = [None if state.prompt_logprobs[i] is None else _top(state.prompt_logprobs[i], options)
                                     for i in positions]  # fmt: skip
    return out


def _top(entry: dict[int, Logprob], options: LogprobOptions) -> list[list[Any]]:
    return [_triple(t, lp, options.return_text) for t, lp in top_entries(entry, options.top_logprobs_num)]


def _triple(token_id: int, entry: Logprob, with_text: bool) -> list[Any]:
    return [json_logprob(entry.logprob), token_id, entry.decoded_token if with_text else None]
