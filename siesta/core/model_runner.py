"""Turns a scheduled step into tensors, runs the model, samples.

Owns the weights, the device KV cache and the sampler.
"""

from __future__ import annotations

import logging
import time
from array import array
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from siesta import cpu_threads, pdl
from siesta.attention.base import AttentionMetadata, KVCache
from siesta.attention.kv_quant import KVScales, is_quantized, resolve_kv_dtype
from siesta.attention.select import get_attention_backend
from siesta.config import ConfigError, EngineConfig, resolve_dtype
from siesta.core import staging
from siesta.core.cuda_graphs import DecodeGraphs
from siesta.core.device_memory import ArenaMemory, SleepableMemory
from siesta.core.host_backup import CAPTURE_LOCK
from siesta.core.mixed_graphs import MixedGraphs
from siesta.core.piecewise_graphs import BUCKETS as PIECEWISE_BUCKETS
from siesta.core.piecewise_graphs import PiecewiseGraphs
from siesta.core.routed_experts import PendingRouting, RoutedExpertsStore, RoutedRows, id_dtype, tier_blocks
from siesta.core.routed_experts import refusal as routed_experts_refusal
from siesta.core.sampler import (
    PendingSamples,
    PromptScores,
    PromptSpan,
    Sampler,
    SampleResult,
    SamplingRow,
    make_generator,
    score_tokens,
)
from siesta.core.scheduler import ScheduledRequest, SchedulerOutput
from siesta.core.staging import to_device_many
from siesta.core.vmm import VirtualArena, place_parameters, vmm_available
from siesta.device_activity import DEVICE_WORK
from siesta.distributed.collectives import broadcast, min_over_ranks
from siesta.model import batch_invariant, cpu_linear, registry
from siesta.model.interface import CausalModel
from siesta.model.kv_calibration import calculate_kv_scales
from siesta.model.kv_scales import CHECKPOINT, source_kv_scales
from siesta.model.loader import ModelSource
from siesta.parallel import SINGLE, TensorParallel
from siesta.request import TOKEN_TYPECODE, EngineCoreOutput, PromptLogprobs, Request
from siesta.sampling import SamplingParams
from siesta.tiers.base import KVConnector, StepTransfers

logger = logging.getLogger(__name__)

# Kernel warm-up batches: a short extend (a few query tiles) over a long cached context,
# long enough that the split-KV paths engage.
WARM_UP_QUERY_TOKENS = 40
WARM_UP_LONG_CONTEXT = 8192
# Prompt logprobs take the LM head and a log_softmax over the whole vocabulary for every
# scored row: rows go through in chunks of about this many logits, so the memory they take
# stays bounded (three fp32 tensors of it, 128 MiB each) however long the prefill chunk.
PROMPT_SCORE_CHUNK_ELEMENTS = 1 << 25
# The last layer's tail runs on the read rows alone where they are at most this fraction of
# the step's (1/KEEP_ROWS_FRACTION): a decode step reads every row, a prompt chunk one
# row a prompt.
KEEP_ROWS_FRACTION = 2


@dataclass
class PromptRows:
    """The hidden-state rows of a step whose logits score prompt tokens (prompt logprobs)."""

    rows: torch.Tensor  # [n] indices into the step's hidden states
    targets: torch.Tensor  # [n] the prompt token each row scores: the one after its position
    spans: list[PromptSpan]  # one per request, in row order
    request_ids: list[str]

    @property
    def num_rows(self) -> int:
        return sum(span.count for span in self.spans)

    @property
    def top_n(self) -> int:
        return max(span.top_n for span in self.spans)


@dataclass
class StepPlan:
    """A step as host arrays, with no Request in it: what the other tensor-parallel ranks are
    sent (pickled, the arrays out of band) to run the very step rank 0 runs."""

    starts: list[int]  # query start offsets, one per row and the end
    seq_lens: list[int]
    table: np.ndarray  # [rows, blocks] int32
    slots: np.ndarray  # [tokens] int64
    input_ids: np.ndarray  # [tokens] int64; 0 where the token is unseen
    positions: np.ndarray  # [tokens] int64
    logits_rows: np.ndarray  # [sampled] int64
    unseen_at: np.ndarray  # [unseen] token indices whose id the previous step sampled
    unseen_rows: np.ndarray  # [unseen] and the rows of the previous step that sampled them
    prompt: tuple[np.ndarray, np.ndarray, list[PromptSpan], list[str]] | None = None  # see _prompt_rows
    # [blocks] int64: unset since a wake (KVCache.unset), zeroed before this step's forward.
    zero_blocks: np.ndarray | None = None

    @property
    def num_unseen(self) -> int:
        return len(self.unseen_at)


