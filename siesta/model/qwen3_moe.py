"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's decoder (q/k norms, no biases) with a
sparse mixture-of-experts block after attention (``moe.SparseMoeBlock``) in every layer that
``decoder_sparse_step`` and ``mlp_only_layers`` make sparse, a dense MLP in the others.

Its checkpoint names are ``qwen3_moe_names``'s; the experts' plans are here. Under tensor
parallelism every expert is cut along its intermediate features: rank r holds features
``[r * I / size, (r + 1) * I / size)`` of each expert's gate, up and down.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

from torch import nn

from siesta.attention.base import AttentionBackend
from siesta.model import qwen3_moe_names
from siesta.model.interface import RoutingLayout, RoutingSink
from siesta.model.llama import CausalLM, DecoderShape
from siesta.model.moe import SparseMoeBlock
from siesta.model.weights import CheckpointPart, Place, Plan
from siesta.parallel import SINGLE, TensorParallel

_SHARDS = ("gate", "up")


@dataclass(frozen=True)
class MoeShape(DecoderShape):
    weight_shape_fields: ClassVar[tuple[str, ...]] = (
        *DecoderShape.weight_shape_fields, "num_experts", "moe_intermediate_size", "sparse_layers")

    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[int, ...] = ()  # the layers with experts (the others a dense MLP)

    @classmethod
    def from_config(cls, config: Any) -> MoeShape:
        dense = DecoderShape.from_config(config)
        layers, step = dense.num_layers, getattr(config, "decoder_sparse_step", 1) or 1
        dense_only = set(getattr(config, "mlp_only_layers", None) or ())
        experts = config.num_experts
        sparse = tuple(i for i in range(layers) if i not in dense_only and experts > 0 and (i + 1) % step == 0)
        return cls(
            **{f.name: getattr(dense, f.name) for f in fields(DecoderShape)},
            num_experts=experts,
            top_k=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size,
            norm_topk_prob=bool(config.norm_topk_prob),
            sparse_layers=sparse,
        )


class Qwen3MoeForCausalLM(CausalLM):
    shape_class = MoeShape
    map_name = staticmethod(qwen3_moe_names.map_checkpoint_name)
    shape: MoeShape

    def __init__(self, config: Any, max_positions: int, backend: AttentionBackend, tp: TensorParallel = SINGLE,
                 head_fp32: bool = False) -> None:  # fmt: skip
        shape = MoeShape.from_config(config)
        # Before the layers are built (``_mlp`` hands it to each); not a module.
        self.__dict__["routing"] = RoutingSink(RoutingLayout(shape.num_layers, shape.top_k, shape.num_experts))
        super().__init__(config, max_positions, backend, tp, head_fp32)

    @property
    def expert_range(self) -> tuple[int, int]:
        """``(start, length)`` of this rank's intermediate features of every expert."""
        return self.tp.shard(self.shape.moe_intermediate_size, "MoE intermediate features")

    def _mlp(self, layer_idx: int) -> nn.Module | None:
        shape = self.shape
        if layer_idx not in shape.sparse_layers:
            return None
        return SparseMoeBlock(
            shape.num_experts, shape.hidden_size, shape.top_k, shape.norm_topk_prob, self.expert_range[1],
            layer_idx, self.tp, self.routing,
        )  # fmt: skip

    def _plan_part(self, name: str, part: CheckpointPart, params: dict[str, nn.Parameter]) -> Plan:
        pname = part.pname
        if pname.endswith(f"experts.{qwen3_moe_names.GATE_UP}"):
            return self._gate_up_plan(name, part, tuple(params[pname].shape))
        if pname.endswith(f"experts.{qwen3_moe_names.DOWN}"):
            return self._down_plan(name, part, tuple(params[pname].shape))
        return super()._plan_part(name, part, params)

    def _gate_up_plan(self, name: str, part: CheckpointPart, shape: tuple[int, ...]) -> Plan:
        """This rank's gate rows and up rows (``[E, 2 * I_local, H]``, gate first) of a gate or
        an up tensor of one expert, both of one expert, or both of every expert (stacked)."""
        pname, expert = part.pname, part.expert
        experts, _, hidden = shape
        start, length = self.expert_range
        full = self.shape.moe_intermediate_size
        _check_expert(name, expert, experts)
        if part.shard is not None:  # one expert's gate or up: [I, H]
            offset = 0 if part.shard == "gate" else length
            place = Place(0, offset, start, length, whole=length == full, all_rows=False, expert=expert)
            return Plan(pname, (f"{pname}:{part.shard}:{expert}",), (full, hidden), (place,))
        if expert is not None:  # one expert's gate and up: [2I, H]
            keys, full_shape, dim, which = tuple(f"{pname}:{s}:{expert}" for s in _SHARDS), (2 * full, hidden), 0, expert
        else:  # every expert: [E, 2I, H]
            keys = tuple(f"{pname}:{s}:{e}" for e in range(experts) for s in _SHARDS)
            full_shape, dim, which = (experts, 2 * full, hidden), 1, None
        if length == full:  # one device: the whole tensor in one copy
            return Plan(pname, keys, full_shape, (Place(dim, 0, 0, 2 * full, whole=True, all_rows=True, expert=which),))
        places = (Place(dim, 0, start, length, whole=False, all_rows=False, expert=which),
                  Place(dim, length, full + start, length, whole=False, all_rows=False, expert=which))  # fmt: skip
        return Plan(pname, keys, full_shape, places)

    def _down_plan(self, name: str, part: CheckpointPart, shape: tuple[int, ...]) -> Plan:
        """This rank's input columns of one expert's down (``[H, I]``) or every expert's (``[E, H, I]``)."""
        pname, expert = part.pname, part.expert
        experts, hidden, _ = shape
        start, length = self.expert_range
        full = self.shape.moe_intermediate_size
        whole = length == full
        _check_expert(name, expert, experts)
        if expert is not None:
            place = Place(1, 0, start, length, whole=whole, all_rows=True, expert=expert)
            return Plan(pname, (f"{pname}:{expert}",), (hidden, full), (place,))
        place = Place(2, 0, start, length, whole=whole, all_rows=True)
        return Plan(pname, tuple(f"{pname}:{e}" for e in range(experts)), (experts, hidden, full), (place,))


def _check_expert(name: str, expert: int | None, experts: int) -> None:
    """Refuses, naming the checkpoint tensor, an expert id past this model's experts (checked
    when the name is planned, so before anything of a state dict is written)."""
    if expert is not None and not 0 <= expert < experts:
        raise ValueError(f"checkpoint tensor {name!r}: expert {expert} is not among this model's {experts}")
