"""The compiled prefill kernel (``cpu_prefill.c``) against float64 dense attention, and its
fallbacks. Every test runs on each build the machine can run (c_marches.MARCHES: native, and
AVX2 on x86-64), whose tiles, and so the shapes it takes, differ."""

from __future__ import annotations

import ctypes
import random

import pytest
import torch
from c_marches import MARCHES, kernel_for, serving
from paged_batch import LAYER, dense_prefill, prefill_batch, require_kernel

from siesta.attention import cpu_attention
from siesta.attention.cpu_attention import CpuAttention, load_prefill_kernel, prefill_limits
from siesta.attention.torch_ref import TorchAttention

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
INT_RANGE = 8  # test_extreme_score_gaps: entries in [-8, 8], so 64-dim scores span hundreds
# test_a_long_chunk_after_a_long_prefix: values around this mean, as a model's value channels
# have, and how close to float64 the outputs (|out| ~ 4) must be at any context length. torch's
# SDPA is within 2.1e-6 there; the kernel summing every key into one fp32 accumulator was 1.7e-5.
VALUE_MEAN = 4.0
LONG_CONTEXT_TOLERANCE = {"rtol": 1.5e-6, "atol": 1e-6}


@pytest.fixture(scope="module", params=MARCHES)
def lib(request: pytest.FixtureRequest):
    """The build for ``request.param``, which CpuAttention then calls too."""
    require_kernel(lambda: load_prefill_kernel(request.param))
    with serving(cpu_attention, "load_prefill_kernel", kernel_for(request.param, load_prefill_kernel)) as built:
        yield built


@pytest.fixture(autouse=True)
def _each_build(lib: ctypes.CDLL) -> None:
    """Every test below, once per build."""


@pytest.fixture
def threads(request: pytest.FixtureRequest):
    """The kernel's OpenMP threads are torch's: run with ``request.param`` of them."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _forward(backend, q, k, v, cache, meta, scale: float) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))
    return backend.forward(q, k, v, cache, LAYER, meta, scale, out)


def _chunks(rng: random.Random, block: int) -> list[tuple[int, int]]:
    """Whole prompts, chunks after a cached prefix, decode rows, and the edges of the kernel's
    tiles (48 query rows under AVX-512, 24 under AVX2) and chunks (64 keys)."""
    out = [(rng.randint(2, 130), 0) for _ in range(4)] + [(2, 2), (63, 64), (65, 65), (16, 16 + 3 * block)]
    out = [(n, ctx or n) for n, ctx in out]
    out += [(n, n + rng.randint(1, 150)) for n in (rng.randint(2, 90) for _ in range(3))]
    out += [(1, rng.randint(1, 200)) for _ in range(2)]  # decode rows in the same step
    rng.shuffle(out)
    return out


# group 0: the build's largest (48 under AVX-512, 24 under AVX2), every row of a task one token's.
@pytest.mark.parametrize("group,head_dim,block", [(1, 64, 16), (3, 64, 16), (5, 64, 7), (8, 128, 32), (0, 64, 1)])
@pytest.mark.parametrize("threads", [1, 2, 3], indirect=True)
def test_kernel_matches_dense_attention(group: int, head_dim: int, block: int, threads: int, lib) -> None:
    group = group or prefill_limits(lib)[0]
    rng = random.Random(group * 100 + head_dim + block + threads)
    q, k, v, cache, meta, whole = prefill_batch(_chunks(rng, block), seed=threads, group=group, head_dim=head_dim,
                                                block=block)  # fmt: skip
    assert CpuAttention._takes_prefill(q, cache.layer(LAYER)[0], q, lib)
    out = _forward(CpuAttention(num_threads=2), q, k, v, cache, meta, head_dim**-0.5)
    torch.testing.assert_close(out.double(), dense_prefill(q, meta, whole, head_dim**-0.5), **TOLERANCE)


def test_a_long_prompt_and_a_long_prefix() -> None:
    """Many tiles and key chunks: a 700-token prompt and a 300-token chunk after a 900-token prefix."""
    q, k, v, cache, meta, whole = prefill_batch([(700, 700), (300, 1200)], seed=11, group=3)
    out = _forward(CpuAttention(num_threads=2), q, k, v, cache, meta, 0.125)
    torch.testing.assert_close(out.double(), dense_prefill(q, meta, whole, 0.125), **TOLERANCE)


def test_a_long_chunk_after_a_long_prefix() -> None:
    """The second 2,048-token chunk of a 4,096-token prompt: every row sees 2,049-4,096 keys.
    Values share a mean, so each key's weighted value adds to a sum that keeps growing: the
    chunk's P V must be summed apart and added to the rescaled output once a chunk of keys, or
    each of 4,000 keys is rounded against the sum of all before it and the error grows with
    the context (1.7e-5 here, 2.4x this tolerance). One KV head of one query head is enough."""
    q, k, v, cache, meta, whole = prefill_batch([(2048, 4096)], seed=13, group=1, kv_heads=1)
    with torch.no_grad():
        for values in (v, cache.layer(LAYER)[1], whole[0][1]):  # the new rows, the cached prefix, the oracle's
            values.add_(VALUE_MEAN)
    out = _forward(CpuAttention(num_threads=2), q, k, v, cache, meta, 0.125)
    torch.testing.assert_close(out.double(), dense_prefill(q, meta, whole, 0.125), **LONG_CONTEXT_TOLERANCE)


def test_extreme_score_gaps() -> None:
    """Scores hundreds apart: weights far below the max's underflow to 0, none turns NaN. Small
    integers make every score exact in fp32, so no summation order tells the paths apart."""
    q, k, v, cache, meta, whole = prefill_batch([(40, 40), (30, 100), (70, 70)], seed=8, int_range=INT_RANGE)
    out = _forward(CpuAttention(num_threads=2), q, k, v, cache, meta, 1.0)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), dense_prefill(q, meta, whole, 1.0), **TOLERANCE)


def test_kernel_writes_only_prompt_rows() -> None:
    """The kernel fills its requests' rows, whatever q's row stride; the decode row between
    them is the decode kernel's, and stays as it was."""
    q, k, v, cache, meta, whole = prefill_batch([(9, 9), (1, 30), (20, 50)], seed=3)
    assert q.stride(0) > q.shape[1] * q.shape[2], "q is a view of the fused projection"
    backend = CpuAttention(num_threads=2)
    backend._write_kv(k, v, cache, LAYER, meta.slot_mapping)
    out = torch.full_like(q, float("nan"))
    backend._prefill_rows(q, k, v, cache, LAYER, meta, 0.125, [0, 2], out)
    prompts = [*range(9), *range(10, 30)]
    torch.testing.assert_close(out[prompts].double(), dense_prefill(q, meta, whole, 0.125)[prompts], **TOLERANCE)
    assert out[9].isnan().all(), "the decode row is left alone"


