"""The ``moe`` section of ``siesta.bench.gpu``: a mixture-of-experts model (Qwen3-30B-A3B's shape,
random weights, bf16) as the dense sections measure the 8B.

- decode tok/s at batch 1 / 16 / 64 / 256 against the roofline of the bytes a step must read:
  the weights every token uses (attention, norms, routers, the head; the embedding's rows only),
  the experts the batch touches (top-k of E per token and layer; with E experts routed uniformly
  a batch of b touches E * (1 - (1 - k/E)^b) a layer: the expectation, which random weights'
  near-uniform routing follows), and the KV the batch attends to;
- prefill at 8k: MFU over the active parameters (the dense part and k of E experts a token);
- fidelity: the engine against a transformers trainer (its default init, pushed) per position
  bucket in units of the trainer's own bf16 floor, on a cut of the shape to ``--moe-check-layers``
  layers (transformers in fp32 holds the whole 30B in 122 GB); the router's top-k agreement;
- knobs: decode A/B of the step's kernel choices on the shared engine (``moe_knobs``);
- sorted_small_batches: decode at batch 1 (and 2) again on an engine whose experts always sort,
  against the per-pair kernels that serve those batches;
- library_prefill: the prefill again with its experts on torch's grouped GEMM (``grouped_mm_moe``);
- resume: the seed's experiment (kept tier against cleared) on this model;
- weight push: CUDA IPC from a trainer process (``weight_transfer``), GB/s against a device copy;
  where the weights do not fit twice on the card, of the shape cut to the layers that do.
"""

from __future__ import annotations

import argparse
import functools
import math
import tempfile
import time
from dataclasses import asdict
from typing import Any

import torch

from siesta.bench.common import cut_model, log_part, release_memory, run_part
from siesta.bench.flops import EXPERT_PARAMS, mfu, prefill_flops
from siesta.bench.steps import (
    PROFILE_TOP_KERNELS,
    BatchDoesNotFit,
    decode_step_s,
    device_kernels,
    engine_step_kernels,
    hbm_bytes_per_s,
    host_calls,
    sync,
)

PUSH_COPIES = 2  # the IPC push holds the trainer's weights and the engine's on one card
# Beside the two copies: the engine's KV cache (4 GiB, the push bench's default), its CUDA graphs and
# workspaces, two CUDA contexts, and the transient buckets of the packed arm.
PUSH_HEADROOM_BYTES = 12 << 30
BF16_BYTES = 2
# The prefill_tiles part's prompts: seeds past the shipped run's (40 to 44).
PREFILL_TILES_SEED = 100
# The PDL A/B alternates its arms this many times (off, on, off, on): the machine's drift shows.
PDL_AB_ROUNDS = 2
PDL_AB_MAX_BATCH = 64


def expected_experts_touched(batch: int, num_experts: int, top_k: int) -> float:
    """Distinct experts a layer reads for ``batch`` tokens routed uniformly, top_k each."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def _model_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the experts (all), of the embedding table, and of everything else."""
    out = {"experts": 0, "embedding": 0, "dense": 0}
    for name, p in model.named_parameters():
        key = "experts" if name.endswith(EXPERT_PARAMS) else "embedding" if "embed_tokens" in name else "dense"
        out[key] += p.numel() * p.element_size()
    return out


def decode(llm, batches: list[int], context: int, steps: int) -> dict[str, Any]:
    model = llm.engine.runner.model
    shape = model.shape
    sizes = _model_bytes(model)
    hidden = shape.hidden_size
    # A dense model (the knobs part's dense A/B) reads no experts.
    sparse_layers, experts = len(getattr(shape, "sparse_layers", ())), getattr(shape, "num_experts", 0)
    per_expert = sizes["experts"] // (sparse_layers * experts) if experts else 0
    kv_per_token = llm.engine.runner.kv_cache.block_bytes // llm.config.cache.block_size
    bandwidth = hbm_bytes_per_s()
    res: dict[str, Any] = {"bytes": sizes, "bytes_per_expert": per_expert, "hbm_bytes_per_s": bandwidth}
    for b in batches:
        try:
            dt = decode_step_s(llm, b, context, steps)
        except BatchDoesNotFit as e:
            res[f"batch{b}"] = {"skipped": str(e)}
            continue
        touched = expected_experts_touched(b, experts, shape.top_k) if experts else 0.0
        step_bytes = (sizes["dense"] + b * hidden * 2 + sparse_layers * touched * per_expert
                      + b * context * kv_per_token)  # fmt: skip
        floor = step_bytes / bandwidth
        res[f"batch{b}"] = {"step_ms": dt * 1e3, "tok_s": b / dt, "experts_touched_per_layer": touched,
                            "step_bytes": step_bytes, "roofline_ms": floor * 1e3, "of_roofline": floor / dt}  # fmt: skip
    return res


