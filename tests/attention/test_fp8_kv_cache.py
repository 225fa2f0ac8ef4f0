"""fp8 KV caches (``kv_quant``): every write path against a float64 oracle of the quantization,
attention over fp8 blocks against float64 attention over the dequantized K/V, and a prompt
chunk's rows against the same tokens attended as decode rows (vLLM issue 54035).

The oracle (``tests/fp8_oracle.py``) rounds by hand, in float64, from the formats' definitions
rather than the code under test. Without a GPU the Triton kernels run in the
interpreter (``tests/conftest.py``), which computes bf16 ``tl.dot`` wrongly: bf16 runs on CUDA only.
"""

from __future__ import annotations

import pytest
import torch
from fp8_oracle import GRIDS, oracle_quantize

from siesta.attention.base import AttentionMetadata, KVCache
from siesta.attention.cpu_attention import CpuAttention
from siesta.attention.kv_quant import KVScales, format_key, resolve_kv_dtype
from siesta.attention.select import get_attention_backend
from siesta.attention.torch_ref import TorchAttention, write_kv
from siesta.kv.hashing import ExtraKeys

triton = pytest.importorskip("triton")
from siesta.attention import triton_tiles as tiling  # noqa: E402
from siesta.attention.triton_attention import BatchInvariantTritonAttention, TritonAttention  # noqa: E402
from siesta.attention.triton_kv_write import write_kv_triton  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# Scales: one, non-powers of two (the quotient rounds), powers of two (it does not).
SCALES = [1.0, 0.3712890625, 3.0517578125, 2.0**-4]
COMPUTE = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# Relative Frobenius error against float64 over the dequantized K/V: fp32 is fp32 noise; half
# types round the dequantized K/V and the softmax weights.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
LAYERS, LAYER, KV_HEADS = 2, 1, 2
# Prefill and decode rows over the same fp8 context: fp32 noise (different reduction orders).
AGREEMENT = 1e-5


