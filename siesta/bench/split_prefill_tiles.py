"""The resume's extend through the split prefill kernel: tile shapes and split counts.

    python -m siesta.bench.split_prefill_tiles [--json PATH] [--candidates 128x128w8s3,64x64w4s3,...]
                                               [--splits 8,16,32,64]

A kept resume runs each request's tail (44 tokens over a 19,456-token cached prefix, Llama-3-8B
heads) through ``prefill_split_kernel`` plus its per-token merge: 2.7-2.8 ms of an 11.9 ms step
over an fp8 cache on an H100 (run 55a), where reading the prefix's K/V once takes ~0.4. Its tile
is the prefill table's, sized for long causal prefills. This times that call (kernel and merge)
for each candidate tile and split count, over an fp8 and a bf16 cache, inside a CUDA graph that
cycles through enough copies of the prefix (one a layer of the cache) that every call reads HBM,
as a step's 32 layers do. Each row: us a call, the prefix's K/V bytes over that time, the error
against the shipped tile's output, and the time over the shipped tile's.

``--smoke`` runs a small case through Triton's interpreter on the CPU
(``TRITON_INTERPRET=1 python -m siesta.bench.split_prefill_tiles --smoke --device cpu``).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from siesta import host_ints
from siesta.attention import triton_tiles as tiling
from siesta.attention.base import AttentionMetadata, KVCache
from siesta.attention.triton_attention import TritonAttention, prefill_block_q
from siesta.bench.common import machine, print_table, write_json
from siesta.bench.kernel_timing import candidates_cli, time_call, weight_copies

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B
PREFIX, EXTEND = 19_456, 44
PAGE = 128
CALLS_PER_GRAPH = 8
SPLITS = (8, 16, 32, 64)
CANDIDATES = "128x128w8s3,128x64w8s3,128x64w4s2,64x128w4s2,64x64w4s3,64x64w4s2,64x32w4s2,256x64w8s2"
SMOKE = {"prefix": 200, "extend": 9, "page": 16, "heads": 4, "kv_heads": 2, "head_dim": 32, "splits": (2,),
         "candidates": "16x16w4s1"}  # fmt: skip


def parse_candidate(text: str) -> tiling.Tiles:
    """``128x64w8s3``: query rows (tokens x heads in a group), keys a step, warps, stages."""
    m = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)", text)
    if m is None:
        raise ValueError(f"a tile is BLOCK_MxBLOCK_NwWARPSsSTAGES, e.g. 128x64w8s3, got {text!r}")
    return tiling.Tiles(*(int(g) for g in m.groups()))


def _case(dtype: torch.dtype, copies: int, device: torch.device, shape: dict[str, Any]):
    """q of the extend, a cache of ``copies`` layers holding the same-shaped random prefix, and
    the step's metadata (one request: prefix then extend)."""
    gen = torch.Generator().manual_seed(0)
    seq = shape["prefix"] + shape["extend"]
    blocks = host_ints.cdiv(seq, shape["page"])
    cache = KVCache.allocate(blocks, copies, shape["page"], shape["kv_heads"], shape["head_dim"], dtype, device)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=gen).to(dtype))
    q = torch.randn(shape["extend"], shape["heads"], shape["head_dim"], generator=gen).to(torch.bfloat16).to(device)
    starts = [0, shape["extend"]]
    meta = AttentionMetadata(
        torch.tensor(starts, dtype=torch.int32, device=device), torch.tensor([seq], dtype=torch.int32, device=device),
        torch.randperm(blocks, generator=gen).to(torch.int32).view(1, blocks).to(device),
        torch.full((shape["extend"],), -1, dtype=torch.int64, device=device), shape["extend"], seq, starts, [seq],
    )  # fmt: skip
    return q, cache, meta


def _time(dtype: torch.dtype, tiles: tiling.Tiles | None, splits: int, device: torch.device, shape: dict[str, Any],
          smoke: bool) -> tuple[float, torch.Tensor, int]:  # fmt: skip
    kv_bytes = 2 * (shape["prefix"] + shape["extend"]) * shape["kv_heads"] * shape["head_dim"] * dtype.itemsize
    copies = 2 if smoke else weight_copies(kv_bytes, device)
    q, cache, meta = _case(dtype, copies, device, shape)
    backend = TritonAttention()
    out = torch.empty_like(q)
    scale = shape["head_dim"] ** -0.5

    def call(i: int) -> None:
        k_cache, v_cache = cache.layer(i)
        backend.split_prefill(q, k_cache, v_cache, meta, scale, out, splits, tiles=tiles)

    us = time_call(call, copies, device, CALLS_PER_GRAPH)
    call(0)
    return us, out.clone(), kv_bytes


