"""``siesta`` command line: generate, serve, bench."""

from __future__ import annotations

import argparse
import json
import sys

from siesta.config import ConfigError
from siesta.entrypoints.cli_flags import (
    UVICORN_LOG_LEVELS,
    add_vllm_flags,
    byte_size,
    check_prompts_are_not_models,
    check_vllm_flags,
)


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file, HF directory or random:<shape>; default: embedded SmolLM2")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-bytes", type=byte_size, default=None, help="bytes, or with units: 4G, 512MiB")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, help="share of the GPU to fill (default 0.9)")
    add_vllm_flags(p)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", help=argparse.SUPPRESS)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
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


def engine_kwargs(args: argparse.Namespace) -> dict:
    check_vllm_flags(args)
    keys = ["model", "tokenizer", "dtype", "max_model_len", "block_size", "kv_cache_bytes", "gpu_memory_utilization",
            "enable_prefix_caching", "max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill",
            "async_scheduling", "max_waiting_requests", "kv_transfer_config", "weight_transfer_config", "device", "seed", "enforce_eager", "attention_backend"]  # fmt: skip
    return {k: getattr(args, k) for k in keys}


def engine_config(args: argparse.Namespace):
    """The EngineConfig the engine flags describe (what ``LLM(**engine_kwargs(args))`` builds)."""
    from siesta.config import EngineConfig

    return EngineConfig.from_flags(**engine_kwargs(args), enable_sleep_mode=getattr(args, "enable_sleep_mode", True))


def _serve(args: argparse.Namespace) -> None:
    from siesta.entrypoints.server.launch import run_server

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    run_server(args, engine_config(args))


def _serve_args(p: argparse.ArgumentParser) -> None:
    from siesta.entrypoints.server.state import DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_MAX_REQUEST_FANOUT

    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="as --model; default: embedded SmolLM2")
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to serve other hosts")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None, help="names the API answers to (default: the model's)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set SIESTA_API_KEY)")
    p.add_argument("--dev-mode", action="store_true", help="enable the control routes (or SIESTA_SERVER_DEV_MODE=1)")
    p.add_argument("--enable-sleep-mode", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--uvicorn-log-level", default=None, choices=UVICORN_LOG_LEVELS,
                   help="vLLM's: uvicorn's own log level (default: --log-level)")  # fmt: skip
    p.add_argument("--max-request-fanout", type=int, default=DEFAULT_MAX_REQUEST_FANOUT,
                   help="engine requests (prompts x n) one HTTP request may make")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="larger request bodies are refused (413) before they are parsed")
    _engine_args(p)


def _generate(args: argparse.Namespace) -> None:
    from siesta import LLM, SamplingParams

    check_prompts_are_not_models(args.prompt)
    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.sample_seed)
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": p} for p in args.prompt], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for out in outputs:
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": out.outputs[0].text, "finish_reason": out.outputs[0].finish_reason}))
        else:
            print(out.outputs[0].text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="siesta", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sample-seed", type=int, default=None)
    gen.add_argument("--json", action="store_true")
    _engine_args(gen)
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (+ control routes in dev mode)")
    _serve_args(serve)
    serve.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from siesta.bench import throughput

    tp = bench_sub.add_parser("throughput", help="offline throughput vs transformers' generate")
    throughput.add_arguments(tp)
    _engine_args(tp)
    tp.set_defaults(func=throughput.run)

    from siesta.bench import resume, resume_offline
    from siesta.bench import serve as serve_bench

    rs = bench_sub.add_parser("resume", help="does the KV tier survive sleep? in-process, or over HTTP with --url")
    resume_offline.add_arguments(rs)
    resume.add_arguments(rs)
    _engine_args(rs)
    rs.set_defaults(func=resume_offline.run)
    sv = bench_sub.add_parser("serve", help="online serving: TTFT, TPOT, ITL, throughput of any OpenAI server")
    serve_bench.add_arguments(sv)
    sv.set_defaults(func=serve_bench.run)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ConfigError, ValueError) as e:
        print(f"siesta: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