def probe_values(n: int, scale: float, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``n`` values under ``scale`` spanning the format: subnormals, normals, past saturation,
    and exact midpoints between neighbouring values (ties, both parities)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen, dtype=torch.float64) * torch.exp(torch.randn(n, generator=gen) * 5).double()
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).double()
    grid = grid[torch.isfinite(grid)].unique()
    midpoints = (grid[1:] + grid[:-1]) / 2
    ties = midpoints[torch.randint(len(midpoints), (n // 4,), generator=gen)]
    x[: n // 4] = ties
    x[n // 4 : n // 4 + 4] = torch.tensor([GRIDS[dtype][2] * 3, -GRIDS[dtype][2] * 1.01, 0.0, -0.0])
    return (x * scale).float()


def slots_and_rows(num_blocks: int, block: int, tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(num_blocks * block, generator=gen)[:tokens].to(torch.int64)


def fp8_cache(num_blocks: int, block: int, head_dim: int, dtype: torch.dtype, k_scale: float, v_scale: float,
              seed: int = 0) -> KVCache:  # fmt: skip
    """An fp8 cache full of finite noise, so a read of a wrong slot shows."""
    scales = KVScales.of([0.5, k_scale], [2.0, v_scale], origin="test")
    cache = KVCache.allocate(num_blocks, LAYERS, block, KV_HEADS, head_dim, dtype, DEVICE, scales=scales)
    gen = torch.Generator().manual_seed(seed)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=gen).mul_(4).to(dtype))
    return cache


def stored(cache: KVCache, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 values (float64, in the format's units) the cache holds at ``slots``, K and V."""
    block = cache.block_size
    return tuple(c[slots // block, slots % block].double().cpu() for c in cache.layer(LAYER))


def cpu_write(k, v, cache, layer, slots) -> None:
    CpuAttention()._write_kv(k, v, cache, layer, slots)


def triton_write(k, v, cache, layer, slots) -> None:
    write_kv_triton(k, v, *cache.layer(layer), slots, cache.layer_scales(layer))


WRITERS = {"torch": write_kv, "triton": triton_write}
if not ON_GPU:
    WRITERS["cpu"] = cpu_write


@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scale", SCALES)
def test_every_write_path_stores_the_oracles_fp8_values(writer: str, dtype: torch.dtype, scale: float) -> None:
    head_dim, block, tokens = 32, 16, 48
    cache = fp8_cache(8, block, head_dim, dtype, k_scale=scale, v_scale=scale * 2)
    n = tokens * KV_HEADS * head_dim
    k = probe_values(n, scale, dtype, seed=1).view(tokens, KV_HEADS, head_dim).to(DEVICE)
    v = probe_values(n, scale * 2, dtype, seed=2).view(tokens, KV_HEADS, head_dim).to(DEVICE)
    slots = slots_and_rows(cache.num_blocks, block, tokens, seed=3).to(DEVICE)
    WRITERS[writer](k, v, cache, LAYER, slots)
    got_k, got_v = stored(cache, slots)
    k_scale, v_scale = cache.layer_scales(LAYER)
    assert torch.equal(got_k, oracle_quantize(k.cpu(), k_scale, dtype))
    assert torch.equal(got_v, oracle_quantize(v.cpu(), v_scale, dtype))


@pytest.mark.parametrize("source", [torch.float16] + ([torch.bfloat16] if ON_GPU else []))
def test_half_precision_rows_are_quantized_from_their_own_values(source: torch.dtype) -> None:
    """A bf16/fp16 engine hands the writes half-precision rows: widened exactly, then divided."""
    dtype, scale, head_dim, tokens = torch.float8_e4m3fn, 0.3712890625, 32, 20
    cache = fp8_cache(4, 16, head_dim, dtype, k_scale=scale, v_scale=scale)
    k = probe_values(tokens * KV_HEADS * head_dim, scale, dtype, seed=4).view(tokens, KV_HEADS, head_dim)
    k = k.clamp(-60000, 60000).to(source).to(DEVICE)
    slots = torch.arange(tokens, dtype=torch.int64, device=DEVICE)
    for writer in (write_kv, triton_write):
        writer(k, k, cache, LAYER, slots)
        assert torch.equal(stored(cache, slots)[0], oracle_quantize(k.cpu().float(), scale, dtype))


def test_the_triton_write_skips_negative_slots_of_an_fp8_cache() -> None:
    cache = fp8_cache(4, 16, 32, torch.float8_e4m3fn, k_scale=0.5, v_scale=0.5)
    before = cache.tensor.clone()
    k = torch.randn(6, KV_HEADS, 32, device=DEVICE)
    write_kv_triton(k, k, *cache.layer(LAYER), torch.full((6,), -1, dtype=torch.int64, device=DEVICE), (0.5, 0.5))
    assert torch.equal(cache.tensor.view(torch.uint8), before.view(torch.uint8))


# -- attention over fp8 blocks -------------------------------------------------------------


def batch(specs: list[tuple[int, int]], group: int, head_dim: int, block: int, compute: torch.dtype,
          dtype: torch.dtype, seed: int):  # fmt: skip
    """Requests of (cached, new) tokens over shuffled blocks of an fp8 cache: the cached prefix is
    stored already (the oracle's values), the new K/V come in ``k``/``v``. Returns q, k, v, the
    cache, the metadata and each request's dequantized context (float64), the truth."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in specs]
    blocks = [-(-s // block) for s in seq_lens]
    cache = fp8_cache(sum(blocks) + 3, block, head_dim, dtype, k_scale=0.3712890625, v_scale=1.5, seed=seed)
    k_scale, v_scale = cache.layer_scales(LAYER)
    k_cache, v_cache = cache.layer(LAYER)
    perm = torch.randperm(cache.num_blocks, generator=gen).tolist()
    table = torch.zeros(len(specs), max(blocks), dtype=torch.int32)
    tokens = sum(n for _, n in specs)
    q = torch.randn(tokens, KV_HEADS * group, head_dim, generator=gen).to(compute)
    k = (torch.randn(tokens, KV_HEADS, head_dim, generator=gen) * 0.7).to(compute)
    v = torch.randn(tokens, KV_HEADS, head_dim, generator=gen).to(compute)
    contexts, slots, starts = [], [], [0]
    for i, (cached, new) in enumerate(specs):
        table[i, : blocks[i]] = torch.tensor(perm[: blocks[i]])
        perm = perm[blocks[i] :]
        at = table[i, torch.arange(cached + new) // block].long() * block + torch.arange(cached + new) % block
        prefix = [oracle_quantize(torch.randn(cached, KV_HEADS, head_dim, generator=gen) * 2, s, dtype)
                  for s in (k_scale, v_scale)]  # fmt: skip
        where = (at[:cached] // block).to(DEVICE), (at[:cached] % block).to(DEVICE)
        k_cache[where] = prefix[0].to(dtype).to(DEVICE)
        v_cache[where] = prefix[1].to(dtype).to(DEVICE)
        s = starts[-1]
        new_k = oracle_quantize(k[s : s + new].float(), k_scale, dtype)
        new_v = oracle_quantize(v[s : s + new].float(), v_scale, dtype)
        contexts.append((torch.cat([prefix[0], new_k]) * k_scale, torch.cat([prefix[1], new_v]) * v_scale))
        slots.append(at[cached:])
        starts.append(s + new)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), block_tables=table.to(DEVICE),
        slot_mapping=torch.cat(slots).to(DEVICE), max_query_len=max(n for _, n in specs), max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
    )  # fmt: skip
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cache, meta, contexts


def dense(q: torch.Tensor, meta: AttentionMetadata, contexts, scale: float) -> torch.Tensor:
    """Causal attention per request, in float64, over the dequantized contexts."""
    out, starts = [], meta.query_start_loc_cpu
    for i, (ctx_k, ctx_v) in enumerate(contexts):
        rows = q[starts[i] : starts[i + 1]].double().cpu()
        group = rows.shape[1] // ctx_k.shape[1]
        kk, vv = ctx_k.repeat_interleave(group, 1), ctx_v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", rows, kk) * scale
        n, length = rows.shape[0], kk.shape[0]
        seen = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
        out.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), vv))
    return torch.cat(out)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


def sdpa_route(monkeypatch: pytest.MonkeyPatch) -> TritonAttention:
    """The fresh-prefill SDPA route, which runs on CUDA only, taken on any device for every batch
    of fresh prefills (others take the kernels)."""
    backend = TritonAttention(sdpa_prefill_min_tokens=1)

    def fresh(q: torch.Tensor, meta: AttentionMetadata) -> bool:
        starts = meta.query_start_loc_cpu
        return all(starts[i + 1] - starts[i] == n > 1 for i, n in enumerate(meta.seq_lens_cpu))

    monkeypatch.setattr(backend, "uses_sdpa", fresh)
    return backend


BACKENDS = {
    "torch": lambda mp: TorchAttention(),
    "unified": lambda mp: TritonAttention(prefill_splits=1, mixed_decode_min_splits=None),
    "split": lambda mp: TritonAttention(prefill_splits=4, decode_splits=4),
    "deterministic": lambda mp: BatchInvariantTritonAttention(),
}
MIXED = [(37, 1), (0, 23), (50, 9), (0, 1), (19, 1)]
FRESH = [(0, 29), (0, 17)]


@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize("compute", COMPUTE)
def test_attention_over_fp8_blocks_is_float64_attention_over_the_dequantized_kv(name, compute, monkeypatch) -> None:
    dtype = torch.float8_e4m3fn
    q, k, v, cache, meta, contexts = batch(MIXED, group=2, head_dim=32, block=16, compute=compute, dtype=dtype, seed=5)
    scale = 32**-0.5
    out = torch.full_like(q, float("nan"))
    BACKENDS[name](monkeypatch).forward(q, k, v, cache, LAYER, meta, scale, out=out)
    assert not out.isnan().any(), "some output elements were never written"
    assert rel_error(out, dense(q, meta, contexts, scale)) < TOLERANCE[compute]


@pytest.mark.parametrize("dtype", FP8)
def test_fresh_prefills_through_sdpa_and_the_cpu_backend_attend_to_the_dequantized_kv(dtype, monkeypatch) -> None:
    """The two paths that read a fresh chunk's K/V without the kernels: Triton's SDPA route, and
    the CPU's auto backend (which, for an fp8 cache, is the torch reference by design)."""
    q, k, v, cache, meta, contexts = batch(FRESH, group=3, head_dim=32, block=16, compute=torch.float32,
                                           dtype=dtype, seed=6)  # fmt: skip
    backends = [sdpa_route(monkeypatch), get_attention_backend("auto", DEVICE, kv_quantized=True)]
    if not ON_GPU:
        assert type(backends[1]) is TorchAttention
        backends.append(CpuAttention())  # asked for by name: its C kernels step aside for fp8
    for backend in backends:
        out = backend.forward(q, k, v, cache, LAYER, meta, 32**-0.5)
        assert rel_error(out, dense(q, meta, contexts, 32**-0.5)) < TOLERANCE[torch.float32], type(backend)


# -- prefill and decode agree --------------------------------------------------------------


def decode_rows_of(meta: AttentionMetadata) -> AttentionMetadata:
    """The tokens of one fresh prompt chunk as decode rows, token t over the t + 1 keys it sees:
    each row writes its own K/V again (the same bytes) and reads them back, as decode does."""
    n = meta.query_start_loc_cpu[-1]
    lens = list(range(1, n + 1))
    starts = list(range(n + 1))
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        block_tables=meta.block_tables[:1].expand(n, -1).contiguous(), slot_mapping=meta.slot_mapping,
        max_query_len=1, max_seq_len=n, query_start_loc_cpu=starts, seq_lens_cpu=lens,
    )  # fmt: skip


AGREEING = {**BACKENDS, "sdpa": sdpa_route}
if not ON_GPU:
    AGREEING["cpu"] = lambda mp: CpuAttention()


@pytest.mark.parametrize("name", list(AGREEING))
def test_a_prompt_chunk_attends_to_what_decode_will_read(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM issue 54035: a chunk that attended to its own unquantized K/V gave other logprobs
    than decode, which reads them quantized. Every row of a fresh chunk equals the same token
    attended as a decode row afterwards, to fp32 noise."""
    q, k, v, cache, meta, _ = batch([(0, 40)], group=2, head_dim=32, block=16, compute=torch.float32,
                                    dtype=torch.float8_e4m3fn, seed=7)  # fmt: skip
    backend = AGREEING[name](monkeypatch)
    prefill = backend.forward(q, k, v, cache, LAYER, meta, 32**-0.5)
    decode = backend.forward(q, k, v, cache, LAYER, decode_rows_of(meta), 32**-0.5)
    assert rel_error(prefill, decode.double().cpu()) < AGREEMENT


# -- what the bytes mean -------------------------------------------------------------------


def test_the_format_key_names_the_dtype_and_the_scales() -> None:
    ones, other = KVScales.default(2), KVScales.of([1.0, 0.5], [1.0, 1.0], origin="checkpoint")
    keys = {format_key(torch.bfloat16, None), format_key(torch.float32, None), format_key(torch.float8_e4m3fn, ones),
            format_key(torch.float8_e4m3fn, other), format_key(torch.float8_e5m2, ones)}  # fmt: skip
    assert len(keys) == 5
    assert format_key(torch.float8_e4m3fn, KVScales.of([1.0, 0.5], [1.0, 1.0], origin="x")) in keys
    extra = {ExtraKeys("m", "source", None, key).encode() for key in keys}
    assert len(extra) == 5 and ExtraKeys("m", "source").encode() not in extra


def test_names_resolve_to_dtypes_and_unknown_ones_are_refused() -> None:
    assert resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("fp8", torch.bfloat16) == resolve_kv_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert resolve_kv_dtype("fp8_e5m2", torch.float16) == torch.float8_e5m2
    with pytest.raises(ValueError, match="fp8_e4m3"):
        resolve_kv_dtype("int8", torch.bfloat16)
    with pytest.raises(ValueError, match="positive"):
        KVScales.of([1.0, 0.0], [1.0, 1.0], origin="checkpoint")


def test_an_fp8_cache_costs_a_byte_a_value_and_zeroes_blocks_through_bytes() -> None:
    args = (3, LAYERS, 16, KV_HEADS, 32)
    fp8_bytes = KVCache.bytes_per_block(*args[1:], torch.float8_e4m3fn)
    assert fp8_bytes * 2 == KVCache.bytes_per_block(*args[1:], torch.bfloat16)
    cache = KVCache.allocate(*args, torch.float8_e4m3fn, DEVICE)
    assert cache.scales == KVScales.default(LAYERS) and cache.block_bytes == fp8_bytes
    cache.tensor.copy_(torch.ones(cache.tensor.shape).to(torch.float8_e4m3fn))
    cache.zero_blocks(torch.tensor([1], device=DEVICE))
    assert cache.tensor[1].float().abs().sum() == 0 and cache.tensor[[0, 2]].float().min() == 1


def test_half_precision_decode_over_fp8_takes_its_own_key_step_and_is_float64_attention() -> None:
    """128-wide heads over an fp8 cache decode 128 keys a step where bf16 takes 64 (the same
    bytes a step); the rows are still float64 attention over the dequantized K/V."""
    assert tiling.decode_tiles(128, torch.float16, fp8_cache=True).block_n == 128
    assert tiling.decode_tiles(128, torch.float16).block_n == 64
    assert tiling.decode_tiles(128, torch.float32, fp8_cache=True) == tiling.decode_tiles(128, torch.float32)
    specs = [(300, 1), (130, 1)]
    q, k, v, cache, meta, contexts = batch(specs, group=2, head_dim=128, block=16, compute=torch.float16,
                                           dtype=torch.float8_e4m3fn, seed=7)  # fmt: skip
    out = torch.full_like(q, float("nan"))
    TritonAttention(decode_splits=2).forward(q, k, v, cache, LAYER, meta, 128**-0.5, out=out)
    assert rel_error(out, dense(q, meta, contexts, 128**-0.5)) < TOLERANCE[torch.float16]


@pytest.mark.parametrize("dtype", FP8)
def test_a_decode_step_that_writes_its_kv_in_the_split_kernel_stores_the_same_fp8_bytes(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``FUSE_DECODE_KV_WRITE`` over an fp8 cache: the split kernel quantizes the new K/V as the
    write kernel does (the same bytes in every block), and reads back what it stored."""
    from siesta.attention import triton_attention

    specs = [(300, 1), (15, 1), (0, 1), (130, 1)]
    runs = []
    for fused in (False, True):
        q, k, v, cache, meta, contexts = batch(specs, group=2, head_dim=64, block=16, compute=torch.float16,
                                               dtype=dtype, seed=23)  # fmt: skip
        monkeypatch.setattr(triton_attention, "FUSE_DECODE_KV_WRITE", fused)
        write_calls, write = [], triton_attention.write_kv_triton
        monkeypatch.setattr(triton_attention, "write_kv_triton", lambda *a: (write_calls.append(1), write(*a)))
        out = torch.full_like(q, float("nan"))
        TritonAttention(decode_splits=4).forward(q, k, v, cache, LAYER, meta, 64**-0.5, out=out)
        assert len(write_calls) == (0 if fused else 1)  # the fused step stored K/V itself
        assert rel_error(out, dense(q, meta, contexts, 64**-0.5)) < TOLERANCE[torch.float16]
        runs.append((cache.tensor.view(torch.uint8).clone(), out))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
