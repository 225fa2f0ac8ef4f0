"""The GPU bench's tensor-parallel mode: one model at several tensor-parallel sizes, side by side.

For each model (random weights of real shapes: Llama-3-8B, and 70B, which needs two H200s) and
each size that fits: greedy logprobs against the smallest size run (tensor parallel 1 where the
model fits one GPU), decode step time at batch 1 and 64 against each GPU's HBM roofline (its
shard of the weights and the KV it reads), the all-reduce kernels' device time per decode step,
the resume experiment (kept against cleared tier: external hits, replay p50, speedup), and what
sleep frees on every rank and how long sleep and wake take. Run by name:
``bash bench/gpu.sh --sections tensor_parallel`` on a host with several GPUs (``--tp-sizes``,
``--tp-models``); it runs on the CPU too (gloo), in a tiny configuration, for its tests.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch

from siesta.bench.common import random_prompts
from siesta.bench.steps import decode_step_s, device_kernels, hbm_bytes_per_s, sync

LOGPROB_PROMPT_LEN = 64
LOGPROB_TOKENS = 8
DECODE_BATCHES = (1, 64)
KERNEL_STEPS = 10
COLLECTIVE_KERNELS = ("nccl", "allreduce", "all_reduce", "allgather", "all_gather")
FIT_FRACTION = 0.8  # a shard of the weights must leave this much of a GPU for the rest
BF16_BYTES = 2


def default_sizes() -> list[int]:
    """1, 2, 4, ... up to the GPUs this host has."""
    count = max(1, torch.cuda.device_count())
    sizes, n = [], 1
    while n <= count:
        sizes.append(n)
        n *= 2
    return sizes


def tensor_parallel(args: argparse.Namespace) -> dict[str, Any]:
    sizes = args.tp_sizes or default_sizes()
    if args.device != "cpu" and torch.cuda.device_count() < 2:
        return {"skipped": f"tensor parallelism needs 2 or more GPUs; this host has {torch.cuda.device_count()}"}
    return {model: _model(args, model, sizes) for model in args.tp_models}


def _model(args: argparse.Namespace, model: str, sizes: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    reference: dict[str, Any] | None = None
    for size in sorted(sizes):
        if not _fits(args, model, size):
            out[f"tp{size}"] = {"skipped": "a shard of the weights does not fit one GPU"}
            continue
        t0 = time.perf_counter()
        llm = _llm(args, model, size)
        entry: dict[str, Any] = {"init_s": time.perf_counter() - t0}
        try:
            entry["logprobs"] = _logprobs(llm)
            if reference is None:
                reference = entry["logprobs"]
                entry["reference"] = True
            else:
                entry["against_reference"] = _compare(entry["logprobs"], reference)
            entry["decode"] = _decode(args, llm)
            entry["collectives"] = _collectives(args, llm)
            entry["resume"] = _resume(args, llm)
            entry["sleep_wake"] = _sleep_wake(llm)
        finally:
            llm.engine.close()
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        out[f"tp{size}"] = entry
    return out


def _fits(args: argparse.Namespace, model: str, size: int) -> bool:
    if args.device == "cpu" or not torch.cuda.is_available():
        return True
    from siesta.model.loader import resolve_model

    cfg = resolve_model(model).hf_config
    h, inter, layers, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = cfg.num_key_value_heads * (getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads)
    params = layers * (2 * h * h + 2 * h * kv + 3 * h * inter) + 2 * vocab * h
    return params * BF16_BYTES / size < FIT_FRACTION * torch.cuda.get_device_properties(0).total_memory


def _llm(args: argparse.Namespace, model: str, size: int):
    from siesta import LLM

    tier = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"block_size": args.tier_block_size, "cpu_bytes_to_use": args.tier_bytes}}  # fmt: skip
    kw: dict[str, Any] = {"dtype": args.tp_dtype, "max_model_len": args.max_model_len, "device": args.device,
                          "max_num_batched_tokens": args.max_num_batched_tokens, "tensor_parallel_size": size,
                          "kv_transfer_config": tier}  # fmt: skip
    if args.device == "cpu":
        kw["kv_cache_bytes"] = args.tp_cpu_kv_cache_bytes
    else:
        kw["gpu_memory_utilization"] = 0.85
    return LLM(model, **kw)


def _logprobs(llm) -> dict[str, Any]:
    from siesta import SamplingParams

    (prompt,) = random_prompts(1, LOGPROB_PROMPT_LEN, LOGPROB_PROMPT_LEN, llm.engine.vocab_size, seed=5)
    params = SamplingParams(temperature=0, max_tokens=LOGPROB_TOKENS, ignore_eos=True, logprobs=0)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    return {"tokens": list(out.token_ids), "logprobs": [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]}


def _compare(got: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    """Teacher-free greedy: tokens agree up to the first difference; logprobs compared there."""
    agree = 0
    for a, b in zip(got["tokens"], want["tokens"]):
        if a != b:
            break
        agree += 1
    diffs = [abs(a - b) for a, b in zip(got["logprobs"][: agree + 1], want["logprobs"][: agree + 1])]
    return {"tokens_agree": agree, "of": len(want["tokens"]), "max_abs_logprob_diff": max(diffs, default=0.0)}


def _decode(args: argparse.Namespace, llm) -> dict[str, Any]:
    weight_bytes = llm.engine.memory.weight_bytes  # rank 0's shard
    kv_per_token = llm.engine.runner.kv_cache.block_bytes // llm.config.cache.block_size  # rank 0's heads
    backup = getattr(llm.engine.memory, "backup", None)
    if backup is not None:
        backup.settle()  # the steady state: background pinning takes the driver's lock from launches
    res = {}
    bandwidth = hbm_bytes_per_s()
    for b in DECODE_BATCHES:
        dt = decode_step_s(llm, b, args.decode_context, args.decode_steps)
        floor = (weight_bytes + b * args.decode_context * kv_per_token) / bandwidth
        res[f"batch{b}"] = {"step_ms": dt * 1e3, "tok_s": b / dt, "roofline_per_gpu_ms": floor * 1e3,
                            "of_roofline": floor / dt}  # fmt: skip
    return res


def _collectives(args: argparse.Namespace, llm) -> dict[str, Any]:
    """Device time per decode step at batch 1, and the collectives' share (rank 0's kernels)."""
    from siesta import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=KERNEL_STEPS + 16, ignore_eos=True)
    (prompt,) = random_prompts(1, args.decode_context, args.decode_context, llm.engine.vocab_size, seed=9)
    rid = llm.add_request({"prompt_token_ids": prompt}, params)
    for _ in range(4):  # prefilled, a few steps into decoding
        llm.step()
    sync()

    def steps() -> None:
        for _ in range(KERNEL_STEPS):
            llm.step()

    busy_ms, launches, top = device_kernels(steps, top=64)
    llm.abort([rid])
    collective = sum(ms for name, ms in top.items() if any(k in name.lower() for k in COLLECTIVE_KERNELS))
    return {"device_ms_per_step": busy_ms / KERNEL_STEPS, "all_reduce_ms_per_step": collective / KERNEL_STEPS,
            "launches_per_step": launches / KERNEL_STEPS}  # fmt: skip


def _resume(args: argparse.Namespace, llm) -> dict[str, Any]:
    from siesta.bench.resume_offline import run_arm

    arms = {}
    for seed, (name, keep) in enumerate((("cleared", False), ("kept", True))):
        prompts = random_prompts(args.resume_requests, args.resume_tokens, args.resume_tokens, llm.engine.vocab_size,
                                 seed=300 + seed)  # fmt: skip
        arm = run_arm(llm, keep, prompts, max_tokens=8)
        arms[name] = {"replay_p50_s": arm["replay_p50_s"], "warm_p50_s": arm["warm_p50_s"],
                      "external_hits": arm["metric_delta"].get("siesta_external_prefix_cache_hits_total", 0.0)}  # fmt: skip
    arms["speedup_p50"] = arms["cleared"]["replay_p50_s"] / arms["kept"]["replay_p50_s"]
    return arms


def _sleep_wake(llm) -> dict[str, Any]:
    ranks = llm.engine.ranks
    before = ranks.run_all("free_device_bytes", (), ())
    t0 = time.perf_counter()
    llm.sleep(level=1)
    sleep_s = time.perf_counter() - t0
    asleep = ranks.run_all("free_device_bytes", (), ())
    t0 = time.perf_counter()
    llm.wake_up()
    wake_s = time.perf_counter() - t0
    return {"sleep_s": sleep_s, "wake_s": wake_s,
            "freed_GiB_per_rank": [(a - b) / 2**30 for a, b in zip(asleep, before)]}  # fmt: skip


def summary_rows(result: dict[str, Any]) -> list[list[Any]]:
    rows: list[list[Any]] = []
    if not isinstance(result, dict) or "skipped" in result:
        return [["tensor parallel", None, (result or {}).get("skipped", "not run")]] if isinstance(result, dict) else rows
    for model, sizes in result.items():
        if not isinstance(sizes, dict):
            continue
        for size, e in sizes.items():
            if not isinstance(e, dict) or "decode" not in e:
                continue
            d, c = e["decode"], e.get("collectives", {})
            vs = e.get("against_reference", {})
            rows.append([f"{model} {size} decode b1 / b64 tok/s",
                         f"{d['batch1']['tok_s']:.0f} / {d['batch64']['tok_s']:.0f}",
                         f"{d['batch1']['of_roofline']:.0%} / {d['batch64']['of_roofline']:.0%} of the per-GPU roofline; "
                         f"all-reduce {c.get('all_reduce_ms_per_step', 0):.2f} ms/step; "
                         f"tokens agree {vs.get('tokens_agree', '-')}/{vs.get('of', '-')}, "
                         f"max dlogprob {vs.get('max_abs_logprob_diff', 0):.3f}; "
                         f"resume {e['resume']['speedup_p50']:.1f}x; sleep/wake {e['sleep_wake']['sleep_s']:.2f}/"
                         f"{e['sleep_wake']['wake_s']:.2f} s"])  # fmt: skip
    return rows
