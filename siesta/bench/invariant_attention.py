"""Deterministic mode's decode rows against the prefill tile they must equal, bit for bit.

    python -m siesta.bench.invariant_attention [--json PATH] [--device cuda] [--smoke]
                                               [--candidates 16w4s2,64w4s2,...]

In deterministic mode a one-token row must have the bits it would have inside a prompt chunk,
where the unified kernel's prefill tile (128 query rows on Hopper for 128-wide heads) computes
it. Sending decode rows through that tile costs up to 32 rows of products for every 4 useful
ones. ``BatchInvariantTritonAttention`` gives them the decode kernel instead, unsplit, with the
prefill tile's key step and a narrower row tile (``triton_tiles.INVARIANT_DECODE_TILES``): the
bits must still be the prefill tile's, which this checks on the card.

Per head shape, KV dtype and (batch, context): the µs of the default mode's split-KV decode,
of the prefill tile (the reference), of the shipped narrow tile and of each ``--candidates``
tile (rows ``w`` warps ``s`` stages, the key step always the prefill tile's), and whether each
gives the reference's bits. Times are one call inside a CUDA graph, median of replays.

``--smoke`` runs a tiny fp32 case through Triton's interpreter on the CPU, only to check that the
script runs end to end.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from siesta.attention import triton_kernels as kernels
from siesta.attention import triton_tiles as tiling
from siesta.attention.base import AttentionMetadata
from siesta.attention.triton_attention import TritonAttention
from siesta.bench import kernel_ir
from siesta.bench.common import print_table, write_json
from siesta.bench.kernel_timing import candidates_cli, time_call

PAGE = 16
# (model, head_dim, query heads per KV head, KV heads)
HEADS = (("llama-3-8b", 128, 4, 8), ("qwen2.5-7b", 128, 7, 4), ("qwen3-30b-a3b", 128, 8, 4), ("smollm2", 64, 3, 3))
# (batch, context): deterministic section's decode steps, and a long context.
CASES = ((1, 512), (64, 512), (256, 512), (64, 8192))
KV_DTYPES = ("bfloat16", "float8_e4m3fn")
SMOKE = (("tiny", 32, 2, 2),), ((3, 40),), ("float32",)
CALLS_PER_GRAPH = 10
FP8_SCALE = 0.05


@dataclass
class Row:
    heads: str
    kv_dtype: str
    batch: int
    context: int
    split_us: float  # the default mode's decode
    prefill_tile_us: float  # deterministic mode's reference: the decode row in the prefill tile
    shipped: dict
    shipped_us: float
    shipped_bits_equal: bool
    candidates: list[dict]


def parse_candidate(text: str) -> tiling.Tiles:
    """``16w4s2``: rows, warps, stages (the key step is filled in per head size)."""
    rows, rest = text.split("w")
    warps, stages = rest.split("s")
    return tiling.Tiles(block_m=int(rows), block_n=0, num_warps=int(warps), num_stages=int(stages))


def decode_inputs(batch: int, context: int, head_dim: int, group: int, kv_heads: int, kv_dtype: torch.dtype,
            q_dtype: torch.dtype, device: torch.device):  # fmt: skip
    blocks = -(-context // PAGE)
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (batch * blocks, PAGE, kv_heads, head_dim)
    k, v = (torch.randn(shape, generator=gen, device=device) for _ in range(2))
    if kv_dtype.itemsize == 1:
        k, v = (k / FP8_SCALE / 8).to(kv_dtype), (v / FP8_SCALE / 8).to(kv_dtype)
    else:
        k, v = k.to(kv_dtype), v.to(kv_dtype)
    table = torch.randperm(batch * blocks, generator=gen, device=device).view(batch, blocks).to(torch.int32)
    q = torch.randn(batch, kv_heads * group, head_dim, generator=gen, device=device).to(q_dtype)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        block_tables=table, slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device=device),
        max_query_len=1, max_seq_len=context, query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[context] * batch,
    )  # fmt: skip
    return q, k, v, meta


def measure(heads: tuple, kv_name: str, batch: int, context: int, candidates: list[tiling.Tiles],
            device: torch.device) -> Row:  # fmt: skip
    name, head_dim, group, kv_heads = heads
    kv_dtype = getattr(torch, kv_name)
    q_dtype = torch.float32 if kv_dtype == torch.float32 else torch.bfloat16
    q, k, v, meta = decode_inputs(batch, context, head_dim, group, kv_heads, kv_dtype, q_dtype, device)
    scale, scales = head_dim**-0.5, ((FP8_SCALE, FP8_SCALE) if kv_dtype.itemsize == 1 else (1.0, 1.0))
    backend = TritonAttention()
    compute = q_dtype if kv_dtype.itemsize == 1 else kv_dtype
    prefill_n = tiling.prefill_tiles(head_dim, compute).block_n
    shipped = tiling.invariant_decode_tiles(head_dim, compute, batch * kv_heads, tiling.device_sm_count(device),
                                            kv_dtype.itemsize == 1)
    outs = {key: torch.empty_like(q) for key in ("split", "ref", "shipped", "try")}

    def split(_: int) -> None:
        backend.decode(q, k, v, meta, scale, outs["split"], scales=scales)

    def ref(_: int) -> None:
        backend.unified(q, k, v, meta, scale, outs["ref"], decode_as_prefill=True, scales=scales)

    def narrow(tiles: tiling.Tiles, out: torch.Tensor):
        return lambda _: backend.decode(q, k, v, meta, scale, out, num_splits=1, scales=scales, tiles=tiles)

    times = {key: time_call(fn, 1, device, CALLS_PER_GRAPH)
             for key, fn in (("split", split), ("ref", ref), ("shipped", narrow(shipped, outs["shipped"])))}  # fmt: skip
    tried = []
    for cand in candidates:
        tiles = replace(cand, block_n=prefill_n)
        us = time_call(narrow(tiles, outs["try"]), 1, device, CALLS_PER_GRAPH)
        tried.append({"tiles": asdict(tiles), "us": us, "bits_equal": torch.equal(outs["try"], outs["ref"])})
    return Row(name, kv_name, batch, context, times["split"], times["ref"], asdict(shipped), times["shipped"],
               torch.equal(outs["shipped"], outs["ref"]), tried)  # fmt: skip


def run(device: torch.device, smoke: bool = False, candidates: list[tiling.Tiles] | None = None,
        ir_path: str | None = None) -> dict:  # fmt: skip
    """The cases, and what the two kernels compiled to (``kernel_ir``; their TTGIR to ``ir_path``)."""
    heads, cases, kv_dtypes = SMOKE if smoke else (HEADS, CASES, KV_DTYPES)
    rows = []
    for h in heads:
        for kv in kv_dtypes:
            for batch, context in cases:
                row = measure(h, kv, batch, context, candidates or [], device)
                print(f"  {h[0]} {kv} b{batch} ctx {context}: split {row.split_us:.1f} us, prefill tile "
                      f"{row.prefill_tile_us:.1f}, narrow {row.shipped_us:.1f} (bits equal: {row.shipped_bits_equal})"
                      + "".join(f"; {c['tiles']['block_m']}w{c['tiles']['num_warps']}s{c['tiles']['num_stages']} "
                                f"{c['us']:.1f}{'' if c['bits_equal'] else ' (other bits)'}" for c in row.candidates))  # fmt: skip
                rows.append(row)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    launched = {"unified_kernel": kernels.unified_kernel, "decode_split_kernel": kernels.decode_split_kernel}
    compiled = kernel_ir.dump(launched, ir_path)
    return {"device": device_name, "rows": [asdict(r) for r in rows],
            "all_shipped_bits_equal": all(r.shipped_bits_equal for r in rows), "compiled": compiled}  # fmt: skip


def summary_rows(res: dict) -> list[list]:
    """Per head shape: the narrow tile's time over the prefill tile's, at the batch with the most
    rows, and whether every case had the reference's bits."""
    rows = []
    for heads in dict.fromkeys(r["heads"] for r in res["rows"]):
        cells = [r for r in res["rows"] if r["heads"] == heads]
        big = max(cells, key=lambda r: (r["batch"], -r["context"]))
        rows.append([f"deterministic decode rows / prefill tile, {heads} (b{big['batch']}, {big['context']})",
                     f"{big['shipped_us'] / big['prefill_tile_us']:.2f}",
                     f"split-KV {big['split_us'] / big['prefill_tile_us']:.2f}; "
                     f"bits equal: {all(c['shipped_bits_equal'] for c in cells)}"])  # fmt: skip
    return rows


def main() -> None:
    args, res = candidates_cli(__doc__, "a tiny fp32 case: checks the script runs", parse_candidate,
                               "other row tiles to try, e.g. 16w4s3,64w4s2", run)  # fmt: skip
    print_table(
        f"Deterministic decode rows: narrow tile against the prefill tile, {res['device']}",
        ["heads", "kv", "batch", "context", "split us", "prefill tile us", "narrow us", "narrow / tile", "bits equal"],
        [[r["heads"], r["kv_dtype"], r["batch"], r["context"], r["split_us"], r["prefill_tile_us"], r["shipped_us"],
          r["shipped_us"] / r["prefill_tile_us"], r["shipped_bits_equal"]] for r in res["rows"]],
    )  # fmt: skip
    write_json(args.json, res)


if __name__ == "__main__":
    main()
