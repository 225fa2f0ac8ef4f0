"""Pieces both OpenAI routes share: usage, weight versions, logprob values JSON can carry,
token texts."""

from __future__ import annotations

import math
from typing import Any

from siesta.entrypoints.server.async_llm import Generation
from siesta.output_processor import RequestState
from siesta.request import Logprob

# JSON has no -inf; vLLM reports impossible tokens at this value.
LOGPROB_FLOOR = -9999.0


def json_logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def usage(generation: Generation) -> dict[str, Any]:
    prompt_tokens = sum(len(p.token_ids) for p in generation.prompts)
    completion_tokens = sum(len(c.state.token_ids) for c in generation.choices)
    # Each prompt's cache hits, counted once (its first choice), as its tokens are.
    cached = sum(max(c.state.num_cached_tokens, 0) for c in generation.choices[:: generation.n])
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def weight_versions(state: RequestState) -> list[dict[str, Any]]:
    """Which weights sampled which output tokens: [start, end) spans, one unless an update
    landed while the request ran (issue: pause(keep) across a weight update)."""
    return [{"weight_version": s.weight_version, "start": s.start, "end": s.end} for s in state.weight_versions]


def stamp_chunk(chunk: dict[str, Any], entry: dict[str, Any], state: RequestState) -> dict[str, Any]:
    """A streamed chunk names the weights of its tokens; a choice's finishing chunk carries its
    spans (and its routing, where recorded), as the whole response would."""
    chunk["weight_version"] = state.weight_version
    if state.finished:
        entry["weight_versions"] = weight_versions(state)
        entry |= routed_experts(state)
    return chunk


def routed_experts(state: RequestState) -> dict[str, Any]:
    """vLLM's per-choice ``routed_experts`` (a finished choice's routing, where the engine records
    it; see ``RoutedExperts.npy_base64``), or nothing."""
    return {} if state.routed_experts is None else {"routed_experts": state.routed_experts.npy_base64()}


def weight_version(generation: Generation) -> str:
    """The version of the weights the response's last tokens came from."""
    return generation.choices[0].state.weight_version


def token_text(entry: Logprob, token_id: int, as_id: bool = False) -> str:
    """A token as text; as vLLM's ``token_id:<id>`` without a tokenizer, or when the request
    asked for ``return_tokens_as_token_ids`` (text that does not round-trip is no use to RL)."""
    if as_id or entry.decoded_token is None:
        return f"token_id:{token_id}"
    return entry.decoded_token


def top_entries(entries: dict[int, Logprob], limit: int) -> list[tuple[int, Logprob]]:
    """The ``limit`` best alternatives by rank (the sampled token is reported separately)."""
    ranked = sorted(entries.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0, -kv[1].logprob))
    return ranked[:limit]


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None], as_ids: bool = False) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token null (the first) or ``{token id: {logprob,
    rank, decoded_token}}``, the prompt token first; -inf as vLLM clamps it."""
    return [
        None if entry is None else {str(tid): _prompt_logprob_json(lp, tid, as_ids) for tid, lp in entry.items()}
        for entry in entries
    ]


def _prompt_logprob_json(entry: Logprob, token_id: int, as_id: bool) -> dict[str, Any]:
    return {"logprob": json_logprob(entry.logprob), "rank": entry.rank, "decoded_token": token_text(entry, token_id, as_id)}


def chat_logprobs(
    state: RequestState, token_ids: list[int], entries: list[dict[int, Logprob]] | None, as_ids: bool = False
) -> dict[str, Any] | None:
    """OpenAI's chat logprobs object (also vLLM's /inference/v1/generate): one entry per token
    with its ``top_logprobs``."""
    if entries is None:
        return None
    limit = state.params.logprobs or 0
    content = []
    for token_id, entry in zip(token_ids, entries):
        top = [_token_json(tid, lp, as_ids) for tid, lp in top_entries(entry, limit)]
        content.append(_token_json(token_id, entry[token_id], as_ids) | {"top_logprobs": top})
    return {"content": content}


def _token_json(token_id: int, entry: Logprob, as_id: bool = False) -> dict[str, Any]:
    text = token_text(entry, token_id, as_id)
    return {"token": text, "logprob": json_logprob(entry.logprob), "bytes": list(text.encode("utf-8", "replace"))}
