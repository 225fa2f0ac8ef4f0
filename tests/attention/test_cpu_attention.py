"""CPU attention: the compiled decode kernel against dense attention, its fallbacks, and the default
backend. Every test runs on each build the machine can run (c_marches.MARCHES: native, and AVX2
on x86-64)."""

from __future__ import annotations

import ctypes
import math
import random

import pytest
import torch
from c_marches import MARCHES, kernel_for, serving
from paged_batch import KV_HEADS, LAYER, decode_batch, dense_decode, require_kernel

from siesta.attention import cpu_attention
from siesta.attention.cpu_attention import MAX_Q_HEADS, MAX_STATE, CpuAttention, _balanced_bounds, load_kernel
from siesta.attention.select import get_attention_backend
from siesta.cache_dir import CACHE_DIR_ENV

# The kernel's exp against float64 exp, in units in the last place of the fp32 result.
EXP_MAX_ULP = 2
# Below this the kernel's exp returns 0 (exp(EXP_ZERO_BELOW) = 2^-126, the smallest normal fp32).
EXP_ZERO_BELOW = math.log(2.0**-126)
EXP_SWEEP_POINTS = 1_000_001
INT_RANGE = 8  # test_extreme_score_gaps: entries in [-8, 8], so 64-dim scores span hundreds


def _run(backend, q, cache, meta, rows=None) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))
    rows = list(range(meta.num_reqs)) if rows is None else rows
    backend._decode(q, cache, LAYER, meta, q.shape[-1] ** -0.5, rows, out)
    return out


@pytest.fixture(scope="module", params=MARCHES)
def lib(request: pytest.FixtureRequest):
    """The build for ``request.param``, which CpuAttention then calls too."""
    require_kernel(lambda: load_kernel(request.param))
    with serving(cpu_attention, "load_kernel", kernel_for(request.param, load_kernel)) as built:
        yield built


@pytest.fixture(autouse=True)
def _each_build(lib: ctypes.CDLL) -> None:
    """Every test below, once per build."""


