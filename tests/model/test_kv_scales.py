"""The fp8 KV cache scales a checkpoint ships: vLLM's names read, anything else refused by name,
and the weight loader passing over them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from siesta.attention.kv_quant import KVScales
from siesta.model.kv_scales import checkpoint_kv_scales, is_kv_scale_name, source_kv_scales
from siesta.model.llama_names import map_checkpoint_name

LAYERS = 2
K, V = (0.25, 0.0712890625), (0.5, 3.0)


def shards(tmp_path: Path, *tensors: dict[str, torch.Tensor]) -> list[Path]:
    """One safetensors file per dict, each with a weight beside its scales."""
    files = []
    for i, named in enumerate(tensors):
        files.append(tmp_path / f"model-{i}.safetensors")
        save_file({f"model.layers.{i}.mlp.up_proj.weight": torch.ones(2, 2), **named}, files[-1])
    return files


def per_layer(template: str, values: tuple[float, ...], shape: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    return {template.format(i): torch.full(shape, v) for i, v in enumerate(values)}


@pytest.mark.parametrize(("k_name", "v_name"), [
    ("model.layers.{}.self_attn.k_scale", "model.layers.{}.self_attn.v_scale"),  # vLLM's, ModelOpt's
    ("model.layers.{}.self_attn.k_proj.output_scale", "model.layers.{}.self_attn.v_proj.output_scale"),
    ("model.language_model.layers.{}.self_attn.k_scale", "model.language_model.layers.{}.self_attn.v_scale"),
])  # fmt: skip
def test_per_tensor_scales_are_read_under_each_name_vllm_reads(tmp_path, k_name: str, v_name: str) -> None:
    files = shards(tmp_path, per_layer(k_name, K, shape=(1,)), per_layer(v_name, V))  # [1] and scalar shapes
    assert checkpoint_kv_scales(files, LAYERS) == KVScales.of(K, V, origin="checkpoint")
    assert all(map_checkpoint_name(name) is None for name in (k_name.format(0), v_name.format(1)))


def test_one_kv_scale_serves_both_and_a_checkpoint_without_scales_gets_ones(tmp_path) -> None:
    files = shards(tmp_path, per_layer("model.layers.{}.self_attn.kv_scale", K))
    assert checkpoint_kv_scales(files, LAYERS) == KVScales.of(K, K, origin="checkpoint")
    (tmp_path / "bare").mkdir()
    bare = shards(tmp_path / "bare", {})
    assert checkpoint_kv_scales(bare, LAYERS) is None
    assert source_kv_scales(bare, LAYERS) == source_kv_scales(None, LAYERS) == KVScales.default(LAYERS)


def test_scales_that_are_not_one_value_a_layer_for_every_layer_are_refused_by_name(tmp_path) -> None:
    per_head = shards(tmp_path, per_layer("model.layers.{}.self_attn.k_scale", K, shape=(8,)))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_scale holds \(8,\) values"):
        checkpoint_kv_scales(per_head, LAYERS)
    (tmp_path / "partial").mkdir()
    partial = shards(tmp_path / "partial", {"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
                                             "model.layers.0.self_attn.v_scale": torch.tensor(0.5)})  # fmt: skip
    with pytest.raises(ValueError, match=r"missing \[1\]"):
        checkpoint_kv_scales(partial, LAYERS)


def test_only_kv_scale_names_are_passed_over() -> None:
    assert is_kv_scale_name("model.layers.3.self_attn.v_proj.output_scale")
    for name in ("model.layers.3.self_attn.k_proj.weight", "model.layers.3.self_attn.k_proj.weight_scale",
                 "model.layers.3.self_attn.q_scale", "lm_head.weight"):  # fmt: skip
        assert not is_kv_scale_name(name)
        assert map_checkpoint_name(name) is not None
