"""Request body -> ``SamplingParams``: OpenAI's defaults where the body leaves a field out."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from transformers import PreTrainedTokenizerBase

from siesta.entrypoints.server.errors import APIError
from siesta.entrypoints.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from siesta.sampling import SamplingParams
from siesta.tokenizer import bad_words_token_ids

# OpenAI's defaults for fields a body may send as null.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
TOP_K_OFF = 0
DEFAULT_MIN_P = 0.0
DEFAULT_REPETITION_PENALTY = 1.0
DEFAULT_ADDITIVE_PENALTY = 0.0
# OpenAI's range for a logit_bias value; vLLM clamps what lies outside it rather than refusing.
MAX_ABS_LOGIT_BIAS = 100.0
_BAD_REQUEST = 400
# echo with max_tokens 0 (the prompt alone, as vLLM and OpenAI allow) still samples this many
# tokens, which the response leaves out: every request samples at least one.
ECHO_ONLY_MAX_TOKENS = 1


def _or(value, default):
    return default if value is None else value


def _common(
    body: SamplingFields, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
) -> SamplingParams:
    # vLLM's rule: a stream has nowhere to put them (echo's, asked for by logprobs, ride in its text).
    if body.stream and body.prompt_logprobs:
        raise APIError(_BAD_REQUEST, "prompt_logprobs are not available when stream=true", "prompt_logprobs")
    return SamplingParams(
        n=body.n,
        temperature=_or(body.temperature, DEFAULT_TEMPERATURE),
        top_p=_or(body.top_p, DEFAULT_TOP_P),
        top_k=_or(body.top_k, TOP_K_OFF),
        min_p=_or(body.min_p, DEFAULT_MIN_P),
        seed=body.seed,
        presence_penalty=_or(body.presence_penalty, DEFAULT_ADDITIVE_PENALTY),
        frequency_penalty=_or(body.frequency_penalty, DEFAULT_ADDITIVE_PENALTY),
        repetition_penalty=_or(body.repetition_penalty, DEFAULT_REPETITION_PENALTY),
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logit_bias=_logit_bias(body.logit_bias),
        allowed_token_ids=body.allowed_token_ids,
        bad_words=body.bad_words,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
    )


def echo_only(body: CompletionRequest) -> bool:
    """echo with max_tokens 0: the response is the prompt alone."""
    return bool(body.echo) and body.max_tokens == 0


def token_id_keys(bias: dict[Any, Any]) -> dict[Any, Any]:
    """A logit_bias's JSON keys ("5") as the token ids they name; a key that is no integer is
    left as it is, for SamplingParams to refuse by name."""
    out: dict[Any, Any] = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            key = int(key)
        out[key] = value
    return out


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's string keys as token ids, each bias clamped to [-100, 100] (vLLM's from_optional)."""
    if bias is None:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids (integers), got {key!r}") from None
        if not math.isfinite(value):  # clamped, NaN would read as -100 (max(-100, nan) is -100)
            raise ValueError(f"logit_bias must map token ids to finite numbers, got {value} for token {key}")
        out[token_id] = min(MAX_ABS_LOGIT_BIAS, max(-MAX_ABS_LOGIT_BIAS, value))
    return out


def tokenize_params(
    params: SamplingParams, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int
) -> SamplingParams:
    """What the core cannot do itself: bad words as token ids; and every field's token ids checked
    against the vocabulary, so that a bad one is a 400 naming its field. Slow for long bad-word
    lists: the routes run it in a worker thread."""
    if params.bad_words:
        if tokenizer is None:
            raise APIError(_BAD_REQUEST, "bad_words need a tokenizer, and this model has none", "bad_words")
        try:
            token_ids = bad_words_token_ids(tokenizer, params.bad_words)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - tokenizers raise many types on odd text (lone surrogates, ...)
            raise APIError(_BAD_REQUEST, f"cannot tokenize bad_words: {e}", "bad_words") from None
        params = params.replace(bad_words_token_ids=token_ids)
    params.verify_token_ids(vocab_size)
    return params


def completion_params(body: CompletionRequest) -> SamplingParams:
    # vLLM: echo's logprobs cover the prompt too, so they ask for prompt logprobs of the same n.
    prompt_logprobs = body.logprobs if body.prompt_logprobs is None and body.echo else body.prompt_logprobs
    max_tokens = ECHO_ONLY_MAX_TOKENS if echo_only(body) else body.max_tokens
    return _common(body, max_tokens, body.logprobs, prompt_logprobs)


def chat_params(body: ChatCompletionRequest) -> SamplingParams:
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(_BAD_REQUEST, "top_logprobs needs logprobs=true", "top_logprobs")
    logprobs = _or(body.top_logprobs, 0) if body.logprobs else None
    max_tokens = _or(body.max_completion_tokens, body.max_tokens)
    return _common(body, max_tokens, logprobs, body.prompt_logprobs)


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The ``index``-th of n samples: one output each, and a seed of its own so they differ."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)