def prefill(llm, n: int, reps: int = 3, seed: int = 40) -> dict[str, Any]:
    """An ``n``-token prompt prefilled whole, ``reps`` times (the last timed), then once under the
    profiler and once under the host-call counter: each a prompt of its own from ``seed`` on, so
    no run hits the prefix cache another left behind."""
    from siesta import SamplingParams
    from siesta.bench.common import random_prompts

    model = llm.engine.runner.model
    dt = float("nan")
    hits_before = llm.get_metrics()["siesta_prefix_cache_hits_total"]
    for rep in range(reps):  # the first run compiles
        prompt = random_prompts(1, n, n, llm.engine.vocab_size, seed=seed + rep)[0]
        sync()
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)
        sync()
        dt = time.perf_counter() - t0
    flops = prefill_flops(model, n)
    # The output head over every row, as runs before 65 counted it (they also counted the last
    # layer's tail there, 1 % more: ``flops``'s docstring).
    head_every_row = flops + 2 * model.shape.vocab_size * model.shape.hidden_size * (n - 1)
    # Where the prefill's time goes (the MFU goal is 60 %): one more run under the profiler.
    prompt = random_prompts(1, n, n, llm.engine.vocab_size, seed=seed + reps)[0]
    idle: dict[str, float] = {}
    busy_ms, launches, top = device_kernels(
        lambda: llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False),
        top=PROFILE_TOP_KERNELS, idle=idle)  # fmt: skip
    # And where its host time goes: the step runs eagerly (past the piecewise graphs' buckets).
    prompt = random_prompts(1, n, n, llm.engine.vocab_size, seed=seed + reps + 1)[0]
    host = host_calls(lambda: llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1),
                                           use_tqdm=False), top=PROFILE_TOP_KERNELS)  # fmt: skip
    hits = llm.get_metrics()["siesta_prefix_cache_hits_total"] - hits_before
    return {"tokens": n, "s": dt, "tok_s": n / dt, "flops": flops, "mfu": mfu(flops, dt),
            "mfu_head_every_row": mfu(head_every_row, dt),
            "prefix_cache_hit_tokens": int(hits),
            "kernels": {"device_busy_ms": busy_ms, "launches": launches, "top_kernels_ms": top, "idle_before_ms": idle},
            "host": host}  # fmt: skip


def fidelity(shape_name: str, layers: int, long_len: int, device: str) -> dict[str, Any]:
    from siesta.bench import fidelity as oracle
    from siesta.model.random_init import RANDOM_SHAPES

    config = RANDOM_SHAPES[shape_name].config()
    config.num_hidden_layers = layers
    return oracle.run_shape(f"{shape_name}[{layers} layers]", config, device=device, long_len=long_len, batch=1,
                            engine_dtype="bfloat16", kv_cache_bytes=8 << 30, routing=True)  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The section: ``args`` are the GPU bench's (``--moe-model`` and ``--moe-*`` flags)."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out: dict[str, Any] = {"model": args.moe_model}
    base = {"dtype": "bfloat16", "max_model_len": args.max_model_len, "device": args.device, "max_num_seqs": 256}
    _engine_parts(args, base, out)
    release_memory()  # the engine is gone with the call's frame: the parts below need its memory
    for name, step in (("sorted_small_batches", lambda: _sorted_small_batches(args, base, out["decode"])),
                       ("fidelity", lambda: fidelity(args.moe_check_shape, args.moe_check_layers,
                                                      args.moe_check_tokens, device)),
                       ("library_prefill", lambda: _library_prefill(args, base, out["prefill"])),
                       ("resume", lambda: _resume(args)),
                       ("weight_transfer", lambda: _push(args))):  # fmt: skip
        if name in args.moe_parts:
            run_part(out, "moe", name, step)
    return out


