"""Everything the GPU issue asks for, in one process: ``bash bench/gpu.sh`` runs it on the H200.

Random weights of the Llama-3-8B shape in bf16. Sections (each survives the others failing):
correctness against transformers on the same weights; decode step time against the HBM
roofline (CUDA graphs and eager); prefill tok/s and MFU; the seed's resume experiment at the
seed's scale; tier transfer GB/s; sleep/wake seconds and memory. A table last, JSON to --json.
Diagnostic sections, run by name: ``resume_trace`` and ``decode_trace`` (where a step's time
goes, on the host and on the stream), ``step_io`` (a small copy beside tier copies).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from siesta import fidelity_report
from siesta.bench import backup_pinning
from siesta.bench import fp8 as fp8_bench
from siesta.bench import moe as moe_bench
from siesta.bench.common import host_memory_gib, print_table, random_prompts, release_memory
from siesta.bench.fidelity import summary_rows as fidelity_rows
from siesta.bench.flops import MEASURED_MATMUL_FLOPS, mfu, prefill_flops
from siesta.bench.gpu_tp import summary_rows as tensor_parallel_rows
from siesta.bench.gpu_tp import tensor_parallel
from siesta.bench.load_floor import DEFAULT_LINK_GBPS
from siesta.bench.resume_http import DEFAULT_TOKENIZER
from siesta.bench.steps import (
    PROFILE_TOP_KERNELS,
    decode_step_s,
    device_kernels,
    engine_step_kernels,
    hbm_bytes_per_s,
    sync,
)
from siesta.bench.weight_transfer import summary_rows as weight_transfer_rows
from siesta.bench.weight_transfer import weight_transfer

RESUME_NEW_TOKENS = 8  # the seed client's max_tokens
MIXED_REPS = 10
TRACE_SLOW_STEPS = 3
STEP_IO_REPS = 30
STEP_IO_DEADLINE_S = 0.1



def _section(results: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    print(f"\n== {name} ==", flush=True)
    host_before = host_memory_gib()  # what earlier sections left: run 48b's fp8 resume read 14x after three
    t0 = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as e:
        traceback.print_exc()
        results[name] = {"error": f"{type(e).__name__}: {e}"}
    results[name]["section_s"] = time.perf_counter() - t0
    results[name]["host_memory_gib_before"] = host_before
    print(json.dumps(results[name], indent=1, default=str)[:3000], flush=True)
    release_memory()


def make_llm(args: argparse.Namespace, **kw):
    from siesta import LLM

    base = {"dtype": "bfloat16", "max_model_len": args.max_model_len, "device": args.device,
            "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": 256,
            "kv_cache_dtype": getattr(args, "kv_cache_dtype", "auto")}  # fmt: skip
    return LLM(args.model, **(base | kw))


# -- sections ------------------------------------------------------------------------------


def correctness(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from siesta import SamplingParams

    llm = make_llm(args, kv_cache_bytes=4 << 30)
    source = llm.engine.source
    dev = llm.engine.runner.device
    # Built on the device itself: ``to_empty`` from meta would leave the rotary buffers unset.
    with torch.device(dev):
        hf = AutoModelForCausalLM.from_config(source.hf_config, dtype=torch.bfloat16)
    hf.load_state_dict(dict(source.iter_weights(torch.bfloat16, dev)), strict=False)
    hf.tie_weights()
    hf.eval()
    vocab = llm.engine.vocab_size
    prompts = random_prompts(4, args.check_prompt_len // 2, args.check_prompt_len, vocab, seed=5)
    n_new = 16
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n_new, logprobs=5, ignore_eos=True), use_tqdm=False)  # fmt: skip
    max_diff, top1_agree, greedy_agree = 0.0, 0, 0
    for p, out in zip(prompts, outs):
        ids = torch.tensor([p + out.outputs[0].token_ids], device=dev)
        with torch.inference_mode():
            ref = torch.log_softmax(hf(ids).logits[0, len(p) - 1 : -1].float(), -1)
        for step, (tok, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
            max_diff = max(max_diff, abs(lp[tok].logprob - ref[step, tok].item()))
            top1_agree += int(ref[step].argmax().item() == tok)
        greedy_agree += int(ref[0].argmax().item() == out.outputs[0].token_ids[0])
    total = len(prompts) * n_new
    del hf
    return {"prompts": len(prompts), "tokens_checked": total, "max_abs_logprob_diff": max_diff,
            "top1_agreement": top1_agree / total, "first_token_agreement": greedy_agree / len(prompts),
            "graphs": llm.engine.runner.graphs is not None}  # fmt: skip





def _replay_s(llm, batch: int, reps: int = 50) -> float:
    graphs = llm.engine.runner.graphs
    bucket = graphs.bucket_for(batch) if graphs is not None else None
    if bucket not in (graphs.graphs if graphs is not None else {}):
        return float("nan")
    graph = graphs.graphs[bucket]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def decode(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"hbm_bytes_per_s": (bandwidth := hbm_bytes_per_s())}
    # The engine's defaults (async scheduling on CUDA), then without async scheduling, then eager.
    arms = {"graphs": {}, "graphs_sync": {"async_scheduling": False}, "eager": {"enforce_eager": True}}
    for arm, kw in arms.items():
        llm = make_llm(args, gpu_memory_utilization=0.85, **kw)
        shape = llm.engine.runner.model.shape
        weight_bytes = llm.engine.memory.weight_bytes
        kv_per_token = llm.engine.runner.kv_cache.block_bytes // llm.config.cache.block_size
        if arm == "graphs":
            # Batch 1 at start-up, with the sleep backup still to be pinned, then every arm once it
            # is: pinning beside the steps took the driver's lock from their launches (H200 run 33:
            # 7.25 against 4.54 ms a step). It now waits for the device to be quiet (host_backup),
            # so the two batch-1 figures should agree.
            early = decode_step_s(llm, 1, args.decode_context, args.decode_steps)
            res["graphs_batch1_while_backup_pins"] = {"step_ms": early * 1e3, "tok_s": 1 / early}
        t0 = time.perf_counter()
        llm.engine.memory.backup.settle()
        res[f"{arm}_backup_settle_s"] = time.perf_counter() - t0
        for b in args.decode_batches:
            dt = decode_step_s(llm, b, args.decode_context, args.decode_steps)
            floor = (weight_bytes + b * args.decode_context * kv_per_token) / bandwidth
            key = f"{arm}_batch{b}"
            res[key] = {"step_ms": dt * 1e3, "tok_s": b / dt, "roofline_ms": floor * 1e3, "of_roofline": floor / dt}
            if arm != "eager":
                # The graph alone, without the engine's host work around it (schedule, sample).
                replay_s = _replay_s(llm, b)
                res[key] |= {"graph_replay_ms": replay_s * 1e3, "graph_of_roofline": floor / replay_s}
        res["weight_bytes"] = weight_bytes
        res["layers"] = shape.num_layers
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return res


def prefill(args: argparse.Namespace) -> dict[str, Any]:
    from siesta import SamplingParams

    res: dict[str, Any] = {}
    llm = make_llm(args, max_num_batched_tokens=max(args.prefill_lens), gpu_memory_utilization=0.85)
    model = llm.engine.runner.model
    vocab = llm.engine.vocab_size
    for n in args.prefill_lens:
        for rep in range(3):  # the first run compiles
            ps = random_prompts(1, n, n, vocab, seed=40 + rep)
            sync()
            t0 = time.perf_counter()
            llm.generate({"prompt_token_ids": ps[0]}, SamplingParams(max_tokens=1), use_tqdm=False)
            sync()
            dt = time.perf_counter() - t0
        flops = prefill_flops(model, n)
        res[f"tokens{n}"] = {"s": dt, "tok_s": n / dt, "flops": flops, "mfu": mfu(flops, dt),
                             "of_measured_matmul": flops / dt / MEASURED_MATMUL_FLOPS}  # fmt: skip
    return res


def _triton_variants() -> int:
    """Compiled variants of siesta's Triton kernels so far (a rise mid-replay is a JIT compile)."""
    import importlib

    from triton.runtime.jit import JITFunction

    count = 0
    for name in ("siesta.attention.triton_kernels", "siesta.attention.triton_kv_write", "siesta.model.triton_ops",
                 "siesta.core.staging"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for fn in vars(module).values():
            if isinstance(fn, JITFunction):
                count += sum(len(caches[0]) for caches in fn.device_caches.values())
    return count


def _joined_ahead(llm) -> list[str]:
    """From now on, the requests that joined a step before their loads landed."""
    joined: list[str] = []
    connector = llm.engine.connector
    if connector is not None:
        join_ahead = connector.join_ahead
        connector.join_ahead = lambda within_s: joined.extend(ids := join_ahead(within_s)) or ids
    return joined


def _timed_forwards(llm) -> tuple[list[float], list[tuple[float, float]], list[tuple[Any, Any]]]:
    """From now on, wall seconds of each model step (synchronized), to tell compute from
    waiting, per step the seconds spent issuing tier copies and in the forward, and on CUDA a
    pair of events around each forward on its stream (``_device_ms``): under async scheduling
    the host times above are not the device's."""
    runner = llm.engine.runner
    times: list[float] = []
    parts: list[tuple[float, float]] = []
    events: list[tuple[Any, Any]] = []
    plain, forward = runner.launch, runner._forward
    spent = {"copies": 0.0, "forward": 0.0}

    def timed(fn, key):
        def call(*a):
            t0 = time.perf_counter()
            try:
                return fn(*a)
            finally:
                spent[key] += time.perf_counter() - t0

        return call

    connector = runner.connector
    if connector is not None:
        connector.run_loads = timed(connector.run_loads, "copies")
        connector.run_stores = timed(connector.run_stores, "copies")
    timed_forward = timed(forward, "forward")

    def forward_with_events(*a):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        try:
            return timed_forward(*a)
        finally:
            end.record()
            events.append((begin, end))

    runner._forward = forward_with_events if torch.cuda.is_available() else timed_forward

    def launch(sched, prev=None, peers=None):
        spent.update(copies=0.0, forward=0.0)
        t0 = time.perf_counter()
        result = plain(sched, prev, peers)
        # The compute stream only: a device-wide sync would wait for tier loads. Not with async
        # scheduling, whose point is not to wait here (its steps' times are then host times).
        if torch.cuda.is_available() and not llm.config.scheduler.async_scheduling:
            torch.cuda.current_stream().synchronize()
        times.append(round(time.perf_counter() - t0, 4))
        parts.append((round(spent["copies"], 4), round(spent["forward"], 4)))
        return result

    runner.launch = launch
    return times, parts, events


def _device_ms(events: list[tuple[Any, Any]]) -> dict[str, list[float]]:
    """Each forward's device time (its events' span: the stream waits it holds, for tier loads
    a step joined ahead of, included) and its start after the first forward's, in ms."""
    if not events:
        return {"forward_ms": [], "start_ms": []}
    events[-1][1].synchronize()
    first = events[0][0]
    return {"forward_ms": [round(b.elapsed_time(e), 3) for b, e in events],
            "start_ms": [round(first.elapsed_time(b), 3) for b, _ in events]}  # fmt: skip


def resume(args: argparse.Namespace) -> dict[str, Any]:
    from siesta.bench.resume_offline import kept_floor, run_arm

    tier = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"block_size": args.tier_block_size, "cpu_bytes_to_use": args.tier_bytes}}  # fmt: skip
    if args.load_window_mib is not None:
        tier["kv_connector_extra_config"]["load_window_bytes"] = args.load_window_mib << 20
    t0 = time.perf_counter()
    llm = make_llm(args, kv_transfer_config=tier, gpu_memory_utilization=0.9)
    init_s = time.perf_counter() - t0
    vocab = llm.engine.vocab_size
    kv_per_token = llm.engine.runner.kv_cache.block_bytes // llm.config.cache.block_size
    arms = {}
    runner = llm.engine.runner
    forwards, parts, events = _timed_forwards(llm)
    piecewise, whole = runner.piecewise, runner.mixed_graphs
    # Both arms with the engine's defaults, then more of the kept tier: without async
    # scheduling, with steps that have prefill rows run eagerly, with those steps all in
    # piecewise graphs (none replayed whole), and with no request joining a step before its
    # loads landed. Each: (name, keep, pieces, whole, run ahead, join ahead).
    sched_cfg = llm.config.scheduler
    default_async, default_join = sched_cfg.async_scheduling, sched_cfg.join_loads_ahead
    configs = [("cleared", False, True, True, default_async, default_join),
               ("kept", True, True, True, default_async, default_join)]  # fmt: skip
    if args.resume_variants:
        configs += [("kept_sync", True, True, True, False, default_join),
                    ("kept_eager", True, False, False, default_async, default_join)]  # fmt: skip
    if args.resume_pieces_arm:
        configs += [("kept_pieces", True, True, False, default_async, default_join)]
    join_arm = "kept_no_join" if default_join else "kept_join_ahead"  # the engine's default flipped
    if args.resume_join_arm:
        configs += [(join_arm, True, True, True, default_async, not default_join)]
    if args.resume_added_first_arm:  # LLM.add_requests not stepping while it adds the batch
        configs += [("kept_added_first", True, True, True, default_async, default_join)]
    joined = _joined_ahead(llm)
    for seed, (name, keep, pieces, whole_steps, run_ahead, join_ahead) in enumerate(configs):
        ps = random_prompts(args.resume_requests, args.resume_tokens, args.resume_tokens, vocab, seed=100 + seed)
        variants = _triton_variants()
        forwards.clear()
        parts.clear()
        events.clear()
        runner.piecewise = piecewise if pieces else None
        runner.mixed_graphs = whole if whole_steps else None
        sched_cfg.async_scheduling, sched_cfg.join_loads_ahead = run_ahead, join_ahead
        joined.clear()
        replays = args.resume_replays if name == "kept" else 1
        if name == "kept_added_first":
            llm._start_early = lambda added_tokens: False
        arms[name] = run_arm(llm, keep, ps, max_tokens=RESUME_NEW_TOKENS, replays=replays)
        vars(llm).pop("_start_early", None)
        arms[name]["triton_variants_compiled"] = _triton_variants() - variants
        arms[name]["forward_s"] = list(forwards)  # warm-up's and replay's steps
        arms[name]["copies_forward_s"] = list(parts)
        arms[name]["device"] = _device_ms(events)  # the same steps on the device's clock
        arms[name]["joined_ahead"] = len(joined)  # over the warm-up and every replay
    runner.piecewise, runner.mixed_graphs = piecewise, whole
    sched_cfg.async_scheduling, sched_cfg.join_loads_ahead = default_async, default_join
    for name in ("launch", "_forward"):
        delattr(runner, name)
    if runner.connector is not None:
        for name in ("run_loads", "run_stores", "join_ahead"):
            delattr(runner.connector, name)
    kept = arms["kept"]["metric_delta"]
    load_bytes = kept.get('siesta_kv_offload_load_bytes_total{tier="host"}', 0.0)
    # After the arms (its prompt's KV goes to the tier), with the engine's defaults restored.
    floor = kept_floor(llm, arms, args.resume_requests, args.resume_tokens, RESUME_NEW_TOKENS, args.link_gbps)
    extra = [name for name in arms if name not in ("cleared", "kept")]  # the kept arm's variants
    return {
        "init_s": init_s,
        "requests": args.resume_requests,
        "prompt_tokens": args.resume_tokens,
        "kv_bytes_per_token": kv_per_token,
        "cleared": arms["cleared"],
        "kept": arms["kept"],
        **{name: arms[name] for name in extra},
        **{f"{name}_p50_over_floor": arms[name]["replay_p50_s"] / floor["floor_p50_s"] for name in extra},
        **{f"{name}_over_kept_p50": arms[name]["replay_p50_s"] / arms["kept"]["replay_p50_s"] for name in extra},
        "async_scheduling": default_async,
        "speedup_p50": arms["cleared"]["replay_p50_s"] / arms["kept"]["replay_p50_s"],
        **({"speedup_p50_kept_sync": arms["cleared"]["replay_p50_s"] / arms["kept_sync"]["replay_p50_s"],
            "speedup_p50_eager_mixed": arms["cleared"]["replay_p50_s"] / arms["kept_eager"]["replay_p50_s"]}
           if args.resume_variants else {}),
        "speedup_p50_median": arms["cleared"]["replay_p50_s"] / arms["kept"]["replay_p50_median_s"],
        "kept_load_floor_s": load_bytes / (args.link_gbps * 1e9),
        "kept_floor": floor,  # the p50 against its ordered-load floor (siesta.bench.load_floor)
        "kept_p50_over_floor": floor["p50_over_floor"],
        "kv_blocks": runner.kv_cache.num_blocks,
        "reserved_GiB": torch.cuda.memory_reserved() / 2**30 if torch.cuda.is_available() else 0.0,
    }


