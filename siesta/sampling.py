"""SamplingParams: how one request picks its tokens, field for field vLLM's.

Field names, defaults and allowed ranges follow vLLM so that clients written
for it (the OpenAI server, RL frameworks) pass their parameters unchanged.
Every invalid value raises ``ValueError`` naming the field and its range.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Any

# vLLM's default ``max_logprobs``: the most top-n logprobs one request may ask for.
MAX_LOGPROBS = 20
# vLLM treats any temperature below this as greedy: dividing by it would only overflow.
GREEDY_TEMPERATURE_EPS = 1e-5
# OpenAI's (and so vLLM's) bound on |presence_penalty| and |frequency_penalty|.
MAX_ABS_ADDITIVE_PENALTY = 2.0
# top_k values that switch top-k filtering off (vLLM accepts both).
TOP_K_DISABLED = (0, -1)
# torch.Generator.manual_seed accepts this range.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1
# vLLM's VLLM_MAX_NUM_BAD_WORDS: token sequences one request's bad_words may become.
MAX_NUM_BAD_WORDS = 128
# vLLM's VLLM_MAX_BAD_WORDS_TOTAL_TOKENS: their tokens together (what one step may have to match).
MAX_BAD_WORDS_TOTAL_TOKENS = 1024
# truncate_prompt_tokens=-1: truncate to max_model_len.
TRUNCATE_TO_MAX_MODEL_LEN = -1


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request holds (vLLM's enum, vLLM's values)."""

    CUMULATIVE = 0  # everything so far
    DELTA = 1  # only what is new since the last one
    FINAL_ONLY = 2  # nothing until the request finishes


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n; 0: only the sampled token's logprob
    # top-n at every prompt position; 0: only the prompt token's logprob. The first position has none.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True  # False: token ids only, text stays "" (and costs nothing)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never completed; normalised to a list
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens; -1: max_model_len
    # bad_words as token sequences, filled in by the front end (the engine core has no
    # tokenizer): see siesta.tokenizer.bad_words_token_ids. vLLM's _bad_words_token_ids.
    bad_words_token_ids: list[list[int]] | None = None
    # siesta's, for SGLang's /generate: logprobs of the sampled distribution's logits (bans, bias
    # and penalties applied, divided by the temperature), as SGLang reports them by default;
    # greedy rows keep the raw ones. False: vLLM's raw logprobs.
    scaled_logprobs: bool = False
    # vLLM's: with a mixture-of-experts model served with enable_return_routed_experts, the
    # routing returned starts at this prompt token (SGLang's routed_experts_start_len; at most
    # the prompt's length); see request.RoutedExperts.
    routed_experts_prompt_start: int = 0
    # SGLang's per-request return_routed_experts (vLLM returns the routing of every request once
    # the engine records it; its routes set this for each).
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        self.bad_words = _normalise_bad_words(self.bad_words)
        # Copies, so that a clone never shares a caller's (or another clone's) containers.
        if isinstance(self.logit_bias, dict):
            self.logit_bias = dict(self.logit_bias)
        if isinstance(self.allowed_token_ids, (list, tuple)):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words_token_ids, (list, tuple)):
            self.bad_words_token_ids = [list(ids) if isinstance(ids, (list, tuple)) else ids
                                        for ids in self.bad_words_token_ids]  # fmt: skip
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k not in TOP_K_DISABLED

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def reads_output_tokens(self) -> bool:
        """Whether sampling looks at the tokens generated so far (penalties, multi-token bad words),
        so that a step may not be scheduled before the last one's sample is on the host."""
        return self.has_penalties or any(len(ids) > 1 for ids in self.bad_words_token_ids or ())

    def prompt_truncation(self, max_model_len: int) -> int | None:
        """How many prompt tokens to keep (the last ones), or None to keep them all."""
        k = self.truncate_prompt_tokens
        if k is None:
            return None
        if k == TRUNCATE_TO_MAX_MODEL_LEN:
            return max_model_len
        if k > max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens must be <= max_model_len={max_model_len} (or -1 for max_model_len), got {k}"
            )
        return k

    def verify_token_ids(self, vocab_size: int) -> None:
        """Every token id a field names must index the logits: ``[0, vocab_size)``."""
        named = {
            "logit_bias": self.logit_bias or (),
            "allowed_token_ids": self.allowed_token_ids or (),
            "bad_words": [t for ids in self.bad_words_token_ids or () for t in ids],
        }
        for name, token_ids in named.items():
            bad = next((t for t in token_ids if t >= vocab_size), None)
            if bad is not None:
                raise ValueError(f"{name} holds token id {bad}, outside the vocabulary [0, {vocab_size})")

    def clone(self) -> SamplingParams:
        """A copy whose lists are its own."""
        return self.replace()

    def with_routing(self, records_routing: bool) -> SamplingParams:
        """vLLM's rule: an engine that records routing (enable_return_routed_experts) returns it
        with every request's output."""
        if not records_routing or self.return_routed_experts:
            return self
        return self.replace(return_routed_experts=True)

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed, validated again."""
        return dataclasses.replace(self, **changes)

    def _validate(self) -> None:
        _check_int("n", self.n, minimum=1)
        _check_range("temperature", self.temperature, "must be >= 0", lambda v: v >= 0.0)
        _check_range("top_p", self.top_p, "must be in (0, 1]", lambda v: 0.0 < v <= 1.0)
        _check_top_k(self.top_k)
        _check_range("min_p", self.min_p, "must be in [0, 1]", lambda v: 0.0 <= v <= 1.0)
        _check_seed(self.seed)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_range(
                name,
                getattr(self, name),
                f"must be in [-{MAX_ABS_ADDITIVE_PENALTY}, {MAX_ABS_ADDITIVE_PENALTY}]",
                lambda v: -MAX_ABS_ADDITIVE_PENALTY <= v <= MAX_ABS_ADDITIVE_PENALTY,
            )
        _check_range("repetition_penalty", self.repetition_penalty, "must be > 0", lambda v: v > 0.0)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        self._validate_min_tokens()
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=0, maximum=MAX_LOGPROBS)
        self._validate_stops()
        if not isinstance(self.output_kind, RequestOutputKind):  # a ValueError too, as every bad field
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")  # noqa: TRY004
        _check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        _check_logit_bias(self.logit_bias)
        _check_allowed_token_ids(self.allowed_token_ids)
        _check_bad_words_token_ids(self.bad_words_token_ids)
        if not isinstance(self.return_routed_experts, bool):
            raise ValueError(f"return_routed_experts must be a bool, got {self.return_routed_experts!r}")
        _check_int("routed_experts_prompt_start", self.routed_experts_prompt_start, minimum=0)

    def _validate_min_tokens(self) -> None:
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, got min_tokens={self.min_tokens}"
            )

    def _validate_stops(self) -> None:
        assert self.stop is not None and self.stop_token_ids is not None  # normalised above
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop must hold non-empty strings, got {stop!r}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, minimum=0)
        if self.stop and not self.detokenize:
            # Stop strings are matched against the text, which detokenize=False never makes.
            raise ValueError("stop strings need detokenize=True: without it there is no text to match")


def _normalise_stop(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    return list(stop)


def _normalise_stop_token_ids(token_ids: list[int] | None) -> list[int]:
    return [] if token_ids is None else list(token_ids)


def _normalise_bad_words(words: list[str] | None) -> list[str]:
    if words is None:
        return []
    if isinstance(words, str) or not isinstance(words, (list, tuple)):
        raise ValueError(f"bad_words must be a list of non-empty strings, got {words!r}")  # noqa: TRY004
    for word in words:
        if not isinstance(word, str) or not word:
            raise ValueError(f"bad_words must hold non-empty strings, got {word!r}")
    return list(dict.fromkeys(words))  # vLLM drops repeats, keeping the first


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but True is never a meant count.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    if not _is_int(value):
        raise ValueError(f"{name} must be an int {allowed}, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be {allowed}, got {value}")


def _check_range(name: str, value: Any, allowed: str, ok: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number and {allowed}, got {value!r}")
    if not ok(value):
        raise ValueError(f"{name} {allowed}, got {value}")


def _check_top_k(top_k: Any) -> None:
    if not _is_int(top_k) or top_k < min(TOP_K_DISABLED):
        raise ValueError(f"top_k must be -1 or 0 (off) or an int >= 1, got {top_k!r}")


def _check_seed(seed: Any) -> None:
    if seed is None:
        return
    if not _is_int(seed) or not MIN_SEED <= seed <= MAX_SEED:
        raise ValueError(f"seed must be None or an int in [{MIN_SEED}, {MAX_SEED}], got {seed!r}")


def _check_truncate_prompt_tokens(k: Any) -> None:
    if k is None:
        return
    if not _is_int(k) or (k < 1 and k != TRUNCATE_TO_MAX_MODEL_LEN):
        raise ValueError(f"truncate_prompt_tokens must be None, -1 (max_model_len) or an int >= 1, got {k!r}")


def _check_logit_bias(bias: Any) -> None:
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")  # noqa: TRY004
    for token_id, value in bias.items():
        _check_int("logit_bias", token_id, minimum=0)
        # Banning and forcing are allowed_token_ids' and bad_words' work: an infinite bias
        # would turn top-p's softmax into NaNs.
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"logit_bias must map token ids to finite numbers, got {value!r} for token {token_id}")


def _check_allowed_token_ids(token_ids: Any) -> None:
    if token_ids is None:
        return
    if not isinstance(token_ids, list) or not token_ids:
        raise ValueError(f"allowed_token_ids must be None or a non-empty list of token ids, got {token_ids!r}")
    for token_id in token_ids:
        _check_int("allowed_token_ids", token_id, minimum=0)


def _check_bad_words_token_ids(sequences: Any) -> None:
    name = "bad_words_token_ids"
    if sequences is None:
        return
    if not isinstance(sequences, list) or not all(isinstance(ids, list) and ids for ids in sequences):
        raise ValueError(f"{name} must be a list of non-empty lists of token ids, got {sequences!r}")
    if len(sequences) > MAX_NUM_BAD_WORDS:
        raise ValueError(f"{name} holds {len(sequences)} token sequences; at most {MAX_NUM_BAD_WORDS} are allowed")
    for ids in sequences:
        for token_id in ids:
            _check_int(name, token_id, minimum=0)
    total = sum(len(ids) for ids in sequences)
    if total > MAX_BAD_WORDS_TOTAL_TOKENS:
        raise ValueError(f"{name} holds {total} tokens in all; at most {MAX_BAD_WORDS_TOTAL_TOKENS} are allowed")
