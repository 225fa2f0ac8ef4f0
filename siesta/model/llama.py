"""One decoder for the Llama family: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Parameters keep Hugging Face checkpoint names, except that q/k/v and gate/up are
fused into one matmul each; ``load_weights`` maps checkpoint tensors onto them, so
a trainer's ``state_dict()`` loads directly.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from siesta.attention.base import AttentionBackend, AttentionMetadata, KVCache
from siesta.model.layers import Linear, MergedLinear, RMSNorm, RotaryEmbedding, rope_parameters, silu_and_mul

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class WeightTarget:
    """The tensor a checkpoint tensor is copied into, and the name ``load_weights`` reports."""

    key: str  # "param" or "param:shard" for the rows of a fused parameter
    view: torch.Tensor


@dataclass(frozen=True)
class DecoderShape:
    """The numbers the engine needs from a transformers config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    rope: dict[str, Any]

    @classmethod
    def from_config(cls, config: Any) -> DecoderShape:
        model_type = config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; siesta runs {', '.join(SUPPORTED_MODEL_TYPES)}")
        heads = config.num_attention_heads
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            # Qwen2 always has q/k/v biases; the others say so in attention_bias.
            qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            rope=rope_parameters(config),
        )


class Attention(nn.Module):
    def __init__(self, shape: DecoderShape, layer_idx: int, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        self.qkv_proj = MergedLinear(shape.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=shape.qkv_bias)
        self.o_proj = Linear(q_size, shape.hidden_size, bias=False)
        self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps) if shape.qk_norm else None
        self.k_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps) if shape.qk_norm else None
        self.rotary = rotary
        self.backend = backend
        self.scale = shape.head_dim**-0.5

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's q ``[T, heads, dim]`` and k, v ``[T, kv_heads, dim]``, rotated (and normed)."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim], dim=-1
        )
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return (*self.rotary(positions, q, k), v)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.backend.forward(q, k, v, kv_cache, self.layer_idx, meta, self.scale, out=out)


class MLP(nn.Module):
    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.inter = shape.intermediate_size
        self.gate_up_proj = MergedLinear(shape.hidden_size, {"gate": self.inter, "up": self.inter}, bias=False)
        self.down_proj = Linear(self.inter, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, shape: DecoderShape, layer_idx: int, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape, layer_idx, rotary, backend)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` is the previous layer's output, not yet added to the ``residual`` stream
        (None for the first layer): each add is fused with the norm that follows it."""
        q, k, v, residual = self.before_attention(x, residual, positions)
        return self.after_attention(self.self_attn.attend(q, k, v, kv_cache, meta), residual)

    # The two halves around attention: CUDA graphs of mixed batches capture everything but
    # attention (``siesta.core.piecewise_graphs``), which runs between them.

    def before_attention(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, k, v, residual)`` of this layer from the previous layer's output."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        return (*self.self_attn.project(h, positions), residual)

    def after_attention(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's output (not yet added to the residual stream) and the residual stream."""
        h = self.self_attn.o_proj(attn_out.reshape(attn_out.shape[0], -1))
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, shape: DecoderShape, max_positions: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        # One table shared by every layer; not a parameter, never loaded.
        self.rotary = RotaryEmbedding(shape.head_dim, max_positions, shape.rope)
        self.layers = nn.ModuleList(DecoderLayer(shape, i, self.rotary, backend) for i in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: Any, max_positions: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.shape = DecoderShape.from_config(config)
        self.model = DecoderModel(self.shape, max_positions, backend)
        self.lm_head = Linear(self.shape.hidden_size, self.shape.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output head; again after ``to_empty``, which unties them."""
        if self.shape.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the step's tokens."""
        x, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            x, residual = layer(x, residual, positions, kv_cache, meta)
        return self.final_norm(x, residual)

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.model.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], written: set[str] | None = None) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names) into the parameters in place.

        In place, so addresses stay put: CUDA graphs and sleep arenas keep pointing at them.
        Returns the parameter names that were written, collected into ``written`` as they are
        (so a caller still knows them when a later tensor raises).
        """
        written = set() if written is None else written
        params = self.parameter_table()
        for name, tensor in weights:
            target = self.weight_target(name, params)
            if target is None:
                continue
            if target.view.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.view.shape)}")
            with torch.no_grad():
                target.view.copy_(tensor)
            written.add(target.key)
        return written

    def weight_target(self, name: str, params: dict[str, nn.Parameter] | None = None) -> WeightTarget | None:
        """Where the checkpoint tensor ``name`` goes: a parameter, or the rows of a fused one.

        Takes Hugging Face names (``...q_proj.weight``) and this model's fused names
        (``...qkv_proj.weight``). None for tensors the model does not keep (rotary tables,
        the head of a tied checkpoint); raises ValueError, naming it, for one it has no place for.
        Pass ``parameter_table()`` when looking up many: building it walks the whole model.
        """
        mapped = _map_checkpoint_name(name)
        if mapped is None:
            return None
        pname, shard, kind = mapped
        if pname == "lm_head.weight" and self.shape.tie_word_embeddings:
            return None  # some tied checkpoints store the shared matrix twice
        params = self.parameter_table() if params is None else params
        if pname not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in this {self.shape.model_type} model")
        if shard is None:
            return WeightTarget(pname, params[pname].data)
        module = self._merged_modules().get(pname.rsplit(".", 1)[0])
        if module is None:
            raise ValueError(f"checkpoint tensor {name!r} is a shard, but {pname!r} is not a fused layer here")
        return WeightTarget(f"{pname}:{shard}", module.shard_view(shard, kind))

    def _merged_modules(self) -> dict[str, MergedLinear]:
        """The fused layers by name: modules are never replaced (their parameters may be), and a
        weight push looks one up per q/k/v/gate/up tensor; get_submodule walks the tree each time."""
        table = self.__dict__.get("_merged_table")
        if table is None:
            table = {name: m for name, m in self.named_modules() if isinstance(m, MergedLinear)}
            self.__dict__["_merged_table"] = table
        return table

    def parameter_table(self) -> dict[str, nn.Parameter]:
        """Name -> parameter, now (to_empty and sleep may swap parameter objects: not kept)."""
        return dict(self.named_parameters(remove_duplicate=False))

    def expected_weight_names(self) -> set[str]:
        """What a complete checkpoint writes, in ``load_weights``'s return format."""
        names: set[str] = set()
        for pname, _ in self.named_parameters():
            module_name, kind = pname.rsplit(".", 1)
            module = self.get_submodule(module_name)
            if isinstance(module, MergedLinear):
                names.update(f"{pname}:{shard}" for shard in module.offsets)
            else:
                names.add(pname)
        return names


# Checkpoint names seen by weight pushes (every push repeats the model's few hundred).
CHECKPOINT_NAME_CACHE = 4096
_SHARDS = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
           "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}  # fmt: skip


@functools.lru_cache(maxsize=CHECKPOINT_NAME_CACHE)
def _map_checkpoint_name(name: str) -> tuple[str, str | None, str] | None:
    """HF name -> (parameter name, shard or None, weight|bias); None for tensors we do not keep."""
    if "rotary_emb" in name:
        return None
    parts = name.split(".")
    kind = parts[-1]
    if len(parts) >= 2 and parts[-2] in _SHARDS:
        fused, shard = _SHARDS[parts[-2]]
        return ".".join([*parts[:-2], fused, kind]), shard, kind
    return name, None, kind