def resume_http(args: argparse.Namespace) -> dict[str, Any]:
    """The seed's own client over HTTP against ``siesta serve`` (both arms), then the in-process
    experiment (``resume``) at the same prompt length, in this one run: how much the HTTP path
    adds to a kept-tier replay."""
    from siesta.bench.resume_http import ServeOptions, measure, seed_prompt_tokens

    options = ServeOptions(model=args.model, tokenizer=args.http_tokenizer, max_model_len=args.max_model_len,
                           max_num_batched_tokens=args.max_num_batched_tokens, tier_block_size=args.tier_block_size,
                           tier_bytes=args.tier_bytes, device=args.device, kv_cache_bytes=args.http_kv_cache_bytes)  # fmt: skip
    tokens = seed_prompt_tokens(args.http_tokenizer, args.http_prompt_words)
    http = measure(options, args.resume_requests, args.http_prompt_words, replays=args.resume_replays)
    gc.collect()
    # The arms the HTTP client has (the resume section runs the variants).
    in_process = resume(argparse.Namespace(**(vars(args) | {"resume_tokens": tokens, "resume_variants": False})))
    kept_http = http["seed_client"]["kept"]["replay_p50_s"]
    kept_in_process = in_process["kept"]
    return {
        "requests": args.resume_requests,
        "prompt_words": args.http_prompt_words,
        "prompt_tokens": tokens,
        "http": http,
        "in_process": in_process,
        "seed_client_speedup_p50": http["speedup_p50"],
        "in_process_speedup_p50": in_process["speedup_p50"],
        # Goal <= 1.15: the HTTP path adds almost nothing to a kept-tier replay.
        "kept_replay_http_over_in_process": kept_http / kept_in_process["replay_p50_s"],
        # The same over every replay of each (a replay's own noise is ~10 %), and the link rate
        # while each side's loads were in flight: what the host gave each process.
        "kept_replay_http_over_in_process_median": http["kept_replay_p50_median_s"] / kept_in_process["replay_p50_median_s"],
        "link_gbps_http": http["seed_kept_link_gbps"],
        "link_gbps_in_process": kept_in_process["link_gbps"],
        # The kept arm's warm-up hits the device prefix cache (the cleared arm's replay left it
        # there): over HTTP that is the API path's own cost plus one extend and the decodes.
        "kept_warm_http_p50_s": http["seed_client"]["kept"]["warm_p50_s"],
    }


