"""Which experts each token was routed to, for RL's routing replay (SGLang's
``return_routed_experts``): recorded per KV slot as steps compute them, gathered per request
when it finishes.

The layout is SGLang's: the request's tokens ``[start, seqlen - 1)`` (prompt then output; the
last sampled token is never computed), each ``[num_layers, top_k]`` expert ids in router order,
``request.RoutedExperts``. A request's prompt may come from the device prefix cache, computed by
another request: so, as in SGLang, the ids live beside the KV, in a host table of every device
block's rows, written by the forward that wrote the block's KV. A block's ids serve a request if
that request computed them itself, or if they were computed for the same content (the block's
key, which carries the weight version, equals the request's). The tiers keep KV across sleep,
and the routing that computed it stays beside them: every full block's rows, once its key is
known, go into a host archive keyed by that key (least recently archived first out, as many
blocks as the tiers hold; 48 layers x 8 ids is 0.4 % of a 30B-A3B block's KV), so a prompt
loaded from a tier after a sleep(keep) gets the ids its KV was computed with. Only a disk entry
read by another process (after a restart) has none: its rows read -1.

Nothing of this exists unless the engine runs with ``enable_return_routed_experts``: the sparse
layers then write their ids into a device buffer (``RoutingSink``, fixed in size so CUDA graphs
capture the writes), and each step copies its rows to the host with its samples.
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from siesta.core import staging
from siesta.model.interface import RoutingLayout
from siesta.request import Request, RoutedExperts
from siesta.sampling import SamplingParams


def id_dtype(num_experts: int) -> torch.dtype:
    """The narrowest signed integer holding every expert id and -1 (unknown)."""
    return torch.int8 if num_experts <= 128 else torch.int16


@dataclass
class RoutedRows:
    """One request's rows in a step: its tokens ``[start, start + count)`` are the step's rows
    ``[offset, offset + count)``, in these blocks."""

    request: Request
    start: int
    count: int
    offset: int
    block_ids: list[int]


class RoutedExpertsStore:
    """Every device block's routing rows on the host, and who computed them."""

    def __init__(self, num_blocks: int, block_size: int, layout: RoutingLayout, archive_blocks: int = 0) -> None:
        self.layout, self.block_size = layout, block_size
        # Full blocks' rows by block key, for KV a tier loads back (see the module's docstring).
        self.archive: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.archive_blocks = archive_blocks
        self.dtype = id_dtype(layout.num_experts)
        shape = (num_blocks, block_size, layout.num_layers, layout.top_k)
        self.rows = np.full(shape, -1, dtype=np.int8 if self.dtype == torch.int8 else np.int16)
        self.writer = np.zeros(num_blocks, dtype=np.int64)  # 0: no forward wrote it
        self.key: list[bytes | None] = [None] * num_blocks  # the content's block key, once known
        self._pending: dict[int, tuple[Request, int]] = {}  # block -> (writer, block index): key not hashed yet
        self._ids: weakref.WeakKeyDictionary[Request, int] = weakref.WeakKeyDictionary()
        self._next = itertools.count(1)

    def _writer_id(self, request: Request) -> int:
        rid = self._ids.get(request)
        if rid is None:
            rid = self._ids[request] = next(self._next)
        return rid

    def record(self, step_rows: np.ndarray, items: list[RoutedRows]) -> None:
        """A step's ids ``[tokens, layers, k]`` into its requests' blocks."""
        bs = self.block_size
        for item in items:
            positions = np.arange(item.start, item.start + item.count)
            blocks = np.asarray(item.block_ids, dtype=np.int64)[positions // bs]
            self.rows[blocks, positions % bs] = step_rows[item.offset : item.offset + item.count]
            writer = self._writer_id(item.request)
            for j in range(item.start // bs, (item.start + item.count - 1) // bs + 1):
                block = item.block_ids[j]
                self.writer[block], self.key[block] = writer, None
                if (j + 1) * bs <= item.start + item.count:  # full: its key names its content
                    self._pending[block] = (item.request, j)
        self._resolve()

    def _resolve(self) -> None:
        """Keys of full blocks, once the KV manager has hashed them (it does so lazily)."""
        for block, (request, j) in list(self._pending.items()):
            if j < len(request.block_hashes):
                self.key[block] = request.block_hashes[j]
                del self._pending[block]
                self._archive(request.block_hashes[j], self.rows[block])
            elif request.status.finished:  # never hashed (a request that ended first): own rows only
                del self._pending[block]

    def _archive(self, key: bytes, rows: np.ndarray) -> None:
        if self.archive_blocks <= 0:
            return
        self.archive[key] = rows.copy()
        self.archive.move_to_end(key)
        while len(self.archive) > self.archive_blocks:
            self.archive.popitem(last=False)

    def gather(self, request: Request, block_ids: list[int]) -> RoutedExperts:
        """The request's ids for tokens ``[start, num_tokens - 1)``; -1 in rows no forward here
        computed for this content."""
        self._resolve()
        start = min(request.sampling_params.routed_experts_prompt_start, request.num_tokens - 1)
        end, bs = request.num_tokens - 1, self.block_size
        layout = self.layout
        out = np.full((end - start, layout.num_layers, layout.top_k), -1, dtype=self.rows.dtype)
        own = self._ids.get(request, -1)
        for j in range(start // bs, -(-end // bs)):
            block = block_ids[j]
            mine = self.writer[block] == own
            same = self.key[block] is not None and j < len(request.block_hashes) and self.key[block] == request.block_hashes[j]
            rows = self.rows[block] if mine or same else self._archived(request, j)
            if rows is not None:
                lo, hi = max(start, j * bs), min(end, (j + 1) * bs)
                out[lo - start : hi - start] = rows[lo - j * bs : hi - j * bs]
        return RoutedExperts(start=start, num_layers=layout.num_layers, top_k=layout.top_k,
                             dtype=str(out.dtype), data=out.tobytes())  # fmt: skip


    def _archived(self, request: Request, j: int) -> np.ndarray | None:
        """The rows that computed the request's block ``j``'s KV, where a tier brought the KV back."""
        return self.archive.get(request.block_hashes[j]) if j < len(request.block_hashes) else None


def tier_blocks(kv_transfer: Any, block_bytes: int) -> int:
    """How many blocks the configured tiers can hold (host and disk, every connector's): the
    routing archive keeps as many. Zero without tiers."""
    if kv_transfer is None or block_bytes <= 0:
        return 0
    return sum(_tier_bytes(kv_transfer.kv_connector_extra_config)) // block_bytes


def _tier_bytes(extra: Any) -> Iterable[int]:
    """Every ``cpu_bytes_to_use`` / ``disk_bytes_to_use`` in a connector's config, its children's too."""
    if isinstance(extra, dict):
        for key, value in extra.items():
            if key in ("cpu_bytes_to_use", "disk_bytes_to_use") and isinstance(value, int):
                yield value
            else:
                yield from _tier_bytes(value)
    elif isinstance(extra, list):
        for item in extra:
            yield from _tier_bytes(item)


class PendingRouting:
    """A step's routing rows on their way to the host: copied after the forward (by a kernel
    through the pinned staging ring on CUDA, never a copy engine, as the samples are), landed
    into the store when the step's samples are read."""

    def __init__(self, rows: torch.Tensor, items: list[RoutedRows], store: RoutedExpertsStore) -> None:
        self.items, self.store = items, store
        self._landed: torch.cuda.Event | None = None
        if not rows.is_cuda:
            self._host = rows.clone()  # the next step's forward writes the same buffer
            return
        rows = rows.contiguous()
        ring = staging.reserve()
        region = ring.take(rows.numel() * rows.element_size())
        if region is None:
            self._host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            self._host.copy_(rows, non_blocking=True)
        else:
            self._host = ring.view(region, rows)
            if staging.KERNEL_COPIES:
                staging.copy_words(rows, self._host)
            else:
                self._host.copy_(rows, non_blocking=True)
        self._landed = torch.cuda.Event()
        self._landed.record(torch.cuda.current_stream(rows.device))
        if region is not None:
            ring.release_after(region, self._landed)

    def land(self) -> None:
        if self._landed is not None:
            self._landed.synchronize()
        self.store.record(self._host.numpy(), self.items)


def refusal(params: SamplingParams, prompt_len: int, store: RoutedExpertsStore | None, dense: bool) -> str | None:
    """Why a request's ``return_routed_experts`` cannot be honoured, or None."""
    if not params.return_routed_experts:
        return None
    if dense:
        return "return_routed_experts: this model has no experts (it is dense)"
    if store is None:
        return "return_routed_experts needs the engine started with enable_return_routed_experts (--enable-return-routed-experts)"
    if params.routed_experts_prompt_start > prompt_len:
        return f"routed_experts_prompt_start must be in [0, {prompt_len}] (the prompt's length), got {params.routed_experts_prompt_start}"
    return None
