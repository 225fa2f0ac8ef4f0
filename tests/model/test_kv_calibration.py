"""fp8 KV cache scales computed at start (``calculate_kv_scales``, ``model/kv_calibration.py``).

The oracle is transformers' model of the same weights in float64: its attention function sees
each layer's K and V as the cache would store them (after rotary), and their largest |value| over
the calibration prompt, divided by vLLM's targets, are the scales the engine must compute.
"""

from __future__ import annotations

import pytest
import torch
from conftest import hf_twin
from safetensors.torch import load_file, save_file
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from siesta import LLM
from siesta.model import kv_calibration as calib
from siesta.model.loader import resolve_model

MODEL = "random:tiny-llama"
LAYERS = 2
RECORDER = "siesta_kv_amax_oracle"
FP32_RELATIVE = 1e-5  # the engine's fp32 K/V against float64's


def engine(model: str = MODEL, **kw) -> LLM:
    kw = {"dtype": "float32", "kv_cache_bytes": 1 << 22, "max_model_len": 1024, "kv_cache_dtype": "fp8"} | kw
    return LLM(model, **kw)


def oracle_amax() -> torch.Tensor:
    """``[2, layers]``: transformers' largest |K| and |V| per layer on the calibration prompt."""
    amax = torch.zeros(2, LAYERS, dtype=torch.float64)

    def recording(module, query, key, value, attention_mask, **kwargs):
        amax[0, module.layer_idx] = max(amax[0, module.layer_idx], key.abs().max())
        amax[1, module.layer_idx] = max(amax[1, module.layer_idx], value.abs().max())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(RECORDER, recording)
    source = resolve_model(MODEL)
    model = hf_twin(source).double()
    model.config._attn_implementation = RECORDER
    gen = torch.Generator().manual_seed(calib.CALIBRATION_SEED)
    ids = torch.randint(0, source.hf_config.vocab_size, (calib.CALIBRATION_TOKENS,), generator=gen)
    with torch.inference_mode():
        model(ids[None])
    return amax


def test_scales_are_each_layers_amax_over_vllms_targets() -> None:
    amax = oracle_amax()
    scales = engine(calculate_kv_scales=True).engine.runner.kv_scales
    assert scales.origin == calib.CALCULATED
    want_k = (amax[0] / calib.K_TARGET_E4M3).tolist()
    want_v = (amax[1] / calib.V_TARGET_E4M3).tolist()
    assert scales.k == pytest.approx(want_k, rel=FP32_RELATIVE) and scales.v == pytest.approx(want_v, rel=FP32_RELATIVE)


def test_without_the_flag_the_scales_are_vllms_default_and_the_blocks_are_keyed_apart() -> None:
    default, calculated = engine(), engine(calculate_kv_scales=True)
    assert default.engine.runner.kv_scales.origin == "default" and set(default.engine.runner.kv_scales.k) == {1.0}
    # A tier entry written under one set of scales is never read under the other.
    assert default.engine.runner.kv_cache.format_key != calculated.engine.runner.kv_cache.format_key


def test_a_checkpoints_own_scales_win(tmp_path) -> None:
    hf_twin(resolve_model(MODEL)).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    for layer in range(LAYERS):
        weights[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.5)
        weights[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    scales = engine(str(tmp_path), calculate_kv_scales=True).engine.runner.kv_scales
    assert scales.origin == "checkpoint" and scales.k == (0.5, 0.5) and scales.v == (0.25, 0.25)


def test_scales_from_amax() -> None:
    amax = torch.tensor([[400.0, 0.0], [50.0, float("inf")]])
    e4m3 = calib.scales_from_amax(amax, torch.float8_e4m3fn)
    assert e4m3.k == (2.0, 1.0) and e4m3.v == (0.5, 1.0)  # a layer that wrote zeros (or overflowed) keeps 1.0
    # e5m2 keeps the same headroom under its own maximum.
    e5m2 = calib.scales_from_amax(amax, torch.float8_e5m2)
    assert e5m2.k[0] == pytest.approx(2.0 * 448.0 / 57344.0)
