"""Which module runs which checkpoint: one line per family, keyed by the Hugging Face
``architectures`` entry and ``model_type`` of its config.json.

A family is one module holding its model class (``siesta.model.interface.CausalModel``), and
beside it the module of its checkpoint names. The classes are imported on first use, so that
the loaders can ask what is supported without importing the models.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from siesta.parallel import SINGLE, TensorParallel


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # config.json's ``architectures`` entry
    model: str  # "module:Class"
    names: str  # the module of its checkpoint names (map_checkpoint_name, checkpoint_layout)

    def model_class(self) -> type:
        module, _, name = self.model.partition(":")
        return getattr(importlib.import_module(module), name)

    def names_module(self) -> Any:
        return importlib.import_module(self.names)


_DENSE, _DENSE_NAMES = "siesta.model.llama:CausalLM", "siesta.model.llama_names"

FAMILIES: tuple[Family, ...] = (
    Family("llama", "LlamaForCausalLM", _DENSE, _DENSE_NAMES),
    Family("mistral", "MistralForCausalLM", _DENSE, _DENSE_NAMES),
    Family("qwen2", "Qwen2ForCausalLM", _DENSE, _DENSE_NAMES),
    Family("qwen3", "Qwen3ForCausalLM", _DENSE, _DENSE_NAMES),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "siesta.model.qwen3_moe:Qwen3MoeForCausalLM",
           "siesta.model.qwen3_moe_names"),
)

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(f.model_type for f in FAMILIES)
_BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES}
_BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES}


def unsupported(model_type: Any) -> str:
    return f"model_type {model_type!r} is not supported; siesta runs {', '.join(SUPPORTED_MODEL_TYPES)}"


def check_model_type(model_type: Any) -> None:
    if model_type not in _BY_MODEL_TYPE:
        raise ValueError(unsupported(model_type))


def family_of(config: Any) -> Family:
    """The family of a transformers config: its ``architectures`` first (what the checkpoint
    says it is), else its ``model_type`` (configs built in code often name no architecture)."""
    for architecture in getattr(config, "architectures", None) or ():
        if architecture in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[architecture]
    model_type = getattr(config, "model_type", None)
    check_model_type(model_type)
    return _BY_MODEL_TYPE[model_type]


def model_class(config: Any) -> type:
    return family_of(config).model_class()


def shape_of(config: Any) -> Any:
    """The whole model's numbers (the family's shape dataclass), without building it."""
    return model_class(config).shape_class.from_config(config)


def build_model(config: Any, max_positions: int, backend: Any, tp: TensorParallel = SINGLE, head_fp32: bool = False):
    """This rank's model of ``config`` (built wherever the caller's device context says)."""
    return model_class(config)(config, max_positions, backend, tp, head_fp32=head_fp32)
