"""The engine's flags on the command line, shared by ``siesta serve``, ``generate`` and the
benchmarks: below the command line (which imports the benchmarks), so that they all read them one way.

Each flag is a field of ``siesta.config.EngineFlags``, which declares its name and default once
(``LLM(...)`` takes the same keywords). This table says only how the command line spells and
parses each; its default is read from there, and ``engine_kwargs`` reads every field back.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from siesta.attention.kv_quant import KV_CACHE_DTYPES
from siesta.config import WEIGHT_BACKUP_MODES, EngineFlags
from siesta.entrypoints.cli_flags import add_vllm_flags, byte_size, check_vllm_flags

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineFlags)}


@dataclass(frozen=True)
class CliFlag:
    name: str  # the EngineFlags field
    options: tuple[str, ...]
    parse: dict[str, Any] = field(default_factory=dict)  # argparse's type, action, choices, help; default: EngineFlags'


BOOL = argparse.BooleanOptionalAction
FLAGS: tuple[CliFlag, ...] = (
    CliFlag("model", ("--model",), {"help": "GGUF file, HF directory or random:<shape>; default: embedded SmolLM2"}),
    CliFlag("tokenizer", ("--tokenizer",)),
    CliFlag("dtype", ("--dtype",)),
    CliFlag("max_model_len", ("--max-model-len",), {"type": int}),
    CliFlag("block_size", ("--block-size",), {"type": int}),
    CliFlag("kv_cache_bytes", ("--kv-cache-bytes",), {"type": byte_size, "help": "bytes, or with units: 4G, 512MiB"}),
    CliFlag("prefault_kv_cache", ("--prefault-kv-cache",),
            {"action": BOOL, "help": "CPU: write the whole KV pool at start-up, not as blocks are first used"}),
    # Not given is None, so that the CPU can say the flag does nothing there (cli_flags), then the default.
    CliFlag("gpu_memory_utilization", ("--gpu-memory-utilization",),
            {"type": float, "default": None,
             "help": f"share of the GPU to fill (default {_DEFAULTS['gpu_memory_utilization']:g})"}),
    CliFlag("enable_prefix_caching", ("--enable-prefix-caching",),
            {"action": BOOL, "help": "vLLM's; on by default (--no-enable-prefix-caching turns it off)"}),
    CliFlag("tensor_parallel_size", ("--tensor-parallel-size", "-tp"),
            {"type": int, "help": "ranks (one process and one GPU each) that split every layer"}),
    CliFlag("kv_cache_dtype", ("--kv-cache-dtype",),
            {"help": f"{', '.join(KV_CACHE_DTYPES)}: auto is the model's dtype; fp8 (= fp8_e4m3) and fp8_e5m2 hold "
                     "a byte a value under per-layer scales (the checkpoint's, else 1.0 or --calculate-kv-scales)"}),
    CliFlag("calculate_kv_scales", ("--calculate-kv-scales",),
            {"action": "store_true", "help": "fp8 KV without checkpoint scales: compute them at start from a fixed "
                                             "calibration prompt (vLLM's flag; default: 1.0)"}),
    CliFlag("max_num_batched_tokens", ("--max-num-batched-tokens",),
            {"type": int, "help": "tokens a step may compute (default: vLLM's: 8192 for serve on an H100/H200-class "
                                  "GPU, 16384 offline; 2048/8192 on smaller GPUs; 2048/4096 per rank on the CPU)"}),
    CliFlag("max_num_seqs", ("--max-num-seqs",),
            {"type": int, "help": "requests running at once (default: vLLM's for the device and entrypoint)"}),
    CliFlag("enable_chunked_prefill", ("--no-chunked-prefill",), {"action": "store_false"}),
    CliFlag("async_scheduling", ("--async-scheduling",),
            {"action": BOOL,
             "help": "schedule a step ahead of reading samples back (default: on CUDA, off on the CPU)"}),
    CliFlag("max_waiting_requests", ("--max-waiting-requests",),
            {"type": int, "help": "engine requests that may wait; past it new ones get 429 (a request counts "
                                  "prompts x n)"}),
    CliFlag("kv_transfer_config", ("--kv-transfer-config",),
            {"help": "JSON, e.g. '{\"kv_connector\":\"OffloadingConnector\"}'"}),
    CliFlag("weight_transfer_config", ("--weight-transfer-config",),
            {"help": "JSON, e.g. '{\"backend\":\"nccl\"}' (nccl or ipc; packed_buffer_size_bytes, timeout_s)"}),
    CliFlag("device", ("--device",)),
    CliFlag("seed", ("--seed",), {"type": int}),
    CliFlag("enforce_eager", ("--enforce-eager",), {"action": "store_true"}),
    CliFlag("attention_backend", ("--attention-backend",), {"choices": ["auto", "torch", "triton"]}),
    CliFlag("enable_sleep_mode", ("--enable-sleep-mode",), {"action": BOOL}),
    CliFlag("weight_backup", ("--weight-backup",),
            {"choices": list(WEIGHT_BACKUP_MODES),
             "help": "when the level-1 sleep's pinned host copy of the weights is made: background (from start-up, "
                     "while no step runs), first_sleep, or auto (background on CUDA)"}),
    CliFlag("head_dtype", ("--head-dtype",),
            {"choices": ["auto", "float32", "fp32"],
             "help": "float32: the final norm, output head and logits in fp32 (RL: logprobs nearer the trainer's)"}),
    CliFlag("deterministic", ("--deterministic",),
            {"action": "store_true", "help": "batch-invariant: a request's bits do not depend on its batch, chunking "
                                             "or prefix source (or VLLM_BATCH_INVARIANT=1)"}),
    CliFlag("enable_return_routed_experts", ("--enable-return-routed-experts",),
            {"action": "store_true", "help": "MoE models: record each token's top-k experts per layer, for requests "
                                             "that ask for them (SGLang's return_routed_experts, for RL's routing "
                                             "replay)"}),
    CliFlag("cpu_threads", ("--cpu-threads",),
            {"type": int, "help": "CPU: torch's threads per rank (default: the cores this process may use, less one "
                                  "for the API server under serve)"}),
)  # fmt: skip

# Every field has its flag (tests/entrypoints/test_cli.py). Other spellings of a flag (another
# engine's name, an old one) are added after it: the first action
# of a destination sets its default, so the flag's own stands.
ALIASES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--no-prefix-caching", {"dest": "enable_prefix_caching", "action": "store_false", "help": argparse.SUPPRESS}),
    ("--enable-fp32-lm-head",
     {"dest": "head_dtype", "action": "store_const", "const": "float32",
      "help": "SGLang's name for --head-dtype float32"}),
    ("--enable-deterministic-inference",
     {"dest": "deterministic", "action": "store_true", "help": "SGLang's name for --deterministic"}),
)  # fmt: skip


def add_engine_args(p: argparse.ArgumentParser) -> None:
    for flag in FLAGS:
        p.add_argument(*flag.options, dest=flag.name, **({"default": _DEFAULTS[flag.name]} | flag.parse))
    for option, parse in ALIASES:
        p.add_argument(option, **parse)
    add_vllm_flags(p)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """``LLM(**engine_kwargs(args))``: every engine flag as parsed."""
    check_vllm_flags(args)
    return {name: getattr(args, name) for name in _DEFAULTS}


def engine_config(args: argparse.Namespace):
    """The EngineConfig the engine flags describe (what ``LLM(**engine_kwargs(args))`` builds), for the server."""
    from siesta.config import EngineConfig

    return EngineConfig.from_flags(usage_context="api_server", **engine_kwargs(args))
