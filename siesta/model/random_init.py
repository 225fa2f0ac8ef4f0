"""Random weights with the names and shapes of real checkpoints, for tests and benchmarks.

Every value is a hash of (seed, tensor name, element index) computed with integer
tensor ops, so the weights are the same on every device and are generated where
they will live: an 8B model never passes through host memory. Tensor-parallel ranks
each generate the same full tensors and keep their slices, as from any checkpoint.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerBase

from siesta.model.hf_loader import (
    CONFIG_FILE,
    Weights,
    digest,
    eos_token_ids,
    has_tokenizer,
    load_config,
    load_tokenizer_from,
)
from siesta.model.registry import family_of

# Part of the fingerprint: bump it whenever the values generated for a seed change.
GENERATOR_VERSION = 1
RANDOM_PREFIX = "random:"

# Matrices get std GAIN / sqrt(fan_in), so activations keep their scale layer after layer.
MATRIX_GAIN = 1.0
# Norm weights are 1 plus noise, so a norm whose weight is ignored changes the output.
NORM_NOISE_STD = 0.1
BIAS_STD = 0.05
# Elements generated per batch of integer ops: bounds the scratch memory. Part of the
# generator's definition (each batch has its own key): changing it changes the values.
CHUNK_ELEMENTS = 1 << 24

_UNIFORM_STD_TO_HALF_WIDTH = math.sqrt(3.0)  # uniform(-a, a) has std a / sqrt(3)
_WORD_BITS = 32
_MASK32 = (1 << _WORD_BITS) - 1
# "lowbias32" from Chris Wellons' hash prospector: a strong 32-bit integer mixer.
_MIX_SHIFT_OUTER, _MIX_SHIFT_INNER = 16, 15
_MIX_MULTIPLIER_FIRST, _MIX_MULTIPLIER_SECOND = 0x7FEB352D, 0x846CA68B
_UNIFORM_BITS = 24  # all a float32 mantissa holds exactly
_KEY_HEX_CHARS = 8
TRANSFORMERS_VERSION_KEY = "transformers_version"  # in every config.json; not part of the architecture

_TINY = {
    "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


@dataclass(frozen=True)
class RandomShape:
    """A model architecture without weights: a transformers model_type and its config values."""

    model_type: str
    params: dict[str, Any]

    def config(self) -> PretrainedConfig:
        return AutoConfig.for_model(self.model_type, **self.params)


def _rope(theta: float, **scaling: Any) -> dict[str, Any]:
    return {"rope_type": "llama3" if scaling else "default", "rope_theta": theta, **scaling}


_LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}

RANDOM_SHAPES: dict[str, RandomShape] = {
    "llama-3-8b": RandomShape("llama", {
        "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_parameters": _rope(500000.0, **_LLAMA3_SCALING, original_max_position_embeddings=8192),
        "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    }),
    "llama-3-70b": RandomShape("llama", {
        "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_parameters": _rope(500000.0, **_LLAMA3_SCALING, original_max_position_embeddings=8192),
        "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    }),
    "llama-2-7b": RandomShape("llama", {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_parameters": _rope(10000.0), "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2,
    }),
    "mistral-7b": RandomShape("mistral", {
        "vocab_size": 32768, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5, "rope_parameters": _rope(1000000.0), "sliding_window": None,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    }),
    "qwen2.5-0.5b": RandomShape("qwen2", {
        "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_parameters": _rope(1000000.0), "tie_word_embeddings": True,
        "bos_token_id": 151643, "eos_token_id": [151645, 151643],
    }),
    # The base model of most RL recipes (GRPO on math, verl's and slime's examples).
    "qwen2.5-7b": RandomShape("qwen2", {
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6, "rope_parameters": _rope(1000000.0), "tie_word_embeddings": False,
        "bos_token_id": 151643, "eos_token_id": 151643,
    }),
    "qwen3-0.6b": RandomShape("qwen3", {
        "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_parameters": _rope(1000000.0), "tie_word_embeddings": True,
        "bos_token_id": 151643, "eos_token_id": [151645, 151643],
    }),
    "qwen3-30b-a3b": RandomShape("qwen3_moe", {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_parameters": _rope(1000000.0), "tie_word_embeddings": False,
        "bos_token_id": 151643, "eos_token_id": [151645, 151643],
    }),
    "smollm2-135m": RandomShape("llama", {
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_parameters": _rope(100000.0), "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2,
    }),
    "tiny-llama": RandomShape("llama", {**_TINY, "rope_parameters": _rope(10000.0), "tie_word_embeddings": False}),
    # A short original context, so the llama3 ramp falls among a 16-dim head's frequencies.
    "tiny-llama3": RandomShape("llama", {
        **_TINY, "rope_parameters": _rope(500000.0, **_LLAMA3_SCALING, original_max_position_embeddings=256),
        "tie_word_embeddings": False,
    }),
    "tiny-mistral": RandomShape("mistral", {
        **_TINY, "rope_parameters": _rope(1000000.0), "sliding_window": None, "tie_word_embeddings": False,
    }),
    "tiny-qwen2": RandomShape("qwen2", {**_TINY, "rope_parameters": _rope(1000000.0), "tie_word_embeddings": True}),
    # head_dim 32 while hidden / heads is 16: q/k/v widths differ from the hidden size.
    "tiny-qwen3": RandomShape("qwen3", {
        **_TINY, "num_hidden_layers": 3, "head_dim": 32, "rope_parameters": _rope(1000000.0),
        "tie_word_embeddings": True,
    }),
    # 8 experts of 32 features, top 2 renormalised, as the 30B's 128 of 768, top 8.
    "tiny-qwen3-moe": RandomShape("qwen3_moe", {
        **_TINY, "num_hidden_layers": 3, "head_dim": 32, "moe_intermediate_size": 32, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rope_parameters": _rope(1000000.0), "tie_word_embeddings": False,
    }),
}  # fmt: skip


def parameter_layout(config: PretrainedConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor a checkpoint of ``config`` holds, as transformers names them.

    Built on the meta device: no memory, no initialisation. Tied weights appear once,
    under the embedding's name, as save_pretrained writes them; a family whose transformers
    model stacks what checkpoints keep apart (Qwen3-MoE's experts) is listed as the checkpoint.
    """
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layout = family_of(config).names_module().checkpoint_layout
    return [item for name, param in model.named_parameters() for item in layout(name, tuple(param.shape))]


