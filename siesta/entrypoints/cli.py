"""``siesta`` command line: generate, serve, bench."""

from __future__ import annotations

import argparse
import json
import sys

from siesta.config import ConfigError
from siesta.entrypoints.cli_flags import UVICORN_LOG_LEVELS, check_prompts_are_not_models
from siesta.entrypoints.engine_args import add_engine_args, engine_config, engine_kwargs


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
    p.add_argument("--dev-mode", action="store_true", help="enable the control routes (or SIESTA_SERVER_DEV_MODE=1, or vLLM's VLLM_SERVER_DEV_MODE=1)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--uvicorn-log-level", default=None, choices=UVICORN_LOG_LEVELS,
                   help="vLLM's: uvicorn's own log level (default: --log-level)")  # fmt: skip
    p.add_argument("--max-request-fanout", type=int, default=DEFAULT_MAX_REQUEST_FANOUT,
                   help="engine requests (prompts x n) one HTTP request may make")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="larger request bodies are refused (413) before they are parsed")
    add_engine_args(p)


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
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (+ control routes in dev mode)")
    _serve_args(serve)
    serve.set_defaults(func=_serve)

    from siesta.fleet import cli as fleet_cli

    fleet = sub.add_parser("fleet", help="N replicas behind a gateway (smg), serving its URL",
                           description=fleet_cli.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    fleet_cli.add_arguments(fleet)
    fleet.set_defaults(func=fleet_cli.run)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from siesta.bench import throughput

    tp = bench_sub.add_parser("throughput", help="offline throughput vs transformers' generate")
    throughput.add_arguments(tp)
    add_engine_args(tp)
    tp.set_defaults(func=throughput.run, **throughput.ENGINE_DEFAULTS)

    from siesta.bench import resume, resume_offline
    from siesta.bench import serve as serve_bench

    rs = bench_sub.add_parser("resume", help="does the KV tier survive sleep? in-process, or over HTTP with --url")
    resume_offline.add_arguments(rs)
    resume.add_arguments(rs)
    add_engine_args(rs)
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
