"""Triton paged attention against a dense float64 reference and the torch backend.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set
before triton is imported). The interpreter computes bf16 ``tl.dot`` wrongly, so
bf16 is only tested on CUDA.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import random
import sys
from dataclasses import dataclass

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

# @triton.jit reads TRITON_INTERPRET when a kernel is defined: modules imported
# before the flag was set must be loaded again.
_KERNEL_MODULES = (
    "siesta.attention.triton_kv_write",
    "siesta.attention.triton_kernels",
    "siesta.attention.triton_attention",
)
for _name in _KERNEL_MODULES:
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])

from siesta.attention.base import AttentionMetadata, KVCache  # noqa: E402
from siesta.attention.torch_ref import TorchAttention, write_kv  # noqa: E402
from siesta.attention.triton_attention import TritonAttention, prefill_block_q  # noqa: E402
from siesta.attention.triton_kv_write import write_kv_triton  # noqa: E402
from siesta.attention.triton_tiles import choose_num_splits, choose_prefill_splits  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# Relative Frobenius error against float64: fp32 stays exact ("ieee" dots); half
# types round the softmax weights before the P @ V product.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
NUM_KV_HEADS = 2
NUM_LAYERS = 2
LAYER = 1
# Blocks no request uses, so the shuffled tables are sparse in the cache.
SPARE_BLOCKS = 5


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: KVCache
    meta: AttentionMetadata
    context_k: list[torch.Tensor]  # per request, [seq_len, kv_heads, head_dim]: the truth
    context_v: list[torch.Tensor]
    q_lens: list[int]
    group: int

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.q.shape[-1])


def _fused_qkv(num_tokens: int, group: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator):
    """q, k, v as strided views of one projection output, as a model produces them."""
    q_width = NUM_KV_HEADS * group * head_dim
    kv_width = NUM_KV_HEADS * head_dim
    qkv = torch.randn(num_tokens, q_width + 2 * kv_width, generator=gen).to(dtype).to(DEVICE)
    q = qkv[:, :q_width].view(num_tokens, NUM_KV_HEADS * group, head_dim)
    k = qkv[:, q_width : q_width + kv_width].view(num_tokens, NUM_KV_HEADS, head_dim)
    v = qkv[:, q_width + kv_width :].view(num_tokens, NUM_KV_HEADS, head_dim)
    return q, k, v


def make_batch(
    specs: list[tuple[int, int]],
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
) -> Batch:
    """``specs``: (cached tokens, new tokens) per request. Cached tokens are placed in
    shuffled blocks beforehand; new tokens' K/V come in ``k``/``v``."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [cached + new for cached, new in specs]
    blocks_per_req = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_req) + SPARE_BLOCKS
    kv_cache = KVCache.allocate(num_blocks, NUM_LAYERS, block_size, NUM_KV_HEADS, head_dim, dtype, DEVICE)
    # Noise everywhere, so a read of a wrong slot shows up in the result.
    kv_cache.tensor.copy_(torch.randn(kv_cache.tensor.shape, generator=gen).to(dtype))
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(specs), max(blocks_per_req), dtype=torch.int32)
    k_layer, v_layer = kv_cache.layer(LAYER)

    q_lens = [new for _, new in specs]
    q, k, v = _fused_qkv(sum(q_lens), group, head_dim, dtype, gen)
    context_k, context_v, slots = [], [], []
    token = 0
    for i, (cached, new) in enumerate(specs):
        ids = perm[: blocks_per_req[i]]
        perm = perm[blocks_per_req[i] :]
        table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        prefix_k = torch.randn(cached, NUM_KV_HEADS, head_dim, generator=gen).to(dtype).to(DEVICE)
        prefix_v = torch.randn(cached, NUM_KV_HEADS, head_dim, generator=gen).to(dtype).to(DEVICE)
        for pos in range(cached + new):
            slot = ids[pos // block_size] * block_size + pos % block_size
            if pos < cached:
                k_layer[slot // block_size, slot % block_size] = prefix_k[pos]
                v_layer[slot // block_size, slot % block_size] = prefix_v[pos]
            else:
                slots.append(slot)
        context_k.append(torch.cat([prefix_k, k[token : token + new]]))
        context_v.append(torch.cat([prefix_v, v[token : token + new]]))
        token += new

    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=table.to(DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    return Batch(q, k, v, kv_cache, meta, context_k, context_v, q_lens, group)


def dense_reference(batch: Batch) -> torch.Tensor:
    """Causal attention per request in float64 over the true contexts."""
    outs = []
    start = 0
    for i, q_len in enumerate(batch.q_lens):
        q = batch.q[start : start + q_len].double()
        ctx_k = batch.context_k[i].double().repeat_interleave(batch.group, dim=1)
        ctx_v = batch.context_v[i].double().repeat_interleave(batch.group, dim=1)
        seq_len = ctx_k.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, ctx_k) * batch.scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, ctx_v))
        start += q_len
    return torch.cat(outs)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def poisoned_like(q: torch.Tensor) -> torch.Tensor:
    return torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)


