"""CUDA graphs of whole steps with prefill rows, for the few-token steps a resume is made of.

Piecewise graphs (``piecewise_graphs``) run attention eagerly between their pieces, because its
split plan depends on every row's lengths. The host then plans and launches five kernels a layer,
and on a slow host that is longer than the device's work: a kept resume's steps (a 44-token
extend over a 19.5k-token prefix beside 4 decodes, Llama-3-8B, fp8 cache) left an H100 idle
2.3-3.5 ms of 11.5-15.6 (run 54b), and a request lives through four or five of them.

So a step of at most ``T`` tokens over at most ``R`` requests replays one graph of the whole
forward, attention included. The graph of bucket ``(T, R)`` is captured over a stand-in batch:
``R - 1`` decode rows and one prefill row of ``T - R + 1`` tokens, every context
``max_model_len`` long on the host. Attention plans from those host lists (``TritonAttention``:
split counts, launch grids, partial buffers), and its kernels read the real rows' lengths from
the device: a real step's rows go first, then padding requests with empty queries and no
context, and padding tokens with no KV slot, which every kernel skips. Request buckets are one
more than a power of two, so the stand-in's decode count (``R - 1``) is where the decode split
count changes, and a step with one extend gets the plan an eager step would.

Only attention that reads every length on the device can be captured so: the Triton backend.
``use_graphs=False`` runs the same stand-in forward through the same buffers without capturing,
so the plumbing is testable where there is no GPU (Triton under its interpreter).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from siesta.attention.base import AttentionMetadata, KVCache
from siesta.core.cuda_graphs import capture_graph
from siesta.model.interface import CausalModel

logger = logging.getLogger(__name__)

# Token and request counts of the captured buckets. Past them a step takes the piecewise graphs:
# with hundreds of tokens its matrix products outlast the host's work on attention.
TOKEN_BUCKETS = (32, 64, 128, 256)
REQUEST_BUCKETS = (2, 3, 5, 9, 17, 33, 65)
NO_SLOT = -1  # the KV-write kernel skips negative slots


@dataclass
class _Buffers:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    query_start_loc: torch.Tensor  # [R + 1]
    seq_lens: torch.Tensor  # [R]
    block_tables: torch.Tensor  # [R, max_blocks]


class MixedGraphs:
    def __init__(self, model: CausalModel, kv_cache: KVCache, max_tokens: int, max_reqs: int, max_model_len: int,
                 block_size: int, use_graphs: bool = True) -> None:  # fmt: skip
        self.model = model
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.use_graphs = use_graphs
        # Token buckets below the step budget and the first that holds it; a bucket's stand-in
        # has R - 1 decodes and a prefill row: R < T, and R - 1 <= max_reqs.
        holds_all = next((t for t in TOKEN_BUCKETS if t >= max_tokens), None)
        tokens = [t for t in TOKEN_BUCKETS if t < max_tokens or t == holds_all]
        self.buckets = [(t, r) for t in tokens for r in REQUEST_BUCKETS if r < t and r - 1 <= max_reqs]
        self.max_blocks = -(-max_model_len // block_size)
        t = max((b[0] for b in self.buckets), default=1)
        r = max((b[1] for b in self.buckets), default=1)
        dev = kv_cache.tensor.device
        self.buf = _Buffers(
            input_ids=torch.zeros(t, dtype=torch.int64, device=dev),
            positions=torch.zeros(t, dtype=torch.int64, device=dev),
            slot_mapping=torch.full((t,), NO_SLOT, dtype=torch.int64, device=dev),
            query_start_loc=torch.zeros(r + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.zeros(r, dtype=torch.int32, device=dev),
            block_tables=torch.zeros((r, self.max_blocks), dtype=torch.int32, device=dev),
        )
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = None

    def bucket_for(self, num_tokens: int, num_reqs: int) -> tuple[int, int] | None:
        """The smallest bucket holding the step: fewest tokens first, then fewest requests."""
        return next(((t, r) for t, r in self.buckets if t >= num_tokens and r >= num_reqs), None)

    def _stand_in(self, bucket: tuple[int, int]) -> AttentionMetadata:
        """The capture's metadata: on the host, R - 1 decode rows and one prefill row, all at
        ``max_model_len``, which fixes the plan; on the device, what ``run`` copies in."""
        t, r = bucket
        buf = self.buf
        starts = [*range(r), t]
        return AttentionMetadata(
            query_start_loc=buf.query_start_loc[: r + 1],
            seq_lens=buf.seq_lens[:r],
            block_tables=buf.block_tables[:r],
            slot_mapping=buf.slot_mapping[:t],
            max_query_len=t - r + 1,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=starts,
            seq_lens_cpu=[self.max_model_len] * r,
        )

    def _warm_up_rows(self, bucket: tuple[int, int]) -> None:
        """Device rows matching the stand-in's shape with contexts no longer than their queries
        (block 0 only, nothing written), so the warm-up forward reads inside the cache."""
        t, r = bucket
        buf = self.buf
        starts = torch.tensor([*range(r), t], dtype=torch.int32)
        buf.query_start_loc[: r + 1].copy_(starts)
        buf.seq_lens[:r].copy_(starts[1:] - starts[:-1])
        buf.block_tables.zero_()
        buf.slot_mapping.fill_(NO_SLOT)

    def _forward(self, bucket: tuple[int, int], meta: AttentionMetadata) -> torch.Tensor:
        t = bucket[0]
        return self.model(self.buf.input_ids[:t], self.buf.positions[:t], self.kv_cache, meta)

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.use_graphs:
            return
        t0 = time.perf_counter()
        self.graphs.clear()
        self.outputs.clear()
        for bucket in reversed(self.buckets):  # largest first: the smaller ones reuse its pool
            self._warm_up_rows(bucket)
            meta = self._stand_in(bucket)
            self._forward(bucket, meta)  # warm-up: compile kernels outside the capture
            torch.cuda.synchronize()
            self.graphs[bucket], self.outputs[bucket], self.pool = capture_graph(
                lambda: self._forward(bucket, meta), self.pool
            )
        torch.cuda.synchronize()
        logger.info("captured %d mixed-step graphs in %.1fs", len(self.graphs), time.perf_counter() - t0)

    def invalidate(self) -> None:
        """Drop the graphs (their addresses died with a sleep); the next ``run`` recaptures."""
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states of the step's tokens, or None if no bucket holds the step."""
        n, reqs = input_ids.shape[0], meta.num_reqs
        bucket = self.bucket_for(n, reqs)
        if bucket is None or meta.block_tables.shape[1] > self.max_blocks:
            return None
        if self.use_graphs and not self.graphs:
            self.capture()
        t, r = bucket
        buf = self.buf
        buf.input_ids[:n].copy_(input_ids, non_blocking=True)
        buf.positions[:n].copy_(positions, non_blocking=True)
        buf.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        buf.slot_mapping[n:t].fill_(NO_SLOT)
        buf.query_start_loc[: reqs + 1].copy_(meta.query_start_loc, non_blocking=True)
        buf.query_start_loc[reqs + 1 : r + 1].fill_(n)  # padding requests: empty queries
        buf.seq_lens[:reqs].copy_(meta.seq_lens, non_blocking=True)
        buf.seq_lens[reqs:r].fill_(0)  # and no context
        buf.block_tables[:reqs, : meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)
        if self.use_graphs:
            self.graphs[bucket].replay()
            return self.outputs[bucket][:n]
        return self._forward(bucket, self._stand_in(bucket))[:n]