def random_tensor(
    name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    center, half_width = _distribution(name, shape)
    keys = tensor_keys(seed, name)
    out = torch.empty(shape, dtype=dtype, device=device)
    flat = out.view(-1)
    for chunk, start in enumerate(range(0, flat.numel(), CHUNK_ELEMENTS)):
        stop = min(start + CHUNK_ELEMENTS, flat.numel())
        values = symmetric_uniform(stop - start, keys, chunk, out.device)
        flat[start:stop] = values.mul_(half_width).add_(center)
    return out


def _distribution(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(center, half width) of the uniform distribution the tensor's values come from."""
    if name.endswith("norm.weight"):
        return 1.0, NORM_NOISE_STD * _UNIFORM_STD_TO_HALF_WIDTH
    if name.endswith(".bias"):
        return 0.0, BIAS_STD * _UNIFORM_STD_TO_HALF_WIDTH
    fan_in = shape[-1]
    return 0.0, MATRIX_GAIN / math.sqrt(fan_in) * _UNIFORM_STD_TO_HALF_WIDTH


def tensor_keys(seed: int, name: str) -> tuple[int, int]:
    key = digest("random-tensor", GENERATOR_VERSION, seed, name)
    return int(key[:_KEY_HEX_CHARS], 16), int(key[_KEY_HEX_CHARS : 2 * _KEY_HEX_CHARS], 16)


def symmetric_uniform(count: int, keys: tuple[int, int], chunk: int, device: torch.device) -> torch.Tensor:
    """``count`` float32 values in (-1, 1), bit-identical on every device.

    Element ``i`` of batch ``chunk`` is ``mix32((i * odd_key) ^ mix32(key ^ chunk))``,
    in int32 whose wrap-around is the arithmetic mod 2**32 the mixer wants; the
    float steps after it are all exact, so no device's rounding enters.
    """
    chunk_key = mix32_reference((keys[0] ^ chunk) & _MASK32)
    bits = torch.arange(count, dtype=torch.int32, device=device)
    bits.mul_(_as_int32(keys[1] | 1)).bitwise_xor_(_as_int32(chunk_key))
    top = _shift_right(_mix32_(bits), _WORD_BITS - _UNIFORM_BITS).to(torch.float32)
    # (2 * top + 1) / 2**24 - 1: odd multiples of 2**-24, symmetric around 0.
    return top.mul_(2.0 ** (1 - _UNIFORM_BITS)).sub_(1.0 - 2.0**-_UNIFORM_BITS)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    x.bitwise_xor_(_shift_right(x, _MIX_SHIFT_OUTER)).mul_(_as_int32(_MIX_MULTIPLIER_FIRST))
    x.bitwise_xor_(_shift_right(x, _MIX_SHIFT_INNER)).mul_(_as_int32(_MIX_MULTIPLIER_SECOND))
    return x.bitwise_xor_(_shift_right(x, _MIX_SHIFT_OUTER))


def _shift_right(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical shift of int32 bits: torch's ``>>`` copies the sign bit in, so mask it out."""
    return (x >> shift).bitwise_and_((1 << (_WORD_BITS - shift)) - 1)


def _as_int32(value: int) -> int:
    """The int32 with the same 32 bits as the unsigned ``value``."""
    return value - (1 << _WORD_BITS) if value >> (_WORD_BITS - 1) else value


def mix32_reference(value: int) -> int:
    """lowbias32 on one unsigned 32-bit int, in plain Python: the definition the tensor code follows."""
    value ^= value >> _MIX_SHIFT_OUTER
    value = (value * _MIX_MULTIPLIER_FIRST) & _MASK32
    value ^= value >> _MIX_SHIFT_INNER
    value = (value * _MIX_MULTIPLIER_SECOND) & _MASK32
    return value ^ (value >> _MIX_SHIFT_OUTER)


@dataclass
class RandomCheckpoint:
    """Random weights of a named shape, or of the ``config.json`` in a folder (``random:DIR``:
    a trainer's exact architecture, rope and all, and the folder's tokenizer if it has one)."""

    shape_name: str  # a RANDOM_SHAPES key, or a folder with a config.json
    seed: int
    tokenizer_path: str | None = None
    hf_config: PretrainedConfig = field(init=False)
    layout: list[tuple[str, tuple[int, ...]]] = field(init=False)
    directory: Path | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.shape_name in RANDOM_SHAPES:
            self.hf_config = RANDOM_SHAPES[self.shape_name].config()
        elif Path(self.shape_name).expanduser().is_dir():
            self.directory = Path(self.shape_name).expanduser()
            self.hf_config = load_config(self.directory)
        else:
            raise ValueError(
                f"unknown random shape {self.shape_name!r}; known shapes: {', '.join(RANDOM_SHAPES)}, "
                "or a folder holding a config.json"
            )
        self.layout = parameter_layout(self.hf_config)

    @property
    def name(self) -> str:
        return f"{RANDOM_PREFIX}{self.shape_name}@{self.seed}"

    @property
    def path(self) -> None:
        return None

    @property
    def fingerprint(self) -> str:
        # The shape's own values, not the config's JSON: that carries the transformers version.
        if self.directory is not None:
            values = json.loads((self.directory / CONFIG_FILE).read_text())
            values.pop(TRANSFORMERS_VERSION_KEY, None)
            return digest("random-dir", GENERATOR_VERSION, json.dumps(values, sort_keys=True), self.seed)
        shape = RANDOM_SHAPES[self.shape_name]
        params = json.dumps(shape.params, sort_keys=True)
        return digest("random", GENERATOR_VERSION, shape.model_type, params, self.seed)

    @property
    def checkpoint_dtype(self) -> None:
        return None

    @property
    def eos_token_ids(self) -> list[int]:
        return eos_token_ids(self.hf_config, directory=self.directory)

    def iter_weights(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> Weights:
        for name, shape in self.layout:
            yield name, random_tensor(name, shape, self.seed, dtype, device)

    def load_tokenizer(self) -> PreTrainedTokenizerBase | None:
        if self.tokenizer_path is not None:
            return load_tokenizer_from(self.tokenizer_path)
        if self.directory is not None and has_tokenizer(self.directory):
            return load_tokenizer_from(self.directory)
        return None