def _engine_parts(args: argparse.Namespace, base: dict[str, Any], out: dict[str, Any]) -> None:
    """The parts that share one engine. In a frame of their own, so that no partial or local outlives
    the engine: a ``del llm`` beside a live partial left 66 GiB held, and the parts after ran out of
    memory on an H100."""
    from siesta import LLM

    llm = LLM(args.moe_model, **base, gpu_memory_utilization=0.85, max_num_batched_tokens=args.moe_prefill_tokens)
    out["decode"] = decode(llm, args.decode_batches, args.decode_context, args.decode_steps)
    log_part("moe", "decode", out["decode"])
    for batch in args.moe_profile_batches:
        run_part(out, "moe", f"kernels_batch{batch}", functools.partial(_step_kernels, llm, batch, args.decode_context))
    out["prefill"] = prefill(llm, args.moe_prefill_tokens)
    log_part("moe", "prefill", out["prefill"])
    if args.moe_prefill_tiles:
        tiles = functools.partial(_prefill_tiles, llm, args.moe_prefill_tokens, args.moe_prefill_tiles, out["prefill"])
        run_part(out, "moe", "prefill_tiles", tiles)
    batches = [b for b in args.decode_batches if b <= PDL_AB_MAX_BATCH]  # where launches weigh
    if "pdl" in args.moe_parts:
        run_part(out, "moe", "pdl", functools.partial(pdl_ab, llm, batches, args.decode_context, args.decode_steps))
    if "knobs" in args.moe_parts:
        from siesta.bench import moe_knobs

        knobs = functools.partial(moe_knobs.run, llm, batches, args.decode_context, args.decode_steps,
                                  candidates=moe_knobs.CANDIDATES)  # fmt: skip
        run_part(out, "moe", "knobs", knobs)


def pdl_ab(llm, batches: list[int], context: int, steps: int, rounds: int = PDL_AB_ROUNDS) -> dict[str, Any]:
    """Decode with programmatic dependent launch off and on (``siesta/pdl.py``), alternated on
    one engine whose decode graphs are recaptured at each switch: per batch, each arm's best step
    and off / on. The engine's own setting is restored after."""
    from siesta import pdl

    runner = llm.engine.runner
    steps_ms: dict[str, dict[str, list[float]]] = {}
    try:
        for _ in range(rounds):
            for arm in ("off", "on"):
                pdl.set_enabled(arm == "on")
                runner.recapture_graphs(decode_only=True)
                res = decode(llm, batches, context, steps)
                for b in batches:
                    if "step_ms" in res[f"batch{b}"]:
                        steps_ms.setdefault(f"batch{b}", {}).setdefault(arm, []).append(res[f"batch{b}"]["step_ms"])
    finally:
        pdl.set_enabled(llm.config.programmatic_dependent_launch)
        runner.recapture_graphs(decode_only=True)
    out: dict[str, Any] = {"supported": pdl.supported(runner.device), "rounds": rounds}
    for key, arms in steps_ms.items():
        best = {arm: min(ms) for arm, ms in arms.items()}
        out[key] = {"step_ms": arms, "best_off_ms": best["off"], "best_on_ms": best["on"],
                    "off_over_on": best["off"] / best["on"]}  # fmt: skip
    return out


def _sorted_small_batches(args: argparse.Namespace, base: dict[str, Any], pairs: dict[str, Any]) -> dict[str, Any]:
    """The same decode at the batches the per-pair kernels serve, on an engine whose experts always
    sort (its graphs are captured that way): the A/B of ``triton_moe.PAIR_PATH_MAX_TOKENS``."""
    from siesta import LLM
    from siesta.model import triton_moe

    batches = [b for b in args.decode_batches if b <= triton_moe.PAIR_PATH_MAX_TOKENS] or [1]
    saved = triton_moe.PAIR_PATH_MAX_TOKENS
    triton_moe.PAIR_PATH_MAX_TOKENS = 0
    try:
        llm = LLM(args.moe_model, **base, gpu_memory_utilization=0.85, max_num_batched_tokens=args.moe_prefill_tokens)
        out = decode(llm, batches, args.decode_context, args.decode_steps)
        del llm
    finally:
        triton_moe.PAIR_PATH_MAX_TOKENS = saved
    for b in batches:
        with_pairs = pairs.get(f"batch{b}", {}).get("tok_s")
        if with_pairs:
            out[f"batch{b}"]["pair_kernels_speedup"] = with_pairs / out[f"batch{b}"]["tok_s"]
    return out