# The oracle's architectures on the GPU: Llama-3 (llama3 rope), Mistral, Qwen3 (q/k norms),
# Qwen2 (q/k/v biases); the last is also loaded from a checkpoint.
FIDELITY_SHAPES = ("qwen3-0.6b", "qwen2.5-0.5b", "llama-3-8b", "mistral-7b")
FIDELITY_KV_BYTES = 24 << 30


def fidelity(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's logprobs against a transformers trainer's (transformers' init, pushed), per
    position bucket up to 32k tokens, at batch 1 and 64, in units of the trainer's bf16 floor;
    Llama-3 again with the fp32 head, and the head's decode cost at batch 1 and 64."""
    from siesta.bench import fidelity as oracle
    from siesta.model.random_init import RANDOM_SHAPES

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out: dict[str, Any] = {}

    def decode_cost(llm) -> dict[str, float]:
        return {f"decode_b{b}_step_ms": decode_step_s(llm, b, args.decode_context, args.decode_steps) * 1e3
                for b in (1, 64)}  # fmt: skip

    for shape in args.fidelity_shapes:
        config = RANDOM_SHAPES[shape].config()
        long_len = min(args.fidelity_tokens, config.max_position_embeddings) - 2 * args.fidelity_decode_tokens
        common = {"device": device, "long_len": long_len, "engine_dtype": "bfloat16", "kv_cache_bytes": args.fidelity_kv_bytes,
                  "decode_tokens": args.fidelity_decode_tokens}  # fmt: skip
        head = shape == args.fidelity_head_shape
        out[shape] = oracle.run_shape(shape, config, batch=args.fidelity_batch, checkpoint=shape == args.fidelity_checkpoint,
                                      probe=decode_cost if head else None, **common)  # fmt: skip
        if head:  # the fp32 head: its floor ratio, and what it costs a decode step
            out[f"{shape}+fp32_head"] = oracle.run_shape(shape, config, batch=1, head_fp32=True, probe=decode_cost, **common)
        for name in (shape, f"{shape}+fp32_head"):  # the last report of each numerics, for /metrics
            if name in out:
                fidelity_report.save(out[name]["numerics_key"], out[name])
        if args.json:  # each shape as it is done: a run cut short keeps what it measured
            with open(f"{args.json}.fidelity.json", "w") as f:
                f.write(oracle.dumps(out))
    return out


def deterministic(args: argparse.Namespace) -> dict[str, Any]:
    """Deterministic mode against the default (each in its own process): decode b1/b64/b256 and
    an 8k prefill, and one request's bits alone, in a batch of 64, chunked, from the tier and
    across a kept sleep."""
    from siesta.bench.deterministic import both_modes

    extra = ["--model", args.model, "--max-model-len", str(args.max_model_len)]
    if args.device:
        extra += ["--device", args.device]
    return both_modes(extra + (args.deterministic_extra.split() if args.deterministic_extra else []))


def seed_line(args: argparse.Namespace) -> dict[str, Any]:
    """The seed's serve line exactly as it is given (its tensor-parallel size aside), the seed's
    client unchanged at ``--http-prompt-words``: the figure a user who pastes it gets, for each
    ``$MODEL`` shape (with whether the burst's KV fits the line's 32 GiB tier)."""
    from siesta.bench import seed_line as seed

    extra = [] if args.seed_line_extra is None else args.seed_line_extra.split()
    out: dict[str, Any] = {}
    for shape in args.seed_line_shapes:
        out[shape] = seed.run(args.resume_requests, args.http_prompt_words, shape=shape,
                              tokenizer=args.http_tokenizer, extra_flags=extra)  # fmt: skip
        gc.collect()
        if args.seed_line_invariant_arm:
            out[f"{shape}+{seed.INVARIANT_ENV_LABEL}"] = seed.run(
                args.resume_requests, args.http_prompt_words, shape=shape, tokenizer=args.http_tokenizer,
                extra_flags=extra, env=seed.INVARIANT_ENV)  # fmt: skip
            gc.collect()
    return out


def resume_trace(args: argparse.Namespace) -> dict[str, Any]:
    """The kept-tier replay with its phases timed on the host and on the compute stream and
    the step loop's stack sampled, twice: step inputs and sampled tokens moved by the copy
    kernel (the engine's way) and by the copy engines. Per arm: p50, the replay's seconds
    per phase, and for its slowest steps the phases and the lines the loop was seen on."""
    from siesta.bench.probes import PhaseTimer, StackSampler
    from siesta.bench.resume_offline import fire_all
    from siesta.core import staging
    from siesta.core.model_runner import LaunchedStep

    tier = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"block_size": args.tier_block_size, "cpu_bytes_to_use": args.tier_bytes}}  # fmt: skip
    llm = make_llm(args, kv_transfer_config=tier, gpu_memory_utilization=0.9)
    eng, runner = llm.engine, llm.engine.runner
    cuda = torch.cuda.is_available()
    res: dict[str, Any] = {}
    for seed, (arm, kernel) in enumerate((("kernel_copies", True), ("copy_engine", False))):
        staging.KERNEL_COPIES = kernel
        ps = random_prompts(args.resume_requests, args.resume_tokens, args.resume_tokens, eng.vocab_size, seed=300 + seed)
        fire_all(llm, ps, 8)
        eng.connector.wait_for_stores(runner.kv_cache)
        llm.sleep(level=1, clear_connector_cache=False)
        llm.wake_up()
        timer = PhaseTimer()
        timer.wrap(eng, "step")
        for owner, attr in ((eng.scheduler, "schedule"), (eng.scheduler, "update"), (eng.connector, "run_loads"),
                            (eng.connector, "run_stores"), (eng.connector, "poll")):  # fmt: skip
            timer.wrap(owner, attr)
        for owner, attr in ((runner, "_plan"), (runner, "_device_inputs"), (runner, "_forward"), (runner.model, "compute_logits"),
                            (runner.sampler, "sample"), (LaunchedStep, "results")):  # fmt: skip
            timer.wrap(owner, attr, device=cuda)
        steps: list[tuple[float, int, int]] = []
        with StackSampler() as sampler:
            latencies = fire_all(llm, ps, 8, steps)
        timer.unwrap()
        walls = [(t1 - t0, t0, t1) for name, t0, t1 in timer.calls if name == "step"]
        first, last = walls[0][1], walls[-1][2] + 1e-9
        res[arm] = {
            "replay_p50_s": sorted(latencies)[len(latencies) // 2],
            "replay_steps": steps,
            "host_phases_s": timer.within(first, last),
            "device_phases_s": timer.device_within(first, last) if cuda else {},
            "slowest_steps": [{"wall_s": round(w, 4), "phases_s": timer.within(t0, t1),
                               "device_phases_s": timer.device_within(t0, t1) if cuda else {},
                               "stacks": sampler.within(t0, t1, top=4), "late_samples_s": sampler.late_within(t0, t1)}
                              for w, t0, t1 in sorted(walls, reverse=True)[:TRACE_SLOW_STEPS]],
        }  # fmt: skip
    staging.KERNEL_COPIES = True
    return res


def _step_phase_timer(llm) -> Any:
    """A PhaseTimer on a step's phases, and inside ``_device_inputs`` on the staged copy, its
    kernel, the pinned ring, tensor indexing (the unseen tokens' gather and scatter) and new
    blocks zeroed. A function of its own: no local of the caller keeps the engine's cache alive."""
    from siesta.bench.probes import PhaseTimer
    from siesta.core import model_runner, staging
    from siesta.core.model_runner import LaunchedStep

    eng, runner = llm.engine, llm.engine.runner
    timer = PhaseTimer()
    timer.wrap(llm, "step", "llm_step")
    timer.wrap(eng, "step")
    for owner, attr in ((eng.scheduler, "schedule"), (eng.scheduler, "update"), (runner, "_plan"), (runner, "_device_inputs"),
                        (runner, "_forward"), (runner.model, "compute_logits"), (runner.sampler, "sample"),
                        (LaunchedStep, "results")):  # fmt: skip
        timer.wrap(owner, attr)
    for owner, attr, phase in ((model_runner, "to_device_many", None), (staging, "copy_words", None),
                               (staging.reserve(), "take", "ring_take"), (torch.Tensor, "__getitem__", "tensor_getitem"),
                               (torch.Tensor, "__setitem__", "tensor_setitem"), (runner.kv_cache, "zero_blocks", None)):  # fmt: skip
        timer.wrap(owner, attr, phase)
    return timer


def decode_trace(args: argparse.Namespace) -> dict[str, Any]:
    """Where a decode step's wall time goes on the host, per phase, next to the graph's own
    replay time (the part of a synchronous step the device sits idle for), with and without
    async scheduling."""
    res: dict[str, Any] = {}
    for arm, run_ahead in (("sync", False), ("async", True)):
        llm = make_llm(args, gpu_memory_utilization=0.85, async_scheduling=run_ahead)
        for b in (1, 64):
            timer = _step_phase_timer(llm)
            step_s = decode_step_s(llm, b, args.decode_context, args.decode_steps)
            timer.unwrap()
            steps = [c for c in timer.calls if c[0] == "llm_step"][-args.decode_steps :]
            per_step = timer.within(steps[0][1], steps[-1][2] + 1e-9)
            res[f"{arm}_batch{b}"] = {"step_ms": step_s * 1e3, "graph_replay_ms": _replay_s(llm, b) * 1e3,
                                      "phases_ms": {k: round(v / len(steps) * 1e3, 3) for k, v in per_step.items()}}  # fmt: skip
        del llm, timer
        gc.collect()
        torch.cuda.empty_cache()
    return res


def step_io(args: argparse.Namespace) -> dict[str, Any]:
    """How long a step's small copy (4 KiB) takes while tier copies stream in or out: through
    the copy engine (``copy_``) or read/written by a kernel straight from pinned host memory
    (zero-copy). Tier copies go out as the engine issues them (one ``cuMemcpyBatchAsync`` per
    chunk, ``batched``) or as plain ``copy_`` on a side stream (``plain``). A small copy that
    has not landed after ``STEP_IO_DEADLINE_S`` counts as starved."""
    import threading

    from siesta.core.staging import copy_words
    from siesta.tiers.transfer import BatchedCopies

    dev = torch.device("cuda", torch.cuda.current_device())
    chunk, in_flight = 128 << 20, 4
    host_big = torch.empty(chunk * in_flight, dtype=torch.uint8, pin_memory=True)
    dev_big = torch.empty(chunk * in_flight, dtype=torch.uint8, device=dev)
    batch = BatchedCopies.create()
    small_host = torch.arange(1024, dtype=torch.int32).pin_memory()
    small_dev = torch.zeros(1024, dtype=torch.int32, device=dev)

    def feed(direction: str, batched: bool, stop: threading.Event, moved: list[int]) -> None:
        torch.cuda.set_device(dev)
        stream = torch.cuda.Stream(dev)
        events: list[torch.cuda.Event] = []
        i = 0
        while not stop.is_set():
            if len(events) == in_flight:
                events.pop(0).synchronize()
            h, d = host_big[i * chunk : (i + 1) * chunk], dev_big[i * chunk : (i + 1) * chunk]
            pair = (d, h) if direction == "in" else (h, d)
            if batched:
                batch.issue([pair], stream)
            else:
                with torch.cuda.stream(stream):
                    pair[0].copy_(pair[1], non_blocking=True)
            e = torch.cuda.Event()
            e.record(stream)
            events.append(e)
            moved[0] += chunk
            i = (i + 1) % in_flight
        for e in events:
            e.synchronize()

    def once(way: str) -> float:
        t0 = time.perf_counter()
        if way == "h2d_copy":
            small_dev.copy_(small_host, non_blocking=True)
        elif way == "h2d_kernel":
            copy_words(small_host, small_dev)
        elif way == "d2h_copy":
            small_host.copy_(small_dev, non_blocking=True)
        else:
            copy_words(small_dev, small_host)
        done = torch.cuda.Event()
        done.record()
        while not done.query():
            if time.perf_counter() - t0 > STEP_IO_DEADLINE_S:
                return float("inf")
            time.sleep(1e-5)
        return time.perf_counter() - t0

    def measure(way: str) -> dict[str, Any]:
        """Latencies until the first starved copy (the ones queued behind it would be too)."""
        lat = []
        for _ in range(STEP_IO_REPS):
            lat.append(once(way))
            if lat[-1] == float("inf"):
                break
        us = sorted(round(x * 1e6, 1) for x in lat if x != float("inf")) or [float("nan")]
        return {"p50_us": us[len(us) // 2], "max_us": us[-1], "starved_after": len(lat) if lat[-1] == float("inf") else None}

    res: dict[str, Any] = {"tier_copies_batched": batch is not None, "deadline_s": STEP_IO_DEADLINE_S}
    ways = ("h2d_kernel", "d2h_kernel", "h2d_copy", "d2h_copy")
    for way in ways:
        once(way)
    torch.cuda.synchronize()
    res["idle"] = {way: measure(way) for way in ways}
    for direction in ("in", "out"):
        for batched in (True, False):
            if batched and batch is None:
                continue
            name = f"{direction}_{'batched' if batched else 'plain'}"
            res[name] = {}
            for way in ways:
                stop, moved = threading.Event(), [0]
                thread = threading.Thread(target=feed, args=(direction, batched, stop, moved), daemon=True)
                thread.start()
                time.sleep(0.05)
                t0, start = time.perf_counter(), moved[0]
                res[name][way] = measure(way) if moved[0] else {"error": "the feeder moved nothing"}
                res[name][way]["tier_GB_s"] = round((moved[0] - start) / (time.perf_counter() - t0) / 1e9, 1)
                stop.set()
                thread.join()
                torch.cuda.synchronize()
    copy_words(small_host, small_dev)
    torch.cuda.synchronize()
    res["kernel_exact"] = bool(torch.equal(small_dev.cpu(), small_host))
    return res


def transfers(args: argparse.Namespace) -> dict[str, Any]:
    """Host-tier store and load rates: the copier's own path, one DMA per device block."""
    from siesta.tiers.transfer import BlockCopier

    llm = make_llm(args, kv_cache_bytes=16 << 30)
    kv = llm.engine.runner.kv_cache
    n = min(kv.num_blocks, args.transfer_blocks)
    host = torch.empty((n, *kv.tensor.shape[1:]), dtype=kv.tensor.dtype, pin_memory=True)
    copier = BlockCopier(kv.tensor.device)
    # Shuffled ids: no two neighbours are consecutive, so every block is its own DMA (the worst case).
    ids = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    nbytes = n * kv.block_bytes
    out: dict[str, Any] = {"block_bytes": kv.block_bytes, "blocks": n}
    for rep in range(2):
        sync()
        t0 = time.perf_counter()
        copier.wait(copier.store(kv, ids, host))
        store_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        copier.wait(copier.load([(host, ids)], kv))
        load_s = time.perf_counter() - t0
    out |= {"store_GB_s": nbytes / store_s / 1e9, "load_GB_s": nbytes / load_s / 1e9}
    return out


def store_overlap(args: argparse.Namespace) -> dict[str, Any]:
    """Decode step time while the store stream copies blocks to host at link speed, against none.

    Two layouts of the stored blocks: whole tier entries (runs of consecutive device blocks,
    what a fresh pool hands a request) and single scattered blocks (the worst case, one DMA
    each), both issued by the step loop in one call per step; and whole entries submitted
    one by one to a store feeder, the connector's own path (a bounded window, queued
    entries coalesced into few calls).
    """
    from siesta.tiers.copy_feeder import CopyFeeder
    from siesta.tiers.offloading import DEFAULT_STORE_WINDOW_BYTES
    from siesta.tiers.transfer import BlockCopier

    llm = make_llm(args, gpu_memory_utilization=0.85)
    kv = llm.engine.runner.kv_cache
    copier = BlockCopier(kv.tensor.device)
    batch, steps = args.overlap_batch, args.decode_steps
    plain_s = decode_step_s(llm, batch, args.decode_context, steps)
    # Enough blocks per step to keep the link busy for the whole step (sized from a plain step).
    run = args.tier_block_size // llm.config.cache.block_size
    per_step = max(run, int(plain_s * args.link_gbps * 1e9 / kv.block_bytes) // run * run)
    host = torch.empty((per_step, *kv.tensor.shape[1:]), dtype=kv.tensor.dtype, pin_memory=True)
    gen = torch.Generator().manual_seed(0)
    # Blocks from the top of the pool, which the decode batch's requests do not reach.
    top = kv.num_blocks - per_step
    entries = [top + e * run + i for e in torch.randperm(per_step // run, generator=gen).tolist() for i in range(run)]
    feeder = CopyFeeder(copier, "out", DEFAULT_STORE_WINDOW_BYTES, kv.block_bytes, threaded=False)

    def fed(ids: list[int], after) -> None:
        for e in range(0, len(ids), run):
            feeder.submit(None, [(host[e : e + run], ids[e : e + run])], kv, issue=False, after=after)
        feeder.landed()  # issues them together, as the connector's poll does

    scattered = (top + torch.randperm(per_step, generator=gen)).tolist()
    arms = {
        "entries": lambda after: copier.store_parts([(host, entries)], kv, after=after),
        "scattered": lambda after: copier.store_parts([(host, scattered)], kv, after=after),
        "entries_fed": lambda after: fed(entries, after),
    }
    out: dict[str, Any] = {"batch": batch, "plain_step_ms": plain_s * 1e3, "stored_bytes_per_step": per_step * kv.block_bytes,
                           "batched_issue": copier.batched, "store_window_bytes": DEFAULT_STORE_WINDOW_BYTES}  # fmt: skip
    runner = llm.engine.runner
    for name, issue in arms.items():
        handles: list[Any] = []
        issue_s: list[float] = []

        # As the runner issues a step's copies: once its forward is launched, waiting for
        # what was queued before it.
        def forward(inputs, issue=issue, handles=handles, issue_s=issue_s, plain=runner._forward):
            mark = torch.cuda.Event()
            mark.record()
            hidden = plain(inputs)
            t0 = time.perf_counter()
            handles.append(issue(mark))
            issue_s.append(time.perf_counter() - t0)
            return hidden

        runner._forward = forward
        try:
            storing_s = decode_step_s(llm, batch, args.decode_context, steps)
        finally:
            del runner._forward  # back to the class's method
        t0 = time.perf_counter()
        for h in handles:
            copier.wait(h)
        feeder.drain()
        backlog_s = time.perf_counter() - t0
        out[name] = {"storing_step_ms": storing_s * 1e3, "slowdown": storing_s / plain_s - 1,
                     "issue_ms_per_step": 1e3 * sum(issue_s) / max(len(issue_s), 1),
                     "store_GB_s": len(handles) * per_step * kv.block_bytes / (storing_s * steps + backlog_s) / 1e9}  # fmt: skip
    out["slowdown"] = out["entries_fed"]["slowdown"]  # the connector's own path
    return out



def decode_kernels(args: argparse.Namespace) -> dict[str, Any]:
    """Device time of a decode step's parts, kernel by kernel: the eager forward (the kernels a
    graph replays), the graph replay itself, and what runs outside it (logits, sampling)."""
    from siesta import SamplingParams
    from siesta.core.sampler import SamplingRow

    llm = make_llm(args, gpu_memory_utilization=0.85)
    runner = llm.engine.runner
    greedy = SamplingRow(params=SamplingParams(temperature=0), generator=None, prompt_token_ids=[],
                         output_token_ids=[], banned_token_ids=[])  # fmt: skip
    res: dict[str, Any] = {}
    for b in (1, 64):
        inputs = runner._dummy_inputs([(args.decode_context, 1)] * b, runner.kv_cache.num_blocks, seed=0)
        with torch.inference_mode():
            hidden = runner._forward(inputs)
        parts = {"eager_forward": lambda i=inputs: runner.model(i.input_ids, i.positions, runner.kv_cache, i.meta),
                 "engine_forward": lambda i=inputs: runner._forward(i),
                 "logits_and_sample": lambda h=hidden: runner.sampler(runner.model.compute_logits(h), [greedy] * b)}  # fmt: skip
        res[f"batch{b}"] = {"graph_replay_ms": _replay_s(llm, b) * 1e3}
        with torch.inference_mode():
            for name, fn in parts.items():
                fn()
                idle: dict[str, float] = {}
                busy_ms, launches, top = device_kernels(fn, top=PROFILE_TOP_KERNELS, idle=idle)
                res[f"batch{b}"][name] = {"device_busy_ms": busy_ms, "launches": launches, "top_kernels": top,
                                          "idle_before_ms": idle}  # fmt: skip
        res[f"batch{b}"]["engine_steps"] = engine_step_kernels(llm, b, args.decode_context)
    return res


def mixed_step(args: argparse.Namespace) -> dict[str, Any]:
    """Forwards of the batches a resume runs (short extends over long cached prefixes beside
    decode rows): eager, in piecewise CUDA graphs, and the engine's path (whole-step graphs,
    ``core/mixed_graphs``, where a bucket holds the step). Wall ms per
    forward against the device's busy ms (the rest is launch overhead on the host), kernel
    launches, the costliest kernels, and how far the two paths' hidden states differ."""
    llm = make_llm(args, gpu_memory_utilization=0.85)
    runner = llm.engine.runner
    extend = args.resume_tokens % args.tier_block_size or args.tier_block_size
    prefix = args.resume_tokens - extend
    cases = {
        "extend": [(prefix, extend)],
        "extend_decode4": [(prefix, extend)] + [(args.resume_tokens, 1)] * 4,
        "extend2_decode6": [(prefix, extend)] * 2 + [(args.resume_tokens, 1)] * 6,
    }
    res: dict[str, Any] = {"extend_tokens": extend, "prefix_tokens": prefix}
    for name, specs in cases.items():
        inputs = runner._dummy_inputs(specs, runner.kv_cache.num_blocks, seed=0)
        paths = {"eager": lambda i=inputs: runner.model(i.input_ids, i.positions, runner.kv_cache, i.meta),
                 "pieces": lambda i=inputs: _in_pieces(runner, i),
                 "engine": lambda i=inputs: runner._forward(i)}  # fmt: skip
        hidden = {}
        res[name] = {}
        for path, forward in paths.items():
            times = []
            with torch.inference_mode():
                for rep in range(MIXED_REPS + 2):  # two warm-ups
                    sync()
                    t0 = time.perf_counter()
                    hidden[path] = forward().clone()
                    sync()
                    if rep >= 2:
                        times.append(time.perf_counter() - t0)
                busy_ms, launches, top = device_kernels(forward)
            res[name][path] = {"wall_ms": 1e3 * sorted(times)[len(times) // 2], "device_busy_ms": busy_ms,
                               "launches": launches, "top_kernels": top}  # fmt: skip
        res[name]["max_abs_hidden_diff"] = (hidden["eager"].float() - hidden["engine"].float()).abs().max().item()
        res[name]["pieces_max_abs_hidden_diff"] = (hidden["eager"].float() - hidden["pieces"].float()).abs().max().item()
        res[name]["speedup"] = res[name]["eager"]["wall_ms"] / res[name]["engine"]["wall_ms"]
        res[name]["speedup_over_pieces"] = res[name]["pieces"]["wall_ms"] / res[name]["engine"]["wall_ms"]
    return res


def _in_pieces(runner, inputs) -> torch.Tensor:
    """The engine's forward with no step replayed whole (steps with prefill rows in pieces)."""
    whole, runner.mixed_graphs = runner.mixed_graphs, None
    try:
        return runner._forward(inputs)
    finally:
        runner.mixed_graphs = whole


def sleep_wake(args: argparse.Namespace) -> dict[str, Any]:
    llm = make_llm(args, gpu_memory_utilization=0.85)
    # The pinned backup is made in the background while no step runs (an engine waiting for its
    # first requests or weights); settle() pins what is left now. How long it took is reported.
    backup = llm.engine.memory.backup
    t0 = time.perf_counter()
    backup.settle()
    backup_info = {"background": llm.config.background_weight_backup(), "ready_after_start_s": time.perf_counter() - t0,
                   "prepare_s": backup.prepare_s, "bytes": backup.nbytes}  # fmt: skip
    free0, total = torch.cuda.mem_get_info()
    engine_bytes = llm.engine.memory.weight_bytes + llm.engine.memory.kv_bytes
    out: dict[str, Any] = {"engine_bytes": engine_bytes, "free_before_GiB": free0 / 2**30, "total_GiB": total / 2**30,
                           "keeps_addresses": llm.engine.memory.keeps_addresses, "backup": backup_info}  # fmt: skip
    for rep in ("first", "second"):  # with weight_backup=first_sleep the first sleep makes the backup
        m0 = llm.get_metrics()
        t0 = time.perf_counter()
        llm.sleep(level=1)
        sleep_s = time.perf_counter() - t0
        free1, _ = torch.cuda.mem_get_info()
        t0 = time.perf_counter()
        llm.wake_up()
        wake_s = time.perf_counter() - t0  # includes re-capturing the decode graphs, where addresses moved
        free2, _ = torch.cuda.mem_get_info()
        m1 = llm.get_metrics()
        # The engine's own timers: memory release / restore only (not the graph re-capture).
        mem_sleep = m1["siesta_sleep_seconds_total"] - m0.get("siesta_sleep_seconds_total", 0.0)
        mem_wake = m1["siesta_wake_seconds_total"] - m0.get("siesta_wake_seconds_total", 0.0)
        reports = llm.engine.memory_reports
        out[rep] = {"freed_fraction": (free1 - free0) / engine_bytes, "sleep_call_s": sleep_s, "wake_call_s": wake_s,
                    "memory_sleep_s": mem_sleep, "memory_wake_s": mem_wake,
                    "parts_s": {k: r.seconds for k, r in reports.items()},
                    "backup_wait_s": reports["sleep_weights"].waited_s,
                    "weights_GB_s_sleep": reports["sleep_weights"].gb_per_s,
                    "weights_GB_s_wake": reports["wake_weights"].gb_per_s,
                    "free_asleep_GiB": free1 / 2**30, "free_after_GiB": free2 / 2**30}  # fmt: skip
    out["freed_fraction"] = out["second"]["freed_fraction"]
    out["weights_GB_s_sleep"] = out["second"]["weights_GB_s_sleep"]
    out["weights_GB_s_wake"] = out["second"]["weights_GB_s_wake"]
    return out


# In order of what matters most, so a short lease loses the least.
def _invariant_matmul():
    """Imported when used: it compiles Triton kernels at import (and needs the interpreter's
    flag set first on the CPU)."""
    from siesta.bench import invariant_matmul

    return invariant_matmul


def _invariant_attention():
    """Imported when used, as ``_invariant_matmul``."""
    from siesta.bench import invariant_attention

    return invariant_attention


def _moe_tiles():
    """Imported when used: it imports the Triton MoE kernels (the interpreter's flag first)."""
    from siesta.bench import moe_tiles

    return moe_tiles


def _fp8_decode():
    """Imported when used, as ``_invariant_matmul``."""
    from siesta.bench import fp8_decode

    return fp8_decode


def moe_tiles(args: argparse.Namespace) -> dict[str, Any]:
    module = _moe_tiles()
    text = args.moe_tile_candidates or module.CANDIDATES
    candidates = [module.parse_candidate(c) for c in text.split(",") if c]
    return module.run(torch.device(args.device or "cuda"), candidates=candidates)


def _beside_json(args: argparse.Namespace, name: str) -> str | None:
    """A file in the JSON's folder (``$OUT`` on the GPU machine), or None without ``--json``."""
    return str(Path(args.json).parent / name) if args.json else None


def invariant_attention(args: argparse.Namespace) -> dict[str, Any]:
    module = _invariant_attention()
    candidates = [module.parse_candidate(c) for c in args.attention_candidates.split(",") if c]
    return module.run(torch.device(args.device or "cuda"), candidates=candidates,
                      ir_path=_beside_json(args, "invariant_attention_ttgir.txt"))


SECTIONS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "correctness": correctness,
    "resume": resume,
    "resume_http": resume_http,
    "seed_line": seed_line,
    "fidelity": fidelity,
    "deterministic": deterministic,
    "decode": decode,
    "prefill": prefill,
    "sleep_wake": sleep_wake,
    "transfers": transfers,
    "store_overlap": store_overlap,
    "mixed_step": mixed_step,
    "weight_transfer": weight_transfer,
    "resume_trace": resume_trace,
    "decode_trace": decode_trace,
    "step_io": step_io,
    "decode_kernels": decode_kernels,
    "tensor_parallel": tensor_parallel,
    "moe": lambda args: moe_bench.run(args),
    "fp8": lambda args: fp8_bench.run(args),
    "invariant_matmul": lambda args: _invariant_matmul().run(torch.device(args.device or "cuda")),
    "invariant_attention": invariant_attention,
    "backup_pinning": backup_pinning.run,
    "moe_tiles": moe_tiles,
    "fp8_decode": lambda args: _fp8_decode().run(
        torch.device(args.device or "cuda"), ir_path=_beside_json(args, "fp8_decode_ttgir.txt"),
        candidates=[_fp8_decode().parse_candidate(c) for c in args.decode_candidates.split(",") if c]),
}
# Run by name only: diagnostics; resume_http, which runs the resume section again beside the
# server; tensor_parallel, which needs a host with several GPUs; invariant_matmul, deterministic
# mode's GEMM against cuBLAS per matrix; invariant_attention, its decode rows against the prefill tile;
# backup_pinning, decode steps beside and between the pinning of the weights' sleep backup;
# moe_tiles, the fused-MoE kernels' tiles against candidates; fp8_decode, the split-KV decode
# over an fp8 cache against bf16.
DIAGNOSTIC_SECTIONS = ("resume_http", "resume_trace", "decode_trace", "step_io", "decode_kernels", "tensor_parallel",
                       "invariant_matmul", "invariant_attention", "backup_pinning", "moe_tiles",
                       "fp8_decode")  # fmt: skip


def summary(results: dict[str, Any]) -> list[list[Any]]:
    rows: list[list[Any]] = []

    def get(*path, default=None):
        node = results
        for p in path:
            if not isinstance(node, dict) or p not in node:
                return default
            node = node[p]
        return node

    if "correctness" in results:
        rows.append(["max |logprob diff| vs transformers", get("correctness", "max_abs_logprob_diff"), "bf16 tolerance"])
    for b in (1, 16, 64, 256) if "decode" in results else ():
        sync = get("decode", f"graphs_sync_batch{b}", "tok_s", default=0) or 0
        rows.append([f"decode b{b} tok/s", get("decode", f"graphs_batch{b}", "tok_s"),
                     f"{get('decode', f'graphs_batch{b}', 'of_roofline', default=0) or 0:.0%} of HBM roofline; "
                     f"{sync:,.0f} without async scheduling"])  # fmt: skip
    for n in (2048, 8192) if "prefill" in results else ():
        rows.append([f"prefill {n} tok/s", get("prefill", f"tokens{n}", "tok_s"),
                     f"MFU {get('prefill', f'tokens{n}', 'mfu', default=0) or 0:.0%}"])  # fmt: skip
    if "resume" in results:
        rows.append(["resume kept vs cleared (p50 speedup)", get("resume", "speedup_p50"),
                     f"goal >= 18x; {get('resume', 'speedup_p50_eager_mixed', default=0) or 0:.1f}x with eager mixed "
                     f"steps, {get('resume', 'speedup_p50_kept_sync', default=0) or 0:.1f}x kept without async scheduling"])
    if isinstance(results.get("deterministic"), dict) and "cost" in results["deterministic"]:
        cost = results["deterministic"]["cost"]
        rows.append(["deterministic mode cost (decode b1 / b64 / b256, prefill)",
                     " / ".join(f"{cost.get(k, 0):+.1%}" for k in ("decode_b1_step_ms", "decode_b64_step_ms",
                                                                    "decode_b256_step_ms", "prefill8192_s")),
                     f"goal <= 10%; bit-identical: {results['deterministic']['bit_identical']}"])  # fmt: skip
        for key, grown in (results["deterministic"].get("kernels_grown_ms") or {}).items():
            families = ", ".join(f"{k} {v:+.2f}" for k, v in sorted((grown.get("families") or {}).items()))
            rows.append([f"deterministic step, {key.removeprefix('kernels_')}: device ms added", grown["device_busy"],
                         f"by kind: {families}"])  # fmt: skip
    if isinstance(results.get("fidelity"), dict):
        rows.extend(fidelity_rows(results["fidelity"]))
    for shape, line in (results.get("seed_line") or {}).items():
        if not isinstance(line, dict) or "seed_client" not in line:
            continue
        stored = sum((line.get("kept_store_bytes") or {}).values())
        burst = line.get("burst_kv", {})
        rows.append([f"seed's serve line as given, {shape} (p50 speedup)", line.get("speedup_p50"),
                     f"goal >= 15x; burst KV {burst.get('GiB', 0):.1f} GiB in the line's {burst.get('tier_GiB', 0):.0f} GiB "
                     f"tier; kept arm stored {stored / 2**20:,.0f} MiB (goal 0), prefilled "
                     f"{line.get('kept_replay_steps', {}).get('prefill_tokens', 0):,} tokens"])  # fmt: skip
    if isinstance(results.get("resume_http"), dict) and "http" in results["resume_http"]:
        rows.append(["seed client over HTTP (p50 speedup)", get("resume_http", "seed_client_speedup_p50"),
                     f"goal >= 15x; in process {get('resume_http', 'in_process_speedup_p50', default=0) or 0:.1f}x"])
        rows.append(["kept replay p50, HTTP / in process", get("resume_http", "kept_replay_http_over_in_process"),
                     f"goal <= 1.15; {get('resume_http', 'kept_replay_http_over_in_process_median', default=0) or 0:.2f} "
                     "over the replays' medians"])  # fmt: skip
        rows.append(["link GB/s while loading, HTTP / in process",
                     f"{get('resume_http', 'link_gbps_http', default=0) or 0:.1f} / "
                     f"{get('resume_http', 'link_gbps_in_process', default=0) or 0:.1f}", "the seed's kept replay"])  # fmt: skip
    if "resume" in results:
        rows.append(["resume kept p50 / ordered-load floor p50", get("resume", "kept_p50_over_floor"),
                     (f"goal <= 1.15; floor p50 {get('resume', 'kept_floor', 'floor_p50_s', default=0) or 0:.3f} s at "
                      f"{get('resume', 'kept_floor', 'link_gbps', default=0) or 0:g} GB/s, decode step "
                      f"{(get('resume', 'kept_floor', 'decode_step_s', default=0) or 0) * 1e3:.2f} ms")])  # fmt: skip
        rows.append(["resume kept, median of replays: speedup; over floor", f"{get('resume', 'speedup_p50_median', default=0) or 0:.2f}x; "
                     f"{get('resume', 'kept_floor', 'median_over_floor', default=0) or 0:.2f}",
                     f"over the floor at the measured {get('resume', 'kept_floor', 'measured_link', 'link_gbps', default=0) or 0:.1f} GB/s: "
                     f"{get('resume', 'kept_floor', 'measured_link', 'p50_over_floor', default=0) or 0:.2f}"])  # fmt: skip
        marks = get("resume", "kept", "timeline_marks", default={}) or {}
        first = marks.get("first") or {}
        rows.append(["kept replay ms: adds done; 1st request issued / landed / done",
                     f"{(marks.get('adds_done_s') or 0) * 1e3:.0f}; " + " / ".join(
                         f"{(first.get(k) or 0) * 1e3:.0f}" for k in ("issued", "landed", "finished")),
                     f"1st step {' - '.join(f'{t * 1e3:.0f}' for t in marks.get('first_step_s') or ())} ms"])  # fmt: skip
    if "mixed_step" in results:
        rows.append(["mixed step ms, eager / pieces / whole graph", f"{get('mixed_step', 'extend_decode4', 'eager', 'wall_ms', default=0) or 0:.1f} / "
                     f"{get('mixed_step', 'extend_decode4', 'pieces', 'wall_ms', default=0) or 0:.1f} / "
                     f"{get('mixed_step', 'extend_decode4', 'engine', 'wall_ms', default=0) or 0:.1f}", "44-token extend + 4 decodes"])  # fmt: skip
    if "transfers" in results:
        rows.append(["tier store / load GB/s", f"{get('transfers', 'store_GB_s', default=0) or 0:.1f} / "
                     f"{get('transfers', 'load_GB_s', default=0) or 0:.1f}", "goal >= 45"])  # fmt: skip
    if "store_overlap" in results:
        rows.append(["decode slowdown storing (entries / scattered / fed)",
                     " / ".join(f"{get('store_overlap', arm, 'slowdown', default=0) or 0:.1%}"
                                for arm in ("entries", "scattered", "entries_fed")), "goal <= 5%"])  # fmt: skip
    if "sleep_wake" in results:
        rows.append(["sleep freed fraction", get("sleep_wake", "freed_fraction"), "goal >= 0.95"])
        for what in ("sleep", "wake"):
            first, second = (get("sleep_wake", rep, f"{what}_call_s", default=0) or 0 for rep in ("first", "second"))
            rows.append([f"{what} s, first / second", f"{first:.2f} / {second:.2f}", "goal <= 0.5" if what == "sleep" else ""])
        rows.append(["sleep / wake weights GB/s", f"{get('sleep_wake', 'weights_GB_s_sleep', default=0) or 0:.1f} / "
                     f"{get('sleep_wake', 'weights_GB_s_wake', default=0) or 0:.1f}", "goal >= 40"])  # fmt: skip
    if isinstance(results.get("weight_transfer"), dict):
        rows.extend(weight_transfer_rows(results["weight_transfer"]))  # ipc push, first push, RL step, nccl
    if isinstance(results.get("fp8"), dict):
        rows.extend(fp8_bench.summary_rows(results["fp8"]))
    if isinstance(results.get("moe"), dict):
        rows.extend(moe_bench.summary_rows(results["moe"]))
    if isinstance(results.get("moe_tiles"), dict) and "rows" in results["moe_tiles"]:
        rows.extend(_moe_tiles().summary_rows(results["moe_tiles"]))
    if isinstance(results.get("fp8_decode"), dict) and "rows" in results["fp8_decode"]:
        rows.extend(_fp8_decode().summary_rows(results["fp8_decode"]))
    if isinstance(results.get("backup_pinning"), dict):
        rows.extend(backup_pinning.summary_rows(results["backup_pinning"]))
    if isinstance(results.get("invariant_matmul"), dict) and "results" in results["invariant_matmul"]:
        rows.extend(_invariant_matmul().summary_rows(results["invariant_matmul"]))
    if isinstance(results.get("invariant_attention"), dict) and "rows" in results["invariant_attention"]:
        rows.extend(_invariant_attention().summary_rows(results["invariant_attention"]))
    if "tensor_parallel" in results:
        rows.extend(tensor_parallel_rows(results["tensor_parallel"]))
    return rows


def _section_names(text: str) -> list[str]:
    names = [] if text == "none" else [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown section(s) {unknown}; known: {', '.join(SECTIONS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    """The bench's flags (tests build their arguments from it, so a new flag reaches them)."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="random:llama-3-8b")
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--kv-cache-dtype", default="auto", help="the engines' KV cache: auto, fp8 (= fp8_e4m3), fp8_e5m2")
    ap.add_argument("--sections", type=_section_names, default=[s for s in SECTIONS if s not in DIAGNOSTIC_SECTIONS],
                    help="comma-separated section names; 'none' runs no section (bench/gpu.sh's tests only)")
    ap.add_argument("--check-prompt-len", type=int, default=512)
    ap.add_argument("--decode-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64, 256])
    ap.add_argument("--decode-context", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--overlap-batch", type=int, default=64)
    ap.add_argument("--prefill-lens", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 8192])
    ap.add_argument("--resume-requests", type=int, default=16)
    ap.add_argument("--resume-tokens", type=int, default=19500)
    ap.add_argument("--resume-replays", type=int, default=3, help="resume: kept-tier replays (the first is the seed's)")
    ap.add_argument("--resume-variants", action=argparse.BooleanOptionalAction, default=True,
                    help="resume: also the kept arm without async scheduling and with eager mixed steps")
    ap.add_argument("--resume-pieces-arm", action=argparse.BooleanOptionalAction, default=False,
                    help="resume: also the kept arm with every step that has prefill rows in piecewise graphs")
    ap.add_argument("--resume-join-arm", action=argparse.BooleanOptionalAction, default=False,
                    help="resume: also the kept arm with joining loads ahead of their landing flipped from the default")
    ap.add_argument("--resume-added-first-arm", action=argparse.BooleanOptionalAction, default=False,
                    help="resume: also the kept arm with the whole batch added before the engine's first step")
    ap.add_argument("--tier-block-size", type=int, default=128)
    ap.add_argument("--tier-bytes", type=int, default=48 << 30)
    ap.add_argument("--load-window-mib", type=int, default=None, help="the tier's load window (default: its own)")
    ap.add_argument("--http-tokenizer", default=str(DEFAULT_TOKENIZER), help="resume_http: siesta serve's --tokenizer")
    ap.add_argument("--http-prompt-words", type=int, default=2900, help="resume_http: the seed client's --prompt-tokens")
    ap.add_argument("--http-kv-cache-bytes", type=int, default=None, help="resume_http: the server's KV (CPU runs)")
    ap.add_argument("--fidelity-shapes", type=lambda s: s.split(","), default=list(FIDELITY_SHAPES))
    ap.add_argument("--fidelity-tokens", type=int, default=32768, help="fidelity: the long prompt's positions")
    ap.add_argument("--fidelity-batch", type=int, default=64)
    # 64: the long prompt's decode bucket then holds 63 positions, not 15 (run 46b's Qwen3 batch-64
    # decode buckets of 12-16 positions read 1.95x and 1.5x a floor that was itself a max of a dozen).
    ap.add_argument("--fidelity-decode-tokens", type=int, default=64, help="fidelity: greedy tokens a request")
    ap.add_argument("--fidelity-checkpoint", default="qwen2.5-0.5b", help="fidelity: the shape also loaded from disk")
    ap.add_argument("--fidelity-kv-bytes", type=int, default=FIDELITY_KV_BYTES)
    ap.add_argument("--fidelity-head-shape", default="llama-3-8b", help="fidelity: the shape also run with the fp32 head")
    ap.add_argument("--moe-tile-candidates", default=None,
                    help="moe_tiles: tiles to try (BLOCK_MxBLOCK_NxBLOCK_KwWARPSsSTAGES, comma-separated)")
    ap.add_argument("--attention-candidates", default="64w4s1,64w4s2,16w4s2",
                    help="invariant_attention: other row tiles to try (rows w warps s stages)")
    ap.add_argument("--decode-candidates", default="128w4s2,128w4s4,64w4s2,64w4s4",
                    help="fp8_decode: decode tiles both caches also try (keys w warps s stages)")
    ap.add_argument("--deterministic-extra", default=None, help="deterministic: more flags (CPU test runs)")
    ap.add_argument("--seed-line-shapes", type=lambda s: s.split(","), default=["qwen2.5-7b", "llama-3-8b"],
                    help="seed_line: the random shapes served as $MODEL, one server each")
    ap.add_argument("--seed-line-extra", default=None,
                    help="seed_line: flags after the seed's (CPU test runs only: the GPU run adds none)")
    ap.add_argument("--seed-line-invariant-arm", action=argparse.BooleanOptionalAction, default=False,
                    help="seed_line: each shape again with VLLM_BATCH_INVARIANT=1 (what the kept arm stores then)")
    ap.add_argument("--tp-sizes", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="tensor_parallel: sizes to run (default 1, 2, 4, ... up to the GPUs here)")
    ap.add_argument("--tp-models", type=lambda s: s.split(","), default=["random:llama-3-8b", "random:llama-3-70b"],
                    help="tensor_parallel: the models, each at every size that fits")
    ap.add_argument("--tp-dtype", default="bfloat16", help="tensor_parallel: the weights' dtype")
    ap.add_argument("--tp-cpu-kv-cache-bytes", type=int, default=64 << 20, help="tensor_parallel on the CPU: KV bytes")
    # The server first: it pins its own 48 GiB tier, best before this process has pinned any.
    ap.add_argument("--fp8-parts", type=lambda s: s.split(","), default=["seed_client", "capacity", "resume", "accuracy"],
                    help="fp8: what runs (each part fp8 against the model's dtype)")
    ap.add_argument("--fp8-long-context", type=int, default=8192, help="fp8: batch 64's decode context")
    ap.add_argument("--fp8-b256-context", type=int, default=2048, help="fp8: batch 256's (what both dtypes hold)")
    ap.add_argument("--fp8-check-shape", default="llama-3-8b", help="fp8: the accuracy check's shape")
    ap.add_argument("--fp8-check-layers", type=int, default=4, help="fp8: its layers")
    ap.add_argument("--moe-model", default="random:qwen3-30b-a3b", help="moe: the mixture-of-experts model")
    ap.add_argument("--moe-prefill-tokens", type=int, default=8192)
    ap.add_argument("--moe-check-shape", default="qwen3-30b-a3b", help="moe: the shape of the fidelity check")
    ap.add_argument("--moe-check-layers", type=int, default=4, help="moe: its layers (fp32 transformers must fit)")
    ap.add_argument("--moe-check-tokens", type=int, default=4096)
    ap.add_argument("--moe-prefill-tiles", default=None,
                    help="moe: the prefill again with these large-prefill expert tiles (moe_tiles' syntax)")
    ap.add_argument("--moe-profile-batches", type=lambda s: [int(b) for b in s.split(",")], default=[1],
                    help="moe: the decode batches whose step kernels are profiled")
    ap.add_argument("--moe-parts", type=lambda s: s.split(","),
                    default=["sorted_small_batches", "library_prefill", "fidelity", "resume", "weight_transfer"],
                    help="moe: what runs after decode and prefill")
    ap.add_argument("--link-gbps", type=float, default=DEFAULT_LINK_GBPS, help="host-to-device GB/s of the resume floor")
    ap.add_argument("--transfer-blocks", type=int, default=2048)
    ap.add_argument("--json", default=None)
    ap.add_argument("--time-budget-s", type=float, default=420.0, help="start no section after this")
    return ap


def main() -> None:
    args = build_parser().parse_args()

    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "args": vars(args)}  # fmt: skip
    start = time.perf_counter()
    for name in args.sections:
        if time.perf_counter() - start > args.time_budget_s:
            results[name] = {"error": "skipped: out of time budget"}
            continue
        _section(results, name, lambda n=name: SECTIONS[n](args))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)
    print_table(f"siesta on {results['device']}", ["measure", "value", "against"], summary(results))


if __name__ == "__main__":
    main()
