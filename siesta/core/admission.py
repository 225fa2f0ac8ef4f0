"""Admission: requests into the engine core and out of it before they finish.

Every request of one call is checked before any is queued, and a refusal (``RequestRejected``,
naming the problem; ``EngineOverloaded`` for a full queue) changes nothing. What one request may
cost is bounded here, before it is paid (DESIGN.md, invariant 9): its prompt against the context
length and the vocabulary, its blocks against the cache, the waiting queue against its bound.

While the engine pauses, new requests are held here and queued at resume: keyed then, not when
they arrived, so a request held through a pause runs under the weights of its resume.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from siesta.control import EngineOverloaded, RequestRejected
from siesta.core.scheduler import Scheduler
from siesta.kv.kv_manager import cdiv
from siesta.metrics import EngineStats
from siesta.request import EngineCoreOutput, EngineCoreRequest, Request
from siesta.sampling import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of this engine."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    max_waiting: int


class Admission:
    def __init__(
        self,
        scheduler: Scheduler,
        limits: RequestLimits,
        eos_token_ids: frozenset[int],
        extra_keys: Callable[[str | None], bytes],
        routing_refusal: Callable[[SamplingParams, int], str | None],
        stats: EngineStats,
    ) -> None:
        self.scheduler = scheduler
        self.limits = limits
        self.eos_token_ids = eos_token_ids
        self.extra_keys = extra_keys  # a block key's extra keys for a cache salt, under the weights serving now
        self.routing_refusal = routing_refusal
        self.stats = stats
        self.held: list[Request] = []  # added while paused: queued at resume

    # -- in ----------------------------------------------------------------------------

    def add(self, reqs: list[EngineCoreRequest], hold: bool) -> None:
        """Queue all of ``reqs``, or none; ``hold``: the engine is paused, so they wait for resume."""
        waiting = len(self.scheduler.waiting) + len(self.held)
        limit = self.limits.max_waiting
        if waiting + len(reqs) > limit:
            raise EngineOverloaded(
                f"{waiting} requests wait and this one adds {len(reqs)}; at most {limit} may wait "
                "(--max-waiting-requests): retry later"
            )
        ids = [r.request_id for r in reqs]
        if len(set(ids)) != len(ids):
            raise RequestRejected("request ids repeat within one request")
        requests = [self._validate(req) for req in reqs]
        now = time.monotonic()
        for req, request in zip(reqs, requests, strict=True):
            # Stamped by the core, where the queue is: queue time counts from here, paused time included.
            req.arrival_time = request.arrival_time = now
            if hold:
                self.held.append(request)
            else:
                self.queue(request)
        self.scheduler.set_held(len(self.held))

    def queue(self, request: Request) -> None:
        # Keyed when queued, not when added: a request held through a pause runs under the
        # weights of its resume.
        request.hash_extra = self.extra_keys(request.cache_salt)
        self.scheduler.add_request(request)

    def release_held(self) -> None:
        """The pause is over: what waited through it is queued."""
        held, self.held = self.held, []
        for req in held:
            self.queue(req)
        self.scheduler.set_held(0)

    def rekey(self) -> None:
        """The weights' key changed: requests re-key their blocks under it when next scheduled.
        One that keeps KV the old weights computed must not publish blocks built on it until it
        recomputes."""
        for request in self.scheduler.requests.values():
            request.hash_extra = self.extra_keys(request.cache_salt)
            request.block_hashes.clear()
            request.kv_mixes_versions = request.num_computed_tokens > 0

    # -- out ---------------------------------------------------------------------------

    def abort(self, request_ids: list[str], stopped: bool, weight_version: str) -> list[EngineCoreOutput]:
        """End requests, held or scheduled; the outputs that say so. ``stopped``: the front end found
        a stop string, so they finished (and are counted so), though they end as an abort does."""
        ids = set(request_ids)
        held = [h for h in self.held if h.request_id in ids]
        self.held = [h for h in self.held if h.request_id not in ids]
        self.scheduler.set_held(len(self.held))
        outputs = [
            EngineCoreOutput(request_id=h.request_id, finish_reason="abort", weight_version=weight_version)
            for h in held
        ]
        if held:  # they never reached the scheduler, which counts the rest
            self.stats.inc("request_success", len(held), finished_reason="abort")
        return outputs + versioned(self.scheduler.abort_requests(request_ids, stopped), weight_version)

    def unfinished_ids(self) -> list[str]:
        return [*self.scheduler.requests, *(h.request_id for h in self.held)]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.held)

    # -- checks --------------------------------------------------------------------------

    def _validate(self, req: EngineCoreRequest) -> Request:
        """The core's request for ``req``, or RequestRejected naming what is wrong with it."""
        limits = self.limits
        n = len(req.prompt_token_ids)
        if req.request_id in self.scheduler.requests or any(h.request_id == req.request_id for h in self.held):
            raise RequestRejected(f"request id {req.request_id!r} is already in use")
        if n == 0:
            raise RequestRejected("the prompt is empty: at least one token is needed")
        if n >= limits.max_model_len:
            raise RequestRejected(
                f"the prompt has {n} tokens but max_model_len is {limits.max_model_len}: "
                "at least one token must remain for the output"
            )
        request = self._checked_tokens(req)
        _check_sampling_token_ids(req.sampling_params, limits.vocab_size)
        if reason := self.routing_refusal(req.sampling_params, n):
            raise RequestRejected(reason)
        max_tokens = req.sampling_params.max_tokens
        total = limits.max_model_len if max_tokens is None else min(n + max_tokens, limits.max_model_len)
        # The last sampled token is never written to the cache.
        needed = cdiv(total - 1, limits.block_size)
        if needed > limits.num_blocks:
            raise RequestRejected(
                f"the request needs {needed} KV blocks ({total - 1} tokens) but the cache holds only "
                f"{limits.num_blocks} blocks of {limits.block_size} tokens; "
                "shorten the prompt or max_tokens, or give the cache more memory"
            )
        return request

    def _checked_tokens(self, req: EngineCoreRequest) -> Request:
        # The request's int64 array is the check: its range is one tensor reduction, where
        # min() and max() over a 19.5k-token list compare Python ints (1.5 of the ~2 ms each
        # request of a resume took to add, on the 2-core CPU; all are added before a step).
        vocab_size = self.limits.vocab_size
        try:
            request = self._core_request(req)
        except (OverflowError, TypeError):  # not an int, or no int64 holds it
            request = None
        if request is not None:
            low, high = torch.frombuffer(request.all_token_ids, dtype=torch.int64).aminmax()
            if 0 <= int(low) and int(high) < vocab_size:
                return request
        bad = next(t for t in req.prompt_token_ids if not _in_range(t, vocab_size))
        raise RequestRejected(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab_size})")

    def _core_request(self, req: EngineCoreRequest) -> Request:
        return Request(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            sampling_params=req.sampling_params,
            eos_token_ids=self.eos_token_ids,
            cache_salt=req.cache_salt,
            arrival_time=req.arrival_time,
        )


def versioned(outputs: list[EngineCoreOutput], weight_version: str) -> list[EngineCoreOutput]:
    """Outputs that end requests outside a step (aborts, failures) say which weights serve now;
    the front end keeps the version of a request's last token where it has one."""
    for out in outputs:
        out.weight_version = weight_version
    return outputs


def _check_sampling_token_ids(params: SamplingParams, vocab_size: int) -> None:
    if params.bad_words and params.bad_words_token_ids is None:
        # The core has no tokenizer: the front end turns the words into token ids.
        raise RequestRejected("bad_words were not tokenized: set bad_words_token_ids (siesta.tokenizer)")
    try:
        params.verify_token_ids(vocab_size)
    except ValueError as e:
        raise RequestRejected(str(e)) from None


def _in_range(token_id: object, vocab_size: int) -> bool:
    try:
        return 0 <= operator.index(token_id) < vocab_size
    except TypeError:
        return False
