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
from siesta.output_processor import RequestState
from siesta.request import Logprob

ABORT_MESSAGE = "the request was aborted"


@dataclass(frozen=True)
class LogprobOptions:
    """What one prompt's answer reports of logprobs (SGLang's per-request fields)."""

    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_text: bool = False  # return_text_in_logprobs


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
    out: dict[str, Any] = {"text": state.text, "output_ids": list(state.token_ids), "meta_info": _meta(choice, options)}
    if index is not None:
        out["index"] = index
    return out


def _meta(choice: Choice, options: LogprobOptions) -> dict[str, Any]:
    state = choice.state
    meta: dict[str, Any] = {
        "id": choice.request_id,
        "finish_reason": finish_reason(state),
        "prompt_tokens": len(choice.prompt.token_ids),
        "completion_tokens": len(state.token_ids),
        "cached_tokens": max(state.num_cached_tokens, 0),
        "weight_version": state.weight_version,
        "weight_versions": weight_versions(state),  # siesta's: which version sampled which tokens
    }
    if options.return_logprob and state.logprobs is not None:
        meta["output_token_logprobs"] = [
            _triple(tid, entry[tid], options.return_text) for tid, entry in zip(state.token_ids, state.logprobs)
        ]
        if options.top_logprobs_num > 0:
            meta["output_top_logprobs"] = [
                [_triple(t, lp, options.return_text) for t, lp in top_entries(entry, options.top_logprobs_num)]
                for entry in state.logprobs
            ]
    if state.finished:
        meta["e2e_latency"] = time.monotonic() - state.arrival
    return meta


def _triple(token_id: int, entry: Logprob, with_text: bool) -> list[Any]:
    return [json_logprob(entry.logprob), token_id, entry.decoded_token if with_text else None]
