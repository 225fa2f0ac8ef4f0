"""CUDA graphs for decode steps, one per batch-size bucket.

A decode step is tens of small kernels per layer; replaying a captured graph
removes their launch cost. Inputs go into static buffers the graph was captured
with; a batch runs in the smallest bucket that holds it, the extra rows write no
KV (slot -1) and are ignored. The attention split count is fixed at capture (for
the longest context), and the kernels read the real lengths from the buffers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from siesta.attention.base import AttentionMetadata, KVCache
from siesta.model.interface import CausalModel

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
NO_SLOT = -1  # the KV-write kernel skips negative slots
_T = TypeVar("_T")


def capture_graph(fn: Callable[[], _T], pool: Any) -> tuple[torch.cuda.CUDAGraph, _T, Any]:
    """``fn`` captured as a graph allocating from ``pool`` (None: a new one): the graph, what
    ``fn`` returned, and the pool, for the graphs captured after it to share. Graphs sharing a
    pool must replay one after another, never overlapping."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out, pool if pool is not None else graph.pool()


@dataclass
class _Buffers:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor
    hidden: torch.Tensor | None = None


class DecodeGraphs:
    def __init__(self, model: CausalModel, kv_cache: KVCache, max_batch: int, max_model_len: int, block_size: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.buckets = [b for b in BUCKETS if b <= max_batch] or [1]
        self.max_blocks = -(-max_model_len // block_size)
        dev = kv_cache.tensor.device
        n = self.buckets[-1]
        self.buf = _Buffers(
            input_ids=torch.zeros(n, dtype=torch.int64, device=dev),
            positions=torch.zeros(n, dtype=torch.int64, device=dev),
            slot_mapping=torch.full((n,), NO_SLOT, dtype=torch.int64, device=dev),
            seq_lens=torch.ones(n, dtype=torch.int32, device=dev),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
            block_tables=torch.zeros((n, self.max_blocks), dtype=torch.int32, device=dev),
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def bucket_for(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def _meta(self, b: int) -> AttentionMetadata:
        buf = self.buf
        return AttentionMetadata(
            query_start_loc=buf.query_start_loc[: b + 1],
            seq_lens=buf.seq_lens[:b],
            block_tables=buf.block_tables[:b],
            slot_mapping=buf.slot_mapping[:b],
            max_query_len=1,
            max_seq_len=self.max_model_len,  # fixes the split count for every context length
            query_start_loc_cpu=list(range(b + 1)),
            seq_lens_cpu=[self.max_model_len] * b,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        self.graphs.clear()
        self.outputs.clear()
        for b in reversed(self.buckets):  # largest first: smaller graphs reuse its pool
            meta = self._meta(b)
            ids, pos = self.buf.input_ids[:b], self.buf.positions[:b]
            self.model(ids, pos, self.kv_cache, meta)  # warm-up: compile kernels outside the capture
            torch.cuda.synchronize()
            self.graphs[b], self.outputs[b], self.pool = capture_graph(
                lambda: self.model(ids, pos, self.kv_cache, meta), self.pool
            )
        torch.cuda.synchronize()
        logger.info("captured %d decode graphs in %.1fs", len(self.graphs), time.perf_counter() - t0)

    def invalidate(self) -> None:
        """Drop the graphs (their addresses died with a sleep); the next ``run`` recaptures."""
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor | None:
        """Hidden states of a decode batch, or None if no bucket holds it."""
        batch = input_ids.shape[0]
        b = self.bucket_for(batch)
        if b is None or block_tables.shape[1] > self.max_blocks:
            return None
        if not self.graphs:
            self.capture()
        buf = self.buf
        buf.input_ids[:batch].copy_(input_ids, non_blocking=True)
        buf.positions[:batch].copy_(positions, non_blocking=True)
        buf.slot_mapping[:batch].copy_(slot_mapping, non_blocking=True)
        buf.slot_mapping[batch:b].fill_(NO_SLOT)
        buf.seq_lens[:batch].copy_(seq_lens, non_blocking=True)
        buf.seq_lens[batch:b].fill_(1)
        buf.block_tables[:batch, : block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        self.graphs[b].replay()
        return self.outputs[b][:batch]
