"""The fused-MoE kernels' tiles on the card: the shipped ones against candidates, per step size.

    python -m siesta.bench.moe_tiles [--json PATH] [--device cuda] [--smoke]
                                     [--candidates 128x128x64w8s4,64x256x64w8s3,...]

The MoE prefill's MFU (issue 38's goal: 60 %) is mostly its two grouped GEMMs (H100 run 50h,
8k tokens of Qwen3-30B-A3B: gate/up 50 ms and down 33 ms of 173 ms of device time, ~400 and
~300 TFLOP/s). Their tiles (``triton_moe.DECODE_TILES``, ``PREFILL_TILES``,
``LARGE_PREFILL_TILES``) come from this sweep (H100 runs 51a-b: the 128-row tile from 128 pairs
an expert, 0.87x the 64-row tile's time at 8k tokens; prefill 8k then read MFU 46 %). Here ``fused_moe`` runs on that model's expert shape with uniform random
routing at each step size, once with the tiles the engine picks (``tiles_for``) and once per
``--candidates`` tile (``BLOCK_Mx BLOCK_Nx BLOCK_K w warps s stages``), inside a CUDA graph (median
of replays); each candidate's output is checked against the shipped one's (bf16 rounding apart).

``--smoke`` runs a tiny fp32 shape through Triton's interpreter on the CPU, only to check that the
script runs end to end.
"""

from __future__ import annotations

import re
from dataclasses import asdict

import torch

from siesta.bench.common import print_table, write_json
from siesta.bench.kernel_timing import candidates_cli, time_call
from siesta.model import triton_moe
from siesta.model.triton_moe import MoeTiles

# (name, experts, hidden, intermediate, top k): Qwen3-30B-A3B's experts.
SHAPE = ("qwen3-30b-a3b", 128, 2048, 768, 8)
TOKENS = (16, 64, 256, 2048, 8192)  # decode batches, a piecewise bucket, the 8k prefill
SMOKE_SHAPE = ("tiny", 8, 64, 32, 2)
SMOKE_TOKENS = (3, 40)
# Against the shipped tile (TMA loads; the down GEMM persistent on 256-wide feature tiles, 3
# stages): the same tile loaded by pointers (what TMA replaced, run 60a); the 128-wide down
# tile; persistent launches of both GEMMs; run 51b's runner-up.
CANDIDATES = "128x128x64w8s4d:256s3,128x128x64w8s4dt,128x128x64w8s4pt:256s3,64x256x64w8s3t"
CALLS_PER_GRAPH = 4
TOLERANCE = 2e-2  # max |diff| over max |out|: two bf16 tilings' rounding, not a wrong product
_CANDIDATE = re.compile(r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)([pd]?)(t?)(?::(\d+)s(\d+))?")


def parse_candidate(text: str) -> MoeTiles:
    """``128x128x64w8s4``: rows, features, reduction chunk, warps, stages; a trailing ``p``
    launches both GEMMs persistent (``MoeTiles.persistent``), ``d`` the down GEMM alone; ``t``
    loads by TMA descriptors (``MoeTiles.tma``); then ``:256s3`` gives the down GEMM its own
    feature tile and stages."""
    match = _CANDIDATE.fullmatch(text.strip())
    if match is None:
        raise ValueError("a tile is BLOCK_MxBLOCK_NxBLOCK_KwWARPSsSTAGES[p|d][t][:DOWN_NsDOWN_STAGES], "
                         f"e.g. 128x128x64w8s4dt:256s3, got {text!r}")  # fmt: skip
    m, n, k, warps, stages = (int(g) for g in match.groups()[:5])
    down_n, down_stages = (int(g) if g else None for g in match.groups()[7:])
    return MoeTiles(block_m=m, block_n=n, block_k=k, num_warps=warps, num_stages=stages,
                    persistent=match.group(6) == "p", persistent_down=match.group(6) == "d",
                    down_block_n=down_n, down_num_stages=down_stages, tma=match.group(7) == "t")  # fmt: skip


