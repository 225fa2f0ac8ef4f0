"""Fused Triton ops (RMSNorm, add + RMSNorm, SiLU-and-mul, RoPE, q/k norm + RoPE) against the torch
code they replace.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set
before triton is imported). The interpreter's bf16 arithmetic is unreliable, so
bf16 is only tested on CUDA.

Results must be bit-identical (``torch.equal``) to torch, with two exceptions that
no kernel can remove, each tested bit-exactly on inputs where it cannot show:

* RMSNorm's sum of squares: torch's summation order depends on the device, the
  CPU's vector width and (on CUDA) the batch size, so the fp32 sum may differ in
  its last bit. Inputs on a 1/16 grid make every partial sum exact, hence the sum
  independent of order: there the whole op must match bit for bit. Random inputs
  must agree within the error of that sum.
* SiLU's exp on CPU: torch uses SLEEF's expf, the interpreter numpy's; they differ
  in the last bit for about 40% of fp32 inputs. On CPU the bit-exact reference is
  torch's SiLU formula with numpy's exp; on CUDA it is F.silu itself (the kernel
  calls libdevice's expf, as torch does).
"""

from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")


# @triton.jit reads TRITON_INTERPRET when a kernel is defined: modules imported
# before the flag was set must be loaded again.
for _name in ("siesta.model.triton_ops",):
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])

