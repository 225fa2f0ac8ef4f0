"""The CPU linears (the kernel up to MAX_ROWS rows, then oneDNN or MKL past it) against F.linear,
where they decline to serve, and which library serves past the kernel. The kernel itself
against a float64 oracle: ``test_cpu_gemm.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linear_cases import at_thread_counts, case, library, within_dot_product_bound  # noqa: F401 (a fixture)

from siesta.model import cpu_linear
from siesta.model.layers import linear


# n not a multiple of the kernel's 4-row tiles (a tail), rows not a multiple of its 6-row passes.
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 40, cpu_linear.MAX_ROWS])
@pytest.mark.parametrize("n,k,bias", [(576, 576, False), (1030, 80, True), (3, 64, True), (49, 1536, False)])
@torch.inference_mode()
def test_matches_f_linear(rows: int, n: int, k: int, bias: bool) -> None:
    x, w, b = case(rows, n, k, bias)
    out = cpu_linear.linear(x, w, b)
    assert out is not None, "the CPU machines build the kernel"
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@torch.inference_mode()
def test_in_features_the_kernel_does_not_take_go_to_the_library(library) -> None:
    x, w, b = case(3, 40, 77, True)  # 77: not a whole number of vectors (of 16, 8 or 4 floats)
    assert cpu_linear.linear_tiled(x, w, b) is None
    assert library("mkl") == "mkl"
    assert cpu_linear.linear(x, w, b) is None  # layers.linear then calls F.linear
    if library("onednn") == "onednn":
        torch.testing.assert_close(cpu_linear.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@torch.inference_mode()
def test_strided_rows_and_any_thread_count_give_the_same_bits() -> None:
    x, w, b = case(4, 333, 128, True)
    wide = torch.zeros(4, 200)
    wide[:, :128] = x
    strided = wide[:, :128]  # row stride 200
    results = at_thread_counts(lambda: cpu_linear.linear(strided, w, b))
    assert all(torch.equal(r, results[0]) for r in results)
    torch.testing.assert_close(results[0], F.linear(x, w, b), rtol=1e-5, atol=1e-4)


# Prefill-sized products (a 300-token chunk at SmolLM2's widths, a tail of 3 columns) and
# the strided inputs oneDNN takes where the row kernel does not.
@pytest.mark.parametrize("rows,n,k,bias", [(cpu_linear.MAX_ROWS + 1, 16, 16, True), (300, 963, 576, True),
                                           (2048, 576, 1536, False)])  # fmt: skip
@torch.inference_mode()
def test_onednn_serves_more_rows_and_matches_f_linear(rows: int, n: int, k: int, bias: bool, library) -> None:
    if cpu_linear.onednn_matmul() is None:
        pytest.skip("this torch build has no oneDNN")
    assert library("onednn") == "onednn"
    x, w, b = case(rows, n, k, bias)
    out = cpu_linear.linear(x, w, b)
    assert out is not None
    # Against float64, within the worst-case bound of fp32 dot products: oneDNN sums in
    # another order than MKL, so the bits differ from F.linear's.
    assert within_dot_product_bound(out, x, w, b)
    wide = torch.zeros(rows, k + 8)
    wide[:, :k] = x
    torch.testing.assert_close(cpu_linear.linear(wide[:, :k], w.t().contiguous().t(), b), out, rtol=1e-5, atol=1e-4)


def test_declines_what_it_cannot_do() -> None:
    x, w, b = case(cpu_linear.MAX_ROWS + 1, 16, 16, True)
    with torch.inference_mode():
        assert cpu_linear.linear(x[:2].double(), w.double(), None) is None
        assert cpu_linear.linear(x[None], w, b) is None  # 3-d input: F.linear's
    w.requires_grad_(True)
    assert cpu_linear.linear(x[:2], w, None) is None  # a backward is wanted
    assert cpu_linear.linear(x, w, None) is None


def test_layers_linear_keeps_autograd_and_matches_in_everycase() -> None:
    x, w, b = case(2, 40, 32, True)
    w.requires_grad_(True)
    out = linear(x, w, b)
    out.sum().backward()
    assert w.grad is not None
    with torch.inference_mode():
        for rows in (1, cpu_linear.MAX_ROWS + 4):
            xr = case(rows, 40, 32, True, seed=rows)[0]
            torch.testing.assert_close(linear(xr, w, b), F.linear(xr, w, b), rtol=1e-5, atol=1e-4)


def test_model_linears_go_through_the_cpu_paths(monkeypatch: pytest.MonkeyPatch, library) -> None:
    from siesta.model.layers import Linear

    onednn = library("onednn") == "onednn"

    layer = Linear(32, 40, bias=True)  # siesta's layers are not initialised: every weight is loaded
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(3)))
        layer.bias.copy_(torch.randn(layer.bias.shape, generator=torch.Generator().manual_seed(4)))
    calls: list[int] = []
    kernel = cpu_linear.linear
    monkeypatch.setattr(cpu_linear, "linear", lambda x, w, b=None: calls.append(x.shape[0]) or kernel(x, w, b))
    with torch.inference_mode():
        for rows in (1, cpu_linear.MAX_ROWS + 4):
            x = case(rows, 40, 32, False, seed=rows)[0]
            assert (kernel(x, layer.weight, layer.bias) is not None) == (rows <= cpu_linear.MAX_ROWS or onednn)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)
    assert calls == [1, cpu_linear.MAX_ROWS + 4]  # every CPU call is offered to cpu_linear


@pytest.mark.parametrize("vendor,chosen", [("AuthenticAMD", "onednn"), ("GenuineIntel", "mkl"), ("", "mkl")])
def test_auto_takes_onednn_on_amd_and_mkl_elsewhere(vendor: str, chosen: str) -> None:
    if chosen == "onednn" and cpu_linear.onednn_matmul() is None:
        chosen = "mkl"  # a torch build without oneDNN multiplies with F.linear
    assert cpu_linear.resolve_library("auto", vendor) == chosen
    assert cpu_linear.resolve_library("mkl", "AuthenticAMD") == "mkl"  # a setting beats the vendor rule
    with pytest.raises(ValueError, match="blas"):
        cpu_linear.resolve_library("blas")


@torch.inference_mode()
def test_mkl_leaves_more_rows_to_f_linear_and_keeps_the_kernel_for_a_few(library) -> None:
    assert library("mkl") == "mkl"
    x, w, b = case(cpu_linear.MAX_ROWS + 1, 64, 32, True)
    assert cpu_linear.linear(x, w, b) is None  # layers.linear then calls F.linear: MKL
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    few = cpu_linear.linear(x[:2], w, b)
    assert few is not None
    torch.testing.assert_close(few, F.linear(x[:2], w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("matmul", ["mkl", "onednn"])
def test_a_cpu_engine_multiplies_with_the_configured_library(matmul: str, library) -> None:
    from siesta.config import CpuConfig, EngineConfig
    from siesta.core.engine_core import EngineCore

    config = EngineConfig.from_flags(model="random:tiny-llama", device="cpu")
    config.cpu = CpuConfig(matmul=matmul)
    library("onednn" if matmul == "mkl" else "mkl")  # the other one: the engine must change it
    EngineCore(config)
    expected = matmul if cpu_linear.onednn_matmul() is not None else "mkl"
    assert cpu_linear.library() == expected


def test_the_cpu_matmul_setting_is_validated_by_name() -> None:
    from siesta.config import ConfigError, CpuConfig, EngineConfig

    with pytest.raises(ConfigError, match="cpu.matmul must be one of auto, mkl, onednn, got 'blas'"):
        EngineConfig(cpu=CpuConfig(matmul="blas")).validate(max_model_len=128)
