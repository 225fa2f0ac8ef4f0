"""The ``moe`` section's ``knobs`` part: a mixture-of-experts decode step under each of its kernel
choices, A/B on one engine.

    bench/gpu.sh --sections moe --moe-parts knobs

Each arm is a set of module settings (``Knobs``). The decode graphs are captured again at every
switch (as ``moe.pdl_ab`` does), the arms run in turn ``rounds`` times (the machine's drift shows
as spread within an arm), and each arm's best step is set against the base arm's. H100 run 64b
timed each choice turned on alone and all together; they now ship, so each arm but the last
takes one of them back (``base_over_arm`` under 1: that choice helps on this card):

- ``base``: what ships;
- ``no_align``: the pairs placed by torch's launches, not one Triton program (``triton_align``,
  ``triton_moe.ALIGN_KERNEL_MAX_PAIRS``);
- ``route4``: the router's tail on 4 warps, not 1 (``triton_router.ROUTE_NUM_WARPS``);
- ``qk_whole``: ``qk_norm_rope``'s q heads in one program, not 8 a program
  (``triton_ops.QK_NORM_Q_HEADS_PER_PROGRAM``);
- ``no_gemv_table``: no per-matrix one-row GEMV configs (``triton_gemv.ONE_ROW_SHAPES``);
- ``swept_gemv``: that table replaced by this card's winners of a sweep of ``bench.gemv``'s
  candidates over the model's dense matrices, run here first;
- ``kv_write``: decode steps' K/V stored by the write kernel, not by the split attention kernel
  (``triton_attention.FUSE_DECODE_KV_WRITE``);
- ``down8``: the one- and two-token down-and-sum kernel on 8-feature tiles, twice the programs
  (``triton_moe.DOWN_SUM_BLOCK_N``; no gain in run 64b);
- ``before``: every choice as before run 64b.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from siesta.attention import triton_attention
from siesta.bench.gemv import CANDIDATES, Shape, bench_shape
from siesta.bench.kernel_timing import weight_copies
from siesta.model import triton_gemv, triton_moe, triton_ops, triton_router
from siesta.model.triton_gemv import GemvConfig

ROUNDS = 2
DOWN8 = 8  # the ``down8`` arm's down-and-sum feature tile
# The 2-D weights a one-row decode step sends through the GEMV, by the end of their names.
GEMV_WEIGHTS = ("qkv_proj.weight", "o_proj.weight", "gate.weight", "lm_head.weight", "gate_up_proj.weight",
                "down_proj.weight")  # fmt: skip


@dataclass(frozen=True)
class Knobs:
    align_max_pairs: int
    route_warps: int
    qk_heads: int | None
    gemv: str = "shipped"  # ONE_ROW_SHAPES: "shipped", "swept" (this card's winners) or "none"
    kv_fused: bool = False
    down_block_n: int = triton_moe.PAIR_BLOCK_N


# Every choice as it was before H100 run 64b turned the winners on.
BEFORE = Knobs(align_max_pairs=0, route_warps=4, qk_heads=None, gemv="none", kv_fused=False,
               down_block_n=triton_moe.PAIR_BLOCK_N)  # fmt: skip


def shipped() -> Knobs:
    return Knobs(triton_moe.ALIGN_KERNEL_MAX_PAIRS, triton_router.ROUTE_NUM_WARPS,
                 triton_ops.QK_NORM_Q_HEADS_PER_PROGRAM, gemv="shipped",
                 kv_fused=triton_attention.FUSE_DECODE_KV_WRITE, down_block_n=triton_moe.DOWN_SUM_BLOCK_N)  # fmt: skip


def arms(base: Knobs) -> dict[str, Knobs]:
    return {
        "base": base,
        "no_align": replace(base, align_max_pairs=BEFORE.align_max_pairs),
        "route4": replace(base, route_warps=BEFORE.route_warps),
        "qk_whole": replace(base, qk_heads=BEFORE.qk_heads),
        "no_gemv_table": replace(base, gemv="none"),
        "swept_gemv": replace(base, gemv="swept"),
        "kv_write": replace(base, kv_fused=BEFORE.kv_fused),
        "down8": replace(base, down_block_n=DOWN8),
        "before": BEFORE,
    }


@contextlib.contextmanager
def applied(knobs: Knobs, tuned: dict[tuple[int, int], GemvConfig]) -> Iterator[None]:
    """The modules set to ``knobs`` (tuned GEMV configs from ``tuned``), restored after."""
    saved = (triton_moe.ALIGN_KERNEL_MAX_PAIRS, triton_router.ROUTE_NUM_WARPS, triton_ops.QK_NORM_Q_HEADS_PER_PROGRAM,
             triton_gemv.ONE_ROW_SHAPES, triton_attention.FUSE_DECODE_KV_WRITE, triton_moe.DOWN_SUM_BLOCK_N)  # fmt: skip
    triton_moe.ALIGN_KERNEL_MAX_PAIRS = knobs.align_max_pairs
    triton_router.ROUTE_NUM_WARPS = knobs.route_warps
    triton_ops.QK_NORM_Q_HEADS_PER_PROGRAM = knobs.qk_heads
    triton_gemv.ONE_ROW_SHAPES = {"shipped": saved[3], "swept": dict(tuned), "none": {}}[knobs.gemv]
    triton_attention.FUSE_DECODE_KV_WRITE = knobs.kv_fused
    triton_moe.DOWN_SUM_BLOCK_N = knobs.down_block_n
    try:
        yield
    finally:
        (triton_moe.ALIGN_KERNEL_MAX_PAIRS, triton_router.ROUTE_NUM_WARPS, triton_ops.QK_NORM_Q_HEADS_PER_PROGRAM,
         triton_gemv.ONE_ROW_SHAPES, triton_attention.FUSE_DECODE_KV_WRITE, triton_moe.DOWN_SUM_BLOCK_N) = saved  # fmt: skip


def gemv_shapes(model: torch.nn.Module) -> list[Shape]:
    """The model's distinct dense matrices a one-row step multiplies, each with its count."""
    counts: dict[tuple[int, int], list[str]] = {}
    for name, p in model.named_parameters():
        if p.dim() == 2 and name.endswith(GEMV_WEIGHTS):
            counts.setdefault(tuple(p.shape), []).append(name.rsplit(".", 2)[-2])
    return [Shape(names[0], n, k, len(names)) for (n, k), names in counts.items()]


