"""The ``fp8`` section of ``siesta.bench.gpu``: an fp8 KV cache against the model's own dtype,
side by side in one run (Llama-3-8B's shape by default).

- capacity: KV tokens that fit at ``--gpu-memory-utilization`` 0.9, each dtype (goal 2x);
- decode tok/s at long contexts, each dtype: batch 64 at ``--fp8-long-context`` (8k) tokens,
  and batch 256 at the longest context both dtypes hold (256 x 8k tokens of an 8B's bf16 KV is
  256 GiB: past the card, so it runs at ``--fp8-b256-context``);
- resume at the seed's scale, in process: the bf16 engine's cleared arm against the fp8
  engine's kept arm (the tier moves half the bytes; goal >= 25x), and each kept p50 against
  its own ordered-load floor (goal <= 1.15);
- the seed's client over HTTP against ``siesta serve --kv-cache-dtype fp8`` (goal >= 22x);
- accuracy: the fidelity oracle (transformers' init, pushed, per position bucket to 32k, prompt
  and decode scored apart, in units of the trainer's bf16 floor) on a cut of the shape to
  ``--fp8-check-layers`` layers, fp8 against the model's dtype.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from siesta.bench.common import log_part, release_memory, run_part
from siesta.bench.steps import decode_step_s

FP8 = "fp8"
AUTO = "auto"
DTYPES = (AUTO, FP8)
CAPACITY_UTILIZATION = 0.9


def _with(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    return argparse.Namespace(**(vars(args) | changes))


def capacity_and_decode(args: argparse.Namespace, kv_cache_dtype: str) -> dict[str, Any]:
    from siesta.bench.gpu import make_llm

    llm = make_llm(_with(args, kv_cache_dtype=kv_cache_dtype), gpu_memory_utilization=CAPACITY_UTILIZATION)
    cache = llm.engine.runner.kv_cache
    out: dict[str, Any] = {"kv_tokens": cache.num_blocks * cache.block_size, "block_bytes": cache.block_bytes,
                           "kv_dtype": str(cache.tensor.dtype)}  # fmt: skip
    for batch, context in ((64, args.fp8_long_context), (256, args.fp8_b256_context)):
        if batch * (context + args.decode_steps + 16) > out["kv_tokens"]:
            out[f"decode_b{batch}_ctx{context}"] = {"error": "does not fit this dtype's KV"}
            continue
        dt = decode_step_s(llm, batch, context, args.decode_steps)
        out[f"decode_b{batch}_ctx{context}"] = {"step_ms": dt * 1e3, "tok_s": batch / dt}
    del llm
    release_memory()
    return out


def resume_both(args: argparse.Namespace) -> dict[str, Any]:
    from siesta.bench.gpu import resume

    runs = {}
    for dtype in DTYPES:  # one engine at a time: each pins its own host tier
        runs[dtype] = resume(_with(args, kv_cache_dtype=dtype, resume_variants=False))
        log_part("fp8", f"resume.{dtype}", runs[dtype])
        release_memory()
    cleared = runs[AUTO]["cleared"]["replay_p50_s"]
    return {"runs": runs, "fp8_kept_vs_bf16_cleared": cleared / runs[FP8]["kept"]["replay_p50_s"],
            "bf16_kept_vs_bf16_cleared": runs[AUTO]["speedup_p50"],
            "fp8_kept_over_floor": runs[FP8]["kept_p50_over_floor"],
            "bf16_kept_over_floor": runs[AUTO]["kept_p50_over_floor"]}  # fmt: skip


def seed_client_fp8(args: argparse.Namespace) -> dict[str, Any]:
    from siesta.bench.resume_http import ServeOptions, measure

    options = ServeOptions(model=args.model, tokenizer=args.http_tokenizer, max_model_len=args.max_model_len,
                           max_num_batched_tokens=args.max_num_batched_tokens, tier_block_size=args.tier_block_size,
                           tier_bytes=args.tier_bytes, device=args.device, kv_cache_bytes=args.http_kv_cache_bytes,
                           extra_flags=["--kv-cache-dtype", FP8])  # fmt: skip
    return measure(options, args.resume_requests, args.http_prompt_words)


def accuracy(args: argparse.Namespace) -> dict[str, Any]:
    from siesta.bench import fidelity as oracle
    from siesta.model.random_init import RANDOM_SHAPES

    config = RANDOM_SHAPES[args.fp8_check_shape].config()
    config.num_hidden_layers = args.fp8_check_layers
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    long_len = min(args.fidelity_tokens, config.max_position_embeddings) - 2 * oracle.DECODE_TOKENS
    return {dtype: oracle.run_shape(f"{args.fp8_check_shape}[{args.fp8_check_layers} layers] kv {dtype}", config,
                                    device=device, long_len=long_len, batch=1, engine_dtype="bfloat16",
                                    kv_cache_bytes=args.fidelity_kv_bytes, engine_kw={"kv_cache_dtype": dtype})
            for dtype in DTYPES}  # fmt: skip


def capacity(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {dtype: capacity_and_decode(args, dtype) for dtype in DTYPES}
    out["kv_tokens_ratio"] = out[FP8]["kv_tokens"] / out[AUTO]["kv_tokens"]
    return out


PARTS = {"capacity": capacity, "resume": resume_both, "seed_client": seed_client_fp8, "accuracy": accuracy}


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"model": args.model}
    for name in args.fp8_parts:
        run_part(out, "fp8", name, lambda n=name: PARTS[n](args))
    return out


def summary_rows(res: dict[str, Any]) -> list[list[Any]]:
    rows = []
    cap = res.get("capacity") or {}
    if "kv_tokens_ratio" in cap:
        rows.append(["fp8 KV tokens / bf16's", cap["kv_tokens_ratio"], f"goal 2x; {cap[FP8]['kv_tokens']:,} tokens"])
        for key in (k for k in cap[FP8] if k.startswith("decode_")):
            fp8, bf16 = cap[FP8][key].get("tok_s"), cap[AUTO].get(key, {}).get("tok_s")
            rows.append([f"fp8 {key} tok/s", fp8, f"bf16 {bf16:,.0f}" if bf16 else "bf16: does not fit"])
    resume = res.get("resume") or {}
    if "fp8_kept_vs_bf16_cleared" in resume:
        rows.append(["fp8 kept vs bf16 cleared (p50)", resume["fp8_kept_vs_bf16_cleared"],
                     f"goal >= 25x; bf16 kept {resume['bf16_kept_vs_bf16_cleared']:.1f}x; fp8 kept / floor "
                     f"{resume['fp8_kept_over_floor']:.2f} (goal <= 1.15)"])  # fmt: skip
    seed = res.get("seed_client") or {}
    if "speedup_p50" in seed:
        rows.append(["seed client over HTTP, fp8 KV (p50)", seed["speedup_p50"], "goal >= 22x"])
    for dtype, shape in (res.get("accuracy") or {}).items():
        if isinstance(shape, dict) and "push_batch1" in shape:
            rows.append([f"logprobs / bf16 floor, KV {dtype}", shape["push_batch1"]["worst_ratio"],
                         f"max |diff| {shape['push_batch1']['max_error']:.3f}"])  # fmt: skip
    return rows