def check_against_oracles(batch: Batch, backend: TritonAttention, out: torch.Tensor) -> None:
    """Every element written, close to float64, close to TorchAttention; same cache as torch's write."""
    dtype = batch.q.dtype
    assert not out.isnan().any(), "some output elements were never written"
    assert rel_error(out, dense_reference(batch)) < TOLERANCE[dtype]

    torch_cache = KVCache(batch.kv_cache.tensor.clone())
    torch_out = TorchAttention().forward(batch.q, batch.k, batch.v, torch_cache, LAYER, batch.meta, batch.scale)
    assert rel_error(out, torch_out) < TOLERANCE[dtype]
    assert torch.equal(torch_cache.tensor, batch.kv_cache.tensor)


def random_specs(rng: random.Random, block_size: int) -> list[tuple[int, int]]:
    """Decode rows, fresh prefills and prefix chunks in a shuffled order."""
    specs = [(rng.randint(0, 4 * block_size + 3), 1) for _ in range(rng.randint(1, 3))]
    specs += [(0, rng.randint(2, 3 * block_size + 5)) for _ in range(rng.randint(1, 2))]
    specs += [(rng.randint(1, 5 * block_size), rng.randint(2, 2 * block_size + 7)) for _ in range(rng.randint(1, 2))]
    rng.shuffle(specs)
    return specs


MIXED_CASES = [
    # block_size, head_dim, group, dtype
    (16, 64, 1, torch.float32),
    (32, 128, 2, torch.float16),
    (16, 128, 4, torch.float32),
    (32, 64, 4, torch.float16),
    (16, 96, 2, torch.float32),  # head_dim not a power of two
    (16, 64, 3, torch.float16),  # group not a power of two
    (32, 256, 2, torch.float16),
]
if ON_GPU:
    MIXED_CASES += [(16, 128, 4, torch.bfloat16), (32, 64, 8, torch.bfloat16)]


@pytest.mark.parametrize("block_size,head_dim,group,dtype", MIXED_CASES)
def test_mixed_batch(block_size: int, head_dim: int, group: int, dtype: torch.dtype) -> None:
    seed = MIXED_CASES.index((block_size, head_dim, group, dtype))
    specs = random_specs(random.Random(seed), block_size)
    batch = make_batch(specs, group, head_dim, block_size, dtype, seed)
    backend = TritonAttention()
    out = poisoned_like(batch.q)
    result = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, LAYER, batch.meta, batch.scale, out=out)
    assert result is out
    check_against_oracles(batch, backend, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_batch_with_split_decode_rows(dtype: torch.dtype) -> None:
    """Decode rows of a mixed batch taken out of the unified launch into split-KV."""
    specs = [(200, 1), (0, 37), (3, 1), (90, 20), (0, 1)]
    batch = make_batch(specs, group=4, head_dim=128, block_size=16, dtype=dtype, seed=12)
    backend = TritonAttention(decode_splits=4, mixed_decode_min_splits=1)
    out = poisoned_like(batch.q)
    backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, LAYER, batch.meta, batch.scale, out=out)
    check_against_oracles(batch, backend, out)


@pytest.mark.parametrize("prefill_splits", [1, 4])
def test_prefill_spans_many_tiles(prefill_splits: int) -> None:
    """Long enough for several query tiles and unmasked key tiles before the diagonal."""
    specs = [(150, 140), (0, 130), (3, 1)]
    batch = make_batch(specs, group=1, head_dim=64, block_size=16, dtype=torch.float32, seed=7)
    backend = TritonAttention(prefill_splits=prefill_splits)
    out = poisoned_like(batch.q)
    backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, LAYER, batch.meta, batch.scale, out=out)
    check_against_oracles(batch, backend, out)


