"""Frontend side of a request: detokenize, apply stop strings, shape vLLM-style outputs, time it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from siesta.metrics import MetricsRegistry
from siesta.request import (
    CompletionOutput,
    EngineCoreOutput,
    Logprob,
    PromptLogprobs,
    RequestOutput,
    RoutedExperts,
    WeightVersionSpan,
)
from siesta.sampling import SamplingParams
from siesta.tokenizer import IncrementalDetokenizer, find_stop


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    arrival: float = field(default_factory=time.monotonic)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    # One entry per prompt token scored so far (None for the first), when asked for.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    weight_version: str = "0"
    weight_versions: list[WeightVersionSpan] = field(default_factory=list)
    error: str | None = None
    routed_experts: RoutedExperts | None = None  # on the finishing output, where asked for
    last_token_time: float | None = None
    last_delta_chars: int = 0  # text added by the latest tokens, where a stop string may end
    # Where the caller's last delta ended (streaming).
    sent_text: int = 0
    sent_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, metrics: MetricsRegistry) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.states: dict[str, RequestState] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams) -> RequestState:
        detok = None
        if self.tokenizer is not None and params.detokenize:
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.spaces_between_special_tokens
            )
        state = RequestState(request_id, prompt, prompt_token_ids, params, detok)
        if params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]  # nothing precedes the first prompt token
        self.states[request_id] = state
        return state

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestState], list[str]]:
        """Apply core outputs; returns the states that changed and the ids the core must abort (stop strings)."""
        changed: dict[str, RequestState] = {}  # each once, in order: one batch may hold several steps
        to_abort: list[str] = []
        now = time.monotonic()
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None or state.finished:
                continue
            self._apply(state, out, now)
            if out.finish_reason is None and self._check_stop_strings(state):
                to_abort.append(state.request_id)
            if state.finished:
                self._finish(state, now)
            changed[state.request_id] = state
        return list(changed.values()), to_abort

    def _apply(self, state: RequestState, out: EngineCoreOutput, now: float) -> None:
        state.num_cached_tokens = out.num_cached_tokens
        if out.new_token_ids or not state.token_ids:
            # The version of the weights that sampled the last token (an abort carries no token:
            # its answer says which weights produced what it returns, as its spans do).
            state.weight_version = out.weight_version
        if out.new_token_ids:
            if state.last_token_time is None:
                self.metrics.observe("time_to_first_token_seconds", now - state.arrival)
            else:
                self.metrics.observe("inter_token_latency_seconds", now - state.last_token_time)
            state.last_token_time = now
        if out.new_token_ids:
            self._extend_spans(state, out.weight_version, len(out.new_token_ids))
        state.token_ids.extend(out.new_token_ids)
        if out.prompt_logprobs is not None and state.prompt_logprobs is not None:
            self._extend_prompt_logprobs(state, out.prompt_logprobs)
        if out.new_logprobs and state.logprobs is not None:
            decode = self.decode_token if state.params.detokenize else _no_text
            for lp in out.new_logprobs:
                state.logprobs.append(_logprob_dict(lp.token_id, lp.logprob, lp.rank, lp.top, decode))
                state.cumulative_logprob += lp.logprob
        if state.detokenizer is not None and out.new_token_ids:
            delta = state.detokenizer.push(out.new_token_ids)
            state.text += delta
            state.last_delta_chars = len(delta)
        if out.finish_reason is not None:
            state.finish_reason, state.stop_reason, state.error = out.finish_reason, out.stop_reason, out.error
            state.routed_experts = out.routed_experts

    @staticmethod
    def _extend_spans(state: RequestState, version: str, count: int) -> None:
        start = len(state.token_ids)
        spans = state.weight_versions
        if spans and spans[-1].weight_version == version and spans[-1].end == start:
            spans[-1].end += count
        else:
            spans.append(WeightVersionSpan(version, start, start + count))

    def _check_stop_strings(self, state: RequestState) -> bool:
        params = state.params
        delta_len = state.last_delta_chars
        if not params.stop or not delta_len or len(state.token_ids) < params.min_tokens:
            return False
        hit = find_stop(state.text, delta_len, params.stop, params.include_stop_str_in_output)
        if hit is None:
            return False
        state.text, state.stop_reason = hit
        state.finish_reason = "stop"
        return True

    def _extend_prompt_logprobs(self, state: RequestState, scores: PromptLogprobs) -> None:
        """vLLM's order: the prompt token first, then the top-n by rank (the prompt token among
        them keeps its place and takes its top-n rank, which is its rank)."""
        decoded: dict[int, str | None] = {}  # a chunk's top-n repeat the same few tokens
        decode = self.decode_token if state.params.detokenize else _no_text

        def logprob(token_id: int, value: float, rank: int) -> Logprob:
            if token_id not in decoded:
                decoded[token_id] = decode(token_id)
            return Logprob(value, rank=rank, decoded_token=decoded[token_id])

        prompt = state.prompt_token_ids
        for j, (value, rank) in enumerate(zip(scores.logprobs, scores.ranks)):
            token_id = prompt[scores.start + j]
            entry = {token_id: logprob(token_id, value, rank)}
            for i, (tid, lp) in enumerate(scores.top[j] if scores.top else ()):
                entry[tid] = logprob(tid, lp, i + 1)
            state.prompt_logprobs.append(entry)

    def decode_token(self, token_id: int) -> str | None:
        """One token's text, as logprobs show it; None without a tokenizer."""
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _finish(self, state: RequestState, now: float) -> None:
        self.metrics.observe("e2e_request_latency_seconds", now - state.arrival)

    def abort(self, request_id: str) -> None:
        state = self.states.get(request_id)
        if state is not None and not state.finished:
            state.finish_reason = "abort"

    def pop(self, request_id: str) -> RequestState | None:
        return self.states.pop(request_id, None)

    @staticmethod
    def completion(state: RequestState, index: int = 0, delta: bool = False) -> CompletionOutput:
        """The state as a CompletionOutput; with ``delta`` only what was not returned before."""
        text, tokens = state.text, state.token_ids
        logprobs = state.logprobs
        if delta:
            text_end = len(state.text) if state.finished else max(len(state.text) - _held_back(state.params), 0)
            text_end = max(text_end, state.sent_text)
            text, tokens = text[state.sent_text : text_end], tokens[state.sent_tokens :]
            logprobs = None if logprobs is None else logprobs[state.sent_tokens :]
            state.sent_text, state.sent_tokens = text_end, len(state.token_ids)
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=list(tokens),
            cumulative_logprob=state.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
            weight_versions=[WeightVersionSpan(s.weight_version, s.start, s.end) for s in state.weight_versions],
            routed_experts=state.routed_experts,
        )

    @staticmethod
    def request_output(request_id: str, states: list[RequestState], delta: bool = False) -> RequestOutput:
        first = states[0]
        return RequestOutput(
            request_id=request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[OutputProcessor.completion(s, i, delta) for i, s in enumerate(states)],
            finished=all(s.finished for s in states),
            num_cached_tokens=first.num_cached_tokens,
            weight_version=first.weight_version,
            prompt_logprobs=first.prompt_logprobs,
        )


def _held_back(params: SamplingParams) -> int:
    """Characters a delta keeps back until the request ends (vLLM's output_text_buffer_length):
    a stop string may begin in them, and text cut at a stop must never have been sent."""
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(stop) for stop in params.stop) - 1


def _no_text(_: int) -> None:
    return None


def _logprob_dict(
    token_id: int, logprob: float, rank: int, top: list[tuple[int, float]], decode: Callable[[int], str | None]
) -> dict[int, Logprob]:
    entry = {tid: Logprob(lp, rank=i + 1, decoded_token=decode(tid)) for i, (tid, lp) in enumerate(top)}
    entry[token_id] = Logprob(logprob, rank=rank, decoded_token=decode(token_id))
    return entry
