"""The batch-invariant GEMM (``triton_matmul``), its dispatch, and deterministic mode's row-aligned softmax.

* Accuracy: against a float64 oracle, within the error bound of an fp32 sum of K products
  (``K * 2**-24`` of ``|x| @ |w|.T``), which TF32 products (``2**-11`` each) would exceed by far;
  fp16 outputs may also be rounded once more (``2**-11`` of the value).
* Invariance: a row's bits (``torch.equal``) alone, among 2..129 other rows at the start, middle
  and end of the batch, beside rows of NaN and of huge values, across row tiles (M = 64, 65, 130)
  and across ``config_for``'s row buckets (M = 513: other tile shapes, the same BLOCK_K), with N and
  K no multiple of the tiles: on the default configs and on a small one whose tiles the shapes
  here cross many times.
* Dispatch: in deterministic mode on CUDA every ``layers.linear`` takes the kernel; on the CPU
  and in the default mode nothing changes (``use_invariant_matmul``, and ``linear`` routed through
  a spy).
* ``batch_invariant.log_softmax``/``softmax``: rows padded to 16 bytes so that torch's CUDA kernel
  reads every row from the same alignment (bit-equality of a row at every offset: CUDA only).

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py), whose bf16 arithmetic
is unreliable: fp32 and fp16 here, bf16 on CUDA.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

# @triton.jit reads TRITON_INTERPRET when a kernel is defined: a module imported before the flag
# was set must be loaded again.
for _name in ("siesta.model.triton_matmul",):
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])

from siesta.model import batch_invariant, layers, triton_matmul  # noqa: E402
from siesta.model.triton_matmul import MatmulConfig, config_for, matmul  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
GPU_ONLY = pytest.mark.skipif(not ON_GPU, reason="needs CUDA (bench/gpu.sh runs it on the GPU host)")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
UNIT_ROUNDING = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
# Small tiles: the shapes below span many row tiles, column tiles and K chunks.
SMALL = MatmulConfig(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=1, num_stages=1)
# (N, K): both ragged; ragged N over an even K (no K tail); K shorter than one chunk.
SHAPES = ((200, 150), (77, 128), (45, 24))
# Across config_for's row buckets too (decode <= 64 < narrow mid <= 256 < mid <= 512 < prefill).
BATCHES = (1, 3, 17, 64, 65, 130, 257, 513)
TARGETS = 3  # rows whose bits are followed through every batch


def _rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _operands(n: int, k: int, dtype: torch.dtype, with_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = _rand((n, k), dtype, seed=n * 7 + k, scale=k**-0.5)
    bias = _rand((n,), dtype, seed=n + 1) if with_bias else None
    return weight, bias


def _assert_within_fp32_sum(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """Every element within ``(K + 1) * 2**-24 * (|x| @ |w|.T + |b|)`` of the float64 result, plus
    one rounding to the output dtype: an fp32 sum's worst case (TF32 products exceed it ~17x)."""
    x64, w64 = x.cpu().double(), weight.cpu().double()
    b64 = torch.zeros(weight.shape[0], dtype=torch.float64) if bias is None else bias.cpu().double()
    ref = x64 @ w64.T + b64
    magnitude = x64.abs() @ w64.abs().T + b64.abs()
    k = x.shape[1]
    bound = (k + 1) * UNIT_ROUNDING[torch.float32] * magnitude + UNIT_ROUNDING[out.dtype] * ref.abs() + 1e-30
    err = (out.cpu().double() - ref).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {worst:.3g}x the fp32-sum bound"


# ---------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_matches_a_float64_oracle(dtype: torch.dtype, n: int, k: int, with_bias: bool) -> None:
    weight, bias = _operands(n, k, dtype, with_bias)
    x = _rand((70, k), dtype, seed=k)
    out = matmul(x, weight, bias)
    assert out.shape == (70, n) and out.dtype == dtype and out.is_contiguous()
    _assert_within_fp32_sum(out, x, weight, bias)


def test_small_tiles_match_the_oracle() -> None:
    weight, bias = _operands(77, 150, torch.float32, with_bias=True)
    x = _rand((40, 150), torch.float32, seed=3)
    _assert_within_fp32_sum(matmul(x, weight, bias, SMALL), x, weight, bias)


def test_linear_takes_any_leading_shape_and_strided_rows() -> None:
    """``triton_matmul.linear``: ``[B, T, K]`` input, x a column slice of a wider tensor (rows
    strided), weight a view with K not contiguous (copied), as ``F.linear`` takes them."""
    weight, bias = _operands(45, 24, torch.float32, with_bias=True)
    wide = _rand((2, 5, 40), torch.float32, seed=9)
    x = wide[..., :24]
    w_t = weight.T.contiguous().T  # same values, K-major storage
    out = triton_matmul.linear(x, w_t, bias)
    assert out.shape == (2, 5, 45)
    assert torch.equal(out, matmul(x.reshape(10, 24).contiguous(), weight, bias).view(2, 5, 45))
    _assert_within_fp32_sum(out.reshape(10, 45), x.reshape(10, 24), weight, bias)


