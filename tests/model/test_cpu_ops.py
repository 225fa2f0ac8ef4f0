"""The CPU's C kernels of a layer's small ops (RMSNorm with its residual add, rotary,
SiLU-and-multiply) against the torch code they replace, through the layers that call them.

Rotary and the products must match torch bit for bit. RMSNorm's fp32 sum of squares may
round differently in another order: on inputs on a 1/16 grid every partial sum is exact, so
there it too must match bit for bit; random inputs agree within that sum's error. SiLU's exp
is the kernel's own (within a few ulp of torch's). Every test runs on each build the machine
can run (c_marches.MARCHES: native, and AVX2 on x86-64): the rounding rules hold for each.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F
from c_marches import MARCHES, kernel_for, serving

from siesta.model import cpu_ops
from siesta.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul

pytestmark = pytest.mark.skipif(cpu_ops.load_ops() is None, reason="no C compiler: the layers run torch")

EPS = 1e-6
ROPE = {"rope_type": "default", "rope_theta": 10000.0}


@pytest.fixture(scope="module", params=MARCHES)
def lib(request: pytest.FixtureRequest):
    """The build for ``request.param``, which the layers then call."""
    with serving(cpu_ops, "load_ops", kernel_for(request.param, cpu_ops.load_ops)) as built:
        yield built


@pytest.fixture(autouse=True)
def _each_build(lib: ctypes.CDLL) -> None:
    """Every test below, once per build."""


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _grid(shape, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-48, 49, shape, generator=gen).float() / 16


def _norm(dim: int, gen: torch.Generator) -> RMSNorm:
    norm = RMSNorm(dim, EPS)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.2 * torch.randn(dim, generator=gen))
    return norm


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.mark.parametrize("rows,dim", [(1, 576), (37, 576), (300, 64), (5, 17)])
@torch.inference_mode()
def test_rms_norm_and_its_residual_add_match_torch_bit_for_bit_on_exact_sums(rows: int, dim: int) -> None:
    gen = _gen(rows * dim)
    norm = _norm(dim, gen)
    x, residual = _grid((rows, dim), gen), _grid((rows, dim), gen)
    assert torch.equal(norm(x), norm._reference(x))
    normed, total = norm.add_and_norm(x, residual)
    assert torch.equal(total, x + residual)
    assert torch.equal(normed, norm._reference(x + residual))


@torch.inference_mode()
def test_rms_norm_of_random_rows_agrees_within_the_sums_error_and_takes_strided_rows() -> None:
    gen = _gen(1)
    norm = _norm(576, gen)
    wide = torch.randn(64, 960, generator=gen) * 3
    x = wide[:, :576]  # row stride 960, as a slice of a fused projection
    torch.testing.assert_close(norm(x), norm._reference(x.contiguous()), rtol=5e-7, atol=1e-7)
    residual = torch.randn(64, 576, generator=gen)
    normed, total = norm.add_and_norm(x, residual)
    assert torch.equal(total, x + residual)
    torch.testing.assert_close(normed, norm._reference(x + residual), rtol=5e-7, atol=1e-7)


@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 9, 3, 64), (257, 9, 3, 64), (40, 4, 4, 128), (3, 2, 1, 6)])
@torch.inference_mode()
def test_rotary_matches_torch_bit_for_bit_on_the_fused_projections_views(
    tokens: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    gen = _gen(tokens)
    rotary = RotaryEmbedding(head_dim, 4096, ROPE)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 4
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # strided views, as the model makes them
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    rq, rk = rotary(positions, q, k)
    cos, sin = rotary.cos[positions][:, None, :], rotary.sin[positions][:, None, :]
    assert torch.equal(rq, q * cos + _rotate_half(q) * sin)
    assert torch.equal(rk, k * cos + _rotate_half(k) * sin)


@torch.inference_mode()
def test_rotary_past_its_tables_is_left_to_torch_which_raises() -> None:
    rotary = RotaryEmbedding(64, 16, ROPE)
    q, k = torch.randn(2, 9, 64), torch.randn(2, 3, 64)
    assert cpu_ops.rope(q, k, torch.tensor([3, 16]), rotary.cos, rotary.sin) is None
    with pytest.raises(IndexError):
        rotary(torch.tensor([3, 16]), q, k)


@pytest.mark.parametrize("rows,dim", [(1, 1536), (77, 1536), (4, 13)])
@torch.inference_mode()
def test_silu_and_mul_agrees_with_torch_within_a_few_ulp(rows: int, dim: int) -> None:
    gen = _gen(rows)
    gate_up = torch.randn(rows, 2 * dim, generator=gen) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(gate_up), F.silu(gate) * up, rtol=1e-6, atol=1e-30)


@torch.inference_mode()
def test_silu_and_mul_at_the_edges_of_exp() -> None:
    gate = torch.tensor([-1e4, -100.0, -87.0, -20.0, -0.0, 0.0, 1e-30, 3.0, 88.0, 1e4, float("inf"), float("nan")])
    out = silu_and_mul(torch.cat([gate, torch.full_like(gate, 2.0)])[None])[0]
    ref = F.silu(gate) * 2.0
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-33, equal_nan=True)


def test_other_dtypes_and_a_wanted_backward_run_torch() -> None:
    gen = _gen(3)
    norm = _norm(32, gen)
    x = torch.randn(4, 32, generator=gen)
    assert cpu_ops.rms_norm(x.double(), norm.weight.double(), EPS) is None
    assert cpu_ops.silu_and_mul(x.bfloat16()) is None
    assert cpu_ops.rms_norm(x, norm.weight, EPS) is None  # grad mode with a parameter that wants one
    out = norm(x)
    out.sum().backward()
    assert norm.weight.grad is not None
    with torch.inference_mode():
        assert cpu_ops.rms_norm(x[None], norm.weight, EPS) is None  # 3-d: Qwen3's per-head norms
        assert cpu_ops.silu_and_mul(x[:, :31]) is None  # odd width