# Prefill split-KV. Contexts of a few hundred keys already give several splits of
# whole key tiles (block_n is 32..64 here), and keep the interpreter quick.
PREFILL_SPLIT_CASES = [
    # block_size, head_dim, group, dtype
    (16, 64, 1, torch.float32),
    (16, 128, 4, torch.float16),
    (16, 96, 2, torch.float32),  # head_dim not a power of two
    (32, 64, 3, torch.float16),  # group not a power of two
]
if ON_GPU:
    PREFILL_SPLIT_CASES += [(16, 128, 4, torch.bfloat16)]


def run_split_prefill(batch: Batch, backend: TritonAttention, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """``forward`` on a poisoned output, failing if the unified launch is reached."""

    def no_unified(*args: object, **kwargs: object) -> None:
        raise AssertionError("the prefill split path should not launch the unified kernel")

    monkeypatch.setattr(backend, "unified", no_unified)
    out = poisoned_like(batch.q)
    backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, LAYER, batch.meta, batch.scale, out=out)
    return out


@pytest.mark.parametrize("num_splits", [2, 4])
@pytest.mark.parametrize("block_size,head_dim,group,dtype", PREFILL_SPLIT_CASES)
def test_prefill_split_short_extend_over_long_prefix(
    num_splits: int, block_size: int, head_dim: int, group: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The resume shape: a few new tokens over a long cached prefix, cut into key ranges."""
    batch = make_batch([(421, 9)], group, head_dim, block_size, dtype, seed=21)
    backend = TritonAttention(prefill_splits=num_splits)
    out = run_split_prefill(batch, backend, monkeypatch)
    check_against_oracles(batch, backend, out)


# The interpreter runs the per-token merge one (token, head) program at a time:
# each case alternates the decode path (direct, or split and merged) rather than
# running both.
PREFILL_SPLIT_MIXED_CASES = [
    (*case, decode_splits) for case, decode_splits in zip(PREFILL_SPLIT_CASES, [None, 4] * len(PREFILL_SPLIT_CASES))
]


@pytest.mark.parametrize("block_size,head_dim,group,dtype,decode_splits", PREFILL_SPLIT_MIXED_CASES)
def test_prefill_split_mixed_batch(
    block_size: int,
    head_dim: int,
    group: int,
    dtype: torch.dtype,
    decode_splits: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Extends of several lengths (one spanning query tiles, one fresh) beside decode rows.

    The decode rows run before the per-token merge: a merge that wrote them would
    leave them wrong.
    """
    specs = [(250, 1), (300, 7), (0, 1), (180, 45), (5, 1), (37, 2), (0, 20)]
    batch = make_batch(specs, group, head_dim, block_size, dtype, seed=22)
    backend = TritonAttention(decode_splits=decode_splits, prefill_splits=4)
    out = run_split_prefill(batch, backend, monkeypatch)
    check_against_oracles(batch, backend, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_split_more_splits_than_key_tiles(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """More splits than key tiles (contexts of 1-2 tiles): most ranges are empty and must weigh nothing."""
    specs = [(70, 20), (3, 12), (0, 1), (0, 6)]
    batch = make_batch(specs, group=2, head_dim=64, block_size=16, dtype=dtype, seed=23)
    backend = TritonAttention(prefill_splits=8)
    out = run_split_prefill(batch, backend, monkeypatch)
    check_against_oracles(batch, backend, out)


@pytest.mark.parametrize("prefill_splits", [None, 4])
def test_a_step_plans_once_and_its_layers_share_scratch(prefill_splits: int | None, monkeypatch) -> None:
    """Every layer of a step reads the first layer's plan and partial buffers back from the
    metadata, and gets the bits a fresh metadata gives it."""
    specs = [(120, 1), (150, 7), (0, 1), (90, 20)]
    batch = make_batch(specs, 2, 32, 16, torch.float32, seed=23)
    backend = TritonAttention(decode_splits=4, prefill_splits=prefill_splits)
    plans = []
    derive = backend.mixed_plan
    monkeypatch.setattr(backend, "mixed_plan", lambda *a: plans.append(derive(*a)) or plans[-1])
    fresh_cache = KVCache(batch.kv_cache.tensor.clone())
    for layer in range(NUM_LAYERS):  # each layer's cache holds its own noise: other contexts
        out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, layer, batch.meta, batch.scale)
        alone = backend.forward(batch.q, batch.k, batch.v, fresh_cache, layer, dataclasses.replace(batch.meta),
                                batch.scale)  # fmt: skip
        assert torch.equal(out, alone) and not out.isnan().any()
    assert len(plans) == 1 + NUM_LAYERS  # the shared metadata's one, and each fresh one's
    scratch = [key for key in batch.meta.step_cache if key[0] == "scratch"]
    assert len(scratch) == (4 if plans[0].prefill_splits > 1 else 2)  # lse and partials, decode (and prefill)


@pytest.mark.parametrize("num_splits", [1, 2, 8, None])
@pytest.mark.parametrize("block_size,head_dim,group,dtype", [(16, 128, 4, torch.float16), (32, 64, 2, torch.float32)])
def test_decode_split_kv(
    num_splits: int | None, block_size: int, head_dim: int, group: int, dtype: torch.dtype
) -> None:
    rng = random.Random(num_splits or 0)
    # Short contexts next to long ones: with 8 splits some ranges are empty.
    specs = [(rng.randint(0, 300), 1) for _ in range(3)] + [(0, 1), (5, 1)]
    batch = make_batch(specs, group, head_dim, block_size, dtype, seed=11)
    backend = TritonAttention(decode_splits=num_splits)
    out = poisoned_like(batch.q)
    backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, LAYER, batch.meta, batch.scale, out=out)
    check_against_oracles(batch, backend, out)


def test_unified_kernel_serves_decode_only_batch() -> None:
    specs = [(40, 1), (0, 1), (77, 1)]
    batch = make_batch(specs, group=2, head_dim=64, block_size=16, dtype=torch.float32, seed=3)
    backend = TritonAttention()
    k_cache, v_cache = batch.kv_cache.layer(LAYER)
    write_kv_triton(batch.k, batch.v, k_cache, v_cache, batch.meta.slot_mapping)
    out = poisoned_like(batch.q)
    backend.unified(batch.q, k_cache, v_cache, batch.meta, batch.scale, out)
    check_against_oracles(batch, backend, out)


def test_sdpa_prefill_path_matches_reference() -> None:
    specs = [(0, 40), (0, 33)]
    batch = make_batch(specs, group=4, head_dim=64, block_size=16, dtype=torch.float32, seed=5)
    out = poisoned_like(batch.q)
    TritonAttention().sdpa_prefill(batch.q, batch.k, batch.v, batch.meta, batch.scale, out)
    assert not out.isnan().any()
    assert rel_error(out, dense_reference(batch)) < TOLERANCE[torch.float32]


def test_one_fresh_prompt_through_sdpa_returns_its_output_uncopied(monkeypatch: pytest.MonkeyPatch) -> None:
    # The SDPA route (CUDA only) taken here too: one prompt and no ``out`` give SDPA's own
    # output, laid out tokens first; with ``out`` (a graph's buffer) the same values land in it.
    batch = make_batch([(0, 40)], group=4, head_dim=64, block_size=16, dtype=torch.float32, seed=6)
    backend = TritonAttention(sdpa_prefill_min_tokens=1)
    monkeypatch.setattr(backend, "uses_sdpa", lambda q, meta: True)
    result = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, LAYER, batch.meta, batch.scale)
    assert result.shape == batch.q.shape and result.is_contiguous()
    assert result._base is not None  # a view of SDPA's output: no copy into a buffer of ours
    out = poisoned_like(batch.q)
    assert backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, LAYER, batch.meta, batch.scale, out=out) is out
    assert torch.equal(result, out)
    assert rel_error(result, dense_reference(batch)) < TOLERANCE[torch.float32]