def _library_prefill(args: argparse.Namespace, base: dict[str, Any], fused: dict[str, Any]) -> dict[str, Any]:
    """The same prefill on an engine whose large steps run the experts on torch's grouped GEMM
    (``triton_moe.LIBRARY_MIN_PAIRS``): the A/B of the fused kernels against the library's."""
    from siesta import LLM
    from siesta.model import triton_moe

    saved = triton_moe.LIBRARY_MIN_PAIRS
    llm = LLM(args.moe_model, **base, gpu_memory_utilization=0.85, max_num_batched_tokens=args.moe_prefill_tokens)
    try:
        # Set after the engine captured its graphs, for the timed step's size: those stay fused.
        triton_moe.LIBRARY_MIN_PAIRS = args.moe_prefill_tokens * llm.engine.runner.model.shape.top_k
        out = prefill(llm, args.moe_prefill_tokens)
        del llm
    finally:
        triton_moe.LIBRARY_MIN_PAIRS = saved
        release_memory()
    out["speedup_over_fused"] = out["tok_s"] / fused["tok_s"]
    return out


def _expert_kernel_ms(res: dict[str, Any]) -> dict[str, float]:
    top = res["kernels"]["top_kernels_ms"]
    return {name: sum(ms for kernel, ms in top.items() if kernel.startswith(f"_{name}_kernel"))
            for name in ("gate_up", "down")}  # fmt: skip


def _prefill_tiles(llm, n: int, candidates: str, shipped: dict[str, Any]) -> dict[str, Any]:
    """The same prefill on the same engine with other large-prefill expert tiles (the A/B of
    ``triton_moe.LARGE_PREFILL_TILES``, in ``moe_tiles``' syntax): tok/s, MFU and each expert
    GEMM's device time. The step runs eagerly, so it takes the tiles in force when it runs."""
    from siesta.bench.moe_tiles import parse_candidate, tile_label
    from siesta.model import triton_moe

    saved = triton_moe.LARGE_PREFILL_TILES
    out: dict[str, Any] = {"shipped": tile_label(asdict(saved)), "shipped_kernels_ms": _expert_kernel_ms(shipped)}
    try:
        for i, text in enumerate(candidates.split(",")):
            triton_moe.LARGE_PREFILL_TILES = parse_candidate(text)
            try:  # prompts of its own: the shipped run's would hit the prefix cache (a 16-token step)
                res = prefill(llm, n, seed=PREFILL_TILES_SEED + 10 * i)
            except Exception as e:  # noqa: BLE001 - a tile the card cannot hold is a result too
                out[text] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                continue
            out[text] = {"tok_s": res["tok_s"], "mfu": res["mfu"], "over_shipped": res["tok_s"] / shipped["tok_s"],
                         "prefix_cache_hit_tokens": res["prefix_cache_hit_tokens"],
                         "kernels_ms": _expert_kernel_ms(res), "device_busy_ms": res["kernels"]["device_busy_ms"]}  # fmt: skip
    finally:
        triton_moe.LARGE_PREFILL_TILES = saved
    return out


def _step_kernels(llm, batch: int, context: int) -> dict[str, Any]:
    """A decode step's kernels (launches, busy time, the costliest): where the step's time goes
    beside the bytes the roofline counts."""
    return engine_step_kernels(llm, batch, context)


def _resume(args: argparse.Namespace) -> dict[str, Any]:
    from siesta.bench.gpu import resume

    return resume(argparse.Namespace(**(vars(args) | {"model": args.moe_model, "resume_variants": False})))


def _push(args: argparse.Namespace) -> dict[str, Any]:
    """The IPC push. The card holds the trainer's weights and the engine's at once: 122 GB for
    the 30B shape, past an H100's 80. Where the whole model does not fit twice, the push is of
    the shape cut to the layers that do (random weights; every layer's tensors the whole
    model's), said in ``cut``: its GB/s against a device copy of the same tensors is the rate
    the goal asks for, over fewer bytes."""
    from siesta.bench.weight_transfer import weight_transfer

    with tempfile.TemporaryDirectory(prefix="siesta-push-cut-") as folder:
        model, cut = args.moe_model, None
        if torch.cuda.is_available():
            model, cut = push_model(args.moe_model, torch.cuda.get_device_properties(0).total_memory, folder)
        res = weight_transfer(argparse.Namespace(**(vars(args) | {"model": model, "wt_skip_nccl": True})))
    return res | ({"cut": cut} if cut else {})


