"""The engine core: scheduler + model runner driven one step at a time.

It speaks token ids only; text, chat templates and stop strings live in the
frontend (``siesta.output_processor``). The offline ``LLM`` drives it in-process,
the server drives it in its own process (``siesta.ipc``).
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Mapping
from typing import Any

import msgspec
import torch

from siesta.config import ConfigError, EngineConfig
from siesta.core.deferred import Deferred
from siesta.core.device_memory import MemoryReport
from siesta.core.model_runner import LaunchedStep
from siesta.core.one_call_updates import OneCallUpdates
from siesta.core.ranks import RankedMemory, RankedUpdater, Ranks
from siesta.core.scheduler import Scheduler, SchedulerOutput
from siesta.core.step_trace import StepTrace
from siesta.core.weight_versions import WeightVersions, check_version
from siesta.distributed.processes import RankFailed, refuse_in_starting_rank
from siesta.kv.hashing import ExtraKeys
from siesta.kv.kv_manager import KVManager, cdiv
from siesta.metrics import EngineStats, StatsSnapshot
from siesta.model.loader import ModelSource, resolve_model
from siesta.request import EngineCoreOutput, Request
from siesta.sampling import SamplingParams
from siesta.tiers.base import ConnectorContext, KVConnector
from siesta.tiers.factory import create_connector
from siesta.weight_transfer.checkpoints import update_source
from siesta.weight_transfer.joining import join_timeout
from siesta.weight_transfer.receivers import Receiver
from siesta.weight_transfer.state import REPAIR
from siesta.weight_transfer.updater import UpdateFailed
from siesta.weight_transfer.wire import WeightTransferError, parse_nccl_init

logger = logging.getLogger(__name__)


class EngineCoreRequest(msgspec.Struct, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str | None = None
    arrival_time: float = 0.0


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    stats: StatsSnapshot = msgspec.field(default_factory=StatsSnapshot)


class RequestRejected(ValueError):
    """A request that can never run here; the message says why. Nothing else is affected."""


class ConnectorRetentionError(ValueError):
    """``clear_connector_cache=False`` with a connector that cannot keep its cache across a pause."""


class EngineStateError(RuntimeError):
    """A control call that does not fit the engine's state (e.g. resume while asleep)."""


class EngineOverloaded(RuntimeError):
    """More requests wait than ``max_waiting_requests``: retry later (HTTP 429)."""


PAUSE_MODES = ("abort", "wait", "keep")
# A second pause moves only up this order: it may end more, never restart generation.
PAUSE_STRENGTH = {"wait": 0, "keep": 1, "abort": 2}
SLEEP_LEVELS = (0, 1, 2)
WAKE_TAGS = ("weights", "kv_cache")
IDLE_WAIT_S = 0.005  # longest an idle step blocks on tier transfers before looking again


def _update_info(weights: Any) -> Any:
    """The update_info of a weight-transfer call (``{"update_info": ...}`` or the bare dict), else None."""
    if isinstance(weights, Mapping) and not isinstance(next(iter(weights.values()), None), torch.Tensor):
        if set(weights) == {"update_info"}:
            return weights["update_info"]
        if "names" in weights:
            return weights
    return None