def _inputs(tokens: int, experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype, device: torch.device):
    g = torch.Generator(device="cpu").manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices.to(device)
    weights = torch.rand(tokens, top_k, generator=g).softmax(-1).to(device, dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(device, dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * inter**-0.5).to(device, dtype)
    return x, weights, ids, gate_up, down


def measure(tokens: int, shape: tuple, candidates: list[MoeTiles], device: torch.device) -> dict:
    name, experts, hidden, inter, top_k = shape
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x, weights, ids, gate_up, down = _inputs(tokens, experts, hidden, inter, top_k, dtype, device)
    flops = 2 * tokens * top_k * 3 * hidden * inter
    shipped = triton_moe.tiles_for(tokens * top_k, experts)
    outs: dict[str, torch.Tensor] = {}

    def timed(key: str, tiles: MoeTiles) -> float:
        def call(_: int) -> None:
            outs[key] = triton_moe.fused_moe(x, weights, ids, gate_up, down, tiles=tiles)

        return time_call(call, 1, device, CALLS_PER_GRAPH)

    shipped_us = timed("shipped", shipped)
    ref = outs["shipped"].float()
    scale = ref.abs().max().item() or 1.0
    tried = []
    for cand in candidates:
        try:
            us = timed("try", cand)
        except Exception as e:  # noqa: BLE001 - a tile the card cannot hold (shared memory) is a result too
            tried.append({"tiles": asdict(cand), "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        diff = (outs["try"].float() - ref).abs().max().item() / scale
        tried.append({"tiles": asdict(cand), "us": us, "tflops": flops / us / 1e6, "over_shipped": us / shipped_us,
                      "max_rel_diff": diff, "agrees": diff <= TOLERANCE})  # fmt: skip
    ok = [c for c in tried if c.get("agrees")]
    best = min(ok, key=lambda c: c["us"]) if ok else None
    return {"shape": name, "tokens": tokens, "pairs": tokens * top_k, "shipped": asdict(shipped),
            "shipped_us": shipped_us, "shipped_tflops": flops / shipped_us / 1e6, "candidates": tried,
            "best": best}  # fmt: skip


def run(device: torch.device, smoke: bool = False, candidates: list[MoeTiles] | None = None) -> dict:
    shape, token_counts = (SMOKE_SHAPE, SMOKE_TOKENS) if smoke else (SHAPE, TOKENS)
    if candidates is None:
        candidates = [parse_candidate(c) for c in CANDIDATES.split(",")]
    rows = []
    for tokens in token_counts:
        row = measure(tokens, shape, candidates, device)
        best = row["best"]
        found = f"; best {best['tiles']} {best['us']:.1f} us ({best['over_shipped']:.2f}x)" if best else ""
        print(f"  {row['shape']} {tokens} tokens: shipped {row['shipped_us']:.1f} us "
              f"({row['shipped_tflops']:.0f} TFLOP/s){found}")  # fmt: skip
        rows.append(row)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    return {"device": device_name, "rows": rows}


def tile_label(tiles: dict) -> str:
    """``parse_candidate``'s syntax for a tile set's dict."""
    down_n, down_stages = tiles.get("down_block_n"), tiles.get("down_num_stages")
    return (f"{tiles['block_m']}x{tiles['block_n']}x{tiles['block_k']}w{tiles['num_warps']}s{tiles['num_stages']}"
            + ("p" if tiles.get("persistent") else "d" if tiles.get("persistent_down") else "")
            + ("t" if tiles.get("tma") else "")
            + (f":{down_n or tiles['block_n']}s{down_stages or tiles['num_stages']}" if down_n or down_stages else ""))  # fmt: skip


def summary_rows(res: dict) -> list[list]:
    rows = []
    for r in res["rows"]:
        best = r["best"]
        tiles = best["tiles"] if best else None
        label = tile_label(tiles) if tiles else "none agreed"
        rows.append([f"MoE tiles, {r['tokens']} tokens: best candidate / shipped",
                     best["over_shipped"] if best else "-",
                     f"shipped {r['shipped_tflops']:.0f} TFLOP/s; best {label}"])  # fmt: skip
    return rows


def main() -> None:
    args, res = candidates_cli(__doc__, "a tiny fp32 shape: checks the script runs", parse_candidate,
                               f"tiles to try (default {CANDIDATES})", run)  # fmt: skip
    print_table(f"Fused-MoE tiles, {res['device']}",
                ["tokens", "shipped us", "shipped TFLOP/s", "best us", "best / shipped"],
                [[r["tokens"], r["shipped_us"], r["shipped_tflops"], r["best"]["us"] if r["best"] else "-",
                  r["best"]["over_shipped"] if r["best"] else "-"] for r in res["rows"]])  # fmt: skip
    write_json(args.json, res)


if __name__ == "__main__":
    main()
