"""The collectives rank 0 and the other ranks run outside the model's layers.

They call the group object itself: tensor parallelism's group is a standalone
``ProcessGroupGloo`` / ``ProcessGroupNCCL`` (an offline ``LLM`` may live in a trainer whose
process already owns torch's default group), which torch's module-level functions only
partly accept.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from siesta.parallel import TensorParallel

SOURCE_RANK = 0  # the engine core's rank: it schedules and samples


def broadcast(tp: TensorParallel, tensor: torch.Tensor, src: int = SOURCE_RANK) -> None:
    """In place from ``src``; on CUDA queued on the current stream (the host does not wait)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    tp.group.broadcast([tensor], opts).wait()


def min_over_ranks(tp: TensorParallel, value: int, device: torch.device) -> int:
    """The smallest of every rank's ``value`` (every rank gets it): e.g. the KV blocks all fit."""
    if tp.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.group)  # takes a standalone backend too
    return int(t.item())
