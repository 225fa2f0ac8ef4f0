"""A model's bound weight targets: kept between lookups, rebound when the parameter moves."""

from __future__ import annotations

import pytest
import torch

from siesta.attention.torch_ref import TorchAttention
from siesta.model import registry
from siesta.model.random_init import RANDOM_SHAPES

MAX_POSITIONS = 64
NAMES = {
    "tiny-llama": ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight"],
    "tiny-qwen3-moe": ["model.layers.0.mlp.experts.3.up_proj.weight", "model.layers.1.mlp.experts.gate_up_proj"],
}


def _model(shape: str) -> torch.nn.Module:
    return registry.build_model(RANDOM_SHAPES[shape].config(), MAX_POSITIONS, TorchAttention())


def _param_of(model: torch.nn.Module, name: str) -> torch.Tensor:
    return model.parameter_table()[model.map_name(name).pname]


@pytest.mark.parametrize("shape", sorted(NAMES))
def test_a_bound_target_is_kept_while_its_parameter_stays(shape):
    model = _model(shape)
    params = model.parameter_table()
    for name in NAMES[shape]:
        assert model.weight_target(name, params) is model.weight_target(name, params)


@pytest.mark.parametrize("shape", sorted(NAMES))
def test_a_moved_parameter_is_bound_again(shape):
    # to_empty gives every parameter new storage (the objects stay, their .data changes): a
    # target bound before must not write the old storage.
    model = _model(shape)
    before = {name: model.weight_target(name) for name in NAMES[shape]}
    model.to_empty(device="cpu")
    for name in NAMES[shape]:
        after = model.weight_target(name)
        assert after is not before[name]
        full = torch.randn(after.full_shape)
        after.write(full)
        param = _param_of(model, name)
        assert after.view.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
        assert torch.equal(after.view, after.shard_of(full))
