"""The model interface: what the model runner, the CUDA graphs, the weight updater and tensor
parallelism ask of a model, whatever its family.

A family (``llama``, ``qwen3_moe``...) is one module behind ``siesta.model.registry``; the
engine never names a family's class. What it needs:

- ``forward`` over a step's tokens (paged attention through ``meta``) and ``compute_logits``;
- the KV layout its cache must hold on this rank (``kv_layout``), which sizes the device cache,
  the tiers' blocks and the graphs' buffers;
- the pieces around attention, for piecewise graphs (``embed``, ``decoder_layers``,
  ``final_norm``);
- weight names -> parameter slices (``weight_target``, see ``siesta.model.weights``): every
  loader and push hands over full Hugging Face tensors, and each rank keeps its cut, per
  expert where a parameter stacks experts;
- for mixture-of-experts families, the routing each step took (``routing``), which RL
  frameworks replay in training.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from siesta.model.weights import WeightTarget

if TYPE_CHECKING:
    from siesta.attention.base import AttentionMetadata, KVCache
    from siesta.parallel import TensorParallel

__all__ = ["CausalModel", "KVLayout", "PiecewiseLayer", "RoutingLayout", "RoutingSink", "WeightTarget"]


@dataclass(frozen=True)
class KVLayout:
    """What one rank's KV cache holds per token: K and V of ``num_kv_heads`` heads of
    ``head_dim`` in each of ``num_layers`` layers (this rank's heads under tensor parallelism)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class RoutingLayout:
    """A mixture-of-experts model's routing per token: ``top_k`` expert ids in each of
    ``num_layers`` layers (every decoder layer; a dense one among them routes nowhere and reads
    -1), out of ``num_experts``."""

    num_layers: int
    top_k: int
    num_experts: int


class RoutingSink:
    """Where the sparse layers write the expert ids a step chose: ``buffer[token, layer, k]``
    (on the device, fixed in size so CUDA graphs capture the writes). ``buffer`` is None
    until the runner asks for routing: then nothing is written and nothing costs."""

    def __init__(self, layout: RoutingLayout) -> None:
        self.layout = layout
        self.buffer: torch.Tensor | None = None

    def allocate(self, rows: int, device: torch.device, dtype: torch.dtype = torch.int32) -> None:
        shape = (rows, self.layout.num_layers, self.layout.top_k)
        self.buffer = torch.full(shape, -1, dtype=dtype, device=device)

    def write(self, layer: int, ids: torch.Tensor) -> None:
        if self.buffer is not None:
            self.buffer[: ids.shape[0], layer].copy_(ids)


class PiecewiseLayer(Protocol):
    """A decoder layer cut at attention (piecewise graphs capture the two halves)."""

    def before_attention(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def after_attention(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class CausalModel(Protocol):
    """One rank's shard of a causal language model, as the engine drives it."""

    tp: TensorParallel
    shape: Any  # the whole model's numbers (a family's shape dataclass: vocab_size, hidden_size...)
    local: Any  # this rank's part of them (``LocalShape``)
    routing: RoutingSink | None  # None for dense families

    @property
    def kv_layout(self) -> KVLayout: ...

    @property
    def weight_dtype(self) -> torch.dtype: ...

    @property
    def decoder_layers(self) -> Sequence[PiecewiseLayer]: ...

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def hidden_dtype(self, dtype: torch.dtype) -> torch.dtype: ...

    def tie_weights(self) -> None: ...

    def build_tables(self, device: torch.device | None) -> None:
        """(Re)build what is computed rather than loaded (rotary tables), after ``to_empty``."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], written: set[str] | None = None) -> set[str]: ...

    def weight_target(self, name: str, params: dict[str, nn.Parameter] | None = None) -> WeightTarget | None: ...

    def parameter_table(self) -> dict[str, nn.Parameter]: ...

    def expected_weight_names(self) -> set[str]: ...

    # nn.Module's, which every family is.
    def parameters(self) -> Iterable[nn.Parameter]: ...

    def to(self, *args: Any, **kwargs: Any) -> CausalModel: ...

    def to_empty(self, *, device: torch.device | str | None) -> CausalModel: ...

    def eval(self) -> CausalModel: ...
