"""One decoder for the Llama family: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Parameters keep Hugging Face checkpoint names, except that q/k/v and gate/up are
fused into one matmul each; ``load_weights`` maps checkpoint tensors onto them, so
a trainer's ``state_dict()`` loads directly.

Under tensor parallelism (``TensorParallel``, cut as ``tensor_parallel`` says) each rank's
model holds its shard of every parameter, and ``weight_target`` says which part of each full
checkpoint tensor that is: every loader and every weight push hands over full tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from siesta.attention.base import AttentionBackend, AttentionMetadata, KVCache
from siesta.model.layers import Linear, MergedLinear, RMSNorm, RotaryEmbedding, rope_parameters, silu_and_mul
from siesta.model.parallel import SINGLE, TensorParallel
from siesta.model.tensor_parallel import LocalShape, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class WeightCut(NamedTuple):
    """``full.narrow(dim, start, length)`` of a full checkpoint tensor lands in ``dest``.

    Tuples, not dataclasses: a weight push builds a target per tensor, and a frozen
    dataclass's ``__init__`` costs a microsecond more per object (the 8B push is 291 tensors)."""

    dest: torch.Tensor
    dim: int
    start: int
    length: int
    whole: bool  # the cut is the full tensor itself: taken as is (no view to build per tensor)

    def of(self, full: torch.Tensor) -> torch.Tensor:
        return full if self.whole else full.narrow(self.dim, self.start, self.length)


class WeightTarget(NamedTuple):
    """Where a full checkpoint tensor goes on this rank, and which part of it this rank keeps.

    One cut, except for a fused q|k|v (or gate|up) tensor pushed whole under tensor
    parallelism: this rank's q rows, its k rows and its v rows are three ranges of it.
    """

    keys: tuple[str, ...]  # what ``load_weights`` reports written: "param", or "param:shard" per shard
    full_shape: tuple[int, ...]  # the whole tensor's shape, as checkpoints and trainers hold it
    cuts: tuple[WeightCut, ...]

    @property
    def view(self) -> torch.Tensor:
        """This rank's destination of a one-cut target (what the checkpoint tensor's shard becomes)."""
        if len(self.cuts) != 1:
            raise ValueError(f"{self.keys} land in {len(self.cuts)} places on this rank, not one")
        return self.cuts[0].dest

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``full``: a view for one cut; the pieces of a fused tensor joined."""
        if len(self.cuts) == 1:
            return self.cuts[0].of(full)
        return torch.cat([cut.of(full) for cut in self.cuts], dim=self.cuts[0].dim)

    def write(self, full: torch.Tensor) -> None:
        """Copy this rank's part of ``full`` into the parameters (casting to their dtype)."""
        for cut in self.cuts:
            cut.dest.copy_(cut.of(full))


class _Place(NamedTuple):
    """A WeightCut without its tensor: ``full.narrow(dim, start, length)`` lands in the
    parameter's ``length`` rows from ``dest_offset`` (along ``dim``)."""

    dim: int
    dest_offset: int
    start: int
    length: int
    whole: bool  # the cut is the full tensor itself
    all_rows: bool  # the destination is the whole parameter

    def bind(self, param: torch.Tensor) -> WeightCut:
        dest = param if self.all_rows else param.narrow(self.dim, self.dest_offset, self.length)
        return WeightCut(dest, self.dim, self.start, self.length, self.whole)


class _Plan(NamedTuple):
    pname: str
    keys: tuple[str, ...]
    full_shape: tuple[int, ...]
    places: tuple[_Place, ...]


