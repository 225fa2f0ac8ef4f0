"""The KV tiers at tensor parallel > 1: one index on rank 0, every rank's shard in each slot.

Rank 0's connector decides everything (lookups, slots, evictions, the disk tier) as it does at
tensor parallel 1. A slot of its host tier holds every rank's shard of an entry, side by side,
in a file under /dev/shm that every rank maps (and pins, on CUDA), so each rank's device blocks
copy to and from its own part at link speed, and the disk tier reads and writes whole slots
from rank 0. A copy is a job on every rank: rank 0 sends the other ranks each job it submits
(its parts as byte offsets into the shared slots), and reports a job landed only once every
rank has landed it. So a tier hit is a hit on every rank, and no block is freed, nor a slot
written to disk, before every rank's copy is done.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from siesta.attention.base import KVCache
from siesta.distributed.processes import RankFailed, RankProcesses
from siesta.pinned import cuda_pinner, map_shared_file

SHM_DIR = "/dev/shm"
NOTE = "landed"  # the kind of note a rank sends when tier copies landed
WAIT_POLL_S = 0.001


@dataclass(frozen=True)
class SharedBuffer:
    """Where a tier's slots live: a file every rank maps, its tensor shape and dtype."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    def map(self, device: torch.device) -> torch.Tensor:
        """The buffer in this process (pinned on CUDA: the copy engines reach it directly)."""
        flat = map_shared_file(self.path, self.nbytes, cuda_pinner(device) if device.type == "cuda" else None)
        return flat.view(self.dtype).view(self.shape)


def create_shared(shape: tuple[int, ...], dtype: torch.dtype) -> SharedBuffer:
    base = SHM_DIR if os.path.isdir(SHM_DIR) else tempfile.gettempdir()
    buffer = SharedBuffer(os.path.join(base, f"siesta-tier-{uuid.uuid4().hex}"), shape, dtype)
    with open(buffer.path, "wb") as f:
        f.truncate(buffer.nbytes)  # sparse: pages come as they are written
    return buffer


class TierRanksOnRank0:
    """``TierRanks`` for rank 0's connectors (the protocol in ``siesta.tiers.base``)."""

    def __init__(self, procs: RankProcesses, device: torch.device, timeout_s: float) -> None:
        self.procs = procs
        self.size = procs.size
        self.device = device
        self.timeout_s = timeout_s
        self._buffers: dict[int, SharedBuffer] = {}  # by data_ptr of rank 0's mapping
        self._feeders: dict[str, RankedCopies] = {}
        self._ids = itertools.count()

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        shared = create_shared(shape, dtype)
        try:
            tensor = shared.map(self.device)
            seq = self.procs.send("map_tier_buffer", shared)
            for answer in self.procs.gather(seq, self.timeout_s):
                if not answer.ok:
                    raise RankFailed(f"tensor-parallel rank {answer.rank} could not map the tier: {answer.value.message}")
        finally:
            os.unlink(shared.path)  # the mappings keep it: nothing is left behind when the ranks exit
        self._buffers[tensor.data_ptr()] = shared
        return tensor

    def copies(self, local: Any, direction: str, buffer: torch.Tensor) -> RankedCopies:
        name = f"{direction}-{next(self._ids)}"
        shared = self._buffers[buffer.data_ptr()]
        feeder = RankedCopies(self, name, local, buffer, shared)
        self._feeders[name] = feeder
        return feeder

    def take_notes(self) -> None:
        """Route the ranks' landed notes to the copies they are about."""
        for note in self.procs.take_notes(NOTE):
            name, tags = note.value[1]
            self._feeders[name].remote_landed(note.rank, tags)


class RankedCopies:
    """Rank 0's copy window (``local``) and the other ranks' copies of each of its jobs."""

    def __init__(self, ranks: TierRanksOnRank0, name: str, local: Any, buffer: torch.Tensor,
                 shared: SharedBuffer) -> None:  # fmt: skip
        self.ranks = ranks
        self.name = name
        self.local = local
        self.base = buffer.data_ptr()
        self.rank_stride = buffer[0, 1].data_ptr() - buffer[0, 0].data_ptr()  # bytes between ranks' parts
        self._tags = itertools.count()
        self._jobs: OrderedDict[int, object] = OrderedDict()  # tag -> job id, in submission order
        # Tags whose copies on this rank have not landed: the local window lands jobs in the
        # order they were submitted, so the oldest is the next one it reports.
        self._local_pending: deque[int] = deque()
        self._local_done: set[int] = set()
        self._remote: dict[int, set[int]] = {}  # tag -> ranks whose copy has not landed
        # The other ranks open their side now, mapping the same slots.
        procs = ranks.procs
        seq = procs.send("open_tier_copies", name, shared.path, local.direction, local.window_bytes, self.rank_stride)
        for answer in procs.gather(seq, ranks.timeout_s):
            if not answer.ok:
                raise RankFailed(f"tensor-parallel rank {answer.rank} could not map the tier: {answer.value.message}")

    @property
    def direction(self) -> str:
        return self.local.direction

    def submit(self, job_id: object, parts: Sequence[tuple[torch.Tensor, Sequence[int]]], kv: KVCache,
               issue: bool = True, after: Any = None) -> None:  # fmt: skip
        tag = next(self._tags)
        self._jobs[tag] = job_id
        self._local_pending.append(tag)
        self._remote[tag] = set(self.ranks.procs.ranks)
        offsets = [(view.data_ptr() - self.base, len(ids), list(ids)) for view, ids in parts]
        # Sent first: the other ranks start while this one queues its own.
        self.ranks.procs.send("tier_copy", self.name, tag, offsets, reply=False)
        self.local.submit(job_id, parts, kv, issue=issue, after=after)

    def remote_landed(self, rank: int, tags: list[int]) -> None:
        for tag in tags:
            waiting = self._remote.get(tag)
            if waiting is not None:
                waiting.discard(rank)

    def compute_mark(self) -> Any:
        return self.local.compute_mark()

    def landed(self) -> list[object]:
        for _ in self.local.landed():
            self._local_done.add(self._local_pending.popleft())
        self.ranks.take_notes()
        done = []
        for tag in list(self._jobs):
            if tag in self._local_done and not self._remote[tag]:
                done.append(self._jobs.pop(tag))
                self._local_done.discard(tag)
                del self._remote[tag]
        return done

    @property
    def pending_bytes(self) -> int:
        return self.local.pending_bytes

    @property
    def window_bytes(self) -> int:
        return self.local.window_bytes

    def busy(self) -> bool:
        return self.local.busy() or bool(self._jobs)

    def wait_for_progress(self, timeout_s: float) -> None:
        self.local.wait_for_progress(timeout_s)

    def drain(self) -> None:
        """Every rank lands every job submitted (``landed`` still reports them)."""
        self.local.drain()
        deadline = time.monotonic() + self.ranks.timeout_s
        while any(self._remote[tag] for tag in self._jobs):
            self.ranks.procs.check()
            self.ranks.take_notes()
            if time.monotonic() > deadline:
                late = sorted({r for tag in self._jobs for r in self._remote[tag]})
                raise RankFailed(f"tensor-parallel rank {late[0]}: tier copies did not land within {self.ranks.timeout_s:g}s")
            time.sleep(WAIT_POLL_S)
