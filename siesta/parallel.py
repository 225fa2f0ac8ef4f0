"""Which rank of a tensor-parallel group this process is, and the two collectives the model needs.

Below both ``siesta.model`` (whose layers call the collectives) and ``siesta.distributed`` (which
builds the group and knows nothing of models), so the imports point one way.

The collectives are plain ``torch.distributed`` calls on device tensors, in place or into a
preallocated output, never a host read: NCCL captures them inside CUDA graphs (decode and
piecewise graphs are captured per rank), and on the CPU they run on gloo. At size 1 every
method is the identity and the model builds none of the parallel layers, so a single-device
step runs exactly the ops it always ran.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (and warns on the old name); 2.11 has only the old one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    # None means the default group when size > 1; the engine passes a standalone backend
    # (siesta.distributed.group), which all_reduce takes as it is.
    group: dist.ProcessGroup | torch._C._distributed_c10d.Backend | None = None

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a tensor-parallel group has at least one rank, got size {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a tensor-parallel group of {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' ``x`` concatenated along ``dim`` in rank order (a new tensor)."""
        if self.size == 1:
            return x
        dim = dim % x.dim()
        # The collective concatenates along the first dim: gather [size * d0, ...] and move
        # the ranks' blocks to ``dim`` afterwards (one copy, on the device).
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        if self.group is not None and not isinstance(self.group, dist.ProcessGroup):
            # The engine's group is a standalone backend (a trainer may own the default group),
            # which torch's gather function does not take; the backend's own call does the same.
            self.group._allgather_base(out, x.contiguous()).wait()
        else:
            _all_gather_single(out, x.contiguous(), group=self.group)
        if dim == 0:
            return out
        stacked = out.view(self.size, *x.shape)  # [rank, d0, ..., d_dim, ...]
        return stacked.movedim(0, dim).reshape(*x.shape[:dim], self.size * x.shape[dim], *x.shape[dim + 1 :])

    def shard(self, n: int, what: str) -> tuple[int, int]:
        """``(start, length)`` of this rank's equal part of ``n`` things named ``what``."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) do not split evenly over tensor parallel size {self.size}")
        length = n // self.size
        return self.rank * length, length


SINGLE = TensorParallel()
