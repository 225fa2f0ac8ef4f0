"""``siesta bench serve``: online serving latency and throughput of any OpenAI-compatible server.

Streams completions at a request rate (Poisson arrivals; ``inf`` sends all at once) under an
optional concurrency cap, and reports what ``vllm bench serve`` reports, in its layout:
TTFT (time to first token), TPOT (time per output token after the first), ITL (gaps
between streamed chunks), request and token throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from siesta.bench.common import percentile, write_json
from siesta.client import AsyncSiestaClient

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_NUM_PROMPTS = 100
DEFAULT_INPUT_LEN = 256
DEFAULT_OUTPUT_LEN = 64
TOKEN_ID_RANGE = (100, 1000)  # ordinary tokens in every vocabulary
# Plain words that most tokenizers keep as one token each: a text prompt of N words is ~N tokens.
_WORDS = (
    "time",
    "year",
    "people",
    "way",
    "day",
    "man",
    "thing",
    "woman",
    "life",
    "child",
    "world",
    "school",
    "state",
    "family",
    "student",
    "group",
    "country",
    "problem",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "company",
    "system",
    "program",
    "question",
    "work",
    "number",
    "night",
    "point",
    "home",
    "water",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "fact",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "eye",
    "job",
    "word",
)
TABLE_WIDTH = 50
LABEL_WIDTH = 40
MS_PER_S = 1000.0
P99 = 99


@dataclass
class RequestResult:
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS)
    p.add_argument("--input-len", type=int, default=DEFAULT_INPUT_LEN, help="prompt tokens (words, for text)")
    p.add_argument("--output-len", type=int, default=DEFAULT_OUTPUT_LEN)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths vary uniformly by this fraction")
    p.add_argument("--prompt-format", choices=["tokens", "text"], default="tokens",
                   help="token-id prompts (vLLM, siesta) or text (any OpenAI server)")  # fmt: skip
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests per second (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly output-len tokens (vLLM's extra field)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", default=None)


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    return max(1, rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio))))


def make_requests(args: argparse.Namespace) -> list[tuple[Any, int]]:
    """(prompt, max_tokens) per request."""
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.num_prompts):
        n = _length(rng, args.input_len, args.range_ratio)
        if args.prompt_format == "tokens":
            prompt: Any = [rng.randrange(*TOKEN_ID_RANGE) for _ in range(n)]
        else:
            prompt = " ".join(rng.choice(_WORDS) for _ in range(n))
        out.append((prompt, _length(rng, args.output_len, args.range_ratio)))
    return out


async def _one(client: AsyncSiestaClient, prompt: Any, max_tokens: int, args: argparse.Namespace) -> RequestResult:
    result = RequestResult()
    extra = {"ignore_eos": True} if args.ignore_eos else {}
    t0 = last = time.perf_counter()
    chunks = 0
    try:
        async for event in client.stream_completions(
            prompt, model=args.model, max_tokens=max_tokens, temperature=0.0,
            stream_options={"include_usage": True}, **extra,
        ):  # fmt: skip
            now = time.perf_counter()
            if event.get("usage"):
                result.prompt_tokens = event["usage"]["prompt_tokens"]
                result.output_tokens = event["usage"]["completion_tokens"]
            if not any(c.get("text") for c in event.get("choices", [])):
                continue
            if chunks == 0:
                result.ttft_s = now - t0
            else:
                result.itl_s.append(now - last)
            last, chunks = now, chunks + 1
        result.latency_s = time.perf_counter() - t0
        result.output_tokens = result.output_tokens or chunks
        result.ok = chunks > 0
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        result.error = f"{type(e).__name__}: {e}"
    return result


async def _arrivals(rate: float, rng: random.Random, count: int):
    for i in range(count):
        yield i
        if math.isfinite(rate) and rate > 0:
            await asyncio.sleep(rng.expovariate(rate))


async def benchmark(args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    requests = make_requests(args)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = random.Random(args.seed + 1)
    async with AsyncSiestaClient(args.url, api_key=args.api_key) as client:

        async def limited(prompt: Any, max_tokens: int) -> RequestResult:
            async with limit if limit is not None else contextlib.nullcontext():
                return await _one(client, prompt, max_tokens, args)

        t0 = time.perf_counter()
        tasks = []
        async for i in _arrivals(args.request_rate, rng, len(requests)):
            tasks.append(asyncio.create_task(limited(*requests[i])))
        results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - t0


def summarize(results: list[RequestResult], duration: float, args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s * MS_PER_S for r in ok]
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) * MS_PER_S for r in ok if r.output_tokens > 1]
    itl = [gap * MS_PER_S for r in ok for gap in r.itl_s]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "errors": sorted({r.error for r in results if r.error})[:10],
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        out[f"mean_{name}_ms"] = statistics.fmean(values) if values else float("nan")
        out[f"median_{name}_ms"] = statistics.median(values) if values else float("nan")
        out[f"p99_{name}_ms"] = percentile(values, P99)
    return out


def print_summary(s: dict[str, Any]) -> None:
    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{label:<{LABEL_WIDTH}} {text:<10}")

    def rule(title: str, fill: str) -> None:
        print(f"{title:{fill}^{TABLE_WIDTH}}")

    rule(" Serving Benchmark Result ", "=")
    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    if s["max_concurrency"]:
        row("Maximum request concurrency:", s["max_concurrency"])
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total Token throughput (tok/s):", s["total_token_throughput"])
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency")):  # fmt: skip
        rule(title, "-")
        row(f"Mean {name.upper()} (ms):", s[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms):", s[f"median_{name}_ms"])
        row(f"P99 {name.upper()} (ms):", s[f"p99_{name}_ms"])
    rule("", "=")
    for error in s["errors"]:
        print(f"error: {error}")


def run(args: argparse.Namespace) -> None:
    results, duration = asyncio.run(benchmark(args))
    summary = summarize(results, duration, args)
    print_summary(summary)
    config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
    config["request_rate"] = summary["request_rate"]
    write_json(args.result_json, {"config": config, "summary": summary, "requests": [asdict(r) for r in results]})
