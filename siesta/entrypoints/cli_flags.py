"""vLLM's command-line flags, as a vLLM user pastes them, and the checks that give a one-line
answer instead of a traceback or a silent no-op.

A flag siesta understands is taken with vLLM's meaning. One it understands but cannot honour
is refused by name with the reason. Sizes take units (``1G``, ``512MiB``), as people write them.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from siesta.attention.kv_quant import check_kv_cache_dtype
from siesta.config import EngineFlags

# K, M, G, T alone or with "i" are binary (1G = 2**30, as vLLM's size flags read them); with a
# plain "B" they are decimal (1GB = 10**9). A bare number is bytes.
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "ki": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mi": 1 << 20,
          "mib": 1 << 20, "mb": 10**6, "g": 1 << 30, "gi": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40,
          "ti": 1 << 40, "tib": 1 << 40, "tb": 10**12}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
GENERATION_CONFIGS = ("vllm",)  # vLLM's own sampling defaults, which siesta uses
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
DEFAULT_GPU_MEMORY_UTILIZATION = EngineFlags.gpu_memory_utilization


def byte_size(text: str) -> int:
    """``4294967296``, ``4G``, ``4GiB`` or ``4.5GB`` -> bytes (argparse type)."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes, or a number with K, M, G or T (4G, 512MiB)")
    return int(float(match.group(1)) * _UNITS[unit])


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """The flags of ``vllm serve`` that set nothing of the engine's (its own are ``engine_args``'s, vLLM's
    spellings among them: --enable-prefix-caching, --tensor-parallel-size, --kv-cache-dtype)."""
    p.add_argument("--disable-log-requests", action="store_true",
                   help="vLLM's; siesta logs no per-request lines in any case")  # fmt: skip
    p.add_argument("--disable-log-stats", action="store_true",
                   help="vLLM's; siesta logs no periodic stats in any case (they are in /metrics)")  # fmt: skip
    p.add_argument("--generation-config", default="vllm",
                   help="vllm: vLLM's own sampling defaults, which siesta uses")  # fmt: skip
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted: siesta runs no model code but its own, for the architectures it implements")  # fmt: skip


def check_vllm_flags(args: argparse.Namespace) -> None:
    """Refuse, by name and with the reason, what siesta understands but cannot do."""
    if getattr(args, "tensor_parallel_size", 1) < 1:
        raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size}: give 1 or more ranks")
    try:
        check_kv_cache_dtype(getattr(args, "kv_cache_dtype", "auto"))
    except ValueError as e:
        raise ValueError(f"--kv-cache-dtype {args.kv_cache_dtype}: {e}") from None
    if getattr(args, "generation_config", "vllm") not in GENERATION_CONFIGS:
        raise ValueError(f"--generation-config {args.generation_config}: siesta does not read a model's "
                         "generation_config.json defaults yet; use vllm (vLLM's own defaults)")  # fmt: skip
    _check_tokenizer(args)
    _check_memory_flags(args)


def _check_tokenizer(args: argparse.Namespace) -> None:
    tokenizer = getattr(args, "tokenizer", None)
    if tokenizer is None:
        return
    if not os.path.exists(tokenizer):
        raise ValueError(f"--tokenizer {tokenizer}: no such file or directory (tokenizers load from local paths; "
                         "nothing is downloaded)")  # fmt: skip
    from siesta.model.hf_loader import check_tokenizer_folder

    try:
        check_tokenizer_folder(Path(tokenizer))
    except ValueError as e:
        raise ValueError(f"--tokenizer {e}") from None


def _check_memory_flags(args: argparse.Namespace) -> None:
    """--gpu-memory-utilization sizes the cache on a GPU only: say so rather than ignore it."""
    given = getattr(args, "gpu_memory_utilization", None)
    if given is None:
        args.gpu_memory_utilization = DEFAULT_GPU_MEMORY_UTILIZATION
        return
    if not _on_gpu(getattr(args, "device", None)):
        print(f"siesta: warning: --gpu-memory-utilization {given:g} has no effect on the CPU: --kv-cache-bytes sizes "
              "the KV cache there (default 4G)", file=sys.stderr)  # fmt: skip


def _on_gpu(device: str | None) -> bool:
    if device is not None:
        return device.startswith("cuda")
    import torch

    return torch.cuda.is_available()


def check_prompts_are_not_models(prompts: list[str]) -> None:
    """``siesta generate DIR`` takes prompts; a model path given there is a mistake worth naming."""
    for prompt in prompts:
        if os.path.isdir(prompt) or (prompt.endswith(".gguf") and os.path.isfile(prompt)):
            raise ValueError(f"{prompt!r} is a model, not a prompt: siesta generate takes prompts; give the model "
                             f"with --model {prompt}")  # fmt: skip