class EngineCore(OneCallUpdates):
    def __init__(self, config: EngineConfig, source: ModelSource | None = None) -> None:
        refuse_in_starting_rank()  # before loading anything: a rank re-running an unguarded script
        self.config = config
        self.source = source or resolve_model(config.model.model, config.model.seed, config.model.tokenizer)
        self.max_model_len = self._max_model_len()
        config.validate(self.max_model_len)
        # The name of the weights, reported with every output, and the key cached KV is filed
        # under: the weights' identity, which a rename leaves alone (core/weight_versions.py).
        self.versions = WeightVersions.at_start(config.model.weight_version)
        # Every tensor-parallel rank's runner: this process holds rank 0's.
        self.ranks = Ranks.start(config, self.source, self.max_model_len)
        self.runner = self.ranks.runner
        self.vocab_size = self.runner.model.shape.vocab_size
        self.stats = EngineStats()
        self.kv = KVManager(self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, self.stats)
        self.eos_token_ids = frozenset(self.source.eos_token_ids)
        try:
            self.connector = self._make_connector()
        except BaseException:
            self.ranks.close()  # the other ranks' processes go with the engine that failed to start
            raise
        self.scheduler.connector = self.connector
        self.runner.connector = self.connector
        self.memory = RankedMemory(self.ranks)
        # What the last sleep and wake moved, part by part (sleep_weights, wake_kv_cache, ...).
        self.memory_reports: dict[str, MemoryReport] = {}
        self._pending: list[EngineCoreOutput] = []
        # The step launched last whose samples the host has not read yet (async scheduling).
        self._inflight: tuple[SchedulerOutput, LaunchedStep] | None = None
        # Pause and sleep state. Requests that arrive while paused wait here until resume.
        self._held: list[Request] = []
        self._pause_mode: str | None = None  # set while paused or pausing
        self._pause_done = False
        self._pause_resets: tuple[bool, bool] = (False, False)  # (prefix cache, connector) to clear once paused
        self._sleep_level: int | None = None
        self._sleep_releases: list[str] = list(WAKE_TAGS)  # what this sleep releases (level >= 1)
        self.updater = RankedUpdater(self.ranks)
        # Whole weights of one version, or why not; an open weight update holds every step.
        self.weights = self.updater.state
        self._record_weight_version()
        self._trace = StepTrace(config.step_trace) if config.step_trace else None
        self._traced: SchedulerOutput | None = None  # the last step's schedule, for the trace

    @property
    def weight_version(self) -> str:
        """The name outputs report for the weights serving now."""
        return self.versions.name

    @property
    def kv_version(self) -> str:
        """The key cached KV of the weights serving now is filed under (their identity)."""
        return self.versions.key

    def _make_connector(self) -> KVConnector | None:
        if self.config.kv_transfer is None:
            return None
        kv = self.runner.kv_cache
        ctx = ConnectorContext(
            block_size=self.config.cache.block_size,
            block_shape=tuple(kv.tensor.shape[1:]),
            dtype=kv.tensor.dtype,
            device=self.runner.device,
            model_fingerprint=self.source.fingerprint,
            weight_version=self.kv_version,
            stats=self.stats,
            pool=self.kv.pool,
            kv_cache=kv,
            ranks=self.ranks.tier_ranks(),
        )
        connector = create_connector(self.config.kv_transfer, ctx)
        if ctx.ranks is not None and not connector.supports_tensor_parallel:
            raise ConfigError(f"{connector.name} does not run at tensor parallel > 1 (OffloadingConnector does)")
        return connector

    def _max_model_len(self) -> int:
        limit = self.source.hf_config.max_position_embeddings
        wanted = self.config.model.max_model_len
        if wanted is None:
            return limit
        if wanted > limit:
            raise ConfigError(f"max_model_len={wanted} exceeds the model's context length ({limit})")
        return wanted

    # -- requests ----------------------------------------------------------------------

    def add_request(self, req: EngineCoreRequest) -> None:
        """Validate and queue; raises RequestRejected (naming the problem) and changes nothing on failure."""
        self.add_requests([req])

    def add_requests(self, reqs: list[EngineCoreRequest]) -> None:
        """All of one HTTP request's choices, or none: each is checked before any is queued."""
        if self.weights.torn:
            raise RequestRejected(f"the engine cannot generate: {self.weights.describe()}; {REPAIR}")
        waiting = len(self.scheduler.waiting) + len(self._held)
        limit = self.config.scheduler.max_waiting_requests
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
            if self._pause_mode is not None:
                self._held.append(request)
            else:
                self._queue(request)
        self.scheduler.set_held(len(self._held))

    def _core_request(self, req: EngineCoreRequest) -> Request:
        return Request(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            sampling_params=req.sampling_params,
            eos_token_ids=self.eos_token_ids,
            cache_salt=req.cache_salt,
            arrival_time=req.arrival_time,
        )

    def _queue(self, request: Request) -> None:
        # Keyed when queued, not when added: a request held through a pause runs under the
        # weights of its resume.
        request.hash_extra = self._hash_extra(request.cache_salt)
        self.scheduler.add_request(request)

    def _hash_extra(self, cache_salt: str | None) -> bytes:
        return ExtraKeys(self.source.fingerprint, self.kv_version, cache_salt, self.runner.kv_cache.format_key).encode()

    def _validate(self, req: EngineCoreRequest) -> Request:
        """The core's request for ``req``, or RequestRejected naming what is wrong with it."""
        n = len(req.prompt_token_ids)
        if req.request_id in self.scheduler.requests or any(h.request_id == req.request_id for h in self._held):
            raise RequestRejected(f"request id {req.request_id!r} is already in use")
        if n == 0:
            raise RequestRejected("the prompt is empty: at least one token is needed")
        if n >= self.max_model_len:
            raise RequestRejected(
                f"the prompt has {n} tokens but max_model_len is {self.max_model_len}: "
                "at least one token must remain for the output"
            )
        request = self._checked_tokens(req)
        self._validate_sampling_token_ids(req.sampling_params)
        if reason := self.runner.routed_experts_refusal(req.sampling_params, n):
            raise RequestRejected(reason)
        max_tokens = req.sampling_params.max_tokens
        total = self.max_model_len if max_tokens is None else min(n + max_tokens, self.max_model_len)
        # The last sampled token is never written to the cache.
        needed = cdiv(total - 1, self.config.cache.block_size)
        if needed > self.kv.pool.num_blocks:
            raise RequestRejected(
                f"the request needs {needed} KV blocks ({total - 1} tokens) but the cache holds only "
                f"{self.kv.pool.num_blocks} blocks of {self.config.cache.block_size} tokens; "
                "shorten the prompt or max_tokens, or give the cache more memory"
            )
        return request

    def _checked_tokens(self, req: EngineCoreRequest) -> Request:
        # The request's int64 array is the check: its range is one tensor reduction, where
        # min() and max() over a 19.5k-token list compare Python ints (1.5 of the ~2 ms each
        # request of a resume took to add, on the 2-core CPU; all are added before a step).
        try:
            request = self._core_request(req)
        except (OverflowError, TypeError):  # not an int, or no int64 holds it
            request = None
        if request is not None:
            low, high = torch.frombuffer(request.all_token_ids, dtype=torch.int64).aminmax()
            if 0 <= int(low) and int(high) < self.vocab_size:
                return request
        bad = next(t for t in req.prompt_token_ids if not _in_range(t, self.vocab_size))
        raise RequestRejected(f"prompt token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")

    def _validate_sampling_token_ids(self, params: SamplingParams) -> None:
        if params.bad_words and params.bad_words_token_ids is None:
            # The core has no tokenizer: the front end turns the words into token ids.
            raise RequestRejected("bad_words were not tokenized: set bad_words_token_ids (siesta.tokenizer)")
        try:
            params.verify_token_ids(self.vocab_size)
        except ValueError as e:
            raise RequestRejected(str(e)) from None

    def abort_requests(self, request_ids: list[str], stopped: bool = False) -> None:
        """End requests; ``stopped``: the front end found a stop string, so they finished (and are
        counted so), though the core ends them as it ends an abort."""
        ids = set(request_ids)
        held = [h for h in self._held if h.request_id in ids]
        self._held = [h for h in self._held if h.request_id not in ids]
        self.scheduler.set_held(len(self._held))
        self._pending.extend(
            EngineCoreOutput(request_id=h.request_id, finish_reason="abort", weight_version=self.weight_version)
            for h in held
        )
        if held:  # they never reached the scheduler, which counts the rest
            self.stats.inc("request_success", len(held), finished_reason="abort")
        self._pending.extend(self._versioned(self.scheduler.abort_requests(request_ids, stopped)))
        self._store_finished(request_ids)

    def _versioned(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Outputs that end requests outside a step (aborts, failures) say which weights serve
        now; the front end keeps the version of a request's last token where it has one."""
        for out in outputs:
            out.weight_version = self.weight_version
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or bool(self._held)

    def has_work(self) -> bool:
        """Whether a step would do anything: outputs to hand out, requests it may schedule,
        tier transfers to finish."""
        if self._pending or self._inflight is not None or self._connector_busy():
            return True
        self.updater.expire()  # a trainer gone between its calls must not hold the engine for ever
        return self._scheduling_allowed() and self.scheduler.has_unfinished()

    # -- the step loop -----------------------------------------------------------------

    def _connector_busy(self) -> bool:
        return self.connector is not None and not self.memory.kv_released and self.connector.has_pending_work()

    def step(self) -> EngineCoreOutputs:
        t0 = time.perf_counter()
        self.ranks.check()  # a rank that died or hung ends the engine, naming it
        outputs, self._pending = self._pending, []
        if self._scheduling_allowed():
            outputs.extend(self._run_one_step())
        else:
            outputs.extend(self._finish_inflight())
        if not self._scheduling_allowed() and self._connector_busy():
            self.connector.wait_for_stores(self.runner.kv_cache)
        if self._pause_mode == "wait" and not self._pause_done and not self.scheduler.has_unfinished():
            self._complete_pause()
        # What a control call arriving mid-step waits for at most (the engine-core loop answers between steps).
        self.stats.observe("engine_step_seconds", time.perf_counter() - t0)
        if self._trace is not None:
            self._trace.record(t0, self._traced, self.scheduler)
            self._traced = None
        return EngineCoreOutputs(outputs=outputs, stats=self.stats.drain())

    def _scheduling_allowed(self) -> bool:
        # Awake and unpaused, or draining in-flight requests for a pause (or sleep) in "wait" mode;
        # never while a weight update is open or the weights are not whole.
        if self.weights.blocks_generation:
            return False
        if self._pause_mode is None:
            return True
        return self._pause_mode == "wait" and not self._pause_done

    def _run_one_step(self) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        if not self._may_run_ahead():
            outputs.extend(self._finish_inflight())
        sched = self.scheduler.schedule()
        if self._trace is not None:
            self._traced = sched
        if sched.is_empty:
            outputs.extend(self._finish_inflight())  # nothing to overlap it with
            self._run_transfers_only(sched)
            return outputs
        prev = self._inflight
        try:
            launched = self.runner.launch(sched, prev[1] if prev is not None else None, self.ranks.peers)
        except RankFailed:
            raise  # the ranks are out of step: nothing more can run
        except Exception as e:  # one bad step must not take the engine down
            outputs.extend(self._finish_inflight())
            return outputs + self._fail_step(sched, e)
        self.scheduler.mark_unseen(sched)
        self._inflight = (sched, launched)
        if prev is not None:  # read back while the device runs the step just launched
            outputs.extend(self._finish_step(prev))
        if not self.config.scheduler.async_scheduling:
            outputs.extend(self._finish_inflight())
        return outputs

    def _run_transfers_only(self, sched: SchedulerOutput) -> None:
        """A step with nothing to compute: the last forward's blocks still go out and loads
        start, or it waits a little for transfers in flight."""
        if sched.transfers:
            self.connector.run_stores(sched.transfers, self.runner.kv_cache)
            self.connector.run_loads(sched.transfers, self.runner.kv_cache)
        elif self.connector is not None:
            self.connector.wait_for_progress(IDLE_WAIT_S)
            self.connector.poll()

    def _may_run_ahead(self) -> bool:
        """Whether the next step may be scheduled before the last one's samples are read:
        penalties and multi-token bad words need every token of a request's output on the host."""
        return not any(r.sampling_params.reads_output_tokens for r in self.scheduler.running)

    def _finish_inflight(self) -> list[EngineCoreOutput]:
        if self._inflight is None:
            return []
        step, self._inflight = self._inflight, None
        return self._finish_step(step)

    def _finish_step(self, step: tuple[SchedulerOutput, LaunchedStep]) -> list[EngineCoreOutput]:
        sched, launched = step
        try:
            samples = launched.results()
            prompt_logprobs = launched.prompt_logprobs()
        except Exception as e:  # noqa: BLE001 - the step's requests fail, the engine goes on
            return self._fail_step(sched, e)
        outputs = self.scheduler.update(sched, samples, self.weight_version, prompt_logprobs)
        self.runner.attach_routed_experts(sched, outputs)
        self._store_finished([out.request_id for out in outputs if out.finish_reason is not None])
        return outputs

    def _store_finished(self, request_ids: list[str]) -> None:
        """A request that ended has its last blocks stored now, not at the next step (which may
        be a sleep away): its KV and the counters are in the tier with its output."""
        if request_ids and self.connector is not None and not self.memory.kv_released:
            self.connector.store_finished(request_ids, self.runner.kv_cache)

    def _fail_step(self, sched: SchedulerOutput, e: Exception) -> list[EngineCoreOutput]:
        logger.error("step failed; failing its %d requests", len(sched.scheduled), exc_info=e)
        ids = [item.request.request_id for item in sched.scheduled]
        return self._versioned(self.scheduler.fail_requests(ids, f"{type(e).__name__}: {e}"))

    def _settle(self) -> None:
        """Read back the step in flight before a control call changes what it depends on."""
        self._pending.extend(self._finish_inflight())

    def close(self) -> None:
        """Before the process exits: the tier stores still planned or in flight are finished,
        so what the last steps computed reaches the disk tier for the next engine, instead of
        going with the process (uncounted: no one would see the count)."""
        self._settle()
        if self._connector_busy():
            self.connector.wait_for_stores(self.runner.kv_cache)
        if self._trace is not None:
            self._trace.close()
        self.ranks.close()

    def drain_stats(self) -> StatsSnapshot:
        return self.stats.drain()

    def drain_outputs(self) -> EngineCoreOutputs:
        """What calls produced since the last step (aborts, a step read back), without stepping."""
        outputs, self._pending = self._pending, []
        return EngineCoreOutputs(outputs=outputs, stats=self.stats.drain())

    # -- pause / resume ----------------------------------------------------------------

    def pause(self, mode: str = "abort", clear_cache: bool = True, clear_connector_cache: bool = True) -> None:
        """Stop generating. ``abort`` ends in-flight requests, ``wait`` lets them finish first,
        ``keep`` freezes them until ``resume``. Requests added while paused wait for ``resume``.

        ``clear_cache`` drops the device prefix cache (preempting frozen requests, which then
        recompute or load their KV on resume); ``clear_connector_cache`` drops the KV tiers.
        Keeping the tiers is refused up front, with the engine untouched, by a connector that
        cannot keep them. A pause while paused is never refused (``_pause_again``).
        """
        self._settle()
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        self.check_connector_retention(clear_connector_cache)
        if self._pause_mode is not None:
            self._pause_again(mode, clear_cache, clear_connector_cache)
            return
        self._pause_mode, self._pause_done = mode, False
        self._pause_resets = (clear_cache, clear_connector_cache)
        if mode == "abort":
            self.abort_requests(list(self.scheduler.requests))
        if mode != "wait" or not self.scheduler.has_unfinished():
            self._complete_pause()

    def _pause_again(self, mode: str, clear_cache: bool, clear_connector_cache: bool) -> None:
        """A pause while paused (or asleep) is never refused: trainers send one from several
        places, and retry loops turn a refusal into a crash. It never restarts generation: the
        mode moves up to the stronger one (wait < keep < abort: ``abort`` ends what a ``keep``
        froze or a ``wait`` drains) or stays, and the caches it asks to drop are dropped (SGLang's
        ``retract`` after ``in_place`` lets the frozen requests' KV go). DESIGN.md, SGLang's routes."""
        if PAUSE_STRENGTH[mode] > PAUSE_STRENGTH[self._pause_mode]:
            self._pause_mode = mode
            if mode == "abort":
                self.abort_requests(list(self.scheduler.requests))
        if not self._pause_done:
            held_cache, held_connector = self._pause_resets
            self._pause_resets = (held_cache or clear_cache, held_connector or clear_connector_cache)
            if self._pause_mode != "wait" or not self.scheduler.has_unfinished():
                self._complete_pause()
        elif clear_cache or clear_connector_cache:
            self._reset_caches(clear_cache, clear_connector_cache)

    def _complete_pause(self) -> None:
        clear_cache, clear_connector = self._pause_resets
        self._reset_caches(clear_cache, clear_connector)
        self._pause_done = True
        self.stats.inc("pauses", mode=self._pause_mode)
        if self._sleep_level is not None:
            self._release_memory()  # a sleep in "wait" mode, now drained

    def _reset_caches(self, reset_prefix: bool, reset_connector: bool) -> None:
        if reset_prefix:
            self.reset_prefix_cache(reset_running_requests=True)
        if reset_connector and self.connector is not None:
            self.connector.reset_cache()

    def check_connector_retention(self, clear_connector_cache: bool) -> None:
        """Refuse, before any state changes, to keep a tier the connector cannot keep."""
        if clear_connector_cache or self.connector is None:
            return
        if not self.connector.supports_retained_cache_on_pause:
            raise ConnectorRetentionError(self.connector.retention_refusal())

    def is_paused(self) -> bool:
        return self._pause_mode is not None and self._pause_done

    def resume(self) -> None:
        if self._sleep_level is not None:
            raise EngineStateError("the engine is asleep: wake_up() resumes it")
        if self._pause_mode is None:
            return
        self._pause_mode, self._pause_done = None, False
        held, self._held = self._held, []
        for req in held:
            self._queue(req)
        self.scheduler.set_held(0)

    # -- sleep / wake ------------------------------------------------------------------

    def sleep(
        self, level: int = 1, mode: str = "abort", clear_connector_cache: bool = True, tags: list[str] | None = None
    ) -> None:
        """Pause, then hand device memory back: level 1 keeps the weights in host memory and
        releases the KV cache, level 2 releases both, level 0 only pauses. ``tags`` narrows
        what level 1 or 2 releases (SGLang's ``["kv_cache"]`` keeps the weights on the device).

        With ``mode="wait"`` the memory is released once in-flight requests finish; poll
        ``is_sleeping()``.
        """
        self._settle()
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, got {level!r}")
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        release = _check_tags(tags, "sleep")
        self.check_connector_retention(clear_connector_cache)
        if self._sleep_level is not None:
            raise EngineStateError(f"the engine is already asleep (level {self._sleep_level}); wake_up() first")
        if self._pause_mode is None:
            # Level >= 1 gives the KV memory away, so the device prefix cache cannot survive it.
            self.pause(mode, clear_cache=level >= 1, clear_connector_cache=clear_connector_cache)
        elif level >= 1 or clear_connector_cache:
            self._reset_caches(level >= 1, clear_connector_cache)
        self._sleep_level, self._sleep_releases = level, release
        if self.is_paused():
            self._release_memory()

    def _release_memory(self) -> None:
        level = self._sleep_level
        t0 = time.perf_counter()
        released = 0
        if level >= 1:
            if self.connector is not None:
                self.connector.wait_for_stores(self.runner.kv_cache)  # nothing may read the cache once it is gone
            self.memory_reports["sleep_kv_cache"] = self.memory.release_kv_cache()
            released = self.memory_reports["sleep_kv_cache"].bytes
            if not self.memory.keeps_addresses:
                self.ranks.run("memory_moved")
            if "weights" in self._sleep_releases:
                self.memory_reports["sleep_weights"] = self.memory.release_weights(backup=level == 1)
                released += self.memory_reports["sleep_weights"].bytes
                if level == 2:
                    self.weights.released()
        self.stats.inc("sleeps", level=str(level))
        self._record_memory_seconds("sleep", time.perf_counter() - t0, level=str(level))
        self.stats.set("device_bytes_released", released)
        logger.info("asleep at level %d: released %.2f GiB in %.2fs", level, released / 2**30, time.perf_counter() - t0)

    def _record_memory_seconds(self, what: str, seconds: float, **labels: str) -> None:
        """One sleep's or wake-up call's device-memory seconds: summed, per call (p50) and the last."""
        self.stats.inc(f"{what}_seconds", seconds)
        self.stats.observe(f"{what}_duration_seconds", seconds, **labels)
        self.stats.set(f"last_{what}_seconds", seconds, **labels)

    def is_sleeping(self) -> bool:
        return self._sleep_level is not None

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore device memory; ``tags`` picks ``weights`` and/or ``kv_cache`` (default both).

        Once both are back the engine resumes. Weights released at level 2 must be
        written (update_weights) before that, or they are reloaded from the model source.
        """
        tags = _check_tags(tags, "wake_up")
        if self._sleep_level is None:
            return
        t0 = time.perf_counter()
        if "weights" in tags:
            self.memory_reports["wake_weights"], _ = self.memory.restore_weights()
        if "kv_cache" in tags:
            mapped_again = self.memory.kv_released
            self.memory_reports["wake_kv_cache"] = self.memory.restore_kv_cache()
            if mapped_again:
                # Fresh memory may hold NaN bit patterns: each block is zeroed by the first step
                # that uses it, on every rank (its plan names them), unless a tier load writes it whole.
                self.runner.kv_cache.forget_contents()
        if not self.memory.keeps_addresses:
            self.ranks.run("memory_moved")
        self._record_memory_seconds("wake", time.perf_counter() - t0, tags=",".join(sorted(set(tags))))
        if self.memory.weights_released or self.memory.kv_released:
            return  # a staged wake: the rest comes with a later call
        if self.weights.only_released:
            self.reload_weights()  # nothing was written since the level-2 sleep: the source's weights
        if not self.weights.whole:
            raise EngineStateError(f"the engine stays asleep: {self.weights.describe()}; {REPAIR}, then wake_up()")
        if not self.memory.keeps_addresses:
            self.ranks.run("recapture_graphs")  # after the weights are back: capture runs the model
        self._sleep_level = None
        self.stats.inc("wakes")
        self.resume()

    # -- weights ---------------------------------------------------------------------
    #
    # Two ways in. A trainer in another process pushes through the weight-transfer API
    # (init_weight_transfer_engine once; then start_weight_update, update_weights(update_info)
    # as often as needed, finish_weight_update): nothing steps while an update is open, and
    # the version advances at the finish. In-process callers and checkpoints pass tensors or
    # a path to update_weights, which advances the version at once when no update is open.

    def init_weight_transfer_engine(self, init_info: Any) -> None:
        """Set up the configured backend (nccl: join the trainer's group; ipc: nothing to do)."""
        self.begin_weight_transfer_engine(init_info).wait()

    def begin_weight_transfer_engine(self, init_info: Any) -> Deferred:
        """``init_weight_transfer_engine`` as a Deferred: nccl's rendezvous runs on a thread of
        every rank while the engine steps (weight_transfer/joining.py)."""
        self._settle()
        if not self.updater.local.joins_by_rendezvous:
            self.updater.init_engine(init_info)
            return Deferred(lambda: True, lambda: None)
        parse_nccl_init(join_timeout(init_info, 1.0)[0])  # refused here, before any rank waits
        self.updater.begin_init_engine(init_info)
        return Deferred(lambda: self.updater.join_done(None), lambda: self.updater.finish_join(None))

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        """Open an update: no step runs until ``finish_weight_update``. Both checkpoint (Hugging
        Face) names and this engine's fused names are taken whatever ``is_checkpoint_format`` says."""
        self._settle()
        if self.memory.weights_released:
            raise EngineStateError("the weights are released: wake_up(tags=['weights']) before a weight update")
        self.updater.start()

    def update_weights(self, weights: Any, weight_version: str | None = None) -> str:
        """Write new weights in place; returns the weight version.

        ``weights``: an update_info (``{"update_info": {...}}`` or the bare dict) received
        through the backend; (name, tensor) pairs or a state dict with Hugging Face names; or
        a model path. Outside an open update, tensors and paths publish new weights at once,
        under the version named (naming the current one keeps the name) or else the next.
        Written weights always get a new cache key: the engine cannot tell equal weights from
        different ones without reading them all (``core/weight_versions.py``).
        """
        self._settle()
        if weight_version is not None:
            weight_version = check_version(weight_version)  # refused before anything is written
        if self.memory.weights_released:
            raise EngineStateError("the weights are released: wake_up(tags=['weights']) before update_weights")
        info = _update_info(weights)
        if info is not None:
            opened = self.updater.start()  # vLLM lets update_weights open the update itself
            try:
                self._receive(info)
            except (WeightTransferError, UpdateFailed):
                if opened and not self.weights.written:
                    self.updater.close_update()  # nothing written: as if never called
                raise
            return self.weight_version
        implicit = not self.weights.open
        if isinstance(weights, str):
            update_source(weights, self.runner.model.shape)  # nothing read before its shapes are known to fit
            self.updater.write_path(weights)
        else:
            self.updater.write(weights)
        if implicit:
            self._publish_written(weight_version)
        return self.weight_version

    def _receive(self, update_info: Any, receiver: Receiver | None = None) -> None:
        backend = (receiver or self.updater.receiver).backend
        self._receive_with(backend, lambda: self.updater.receive(update_info, receiver))

    def _receive_with(self, backend: str, receive) -> None:
        """``receive()`` (returning the bytes it took), counted under ``backend``."""
        t0 = time.perf_counter()
        try:
            nbytes = receive()
        except UpdateFailed:
            self.stats.inc("weight_transfer_failures", backend=backend)
            raise
        self.stats.inc("weight_transfer_seconds", time.perf_counter() - t0, backend=backend)
        self.stats.inc("weight_transfer_bytes", nbytes, backend=backend)

    def finish_weight_update(self, weight_version: str | None = None) -> str:
        """Close the update and publish its version (the next one unless named); evict what
        other weights computed, on the device and in every tier. Refused, with nothing
        changed, while the weights are not whole. An update that wrote nothing only renames
        (when a version is named): the weights, and so their cached KV, are the same."""
        self._settle()
        if weight_version is not None:
            weight_version = check_version(weight_version)
        if not self.weights.whole:
            raise EngineStateError(f"the weight update cannot finish: {self.weights.describe()}; {REPAIR}")
        changed = self.weights.open and bool(self.weights.written)
        if self.weights.open:
            self.updater.close_update()
        if changed:
            self._publish_written(weight_version)
        elif weight_version is not None:
            self._rename_weights(weight_version)
        self.kv.reset_prefix_cache()
        if self.connector is not None:
            self.connector.evict_other_versions(self.kv_version)
        return self.weight_version

    def get_world_size(self) -> int:
        """Engine ranks in a weight-transfer group (the tensor-parallel size)."""
        return self.ranks.size

    def reload_weights(self) -> None:
        """Re-read the weights of the model source (after a level-2 sleep with no update).

        The engine then serves the checkpoint it started from, so it reports that checkpoint's
        version and reaches only KV the checkpoint computed; what later weights computed is
        evicted from every tier."""
        self._settle()
        self.ranks.run("reload_weights")
        self.weights.wrote(set(self.weights.expected))
        self._use_kv_key(self.versions.reloaded_source)
        self._record_weight_version()
        self.kv.reset_prefix_cache()
        if self.connector is not None:
            self.connector.evict_other_versions(self.kv_version)

    def _publish_written(self, weight_version: str | None) -> None:
        """New weights were written: they get a new cache key, and ``weight_version`` (else
        the next version) as their name."""
        self._use_kv_key(lambda: self.versions.wrote(weight_version))
        self._record_weight_version()
        self.stats.inc("weight_updates")

    def _rename_weights(self, version: str) -> None:
        """The name outputs report from now on; what is cached stays keyed as it was."""
        version = check_version(version)
        if version == self.weight_version:
            return
        self.versions.rename(version)
        self._record_weight_version()

    def _use_kv_key(self, change) -> None:
        """``change()`` moves ``versions.key``; KV from now on is filed under the new key.
        Keys name weights, so nothing under a new key came from other weights."""
        before = self.kv_version
        change()
        if self.kv_version == before:
            return
        if self.connector is not None:
            self.connector.set_weight_version(self.kv_version)
        # Requests re-key their blocks under the new version when next scheduled. One that keeps
        # KV the old weights computed must not publish blocks built on it until it recomputes.
        for request in self.scheduler.requests.values():
            request.hash_extra = self._hash_extra(request.cache_salt)
            request.block_hashes.clear()
            request.kv_mixes_versions = request.num_computed_tokens > 0

    def _record_weight_version(self) -> None:
        # One series, the live version's: a series per version ever served grows /metrics
        # without bound over an RL run's pushes (the registry drops the others).
        self.stats.set("weight_version_info", 1.0, version=self.weight_version)
        if self.weight_version.isdigit():
            self.stats.set("weight_version", float(self.weight_version))

    # -- caches ----------------------------------------------------------------------

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Drop the device prefix cache; with ``reset_running_requests`` running requests are
        preempted first (they recompute, or load from a tier, when scheduled again)."""
        self._settle()
        if reset_running_requests:
            self.scheduler.preempt_all_running()
        self.kv.reset_prefix_cache()
        if reset_connector and self.connector is not None:
            self.connector.reset_cache()
        return True


def _check_tags(tags: list[str] | None, call: str) -> list[str]:
    """The memory kinds a sleep releases or a wake-up restores; None: both."""
    tags = list(WAKE_TAGS) if tags is None else list(tags)
    unknown = sorted(set(tags) - set(WAKE_TAGS))
    if unknown:
        raise ValueError(f"unknown {call} tags {unknown}: expected any of {', '.join(WAKE_TAGS)}")
    if call == "sleep" and "kv_cache" not in tags:
        # The weights cannot leave while the KV cache stays: a wake-up restores weights first.
        raise ValueError(f"sleep tags {tags} must include kv_cache: the KV cache is released with anything")
    return tags


def _in_range(token_id: object, vocab_size: int) -> bool:
    try:
        return 0 <= operator.index(token_id) < vocab_size
    except TypeError:
        return False
