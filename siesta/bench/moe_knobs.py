"""The ``moe`` section's ``knobs`` part: a mixture-of-experts decode step under each of its kernel
choices, A/B on one engine.

    bench/gpu.sh --sections moe --moe-parts knobs
    bench/gpu.sh --sections moe --moe-parts knobs --moe-model random:llama-3-8b   # a dense model

On a dense model the choices it shares with the MoE (the GEMV table, the fused K/V write and
merge, the L2 prefetches) are A/B'd the same way; the expert arms change nothing there, and the
pair sweep is skipped.

Each arm is a set of module settings (``Knobs``). The decode graphs are captured again at every
switch (as ``moe.pdl_ab`` does), the arms run in turn ``rounds`` times (the machine's drift shows
as spread within an arm), and each arm's best step is set against the base arm's. H100 run 64b
timed each choice turned on alone and all together; they now ship, so most arms take one of
them back (``base_over_arm`` under 1: that choice helps on this card), the ``swept_`` arms try
this card's own sweep winners, and ``before`` takes them all back:

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
- ``swept_pairs``: the one- and two-token expert kernels (``triton_moe.GATE_UP_PAIR_TILES``,
  ``DOWN_SUM_TILES``) on this card's winners of a sweep of ``PAIR_CANDIDATES`` at one token over
  the model's own experts, one kernel's tiles varied at a time, run here first;
- ``qkv_norm``: one row's input norm folded into the q/k/v GEMV (``triton_gemv.FUSE_ADD_NORM``);
- ``route_fused``: one token's router logits and tail in one launch
  (``triton_router.FUSE_ONE_ROW``);
- ``down_split``: one and two tokens' down-and-sum split over each token's experts, the last
  to finish summing (``triton_moe.DOWN_SUM_SPLIT``);
- ``fused_merge``: split decode steps merged by the last split's program, not by the merge
  kernel's launch (``triton_attention.FUSE_DECODE_MERGE``);
- ``l2_o_proj``: each layer's o_proj prefetched into L2 during its attention (``l2_prefetch``,
  window ``o_proj``), at every batch timed;
- ``l2_both``: that, and the next layer's q/k/v prefetched after o_proj (window ``next_qkv``);
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
from siesta.bench.gemv import CANDIDATES, Shape, bench_shape, relative_error
from siesta.bench.kernel_timing import time_call, weight_copies
from siesta.model import l2_prefetch, triton_gemv, triton_moe, triton_ops, triton_router
from siesta.model.triton_gemv import GemvConfig
from siesta.model.triton_moe import PairTiles

ROUNDS = 2
# Pair-kernel tiles the sweep tries, (block_n, block_k, warps, stages), beside the shipped ones:
# more programs (8 features), longer reads (512), deeper pipelines, wider programs.
PAIR_CANDIDATES = tuple(PairTiles(*t) for t in (
    (8, 256, 4, 4), (8, 512, 4, 3), (16, 128, 4, 6), (16, 256, 4, 5), (16, 512, 4, 3), (16, 512, 8, 4),
    (32, 256, 8, 3), (32, 128, 4, 4), (16, 256, 2, 4), (8, 128, 2, 6)))  # fmt: skip
SMOKE_PAIR_CANDIDATES = (PairTiles(8, 64, 2, 2), PairTiles(16, 32, 4, 3))
# The prefetch arms prefetch at every decode batch the part times (the bench reads where it pays).
PREFETCH_ROWS = 256
WRONG_ABOVE = 1e-2  # max |diff| over max |out| against the shipped tiles: another reduction's rounding
# Each pair kernel's name in the sweep's record, and its tiles' name in ``triton_moe``.
PAIR_KERNELS = {"gate_up": "GATE_UP_PAIR_TILES", "down_sum": "DOWN_SUM_TILES"}
# The 2-D weights a one-row decode step sends through the GEMV, by the end of their names.
GEMV_WEIGHTS = ("qkv_proj.weight", "o_proj.weight", "gate.weight", "lm_head.weight", "gate_up_proj.weight",
                "down_proj.weight")  # fmt: skip


@dataclass(frozen=True)
class Knobs:
    """A decode step's kernel choices: each field a module setting (``SETTINGS`` says which), but
    ``gemv`` and ``pairs``, which name tables."""

    align_max_pairs: int
    route_warps: int
    qk_heads: int | None
    gemv: str = "shipped"  # ONE_ROW_SHAPES: "shipped", "swept" (this card's winners) or "none"
    kv_fused: bool = False
    pairs: str = "shipped"  # the pair kernels' tiles: "shipped" or "swept"
    merge_fused: bool = False
    down_split: bool = False
    route_fused: bool = False
    qkv_norm: bool = False
    prefetch_rows: int = 0
    prefetch_windows: tuple[str, ...] = l2_prefetch.WINDOWS


# Every choice as it was before H100 run 64b turned the winners on.
BEFORE = Knobs(align_max_pairs=0, route_warps=4, qk_heads=None, gemv="none", kv_fused=False)
# Each ``Knobs`` field that is a module setting as it stands, and that setting. (``gemv`` and
# ``pairs`` name tables instead: ``applied`` sets those.)
SETTINGS = {
    "align_max_pairs": (triton_moe, "ALIGN_KERNEL_MAX_PAIRS"),
    "route_warps": (triton_router, "ROUTE_NUM_WARPS"),
    "qk_heads": (triton_ops, "QK_NORM_Q_HEADS_PER_PROGRAM"),
    "kv_fused": (triton_attention, "FUSE_DECODE_KV_WRITE"),
    "merge_fused": (triton_attention, "FUSE_DECODE_MERGE"),
    "down_split": (triton_moe, "DOWN_SUM_SPLIT"),
    "route_fused": (triton_router, "FUSE_ONE_ROW"),
    "qkv_norm": (triton_gemv, "FUSE_ADD_NORM"),
    "prefetch_rows": (l2_prefetch, "MAX_ROWS"),
    "prefetch_windows": (l2_prefetch, "ENABLED"),
}


def shipped() -> Knobs:
    return Knobs(**{name: getattr(module, attr) for name, (module, attr) in SETTINGS.items()})


def arms(base: Knobs) -> dict[str, Knobs]:
    return {
        "base": base,
        "no_align": replace(base, align_max_pairs=BEFORE.align_max_pairs),
        "route4": replace(base, route_warps=BEFORE.route_warps),
        "qk_whole": replace(base, qk_heads=BEFORE.qk_heads),
        "no_gemv_table": replace(base, gemv="none"),
        "swept_gemv": replace(base, gemv="swept"),
        "kv_write": replace(base, kv_fused=BEFORE.kv_fused),
        "swept_pairs": replace(base, pairs="swept"),
        "qkv_norm": replace(base, qkv_norm=True),
        "route_fused": replace(base, route_fused=True),
        "down_split": replace(base, down_split=True),
        "fused_merge": replace(base, merge_fused=True),
        "l2_o_proj": replace(base, prefetch_rows=PREFETCH_ROWS, prefetch_windows=("o_proj",)),
        "l2_both": replace(base, prefetch_rows=PREFETCH_ROWS, prefetch_windows=("o_proj", "next_qkv")),
        "before": BEFORE,
    }


@contextlib.contextmanager
def applied(knobs: Knobs, tuned: dict[tuple[int, int], GemvConfig],
            pairs: tuple[PairTiles, PairTiles]) -> Iterator[None]:  # fmt: skip
    """The modules set to ``knobs`` (this card's GEMV winners ``tuned``, pair-kernel winners
    ``pairs``: gate/up's and down-and-sum's), restored after."""
    values = {SETTINGS[name]: getattr(knobs, name) for name in SETTINGS}
    tables = {"shipped": triton_gemv.ONE_ROW_SHAPES, "swept": dict(tuned), "none": {}}
    values[(triton_gemv, "ONE_ROW_SHAPES")] = tables[knobs.gemv]
    if knobs.pairs == "swept":
        values[(triton_moe, "GATE_UP_PAIR_TILES")], values[(triton_moe, "DOWN_SUM_TILES")] = pairs
    saved = {key: getattr(*key) for key in values}
    for (module, attr), value in values.items():
        setattr(module, attr, value)
    try:
        yield
    finally:
        for (module, attr), value in saved.items():
            setattr(module, attr, value)


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


def _experts(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every sparse layer's ``(gate_up [E, 2I, H], down [E, H, I])``, in layer order."""
    params = dict(model.named_parameters())
    return [(p, params[name.replace("gate_up_proj", "down_proj")]) for name, p in params.items()
            if name.endswith("experts.gate_up_proj")]  # fmt: skip