def test_no_rows_and_empty_k() -> None:
    weight, bias = _operands(16, 8, torch.float32, with_bias=True)
    assert matmul(torch.empty(0, 8, device=DEVICE), weight, bias).shape == (0, 16)
    empty_k = matmul(torch.empty(3, 0, device=DEVICE), torch.empty(16, 0, device=DEVICE), bias)
    assert torch.equal(empty_k, bias.expand(3, 16))


@pytest.mark.parametrize(
    "x_shape,w_shape,dtypes",
    [((2, 8), (4, 9), (torch.float32, torch.float32)), ((2, 8), (4, 8), (torch.float32, torch.float16))],
    ids=["k-mismatch", "dtype-mismatch"],
)
def test_refuses_mismatched_operands(x_shape, w_shape, dtypes) -> None:
    with pytest.raises(ValueError):
        matmul(torch.zeros(x_shape, dtype=dtypes[0]), torch.zeros(w_shape, dtype=dtypes[1]))


# ---------------------------------------------------------------------------- invariance


def _batch_around(targets: torch.Tensor, m: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    """``m`` rows: the targets at the start, middle and end (as many as fit), the rest random,
    one of them NaN and one huge where there is room: rows that would show through any mixing."""
    k = targets.shape[1]
    x = _rand((m, k), targets.dtype, seed=seed)
    positions = sorted({0, m // 2, m - 1})[: targets.shape[0]]
    others = [i for i in range(m) if i not in positions]
    if len(others) >= 2:
        x[others[0]] = float("nan")
        x[others[-1]] = torch.finfo(targets.dtype).max / 4
    for row, at in enumerate(positions):
        x[at] = targets[row]
    return x, positions


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("config,n,k", [(None, 200, 150), (SMALL, 77, 72)], ids=["default-config", "small-tiles"])
def test_a_rows_bits_do_not_depend_on_its_batch(dtype: torch.dtype, with_bias: bool, config, n: int, k: int) -> None:
    """Small tiles: 9 row tiles, 3 column tiles and 5 K chunks (the last ragged) at M=130."""
    weight, bias = _operands(n, k, dtype, with_bias)
    targets = _rand((TARGETS, k), dtype, seed=11)
    alone = [matmul(targets[i : i + 1].contiguous(), weight, bias, config)[0] for i in range(TARGETS)]
    assert all(torch.isfinite(row).all() for row in alone)
    for m in BATCHES:
        x, positions = _batch_around(targets, m, seed=m)
        out = matmul(x, weight, bias, config)
        for row, at in enumerate(positions):
            assert torch.equal(out[at], alone[row]), f"M={m}: row {row} at {at} differs from its M=1 bits"


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_the_persistent_tma_kernel_gives_the_plain_kernels_bits(with_bias: bool) -> None:
    """The same tile walked by one program per SM with TMA loads (zero-filled past M, N and K where
    the plain kernel masks): the same sums, bit for bit, at every M, ragged K included."""
    n, k = 77, 72
    weight, bias = _operands(n, k, torch.float32, with_bias)
    tma = dataclasses.replace(SMALL, persistent_tma=True)
    for m in (1, 17, 130):
        x = _rand((m, k), torch.float32, seed=m)
        assert torch.equal(matmul(x, weight, bias, tma), matmul(x, weight, bias, SMALL)), m


def test_every_row_bucket_reduces_in_the_same_order() -> None:
    """``config_for`` may change the tile with M, never BLOCK_K: the order of a row's sum."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        chunks = {config_for(n, k, m, dtype).block_k for m in (1, 64, 65, 256, 257, 512, 513, 8192)
                  for n, k in ((4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096))}  # fmt: skip
        assert len(chunks) == 1, (dtype, chunks)


# ---------------------------------------------------------------------------- dispatch


@pytest.fixture
def deterministic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_invariant, "_enabled", True)


@pytest.fixture
def default_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_invariant, "_enabled", False)


def test_deterministic_mode_on_cuda_takes_the_invariant_gemm(deterministic) -> None:
    assert layers.use_invariant_matmul(torch.device("cuda"))
    assert layers.use_invariant_matmul(torch.device("cuda", 1))
    assert not layers.use_invariant_matmul(torch.device("cpu")), "the CPU keeps cpu_gemm.c"
    assert not layers.use_invariant_matmul(torch.device("cuda"), wants_grad=True), "the kernel has no backward"


def test_default_mode_never_takes_it(default_mode) -> None:
    assert not layers.use_invariant_matmul(torch.device("cuda"))
    assert not layers.use_invariant_matmul(torch.device("cpu"))


def _spy_on_kernel(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    calls: list[tuple[int, ...]] = []
    real = triton_matmul.linear

    def spy(x, weight, bias=None):
        calls.append(tuple(x.shape))
        return real(x, weight, bias)

    monkeypatch.setattr(triton_matmul, "linear", spy)
    return calls


def test_layers_linear_routes_to_the_kernel_where_the_predicate_says(monkeypatch, deterministic) -> None:
    """With the predicate true (as on CUDA in deterministic mode) ``layers.linear`` and the
    modules built on it run the kernel, the CPU tensors here through the interpreter."""
    calls = _spy_on_kernel(monkeypatch)
    monkeypatch.setattr(layers, "use_invariant_matmul", lambda device, wants_grad=False: True)
    weight, bias = _operands(45, 24, torch.float32, with_bias=True)
    x = _rand((5, 24), torch.float32, seed=5)
    assert torch.equal(layers.linear(x, weight, bias), matmul(x, weight, bias))
    module = layers.MergedLinear(24, {"q": 20, "kv": 25}, bias=True).to(DEVICE)
    with torch.no_grad():
        module.weight.copy_(weight)
        module.bias.copy_(bias)
        assert torch.equal(module(x), matmul(x, weight, bias))
    assert calls == [(5, 24), (5, 24)]


def test_cpu_linears_do_not_take_it(monkeypatch, deterministic) -> None:
    """On the CPU the predicate is false even in deterministic mode: cpu_linear as before."""
    calls = _spy_on_kernel(monkeypatch)
    weight, _ = _operands(16, 32, torch.float32, with_bias=False)
    layers.linear(torch.ones(2, 32), weight.cpu())
    assert calls == []


# ---------------------------------------------------------------------------- softmax rows


def test_aligned_rows_pad_with_minus_infinity() -> None:
    """A 1001-wide fp32 row padded to 1004 (16 bytes a vector): max and sums unchanged, so the
    log-softmax of the padded rows, cut back, is the plain one."""
    x = _rand((5, 1001), torch.float32, seed=2).cpu()
    padded = batch_invariant._aligned_rows(x)
    assert padded.shape == (5, 1004) and padded.stride(0) * 4 % batch_invariant.ROW_ALIGN_BYTES == 0
    assert torch.equal(padded[:, :1001], x) and torch.isneginf(padded[:, 1001:]).all()
    torch.testing.assert_close(padded.log_softmax(-1)[:, :1001], x.log_softmax(-1), rtol=0, atol=1e-6)


def test_default_mode_softmax_is_torchs(default_mode) -> None:
    x = _rand((3, 1001), torch.float32, seed=4)
    assert torch.equal(batch_invariant.log_softmax(x), x.log_softmax(dim=-1))
    assert torch.equal(batch_invariant.softmax(x), x.softmax(dim=-1))


@GPU_ONLY
@pytest.mark.parametrize("vocab", [50257, 128256])
def test_a_rows_log_softmax_bits_do_not_depend_on_its_index_cuda(deterministic, vocab: int) -> None:
    """torch's CUDA softmax splits a long row by its 16-byte alignment: with V % 4 != 0 a row's
    sums followed its index. Padded, the row has the same bits at every index."""
    target = _rand((1, vocab), torch.float32, seed=1, scale=4.0)
    alone_log, alone_p = batch_invariant.log_softmax(target)[0], batch_invariant.softmax(target)[0]
    for index in (1, 2, 3, 5):
        batch = _rand((index + 2, vocab), torch.float32, seed=index, scale=4.0)
        batch[index] = target[0]
        assert torch.equal(batch_invariant.log_softmax(batch)[index], alone_log), index
        assert torch.equal(batch_invariant.softmax(batch)[index], alone_p), index


@GPU_ONLY
def test_bf16_rows_are_invariant_and_near_cublas_cuda() -> None:
    """Llama-3-8B's o_proj and down in bf16: a row's bits alone and among others in every row
    bucket of ``config_for`` (1, 41, 256, 512 and 1,024 rows: five tile shapes, mma.sync and
    wgmma, cp.async and TMA), and the result within bf16 rounding of cuBLAS."""
    for n, k in ((4096, 4096), (4096, 14336)):
        weight = _rand((n, k), torch.bfloat16, seed=1, scale=k**-0.5)
        x = _rand((1024, k), torch.bfloat16, seed=2)
        alone = matmul(x[40:41].contiguous(), weight)[0]
        for m in (41, 64, 256, 512, 1024):
            assert torch.equal(matmul(x[:m].contiguous(), weight)[40], alone), (n, k, m)
        for config in (config_for(n, k, 1024, torch.bfloat16), config_for(n, k, 1, torch.bfloat16)):
            tma = dataclasses.replace(config, persistent_tma=True)
            assert torch.equal(matmul(x[:1024].contiguous(), weight, config=tma), matmul(x[:1024].contiguous(), weight,
                               config=config)), (n, k, config)  # fmt: skip
    out = matmul(x[:256].contiguous(), weight)
    ref = torch.nn.functional.linear(x[:256], weight).float()
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 1.6e-2