def run(device: torch.device, smoke: bool = False, candidates: list[tiling.Tiles] | None = None,
        splits: tuple[int, ...] = SPLITS) -> dict[str, Any]:  # fmt: skip
    shape = dict(SMOKE if smoke else {"prefix": PREFIX, "extend": EXTEND, "page": PAGE, "heads": HEADS,
                                      "kv_heads": KV_HEADS, "head_dim": HEAD_DIM})  # fmt: skip
    if smoke:
        splits = SMOKE["splits"]
    if candidates is None:
        candidates = [parse_candidate(c) for c in (SMOKE["candidates"] if smoke else CANDIDATES).split(",")]
    group = shape["heads"] // shape["kv_heads"]
    shipped_tiles = tiling.prefill_tiles(shape["head_dim"], torch.bfloat16)
    shipped_splits = tiling.choose_prefill_splits(
        [shape["extend"]], [shape["prefix"] + shape["extend"]],
        prefill_block_q(shape["head_dim"], group, torch.bfloat16), shape["kv_heads"], tiling.device_sm_count(device))
    res: dict[str, Any] = {"machine": machine(), "shape": shape, "shipped": {"tiles": _label(shipped_tiles),
                           "splits": shipped_splits}, "dtypes": {}}  # fmt: skip
    for name, dtype in (("fp8", torch.float8_e4m3fn), ("bf16", torch.bfloat16)):
        if smoke and name == "bf16":
            dtype = torch.float32  # the interpreter's CPU has no bf16 dots to speak of
        base_us, base_out, kv_bytes = _time(dtype, None, shipped_splits, device, shape, smoke)
        rows = [{"tiles": "shipped", "splits": shipped_splits, "us": base_us, "GB_s": kv_bytes / base_us / 1e3,
                 "rel_err": 0.0, "over_shipped": 1.0}]  # fmt: skip
        for tiles in candidates:
            for n in splits:
                try:
                    us, out, _ = _time(dtype, tiles, n, device, shape, smoke)
                except Exception as exc:  # noqa: BLE001 - a tile that does not compile or fit is a result too
                    rows.append({"tiles": _label(tiles), "splits": n, "error": f"{type(exc).__name__}: {exc}"[:200]})
                    continue
                err = ((out.float() - base_out.float()).norm() / base_out.float().norm()).item()
                rows.append({"tiles": _label(tiles), "splits": n, "us": us, "GB_s": kv_bytes / us / 1e3,
                             "rel_err": err, "over_shipped": us / base_us})  # fmt: skip
        ok = [r for r in rows if "us" in r and r["rel_err"] < 1e-2]
        res["dtypes"][name] = {"kv_bytes": kv_bytes, "rows": rows, "best": min(ok, key=lambda r: r["us"])}
    return res


def _label(tiles: tiling.Tiles) -> str:
    return f"{tiles.block_m}x{tiles.block_n}w{tiles.num_warps}s{tiles.num_stages}"


def main() -> None:
    args, res = candidates_cli(__doc__, "a small case under Triton's interpreter, to check the script runs",
                               parse_candidate, "tiles to time (BLOCK_MxBLOCK_NwWARPSsSTAGES, comma-separated)",
                               run)  # fmt: skip
    for name, d in res["dtypes"].items():
        rows = [[r["tiles"], r["splits"], r.get("us", r.get("error")), r.get("GB_s", ""), r.get("rel_err", ""),
                 r.get("over_shipped", "")] for r in d["rows"]]  # fmt: skip
        print_table(f"split prefill, {name} cache: {res['shape']['extend']} tokens over {res['shape']['prefix']}",
                    ["tiles", "splits", "us a call", "GB/s", "rel err", "over shipped"], rows)  # fmt: skip
        print(f"best: {d['best']['tiles']} x {d['best']['splits']} splits, {d['best']['over_shipped']:.2f}x shipped")
    write_json(args.json, res)


if __name__ == "__main__":
    main()
