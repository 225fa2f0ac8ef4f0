"""The engine core: scheduler + model runner driven one step at a time, and the control verbs.

It speaks token ids only; text, chat templates and stop strings live in the frontend
(``siesta.output_processor``). The offline ``LLM`` drives it in-process, the server drives it in
its own process (``siesta.ipc``). It implements ``siesta.control.EngineControl``.

This module is the step loop and the composition of the core's parts, each one idea:
``admission`` (requests in and out), ``pause_state`` (the pause/sleep state machine),
``sleep_memory`` (what a sleep releases), ``weights`` (weight updates and versions) and
``one_call_updates`` (SGLang's weight calls over them). A verb here reads back the step in
flight (invariant 10), then runs the parts' moves in the order the verb needs.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from siesta import fidelity_report
from siesta.config import ConfigError, EngineConfig
from siesta.control import ConnectorRetentionError, EngineStateError, OneCallResult, RequestRejected, init_info_of
from siesta.core.admission import Admission, RequestLimits, versioned
from siesta.core.deferred import Deferred
from siesta.core.gc_heap import freeze_startup_heap
from siesta.core.model_runner import LaunchedStep, ModelRunner
from siesta.core.one_call_updates import OneCallUpdates
from siesta.core.pause_state import ABORT, WAIT, PauseState, check_pause_mode, check_sleep_level, check_tags
from siesta.core.ranks import RankedMemory, Ranks
from siesta.core.scheduler import Scheduler, SchedulerOutput
from siesta.core.sleep_memory import SleepMemory
from siesta.core.step_lead import StepLead
from siesta.core.step_trace import StepTrace
from siesta.core.weight_versions import WeightVersions
from siesta.core.weights import WeightUpdates
from siesta.distributed.processes import RankFailed, refuse_in_starting_rank
from siesta.kv.hashing import ExtraKeys
from siesta.kv.kv_manager import KVManager
from siesta.metrics import EngineStats, StatsSnapshot
from siesta.model.loader import ModelSource, resolve_model
from siesta.request import EngineCoreOutput, EngineCoreRequest
from siesta.tiers.base import ConnectorContext, KVConnector
from siesta.tiers.factory import create_connector
from siesta.weight_transfer.sglang_group import DEFAULT_GROUP_NAME
from siesta.weight_transfer.state import REPAIR

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.005  # longest an idle step blocks on tier transfers before looking again


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    stats: StatsSnapshot = msgspec.field(default_factory=StatsSnapshot)


def block_extra_keys(
    source: ModelSource, versions: WeightVersions, runner: ModelRunner
) -> Callable[[str | None], bytes]:
    """A block key's extra keys for a cache salt (invariant 1): the model, the weights serving now
    (their key, not their name) and the KV cache's format."""

    def extra_keys(cache_salt: str | None) -> bytes:
        return ExtraKeys(source.fingerprint, versions.key, cache_salt, runner.kv_cache.format_key).encode()

    return extra_keys