from siesta.model.layers import RMSNorm, RotaryEmbedding
from siesta.model.triton_ops import apply_rope, fused_add_rms_norm, qk_norm_rope, rms_norm, silu_and_mul

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
EPS = 1e-6
ROPE_PARAMS = {"rope_type": "default", "rope_theta": 10000.0}
MAX_POSITIONS = 4096


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(shape, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _grid_values(shape, dtype: torch.dtype, gen: torch.Generator, limit: int = 48) -> torch.Tensor:
    """Multiples of 1/16 up to 3 (exact in every dtype): their squares are multiples of
    1/256 and any partial sum of up to ~7000 of them is an exact fp32 number."""
    return (torch.randint(-limit, limit + 1, shape, generator=gen).float() / 16).to(dtype).to(DEVICE)


def _weight(dim: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return (1.0 + 0.2 * torch.randn(dim, generator=gen)).to(dtype).to(DEVICE)


def _reference_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The torch code of ``RMSNorm``, spelled out: the class runs the Triton kernel on CUDA and
    a C kernel on the CPU (tests/model/test_cpu_ops.py); its torch code is checked here too."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    ref = weight * x32.to(dtype)
    if not ON_GPU:
        norm = RMSNorm(weight.shape[0], EPS).to(dtype=weight.dtype)
        with torch.no_grad():
            norm.weight.copy_(weight)
            assert torch.equal(norm._reference(x), ref), "RMSNorm's torch code changed: update this reference"
    return ref


def _reference_rope(rotary: RotaryEmbedding, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    """The torch code of ``RotaryEmbedding.forward``, spelled out (see _reference_norm)."""

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    cos = rotary.cos[positions].to(q.dtype)[:, None, :]
    sin = rotary.sin[positions].to(q.dtype)[:, None, :]
    ref = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    if not ON_GPU:
        q_cls, k_cls = rotary(positions, q, k)
        assert torch.equal(q_cls, ref[0]) and torch.equal(k_cls, ref[1]), "RotaryEmbedding changed: update"
    return ref


def _assert_within_sum_error(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Random inputs: a sum of squares that rounds differently in its last bit(s) scales
    a whole fp32 row by a few ulp (measured: up to ~3.5e-7 relative, in ~25% of rows)
    and flips the odd half-precision element by one ulp (~1e-5 of the elements)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    rtol = {torch.float32: 5e-7, torch.float16: 2**-10, torch.bfloat16: 2**-7}[ref.dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=0)
    if ref.dtype != torch.float32:
        # Rounding to the half type hides the sum's error almost always.
        assert (out != ref).float().mean().item() < 1e-3


def _fused_qkv(num_tokens: int, q_heads: int, kv_heads: int, head_dim: int, dtype, gen, grid: bool = False):
    """q, k, v as strided views of one projection output, as the model produces them."""
    width = (q_heads + 2 * kv_heads) * head_dim
    make = _grid_values if grid else _randn
    qkv = make((num_tokens, width), dtype, gen)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (
        q.view(num_tokens, q_heads, head_dim),
        k.view(num_tokens, kv_heads, head_dim),
        v.view(num_tokens, kv_heads, head_dim),
    )


# ---------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,dim", [(1, 576), (37, 576), (37, 64), (5, 128), (3, 100)])
def test_rms_norm_bit_identical_on_exact_sums(dtype, num_tokens, dim):
    gen = _gen(num_tokens * 1000 + dim)
    x = _grid_values((num_tokens, dim), dtype, gen)
    x[0, : dim // 2] = 0  # a row with zeros (and, for T=1, fewer terms)
    weight = _weight(dim, dtype, gen)
    out = rms_norm(x, weight, EPS)
    assert torch.equal(out, _reference_norm(x, weight))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,dim", [(1, 576), (37, 576), (37, 128)])
def test_rms_norm_random_inputs(dtype, num_tokens, dim):
    gen = _gen(7 + num_tokens + dim)
    x = _randn((num_tokens, dim), dtype, gen, scale=3.0)
    weight = _weight(dim, dtype, gen)
    _assert_within_sum_error(rms_norm(x, weight, EPS), _reference_norm(x, weight))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,q_heads,kv_heads,head_dim", [(1, 9, 3, 64), (37, 9, 3, 64), (6, 4, 2, 128)])
def test_qk_norm_on_strided_heads(dtype, num_tokens, q_heads, kv_heads, head_dim):
    """Qwen3's q/k norm: [T, H, D] views of the qkv projection, normalised per head."""
    gen = _gen(11 + num_tokens + q_heads + head_dim)
    q, k, _ = _fused_qkv(num_tokens, q_heads, kv_heads, head_dim, dtype, gen, grid=True)
    assert num_tokens == 1 or not q.is_contiguous()  # torch drops the stride of a size-1 dim
    q_weight, k_weight = _weight(head_dim, dtype, gen), _weight(head_dim, dtype, gen)
    for t, weight in ((q, q_weight), (k, k_weight)):
        out = rms_norm(t, weight, EPS)
        assert out.shape == t.shape and out.is_contiguous()
        assert torch.equal(out, _reference_norm(t, weight))

    q, k, _ = _fused_qkv(num_tokens, q_heads, kv_heads, head_dim, dtype, gen)
    _assert_within_sum_error(rms_norm(q, q_weight, EPS), _reference_norm(q, q_weight))
    _assert_within_sum_error(rms_norm(k, k_weight, EPS), _reference_norm(k, k_weight))


def test_rms_norm_fp32_weight_promotes_like_torch():
    """A weight of another dtype: the product (and result dtype) follow torch's promotion."""
    gen = _gen(3)
    x = _grid_values((4, 576), torch.float16, gen)
    weight = _weight(576, torch.float32, gen)
    out = rms_norm(x, weight, EPS)
    assert out.dtype == torch.float32
    assert torch.equal(out, _reference_norm(x, weight))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,dim", [(1, 576), (37, 576), (37, 64), (5, 128)])
def test_fused_add_rms_norm(dtype, num_tokens, dim):
    gen = _gen(100 + num_tokens + dim)
    weight = _weight(dim, dtype, gen)

    # Exact sums: both outputs bit-identical.
    x = _grid_values((num_tokens, dim), dtype, gen, limit=24)
    residual = _grid_values((num_tokens, dim), dtype, gen, limit=24)
    x_before, residual_before = x.clone(), residual.clone()
    normed, summed = fused_add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs were modified"
    expected_sum = x + residual
    assert torch.equal(summed, expected_sum)
    assert torch.equal(normed, _reference_norm(expected_sum, weight))

    # Random inputs: the sum (elementwise) is still exact, the norm within the sum-of-squares error.
    x = _randn((num_tokens, dim), dtype, gen, scale=2.0)
    residual = _randn((num_tokens, dim), dtype, gen, scale=2.0)
    normed, summed = fused_add_rms_norm(x, residual, weight, EPS)
    expected_sum = x + residual
    assert torch.equal(summed, expected_sum)
    _assert_within_sum_error(normed, _reference_norm(expected_sum, weight))


def test_rms_norm_empty():
    weight = _weight(64, torch.float32, _gen(0))
    x = torch.empty(0, 64, device=DEVICE)
    assert rms_norm(x, weight, EPS).shape == (0, 64)
    normed, summed = fused_add_rms_norm(x, x, weight, EPS)
    assert normed.shape == summed.shape == (0, 64)


# ----------------------------------------------------------------------- SiLU-and-mul


def _silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """Bit-exact reference: F.silu on CUDA; on CPU the same fp32 formula with numpy's exp."""
    gate, up = gate_up.split([gate_up.shape[-1] // 2] * 2, dim=-1)
    if ON_GPU:
        return F.silu(gate) * up
    g = gate.float()
    with np.errstate(over="ignore"):  # exp(90) is inf, as in the kernel
        e = torch.from_numpy(np.exp(-g.numpy()))
    return (g / (1 + e)).to(gate.dtype) * up


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,inter", [(1, 1536), (37, 1536), (37, 100), (4, 64)])
def test_silu_and_mul(dtype, num_tokens, inter):
    gen = _gen(200 + num_tokens + inter)
    gate_up = _randn((num_tokens, 2 * inter), dtype, gen, scale=4.0)
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 20.0, -20.0, 90.0, -90.0, 1e-3, -1e-3], dtype=dtype)
    out = silu_and_mul(gate_up)
    assert out.shape == (num_tokens, inter) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, _silu_mul_reference(gate_up))

    # And torch's own F.silu, whose CPU exp (SLEEF) may differ from numpy's in the last bit:
    # fp32 by an ulp or two; a half SiLU rarely flips by one ulp, which the product can
    # round into two.
    gate, up = gate_up.split([inter, inter], dim=-1)
    rtol = {torch.float32: 5e-7, torch.float16: 2**-9, torch.bfloat16: 2**-6}[dtype]
    torch.testing.assert_close(out.float(), (F.silu(gate) * up).float(), rtol=rtol, atol=1e-30)


def test_silu_and_mul_strided_rows():
    """Rows of a wider buffer (row stride != 2I)."""
    gen = _gen(5)
    wide = _randn((7, 3 * 96), torch.float16, gen)
    gate_up = wide[:, : 2 * 96]
    assert torch.equal(silu_and_mul(gate_up), _silu_mul_reference(gate_up))


# ------------------------------------------------------------------------------ RoPE


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens,q_heads,kv_heads,head_dim", [(1, 9, 3, 64), (37, 9, 3, 64), (37, 4, 2, 128), (3, 1, 1, 96)]
)
def test_apply_rope_on_qkv_views(dtype, num_tokens, q_heads, kv_heads, head_dim):
    gen = _gen(300 + num_tokens + q_heads + head_dim)
    rotary = RotaryEmbedding(head_dim, MAX_POSITIONS, ROPE_PARAMS).to(DEVICE)
    q, k, _ = _fused_qkv(num_tokens, q_heads, kv_heads, head_dim, dtype, gen)
    assert num_tokens == 1 or q.stride(0) != q_heads * head_dim  # torch drops the stride of a size-1 dim
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=gen).to(DEVICE)
    positions[0] = 0
    q_before, k_before = q.clone(), k.clone()

    q_out, k_out = apply_rope(q, k, positions, rotary.cos, rotary.sin)
    q_ref, k_ref = _reference_rope(rotary, positions, q, k)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert q_out.dtype == dtype and k_out.dtype == dtype
    assert torch.equal(q_out, q_ref)
    assert torch.equal(k_out, k_ref)
    assert torch.equal(q, q_before) and torch.equal(k, k_before), "inputs were modified"


@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_rope_contiguous_llama3_scaling(dtype):
    gen = _gen(17)
    params = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    }
    rotary = RotaryEmbedding(128, MAX_POSITIONS, params).to(DEVICE)
    q = _randn((11, 8, 128), dtype, gen, scale=2.0)
    k = _randn((11, 2, 128), dtype, gen, scale=2.0)
    positions = torch.arange(MAX_POSITIONS - 11, MAX_POSITIONS).to(DEVICE)
    q_out, k_out = apply_rope(q, k, positions, rotary.cos, rotary.sin)
    q_ref, k_ref = _reference_rope(rotary, positions, q, k)
    assert torch.equal(q_out, q_ref)
    assert torch.equal(k_out, k_ref)


def test_apply_rope_empty():
    rotary = RotaryEmbedding(64, 16, ROPE_PARAMS).to(DEVICE)
    q = torch.empty(0, 4, 64, device=DEVICE)
    k = torch.empty(0, 2, 64, device=DEVICE)
    positions = torch.empty(0, dtype=torch.int64, device=DEVICE)
    q_out, k_out = apply_rope(q, k, positions, rotary.cos, rotary.sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape


# ------------------------------------------------------------------- q/k norm + RoPE


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,q_heads,kv_heads,head_dim", [(1, 32, 4, 128), (37, 9, 3, 64), (5, 16, 8, 128)])
def test_qk_norm_rope_is_the_norms_then_the_rotation(dtype, num_tokens, q_heads, kv_heads, head_dim):
    """Qwen3's q/k norm and RoPE in one launch: on exact sums, the bits of the torch code (each
    head normed, then rotated); on random inputs, the three-launch Triton path's bits up to the
    norm's sum of squares."""
    gen = _gen(500 + num_tokens + q_heads + head_dim)
    rotary = RotaryEmbedding(head_dim, MAX_POSITIONS, {"rope_type": "default", "rope_theta": 1e6}).to(DEVICE)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=gen).to(DEVICE)
    q_weight, k_weight = _weight(head_dim, dtype, gen), _weight(head_dim, dtype, gen)
    q, k, _ = _fused_qkv(num_tokens, q_heads, kv_heads, head_dim, dtype, gen, grid=True)
    q_out, k_out = qk_norm_rope(q, k, positions, rotary.cos, rotary.sin, q_weight, k_weight, EPS, EPS)
    q_ref, k_ref = _reference_rope(rotary, positions, _reference_norm(q, q_weight), _reference_norm(k, k_weight))
    assert q_out.is_contiguous() and k_out.is_contiguous() and q_out.dtype == dtype
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)

    q, k, _ = _fused_qkv(num_tokens, q_heads, kv_heads, head_dim, dtype, gen)
    q_out, k_out = qk_norm_rope(q, k, positions, rotary.cos, rotary.sin, q_weight, k_weight, EPS, EPS)
    q_three, k_three = apply_rope(rms_norm(q, q_weight, EPS), rms_norm(k, k_weight, EPS), positions, rotary.cos,
                                  rotary.sin)  # fmt: skip
    _assert_within_rotated_sum_error(q_out, q_three)
    _assert_within_rotated_sum_error(k_out, k_three)