def push_model(model: str, card_bytes: int, folder: str) -> tuple[str, dict[str, Any] | None]:
    """``model`` where its weights fit ``PUSH_COPIES`` times on a card of ``card_bytes`` beside
    the engine's headroom; else ``random:<folder>``, its config cut to the layers that fit
    (written into ``folder``), and what was cut."""
    from siesta.model.loader import resolve_model

    config = resolve_model(model).hf_config
    per_layer, rest = layer_bytes(config)
    total = config.num_hidden_layers
    fit = int(((card_bytes - PUSH_HEADROOM_BYTES) / PUSH_COPIES - rest) // per_layer)
    if fit >= total:
        return model, None
    if fit < 1:
        raise ValueError(f"not one layer of {model} fits {PUSH_COPIES} times on this card's {card_bytes / 1e9:.0f} GB")
    cut = {"layers": fit, "of_layers": total, "whole_model_bytes": rest + total * per_layer,
           "why": f"the whole model's weights ({PUSH_COPIES} x {(rest + total * per_layer) / 1e9:.0f} GB) do not fit "
                  f"this card's {card_bytes / 1e9:.0f} GB beside the engine's {PUSH_HEADROOM_BYTES / 2**30:.0f} GiB"}  # fmt: skip
    return cut_model(model, fit, folder), cut


def layer_bytes(config: Any) -> tuple[int, int]:
    """bf16 bytes of one decoder layer's tensors, and of the rest (embedding, head, final norm)."""
    from siesta.model.random_init import parameter_layout

    per_layer, rest = 0, 0
    for name, shape in parameter_layout(config):
        nbytes = math.prod(shape) * BF16_BYTES
        if ".layers.0." in name:
            per_layer += nbytes
        elif ".layers." not in name:
            rest += nbytes
    return per_layer, rest


def summary_rows(res: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for key, cell in (res.get("decode") or {}).items():
        if key.startswith("batch") and "skipped" in cell:
            rows.append([f"MoE decode {key} tok/s", "-", f"skipped: {cell['skipped']}"])
        elif key.startswith("batch"):
            rows.append([f"MoE decode {key} tok/s", cell["tok_s"], f"{cell['of_roofline']:.0%} of the bytes-read roofline "
                         f"({cell['experts_touched_per_layer']:.0f} experts a layer)"])  # fmt: skip
    for key, cell in (res.get("sorted_small_batches") or {}).items():
        if key.startswith("batch") and "pair_kernels_speedup" in cell:
            rows.append([f"MoE decode {key}: pair kernels / sorted", cell["pair_kernels_speedup"],
                         f"sorted {cell['tok_s']:,.0f} tok/s"])  # fmt: skip
    for key, cell in (res.get("pdl") or {}).items():
        if key.startswith("batch"):
            rows.append([f"MoE decode {key}: step without PDL / with", cell["off_over_on"],
                         f"best of {len(cell['step_ms']['on'])}: {cell['best_off_ms']:.2f} / {cell['best_on_ms']:.2f} ms"])  # fmt: skip
    for shape, cell in ((res.get("knobs") or {}).get("gemv_sweep") or {}).get("shapes", {}).items():
        if cell["best_us"] and cell["default_us"]:
            rows.append([f"MoE one-row GEMV {shape}: default / best us", cell["default_us"] / cell["best_us"],
                         f"{cell['default_us']:.1f} / {cell['best_us']:.1f} (cuBLAS {cell['cublas_us']:.1f})"])  # fmt: skip
    for kernel in ("gate_up", "down_sum"):
        cell = ((res.get("knobs") or {}).get("pair_sweep") or {}).get(kernel) or {}
        if cell.get("best") and cell.get("shipped_us"):
            best = cell["best"]
            rows.append([f"MoE one-token {kernel} pair kernel: shipped / best us", cell["shipped_us"] / best["us"],
                         f"{cell['shipped_us']:.1f} / {best['us']:.1f} ({best['gbps']:,.0f} GB/s at {tuple(best['tiles'].values())})"])  # fmt: skip
    for key, cell in (res.get("knobs") or {}).items():
        if key.startswith("batch"):
            rows.extend([f"MoE decode {key}: knobs {name} / base", arm["base_over_arm"],
                         f"best of {len(arm['step_ms'])}: {arm['best_ms']:.2f} ms"]
                        for name, arm in cell.items() if name != "base")  # fmt: skip
    kernels = res.get("kernels_batch1") or {}
    if "launches" in kernels:
        rows.append(["MoE decode batch1 kernel launches a step", kernels["launches"],
                     f"device busy {kernels['device_busy_ms']:.2f} of {kernels['wall_ms']:.2f} ms"])  # fmt: skip
    if "prefill" in res:
        rows.append([f"MoE prefill {res['prefill']['tokens']} tok/s", res["prefill"]["tok_s"],
                     f"MFU {res['prefill']['mfu']:.0%} (goal >= 60%; counting the head on every row: "
                     f"{res['prefill'].get('mfu_head_every_row', float('nan')):.0%})"])  # fmt: skip
        kernels = res["prefill"].get("kernels") or {}
        if kernels.get("top_kernels_ms"):
            name, ms = next(iter(kernels["top_kernels_ms"].items()))
            rows.append([f"MoE prefill {res['prefill']['tokens']}: device busy ms", kernels["device_busy_ms"],
                         f"{kernels['launches']:,} launches; most by {name[:40]} ({ms:.1f} ms)"])  # fmt: skip
        host = res["prefill"].get("host") or {}
        if "wall_ms" in host:
            blocking = sum(count for count, _ in host["blocking_calls"].values())
            launched = sum(count for count, _ in host["launch_calls"].values())
            launch_ms = sum(ms for _, ms in host["launch_calls"].values())
            rows.append([f"MoE prefill {res['prefill']['tokens']}: host wall ms", host["wall_ms"],
                         f"{blocking:,} blocking calls; {launched:,} launches, {launch_ms:.1f} ms in them"])  # fmt: skip
    for text, cell in (res.get("prefill_tiles") or {}).items():
        if isinstance(cell, dict) and "over_shipped" in cell:
            ms = cell["kernels_ms"]
            rows.append([f"MoE prefill, tiles {text} / shipped", cell["over_shipped"],
                         f"MFU {cell['mfu']:.0%}; gate/up {ms['gate_up']:.1f} ms, down {ms['down']:.1f} ms"])  # fmt: skip
    lib = res.get("library_prefill") or {}
    if "speedup_over_fused" in lib:
        rows.append([f"MoE prefill {lib['tokens']}: grouped_mm / fused", lib["speedup_over_fused"],
                     f"{lib['tok_s']:,.0f} tok/s, MFU {lib['mfu']:.0%}"])  # fmt: skip
    fid = res.get("fidelity") or {}
    if "push_batch1" in fid:
        rows.append(["MoE logprobs / trainer's bf16 floor", fid["push_batch1"]["worst_ratio"], "goal <= 1.5"])
        route = fid["push_batch1"].get("routing")
        if route:
            rows.append(["MoE routing decisions beyond the floor", route["engine_beyond_floor"],
                         f"of {route['decisions']:,}: top-k sets unlike fp32's {route['engine_differs']} "
                         f"(transformers bf16 {route['trainer_bf16_differs']}); widest margin crossed "
                         f"{route['engine_widest_margin']:.1e} against bf16's {route['floor_margin']:.1e}"])  # fmt: skip
    if isinstance(res.get("resume"), dict) and "speedup_p50" in res["resume"]:
        rows.append(["MoE resume kept vs cleared (p50)", res["resume"]["speedup_p50"], ""])
    rows += _push_rows(res.get("weight_transfer"))
    return rows


def _push_rows(push: dict[str, Any] | None) -> list[list[Any]]:
    """The IPC push's rate against a device copy of the same tensors (goal 30 %), or why not."""
    if not push:
        return []
    if "skipped" in push or "error" in push:
        return [["MoE IPC push / device copy", "-", str(push.get("skipped") or push.get("error"))[:100]]]
    ipc, plain = push.get("ipc") or {}, push.get("plain_copy") or {}
    if "of_plain_copy" not in ipc:
        why = ipc.get("error") or ipc.get("skipped") or push.get("ipc_error") or "not measured"
        return [["MoE IPC push / device copy", "-", str(why)[:100]]]
    cut = push.get("cut")
    of = f" ({cut['layers']} of {cut['of_layers']} layers)" if cut else ""
    return [["MoE IPC push / device copy", ipc["of_plain_copy"],
             f"goal >= 0.3; {ipc['GB_s']:.0f} against {plain['GB_s']:.0f} GB/s, {push['bytes'] / 1e9:.0f} GB{of}"]]  # fmt: skip
