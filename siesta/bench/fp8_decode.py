"""The default mode's split-KV decode over an fp8 cache against bf16, per decode tile.

    python -m siesta.bench.fp8_decode [--json PATH] [--device cuda] [--smoke]
                                      [--candidates 128w4s3,128w8s3,64w4s4,...]

An fp8 cache holds half the bytes a token, so its decode should take about half bf16's time,
at the same GB/s. It does not yet: on an H100 fp8 read ~1.9 TB/s where bf16 read 3.0 (runs
49c, 51g), and 1.5-2.1 TB/s on 128-key steps (run 51h: 0.72-0.84x bf16's time). Per (batch,
context) of Llama-3-8B's heads: the µs and KV GB/s of bf16 on its tiles, of fp8 on the tiles the
engine ships (``triton_tiles.decode_tiles``), and of fp8 on each ``--candidates`` tile (keys a
step ``w`` warps ``s`` stages; 16 query-head rows, as the shipped tile). Each candidate's output
is checked against the shipped tile's (the key step changes only the softmax's rounding); the bf16
cache runs the candidates too (``half_candidates``). Times
are one call inside a CUDA graph, median of replays, the split count the engine's.

``--smoke`` runs a tiny case through Triton's interpreter on the CPU, only to check that the
script runs end to end.
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from siesta.attention import triton_kernels as kernels
from siesta.attention import triton_tiles as tiling
from siesta.attention.triton_attention import TritonAttention
from siesta.bench import kernel_ir
from siesta.bench.common import print_table, write_json
from siesta.bench.invariant_attention import FP8_SCALE, decode_inputs
from siesta.bench.kernel_timing import candidates_cli, time_call

# (head_dim, query heads per KV head, KV heads): Llama-3-8B.
HEADS = (128, 4, 8)
# (batch, context): a long single request, the seed's resume (16 x 19.5k), issue 39's b64 at 8k,
# and a wide short batch.
CASES = ((1, 32768), (16, 19500), (64, 8192), (256, 512))
SMOKE_HEADS = (32, 2, 2)
SMOKE_CASES = ((3, 40),)
CALLS_PER_GRAPH = 10
TOLERANCE = 2e-2  # max |diff| over max |out|: another key step's rounding, not a wrong sum


def parse_candidate(text: str) -> tiling.Tiles:
    """``128w4s3``: keys a step, warps, stages (16 query-head rows)."""
    keys, rest = text.split("w")
    warps, stages = rest.split("s")
    return tiling.Tiles(block_m=tiling.MIN_DOT_DIM, block_n=int(keys), num_warps=int(warps), num_stages=int(stages))


def _kv_bytes(batch: int, context: int, heads: tuple, kv_dtype: torch.dtype) -> int:
    head_dim, _, kv_heads = heads
    return 2 * batch * context * kv_heads * head_dim * kv_dtype.itemsize


def measure(batch: int, context: int, heads: tuple, q_dtype: torch.dtype, candidates: list[tiling.Tiles],
            device: torch.device) -> dict:  # fmt: skip
    head_dim, group, kv_heads = heads
    backend = TritonAttention()
    row: dict = {"batch": batch, "context": context}
    outs = {}
    for kv_dtype in (q_dtype, torch.float8_e4m3fn):
        q, k, v, meta = decode_inputs(batch, context, head_dim, group, kv_heads, kv_dtype, q_dtype, device)
        scales = (FP8_SCALE, FP8_SCALE) if kv_dtype.itemsize == 1 else (1.0, 1.0)

        def call(tiles: tiling.Tiles | None, out: torch.Tensor):
            return lambda _: backend.decode(q, k, v, meta, head_dim**-0.5, out, scales=scales, tiles=tiles)

        name = "fp8" if kv_dtype.itemsize == 1 else "half"
        outs[name] = torch.empty_like(q)
        us = time_call(call(None, outs[name]), 1, device, CALLS_PER_GRAPH)
        row[name] = {"tiles": asdict(tiling.decode_tiles(head_dim, q_dtype, kv_dtype.itemsize == 1)), "us": us,
                     "gbps": _kv_bytes(batch, context, heads, kv_dtype) / us / 1e3}  # fmt: skip
        # Both caches try every candidate: a change to the kernel's loop (its pipelining) moves both.
        row["candidates" if name == "fp8" else "half_candidates"] = candidate_rows = []
        for tiles in candidates:
            out = torch.empty_like(q)
            us = time_call(call(tiles, out), 1, device, CALLS_PER_GRAPH)
            diff = ((out.float() - outs[name].float()).abs().max() / outs[name].float().abs().max()).item()
            candidate_rows.append({"tiles": asdict(tiles), "us": us, "agrees": diff <= TOLERANCE,
                                   "gbps": _kv_bytes(batch, context, heads, kv_dtype) / us / 1e3})  # fmt: skip
    row["fp8_over_half"] = row["fp8"]["us"] / row["half"]["us"]
    return row


def run(device: torch.device, smoke: bool = False, candidates: list[tiling.Tiles] | None = None,
        ir_path: str | None = None) -> dict:  # fmt: skip
    """The cases, and what the decode kernel compiled to (``kernel_ir``; its TTGIR to ``ir_path``)."""
    heads, cases = (SMOKE_HEADS, SMOKE_CASES) if smoke else (HEADS, CASES)
    q_dtype = torch.float32 if smoke else torch.bfloat16
    rows = []
    for batch, context in cases:
        row = measure(batch, context, heads, q_dtype, candidates or [], device)
        for name, key in (("half", "half_candidates"), ("fp8", "candidates")):
            print(f"  b{batch} ctx {context}: {name} {row[name]['us']:.1f} us"
                  + "".join(f"; {_label(c['tiles'])} {c['us']:.1f}" for c in row[key]))  # fmt: skip
        rows.append(row)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    compiled = kernel_ir.dump({"decode_split_kernel": kernels.decode_split_kernel}, ir_path)
    return {"device": device_name, "heads": heads, "rows": rows, "compiled": compiled}


def summary_rows(res: dict) -> list[list]:
    """Per case: fp8's decode time over bf16's (half the bytes: 0.5 at the same GB/s)."""
    return [[f"fp8 KV decode / bf16, b{r['batch']} ctx {r['context']}", f"{r['fp8_over_half']:.2f}",
             f"0.5 at equal GB/s; fp8 {r['fp8']['gbps']:,.0f} GB/s, bf16 {r['half']['gbps']:,.0f}"]
            for r in res["rows"]]  # fmt: skip


def main() -> None:
    args, res = candidates_cli(__doc__, "a tiny case: checks the script runs", parse_candidate,
                               "other decode tiles to try over fp8, e.g. 128w4s3,128w8s3", run)  # fmt: skip
    print_table(
        f"Split-KV decode, fp8 cache against bf16, {res['device']}",
        ["batch", "context", "bf16 us", "bf16 GB/s", "fp8 us", "fp8 GB/s", "fp8 / bf16", "best candidate", "its us"],
        [[r["batch"], r["context"], r["half"]["us"], r["half"]["gbps"], r["fp8"]["us"], r["fp8"]["gbps"],
          r["fp8_over_half"], *_best(r)] for r in res["rows"]],
    )  # fmt: skip
    write_json(args.json, res)


def _best(row: dict) -> list:
    agreeing = [c for c in row["candidates"] if c["agrees"]]
    if not agreeing:
        return ["-", "-"]
    best = min(agreeing, key=lambda c: c["us"])
    return [_label(best["tiles"]), best["us"]]


def _label(tiles: dict) -> str:
    return f"{tiles['block_n']}w{tiles['num_warps']}s{tiles['num_stages']}"


if __name__ == "__main__":
    main()