def test_sdpa_routing_policy() -> None:
    fresh = make_batch([(0, 40), (0, 33)], 2, 64, 16, torch.float32, seed=1)
    chunked = make_batch([(10, 40)], 2, 64, 16, torch.float32, seed=2)
    backend = TritonAttention(sdpa_prefill_min_tokens=32)
    assert backend.uses_sdpa(fresh.q, fresh.meta) == ON_GPU
    assert not backend.uses_sdpa(chunked.q, chunked.meta)
    assert not TritonAttention(sdpa_prefill_min_tokens=None).uses_sdpa(fresh.q, fresh.meta)
    assert not TritonAttention(sdpa_prefill_min_tokens=34).uses_sdpa(fresh.q, fresh.meta)


def test_write_kv_matches_torch_reference() -> None:
    specs = [(0, 21), (13, 5), (40, 1)]
    batch = make_batch(specs, group=1, head_dim=96, block_size=32, dtype=torch.float16, seed=9)
    expected = KVCache(batch.kv_cache.tensor.clone())
    write_kv(batch.k, batch.v, expected, LAYER, batch.meta.slot_mapping)
    k_cache, v_cache = batch.kv_cache.layer(LAYER)
    write_kv_triton(batch.k, batch.v, k_cache, v_cache, batch.meta.slot_mapping)
    assert torch.equal(expected.tensor, batch.kv_cache.tensor)