def sweep(model: torch.nn.Module, candidates: tuple[GemvConfig, ...] = CANDIDATES) -> dict[str, Any]:
    """``bench.gemv``'s sweep at one row over the model's dense matrices, in its dtype and on its
    device: each matrix's times and its winner."""
    weight = next(p for name, p in model.named_parameters() if name.endswith(GEMV_WEIGHTS))
    out: dict[str, Any] = {"shapes": {}, "tuned": {}}
    for shape in gemv_shapes(model):
        nbytes = shape.n * shape.k * weight.element_size()
        weights = [torch.randn((shape.n, shape.k), device=weight.device).mul_(shape.k**-0.5).to(weight.dtype)
                   for _ in range(weight_copies(nbytes, weight.device))]  # fmt: skip
        r = bench_shape(shape, 1, weights, candidates, weight.dtype)
        del weights
        out["shapes"][f"{shape.name} {shape.n}x{shape.k}"] = {
            "per_step": shape.per_step, "cublas_us": r.cublas.us, "default_us": r.default.us if r.default else None,
            "best_us": r.best.us if r.best else None, "best": r.best.config if r.best else None,
        }  # fmt: skip
        if r.best is not None:
            out["tuned"][(shape.n, shape.k)] = GemvConfig(**r.best.config)
    return out


def run(llm, batches: list[int], context: int, steps: int, rounds: int = ROUNDS,
        candidates: tuple[GemvConfig, ...] = CANDIDATES) -> dict[str, Any]:  # fmt: skip
    """Every arm's decode step at ``batches``, alternated ``rounds`` times on ``llm``; the
    shipped settings (and decode graphs) are back after."""
    from siesta.bench.moe import decode

    runner = llm.engine.runner
    # The sleep backup pins while the device is quiet, and pinning holds the driver's lock that
    # every launch waits for: done first, so no arm (nor the sweep) is timed beside it.
    llm.engine.memory.backup.settle()
    swept = sweep(runner.model, candidates)
    tuned = swept.pop("tuned")
    knobs = arms(shipped())
    steps_ms: dict[str, dict[str, list[float]]] = {name: {} for name in knobs}
    errors: dict[str, str] = {}
    try:
        for _ in range(rounds):
            for name, arm in knobs.items():
                if name in errors:
                    continue
                try:
                    with applied(arm, tuned):
                        runner.recapture_graphs(decode_only=True)
                        res = decode(llm, batches, context, steps)
                except Exception as e:  # noqa: BLE001 - one arm's failure is reported, the others still run
                    errors[name] = f"{type(e).__name__}: {e} at {traceback.format_tb(e.__traceback__)[-1].strip()}"
                    continue
                for b in batches:
                    if "step_ms" in res[f"batch{b}"]:
                        steps_ms[name].setdefault(f"batch{b}", []).append(res[f"batch{b}"]["step_ms"])
    finally:
        runner.recapture_graphs(decode_only=True)
    out: dict[str, Any] = {"gemv_sweep": swept, "tuned": {f"{n}x{k}": asdict(c) for (n, k), c in tuned.items()},
                           "arms": {name: asdict(arm) for name, arm in knobs.items()}, "rounds": rounds,
                           "errors": errors}  # fmt: skip
    for key, base in steps_ms["base"].items():
        best_base = min(base)
        out[key] = {name: {"step_ms": arm[key], "best_ms": min(arm[key]), "base_over_arm": best_base / min(arm[key])}
                    for name, arm in steps_ms.items() if key in arm}  # fmt: skip
    return out
