"""How the decoder is cut over a tensor-parallel group, and the layers that need a collective.

Megatron's split: q/k/v and gate/up are column-parallel (each rank holds the output rows of
its heads, and its slice of the intermediate features), o_proj and down_proj row-parallel
(each rank holds the matching input columns; an all-reduce sums the partial outputs). The
embedding and the LM head are cut along the vocabulary. Norms, rotary tables and the residual
stream are replicated. The column-parallel projections need no layer of their own: they are the
ordinary fused ``MergedLinear`` over this rank's rows, which ``CausalLM.weight_target`` cuts
from the full checkpoint tensors with the ranges below.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from siesta.model.layers import Embedding, Linear, linear
from siesta.model.parallel import TensorParallel


@dataclass(frozen=True)
class LocalShape:
    """This rank's part of a DecoderShape: what its layers and its KV cache hold."""

    num_layers: int
    head_dim: int
    num_heads: int
    head_start: int  # this rank's first query head
    num_kv_heads: int
    kv_head_start: int  # this rank's first KV head
    intermediate_size: int
    intermediate_start: int
    vocab_size: int  # rows of the embedding and LM head here, padding included
    vocab_start: int
    padded_vocab_size: int  # the whole vocabulary, rounded up to a multiple of the tp size

    @classmethod
    def of(
        cls,
        *,
        num_layers: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        intermediate_size: int,
        vocab_size: int,
        tp: TensorParallel,
    ) -> LocalShape:
        head_start, heads = tp.shard(num_heads, "attention heads")
        kv_start, kv_heads = kv_head_range(num_heads, num_kv_heads, tp)
        inter_start, inter = tp.shard(intermediate_size, "MLP intermediate features")
        padded = -(-vocab_size // tp.size) * tp.size
        vocab_start, vocab = tp.shard(padded, "vocabulary rows")
        return cls(
            num_layers=num_layers,
            head_dim=head_dim,
            num_heads=heads,
            head_start=head_start,
            num_kv_heads=kv_heads,
            kv_head_start=kv_start,
            intermediate_size=inter,
            intermediate_start=inter_start,
            vocab_size=vocab,
            vocab_start=vocab_start,
            padded_vocab_size=padded,
        )

    def real_vocab_rows(self, vocab_size: int) -> int:
        """How many of this rank's vocabulary rows are real tokens (the last rank's may be padding)."""
        return max(0, min(self.vocab_size, vocab_size - self.vocab_start))


def kv_head_range(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """``(first, count)`` of the KV heads this rank's query heads read.

    With at least as many KV heads as ranks each rank holds its equal share. With fewer, the
    KV heads are replicated: ``size / num_kv_heads`` consecutive ranks hold the one KV head their
    query heads share (vLLM's rule), so a rank's KV cache holds that head alone.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} attention heads do not group over {num_kv_heads} KV heads")
    if num_kv_heads >= tp.size:
        return tp.shard(num_kv_heads, "KV heads")
    if tp.size % num_kv_heads:
        raise ValueError(
            f"{num_kv_heads} KV heads can be neither split nor replicated evenly over tensor parallel size {tp.size}"
        )
    return tp.rank * num_kv_heads // tp.size, 1


class RowParallelLinear(Linear):
    """This rank's input columns of a linear layer; the partial products are summed over the
    ranks, and the bias (replicated) is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(Embedding):
    """This rank's rows of the embedding: ids outside them look up zeros, and the sum over the
    ranks is each id's row. No host sync: the mask is computed on the device."""

    def __init__(self, local: LocalShape, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__(local.vocab_size, hidden_size)
        self.start, self.tp = local.vocab_start, tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(Linear):
    """This rank's vocabulary rows of the output head: local logits, gathered over the ranks
    into the padded vocabulary, then cut to the real one."""

    def __init__(self, local: LocalShape, hidden_size: int, vocab_size: int, tp: TensorParallel) -> None:
        super().__init__(hidden_size, local.vocab_size, bias=False)
        self.vocab_size, self.padded, self.tp = vocab_size, local.padded_vocab_size != vocab_size, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._gathered(linear(x, self.weight))

    def fp32_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._gathered(linear(x.float(), self.weight.float()))

    def _gathered(self, local_logits: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather(local_logits, dim=-1)
        # Rows stay contiguous for the sampler's kernels, which read each row at a unit stride.
        return logits[..., : self.vocab_size].contiguous() if self.padded else logits
