"""SamplingParams: how one request picks its tokens, field for field vLLM's.

Field names, defaults and allowed ranges follow vLLM so that clients written
for it (the OpenAI server, RL frameworks) pass their parameters unchanged.
Every invalid value raises ``ValueError`` naming the field and its range.
"""

from __future__ import annotations

import dataclasses
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

    def __post_init__(self) -> None:
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
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

    def clone(self) -> SamplingParams:
        """A copy whose lists are its own."""
        return self.replace()

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


def _normalise_stop(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    return list(stop)


def _normalise_stop_token_ids(token_ids: list[int] | None) -> list[int]:
    return [] if token_ids is None else list(token_ids)


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