class StepPeers(Protocol):
    """The other tensor-parallel ranks, as the model runner on rank 0 sees them."""

    def launch(self, plan: StepPlan) -> None: ...

    def step_failed(self, error: Exception) -> Exception:
        """What to raise for a step that failed on rank 0 after the other ranks had it: most
        often a collective that broke because another rank died, which it names."""
        ...


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # hidden-state rows whose logits are sampled
    sampled: list[ScheduledRequest]
    prompt: PromptRows | None = None


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device."""

    sampled_ids: list[str]  # the requests of the sampled rows, in row order
    samples: PendingSamples | None
    prompt_ids: list[str] = field(default_factory=list)  # the requests of its prompt scores, in order
    routing: PendingRouting | None = None  # the experts its tokens took, where recorded

    def __post_init__(self) -> None:
        self.row_of = {rid: row for row, rid in enumerate(self.sampled_ids)}

    def results(self) -> dict[str, SampleResult]:
        """Wait for this step's samples (and nothing queued after them)."""
        if self.routing is not None:  # before the outputs that may finish its requests
            routing, self.routing = self.routing, None
            routing.land()
        if self.samples is None:
            return {}
        return dict(zip(self.sampled_ids, self.samples.results()))

    def prompt_logprobs(self) -> dict[str, PromptLogprobs]:
        """The prompt tokens this step scored, per request (they travel with the samples)."""
        if self.samples is None or not self.prompt_ids:
            return {}
        return dict(zip(self.prompt_ids, self.samples.prompt_results()))