# (2, 24, 7): a head_dim with no unrolled copy, not a multiple of the vector width, and blocks
# whose keys do not split into the value loop's groups of four.
@pytest.mark.parametrize("group,head_dim,block", [(1, 16, 4), (3, 64, 16), (4, 128, 16), (8, 64, 32), (2, 24, 7)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_matches_dense_attention(group: int, head_dim: int, block: int, threads: int) -> None:
    rng = random.Random(group * 100 + head_dim + threads)
    lens = [rng.randint(1, 5 * block + 3) for _ in range(11)] + [1, block, block + 1]
    q, cache, meta = decode_batch(lens, seed=threads, group=group, head_dim=head_dim, block=block)
    out = _run(CpuAttention(num_threads=threads), q, cache, meta)
    torch.testing.assert_close(out, dense_decode(q, cache, meta, head_dim**-0.5), rtol=1e-5, atol=1e-5)


class _PastBuild:
    """A build from before ``paged_decode_parts`` (the benchmark's baseline): only the row-range call."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.paged_decode = lib.paged_decode


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_past_build_splits_rows_over_python_threads(threads: int, lib: ctypes.CDLL) -> None:
    q, cache, meta = decode_batch([40, 3, 77, 16, 1, 25], seed=threads, group=3, head_dim=64, block=16)
    backend = CpuAttention(num_threads=threads, kernel=_PastBuild(lib))
    out = _run(backend, q, cache, meta)
    torch.testing.assert_close(out, dense_decode(q, cache, meta, 64**-0.5), rtol=1e-5, atol=1e-5)
    assert backend._pool is not None  # the Python threads served it


def test_kernel_takes_a_large_group() -> None:
    """Past the old cap of 16 query heads per KV head: the kernel keeps state per query head."""
    q, cache, meta = decode_batch([33, 5, 64, 17], seed=5, group=32, head_dim=64, block=16)
    out = torch.empty_like(q)
    assert CpuAttention._takes(q, cache.layer(LAYER)[0], out)
    torch.testing.assert_close(_run(CpuAttention(num_threads=2), q, cache, meta),
                               dense_decode(q, cache, meta, q.shape[-1] ** -0.5), rtol=1e-5, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("group,head_dim", [(40, 128), (MAX_Q_HEADS // KV_HEADS + 1, 16)])
def test_too_many_heads_take_the_torch_path(group: int, head_dim: int) -> None:
    q, cache, meta = decode_batch([9, 20], seed=6, group=group, head_dim=head_dim)
    assert q.shape[1] > MAX_Q_HEADS or q.shape[1] * head_dim > MAX_STATE
    assert not CpuAttention._takes(q, cache.layer(LAYER)[0], torch.empty_like(q))
    torch.testing.assert_close(_run(CpuAttention(), q, cache, meta), dense_decode(q, cache, meta, head_dim**-0.5),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_extreme_score_gaps() -> None:
    """Scores hundreds apart: weights far below the max's underflow to 0, none turns NaN. Small
    integers make every score exact in fp32, so no summation order can tell the two paths apart."""
    q, cache, meta = decode_batch([3, 16, 29, 50], seed=8, head_dim=64, block=16)
    gen = torch.Generator().manual_seed(9)
    cache.tensor.copy_(torch.randint(-INT_RANGE, INT_RANGE + 1, cache.tensor.shape, generator=gen))
    q = torch.randint(-INT_RANGE, INT_RANGE + 1, q.shape, generator=gen).float()
    out = torch.full_like(q, float("nan"))
    CpuAttention(num_threads=2)._decode(q, cache, LAYER, meta, 1.0, list(range(meta.num_reqs)), out)
    torch.testing.assert_close(out, dense_decode(q, cache, meta, 1.0), rtol=1e-5, atol=1e-5)


def test_kernel_exp_is_within_two_ulp_and_zero_at_the_far_end(lib: ctypes.CDLL) -> None:
    lib.decode_exp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.decode_exp.restype = None

    def kernel_exp(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(x)
        lib.decode_exp(x.data_ptr(), y.data_ptr(), x.numel())
        return y

    x = torch.linspace(EXP_ZERO_BELOW + 1e-4, 0.0, EXP_SWEEP_POINTS)
    got, want = kernel_exp(x).double(), x.double().exp()
    ulp = (want.float().nextafter(torch.tensor(float("inf"))) - want.float()).double()
    assert ((got - want).abs() / ulp).max().item() <= EXP_MAX_ULP
    special = torch.tensor([0.0, -0.0, -1e-30, EXP_ZERO_BELOW - 1e-3, -88.0, -1e4, -1e30, -float("inf")])
    assert kernel_exp(special).tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_kernel_writes_only_its_rows_and_reads_strided_queries() -> None:
    lens = [9, 30, 4, 17, 25]
    q, cache, meta = decode_batch(lens, seed=7)
    wide = torch.randn(q.shape[0], q.shape[1], 2 * q.shape[2])
    wide[..., : q.shape[2]] = q
    strided = wide[..., : q.shape[2]]  # a view, as a fused projection's split gives
    rows = [1, 3, 4]
    out = _run(CpuAttention(num_threads=2), strided, cache, meta, rows)
    dense = dense_decode(q, cache, meta, q.shape[-1] ** -0.5)
    torch.testing.assert_close(out[rows], dense[rows], rtol=1e-5, atol=1e-5)
    assert out[[0, 2]].isnan().all(), "rows not asked for are left alone"


def test_unsupported_dtype_takes_the_torch_path() -> None:
    q, cache, meta = decode_batch([12, 7, 20], seed=3)
    wide = type(cache)(cache.tensor.to(torch.float64))
    out = torch.empty_like(q, dtype=torch.float64)
    CpuAttention()._decode(q.double(), wide, LAYER, meta, q.shape[-1] ** -0.5, [0, 1, 2], out)
    torch.testing.assert_close(out.float(), dense_decode(q, cache, meta, q.shape[-1] ** -0.5), rtol=1e-5, atol=1e-5)


def test_without_a_compiler_the_torch_path_serves(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    load_kernel.cache_clear()
    try:
        assert load_kernel() is None
    finally:
        load_kernel.cache_clear()
    monkeypatch.setattr(cpu_attention, "load_kernel", lambda march=None: None)
    q, cache, meta = decode_batch([5, 40, 13], seed=4)
    torch.testing.assert_close(_run(CpuAttention(), q, cache, meta), dense_decode(q, cache, meta, q.shape[-1] ** -0.5),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_loading_the_kernel_keeps_subnormal_floats(lib: ctypes.CDLL) -> None:
    """A library built with -ffast-math would switch the whole process to flush-to-zero."""
    assert lib is not None
    tiny = 5e-324  # the smallest subnormal double
    assert tiny * 1.0 > 0.0 and 2.2250738585072014e-308 / 2 > 0.0
    assert torch.tensor(1e-40, dtype=torch.float32).item() > 0.0


def test_cpu_default_backend_is_the_kernel_one() -> None:
    assert isinstance(get_attention_backend("auto", torch.device("cpu")), CpuAttention)
    assert type(get_attention_backend("torch", torch.device("cpu"))).__name__ == "TorchAttention"


def test_balanced_bounds_split_context_evenly() -> None:
    assert _balanced_bounds([10] * 8, 2) == [0, 4, 8]
    assert _balanced_bounds([100, 1, 1, 1], 2) == [0, 1, 4]
    assert _balanced_bounds([5, 5], 1) == [0, 2]
    assert _balanced_bounds([5], 3) == [0, 1, 1, 1]
    assert KV_HEADS > 1  # the batches above exercise more than one KV head per row


@pytest.mark.parametrize("tokens", [1, 37, 300])
def test_written_kv_rows_are_torchs_writes_bit_for_bit(tokens: int) -> None:
    """The row copies into shuffled slots, from strided views of a fused projection, against
    torch's two-index assignment; every other slot of every layer is left alone."""
    from siesta.attention.base import KVCache
    from siesta.attention.torch_ref import write_kv

    gen = torch.Generator().manual_seed(tokens)
    kv_heads, head_dim, block, layers = 3, 64, 16, 4
    blocks = -(-tokens // block) + 3
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * head_dim, generator=gen)
    k = qkv[:, 9 * head_dim : (9 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (9 + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(blocks * block, generator=gen)[:tokens]
    ours = KVCache.allocate(blocks, layers, block, kv_heads, head_dim, torch.float32, torch.device("cpu"))
    theirs = KVCache.allocate(blocks, layers, block, kv_heads, head_dim, torch.float32, torch.device("cpu"))
    for cache in (ours, theirs):
        cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=torch.Generator().manual_seed(0)))
    backend = CpuAttention(num_threads=2)
    assert cpu_attention._rows_copy(k, v, ours.layer(2)[0], slots)
    backend._write_kv(k, v, ours, 2, slots)
    write_kv(k, v, theirs, 2, slots)
    assert torch.equal(ours.tensor, theirs.tensor)


def test_kv_writes_it_does_not_take_go_through_torch() -> None:
    from siesta.attention.base import KVCache

    cache = KVCache.allocate(2, 1, 4, 2, 8, torch.float32, torch.device("cpu"))
    k = torch.randn(3, 2, 8)
    slots = torch.tensor([5, 0, 2])
    assert not cpu_attention._rows_copy(k.double(), k.double(), cache.layer(0)[0], slots)
    assert not cpu_attention._rows_copy(k, k, cache.layer(0)[0], slots.int())
    assert not cpu_attention._rows_copy(k.transpose(1, 2).contiguous().transpose(1, 2), k, cache.layer(0)[0], slots)
    CpuAttention(num_threads=1)._write_kv(k, k * 2, cache, 0, slots.int())  # through torch's assignment
    assert torch.equal(cache.layer(0)[0][1, 1], k[0]) and torch.equal(cache.layer(0)[1][0, 2], 2 * k[2])