@pytest.mark.parametrize("per_program", [1, 4, 8])
def test_qk_norm_rope_split_over_programs_changes_no_bits(monkeypatch, per_program, launch_grids):
    """q heads in groups of 1, 4 or 8 programs (9 heads: a ragged last group) give the bits of one
    program for all of them: each head is its own norm."""
    from siesta.model import triton_ops

    gen = _gen(77)
    rotary = RotaryEmbedding(64, MAX_POSITIONS, {"rope_type": "default", "rope_theta": 1e6}).to(DEVICE)
    positions = torch.randint(0, MAX_POSITIONS, (3,), generator=gen).to(DEVICE)
    q_weight, k_weight = _weight(64, torch.float16, gen), _weight(64, torch.float16, gen)
    q, k, _ = _fused_qkv(3, 9, 3, 64, torch.float16, gen)
    whole = qk_norm_rope(q, k, positions, rotary.cos, rotary.sin, q_weight, k_weight, EPS, EPS)
    monkeypatch.setattr(triton_ops, "QK_NORM_Q_HEADS_PER_PROGRAM", per_program)
    grids = launch_grids(triton_ops, "_qk_norm_rope_kernel")
    split = qk_norm_rope(q, k, positions, rotary.cos, rotary.sin, q_weight, k_weight, EPS, EPS)
    assert grids == [(3, -(-9 // per_program) + 1)]  # q groups, then one program for the k heads
    assert torch.equal(split[0], whole[0]) and torch.equal(split[1], whole[1])


def _assert_within_rotated_sum_error(out: torch.Tensor, ref: torch.Tensor) -> None:
    """``_assert_within_sum_error`` after a rotation: ``x cos - y sin`` cancels, so a norm a few
    ulp off shows as a few ulp of the row's scale (absolute), not of each element (relative)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    ulp = {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}[ref.dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=ulp, atol=4 * ulp * ref.float().abs().max().item())
    if ref.dtype != torch.float32:
        assert (out != ref).float().mean().item() < 1e-2


def test_norm_and_rotate_takes_the_fused_kernel_on_cuda_only_with_matching_weights(monkeypatch):
    """``RotaryEmbedding.norm_and_rotate``: the one launch where the weights keep q's dtype on
    CUDA, else the norms and the rotation as before (the CPU, an fp32 norm weight)."""
    from siesta.model import layers

    calls = []
    real = layers._triton_ops() if ON_GPU else None

    class Ops:  # the fused launch recorded; the norms and the rotation of the fallback are real
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def qk_norm_rope(*a):
            calls.append(a)
            return a[0], a[1]

    monkeypatch.setattr(layers, "_triton_ops", Ops)
    rotary = RotaryEmbedding(64, 128, ROPE_PARAMS)
    norm = RMSNorm(64, EPS)
    q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    positions = torch.arange(3)
    q_out, k_out = rotary.norm_and_rotate(positions, q, k, norm, norm)  # CPU: no fused launch
    q_ref, k_ref = rotary(positions, norm(q), norm(k))
    assert not calls and torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    if ON_GPU:
        cuda = rotary.to(DEVICE), norm.to(DEVICE), q.to(DEVICE), k.to(DEVICE), positions.to(DEVICE)
        cuda[0].norm_and_rotate(cuda[4], cuda[2], cuda[3], cuda[1], cuda[1])
        assert len(calls) == 1
        cuda[0].norm_and_rotate(cuda[4], cuda[2].half(), cuda[3].half(), cuda[1], cuda[1])  # fp32 weights
        assert len(calls) == 1
