"""Continuous batching: which requests compute how many tokens in the next step.

Every step has a token budget. Running requests go first (a decode token each,
or the next chunk of their prefill), then waiting requests in arrival order.
When the device runs out of KV blocks the most recently admitted running
request is preempted: its blocks are freed and it is recomputed later (its
prefix usually comes back from the prefix cache).

A request that asks for prompt logprobs takes no prefix hits (device or tier) for
prompt positions not scored yet: cached KV has no logits. Its blocks are cached as
anyone's, and a recompute skips what it already scored.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from siesta.config import SchedulerConfig
from siesta.core.sampler import SampleResult
from siesta.kv.kv_manager import KVManager
from siesta.metrics import EngineStats
from siesta.request import EngineCoreOutput, PromptLogprobs, Request, RequestStatus, SampledLogprobs
from siesta.tiers.base import KVConnector, StepTransfers

# Prompt tokens of waiting requests hashed per step to mark the tier entries they will load
# (connector.want): ~5 ms on a 2-core CPU, so a burst of long prompts is marked over a few steps.
WANT_HASH_TOKENS_PER_STEP = 1 << 16


@dataclass
class ScheduledRequest:
    request: Request
    start: int  # position of the first token computed this step
    num_new_tokens: int
    block_ids: list[int]
    sample: bool  # the step reaches the request's last known token, so it samples the next
    # Positions whose logits score the next prompt token (prompt logprobs) this step.
    prompt_logprob_positions: range = range(0)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Requests that left since the previous step (finished, aborted): state to drop downstream.
    finished_req_ids: set[str] = field(default_factory=set)
    transfers: StepTransfers | None = None  # the KV connector's loads and stores for this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager, max_model_len: int, stats: EngineStats) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.stats = stats
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.held = 0  # requests the engine holds back while paused: they wait too
        # Holding blocks, waiting for their tier loads to land before computing.
        self.loading: dict[str, Request] = {}
        # Running, joined before their loads landed (``join_within_s``): their blocks may not be
        # freed until the loads land.
        self.landing: set[str] = set()
        self.connector: KVConnector | None = None
        self._finished_ids: set[str] = set()
        # Preempted outside schedule() (e.g. by a pause); reported by the next schedule().
        self._preempted_ids: set[str] = set()

    # -- requests in and out ---------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str], stopped: bool = False) -> list[EngineCoreOutput]:
        status = RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_ABORTED
        outputs = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None:
                outputs.append(self._finish(request, status))
        self._record_gauges()  # a paused engine does not schedule: refresh them here
        return outputs

    def fail_requests(self, request_ids: Iterable[str], error: str) -> list[EngineCoreOutput]:
        outputs = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None:
                out = self._finish(request, RequestStatus.FINISHED_ERROR)
                out.error = error
                outputs.append(out)
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- one step ----------------------------------------------------------------------

    def schedule(self, join_within_s: float = 0.0) -> SchedulerOutput:
        """The next step. ``join_within_s``: how long until it starts on the device (the step
        before it still running there); loading requests expected to land by then join it,
        and it waits for their landing on the device."""
        out = SchedulerOutput(finished_req_ids=self._finished_ids, preempted_req_ids=self._preempted_ids)
        self._finished_ids, self._preempted_ids = set(), set()
        self._join_loaded(join_within_s)
        preempted_before = len(out.preempted_req_ids)
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if len(out.preempted_req_ids) == preempted_before:
            self._schedule_waiting(out, budget)
        if self.connector is not None:
            out.transfers = self.connector.build_step(out)
            if self.waiting:
                self.connector.want(self.waiting, WANT_HASH_TOKENS_PER_STEP)
        self._record_gauges()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if self._ends_with_unseen(request):
                i += 1
                continue
            num_new = min(request.num_tokens + request.num_unseen - request.num_computed_tokens, budget)
            while self.kv.allocate(request, request.num_computed_tokens + num_new) is None:
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is request:
                    return budget
            self._commit(request, num_new, out)
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.config.max_num_seqs:
            if self.connector is not None and not self.connector.may_start_loads():
                break
            request = self.waiting[0]
            if request.num_unseen:  # preempted a step ahead of its last sample: it recomputes once seen
                break
            cached = self.kv.find_cached_prefix(request)
            scoring = request.prompt_logprobs_pending
            if scoring:  # cached KV has no logits: only what was scored before may be skipped
                cached = cached[: request.num_prompt_logprob_positions // self.kv.block_size]
            num_cached = len(cached) * self.kv.block_size
            num_external = 0
            if self.connector is not None and not scoring:
                num_external = self.connector.get_num_new_matched_tokens(request, num_cached)
            if num_external:
                if not self._start_load(request, cached, num_cached, num_external):
                    break
                continue
            num_new = request.num_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if self.kv.allocate(request, num_cached + num_new, cached) is None:
                break
            self.waiting.popleft()
            self._admit(request, num_cached, 0)
            if self.connector is not None:
                self.connector.update_state_after_alloc(request, self.kv.block_ids(request.request_id), num_cached, 0)
            self._commit(request, num_new, out)
            budget -= num_new

    def _start_load(self, request: Request, cached: list, num_cached: int, num_external: int) -> bool:
        """Give the request blocks for its tier hits and start loading them; it computes once they land.

        Its blocks are not published until then: nobody may read KV that is still on its way.
        """
        num_loaded = num_cached + num_external
        if self.kv.allocate(request, num_loaded, cached, publish=False) is None:
            return False
        self.waiting.popleft()
        self._admit(request, num_cached, num_external, joins_running=False)
        request.status = RequestStatus.LOADING
        self.loading[request.request_id] = request
        self.connector.update_state_after_alloc(request, self.kv.block_ids(request.request_id), num_cached, num_external)
        return True

    def _join_loaded(self, join_within_s: float = 0.0) -> None:
        """Requests whose tier loads landed join the running batch, and those expected to land
        within ``join_within_s``. Their blocks are published at once: whoever reads them is
        in this step or a later one, which the device runs after the landing."""
        if self.connector is None or not (self.loading or self.landing):
            return
        for request_id in self.connector.finished_loads():
            if request_id not in self.landing:
                self._join(request_id)
            self.landing.discard(request_id)
        if join_within_s > 0 and self.loading:
            for request_id in self.connector.join_ahead(join_within_s):
                if self._join(request_id):
                    self.landing.add(request_id)

    def _join(self, request_id: str) -> bool:
        request = self.loading.pop(request_id, None)
        if request is None:
            return False
        self.kv.publish(request, request.num_computed_tokens)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return True

    def _settle_loads(self) -> None:
        """Finish every load in flight, so that the blocks they write may be freed."""
        if self.loading or self.landing:
            self.connector.wait_for_loads()
            self._join_loaded()

    def _admit(self, request: Request, num_cached: int, num_external: int, joins_running: bool = True) -> None:
        if request.num_cached_tokens < 0:  # first scheduling only: a preempted request, admitted again, skips this
            request.num_cached_tokens = num_cached + num_external
            self.stats.inc("prompt_tokens", request.num_prompt_tokens)
            self.stats.observe("request_queue_time_seconds", time.monotonic() - request.arrival_time)
        self.stats.inc("prefix_cache_queries", request.num_tokens)
        self.stats.inc("prefix_cache_hits", num_cached)
        request.num_computed_tokens = num_cached + num_external
        if joins_running:
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def _commit(self, request: Request, num_new: int, out: SchedulerOutput) -> None:
        start = request.num_computed_tokens
        request.num_computed_tokens += num_new
        out.scheduled.append(
            ScheduledRequest(
                request=request,
                start=start,
                num_new_tokens=num_new,
                block_ids=self.kv.block_ids(request.request_id),
                sample=request.num_computed_tokens == request.num_tokens + request.num_unseen,
                prompt_logprob_positions=_positions_to_score(request, start),
            )
        )

    def _ends_with_unseen(self, request: Request) -> bool:
        """Whether the request's unseen sample is its last (by length): nothing more to compute."""
        if not request.num_unseen:
            return False
        max_tokens = request.sampling_params.max_tokens
        total = request.num_tokens + request.num_unseen
        return total >= self.max_model_len or (max_tokens is not None and request.num_output_tokens + request.num_unseen >= max_tokens)

    def mark_unseen(self, sched: SchedulerOutput) -> None:
        """The step is launched: its samples exist on the device, not yet on the host."""
        for item in sched.scheduled:
            if item.sample:
                item.request.num_unseen += 1

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        if request.request_id in self.landing:
            self._settle_loads()  # its blocks are being written: let that end before freeing them
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.kv_mixes_versions = False  # it recomputes from scratch
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted_req_ids.add(request.request_id)
        self.stats.inc("num_preemptions")

    def preempt_all_running(self) -> set[str]:
        """Free every running request's blocks; they resume (recompute or load) when scheduled again.

        The next ``schedule()`` reports them as preempted, possibly in the same step that
        resumes them.
        """
        self._settle_loads()
        out = SchedulerOutput(preempted_req_ids=self._preempted_ids)
        while self.running:
            self._preempt(self.running.pop(), out)
        return set(out.preempted_req_ids)

    # -- after the step ----------------------------------------------------------------

    def update(
        self,
        sched: SchedulerOutput,
        samples: dict[str, SampleResult],
        weight_version: str,
        prompt_logprobs: dict[str, PromptLogprobs] | None = None,
    ) -> list[EngineCoreOutput]:
        outputs = []
        for item in sched.scheduled:
            request = item.request
            sample = samples.get(request.request_id)
            if sample is not None:
                request.num_unseen = max(request.num_unseen - 1, 0)
            # Scored prompt tokens go out even if the request was preempted since: they are not
            # scored again.
            scores = None if request.status.finished or not prompt_logprobs else prompt_logprobs.get(request.request_id)
            # A request preempted in the step scheduled ahead of this one still takes its token.
            takes_sample = sample is not None and request.status in (RequestStatus.RUNNING, RequestStatus.PREEMPTED)
            if not takes_sample and scores is None:
                continue
            out = EngineCoreOutput(
                request_id=request.request_id,
                prompt_logprobs=scores,
                num_cached_tokens=max(request.num_cached_tokens, 0),
                weight_version=weight_version,
            )
            if takes_sample:
                self._take_sample(request, sample, out)
            outputs.append(out)
        self._record_gauges()
        return outputs

    def _take_sample(self, request: Request, sample: SampleResult, out: EngineCoreOutput) -> None:
        request.append_output_token(sample.token_id)
        self.stats.inc("generation_tokens")
        out.new_token_ids, out.new_logprobs = [sample.token_id], _logprobs(sample)
        status = self._stop_status(request, sample.token_id)
        if status is not None:
            done = self._finish(request, status)
            out.finish_reason, out.stop_reason = done.finish_reason, done.stop_reason

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if params.stop_token_ids and token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> EngineCoreOutput:
        if request.request_id in self.loading or request.request_id in self.landing:
            self._settle_loads()  # its blocks are being written: let that end before freeing them
        request.status = status
        if self.connector is not None and status is RequestStatus.FINISHED_ERROR:
            self.connector.request_failed(request)
        elif self.connector is not None:
            # Its blocks are still its own: the connector takes what it needs before they go.
            self.connector.request_finished(request, self.kv.block_ids(request.request_id))
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.kv.free(request)
        self.requests.pop(request.request_id, None)
        self._finished_ids.add(request.request_id)
        self.stats.inc("request_success", finished_reason=status.value)
        return EngineCoreOutput(
            request_id=request.request_id,
            finish_reason=status.value,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )

    def set_held(self, count: int) -> None:
        self.held = count
        self._record_gauges()

    def _record_gauges(self) -> None:
        self.stats.set("num_requests_running", len(self.running))
        self.stats.set("num_requests_waiting", len(self.waiting) + len(self.loading) + self.held)
        self.stats.set("kv_cache_usage_perc", self.kv.pool.usage)


def _logprobs(sample: SampleResult) -> list[SampledLogprobs] | None:
    if sample.logprob is None:
        return None
    return [SampledLogprobs(token_id=sample.token_id, logprob=sample.logprob, rank=sample.rank or 0, top=sample.top_logprobs)]


def _positions_to_score(request: Request, start: int) -> range:
    """The positions of a step's tokens [start, num_computed_tokens) whose logits score a prompt
    token not scored before (position p scores token p + 1), marked scored."""
    if not request.prompt_logprobs_pending:
        return range(0)
    done = request.num_prompt_logprob_positions
    assert start <= done, f"request {request.request_id}: prompt positions {done}..{start} would go unscored"
    end = min(request.num_computed_tokens, request.num_prompt_tokens - 1)
    if end <= done:
        return range(0)
    request.num_prompt_logprob_positions = end
    return range(done, end)