_UNPLANNED = object()


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
    def __init__(
        self,
        shape: DecoderShape,
        local: LocalShape,
        layer_idx: int,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = local.num_heads, local.num_kv_heads, local.head_dim
        q_size, kv_size = local.num_heads * local.head_dim, local.num_kv_heads * local.head_dim
        self.qkv_proj = MergedLinear(shape.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=shape.qkv_bias)
        self.o_proj = _row_linear(q_size, shape.hidden_size, tp)
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


def _row_linear(in_features: int, out_features: int, tp: TensorParallel) -> Linear:
    """A projection back to the hidden size: the plain layer on one device (today's ops, no
    collective), else this rank's input columns and the all-reduce."""
    if tp.size == 1:
        return Linear(in_features, out_features, bias=False)
    return RowParallelLinear(in_features, out_features, bias=False, tp=tp)


class MLP(nn.Module):
    def __init__(self, shape: DecoderShape, local: LocalShape, tp: TensorParallel) -> None:
        super().__init__()
        self.inter = local.intermediate_size
        self.gate_up_proj = MergedLinear(shape.hidden_size, {"gate": self.inter, "up": self.inter}, bias=False)
        self.down_proj = _row_linear(self.inter, shape.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        shape: DecoderShape,
        local: LocalShape,
        layer_idx: int,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape, local, layer_idx, rotary, backend, tp)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape, local, tp)

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
    def __init__(
        self, shape: DecoderShape, local: LocalShape, max_positions: int, backend: AttentionBackend, tp: TensorParallel
    ) -> None:
        super().__init__()
        if tp.size == 1:
            self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(local, shape.hidden_size, tp)
        # One table shared by every layer; not a parameter, never loaded.
        self.rotary = RotaryEmbedding(shape.head_dim, max_positions, shape.rope)
        self.layers = nn.ModuleList(
            DecoderLayer(shape, local, i, self.rotary, backend, tp) for i in range(shape.num_layers)
        )
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: Any, max_positions: int, backend: AttentionBackend, tp: TensorParallel = SINGLE,
                 head_fp32: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.tp = tp
        # The final norm, the output head and so the logits in fp32 whatever the weights' dtype
        # (vLLM's head_dtype, SGLang's fp32 LM head): bf16 logits round by up to 1/32 at |8|.
        self.head_fp32 = head_fp32
        self.shape = DecoderShape.from_config(config)  # the whole model's
        self.local = LocalShape.of(
            num_layers=self.shape.num_layers,
            head_dim=self.shape.head_dim,
            num_heads=self.shape.num_heads,
            num_kv_heads=self.shape.num_kv_heads,
            intermediate_size=self.shape.intermediate_size,
            vocab_size=self.shape.vocab_size,
            tp=tp,
        )
        self._shard_ranges = self._part_ranges()
        self.model = DecoderModel(self.shape, self.local, max_positions, backend, tp)
        if tp.size == 1:
            self.lm_head = Linear(self.shape.hidden_size, self.shape.vocab_size, bias=False)
        else:
            self.lm_head = ParallelLMHead(self.local, self.shape.hidden_size, self.shape.vocab_size, tp)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output head; again after ``to_empty``, which unties them.
        Under tensor parallelism both hold the same vocabulary rows, so one shard is shared."""
        if self.shape.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the step's tokens.

        ``keep``: the rows whose hidden states are read (those whose logits are taken). The last
        layer still writes every row's K/V, but its o_proj, MLP and the final norm run on those
        rows alone: a prompt chunk's other rows feed only the cache. The rows not kept are NaN,
        so that a reader of one fails loudly."""
        x, residual = self.model.embed_tokens(input_ids), None
        *layers, last = self.model.layers
        for layer in layers:
            x, residual = layer(x, residual, positions, kv_cache, meta)
        if keep is None:
            return self.final_norm(*last(x, residual, positions, kv_cache, meta))
        q, k, v, residual = last.before_attention(x, residual, positions)
        attn = last.self_attn.attend(q, k, v, kv_cache, meta)
        hidden = residual.new_full(residual.shape, float("nan"), dtype=self.hidden_dtype(residual.dtype))
        if len(keep):  # none read (a chunk of a prompt that goes on): no tail at all
            hidden[keep] = self.final_norm(*last.after_attention(attn[keep], residual[keep]))
        return hidden

    def hidden_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the final hidden states (what ``forward`` returns) for weights of ``dtype``."""
        return torch.float32 if self.head_fp32 else dtype

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.head_fp32:
            x, residual = x.float(), residual.float()
        return self.model.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_fp32:
            return self.lm_head.fp32_forward(hidden)
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], written: set[str] | None = None) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names, full shapes) into the parameters in place;
        under tensor parallelism each rank copies its part of each.

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
            if target.full_shape != tuple(tensor.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {target.full_shape}")
            with torch.no_grad():
                target.write(tensor)
            written.update(target.keys)
        return written

    def weight_target(self, name: str, params: dict[str, nn.Parameter] | None = None) -> WeightTarget | None:
        """Where the checkpoint tensor ``name`` goes: a parameter, or the rows of a fused one, and
        which part of the full tensor this rank keeps.

        Takes Hugging Face names (``...q_proj.weight``) and this model's fused names
        (``...qkv_proj.weight``). None for tensors the model does not keep (rotary tables,
        the head of a tied checkpoint); raises ValueError, naming it, for one it has no place for.
        Pass ``parameter_table()`` when looking up many: building it walks the whole model.
        """
        params = self.parameter_table() if params is None else params
        plans = self.__dict__.setdefault("_weight_plans", {})
        plan = plans.get(name, _UNPLANNED)
        if plan is _UNPLANNED:
            plan = plans[name] = self._plan(name, params)  # names and shapes never change: planned once
        if plan is None:
            return None
        param = params[plan.pname].data  # the parameter now: sleep and to_empty may swap it
        places = plan.places
        cuts = (places[0].bind(param),) if len(places) == 1 else tuple(place.bind(param) for place in places)
        return WeightTarget(plan.keys, plan.full_shape, cuts)

    def _plan(self, name: str, params: dict[str, nn.Parameter]) -> _Plan | None:
        mapped = _map_checkpoint_name(name)
        if mapped is None:
            return None
        pname, shard, _ = mapped
        if pname == "lm_head.weight" and self.shape.tie_word_embeddings:
            return None  # some tied checkpoints store the shared matrix twice
        if pname not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in this {self.shape.model_type} model")
        shape = tuple(params[pname].shape)
        module = self._merged_modules().get(pname.rsplit(".", 1)[0])
        if shard is not None:
            if module is None:
                raise ValueError(f"checkpoint tensor {name!r} is a shard, but {pname!r} is not a fused layer here")
            offset, _ = module.offsets[shard]
            start, length, full = self._shard_ranges[shard]
            place = _Place(0, offset, start, length, whole=length == full, all_rows=False)
            return _Plan(pname, (f"{pname}:{shard}",), (full, *shape[1:]), (place,))
        if module is not None:
            return self._fused_plan(pname, shape, module)
        dim, start, length, full = self._split_of(pname) or (0, 0, shape[0], shape[0])
        whole = start == 0 and length == full == shape[dim]
        full_shape = (*shape[:dim], full, *shape[dim + 1 :])
        place = _Place(dim, 0, start, length, whole=whole, all_rows=length == shape[dim])
        return _Plan(pname, (pname,), full_shape, (place,))

    def _fused_plan(self, pname: str, shape: tuple[int, ...], module: MergedLinear) -> _Plan:
        """A fused q|k|v or gate|up tensor pushed whole: each rank takes its rows of every part."""
        keys = tuple(f"{pname}:{shard}" for shard in module.offsets)
        ranges = [self._shard_ranges[shard] for shard in module.offsets]
        full_rows = sum(full for _, _, full in ranges)
        full_shape = (full_rows, *shape[1:])
        if full_rows == shape[0]:  # one device: the whole tensor in one copy
            return _Plan(pname, keys, full_shape, (_Place(0, 0, 0, full_rows, whole=True, all_rows=True),))
        places, offset = [], 0
        for (local_offset, _), (start, length, full) in zip(module.offsets.values(), ranges):
            places.append(_Place(0, local_offset, offset + start, length, whole=False, all_rows=False))
            offset += full
        return _Plan(pname, keys, full_shape, tuple(places))

    def _part_ranges(self) -> dict[str, tuple[int, int, int]]:
        """``(start, length, full length)`` of this rank's rows in each part's full checkpoint tensor."""
        local, hd = self.local, self.shape.head_dim
        q = (local.head_start * hd, local.num_heads * hd, self.shape.num_heads * hd)
        kv = (local.kv_head_start * hd, local.num_kv_heads * hd, self.shape.num_kv_heads * hd)
        inter = (local.intermediate_start, local.intermediate_size, self.shape.intermediate_size)
        return {"q": q, "k": kv, "v": kv, "gate": inter, "up": inter}

    def _split_of(self, pname: str) -> tuple[int, int, int, int] | None:
        """``(dim, start, length, full length)`` of this rank's part of an unfused parameter's
        full tensor; None for one every rank holds whole (norms)."""
        tail = ".".join(pname.rsplit(".", 2)[-2:])
        if tail == "o_proj.weight":  # row-parallel: this rank's heads are its input columns
            return (1, *self._shard_ranges["q"])
        if tail == "down_proj.weight":
            return (1, *self._shard_ranges["gate"])
        if pname in ("model.embed_tokens.weight", "lm_head.weight"):
            local = self.local
            return 0, local.vocab_start, local.real_vocab_rows(self.shape.vocab_size), self.shape.vocab_size
        return None

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
            module_name, _ = pname.rsplit(".", 1)
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
