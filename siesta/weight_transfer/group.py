"""The trainer-engine process group: its own store and group, never the default one.

Tensor parallelism owns the default group; a weight-transfer group is a standalone
``ProcessGroupNCCL`` (CUDA) or ``ProcessGroupGloo`` (CPU) over a ``TCPStore`` that the
trainer (rank 0) hosts at ``master_address:master_port``. The same code runs both, so every
path is tested on CPUs. Every wait is bounded: a trainer that dies or stops sending fails the
collective within the timeout instead of hanging the engine.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from siesta.brief import brief

STORE_PREFIX = "siesta-weight-transfer"
NCCL, GLOO = "nccl", "gloo"
SOURCE_RANK = 0  # the trainer
# How often a CUDA collective's completion is polled while the host waits for it.
POLL_S = 0.001
# A failed NCCL collective aborts its communicator instead of tearing the process down
# (torch's default): a dead trainer must not take the engine with it.
_NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


class TransferTimeout(RuntimeError):
    """The other side of the group did not take part within the timeout."""


@dataclass
class TransferGroup:
    """One rank's membership: its group, its store (kept alive with it) and its timeout."""

    group: dist.ProcessGroup
    store: dist.Store
    rank: int
    world_size: int
    device: torch.device
    timeout_s: float

    def broadcast(self, tensor: torch.Tensor, src: int = SOURCE_RANK) -> None:
        """Broadcast in place from ``src``; returns once ``tensor`` holds the data (on CUDA:
        once the collective completed), or raises within the timeout."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = timedelta(seconds=self.timeout_s)
        work = self.group.broadcast([tensor], opts)
        if tensor.device.type != "cuda":
            work.wait()  # gloo enforces the timeout itself and raises on a closed peer
            return
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                self.abort()
                raise TransferTimeout(f"no data from rank {src} within {self.timeout_s:.0f}s")
            time.sleep(POLL_S)
        work.wait()  # raises the collective's own error, if any

    def abort(self) -> None:
        abort = getattr(self.group, "abort", None)
        if callable(abort):
            abort()

    def close(self) -> None:
        self.abort()


def connect_store(
    master_address: str, master_port: int, world_size: int, is_master: bool, timeout_s: float, counts_itself: bool
) -> dist.TCPStore:
    """The trainer's TCPStore (hosted by rank 0), reached within the timeout.

    ``counts_itself``: add this member to the store's count of joined workers, which a master
    built by torch's ``rendezvous`` waits on (SGLang's trainers); siesta's own master does not.
    """
    try:
        return dist.TCPStore(
            master_address, master_port, world_size, is_master=is_master, timeout=timedelta(seconds=timeout_s),
            wait_for_workers=counts_itself,
        )  # fmt: skip
    except RuntimeError as e:  # DistStoreError: nobody listens there, or not in time
        raise TransferTimeout(
            f"could not reach the weight-transfer store at {master_address}:{master_port} within {timeout_s:.0f}s: {e}"
        ) from None


def make_process_group(
    store: dist.Store, rank: int, world_size: int, backend: str, timeout_s: float
) -> dist.ProcessGroup:
    """A standalone ``ProcessGroupNCCL`` or ``ProcessGroupGloo`` over ``store`` (never the default group)."""
    timeout = timedelta(seconds=timeout_s)
    if backend == NCCL:
        os.environ.setdefault(*_NCCL_ERROR_HANDLING)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    if backend == GLOO:
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    raise ValueError(f"a weight-transfer group runs on {NCCL} or {GLOO}, not {brief(backend)}")


def open_group(
    master_address: str, master_port: int, rank: int, world_size: int, device: torch.device, timeout_s: float
) -> TransferGroup:
    """Join (rank > 0) or host (rank 0) siesta's group; blocks until every rank has joined."""
    store = connect_store(master_address, master_port, world_size, rank == SOURCE_RANK, timeout_s, counts_itself=False)
    backend = NCCL if device.type == "cuda" else GLOO
    group = make_process_group(dist.PrefixStore(STORE_PREFIX, store), rank, world_size, backend, timeout_s)
    transfer = TransferGroup(group, store, rank, world_size, device, timeout_s)
    # One tiny collective now, so that a mismatched world size or a missing rank fails at
    # init, not halfway through the first update.
    handshake = torch.zeros(1, dtype=torch.int64, device=device)
    if rank == SOURCE_RANK:
        handshake.fill_(world_size)
    transfer.broadcast(handshake)
    if int(handshake.item()) != world_size:
        transfer.close()
        raise ValueError(f"the trainer opened a group of {int(handshake.item())} ranks, this side expects {world_size}")
    return transfer
