"""CUDA graphs for steps with prefill rows: everything but attention, per token bucket.

A decode-only step replays one whole graph (``cuda_graphs``). A step with prefill rows
cannot: how attention splits its work depends on every row's query and context length.
Run eagerly, its ~400 small launches cost more host time than the device spends on them
(H200, Llama-3-8B, a 44-token extend over a 19,456-token prefix: 22.7 ms a forward for
7.5 ms of device work), and every resume from the KV tier is a run of such steps.

So the layers are cut at attention: piece 0 is the embedding and layer 0 up to its
attention, piece ``i`` is the rest of layer ``i - 1`` and layer ``i`` up to its attention,
the last piece the rest of the last layer and the final norm. Each piece is captured once
per token bucket; attention runs eagerly between replays, over the step's real tokens.
The pieces hand over through static buffers (q, k, v, residual, attention output): the
rows past the step's tokens carry stale values that stay in their own rows.

``use_graphs=False`` runs the same pieces through the same buffers without capturing,
so the plumbing is testable where there is no GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from siesta.attention.base import AttentionMetadata, KVCache
from siesta.core.cuda_graphs import capture_graph
from siesta.model.interface import CausalModel

logger = logging.getLogger(__name__)

# Token counts of the captured buckets. Past the largest, a step runs eagerly: its matmuls
# take long enough that launches no longer dominate.
BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)


@dataclass
class _Buffers:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    q: torch.Tensor  # [T, heads, head_dim]
    k: torch.Tensor  # [T, kv_heads, head_dim]
    v: torch.Tensor  # [T, kv_heads, head_dim]
    residual: torch.Tensor  # [T, hidden]
    attn_out: torch.Tensor  # [T, heads, head_dim]
    hidden: torch.Tensor  # [T, hidden]: the last piece's output


class PiecewiseGraphs:
    def __init__(self, model: CausalModel, kv_cache: KVCache, max_tokens: int, use_graphs: bool = True) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.use_graphs = use_graphs
        # Every bucket below the step budget and the first that holds it (the largest, past 2,048).
        holds_all = next((b for b in BUCKETS if b >= max_tokens), BUCKETS[-1])
        self.buckets = sorted({b for b in BUCKETS if b < max_tokens} | {holds_all})
        shape, local = model.shape, model.local  # attention buffers hold this rank's heads
        n, dev = self.buckets[-1], kv_cache.tensor.device
        dtype = model.weight_dtype

        def zeros(*dims: int) -> torch.Tensor:
            return torch.zeros((n, *dims), dtype=dtype, device=dev)

        self.buf = _Buffers(
            input_ids=torch.zeros(n, dtype=torch.int64, device=dev),
            positions=torch.zeros(n, dtype=torch.int64, device=dev),
            q=zeros(local.num_heads, local.head_dim),
            k=zeros(local.num_kv_heads, local.head_dim),
            v=zeros(local.num_kv_heads, local.head_dim),
            residual=zeros(shape.hidden_size),
            attn_out=zeros(local.num_heads, local.head_dim),
            hidden=torch.zeros((n, shape.hidden_size), dtype=model.hidden_dtype(dtype), device=dev),
        )
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = None

    @property
    def num_pieces(self) -> int:
        return len(self.model.decoder_layers) + 1

    def bucket_for(self, num_tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= num_tokens), None)

    # -- the pieces ------------------------------------------------------------------------

    def _piece(self, index: int, t: int) -> None:
        """Piece ``index`` over the buffers' first ``t`` rows."""
        buf, layers = self.buf, self.model.decoder_layers
        if index == 0:
            x, residual = self.model.embed(buf.input_ids[:t]), None
        else:
            x, residual = layers[index - 1].after_attention(buf.attn_out[:t], buf.residual[:t])
        if index == len(layers):
            buf.hidden[:t].copy_(self.model.final_norm(x, residual))
            return
        q, k, v, residual = layers[index].before_attention(x, residual, buf.positions[:t])
        buf.q[:t].copy_(q)
        buf.k[:t].copy_(k)
        buf.v[:t].copy_(v)
        buf.residual[:t].copy_(residual)

    def _attention(self, index: int, n: int, meta: AttentionMetadata) -> None:
        buf = self.buf
        self.model.decoder_layers[index].attend(
            buf.q[:n], buf.k[:n], buf.v[:n], self.kv_cache, meta, out=buf.attn_out[:n]
        )

    # -- capture and replay ----------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.use_graphs:
            return
        t0 = time.perf_counter()
        self.graphs.clear()
        for b in reversed(self.buckets):  # largest first: the smaller ones reuse its pool
            for index in range(self.num_pieces):
                self._piece(index, b)  # warm-up: compile kernels outside the capture
            torch.cuda.synchronize()
            pieces = []
            for index in range(self.num_pieces):
                # One pool for every piece: they run one after another, and each piece's
                # temporaries are dead once its outputs are in the buffers.
                graph, _, self.pool = capture_graph(lambda i=index: self._piece(i, b), self.pool)
                pieces.append(graph)
            self.graphs[b] = pieces
        torch.cuda.synchronize()
        logger.info(
            "captured %d piecewise graphs in %.1fs", sum(map(len, self.graphs.values())), time.perf_counter() - t0
        )

    def invalidate(self) -> None:
        """Drop the graphs (their addresses died with a sleep); the next ``run`` recaptures."""
        self.graphs.clear()
        self.pool = None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states of the step's tokens, or None if no bucket holds them."""
        n = input_ids.shape[0]
        b = self.bucket_for(n)
        if b is None:
            return None
        if self.use_graphs and not self.graphs:
            self.capture()
        self.buf.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.buf.positions[:n].copy_(positions, non_blocking=True)
        pieces: list[Callable[[], None]]
        if self.use_graphs:
            pieces = [g.replay for g in self.graphs[b]]
        else:
            pieces = [lambda i=i: self._piece(i, b) for i in range(self.num_pieces)]
        for index, piece in enumerate(pieces):
            piece()
            if index < self.num_pieces - 1:
                self._attention(index, n, meta)
        return self.buf.hidden[:n]
