"""The ranks' process group: a store that rank 0 hosts on loopback, and a standalone group.

Standalone (never torch's default group): an offline ``LLM`` may run inside a trainer whose
process already owns the default group. NCCL on GPUs, gloo on CPUs: the same code, so every
path is tested on CPUs. The group's timeout bounds every collective: a rank that died or hangs
fails rank 0's next collective instead of holding it forever.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from siesta.parallel import TensorParallel

STORE_PREFIX = "siesta-tensor-parallel"
LOOPBACK = "127.0.0.1"
# A failed NCCL collective aborts its communicator and raises, instead of tearing the process
# down (torch's default): rank 0 reports the rank that failed.
_NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
# Each other rank adds one here before it joins: rank 0 joins once all have arrived, so that a
# rank that dies on the way (say, an import error) is reported at once, not after the group's
# timeout inside a constructor that cannot be interrupted.
ARRIVED_KEY = "arrived"
ARRIVAL_POLL_S = 0.05


@dataclass
class RankGroup:
    tp: TensorParallel
    store: dist.TCPStore  # kept alive with the group

    def abort(self) -> None:
        abort = getattr(self.tp.group, "abort", None)
        if callable(abort):
            abort()


def _wait_for_arrivals(store: dist.Store, count: int, timeout_s: float, check: Callable[[], None] | None) -> None:
    deadline = time.monotonic() + timeout_s
    while store.add(ARRIVED_KEY, 0) < count:
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count - store.add(ARRIVED_KEY, 0)} tensor-parallel rank(s) did not start within {timeout_s:g}s")
        time.sleep(ARRIVAL_POLL_S)


def host_store(size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store, on a free loopback port (``store.port``), before the other ranks start."""
    return dist.TCPStore(LOOPBACK, 0, size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def join(
    rank: int, size: int, device: torch.device, timeout_s: float, store: dist.TCPStore | None = None, port: int = 0,
    check: Callable[[], None] | None = None,
) -> RankGroup:
    """This rank's membership (rank 0 passes the store it hosts, the others its port). Gloo's
    constructor returns once every rank has joined; NCCL meets at its first collective. Rank 0
    first waits for the others to arrive, calling ``check`` (which raises for a dead rank) as it does."""
    if store is None:
        store = dist.TCPStore(LOOPBACK, port, size, is_master=False, timeout=timedelta(seconds=timeout_s))
    prefixed = dist.PrefixStore(STORE_PREFIX, store)
    if rank:
        prefixed.add(ARRIVED_KEY, 1)
    else:
        _wait_for_arrivals(prefixed, size - 1, timeout_s, check)
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        os.environ.setdefault(*_NCCL_ERROR_HANDLING)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    return RankGroup(TensorParallel(rank=rank, size=size, group=group), store)