def test_write_kv_skips_negative_slots() -> None:
    batch = make_batch([(0, 6)], group=1, head_dim=64, block_size=16, dtype=torch.float32, seed=4)
    before = batch.kv_cache.tensor.clone()
    slots = batch.meta.slot_mapping.clone()
    slots[::2] = -1
    k_cache, v_cache = batch.kv_cache.layer(LAYER)
    write_kv_triton(batch.k, batch.v, k_cache, v_cache, slots)
    expected = KVCache(before)
    kept = slots >= 0
    write_kv(batch.k[kept], batch.v[kept], expected, LAYER, slots[kept])
    assert torch.equal(expected.tensor, batch.kv_cache.tensor)


def test_rejects_unsupported_shapes() -> None:
    batch = make_batch([(0, 4)], group=1, head_dim=64, block_size=16, dtype=torch.float32, seed=6)
    backend = TritonAttention()
    uneven_q = torch.randn(4, 3, 64, device=DEVICE)
    with pytest.raises(ValueError, match="query heads"):
        backend.forward(uneven_q, batch.k, batch.v, batch.kv_cache, LAYER, batch.meta, batch.scale)
    big = make_batch([(0, 2)], group=1, head_dim=512, block_size=16, dtype=torch.float32, seed=6)
    with pytest.raises(ValueError, match="head_dim"):
        backend.forward(big.q, big.k, big.v, big.kv_cache, LAYER, big.meta, big.scale)


def test_split_heuristic() -> None:
    sms = 132
    # One long sequence: split until the GPU is full.
    assert choose_num_splits(1, 8, 32768, sms) == 64
    # Short context: never below the minimum keys per split.
    assert choose_num_splits(1, 8, 512, sms) == 2
    # A big batch fills the GPU by itself.
    assert choose_num_splits(256, 8, 32768, sms) == 1
    for batch in (1, 3, 16, 64):
        splits = choose_num_splits(batch, 8, 8192, sms)
        assert splits & (splits - 1) == 0


def test_prefill_split_heuristic() -> None:
    sms, kv_heads = 132, 8
    # Llama-3-8B: 32 query heads over 8 KV heads, head_dim 128, bf16 cache.
    block_q = prefill_block_q(head_dim=128, group=4, dtype=torch.bfloat16)
    # A resume from the KV tier: 44 new tokens over 19,456 cached give 2 tiles x 8 heads.
    assert choose_prefill_splits([44], [19_456 + 44], block_q, kv_heads, sms) > 1
    # The same extend beside decode rows: they do not count as prefill tiles.
    assert choose_prefill_splits([44, 1, 1], [19_500, 30_000, 500], block_q, kv_heads, sms) > 1
    # A large fresh prefill batch fills the GPU by itself.
    assert choose_prefill_splits([2048] * 8, [2048] * 8, block_q, kv_heads, sms) == 1
    # A short context is not worth splitting.
    assert choose_prefill_splits([44], [200], block_q, kv_heads, sms) == 1
    # Decode rows only: no prefill tiles to split.
    assert choose_prefill_splits([1, 1], [30_000, 30_000], block_q, kv_heads, sms) == 1



