"""Every engine setting in one place, with its defaults and validation.

The engine is built from an ``EngineConfig``; nothing else holds tunables. ``EngineFlags`` is
the flat, vLLM-style view of it that ``LLM(...)`` and the command line take.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from siesta.attention.kv_quant import AUTO, KV_CACHE_DTYPES, check_kv_cache_dtype

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


WEIGHT_BACKUP_MODES = ("auto", "background", "first_sleep")
# Who drives the engine: the offline LLM class in the caller's process, or the API server
# (vLLM's UsageContext): the step budget's default, and the cores left to the API server,
# depend on it.
USAGE_CONTEXTS = ("llm", "api_server")
STEP_TRACE_ENV = "SIESTA_STEP_TRACE"
HEAD_FP32_NAMES = ("float32", "fp32")
# Batch-invariant (deterministic) mode from the environment, under vLLM's name or siesta's.
DETERMINISTIC_ENVS = ("VLLM_BATCH_INVARIANT", "SIESTA_DETERMINISTIC")
# Programmatic dependent launch of the decode kernels (siesta/pdl.py): SIESTA_PDL=0 turns it off.
PDL_ENV = "SIESTA_PDL"
_FALSE = ("0", "false", "no")
_TRUE = ("1", "true", "yes")


def _env_flag(names: tuple[str, ...]) -> bool:
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in names)


class ConfigError(ValueError):
    """A setting that cannot work; the message names it."""


def resolve_dtype(name: str | torch.dtype, model_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    """``auto`` picks the checkpoint's dtype, except where this device runs it badly."""
    if isinstance(name, torch.dtype):
        return name
    if name != "auto":
        if name not in _DTYPES:
            raise ConfigError(f"dtype={name!r} is not one of auto, {', '.join(sorted(set(_DTYPES)))}")
        return _DTYPES[name]
    if device.type == "cpu":
        # CPU matmuls in fp16 run ~10x slower than fp32 here; bf16 keeps its speed.
        return torch.bfloat16 if model_dtype == torch.bfloat16 else torch.float32
    return model_dtype if model_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


@dataclass
class ModelConfig:
    """Which weights to run and how."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    tokenizer: str | None = None  # None: the model's own
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None  # None: the model's context length
    seed: int = 0  # random-init weights and unseeded sampling
    weight_version: str = "0"
    # "float32": the final norm, the output head and the logits in fp32 (vLLM's head_dtype,
    # SGLang's --enable-fp32-lm-head); "auto": in the weights' dtype, logits cast to fp32 after.
    head_dtype: str = "auto"
    # SGLang's --enable-return-routed-experts: a mixture-of-experts model records every token's
    # top-k experts per layer (what requests with return_routed_experts get back). Off, nothing
    # is recorded and such requests are refused.
    enable_return_routed_experts: bool = False

    @property
    def head_fp32(self) -> bool:
        return self.head_dtype in HEAD_FP32_NAMES

    def validate(self) -> None:
        if self.head_dtype not in ("auto", *HEAD_FP32_NAMES):
            raise ConfigError(f"head_dtype must be auto or float32, got {self.head_dtype!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")
        if isinstance(self.dtype, str) and self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not one of auto, {', '.join(sorted(set(_DTYPES)))}")


@dataclass
class CacheConfig:
    """The paged device KV cache."""

    block_size: int = 16
    # Exactly one sizing rule applies: explicit bytes win over a memory fraction.
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    # On CPU there is no device to fill; this many bytes are used unless kv_cache_bytes says otherwise.
    cpu_kv_cache_bytes: int = 4 << 30  # what vLLM's CPU backend takes by default; committed only as used
    enable_prefix_caching: bool = True
    # On CPU: write every page of the pool at start-up, as vLLM's zeroed cache is, instead of as
    # blocks are first used. On a VM whose host backs memory lazily, a first touch costs about
    # 4 s a GB, and a fresh engine pays it inside its steps until the pool has gone round once.
    # Off by default: the pool then holds only what it stores. A sleep gives the pages back.
    prefault_kv_cache: bool = False
    # What the blocks hold (vLLM's --kv-cache-dtype): "auto" the model's dtype; "fp8" (= "fp8_e4m3")
    # or "fp8_e5m2" one byte a value under per-layer scales, twice the tokens of bf16 in the same
    # bytes (siesta/attention/kv_quant.py).
    kv_cache_dtype: str = AUTO
    # fp8 caches of a checkpoint that ships no scales: compute them at start from one fixed
    # calibration prompt (siesta/model/kv_calibration.py) instead of vLLM's default 1.0.
    calculate_kv_scales: bool = False

    @property
    def kv_quantized(self) -> bool:
        return KV_CACHE_DTYPES.get(self.kv_cache_dtype) is not None

    def validate(self) -> None:
        try:
            check_kv_cache_dtype(self.kv_cache_dtype)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ConfigError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class BatchDefaults:
    """A step's token budget and running-request cap when the user sets neither."""

    max_num_batched_tokens: int
    max_num_seqs: int


