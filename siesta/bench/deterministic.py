"""Deterministic (batch-invariant) mode against the default, each in a process of its own (cuBLAS
reads its workspace setting when it makes its handle, so one process cannot hold both):

* cost: decode step time at batch 1, 64 and 256, and an 8k-token prefill; a profiled decode step
  of each mode at the smallest and largest batch, and the kernels whose time grew most between
  them (where the cost is);
* bits: one request alone, beside 63 others, with its prompt chunked small and whole, its
  prefix loaded from the host tier, and resumed across a sleep that keeps the tier — equal in
  deterministic mode (the default mode's figures say what it would not hold).

``python -m siesta.bench.deterministic --model random:llama-3-8b [--deterministic] --json out.json``
runs one mode; ``bench/gpu.sh --sections deterministic`` runs both and sets them side by side.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from siesta.bench.common import random_prompts
from siesta.bench.steps import decode_step_s, engine_step_kernels, sync

NEW_TOKENS = 16
TIER_BYTES = 8 << 30
GROWN_KERNELS = 6  # the kernels a mode's step added the most time to, per profiled batch
# Kernel names by what they compute, so two modes' different kernels for one job compare
# (cuBLAS's nvjet/cutlass kernels or the GEMV against the invariant GEMM; split-KV against
# the unsplit decode): a name's first matching prefix decides.
KERNEL_FAMILIES = (("GEMM", ("nvjet", "sm90_", "cutlass", "void cutlass", "ampere_", "_matmul", "_gemv")),
                   ("attention", ("decode_split", "reduce_splits", "unified_kernel", "prefill_split")))  # fmt: skip


def kernel_family(name: str) -> str:
    return next((family for family, prefixes in KERNEL_FAMILIES if name.startswith(prefixes)), "other")


def _bits(llm, prompts: list[list[int]], index: int = 0) -> list:
    from siesta import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0, ignore_eos=True)
    gen = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)[index].outputs[0]
    return [list(gen.token_ids), [step[t].logprob for step, t in zip(gen.logprobs, gen.token_ids, strict=True)]]


def _resumed(llm, prompt: list[int]) -> list:
    """Paused mid-generation by a sleep that keeps the tier, woken, finished."""
    from siesta import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0, ignore_eos=True)
    rid = llm.add_request({"prompt_token_ids": prompt}, params)
    for _ in range(NEW_TOKENS // 2):
        llm.step()
    llm.sleep(level=1, mode="keep", clear_connector_cache=False)
    llm.wake_up()
    done = {}
    while llm.has_unfinished_requests():
        done |= {o.request_id: o for o in llm.step()}
    gen = done[rid].outputs[0]
    return [list(gen.token_ids), [step[t].logprob for step, t in zip(gen.logprobs, gen.token_ids, strict=True)]]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from siesta import LLM, SamplingParams

    tier = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"block_size": 128, "cpu_bytes_to_use": args.tier_bytes}}  # fmt: skip
    kw = {"dtype": args.dtype, "device": args.device, "max_model_len": args.max_model_len,
          "deterministic": args.deterministic, "kv_transfer_config": tier}  # fmt: skip
    if args.kv_cache_bytes:
        kw["kv_cache_bytes"] = args.kv_cache_bytes
    out: dict[str, Any] = {"deterministic": args.deterministic}
    llm = LLM(args.model, **kw)
    vocab = llm.engine.vocab_size
    target = random_prompts(1, args.prompt_tokens, args.prompt_tokens, vocab, seed=1)[0]
    others = random_prompts(args.batch - 1, 64, args.prompt_tokens, vocab, seed=2)
    runs = {"alone": _bits(llm, [target])}
    llm.reset_prefix_cache(reset_connector=True)
    runs[f"in_batch{args.batch}"] = _bits(llm, others[: len(others) // 2] + [target] + others[len(others) // 2 :],
                                          index=len(others) // 2)  # fmt: skip
    llm.reset_prefix_cache()  # the host tier keeps it: the next run loads its prefix
    runs["prefix_from_tier"] = _bits(llm, [target])
    runs["across_sleep_keep"] = _resumed(llm, target)
    out["runs"] = runs
    out["equal_to_alone"] = {name: run == runs["alone"] for name, run in runs.items() if name != "alone"}
    for b in args.decode_batches:
        out[f"decode_b{b}_step_ms"] = decode_step_s(llm, b, args.decode_context, args.decode_steps) * 1e3
    for b in sorted({min(args.decode_batches), max(args.decode_batches)}):
        out[f"kernels_b{b}"] = engine_step_kernels(llm, b, args.decode_context)
    del llm
    llm = LLM(args.model, **(kw | {"kv_transfer_config": None, "max_num_batched_tokens": args.prefill_tokens}))
    for rep in range(2):  # the first compiles; each its own prompt, or the second would hit the prefix cache
        prompt = random_prompts(1, args.prefill_tokens, args.prefill_tokens, vocab, seed=3 + rep)[0]
        sync()
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)
        sync()
        out[f"prefill{args.prefill_tokens}_s"] = time.perf_counter() - t0
    whole = _bits(llm, [target])
    del llm
    small = LLM(args.model, **(kw | {"kv_transfer_config": None, "max_num_batched_tokens": args.small_chunk}))
    out["equal_to_alone"][f"chunked_{args.small_chunk}_vs_whole"] = _bits(small, [target]) == whole
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="random:llama-3-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default=None)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--kv-cache-bytes", type=int, default=None)
    ap.add_argument("--tier-bytes", type=int, default=TIER_BYTES)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--small-chunk", type=int, default=512)
    ap.add_argument("--decode-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64, 256])
    ap.add_argument("--decode-context", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--json", default=None)
    return ap


def both_modes(extra: list[str]) -> dict[str, Any]:
    """Each mode in its own process; the deterministic mode's cost against the default."""
    res: dict[str, Any] = {}
    for mode in ("default", "deterministic"):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "out.json"
            cmd = [sys.executable, "-m", "siesta.bench.deterministic", "--json", str(path), *extra]
            cmd += ["--deterministic"] if mode == "deterministic" else []
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{mode}: exit {done.returncode}\n{done.stderr[-4000:]}")
            res[mode] = json.loads(path.read_text())
    base, det = res["default"], res["deterministic"]
    res["cost"] = {k: det[k] / base[k] - 1 for k in base if k.endswith(("_ms", "_s")) and base[k]}
    res["bit_identical"] = all(det["equal_to_alone"].values())
    res["kernels_grown_ms"] = {key: grown_kernels(base[key], det[key]) for key in base
                               if key.startswith("kernels_") and key in det}  # fmt: skip
    return res


def grown_kernels(base: dict[str, Any], det: dict[str, Any]) -> dict[str, float]:
    """Per kernel name, the deterministic step's ms less the default step's (a kernel only one
    mode runs counts in full), the largest growths first, and the same per family
    (``KERNEL_FAMILIES``); what the top lists of both left out counts as 0 there, so a small
    figure may be understated."""
    b, d = base["top_kernels_ms_per_step"], det["top_kernels_ms_per_step"]
    grown = {name: d.get(name, 0.0) - b.get(name, 0.0) for name in {*b, *d}}
    top = sorted(grown.items(), key=lambda kv: -kv[1])[:GROWN_KERNELS]
    families: dict[str, float] = {}
    for name, ms in grown.items():
        families[kernel_family(name)] = families.get(kernel_family(name), 0.0) + ms
    return {"device_busy": det["device_busy_ms"] - base["device_busy_ms"],
            "launches": det["launches"] - base["launches"], "families": {k: round(v, 4) for k, v in families.items()},
            **{k: round(v, 4) for k, v in top}}  # fmt: skip


def main() -> None:
    args = build_parser().parse_args()
    out = measure(args)
    text = json.dumps(out, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