def _replay(batch: Batch, picks: list[tuple[int, int]]):
    """Queries for (request, last n tokens) picks of ``batch`` after its forward wrote every
    K/V: each pick's earlier tokens are its cached prefix now. Nothing is written again
    (negative slots). Returns q, k, v and the metadata."""
    starts, lens = batch.meta.query_start_loc_cpu, batch.meta.seq_lens_cpu
    q_rows, q_lens, starts_out = [], [], [0]
    for i, n in picks:
        q_rows.append(batch.q[starts[i + 1] - n : starts[i + 1]])
        q_lens.append(n)
        starts_out.append(starts_out[-1] + n)
    q = torch.cat(q_rows)
    seq_lens = [lens[i] for i, _ in picks]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts_out, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=batch.meta.block_tables[[i for i, _ in picks]].contiguous(),
        slot_mapping=torch.full((q.shape[0],), -1, dtype=torch.int64, device=DEVICE),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), query_start_loc_cpu=starts_out, seq_lens_cpu=seq_lens,
    )  # fmt: skip
    kv = torch.zeros(q.shape[0], NUM_KV_HEADS, q.shape[-1], dtype=q.dtype, device=DEVICE)
    return q, kv, kv, meta


# (head_dim, group, dtype): the CPU's interpreter checks the logic; the GPU checks that the
# decode rows' narrow tile reaches the prefill tile's bits on the card, for the heads served
# (Llama-3 and Qwen3-MoE 128 x 4 and x 8, Qwen2.5-7B's group of 7, SmolLM2's 64 x 3).
INVARIANT_CASES = [(64, 4, torch.float32)] + ([(128, 4, torch.bfloat16), (128, 7, torch.bfloat16),
    (128, 8, torch.bfloat16), (64, 3, torch.bfloat16), (256, 2, torch.bfloat16), (128, 4, torch.float16),
    (128, 4, torch.float32)] if ON_GPU else [])  # fmt: skip


@pytest.mark.parametrize("head_dim,group,dtype", INVARIANT_CASES)
def test_batch_invariant_mode_gives_a_token_the_same_bits_in_a_chunk_as_a_decode_row(head_dim, group, dtype) -> None:
    """Deterministic mode: the last token of a 300-token extend over a cached prefix has the same
    output bits computed inside that chunk, at the end of shorter chunks over longer prefixes,
    and as a decode row, alone or beside other requests."""
    from siesta.attention.triton_attention import BatchInvariantTritonAttention

    block = 16
    specs = [(70, 300), (33, 1), (0, 25), (50, 1), (0, 9)] if ON_GPU else [(70, 40), (33, 1), (0, 25), (50, 1), (0, 9)]
    batch = make_batch(specs, group, head_dim, block, dtype, seed=7)
    backend = BatchInvariantTritonAttention()
    full = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, LAYER, batch.meta, batch.scale)
    check_against_oracles(batch, backend, full)
    token = full[batch.meta.query_start_loc_cpu[1] - 1]
    long = specs[0][1] - 1
    for picks in ([(0, 1)], [(0, 7)], [(0, long)], [(3, 1), (0, 1), (4, 9)], [(2, 25), (0, 1), (1, 1)]):
        q, k, v, meta = _replay(batch, picks)
        out = backend.forward(q, k, v, batch.kv_cache, LAYER, meta, batch.scale)
        row = meta.query_start_loc_cpu[[i for i, _ in picks].index(0) + 1] - 1
        assert torch.equal(out[row], token), picks
    # Every token of the chunk as a decode row over its own prefix, all in one batch: a tile
    # that reaches other bits only now and then shows here (one token alone may pass by chance).
    q, meta = _decode_rows(batch, 0)
    out = backend.forward(q, q[:, :NUM_KV_HEADS], q[:, :NUM_KV_HEADS], batch.kv_cache, LAYER, meta, batch.scale)
    chunk = full[: batch.meta.query_start_loc_cpu[1]]
    differ = (out != chunk).flatten(1).any(1).nonzero().flatten().tolist()
    assert not differ, f"tokens {differ[:8]} of {len(chunk)} differ as decode rows"


def _decode_rows(batch: Batch, req: int):
    """Request ``req``'s new tokens as decode rows, each over the prefix up to itself (its K/V
    already written): the queries and the metadata. Nothing is written (negative slots)."""
    starts, lens = batch.meta.query_start_loc_cpu, batch.meta.seq_lens_cpu
    n = starts[req + 1] - starts[req]
    seq_lens = [lens[req] - n + 1 + j for j in range(n)]
    meta = AttentionMetadata(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=batch.meta.block_tables[[req] * n].contiguous(),
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=DEVICE),
        max_query_len=1, max_seq_len=max(seq_lens), query_start_loc_cpu=list(range(n + 1)), seq_lens_cpu=seq_lens,
    )  # fmt: skip
    return batch.q[starts[req] : starts[req + 1]], meta