# vLLM's defaults (EngineArgs.get_batch_defaults), by device and usage context: a GPU of at
# least 70 GiB other than an A100 (H100, H200, MI300X) takes the large budget; the CPU's
# scale with the tensor-parallel size.
_LARGE_GPU_BYTES = 70 << 30
_LARGE_GPU_DEFAULTS = {"llm": BatchDefaults(16384, 1024), "api_server": BatchDefaults(8192, 1024)}
_GPU_DEFAULTS = {"llm": BatchDefaults(8192, 256), "api_server": BatchDefaults(2048, 256)}
_CPU_DEFAULTS = {"llm": BatchDefaults(4096, 256), "api_server": BatchDefaults(2048, 128)}


def batch_defaults(device: torch.device, usage_context: str, world_size: int = 1) -> BatchDefaults:
    """What vLLM would take for ``max_num_batched_tokens`` and ``max_num_seqs`` here."""
    if device.type == "cpu":
        base = _CPU_DEFAULTS[usage_context]
        return BatchDefaults(base.max_num_batched_tokens * world_size, base.max_num_seqs * world_size)
    try:
        props = torch.cuda.get_device_properties(device)
    except (AssertionError, RuntimeError):  # no such device here (a config validated elsewhere): vLLM's fallback
        return _GPU_DEFAULTS[usage_context]
    large = props.total_memory >= _LARGE_GPU_BYTES and "a100" not in props.name.lower()
    return (_LARGE_GPU_DEFAULTS if large else _GPU_DEFAULTS)[usage_context]


@dataclass
class SchedulerConfig:
    """Continuous batching limits."""

    # None: vLLM's default for the device and usage context (``batch_defaults``), or
    # max_model_len when prefills are not chunked.
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enable_chunked_prefill: bool = True
    # Schedule and launch step k+1 before reading step k's samples back (its inputs come from
    # them on the device), so the host's work of a step overlaps the device's. None: on where
    # the device runs ahead of the host (CUDA), off on the CPU, whose ops finish as they return.
    async_scheduling: bool | None = None
    # Under async scheduling, a request whose tier loads are expected to land before the step
    # scheduled now starts on the device joins it, which waits for them there (core/step_lead.py).
    # On: the kept resume's p50 was lower with it in 5 of 6 A/Bs (H100 runs 56a-b, H200 run 56c),
    # each by about the arms' own noise (DESIGN.md); bench resume --resume-join-arm runs both.
    join_loads_ahead: bool = True
    # Engine requests (prompts x n of every HTTP request) that may wait to be scheduled; past
    # this the engine refuses new ones (HTTP 429 with Retry-After) instead of queueing for hours.
    max_waiting_requests: int = 4096

    def resolve(self, max_model_len: int, defaults: BatchDefaults | None = None) -> None:
        defaults = defaults or _CPU_DEFAULTS["llm"]
        if self.max_num_batched_tokens is None:
            # vLLM takes max_model_len without chunked prefill; a larger budget only helps.
            chunked = self.enable_chunked_prefill
            self.max_num_batched_tokens = defaults.max_num_batched_tokens if chunked else max(
                defaults.max_num_batched_tokens, max_model_len)
        if self.max_num_seqs is None:
            self.max_num_seqs = min(defaults.max_num_seqs, self.max_num_batched_tokens)

    def validate(self, max_model_len: int, defaults: BatchDefaults) -> None:
        self.resolve(max_model_len, defaults)
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_waiting_requests <= 0:
            raise ConfigError(f"max_waiting_requests must be positive, got {self.max_waiting_requests}")
        if self.max_num_batched_tokens <= 0:
            raise ConfigError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ConfigError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be at "
                f"least max_model_len ({max_model_len}), or a long prompt could never be scheduled"
            )


CPU_MATMULS = ("auto", "mkl", "onednn")


