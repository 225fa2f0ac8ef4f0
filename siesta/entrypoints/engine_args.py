"""The engine's flags, shared by ``siesta serve``, ``generate`` and the benchmarks: below the
command line (which imports the benchmarks), so that they all read them one way."""

from __future__ import annotations

import argparse

from siesta.entrypoints.cli_flags import add_vllm_flags, byte_size, check_vllm_flags


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file, HF directory or random:<shape>; default: embedded SmolLM2")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-bytes", type=byte_size, default=None, help="bytes, or with units: 4G, 512MiB")
    p.add_argument("--prefault-kv-cache", action=argparse.BooleanOptionalAction, default=False,
                   help="CPU: write the whole KV pool at start-up, not as blocks are first used")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, help="share of the GPU to fill (default 0.9)")
    add_vllm_flags(p)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", help=argparse.SUPPRESS)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens a step may compute (default: vLLM's: 8192 for serve on an H100/H200-class GPU, "
                        "16384 offline; 2048/8192 on smaller GPUs; 2048/4096 per rank on the CPU)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="requests running at once (default: vLLM's for the device and entrypoint)")
    p.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule a step ahead of reading samples back (default: on CUDA, off on the CPU)")
    p.add_argument("--max-waiting-requests", type=int, default=4096,
                   help="engine requests that may wait; past it new ones get 429 (a request counts prompts x n)")
    p.add_argument("--kv-transfer-config", default=None, help="JSON, e.g. '{\"kv_connector\":\"OffloadingConnector\"}'")
    p.add_argument("--weight-transfer-config", default=None,
                   help="JSON, e.g. '{\"backend\":\"nccl\"}' (nccl or ipc; packed_buffer_size_bytes, timeout_s)")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--head-dtype", default="auto", choices=["auto", "float32", "fp32"],
                   help="float32: the final norm, output head and logits in fp32 (RL: logprobs nearer the trainer's)")
    p.add_argument("--enable-fp32-lm-head", dest="head_dtype", action="store_const", const="float32",
                   help="SGLang's name for --head-dtype float32")
    p.add_argument("--deterministic", action="store_true", default=None,
                   help="batch-invariant: a request's bits do not depend on its batch, chunking or prefix source "
                        "(or VLLM_BATCH_INVARIANT=1)")
    p.add_argument("--enable-deterministic-inference", dest="deterministic", action="store_true",
                   help="SGLang's name for --deterministic")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="MoE models: record each token's top-k experts per layer, for requests that ask for "
                        "them (SGLang's return_routed_experts, for RL's routing replay)")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="CPU: torch's threads per rank (default: the cores this process may use, less one "
                        "for the API server under serve)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    check_vllm_flags(args)
    keys = ["model", "tokenizer", "dtype", "max_model_len", "block_size", "kv_cache_bytes", "gpu_memory_utilization",
            "enable_prefix_caching", "prefault_kv_cache", "max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill",
            "async_scheduling", "max_waiting_requests", "kv_transfer_config", "weight_transfer_config", "device", "seed", "enforce_eager", "attention_backend",
            "tensor_parallel_size", "cpu_threads", "head_dtype", "deterministic",
            "enable_return_routed_experts", "kv_cache_dtype"]  # fmt: skip
    return {k: getattr(args, k) for k in keys}


def engine_config(args: argparse.Namespace):
    """The EngineConfig the engine flags describe (what ``LLM(**engine_kwargs(args))`` builds)."""
    from siesta.config import EngineConfig

    return EngineConfig.from_flags(**engine_kwargs(args), enable_sleep_mode=getattr(args, "enable_sleep_mode", True),
                                   usage_context="api_server")
