"""GPU micro-benchmark of the Triton paged attention (run on CUDA).

    python -m siesta.bench.attention [--peak-gbps 4200] [--json out.json] [--sweep]

Llama-3-8B attention shape (32 query heads, 8 KV heads, head_dim 128), bf16, block
size 16, one layer. Times are ``triton.testing.do_bench`` medians (it flushes L2
between runs, so decode reads come from HBM).

* decode: batch x context grid, achieved GB/s of K/V read against ``--peak-gbps``;
* prefill: one 8,192-token causal sequence in TFLOP/s (the causal half counted) for
  the Triton kernel, the SDPA route ``TritonAttention`` takes (SDPA's GQA flag plus
  the output copy), SDPA alone with K/V expanded and with its GQA flag, and
  ``varlen_attn`` when torch has it; plus a length
  sweep that shows where ``SDPA_PREFILL_MIN_TOKENS`` should sit, a chunk with a
  cached prefix and a mixed batch;
* correctness: bf16 mixed batch against ``TorchAttention`` (relative error);
* ``--sweep``: alternative tile shapes for the prefill and decode kernels.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from siesta.attention import triton_attention as ta
from siesta.attention import triton_tiles as tiling
from siesta.attention.base import AttentionMetadata, KVCache
from siesta.attention.torch_ref import TorchAttention

Q_HEADS = 32
KV_HEADS = 8
HEAD_DIM = 128
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
DEFAULT_PEAK_GBPS = 4200.0
DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXTS = (1024, 4096, 8192, 16384, 32768)
PREFILL_TOKENS = 8192
PREFILL_SWEEP = (512, 1024, 2048, 4096, 8192)
# Chunked prefill: this many new tokens after as many cached ones.
CHUNK_TOKENS = 4096
# Mixed step: decode rows next to one prefill chunk.
MIXED_DECODES = 64
MIXED_DECODE_CONTEXT = 4096
MIXED_CHUNK = 2048
MIXED_CHUNK_PREFIX = 2048
LONG_DECODES = 4
LONG_DECODE_CONTEXT = 32768
SHORT_CHUNK = 512
# Correctness batch: (cached, new) per request; kept small for TorchAttention's padded decode.
CHECK_SPECS = [(0, 1), (517, 1), (3000, 1), (4095, 1), (0, 700), (1500, 300), (33, 2000)]
BF16_TOLERANCE = 2e-2
DEFAULT_MAX_KV_GIB = 40.0
WARMUP_MS = 25
REP_MS = 100
FLOPS_PER_MAC = 2
GIB = 1 << 30
TERA = 1e12
GIGA = 1e9
MS = 1e-3

# Alternative tiles for --sweep: (block_m, block_n, num_warps, num_stages).
PREFILL_SWEEP_TILES = [
    (128, 128, 8, 3),
    (128, 128, 8, 2),
    (128, 128, 8, 4),
    (128, 64, 8, 3),
    (128, 64, 4, 3),
    (256, 64, 8, 3),
    (256, 64, 8, 2),
    (256, 32, 8, 3),
]
DECODE_SWEEP_TILES = [(16, 64, 4, 3), (16, 64, 2, 3)]
HOST_OVERHEAD_CALLS = 200


@dataclass
class Results:
    device: str = ""
    peak_gbps: float = DEFAULT_PEAK_GBPS
    decode: list[dict] = field(default_factory=list)
    prefill: list[dict] = field(default_factory=list)
    prefill_sweep: list[dict] = field(default_factory=list)
    other: list[dict] = field(default_factory=list)
    correctness: dict = field(default_factory=dict)
    tile_sweep: list[dict] = field(default_factory=list)


def time_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def graph_time_ms(fn: Callable[[], object]) -> float:
    """Replays of a captured CUDA graph, as the engine runs decode (no L2 flush between replays)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=REP_MS, return_mode="median")