@dataclass
class CpuConfig:
    """How an engine on the CPU computes (ignored on CUDA)."""

    # The library of fp32 linears past a decode step's few rows (siesta/model/cpu_linear.py):
    # "auto" takes oneDNN on AMD CPUs and MKL (F.linear's) elsewhere, as measured on each.
    matmul: str = "auto"
    # torch's (and the C kernels') threads per rank; None: the cores this process may use,
    # less one for the API server when there is one (siesta/cpu_threads.py).
    threads: int | None = None

    def validate(self) -> None:
        if self.matmul not in CPU_MATMULS:
            raise ConfigError(f"cpu.matmul must be one of {', '.join(CPU_MATMULS)}, got {self.matmul!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ConfigError(f"cpu threads must be a positive integer, got {self.threads!r}")


@dataclass
class ParallelConfig:
    """Tensor parallelism: one process per rank (rank 0 is the engine core's own), one device each."""

    tensor_parallel_size: int = 1
    # A rank that does not answer a call, or a collective that does not complete, within this
    # long has failed: the engine reports it, naming the rank, instead of hanging.
    rank_timeout_s: float = 120.0
    # Loading the model and capturing its graphs on every rank, before the engine is up.
    rank_start_timeout_s: float = 900.0
    # A rank that sent no heartbeat for this long is reported as hung.
    heartbeat_timeout_s: float = 10.0

    def validate(self, device: torch.device) -> None:
        size = self.tensor_parallel_size
        if not isinstance(size, int) or size < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive integer, got {size!r}")
        if device.type == "cuda" and size > 1 and size > torch.cuda.device_count():
            raise ConfigError(
                f"tensor_parallel_size={size} needs {size} GPUs; this host has {torch.cuda.device_count()}"
            )
        for name in ("rank_timeout_s", "rank_start_timeout_s", "heartbeat_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")


@dataclass
class KVTransferConfig:
    """Which KV connector moves blocks between the device and the outer tiers."""

    kv_connector: str | None = None
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: str | None = None

    @classmethod
    def from_any(cls, value: KVTransferConfig | dict[str, Any] | str | None) -> KVTransferConfig | None:
        """Accept the dataclass, a dict (Python API) or a JSON string (CLI)."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        value = _json_object("kv_transfer_config", value)
        unknown = set(value) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise ConfigError(f"kv_transfer_config has unknown keys: {sorted(unknown)}")
        cfg = cls(**value)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if not self.kv_connector:
            raise ConfigError("kv_transfer_config needs 'kv_connector' (e.g. 'OffloadingConnector')")
        if self.kv_role not in ("kv_both", "kv_producer", "kv_consumer"):
            raise ConfigError(f"kv_role must be kv_both, kv_producer or kv_consumer, got {self.kv_role!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ConfigError("kv_connector_extra_config must be a dict")


WEIGHT_TRANSFER_BACKENDS = ("nccl", "ipc")


@dataclass
class WeightTransferConfig:
    """How a trainer process pushes weights into the engine (``siesta.weight_transfer``).

    ``nccl``: a process group of the trainer (rank 0) and the engine (ranks from the init
    info's ``rank_offset``): NCCL on GPUs, gloo on CPUs. ``ipc``: a trainer on the same
    device hands over its tensors (CUDA IPC handles, or shared memory on the CPU).
    """

    backend: str = "nccl"
    # Bucket size of packed transfers whose update_info names none. vLLM's default is 1 GiB;
    # half of it keeps the receive buffer small beside a full KV cache and costs no speed.
    packed_buffer_size_bytes: int = 512 << 20
    packed_num_buffers: int = 2
    # A trainer silent this long mid-transfer (or at the rendezvous) has failed: the update
    # is refused, not waited on forever.
    timeout_s: float = 120.0
    # Joining a trainer's group (nccl's init, SGLang's /init_weights_update_group) runs beside the
    # step loop and fails after this long without the trainer; an init info's "timeout_s" overrides it.
    join_timeout_s: float = 30.0
    # ipc: keep the trainer's CUDA buffers of the last update mapped, so a push of the same
    # buffers opens nothing (siesta.weight_transfer.handles says what it holds on to).
    ipc_keep_mappings: bool = True

    @classmethod
    def from_any(cls, value: WeightTransferConfig | dict[str, Any] | str | None) -> WeightTransferConfig:
        if value is None:
            return cls()
        if isinstance(value, WeightTransferConfig):
            return value
        value = _json_object("weight_transfer_config", value)
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"weight_transfer_config has unknown keys: {sorted(unknown)}")
        cfg = cls(**value)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.backend not in WEIGHT_TRANSFER_BACKENDS:
            raise ConfigError(f"weight transfer backend must be one of {', '.join(WEIGHT_TRANSFER_BACKENDS)}, got {self.backend!r}")
        if not isinstance(self.packed_buffer_size_bytes, int) or self.packed_buffer_size_bytes <= 0:
            raise ConfigError(f"packed_buffer_size_bytes must be a positive integer, got {self.packed_buffer_size_bytes!r}")
        if not isinstance(self.packed_num_buffers, int) or self.packed_num_buffers <= 0:
            raise ConfigError(f"packed_num_buffers must be a positive integer, got {self.packed_num_buffers!r}")
        if not self.timeout_s > 0:
            raise ConfigError(f"weight transfer timeout_s must be positive, got {self.timeout_s!r}")
        if not self.join_timeout_s > 0:
            raise ConfigError(f"weight transfer join_timeout_s must be positive, got {self.join_timeout_s!r}")


def _json_object(what: str, value: dict[str, Any] | str) -> dict[str, Any]:
    """A dict (Python API) or a JSON object string (CLI)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{what} must be a dict or JSON object, got {type(value).__name__}")
    return value


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_transfer: KVTransferConfig | None = None
    weight_transfer: WeightTransferConfig = field(default_factory=WeightTransferConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cpu: CpuConfig = field(default_factory=CpuConfig)
    device: str | None = None  # None: cuda when available, else cpu
    enable_sleep_mode: bool = True
    # When the level-1 sleep's host backup of the weights is made (pinned, on CUDA):
    # "background" from start-up on, in a thread, so the first sleep is as fast as the rest;
    # "first_sleep" by the first sleep, holding no host memory until then; "auto" is
    # background on CUDA with sleep mode on, else first_sleep.
    weight_backup: str = "auto"
    # CUDA graphs for decode; ignored on CPU.
    enforce_eager: bool = False
    attention_backend: str = "auto"  # auto | torch | triton
    usage_context: str = "llm"  # one of USAGE_CONTEXTS
    # Batch invariance: a request's tokens and logprobs bit-identical whatever else is in its
    # batch, however its prompt was chunked and wherever its prefix came from
    # (siesta/model/batch_invariant.py). vLLM's VLLM_BATCH_INVARIANT=1 turns it on too.
    deterministic: bool = field(default_factory=lambda: _env_flag(DETERMINISTIC_ENVS))
    # Hopper's programmatic dependent launch for the decode path's Triton kernels (siesta/pdl.py;
    # a no-op elsewhere): on unless SIESTA_PDL=0 (batch-1 MoE decode 1.03x, H100 runs 58c-d).
    programmatic_dependent_launch: bool = field(
        default_factory=lambda: os.environ.get(PDL_ENV, "").strip().lower() not in _FALSE
    )
    # A file each engine step appends one JSON line to (when it started and ended, its tokens
    # and rows, the requests running, loading and waiting): where a replay's time went.
    step_trace: str | None = field(default_factory=lambda: os.environ.get(STEP_TRACE_ENV) or None)
    # Take the heap alive once the engine is built out of the collector's full passes
    # (core/gc_heap.py). None: on with CUDA, whose steps a full pass would stall; off on the CPU,
    # whose steps outlast it, and where a test process builds hundreds of engines.
    freeze_gc_heap: bool | None = None

    @classmethod
    def from_flags(cls, usage_context: str = "llm", **flags: Any) -> EngineConfig:
        """The flat, vLLM-style engine arguments (``EngineFlags``: ``LLM(...)``, CLI flags) as a config."""
        return EngineFlags(**flags).config(usage_context)

    def background_weight_backup(self) -> bool:
        """Whether the weights' sleep backup is made at start-up, in the background."""
        if self.weight_backup == "auto":
            return self.enable_sleep_mode and self.torch_device().type == "cuda"
        return self.weight_backup == "background"

    def freezes_gc_heap(self) -> bool:
        if self.freeze_gc_heap is None:
            return self.torch_device().type == "cuda"
        return self.freeze_gc_heap

    def torch_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def for_rank(self, rank: int) -> EngineConfig:
        """This config as tensor-parallel ``rank`` runs it: on CUDA, the rank-th GPU from the
        configured one (rank 0 keeps it)."""
        device = self.torch_device()
        if device.type != "cuda":
            return self
        first = device.index if device.index is not None else 0
        return dataclasses.replace(self, device=f"cuda:{first + rank}")

    def validate(self, max_model_len: int) -> None:
        self.model.validate()
        self.cache.validate()
        if self.usage_context not in USAGE_CONTEXTS:
            raise ConfigError(f"usage_context must be one of {', '.join(USAGE_CONTEXTS)}, got {self.usage_context!r}")
        defaults = batch_defaults(self.torch_device(), self.usage_context, self.parallel.tensor_parallel_size)
        self.scheduler.validate(max_model_len, defaults)
        if self.scheduler.async_scheduling is None:
            self.scheduler.async_scheduling = self.torch_device().type == "cuda"
        if self.kv_transfer is not None:
            self.kv_transfer.validate()
        self.weight_transfer.validate()
        self.parallel.validate(self.torch_device())
        if self.deterministic and self.cache.kv_quantized and self.torch_device().type == "cpu":
            raise ConfigError(f"deterministic mode on the CPU runs on its fp32 attention kernels, which read no "
                              f"{self.cache.kv_cache_dtype} KV cache (drop --kv-cache-dtype or --deterministic)")
        if self.deterministic and self.parallel.tensor_parallel_size > 1:
            raise ConfigError("deterministic mode runs on one rank: tensor parallelism's all-reduces sum in an order "
                              "of their own (drop --tensor-parallel-size or --deterministic)")
        self.cpu.validate()
        if self.weight_backup not in WEIGHT_BACKUP_MODES:
            raise ConfigError(f"weight_backup must be one of {', '.join(WEIGHT_BACKUP_MODES)}, got {self.weight_backup!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ConfigError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")


@dataclass
class EngineFlags:
    """The flat, vLLM-style engine arguments, declared once: ``LLM(...)``'s keywords (its signature
    is these fields), ``EngineConfig.from_flags``, and the command line's engine flags
    (``entrypoints/engine_args.py`` spells each on the command line and reads its default here).
    Each default is the structured config's own; what a field means is documented there."""

    model: str | None = ModelConfig.model
    tokenizer: str | None = ModelConfig.tokenizer
    dtype: str | torch.dtype = ModelConfig.dtype
    max_model_len: int | None = ModelConfig.max_model_len
    block_size: int = CacheConfig.block_size
    kv_cache_bytes: int | None = CacheConfig.kv_cache_bytes
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    prefault_kv_cache: bool = CacheConfig.prefault_kv_cache
    kv_cache_dtype: str = CacheConfig.kv_cache_dtype
    calculate_kv_scales: bool = CacheConfig.calculate_kv_scales
    seed: int = ModelConfig.seed
    max_num_batched_tokens: int | None = SchedulerConfig.max_num_batched_tokens
    max_num_seqs: int | None = SchedulerConfig.max_num_seqs
    enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill
    async_scheduling: bool | None = SchedulerConfig.async_scheduling
    max_waiting_requests: int = SchedulerConfig.max_waiting_requests
    kv_transfer_config: KVTransferConfig | dict[str, Any] | str | None = None  # None: no KV tiers
    weight_transfer_config: WeightTransferConfig | dict[str, Any] | str | None = None  # None: nccl's defaults
    device: str | None = EngineConfig.device
    enforce_eager: bool = EngineConfig.enforce_eager
    attention_backend: str = EngineConfig.attention_backend
    enable_sleep_mode: bool = EngineConfig.enable_sleep_mode
    weight_backup: str = EngineConfig.weight_backup
    tensor_parallel_size: int = ParallelConfig.tensor_parallel_size
    cpu_threads: int | None = CpuConfig.threads
    head_dtype: str = ModelConfig.head_dtype
    deterministic: bool | None = None  # None: the environment's (VLLM_BATCH_INVARIANT)
    enable_return_routed_experts: bool = ModelConfig.enable_return_routed_experts

    def config(self, usage_context: str = "llm") -> EngineConfig:
        return EngineConfig(
            model=ModelConfig(model=self.model, tokenizer=self.tokenizer, dtype=self.dtype,
                              max_model_len=self.max_model_len, seed=self.seed, head_dtype=self.head_dtype,
                              enable_return_routed_experts=self.enable_return_routed_experts),
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_bytes=self.kv_cache_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching,
                prefault_kv_cache=self.prefault_kv_cache,
                kv_cache_dtype=self.kv_cache_dtype,
                calculate_kv_scales=self.calculate_kv_scales,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                enable_chunked_prefill=self.enable_chunked_prefill,
                async_scheduling=self.async_scheduling,
                max_waiting_requests=self.max_waiting_requests,
            ),
            kv_transfer=KVTransferConfig.from_any(self.kv_transfer_config),
            weight_transfer=WeightTransferConfig.from_any(self.weight_transfer_config),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size),
            cpu=CpuConfig(threads=self.cpu_threads),
            device=self.device,
            enforce_eager=self.enforce_eager,
            attention_backend=self.attention_backend,
            enable_sleep_mode=self.enable_sleep_mode,
            weight_backup=self.weight_backup,
            usage_context=usage_context,
            **({} if self.deterministic is None else {"deterministic": self.deterministic}),
        )  # fmt: skip