@pytest.mark.parametrize("num_splits", [1, 4, None])
@pytest.mark.parametrize("block_size,head_dim,group,dtype", [(16, 128, 4, torch.float16), (32, 64, 2, torch.float32)])
def test_a_decode_step_that_writes_its_kv_in_the_split_kernel(num_splits, block_size, head_dim, group, dtype,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """``FUSE_DECODE_KV_WRITE``: the split kernel stores the new K/V before it reads them. The
    cache then holds the write kernel's bytes (every layer, every block), the output is the
    oracles', and a padding row (slot -1) writes nothing."""
    from siesta.attention import triton_attention

    specs = [(0, 1), (5, 1), (block_size - 1, 1), (block_size, 1), (130, 1)]
    caches, outs = [], []
    for fused in (False, True):
        batch = make_batch(specs, group, head_dim, block_size, dtype, seed=19)
        batch.meta.slot_mapping[1] = -1  # a padding row: its slot stays as it was
        before = batch.kv_cache.tensor.clone()
        monkeypatch.setattr(triton_attention, "FUSE_DECODE_KV_WRITE", fused)
        # the fused step must store K/V without the write kernel, or the knob did nothing
        write_calls = []
        write = triton_attention.write_kv_triton
        monkeypatch.setattr(triton_attention, "write_kv_triton", lambda *a: (write_calls.append(1), write(*a)))
        out = poisoned_like(batch.q)
        TritonAttention(decode_splits=num_splits).forward(batch.q, batch.k, batch.v, batch.kv_cache, LAYER,
                                                          batch.meta, batch.scale, out=out)  # fmt: skip
        caches.append(batch.kv_cache.tensor.clone())
        outs.append(out)
        assert not torch.equal(caches[-1], before)  # the other rows were written
        assert len(write_calls) == (0 if fused else 1)
    assert torch.equal(caches[0], caches[1])
    assert torch.equal(outs[0][[0, 2, 3, 4]], outs[1][[0, 2, 3, 4]])


@pytest.mark.parametrize("num_splits", [2, 8])
@pytest.mark.parametrize(("specs", "decode_splits_in_mixed"), [
    ([(0, 1), (5, 1), (300, 1), (130, 1), (17, 1)], None),  # decode only: with 8 splits some ranges are empty
    ([(200, 1), (0, 37), (3, 1), (90, 20), (0, 1)], 1),  # a mixed batch's decode rows (prefill programs never arrive)
])  # fmt: skip
@pytest.mark.parametrize("block_size,head_dim,group,dtype", [(16, 128, 4, torch.float16), (32, 64, 2, torch.float32)])
def test_the_last_split_to_finish_merges_with_the_merge_kernels_bits(num_splits, specs, decode_splits_in_mixed,
                                                                    block_size, head_dim, group, dtype, launch_grids,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """``FUSE_DECODE_MERGE``: one merge launch fewer a split decode launch, the same output bits
    as with it, the oracles' result, and every arrival counter back at zero for the next launch
    (two layers run, one after the other)."""
    from siesta import arrivals
    from siesta.attention import triton_attention, triton_kernels

    outs, merges = [], []
    for fused in (False, True):
        monkeypatch.setattr(triton_attention, "FUSE_DECODE_MERGE", fused)
        monkeypatch.setattr(arrivals, "_counters", {})
        merge_grids = launch_grids(triton_kernels, "reduce_splits_kernel")
        split_grids = launch_grids(triton_kernels, "decode_split_kernel")
        batch = make_batch(specs, group, head_dim, block_size, dtype, seed=23)
        backend = TritonAttention(decode_splits=num_splits, mixed_decode_min_splits=decode_splits_in_mixed)
        for layer in (0, LAYER):
            out = poisoned_like(batch.q)
            backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, layer, batch.meta, batch.scale, out=out)
        outs.append(out)
        split_launches = sum(grid[2] > 1 for grid in split_grids)
        assert split_launches == 2  # both layers split their decode rows: the case under test
        merges.append(len(merge_grids))
        if fused:
            assert arrivals._counters[batch.q.device].count_nonzero() == 0
    assert merges[1] == merges[0] - split_launches
    check_against_oracles(batch, backend, outs[1])
    assert torch.equal(outs[0], outs[1])
