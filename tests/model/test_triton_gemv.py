"""The Triton skinny GEMM (``gemv``) against ``torch.nn.functional.linear``.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before triton is imported), whose bf16 arithmetic is unreliable: fp32 and fp16 are
tested there, bf16 only on CUDA (Llama-3-8B decode shapes).

The kernel accumulates in fp32 in its own order (per K chunk, per split), so it
matches torch within the rounding of that order: tolerances are relative to the
scale of the output, not bit-exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton

from siesta.model.triton_gemv import DOT_MIN_ROWS, MAX_GEMV_ROWS, GemvConfig, default_config, gemv

ON_GPU = torch.cuda.is_available()  # without one, tests/conftest.py runs Triton in its interpreter

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# Max |error| over max |reference|: fp32 sums in another order differ by a few ulp of
# the partial sums; fp16 outputs are rounded once more (2**-11 relative).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
ROWS = (1, 2, 3, 8)
# (N, K): aligned, N ragged, K ragged, both ragged and K shorter than one chunk.
SHAPES = ((64, 128), (40, 128), (32, 200), (37, 72))
# Small tiles so that the shapes above span several programs and K chunks.
CONFIGS = {
    "sum": GemvConfig(block_n=16, block_k=32, num_warps=1, num_stages=1),
    "sum-split2": GemvConfig(block_n=16, block_k=32, num_warps=1, num_stages=1, split_k=2),
    "sum-split3": GemvConfig(block_n=32, block_k=16, num_warps=1, num_stages=1, split_k=3),
    "dot": GemvConfig(block_n=16, block_k=32, num_warps=1, num_stages=1, tensor_cores=True),
    "dot-split4": GemvConfig(block_n=16, block_k=16, num_warps=1, num_stages=1, split_k=4, tensor_cores=True),
}
# Shared memory one program may use on an H100/H200 (227 KiB).
HOPPER_SHARED_MEMORY = 232448
# Llama-3-8B decode matrices (N, K): qkv, o_proj, gate_up, down.
LLAMA_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
LLAMA_CONFIGS = (
    GemvConfig(block_n=16, block_k=512, num_warps=4, num_stages=3),
    GemvConfig(block_n=16, block_k=512, num_warps=4, num_stages=2, split_k=4),
    GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=3, tensor_cores=True),
)


def _rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _check(m: int, n: int, k: int, dtype: torch.dtype, config: GemvConfig | None, with_bias: bool) -> None:
    x = _rand((m, k), dtype, seed=m * 1000 + n)
    w = _rand((n, k), dtype, seed=k) / k**0.5
    bias = _rand((n,), dtype, seed=n) if with_bias else None
    out = gemv(x, w, bias, config)
    # torch's fp16 linear on CPU accumulates in fp32 as the kernel does.
    ref = F.linear(x, w, bias)
    assert out.shape == (m, n) and out.dtype == dtype and out.is_contiguous()
    assert _relative_error(out, ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_matches_linear_fp32(m: int, n: int, k: int, config_name: str) -> None:
    _check(m, n, k, torch.float32, CONFIGS[config_name], with_bias=(m + n) % 2 == 0)


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m", ROWS)
def test_matches_linear_fp16(m: int, with_bias: bool, config_name: str) -> None:
    _check(m, 37, 72, torch.float16, CONFIGS[config_name], with_bias)


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_bias_both_ways(config_name: str) -> None:
    for with_bias in (False, True):
        _check(3, 40, 200, torch.float32, CONFIGS[config_name], with_bias)


@pytest.mark.parametrize("m", ROWS)
def test_default_config(m: int) -> None:
    _check(m, 48, 160, torch.float32, None, with_bias=True)


def test_a_named_shape_takes_its_one_row_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ONE_ROW_SHAPES`` picks one matrix's config at one row of 2-byte weights, and only there."""
    from siesta.model import triton_gemv

    tuned = GemvConfig(block_n=4, block_k=64, num_warps=2, num_stages=2, split_k=2)
    monkeypatch.setattr(triton_gemv, "ONE_ROW_SHAPES", {(40, 96): tuned})
    assert default_config(1, 40, 96) == tuned
    assert default_config(1, 40, 96, element_size=4) != tuned and default_config(2, 40, 96) != tuned
    assert default_config(1, 48, 96) != tuned
    x, w = _rand((1, 96), torch.float16, seed=3), _rand((40, 96), torch.float16, seed=4)
    assert _relative_error(gemv(x, w), F.linear(x.float(), w.float())) <= TOLERANCE[torch.float16]