def pair_sweep(model: torch.nn.Module, candidates: tuple[PairTiles, ...] = PAIR_CANDIDATES,
               top_k: int | None = None) -> dict[str, Any]:  # fmt: skip
    """One token's experts (``_fused_moe_pairs``) under each candidate tile of one kernel, the
    other's shipped: µs and expert GB/s, over the model's own experts (call ``i`` routes to ``top_k``
    random experts of layer ``i``, so the cycle reads HBM). Each kernel's winner among the
    candidates whose output is the shipped tiles' (to another reduction's rounding)."""
    layers = _experts(model)
    if not layers:  # a dense model: the knobs part A/Bs its decode all the same
        return {"skipped": "the model has no experts"}
    gate_up, down = layers[0]
    experts, hidden = gate_up.shape[0], gate_up.shape[2]
    top_k = top_k or min(8, experts)
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randperm(experts, generator=gen)[:top_k].view(1, top_k).to(gate_up.device) for _ in layers]
    x = torch.randn((1, hidden), generator=gen).mul_(hidden**-0.5).to(gate_up.device, gate_up.dtype)
    weights = torch.full((1, top_k), 1.0 / top_k, device=gate_up.device, dtype=gate_up.dtype)
    expert_bytes = top_k * (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()

    def call(i: int) -> torch.Tensor:
        return triton_moe._fused_moe_pairs(x, weights, ids[i], *layers[i])

    ref = call(0)
    out: dict[str, Any] = {"expert_bytes": expert_bytes, "layers": len(layers)}
    for kernel, module_name in PAIR_KERNELS.items():
        shipped_tiles = getattr(triton_moe, module_name)
        rows = []
        for tiles in dict.fromkeys((shipped_tiles, *candidates)):
            setattr(triton_moe, module_name, tiles)
            row: dict[str, Any] = {"tiles": asdict(tiles)}
            try:
                got = call(0)
                row["rel_err"] = relative_error(got, ref)
                row["us"] = time_call(call, len(layers), x.device, len(layers))
                row["gbps"] = expert_bytes / row["us"] / 1e3
            except Exception as e:  # noqa: BLE001 - a tile that fails to compile (shared memory) is a result
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            finally:
                setattr(triton_moe, module_name, shipped_tiles)
            rows.append(row)
        good = [r for r in rows if "us" in r and r["rel_err"] <= WRONG_ABOVE]
        out[kernel] = {"rows": rows, "shipped_us": rows[0].get("us"),
                       "best": min(good, key=lambda r: r["us"]) if good else None}  # fmt: skip
    return out


def _pair_winners(swept: dict[str, Any]) -> tuple[PairTiles, PairTiles]:
    """(gate/up's, down-and-sum's) winners of ``pair_sweep``, the shipped tile where none ran."""
    return tuple(PairTiles(**swept[kernel]["best"]["tiles"]) if (swept.get(kernel) or {}).get("best")
                 else getattr(triton_moe, name) for kernel, name in PAIR_KERNELS.items())  # fmt: skip


def run(llm, batches: list[int], context: int, steps: int, rounds: int = ROUNDS,
        candidates: tuple[GemvConfig, ...] = CANDIDATES,
        pair_candidates: tuple[PairTiles, ...] = PAIR_CANDIDATES) -> dict[str, Any]:  # fmt: skip
    """Every arm's decode step at ``batches``, alternated ``rounds`` times on ``llm``; the
    shipped settings (and decode graphs) are back after."""
    from siesta.bench.moe import decode

    runner = llm.engine.runner
    # The sleep backup pins while the device is quiet, and pinning holds the driver's lock that
    # every launch waits for: done first, so no arm (nor the sweep) is timed beside it.
    llm.engine.memory.backup.settle()
    swept = sweep(runner.model, candidates)
    tuned = swept.pop("tuned")
    pairs_swept = pair_sweep(runner.model, pair_candidates, getattr(runner.model.shape, "top_k", None))
    pairs = _pair_winners(pairs_swept)
    knobs = arms(shipped())
    steps_ms: dict[str, dict[str, list[float]]] = {name: {} for name in knobs}
    errors: dict[str, str] = {}
    try:
        for _ in range(rounds):
            for name, arm in knobs.items():
                if name in errors:
                    continue
                try:
                    with applied(arm, tuned, pairs):
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
                           "pair_sweep": pairs_swept, "pairs": {"gate_up": asdict(pairs[0]), "down_sum": asdict(pairs[1])},
                           "arms": {name: asdict(arm) for name, arm in knobs.items()}, "rounds": rounds,
                           "errors": errors}  # fmt: skip
    for key, base in steps_ms["base"].items():
        best_base = min(base)
        out[key] = {name: {"step_ms": arm[key], "best_ms": min(arm[key]), "base_over_arm": best_base / min(arm[key])}
                    for name, arm in steps_ms.items() if key in arm}  # fmt: skip
    return out
