"""One decoder for the Llama family: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm); the
base of the families that share its attention (``qwen3_moe``). Its checkpoint names are
``llama_names``'s.

Parameters keep Hugging Face checkpoint names, except that q/k/v and gate/up are
fused into one matmul each; ``load_weights`` maps checkpoint tensors onto them, so
a trainer's ``state_dict()`` loads directly.

Under tensor parallelism (``TensorParallel``, cut as ``tensor_parallel`` says) each rank's
model holds its shard of every parameter, and ``weight_target`` says which part of each full
checkpoint tensor that is: every loader and every weight push hands over full tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from siesta.attention.base import AttentionBackend, AttentionMetadata, KVCache
from siesta.model import l2_prefetch, llama_names
from siesta.model.interface import KVLayout, PiecewiseLayer, RoutingSink
from siesta.model.l2_prefetch import NO_PREFETCH, Prefetches
from siesta.model.layers import Embedding, Linear, MergedLinear, RMSNorm, RotaryEmbedding, rope_parameters, silu_and_mul
from siesta.model.registry import SUPPORTED_MODEL_TYPES, check_model_type
from siesta.model.tensor_parallel import LocalShape, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from siesta.model.weights import UNPLANNED, CheckpointPart, Place, Plan, WeightCut, WeightTarget
from siesta.parallel import SINGLE, TensorParallel

# Re-exported: the updater, the benches and the tests take them from here.
__all__ = ["SUPPORTED_MODEL_TYPES", "CausalLM", "DecoderShape", "WeightCut", "WeightTarget"]


# Qwen3's attention norms q and k per head (its MoE sibling shares the attention).
QK_NORM_TYPES = frozenset({"qwen3", "qwen3_moe"})


@dataclass(frozen=True)
class DecoderShape:
    """The numbers the engine needs from a transformers config."""

    # The fields that set the shapes (and the set) of the weight tensors: a checkpoint read into
    # the served model must agree on these (``weight_transfer.checkpoints``).
    weight_shape_fields: ClassVar[tuple[str, ...]] = (
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
        "head_dim", "qkv_bias", "qk_norm", "tie_word_embeddings")  # fmt: skip

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
        check_model_type(model_type)
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
            qk_norm=model_type in QK_NORM_TYPES,
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
        return self.rotate(self.qkv_proj(x), positions)

    def rotate(self, qkv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``project``'s q, k, v from the fused projection's output ``qkv``."""
        t = qkv.shape[0]
        q, k, v = qkv.split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim], dim=-1
        )
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            return (*self.rotary.norm_and_rotate(positions, q, k, self.q_norm, self.k_norm), v)
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
        mlp: nn.Module | None = None,
    ) -> None:
        """``mlp``: what follows attention, the dense MLP unless a family gives another (a
        sparse mixture-of-experts block)."""
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape, local, layer_idx, rotary, backend, tp)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape, local, tp) if mlp is None else mlp

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        prefetch: Prefetches = NO_PREFETCH,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` is the previous layer's output, not yet added to the ``residual`` stream
        (None for the first layer): each add is fused with the norm that follows it.
        ``prefetch``: the step's L2 prefetches (``l2_prefetch``), issued beside attention and
        before the MLP."""
        q, k, v, residual = self.before_attention(x, residual, positions)
        prefetch.during_attention(self.self_attn.layer_idx)
        return self.after_attention(self.self_attn.attend(q, k, v, kv_cache, meta), residual, prefetch)

    # The two halves around attention: CUDA graphs of mixed batches capture everything but
    # attention (``siesta.core.piecewise_graphs``), which runs between them.

    def before_attention(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, k, v, residual)`` of this layer from the previous layer's output."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
            return (*self.self_attn.project(h, positions), residual)
        qkv, residual = self.input_layernorm.add_norm_linear(x, residual, self.self_attn.qkv_proj)
        return (*self.self_attn.rotate(qkv, positions), residual)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.self_attn.attend(q, k, v, kv_cache, meta, out=out)

    def after_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor, prefetch: Prefetches = NO_PREFETCH
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's output (not yet added to the residual stream) and the residual stream."""
        h = self.self_attn.o_proj(attn_out.reshape(attn_out.shape[0], -1))
        prefetch.before_mlp(self.self_attn.layer_idx)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(
        self,
        shape: DecoderShape,
        local: LocalShape,
        max_positions: int,
        backend: AttentionBackend,
        tp: TensorParallel,
        mlp_for: Callable[[int], nn.Module | None] | None = None,
    ) -> None:
        super().__init__()
        if tp.size == 1:
            self.embed_tokens = Embedding(shape.vocab_size, shape.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(local, shape.hidden_size, tp)
        # One table shared by every layer; not a parameter, never loaded.
        self.rotary = RotaryEmbedding(shape.head_dim, max_positions, shape.rope)
        self.layers = nn.ModuleList(
            DecoderLayer(shape, local, i, self.rotary, backend, tp, None if mlp_for is None else mlp_for(i))
            for i in range(shape.num_layers)
        )
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class CausalLM(nn.Module):
    """The dense decoder (``siesta.model.interface.CausalModel``). Another family that shares
    its attention subclasses it: its shape, what follows attention (``_mlp``), its checkpoint
    names (``map_name``) and the plans of the parameters it adds (``_plan_part``)."""

    shape_class: type[DecoderShape] = DecoderShape
    map_name = staticmethod(llama_names.map_checkpoint_name)
    routing: RoutingSink | None = None  # a dense model routes nowhere

    def __init__(self, config: Any, max_positions: int, backend: AttentionBackend, tp: TensorParallel = SINGLE,
                 head_fp32: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.tp = tp
        # The final norm, the output head and so the logits in fp32 whatever the weights' dtype
        # (vLLM's head_dtype, SGLang's fp32 LM head): bf16 logits round by up to 1/32 at |8|.
        self.head_fp32 = head_fp32
        self.shape = self.shape_class.from_config(config)  # the whole model's
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
        self.model = DecoderModel(self.shape, self.local, max_positions, backend, tp, self._mlp)
        if tp.size == 1:
            self.lm_head = Linear(self.shape.hidden_size, self.shape.vocab_size, bias=False)
        else:
            self.lm_head = ParallelLMHead(self.local, self.shape.hidden_size, self.shape.vocab_size, tp)
        self.tie_weights()

    def _mlp(self, layer_idx: int) -> nn.Module | None:
        """What follows attention in layer ``layer_idx``; None: the dense MLP."""
        return None

    # -- the interface's views ---------------------------------------------------------

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout(self.local.num_layers, self.local.num_kv_heads, self.local.head_dim)

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def decoder_layers(self) -> Sequence[PiecewiseLayer]:
        return self.model.layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def build_tables(self, device: torch.device | None) -> None:
        self.model.rotary.build_tables(device)

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
        prefetch = l2_prefetch.for_step(self.model.layers, input_ids.shape[0], input_ids.device)
        *layers, last = self.model.layers
        for layer in layers:
            x, residual = layer(x, residual, positions, kv_cache, meta, prefetch)
        if keep is None:
            hidden = self.final_norm(*last(x, residual, positions, kv_cache, meta, prefetch))
            prefetch.join()
            return hidden
        prefetch.join()
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
        plan = plans.get(name, UNPLANNED)
        if plan is UNPLANNED:
            plan = plans[name] = self._plan(name, params)  # names and shapes never change: planned once
        if plan is None:
            return None
        # Bound targets are kept while their parameter is the same object at the same address:
        # binding builds views (9 us a tensor, 67 ms of a per-expert 30B-A3B push on an H100,
        # run 61c). An arena sleep re-maps the same addresses (kept); a CPU sleep resizes the
        # storage in place and to_empty gives parameters new storage (both bind again). The
        # views hold no slept memory: arenas unmap the pages, a CPU sleep empties the storage.
        param = params[plan.pname]
        bound = self.__dict__.setdefault("_bound_targets", {})
        kept = bound.get(name)
        if kept is not None and kept[0] is param and kept[1] == param.data_ptr():
            return kept[2]
        target = plan.bind(params)
        bound[name] = (param, param.data_ptr(), target)
        return target

    def _plan(self, name: str, params: dict[str, nn.Parameter]) -> Plan | None:
        part = self.map_name(name)
        if part is None:
            return None
        if part.pname == "lm_head.weight" and self.shape.tie_word_embeddings:
            return None  # some tied checkpoints store the shared matrix twice
        if part.pname not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in this {self.shape.model_type} model")
        return self._plan_part(name, part, params)

    def _plan_part(self, name: str, part: CheckpointPart, params: dict[str, nn.Parameter]) -> Plan:
        """The plan of a checkpoint tensor whose parameter is ``part.pname`` (a family adds its
        own parameters' plans here)."""
        pname, shard = part.pname, part.shard
        shape = tuple(params[pname].shape)
        module = self._merged_modules().get(pname.rsplit(".", 1)[0])
        if shard is not None:
            if module is None:
                raise ValueError(f"checkpoint tensor {name!r} is a shard, but {pname!r} is not a fused layer here")
            offset, _ = module.offsets[shard]
            start, length, full = self._shard_ranges[shard]
            place = Place(0, offset, start, length, whole=length == full, all_rows=False)
            return Plan(pname, (f"{pname}:{shard}",), (full, *shape[1:]), (place,))
        if module is not None:
            return self._fused_plan(pname, shape, module)
        dim, start, length, full = self._split_of(pname) or (0, 0, shape[0], shape[0])
        whole = start == 0 and length == full == shape[dim]
        full_shape = (*shape[:dim], full, *shape[dim + 1 :])
        place = Place(dim, 0, start, length, whole=whole, all_rows=length == shape[dim])
        return Plan(pname, (pname,), full_shape, (place,))

    def _fused_plan(self, pname: str, shape: tuple[int, ...], module: MergedLinear) -> Plan:
        """A fused q|k|v or gate|up tensor pushed whole: each rank takes its rows of every part."""
        keys = tuple(f"{pname}:{shard}" for shard in module.offsets)
        ranges = [self._shard_ranges[shard] for shard in module.offsets]
        full_rows = sum(full for _, _, full in ranges)
        full_shape = (full_rows, *shape[1:])
        if full_rows == shape[0]:  # one device: the whole tensor in one copy
            return Plan(pname, keys, full_shape, (Place(0, 0, 0, full_rows, whole=True, all_rows=True),))
        places, offset = [], 0
        for (local_offset, _), (start, length, full) in zip(module.offsets.values(), ranges):
            places.append(Place(0, local_offset, offset + start, length, whole=False, all_rows=False))
            offset += full
        return Plan(pname, keys, full_shape, tuple(places))

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
        """What a complete checkpoint writes, in ``load_weights``'s return format: a fused layer's
        parts, the experts of a module that says so (``weight_keys``), else each parameter."""
        names: set[str] = set()
        for pname, _ in self.named_parameters():
            module_name, _ = pname.rsplit(".", 1)
            module = self.get_submodule(module_name)
            if isinstance(module, MergedLinear):
                names.update(f"{pname}:{shard}" for shard in module.offsets)
            elif hasattr(module, "weight_keys"):
                names.update(module.weight_keys(pname))
            else:
                names.add(pname)
        return names