def test_strided_rows() -> None:
    """Rows of x and W may be strided (views into wider buffers), as long as K is contiguous."""
    x = _rand((3, 100), torch.float32, seed=1)[:, :72]
    w = _rand((40, 90), torch.float32, seed=2)[:, :72]
    out = gemv(x, w, config=CONFIGS["sum-split2"])
    assert _relative_error(out, F.linear(x, w)) <= TOLERANCE[torch.float32]


def test_zero_rows() -> None:
    x = torch.empty((0, 64), device=DEVICE)
    assert gemv(x, _rand((16, 64), torch.float32, seed=0)).shape == (0, 16)


@pytest.mark.parametrize(
    "x_shape,w_shape,match",
    [
        ((64,), (16, 64), "x \\[M, K\\]"),
        ((2, 64), (16, 64, 1), "x \\[M, K\\]"),
        ((2, 64), (16, 32), "K mismatch"),
        ((MAX_GEMV_ROWS + 1, 64), (16, 64), "at most"),
    ],
)
def test_bad_shapes(x_shape: tuple[int, ...], w_shape: tuple[int, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        gemv(torch.zeros(x_shape, device=DEVICE), torch.zeros(w_shape, device=DEVICE))


def test_bad_layout_dtype_and_bias() -> None:
    x = torch.zeros((2, 64), device=DEVICE)
    w = torch.zeros((16, 64), device=DEVICE)
    with pytest.raises(ValueError, match="contiguous along K"):
        gemv(x, torch.zeros((64, 16), device=DEVICE).t())
    with pytest.raises(ValueError, match="contiguous along K"):
        gemv(torch.zeros((64, 2), device=DEVICE).t(), w)
    with pytest.raises(ValueError, match="one dtype"):
        gemv(x, w.half())
    with pytest.raises(ValueError, match="one dtype"):
        gemv(x.double(), w.double())
    with pytest.raises(ValueError, match="bias"):
        gemv(x, w, torch.zeros(15, device=DEVICE))


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"block_n": 24}, "power of two"),
        ({"num_warps": 0}, "power of two"),
        ({"split_k": 0}, "split_k"),
        ({"block_n": 8, "tensor_cores": True}, "tensor_cores"),
    ],
)
def test_bad_config(fields: dict, match: str) -> None:
    base = {"block_n": 16, "block_k": 64, "num_warps": 4, "num_stages": 2}
    with pytest.raises(ValueError, match=match):
        GemvConfig(**(base | fields))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_default_config_fits_shared_memory(dtype: torch.dtype) -> None:
    """The interpreter has no shared memory limit: check the defaults' pipelined tiles
    against Hopper's, as Triton sizes them (num_stages - 1 buffers of W and x tiles)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    for m in range(1, MAX_GEMV_ROWS + 1):
        for n, k in LLAMA_SHAPES:
            config = default_config(m, n, k, element_size)
            rows = DOT_MIN_ROWS if config.tensor_cores else triton.next_power_of_2(m)
            tiles = (config.num_stages - 1) * (config.block_n + rows) * config.block_k * element_size
            assert tiles <= HOPPER_SHARED_MEMORY, (m, n, k, dtype, config)


@pytest.mark.skipif(not ON_GPU, reason="bf16 and real tile sizes need a GPU")
@pytest.mark.parametrize("config", [None, *LLAMA_CONFIGS], ids=["default", "sum", "sum-split4", "dot"])
@pytest.mark.parametrize("n,k", LLAMA_SHAPES)
@pytest.mark.parametrize("m", (1, 4, 8))
def test_llama_shapes_bf16_cuda(m: int, n: int, k: int, config: GemvConfig | None) -> None:
    x = _rand((m, k), torch.bfloat16, seed=m)
    w = _rand((n, k), torch.bfloat16, seed=n + k) / k**0.5
    bias = _rand((n,), torch.bfloat16, seed=n)
    out = gemv(x, w, bias, config)
    ref = F.linear(x.float(), w.float(), bias.float())
    assert out.dtype == torch.bfloat16
    assert _relative_error(out, ref) <= TOLERANCE[torch.bfloat16]


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_cuda_graph_replay() -> None:
    """Captured once, replayed on new inputs: no host sync or varying allocation inside."""
    n, k = 4096, 4096
    x = _rand((2, k), torch.bfloat16, seed=0)
    w = _rand((n, k), torch.bfloat16, seed=1) / k**0.5
    config = GemvConfig(block_n=16, block_k=512, num_warps=4, num_stages=2, split_k=2)
    gemv(x, w, config=config)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, w, config=config)
    x.copy_(_rand((2, k), torch.bfloat16, seed=5))
    graph.replay()
    torch.cuda.synchronize()
    assert _relative_error(out, F.linear(x.float(), w.float())) <= TOLERANCE[torch.bfloat16]


@pytest.mark.skipif(not ON_GPU, reason="the model's linear routes to the GEMV on CUDA only")
def test_model_linear_takes_the_gemv_for_one_half_row(monkeypatch) -> None:
    from siesta.model import layers, triton_gemv

    calls: list[int] = []
    real = triton_gemv.gemv
    monkeypatch.setattr(triton_gemv, "gemv", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    w = _rand((6144, 4096), torch.bfloat16, seed=3) / 4096**0.5
    for rows in (1, 2):
        x = _rand((rows, 4096), torch.bfloat16, seed=rows)
        out = layers.linear(x, w)
        assert _relative_error(out, F.linear(x.float(), w.float())) <= TOLERANCE[torch.bfloat16]
    layers.linear(_rand((1, 4096), torch.float32, seed=4), w.float())  # fp32 stays with cuBLAS
    layers.linear(_rand((1, 4096), torch.bfloat16, seed=5), w.clone().requires_grad_())  # autograd too
    assert calls == [1]


@pytest.mark.parametrize(("n", "k", "with_bias"), [(96, 256, False), (40, 200, True)], ids=["even", "ragged-bias"])
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if ON_GPU else []), ids=str)
def test_a_rows_add_and_norm_fold_into_the_gemv(n: int, k: int, with_bias: bool, dtype: torch.dtype) -> None:
    """``add_norm_gemv``: the residual stream's next value exactly (one rounding of the sum, as
    torch's add), and ``linear(norm(h + res))`` against float64 (fp32), or against the two
    launches it replaces to bf16's rounding of a normed value (a card)."""
    from siesta.model import triton_ops
    from siesta.model.triton_gemv import add_norm_gemv

    gen = torch.Generator().manual_seed(n + k)
    h, res = (torch.randn(1, k, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    norm = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if with_bias else None
    y, summed = add_norm_gemv(h, res, norm, 1e-6, w, bias, triton_ops.mean_factor(1, k))
    assert torch.equal(summed, h + res) and y.shape == (1, n) and y.dtype == dtype
    s = (h + res).double()
    want = F.linear(norm.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6), w.double(),
                    None if bias is None else bias.double())  # fmt: skip
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    else:
        normed, _ = triton_ops.fused_add_rms_norm(h, res, norm, 1e-6)
        torch.testing.assert_close(y.float(), gemv(normed, w, bias).float(), rtol=2e-2, atol=2e-2)


def test_a_layers_input_norm_folds_into_its_qkv_projection(monkeypatch: pytest.MonkeyPatch) -> None:
    """``RMSNorm.add_norm_linear`` through a real forward (tiny Llama in fp32 on the CPU, the fold
    forced on for one-row steps): each decode step folds every layer's input norm but the first
    layer's (which has no residual to add) into its q/k/v GEMV, and the tokens and logprobs are
    the unfolded forward's to fp32 error."""
    from siesta import LLM, SamplingParams
    from siesta.model import layers, triton_gemv

    llm = LLM("random:tiny-llama", dtype="float32", kv_cache_bytes=16 << 20, enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(5, 30))}
    plain = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    calls = []
    real = triton_gemv.add_norm_gemv
    monkeypatch.setattr(layers, "folds_add_norm", lambda x, weight, norm_weight: x.shape[0] == 1)
    monkeypatch.setattr(triton_gemv, "add_norm_gemv", lambda *a: calls.append(id(a[4])) or real(*a))
    folded = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    layers_ = llm.engine.runner.model.model.layers
    assert calls == [id(layer.self_attn.qkv_proj.weight) for layer in layers_[1:]] * 3  # 3 decode steps
    assert folded.token_ids == plain.token_ids
    for got, want in zip(folded.logprobs, plain.logprobs):
        assert got.keys() == want.keys()
        assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in got)