# In units of the build's limits: half a register tile of head_dim, 1.5 tiles, a group too large.
@pytest.mark.parametrize("group,tiles", [(3, 0.5), (3, 1.5), (None, 1)])
def test_shapes_it_does_not_take_go_through_torch(group: int | None, tiles: float, lib) -> None:
    max_group, dim_tile = prefill_limits(lib)
    group, head_dim = group or max_group + 1, int(tiles * dim_tile)
    q, k, v, cache, meta, whole = prefill_batch([(20, 20), (7, 40)], seed=5, group=group, head_dim=head_dim,
                                                kv_heads=1)  # fmt: skip
    assert head_dim % dim_tile != 0 or group > max_group
    assert not CpuAttention._takes_prefill(q, cache.layer(LAYER)[0], q, lib)
    out = _forward(CpuAttention(num_threads=2), q, k, v, cache, meta, head_dim**-0.5)
    torch.testing.assert_close(out.double(), dense_prefill(q, meta, whole, head_dim**-0.5), **TOLERANCE)


def test_other_dtypes_go_through_torch(lib) -> None:
    q, k, v, cache, meta, whole = prefill_batch([(20, 20), (7, 40)], seed=6, group=3)
    wide = type(cache)(cache.tensor.double())
    assert not CpuAttention._takes_prefill(q.double(), wide.layer(LAYER)[0], q.double(), lib)
    out = _forward(CpuAttention(num_threads=2), q.double(), k.double(), v.double(), wide, meta, 0.125)
    torch.testing.assert_close(out, dense_prefill(q, meta, whole, 0.125), **TOLERANCE)


class _FailingKernel:
    """A prefill kernel whose threads could not allocate their buffers (it returns -1)."""

    limits = (48, 64)  # prefill_limits: the AVX-512 build's

    def __init__(self) -> None:
        self.calls = 0

    def paged_prefill(self, *args) -> int:
        self.calls += 1
        return -1


@pytest.mark.parametrize("kernel", [None, "failing"])
def test_without_the_kernel_the_torch_path_serves(kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler (no kernel), or a kernel that could not run: torch's SDPA answers instead."""
    lib = _FailingKernel() if kernel else None
    monkeypatch.setattr(cpu_attention, "load_prefill_kernel", lambda march=None: lib)
    q, k, v, cache, meta, whole = prefill_batch([(33, 33), (12, 70), (1, 20)], seed=7, group=3)
    out = _forward(CpuAttention(num_threads=2), q, k, v, cache, meta, 0.125)
    torch.testing.assert_close(out.double(), dense_prefill(q, meta, whole, 0.125), **TOLERANCE)
    assert lib is None or lib.calls == 1


def test_the_kernel_and_torchs_sdpa_agree() -> None:
    """The two CPU paths on one batch: within fp32 rounding of each other."""
    chunks = [(150, 150), (64, 500), (1, 90), (300, 300)]
    ours = _forward(CpuAttention(num_threads=2), *prefill_batch(chunks, seed=12)[:5], 0.125)
    theirs = _forward(TorchAttention(), *prefill_batch(chunks, seed=12)[:5], 0.125)
    torch.testing.assert_close(ours, theirs, **TOLERANCE)