class EngineCore:
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
        self._pending: list[EngineCoreOutput] = []
        # The step launched last whose samples the host has not read yet (async scheduling).
        self._inflight: tuple[SchedulerOutput, LaunchedStep] | None = None
        # When the step scheduled next starts on the device: loads landing by then join it.
        self._lead = StepLead()
        self.pause_state = PauseState()
        # The parts hold no reference back to the engine, so that dropping it frees its memory at once.
        self.admission = Admission(self.scheduler, self._limits(), self.eos_token_ids,
                                   block_extra_keys(self.source, self.versions, self.runner),
                                   self.runner.routed_experts_refusal, self.stats)  # fmt: skip
        self.weight_updates = WeightUpdates(config, self.versions, self.ranks, self.runner, self.kv, self.connector,
                                            self.memory, self.stats, self.admission.rekey)  # fmt: skip
        self.updater = self.weight_updates.updater
        # Whole weights of one version, or why not; an open weight update holds every step.
        self.weights = self.weight_updates.state
        self.sleep_memory = SleepMemory(self.memory, self.ranks, self.runner, self.connector, self.weights, self.stats)
        # What the last sleep and wake moved, part by part (sleep_weights, wake_kv_cache, ...).
        self.memory_reports = self.sleep_memory.reports
        self.one_call = OneCallUpdates(self.weight_updates, self.admission.unfinished_ids)
        self._trace = StepTrace(config.step_trace) if config.step_trace else None
        self._traced: SchedulerOutput | None = None  # the last step's schedule, for the trace
        if config.freezes_gc_heap():
            freeze_startup_heap()

    @property
    def weight_version(self) -> str:
        """The name outputs report for the weights serving now."""
        return self.versions.name

    @functools.cached_property
    def numerics_key(self) -> str:
        """The logprob oracle's key of this engine: its architecture and how it computes
        (``siesta.fidelity_report``); the oracle's last report under it is what /metrics serves."""
        return fidelity_report.numerics_key(
            self.source.hf_config, device=self.runner.device.type, dtype=str(self.runner.dtype),
            kv_cache_dtype=str(self.runner.kv_dtype), head_fp32=self.config.model.head_fp32,
            deterministic=self.config.deterministic)

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

    def _limits(self) -> RequestLimits:
        cfg = self.config
        return RequestLimits(self.max_model_len, self.vocab_size, cfg.cache.block_size, self.kv.pool.num_blocks,
                             cfg.scheduler.max_waiting_requests)  # fmt: skip

    def _hash_extra(self, cache_salt: str | None) -> bytes:
        return self.admission.extra_keys(cache_salt)

    # -- requests ----------------------------------------------------------------------

    def add_request(self, req: EngineCoreRequest) -> None:
        """Validate and queue; raises RequestRejected (naming the problem) and changes nothing on failure."""
        self.add_requests([req])

    def add_requests(self, reqs: list[EngineCoreRequest]) -> None:
        """All of one HTTP request's choices, or none: each is checked before any is queued."""
        if self.weights.torn:
            raise RequestRejected(f"the engine cannot generate: {self.weights.describe()}; {REPAIR}")
        self.admission.add(reqs, hold=self.pause_state.holding)

    def abort_requests(self, request_ids: list[str], stopped: bool = False) -> None:
        """End requests; ``stopped``: the front end found a stop string, so they finished (and are
        counted so), though the core ends them as it ends an abort."""
        self._pending.extend(self.admission.abort(request_ids, stopped, self.weight_version))
        self._store_finished(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.admission.has_unfinished() or bool(self._pending)

    def step_loses_nothing_to_more_adds(self, waiting_tokens: int) -> bool:
        """Whether a step taken now, with more of a batch still to be added, is as full as the
        first step after the whole batch would be: the device runs ahead of the host (the step
        returns once launched), nothing is in flight, and the ``waiting_tokens`` already added
        fill a step's token budget. ``LLM.add_requests`` (and so ``generate``) takes it, so the
        first prompt's tier loads (or first prefill chunk) overlap the host's admission of the rest."""
        sched = self.config.scheduler
        if not sched.async_scheduling or self._inflight is not None or self.scheduler.running:
            return False
        return self._scheduling_allowed() and waiting_tokens >= sched.max_num_batched_tokens

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
        if self.pause_state.draining and not self.scheduler.has_unfinished():
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
        return not self.weights.blocks_generation and self.pause_state.allows_scheduling

    def _run_one_step(self) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        if not self._may_run_ahead():
            outputs.extend(self._finish_inflight())
        sched = self.scheduler.schedule(self._join_within_s())
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
            outputs.extend(self._finish_step(prev, chained=True))
        if not self.config.scheduler.async_scheduling:
            outputs.extend(self._finish_inflight())
        return outputs

    def _join_within_s(self) -> float:
        """How long until the step scheduled now starts on the device (``core/step_lead.py``);
        0 with no step in flight, whose end it would start at."""
        if self._inflight is None or not self.config.scheduler.join_loads_ahead:
            return 0.0
        return self._lead.seconds()

    def _run_transfers_only(self, sched: SchedulerOutput) -> None:
        """A step with nothing to compute: the last forward's blocks still go out and loads
        start, or it waits a little for transfers in flight."""
        self.runner.wait_for_landings(sched.transfers)  # later steps must not run ahead of them
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

    def _finish_step(
        self, step: tuple[SchedulerOutput, LaunchedStep], chained: bool = False
    ) -> list[EngineCoreOutput]:
        """Read the step back; ``chained``: the next step is already queued behind it."""
        sched, launched = step
        try:
            samples = launched.results()
            self._lead.read_back(chained)
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
        return versioned(self.scheduler.fail_requests(ids, f"{type(e).__name__}: {e}"), self.weight_version)

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

    # -- pause / resume (core/pause_state.py) ---------------------------------------------

    def pause(self, mode: str = "abort", clear_cache: bool = True, clear_connector_cache: bool = True) -> None:
        """Stop generating. ``abort`` ends in-flight requests, ``wait`` lets them finish first,
        ``keep`` freezes them until ``resume``. Requests added while paused wait for ``resume``.

        ``clear_cache`` drops the device prefix cache (preempting frozen requests, which then
        recompute or load their KV on resume); ``clear_connector_cache`` drops the KV tiers.
        Keeping the tiers is refused up front, with the engine untouched, by a connector that
        cannot keep them. A pause while paused is never refused (``_pause_again``).
        """
        self._settle()
        check_pause_mode(mode)
        self.check_connector_retention(clear_connector_cache)
        if self.pause_state.holding:
            self._pause_again(mode, clear_cache, clear_connector_cache)
            return
        self.pause_state.begin(mode, clear_cache, clear_connector_cache)
        if mode == ABORT:
            self.abort_requests(list(self.scheduler.requests))
        if mode != WAIT or not self.scheduler.has_unfinished():
            self._complete_pause()

    def _pause_again(self, mode: str, clear_cache: bool, clear_connector_cache: bool) -> None:
        """A pause while paused (or asleep): the mode only moves up, the caches asked for are
        dropped, generation never restarts (core/pause_state.py)."""
        if self.pause_state.strengthen(mode) and mode == ABORT:
            self.abort_requests(list(self.scheduler.requests))
        if not self.pause_state.done:
            self.pause_state.add_resets(clear_cache, clear_connector_cache)
            if self.pause_state.mode != WAIT or not self.scheduler.has_unfinished():
                self._complete_pause()
        elif clear_cache or clear_connector_cache:
            self._reset_caches(clear_cache, clear_connector_cache)

    def _complete_pause(self) -> None:
        state = self.pause_state
        self._reset_caches(*state.resets)
        state.done = True
        self.stats.inc("pauses", mode=state.mode)
        if state.sleeping:  # a wait-mode sleep, drained
            self.sleep_memory.release(state.sleep_level, state.releases)

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
        return self.pause_state.paused

    def resume(self) -> None:
        if self.pause_state.sleeping:
            raise EngineStateError("the engine is asleep: wake_up() resumes it")
        if not self.pause_state.holding:
            return
        self.pause_state.end()
        self.admission.release_held()

    # -- sleep / wake (core/sleep_memory.py) -------------------------------------------------

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
        check_sleep_level(level)
        check_pause_mode(mode)
        release = check_tags(tags, "sleep")
        self.check_connector_retention(clear_connector_cache)
        if self.pause_state.sleeping:
            level_now = self.pause_state.sleep_level
            raise EngineStateError(f"the engine is already asleep (level {level_now}); wake_up() first")
        if not self.pause_state.holding:
            # Level >= 1 gives the KV memory away, so the device prefix cache cannot survive it.
            self.pause(mode, clear_cache=level >= 1, clear_connector_cache=clear_connector_cache)
        elif level >= 1 or clear_connector_cache:
            self._reset_caches(level >= 1, clear_connector_cache)
        self.pause_state.fall_asleep(level, release)
        if self.is_paused():
            self.sleep_memory.release(level, release)

    def is_sleeping(self) -> bool:
        return self.pause_state.sleeping

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore device memory; ``tags`` picks ``weights`` and/or ``kv_cache`` (default both).

        Once both are back the engine resumes. Weights released at level 2 must be
        written (update_weights) before that, or they are reloaded from the model source.
        """
        tags = check_tags(tags, "wake_up")
        if not self.pause_state.sleeping:
            return
        if not self.sleep_memory.restore(tags):
            return  # a staged wake: the rest comes with a later call
        if self.weights.only_released:
            self.reload_weights()  # nothing was written since the level-2 sleep: the source's weights
        if not self.weights.whole:
            raise EngineStateError(f"the engine stays asleep: {self.weights.describe()}; {REPAIR}, then wake_up()")
        self.sleep_memory.recapture_graphs()
        self.pause_state.wake()
        self.stats.inc("wakes")
        self.resume()

    # -- weights (core/weights.py, core/one_call_updates.py) -----------------------------------

    def init_weight_transfer_engine(self, request: Any) -> None:
        """Set up the configured backend (nccl: join the trainer's group; ipc: nothing to do);
        ``request`` is vLLM's ``{"init_info": {...}}`` or the bare init info."""
        self.begin_weight_transfer_engine(init_info_of(request)).wait()

    def begin_weight_transfer_engine(self, init_info: Any) -> Deferred:
        """``init_weight_transfer_engine`` as a Deferred: nccl's rendezvous runs on a thread of
        every rank while the engine steps (weight_transfer/joining.py)."""
        self._settle()
        return self.weight_updates.begin_transfer_engine(init_info)

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        """Open an update: no step runs until ``finish_weight_update``. Both checkpoint (Hugging
        Face) names and this engine's fused names are taken whatever ``is_checkpoint_format`` says."""
        self._settle()
        self.weight_updates.start()

    def update_weights(self, weights: Any, weight_version: str | None = None) -> str:
        """Write new weights in place; returns the weight version (``WeightUpdates.update``)."""
        self._settle()
        return self.weight_updates.update(weights, weight_version)

    def finish_weight_update(self, weight_version: str | None = None) -> str:
        """Close the update and publish its version (the next one unless named); evict what
        other weights computed (``WeightUpdates.finish``)."""
        self._settle()
        return self.weight_updates.finish(weight_version)

    def get_world_size(self) -> int:
        """Engine ranks in a weight-transfer group (the tensor-parallel size)."""
        return self.ranks.size

    def get_weight_version(self) -> str:
        return self.weight_version

    def reload_weights(self) -> None:
        """Re-read the weights of the model source (after a level-2 sleep with no update)."""
        self._settle()
        self.weight_updates.reload()

    def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> str:
        """Rename the weights: outputs report ``new_version``; cached KV stays valid and reachable."""
        self._settle()
        return self.one_call.rename(self.abort_requests, new_version, abort_all_requests)

    def init_weights_update_group(self, init_info: Any) -> str:
        """Join the trainer's group through SGLang's rendezvous; returns its name."""
        return self.begin_weights_update_group(init_info).wait()

    def begin_weights_update_group(self, init_info: Any) -> Deferred:
        """Start joining on a thread of every rank (the engine steps meanwhile)."""
        self._settle()
        return self.one_call.begin_join_group(init_info)

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> None:
        self._settle()
        self.one_call.destroy_group(group_name)

    def update_weights_from_distributed(
        self,
        names: Any,
        dtypes: Any,
        shapes: Any,
        group_name: str = DEFAULT_GROUP_NAME,
        load_format: str | None = None,
        **options: Any,
    ) -> OneCallResult:
        """The trainer broadcasts while this call runs (each tensor, or one flattened bucket)."""
        self._settle()
        return self.one_call.from_distributed(self.abort_requests, names, dtypes, shapes, group_name, load_format,
                                              **options)  # fmt: skip

    def update_weights_from_tensor(
        self, serialized: list[Any], load_format: str | None = None, **options: Any
    ) -> OneCallResult:
        """Tensors the trainer shares (CUDA IPC, or shared memory by name on the CPU), one entry per engine rank."""
        self._settle()
        return self.one_call.from_tensor(self.abort_requests, serialized, load_format, **options)

    def update_weights_from_disk(self, model_path: str, **options: Any) -> OneCallResult:
        self._settle()
        return self.one_call.from_disk(self.abort_requests, model_path, **options)

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