class ModelRunner:
    def __init__(
        self, config: EngineConfig, source: ModelSource, max_model_len: int, tp: TensorParallel = SINGLE
    ) -> None:
        self.config = config
        self.tp = tp
        self.device = config.torch_device()
        self.dtype = resolve_dtype(config.model.dtype, source.checkpoint_dtype, self.device)
        # What the KV cache's blocks hold: the model's dtype, or fp8 under per-layer scales.
        self.kv_dtype = resolve_kv_dtype(config.cache.kv_cache_dtype, self.dtype)
        self.max_model_len = max_model_len
        self.block_size = config.cache.block_size
        if self.device.type == "cpu":  # before the attention backend, which sizes its work by it
            threads = cpu_threads.engine_threads(config.cpu.threads, config.usage_context, tp.size)
            cpu_threads.apply(threads)
            logger.info("CPU threads: %d", threads)
        if config.deterministic:
            batch_invariant.enable()  # before the first matmul: cuBLAS reads its workspace setting once
        pdl.set_enabled(config.programmatic_dependent_launch)  # before the graphs capture the launches
        self.backend = get_attention_backend(config.attention_backend, self.device, config.deterministic,
                                             kv_quantized=is_quantized(self.kv_dtype))  # fmt: skip
        if self.device.type == "cuda":
            staging.warm_up(self.device)  # pinned and compiled now, not in a step while tier copies run
        else:
            logger.info("CPU linears past %d rows: %s", cpu_linear.MAX_ROWS, cpu_linear.set_library(config.cpu.matmul))
        # Sleep on CUDA keeps addresses when weights and KV live in virtual-memory arenas.
        self.use_arenas = self.device.type == "cuda" and config.enable_sleep_mode and vmm_available()
        if self.device.type == "cuda" and config.enable_sleep_mode and not self.use_arenas:
            logger.warning("cuda-python is not installed: sleep frees memory by reallocation and graphs are recaptured")
        self.weight_arena: VirtualArena | None = None
        self.kv_arena: VirtualArena | None = None
        if config.deterministic and self.device.type == "cpu":
            self._check_deterministic_cpu(source.hf_config)
        self.model = self._build_model(source)
        self.kv_scales = self._kv_scales(source)
        self.kv_cache = self._allocate_kv_cache()
        self.routed: RoutedExpertsStore | None = None  # the experts tokens took (rank 0, where asked)
        if config.model.enable_return_routed_experts:
            self._record_routing(source.name)  # before the graphs, which capture the writes
        self.sampler = Sampler(seed=config.model.seed, device=self.device)
        self.connector: KVConnector | None = None  # set by the engine core when tiers are configured
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None  # steps with prefill rows
        self.mixed_graphs: MixedGraphs | None = None  # the few-token ones of those, whole
        if self.device.type == "cuda" and self.backend.name == "triton":
            self._warm_up_kernels()
        if self.device.type == "cuda" and not config.enforce_eager and self.backend.name == "triton":
            self.graphs = DecodeGraphs(
                self.model, self.kv_cache, config.scheduler.max_num_seqs, max_model_len, self.block_size
            )
            self.piecewise = PiecewiseGraphs(self.model, self.kv_cache, config.scheduler.max_num_batched_tokens)
            if not config.deterministic:  # its attention picks tiles by the batch: it keeps the pieces
                self.mixed_graphs = MixedGraphs(self.model, self.kv_cache, config.scheduler.max_num_batched_tokens,
                                                config.scheduler.max_num_seqs, max_model_len, self.block_size)
            self.recapture_graphs()  # now, not in the first steps that serve requests

    # -- setup -----------------------------------------------------------------------

    def _check_deterministic_cpu(self, hf_config) -> None:
        """Deterministic mode on the CPU runs on siesta's fp32 kernels alone: refuse, naming why,
        what they cannot take (a torch fallback would silently break the invariance)."""
        shape = registry.shape_of(hf_config)
        # Every matrix's input width: the MoE experts' too (their down projections read theirs).
        widths = {shape.hidden_size, shape.intermediate_size, shape.num_heads * shape.head_dim}
        widths.update(w for w in (getattr(shape, "moe_intermediate_size", None),) if w)
        reasons = [
            None if self.dtype == torch.float32 else f"deterministic mode on the CPU computes in float32, not {self.dtype}",
            cpu_linear.invariant_refusal(widths),
            self.backend.refusal(shape.num_heads, shape.num_kv_heads, shape.head_dim),
        ]
        reason = next((r for r in reasons if r), None)
        if reason:
            raise ConfigError(reason)

    def _build_model(self, source: ModelSource) -> CausalModel:
        t0 = time.perf_counter()
        with torch.device("meta"):
            model = registry.build_model(source.hf_config, self.max_model_len, self.backend, self.tp,
                                         head_fp32=self.config.model.head_fp32)
        # Materialise on the device without initialising: every parameter is loaded next.
        model = model.to(dtype=self.dtype)
        if self.use_arenas:
            self.weight_arena = place_parameters(model, self.device)
        else:
            model = model.to_empty(device=self.device)
        model.tie_weights()
        model.build_tables(self.device)
        self.load_weights(model, source.iter_weights(self.dtype, self.device), complete=True)
        model.eval()
        logger.info("loaded %s in %.1fs (%s, %s)", source.name, time.perf_counter() - t0, self.dtype, self.device)
        return model

    @staticmethod
    def load_weights(model: CausalModel, weights, complete: bool = False) -> set[str]:
        written = model.load_weights(weights)
        if complete:
            missing = model.expected_weight_names() - written
            if missing:
                raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:5]}")
        return written

    def _kv_scales(self, source: ModelSource) -> KVScales | None:
        """An fp8 cache's scales: the checkpoint's (Hugging Face folders), else computed
        (``calculate_kv_scales``), else 1.0 per layer."""
        if not is_quantized(self.kv_dtype):
            return None
        files = getattr(source.checkpoint, "files", None) if source.kind == "hf" else None
        try:
            scales = source_kv_scales(files, self.model.kv_layout.num_layers)
        except ValueError as e:
            raise ConfigError(f"kv_cache_dtype={self.config.cache.kv_cache_dtype}: {e}") from None
        if scales.origin != CHECKPOINT and self.config.cache.calculate_kv_scales:
            scales = calculate_kv_scales(self.model, self.model.shape.vocab_size, self.dtype, self.kv_dtype,
                                         self.device, self.max_model_len, self.block_size, self.tp)  # fmt: skip
        logger.info("KV cache: %s, scales from the %s (K %.3g-%.3g, V %.3g-%.3g)", self.kv_dtype, scales.origin,
                    min(scales.k), max(scales.k), min(scales.v), max(scales.v))  # fmt: skip
        return scales

    def _allocate_kv_cache(self) -> KVCache:
        shape = self.model.kv_layout  # this rank's KV heads only
        block_bytes = KVCache.bytes_per_block(shape.num_layers, self.block_size, shape.num_kv_heads, shape.head_dim,
                                              self.kv_dtype)  # fmt: skip
        # Every rank holds the same blocks: the one with least room decides (profiles differ a little).
        num_blocks = min_over_ranks(self.tp, max(1, self._kv_cache_bytes() // block_bytes), self.device)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, self.block_size, num_blocks * block_bytes / 2**20)
        storage = None
        if self.use_arenas:
            self.kv_arena = VirtualArena(num_blocks * block_bytes, self.device)
            storage = self.kv_arena.tensor
        t0 = time.perf_counter()
        prefault = self.config.cache.prefault_kv_cache and storage is None and self.device.type == "cpu"
        cache = KVCache.allocate(
            num_blocks, shape.num_layers, self.block_size, shape.num_kv_heads, shape.head_dim, self.kv_dtype,
            self.device, storage=storage, prefault=prefault, scales=self.kv_scales,
        )
        if prefault:
            logger.info("KV cache pages written at start-up in %.1f s", time.perf_counter() - t0)
        return cache

    def _record_routing(self, name: str) -> None:
        sink = self.model.routing
        if sink is None:
            raise ConfigError(f"enable_return_routed_experts: {name} is a dense model, it routes to no experts")
        if self.tp.rank:
            return  # rank 0 reports them; the others route the same tokens the same way
        sched = self.config.scheduler
        # Every step's tokens: the budget, a decode batch, a piecewise bucket past the budget.
        rows = max(sched.max_num_batched_tokens, sched.max_num_seqs, next(
            (b for b in PIECEWISE_BUCKETS if b >= sched.max_num_batched_tokens), PIECEWISE_BUCKETS[-1]))  # fmt: skip
        sink.allocate(rows, self.device, id_dtype(sink.layout.num_experts))
        archive = tier_blocks(self.config.kv_transfer, self.kv_cache.block_bytes)
        self.routed = RoutedExpertsStore(self.kv_cache.num_blocks, self.block_size, sink.layout, archive)

    def routed_experts_refusal(self, params: SamplingParams, prompt_len: int) -> str | None:
        """Why a request's ``return_routed_experts`` cannot be honoured here, or None."""
        return routed_experts_refusal(params, prompt_len, self.routed, self.model.routing is None)

    def attach_routed_experts(self, sched: SchedulerOutput, outputs: list[EngineCoreOutput]) -> None:
        """Put the routed experts on the outputs that finish requests which asked for them
        (called right after the step's outputs are made, before a block they held is reused)."""
        if self.routed is None:
            return
        finished = {out.request_id: out for out in outputs if out.finish_reason is not None}
        for item in sched.scheduled:
            out = finished.get(item.request.request_id)
            if out is not None and item.request.sampling_params.return_routed_experts:
                out.routed_experts = self.routed.gather(item.request, item.block_ids)

    def _pending_routing(self, sched: SchedulerOutput, plan: StepPlan) -> PendingRouting | None:
        if self.routed is None:
            return None
        items = [RoutedRows(item.request, item.start, item.num_new_tokens, offset, item.block_ids)
                 for item, offset in zip(sched.scheduled, plan.starts)]  # fmt: skip
        return PendingRouting(self.model.routing.buffer[: plan.starts[-1]], items, self.routed)

    def sleepable_memory(self) -> SleepableMemory | ArenaMemory:
        # Built after the start-up capture, so the backup's background pinning never meets it.
        background = self.config.background_weight_backup()
        if self.weight_arena is not None and self.kv_arena is not None:
            return ArenaMemory(self.weight_arena, self.kv_arena, background)
        return SleepableMemory(list(self.model.parameters()), self.kv_cache, self.device, background)

    def _kv_cache_bytes(self) -> int:
        cache = self.config.cache
        if cache.kv_cache_bytes is not None:
            return cache.kv_cache_bytes
        if self.device.type != "cuda":
            return cache.cpu_kv_cache_bytes
        free, total = torch.cuda.mem_get_info(self.device)
        used_elsewhere = total - free  # weights, other processes
        activation_peak = self._profile_activation_bytes()
        return int(total * cache.gpu_memory_utilization - used_elsewhere - activation_peak)

    def _profile_activation_bytes(self) -> int:
        """Peak memory of one full-budget prefill, run against a throwaway one-block cache."""
        n = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        shape = self.model.kv_layout
        scratch = KVCache.allocate(
            -(-n // self.block_size), shape.num_layers, self.block_size, shape.num_kv_heads, shape.head_dim,
            self.kv_dtype, self.device, scales=self.kv_scales,
        )
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        meta = self._dummy_meta([(0, n)], scratch.num_blocks, writes=True)
        with torch.inference_mode():
            hidden = self.model(torch.zeros(n, dtype=torch.long, device=self.device),
                                torch.arange(n, device=self.device), scratch, meta)
            self.model.compute_logits(hidden[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del scratch
        torch.cuda.empty_cache()
        return peak

    def _warm_up_kernels(self) -> None:
        """Compile each attention path's kernels now, not in the middle of serving.

        A first resume from the tier (short extends over long cached prefixes) would
        otherwise compile the split-prefill kernels during its replay (H200: three
        steps of ~0.3 s each). Writes go to slot -1 (skipped); reads are of no consequence.
        """
        t0 = time.perf_counter()
        short = min(WARM_UP_QUERY_TOKENS, self.max_model_len // 2)
        long_ctx = max(short, min(self.max_model_len, WARM_UP_LONG_CONTEXT) - short)
        batches = [
            [(long_ctx, short), (long_ctx, 1), (long_ctx, 1)],  # split prefill tiles, split decode rows
            [(0, short), (long_ctx, 1)],  # one unified launch, its decode row split apart
            [(0, short), (short, 1)],  # one unified launch with its decode row
        ]
        with torch.inference_mode():
            for specs in batches:
                inputs = self._dummy_inputs(specs, self.kv_cache.num_blocks)
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)
                self.model.compute_logits(hidden[inputs.logits_rows])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("attention kernels warmed up in %.1fs", time.perf_counter() - t0)

    def _dummy_meta(self, specs: list[tuple[int, int]], num_blocks: int, writes: bool = False) -> AttentionMetadata:
        """Requests of (cached, new) tokens over blocks 0, 1, ... (wrapping at ``num_blocks``).

        Without ``writes`` every slot is -1, so nothing is written; with it, token ``t``
        of the flat batch writes slot ``t`` (a throwaway cache's).
        """
        dev, bs = self.device, self.block_size
        seq_lens = [c + q for c, q in specs]
        starts = [0]
        for _, q in specs:
            starts.append(starts[-1] + q)
        width = -(-max(seq_lens) // bs)
        tables = (torch.arange(width, dtype=torch.int32) % num_blocks).repeat(len(specs), 1)
        slots = torch.arange(starts[-1], dtype=torch.int64) if writes else torch.full((starts[-1],), -1, dtype=torch.int64)
        return AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev),
            slot_mapping=slots.to(dev),
            max_query_len=max(q for _, q in specs), max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
        )  # fmt: skip

    def _dummy_inputs(self, specs: list[tuple[int, int]], num_blocks: int, writes: bool = False,
                      seed: int | None = None) -> StepInputs:  # fmt: skip
        """A step of ``_dummy_meta``'s batch: token ids 0 (random in the vocabulary with a
        ``seed``), every token at its position, the last token's logits sampled."""
        meta = self._dummy_meta(specs, num_blocks, writes)
        n = meta.query_start_loc_cpu[-1]
        if seed is None:
            ids = torch.zeros(n, dtype=torch.long)
        else:
            ids = torch.randint(0, self.model.shape.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))
        positions = torch.tensor([c + i for c, q in specs for i in range(q)])
        dev = self.device
        return StepInputs(ids.to(dev), positions.to(dev), meta, logits_rows=torch.tensor([n - 1], device=dev), sampled=[])

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    # -- one step ----------------------------------------------------------------------

    def execute(self, sched: SchedulerOutput) -> dict[str, SampleResult]:
        return self.launch(sched).results()

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, prev: LaunchedStep | None = None, peers: StepPeers | None = None) -> LaunchedStep:
        """Queue the step's forward and sampling. A row whose input token ``prev`` sampled and
        the host has not seen yet (the scheduler ran ahead of it) reads it on the device.

        ``peers``: the other tensor-parallel ranks, handed the step's plan once it is checked
        (a step refused before that costs them nothing) to run it beside this rank."""
        if sched.is_empty:
            return LaunchedStep([], None)
        self.wait_for_landings(sched.transfers)  # first: nothing after it may run ahead of them
        plan, sampled = self._plan(sched, prev)
        if peers is None:
            return self._launch_planned(sched, plan, sampled, prev)
        peers.launch(plan)
        try:
            return self._launch_planned(sched, plan, sampled, prev)
        except Exception as e:
            # The other ranks run this step's collectives: they cannot be taken back.
            raise peers.step_failed(e) from e

    def _launch_planned(
        self, sched: SchedulerOutput, plan: StepPlan, sampled: list[ScheduledRequest], prev: LaunchedStep | None
    ) -> LaunchedStep:
        DEVICE_WORK.touch()  # the weights' backup is pinned only while the device has no work
        transfers = sched.transfers
        if transfers and self.device.type == "cuda":
            # The copies wait for what is queued before this forward: it neither reads the
            # blocks that loads overwrite nor writes the full ones stores read. So they are
            # issued once it is launched, their host work done while the device runs it.
            mark = torch.cuda.Event()
            mark.record()
            transfers.mark(mark)
        inputs = self._device_inputs(plan, prev.samples.tokens if plan.num_unseen else None, sampled)
        hidden = self._forward(inputs)
        routing = self._pending_routing(sched, plan)
        if transfers:
            # Stores first: they read blocks the previous forward filled, on their own stream.
            self.connector.run_stores(transfers, self.kv_cache)
            self.connector.run_loads(transfers, self.kv_cache)
        prompt = self._score_prompt(hidden, inputs.prompt)
        prompt_ids = [] if inputs.prompt is None else inputs.prompt.request_ids
        if not inputs.sampled:
            if prompt is None:
                return LaunchedStep([], None, routing=routing)
            no_tokens = torch.empty(0, dtype=torch.long, device=self.device)
            return LaunchedStep([], PendingSamples(no_tokens, None, [], prompt), prompt_ids, routing)
        logits = self.model.compute_logits(hidden[inputs.logits_rows])
        rows = [self._sampling_row(item.request) for item in inputs.sampled]
        samples = self.sampler.sample(logits, rows, prompt)
        return LaunchedStep([item.request.request_id for item in inputs.sampled], samples, prompt_ids, routing)

    def wait_for_landings(self, transfers: StepTransfers | None) -> None:
        """The compute stream waits for the loads of requests that joined before landing: this
        step's forward and every later one read their blocks after the copies. (On the CPU a
        copy has landed when issued: no request joins ahead of one.)"""
        if transfers is not None and transfers.waits and self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            for event in transfers.waits:
                stream.wait_event(event)

    @torch.inference_mode()
    def run_plan(self, plan: StepPlan) -> None:
        """Another rank's step, as planned on rank 0: the same forward and the same collectives
        (the head's gathers of sampled and scored rows), nothing sampled here."""
        DEVICE_WORK.touch()  # the weights' backup is pinned only while the device has no work
        inputs = self._device_inputs(plan, None, [])
        hidden = self._forward(inputs)
        self._score_prompt(hidden, inputs.prompt)
        if len(plan.logits_rows):
            self.model.compute_logits(hidden[inputs.logits_rows])

    def _score_prompt(self, hidden: torch.Tensor, prompt: PromptRows | None) -> PromptScores | None:
        """Prompt logprobs of the step's scored rows: the LM head on those rows alone, in chunks."""
        if prompt is None:
            return None
        per_chunk = max(1, PROMPT_SCORE_CHUNK_ELEMENTS // self.model.shape.vocab_size)
        chunks = []
        for start in range(0, prompt.num_rows, per_chunk):
            rows = slice(start, start + per_chunk)
            logits = self.model.compute_logits(hidden[prompt.rows[rows]])
            chunks.append(score_tokens(logits, prompt.targets[rows], prompt.top_n))
        return PromptScores.concat(prompt.spans, chunks)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        meta = inputs.meta
        if self.graphs is not None and meta.is_decode_only:
            hidden = self.graphs.run(
                inputs.input_ids, inputs.positions, meta.slot_mapping, meta.seq_lens, meta.block_tables
            )
            if hidden is not None:
                return hidden
        if self.mixed_graphs is not None and not meta.is_decode_only:
            hidden = self.mixed_graphs.run(inputs.input_ids, inputs.positions, meta)
            if hidden is not None:
                return hidden
        if self.piecewise is not None:
            hidden = self.piecewise.run(inputs.input_ids, inputs.positions, meta)
            if hidden is not None:
                return hidden
        # While routing is recorded the last layer routes every row: nothing is left out.
        keep = None if self.routed is not None else self._kept_rows(inputs)
        return self.model(inputs.input_ids, inputs.positions, self.kv_cache, meta, keep=keep)

    @staticmethod
    def _kept_rows(inputs: StepInputs) -> torch.Tensor | None:
        """The rows whose hidden states the step reads (sampled and scored), where they are few
        enough of its rows for the last layer's tail to run on them alone (``CausalModel.forward``)."""
        rows = inputs.logits_rows
        if inputs.prompt is not None:
            rows = torch.cat([rows, inputs.prompt.rows])
        return rows if len(rows) * KEEP_ROWS_FRACTION <= len(inputs.input_ids) else None

    def memory_moved(self) -> None:
        """Weights or KV were re-allocated (sleep): graphs captured on the old addresses are void."""
        for graphs in (self.graphs, self.piecewise, self.mixed_graphs):
            if graphs is not None:
                graphs.invalidate()

    def recapture_graphs(self, decode_only: bool = False) -> None:
        """Capture now (at start and on wake-up) rather than in the first steps after it; only the
        decode graphs where ``decode_only`` (a bench that switched how kernels launch)."""
        if decode_only and self.graphs is not None:
            # Captured again over live graphs: a fresh pool (reusing the old one's id once its
            # graphs are gone trips the caching allocator's assert, H100 run 58a).
            self.graphs.invalidate()
        # Global capture mode: no thread may pin host memory meanwhile (another engine's backup).
        with CAPTURE_LOCK:
            for graphs in (self.graphs,) if decode_only else (self.graphs, self.piecewise, self.mixed_graphs):
                if graphs is not None:
                    graphs.capture()

    def _plan(self, sched: SchedulerOutput, prev: LaunchedStep | None) -> tuple[StepPlan, list[ScheduledRequest]]:
        """The step as host arrays (what every rank needs), and the requests of its sampled rows."""
        items = sched.scheduled
        ids = array(TOKEN_TYPECODE)  # the requests' own int64 arrays, appended without boxing
        unseen_at: list[int] = []  # token indices whose id is ``prev``'s sample, still on the device
        unseen_rows: list[int] = []  # and the rows of ``prev`` that sampled them
        starts = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        sampled: list[ScheduledRequest] = []
        scored: list[tuple[int, ScheduledRequest]] = []  # (first row, item) of items that score prompt tokens
        # numpy, not nested lists through torch.tensor: 16 rows of 1,219 blocks take 0.3 ms, not 1.1.
        table = np.zeros((len(items), max(len(item.block_ids) for item in items)), dtype=np.int32)
        for row, item in enumerate(items):
            end = item.start + item.num_new_tokens
            known = item.request.all_token_ids[item.start : end]
            ids.extend(known)
            if len(known) < item.num_new_tokens:  # only the last can be unseen: one step ahead at most
                if prev is None or len(known) + 1 != item.num_new_tokens:
                    raise RuntimeError(f"request {item.request.request_id}: input tokens not sampled yet")
                unseen_at.append(len(ids))
                unseen_rows.append(prev.row_of[item.request.request_id])
                ids.append(0)
            if item.prompt_logprob_positions:
                scored.append((starts[-1], item))
            starts.append(starts[-1] + item.num_new_tokens)
            seq_lens.append(end)
            table[row, : len(item.block_ids)] = item.block_ids
            if item.sample:
                logits_rows.append(starts[-1] - 1)
                sampled.append(item)
        q_lens = np.diff(starts)
        row_of_token = np.repeat(np.arange(len(items)), q_lens)
        # Each row's positions run from its first new token: seq_len - q_len onwards.
        pos = np.arange(starts[-1], dtype=np.int64) - np.repeat(np.asarray(starts[:-1]) - (np.asarray(seq_lens) - q_lens), q_lens)
        slots = table[row_of_token, pos // self.block_size].astype(np.int64) * self.block_size + pos % self.block_size
        plan = StepPlan(
            starts=starts, seq_lens=seq_lens, table=table, slots=slots, input_ids=np.frombuffer(ids, dtype=np.int64),
            positions=pos, logits_rows=np.asarray(logits_rows, dtype=np.int64),
            unseen_at=np.asarray(unseen_at, dtype=np.int64), unseen_rows=np.asarray(unseen_rows, dtype=np.int64),
            prompt=_prompt_rows(scored) if scored else None,
            zero_blocks=self._claim_unset(table, items),
        )  # fmt: skip
        return plan, sampled

    def _claim_unset(self, table: np.ndarray, items: list[ScheduledRequest]) -> np.ndarray | None:
        if self.kv_cache.unset is None:
            return None
        # The rows' own blocks, not the table's padding: block 0 may be another request's,
        # with a tier load on its way in.
        owned = np.arange(table.shape[1]) < np.asarray([len(item.block_ids) for item in items])[:, None]
        ids = self.kv_cache.claim_unset(table[owned])
        return ids if len(ids) else None

    def _device_inputs(self, plan: StepPlan, prev_tokens: torch.Tensor | None, sampled: list[ScheduledRequest]) -> StepInputs:
        """The plan's arrays on the device, in one launch (never a copy engine: tier copies keep
        those busy). ``prev_tokens``: the previous step's samples on the device, which the unseen
        input tokens are (None on the other ranks, which receive them from rank 0)."""
        starts, seq_lens = plan.starts, plan.seq_lens
        host = [np.asarray(starts, dtype=np.int32), np.asarray(seq_lens, dtype=np.int32), plan.table, plan.slots,
                plan.input_ids, plan.positions, plan.logits_rows, plan.unseen_at, plan.unseen_rows]  # fmt: skip
        if plan.prompt is not None:
            host.extend(plan.prompt[:2])
        if plan.zero_blocks is not None:
            host.append(plan.zero_blocks)
        moved = to_device_many([torch.from_numpy(h) for h in host], self.device)
        if plan.zero_blocks is not None:
            # On the compute stream, before the forward writes or reads them.
            self.kv_cache.zero_blocks(moved.pop())
        starts_d, seq_lens_d, tables_d, slots_d, ids_d, pos_d, rows_d, at_d, from_d = moved[:9]
        prompt = None if plan.prompt is None else PromptRows(*moved[9:], *plan.prompt[2:])
        if plan.num_unseen:
            if prev_tokens is not None:
                unseen = prev_tokens[from_d]
            else:
                unseen = torch.empty(plan.num_unseen, dtype=torch.long, device=self.device)
            if self.tp.size > 1:
                broadcast(self.tp, unseen)  # rank 0 sampled them; every rank embeds them
            ids_d[at_d] = unseen
        meta = AttentionMetadata(
            query_start_loc=starts_d,
            seq_lens=seq_lens_d,
            block_tables=tables_d,
            slot_mapping=slots_d,
            max_query_len=max(b - a for a, b in zip(starts, starts[1:])),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )
        return StepInputs(input_ids=ids_d, positions=pos_d, meta=meta, logits_rows=rows_d, sampled=sampled,
                          prompt=prompt)  # fmt: skip

    def _sampling_row(self, request: Request) -> SamplingRow:
        params = request.sampling_params
        if params.seed is not None and request.generator is None:
            request.generator = make_generator(params.seed, self.device)
        banned: list[int] = []
        if request.num_output_tokens + request.num_unseen < params.min_tokens:
            banned.extend(params.stop_token_ids or ())
            if not params.ignore_eos:
                banned.extend(request.eos_token_ids)
        return SamplingRow(
            params=params,
            generator=request.generator,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            banned_token_ids=banned,
        )


def _prompt_rows(scored: list[tuple[int, ScheduledRequest]]) -> tuple[np.ndarray, np.ndarray, list[PromptSpan], list[str]]:
    """Host side of ``PromptRows``: for each item, the rows of its scored positions (``first``
    is the row of its first new token) and the prompt tokens they score."""
    rows, targets, spans, ids = [], [], [], []
    for first, item in scored:
        positions = item.prompt_logprob_positions
        rows.append(np.arange(positions.start, positions.stop, dtype=np.int64) + (first - item.start))
        # Position p's logits score the token at p + 1.
        targets.append(np.asarray(item.request.prompt_token_ids[positions.start + 1 : positions.stop + 1], dtype=np.int64))
        top_n = item.request.sampling_params.prompt_logprobs or 0
        spans.append(PromptSpan(first=positions.start + 1, count=len(positions), top_n=top_n))
        ids.append(item.request.request_id)
    return np.concatenate(rows), np.concatenate(targets), spans, ids
