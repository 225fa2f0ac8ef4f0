"""Block copies between the device KV cache and host memory.

One copy per device block: the cache is block-first, so a block is one
contiguous region and each copy is a single DMA. On CUDA, stores and loads run
on their own streams from pinned memory: a store waits only for the forward
that filled its blocks, and the next forward waits only for its loads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from siesta.attention.base import KVCache


class BlockCopier:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._store_stream = torch.cuda.Stream(device) if self.cuda else None
        self._load_stream = torch.cuda.Stream(device) if self.cuda else None

    def store(self, kv: KVCache, block_ids: Sequence[int], dst: torch.Tensor) -> torch.cuda.Event | None:
        """Copy device blocks into ``dst[i]``; returns an event that fires when done (None: done)."""
        if not self.cuda:
            for i, b in enumerate(block_ids):
                dst[i].copy_(kv.tensor[b])
            return None
        # Everything queued so far on the compute stream, i.e. the forward that filled the blocks.
        self._store_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._store_stream):
            for i, b in enumerate(block_ids):
                dst[i].copy_(kv.tensor[b], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return event

    def load(self, src: torch.Tensor, kv: KVCache, block_ids: Sequence[int]) -> None:
        """Copy ``src[i]`` into device blocks, ordered before whatever the compute stream runs next."""
        if not self.cuda:
            for i, b in enumerate(block_ids):
                kv.tensor[b].copy_(src[i])
            return
        # New blocks may have been written by an earlier forward; start after it.
        self._load_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._load_stream):
            for i, b in enumerate(block_ids):
                kv.tensor[b].copy_(src[i], non_blocking=True)

    def loads_issued(self) -> torch.cuda.Event | None:
        """An event that fires when the loads issued so far have landed (None: already landed).

        The compute stream does not wait: the requests being loaded compute only once it fired.
        """
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self._load_stream)
        return event

    @staticmethod
    def done(event: torch.cuda.Event | None) -> bool:
        return event is None or event.query()

    @staticmethod
    def wait(event: torch.cuda.Event | None) -> None:
        if event is not None:
            event.synchronize()