def make_meta(specs: list[tuple[int, int]], num_blocks: int, device: torch.device) -> AttentionMetadata:
    """Metadata for (cached, new) requests over randomly scattered blocks of a pool."""
    seq_lens = [c + n for c, n in specs]
    per_req = [-(-s // BLOCK_SIZE) for s in seq_lens]
    ids = torch.randperm(num_blocks, device=device)[: sum(per_req)].to(torch.int32)
    table = torch.zeros(len(specs), max(per_req), dtype=torch.int32, device=device)
    slots, start = [], 0
    for i, ((cached, new), n) in enumerate(zip(specs, per_req)):
        row = ids[start : start + n]
        table[i, :n] = row
        start += n
        pos = torch.arange(cached, cached + new, device=device)
        slots.append(row[pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
    starts = [0]
    for _, n in specs:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table,
        slot_mapping=torch.cat(slots),
        max_query_len=max(n for _, n in specs),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )


def random_cache(num_blocks: int, device: torch.device) -> KVCache:
    cache = KVCache.allocate(num_blocks, 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM, DTYPE, device)
    cache.tensor.normal_()  # never time zeros: they run faster than real data
    return cache


def qkv(num_tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(num_tokens, Q_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    k = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    v = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    return q, k, v


def causal_flops(new: int, cached: int = 0) -> float:
    """QK^T and PV over the visible (causal) pairs only."""
    pairs = new * cached + new * (new + 1) / 2
    return 2 * FLOPS_PER_MAC * pairs * HEAD_DIM * Q_HEADS


def kv_bytes(seq_lens: list[int]) -> int:
    return sum(seq_lens) * KV_HEADS * HEAD_DIM * 2 * torch.empty((), dtype=DTYPE).element_size()


def scale() -> float:
    return 1.0 / math.sqrt(HEAD_DIM)


# --------------------------------------------------------------------------- decode


def bench_decode(results: Results, device: torch.device, max_kv_gib: float) -> None:
    block_bytes = KVCache.bytes_per_block(1, BLOCK_SIZE, KV_HEADS, HEAD_DIM, DTYPE)
    budget_blocks = int(max_kv_gib * GIB // block_bytes)
    needed = max(b * c for b in DECODE_BATCHES for c in DECODE_CONTEXTS) // BLOCK_SIZE
    cache = random_cache(min(needed, budget_blocks), device)
    backend = ta.TritonAttention()
    k_cache, v_cache = cache.layer(0)
    for batch in DECODE_BATCHES:
        for ctx in DECODE_CONTEXTS:
            if batch * ctx // BLOCK_SIZE > cache.num_blocks:
                continue
            meta = make_meta([(ctx - 1, 1)] * batch, cache.num_blocks, device)
            q, _, _ = qkv(batch, device)
            out = torch.empty_like(q)
            splits = backend.num_splits(batch, meta.max_seq_len, KV_HEADS, device)
            run = functools.partial(backend.decode, q, k_cache, v_cache, meta, scale(), out)
            ms = time_ms(run)
            gbps = kv_bytes(meta.seq_lens_cpu) / (ms * MS) / GIGA
            results.decode.append(
                dict(batch=batch, context=ctx, splits=splits, ms=ms, gbps=gbps, pct_peak=100 * gbps / results.peak_gbps,
                     graph_ms=graph_time_ms(run))  # fmt: skip
            )
    del cache


# --------------------------------------------------------------------------- prefill


def _expanded(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).repeat_interleave(Q_HEADS // KV_HEADS, dim=0).unsqueeze(0)


def prefill_variants(tokens: int, device: torch.device) -> dict[str, Callable[[], object]]:
    """Ways to run one fresh causal prefill of ``tokens``: name -> zero-argument call."""
    cache = random_cache(-(-tokens // BLOCK_SIZE) + 1, device)
    meta = make_meta([(0, tokens)], cache.num_blocks, device)
    q, k, v = qkv(tokens, device)
    k_cache, v_cache = cache.layer(0)
    ta.write_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    triton_backend = ta.TritonAttention(sdpa_prefill_min_tokens=None)
    sdpa_backend = ta.TritonAttention(sdpa_prefill_min_tokens=1)
    qh, kh, vh = q.transpose(0, 1).unsqueeze(0), _expanded(k), _expanded(v)
    k_gqa, v_gqa = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    variants: dict[str, Callable[[], object]] = {
        "triton": lambda: triton_backend.unified(q, k_cache, v_cache, meta, scale(), out),
        "sdpa_route": lambda: sdpa_backend.sdpa_prefill(q, k, v, meta, scale(), out),
        "sdpa expanded (kernel only)": lambda: F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=scale()
        ),
        "sdpa enable_gqa (kernel only)": lambda: F.scaled_dot_product_attention(
            qh, k_gqa, v_gqa, is_causal=True, scale=scale(), enable_gqa=True
        ),
    }
    varlen = _varlen_variant(q, k, v, tokens, device)
    if varlen is not None:
        variants["varlen_attn"] = varlen
    return variants


def _varlen_variant(q, k, v, tokens: int, device: torch.device) -> Callable[[], object] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    group = Q_HEADS // KV_HEADS
    k_full = k.repeat_interleave(group, dim=1)
    v_full = v.repeat_interleave(group, dim=1)

    def run() -> object:
        return varlen_attn(q, k_full, v_full, cu, cu, tokens, tokens, scale=scale(), window_size=(-1, 0))

    try:
        run()
    except Exception as exc:  # an older torch without window_size, or no kernel for this GPU
        print(f"varlen_attn unavailable: {exc}")
        return None
    return run


def bench_prefill(results: Results, device: torch.device) -> None:
    flops = causal_flops(PREFILL_TOKENS)
    for name, fn in prefill_variants(PREFILL_TOKENS, device).items():
        ms = time_ms(fn)
        results.prefill.append(dict(variant=name, tokens=PREFILL_TOKENS, ms=ms, tflops=flops / (ms * MS) / TERA))
    for tokens in PREFILL_SWEEP:
        variants = prefill_variants(tokens, device)
        row = dict(tokens=tokens)
        for name in ("triton", "sdpa_route"):
            row[name] = causal_flops(tokens) / (time_ms(variants[name]) * MS) / TERA
        results.prefill_sweep.append(row)


def bench_chunk_and_mixed(results: Results, device: torch.device) -> None:
    backend = ta.TritonAttention()
    cases = {
        f"chunk {CHUNK_TOKENS} after {CHUNK_TOKENS} cached": [(CHUNK_TOKENS, CHUNK_TOKENS)],
        f"mixed {MIXED_DECODES} decodes@{MIXED_DECODE_CONTEXT} + chunk {MIXED_CHUNK}@{MIXED_CHUNK_PREFIX}": (
            [(MIXED_DECODE_CONTEXT - 1, 1)] * MIXED_DECODES + [(MIXED_CHUNK_PREFIX, MIXED_CHUNK)]
        ),
        # A few long decode rows next to a short chunk: mixed() sends them to the split kernel.
        f"mixed {LONG_DECODES} decodes@{LONG_DECODE_CONTEXT} + chunk {SHORT_CHUNK}": (
            [(LONG_DECODE_CONTEXT - 1, 1)] * LONG_DECODES + [(0, SHORT_CHUNK)]
        ),
    }
    for name, specs in cases.items():
        blocks = sum(-(-(c + n) // BLOCK_SIZE) for c, n in specs) + 1
        cache = random_cache(blocks, device)
        meta = make_meta(specs, cache.num_blocks, device)
        q, k, v = qkv(meta.query_start_loc_cpu[-1], device)
        k_cache, v_cache = cache.layer(0)
        ta.write_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        ms = time_ms(lambda: backend.mixed(q, k_cache, v_cache, meta, scale(), out))
        flops = sum(causal_flops(n, c) for c, n in specs)
        results.other.append(
            dict(case=name, ms=ms, tflops=flops / (ms * MS) / TERA, gbps=kv_bytes(meta.seq_lens_cpu) / (ms * MS) / GIGA)
        )


def host_overhead_us(fn: Callable[[], object]) -> float:
    """Host time per call of a tiny launch: what a step pays per layer without CUDA graphs."""
    import time

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(HOST_OVERHEAD_CALLS):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / HOST_OVERHEAD_CALLS / 1e-6


def bench_host_overhead(results: Results, device: torch.device) -> None:
    specs = [(100, 1), (0, 1)]
    cache = random_cache(32, device)
    meta = make_meta(specs, cache.num_blocks, device)
    q, k, v = qkv(len(specs), device)
    k_cache, v_cache = cache.layer(0)
    backend = ta.TritonAttention()
    out = torch.empty_like(q)
    calls = {
        "write_kv": lambda: ta.write_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping),
        "decode (split)": lambda: backend.decode(q, k_cache, v_cache, meta, scale(), out, num_splits=2),
        "decode (no split)": lambda: backend.decode(q, k_cache, v_cache, meta, scale(), out, num_splits=1),
        "unified": lambda: backend.unified(q, k_cache, v_cache, meta, scale(), out),
        "mixed (split decodes)": lambda: backend.mixed(q, k_cache, v_cache, meta, scale(), out),
        "forward (decode batch)": lambda: backend.forward(q, k, v, cache, 0, meta, scale(), out=out),
    }
    for name, fn in calls.items():
        results.other.append(dict(case=f"host overhead: {name}", us=host_overhead_us(fn)))


# --------------------------------------------------------------------------- correctness


def check_correctness(results: Results, device: torch.device) -> None:
    blocks = sum(-(-(c + n) // BLOCK_SIZE) for c, n in CHECK_SPECS) + 1
    cache = random_cache(blocks, device)
    meta = make_meta(CHECK_SPECS, cache.num_blocks, device)
    q, k, v = qkv(meta.query_start_loc_cpu[-1], device)
    reference_cache = KVCache(cache.tensor.clone())
    expected = TorchAttention().forward(q, k, v, reference_cache, 0, meta, scale())
    out = torch.full_like(q, float("nan"))
    ta.TritonAttention().forward(q, k, v, cache, 0, meta, scale(), out=out)
    err = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
    decode_meta = make_meta([(c + n - 1, 1) for c, n in CHECK_SPECS], cache.num_blocks, device)
    qd, _, _ = qkv(len(CHECK_SPECS), device)
    k_cache, v_cache = cache.layer(0)
    split_errs = {}
    for splits in (1, 4, 16):
        got = torch.full_like(qd, float("nan"))
        ta.TritonAttention().decode(qd, k_cache, v_cache, decode_meta, scale(), got, num_splits=splits)
        want = torch.empty_like(qd)
        TorchAttention()._decode(qd, cache, 0, decode_meta, scale(), list(range(len(CHECK_SPECS))), want)
        split_errs[splits] = ((got.float() - want.float()).norm() / want.float().norm()).item()
    results.correctness = dict(
        mixed_rel_err=err,
        all_written=not bool(out.isnan().any()),
        kv_cache_equal=bool(torch.equal(reference_cache.tensor, cache.tensor)),
        decode_split_rel_err=split_errs,
        tolerance=BF16_TOLERANCE,
        ok=err < BF16_TOLERANCE and max(split_errs.values()) < BF16_TOLERANCE and not bool(out.isnan().any()),
    )


# --------------------------------------------------------------------------- tile sweep


def sweep_tiles(results: Results, device: torch.device) -> None:
    """Time alternative tile shapes by swapping the entries of triton_tiles' tables."""
    saved_prefill, saved_decode = dict(tiling.PREFILL_TILES), dict(tiling.DECODE_TILES)
    variants = prefill_variants(PREFILL_TOKENS, device)
    try:
        for block_m, block_n, warps, stages in PREFILL_SWEEP_TILES:
            tiling.PREFILL_TILES[HEAD_DIM] = tiling.Tiles(block_m, block_n, warps, stages)
            ms = time_ms(variants["triton"])
            results.tile_sweep.append(
                dict(kernel="prefill", tiles=[block_m, block_n, warps, stages],
                     tflops=causal_flops(PREFILL_TOKENS) / (ms * MS) / TERA)  # fmt: skip
            )
        tiling.PREFILL_TILES.update(saved_prefill)
        _sweep_decode(results, device)
    finally:
        tiling.PREFILL_TILES.update(saved_prefill)
        tiling.DECODE_TILES.update(saved_decode)


def _sweep_decode(results: Results, device: torch.device) -> None:
    cases = [(1, 32768), (16, 8192), (64, 4096), (256, 2048)]
    cache = random_cache(max(b * c for b, c in cases) // BLOCK_SIZE, device)
    k_cache, v_cache = cache.layer(0)
    backend = ta.TritonAttention()
    for block_m, block_n, warps, stages in DECODE_SWEEP_TILES:
        tiling.DECODE_TILES[HEAD_DIM] = tiling.Tiles(block_m, block_n, warps, stages)
        for batch, ctx in cases:
            meta = make_meta([(ctx - 1, 1)] * batch, cache.num_blocks, device)
            q, _, _ = qkv(batch, device)
            out = torch.empty_like(q)
            ms = time_ms(lambda: backend.decode(q, k_cache, v_cache, meta, scale(), out))
            results.tile_sweep.append(
                dict(kernel="decode", tiles=[block_m, block_n, warps, stages], batch=batch, context=ctx,
                     gbps=kv_bytes(meta.seq_lens_cpu) / (ms * MS) / GIGA)  # fmt: skip
            )


# --------------------------------------------------------------------------- report


def print_report(results: Results) -> None:
    print(f"\n{results.device}  bf16  q_heads={Q_HEADS} kv_heads={KV_HEADS} head_dim={HEAD_DIM} block={BLOCK_SIZE}")
    print(f"\ndecode (KV read GB/s vs peak {results.peak_gbps:.0f})")
    print(f"{'batch':>6} {'context':>8} {'splits':>6} {'ms':>9} {'GB/s':>8} {'%peak':>6} {'graph ms':>9}")
    for r in results.decode:
        print(
            f"{r['batch']:>6} {r['context']:>8} {r['splits']:>6} {r['ms']:>9.4f} {r['gbps']:>8.0f}"
            f" {r['pct_peak']:>6.1f} {r['graph_ms']:>9.4f}"
        )
    print(f"\nprefill, {PREFILL_TOKENS} tokens causal (TFLOP/s, causal half)")
    for r in results.prefill:
        print(f"  {r['variant']:<32} {r['ms']:>8.3f} ms {r['tflops']:>7.1f}")
    print("\nprefill length sweep (TFLOP/s): triton vs SDPA route")
    for r in results.prefill_sweep:
        print(f"  {r['tokens']:>6}  triton {r['triton']:>7.1f}  sdpa_route {r['sdpa_route']:>7.1f}")
    for r in results.other:
        if "us" in r:
            print(f"  {r['case']:<48} {r['us']:>8.1f} us")
        else:
            print(f"  {r['case']:<48} {r['ms']:>8.3f} ms {r['tflops']:>7.1f} TFLOP/s {r['gbps']:>7.0f} GB/s")
    if results.tile_sweep:
        print("\ntile sweep")
        for r in results.tile_sweep:
            print("  " + json.dumps(r))
    c = results.correctness
    print(f"\ncorrectness vs TorchAttention (bf16): {c}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peak-gbps", type=float, default=DEFAULT_PEAK_GBPS, help="HBM peak to compare decode with")
    parser.add_argument("--json", help="write all results to this path")
    parser.add_argument("--max-kv-gib", type=float, default=DEFAULT_MAX_KV_GIB, help="cap on the decode KV pool")
    parser.add_argument("--sweep", action="store_true", help="also time alternative tile shapes")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-prefill", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    device = torch.device("cuda")
    torch.manual_seed(0)
    results = Results(device=torch.cuda.get_device_name(device), peak_gbps=args.peak_gbps)
    check_correctness(results, device)
    bench_host_overhead(results, device)
    if not args.skip_decode:
        bench_decode(results, device, args.max_kv_gib)
    if not args.skip_prefill:
        bench_prefill(results, device)
        bench_chunk_and_mixed(results, device)
    if args.sweep:
        sweep_tiles(results, device)
    print_report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(results), f, indent=2)


if __name__ == "__main__":
    main()
