"""Page-locked host memory of the size asked for, and the runtime calls that lock it.

torch's pinned allocator (``torch.empty(..., pin_memory=True)``) rounds every block it makes
up to a power of two, so that freed blocks are reused: a 48 GiB host tier locked 64 GiB. On a
125 GiB host that, beside the MoE shape's 61 GB sleep backup, got the process killed (H100
run 59b). ``pinned_empty`` maps exactly the bytes asked for and locks them with one
``cudaHostRegister``; the lock goes when the last tensor over the memory is gone. The
tensor-parallel ranks' shared tier (``map_shared_file``) is locked and unlocked the same way.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

import torch

Pinner = Callable[[int, int], None]  # (address, bytes): pin that range, or raise
Unpinner = Callable[[int], None]

_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every context, as cudaHostAlloc's memory is
_CUDA_SUCCESS = 0


def cuda_pinner(device: torch.device) -> tuple[Pinner, Unpinner]:
    """``cudaHostRegister`` / ``cudaHostUnregister`` through torch's own runtime bindings.
    ``device`` without an index is the current device, read here, not in the pinning thread."""
    cudart = torch.cuda.cudart()
    index = torch.cuda.current_device() if device.index is None else device.index

    def pin(address: int, nbytes: int) -> None:
        torch.cuda.set_device(index)  # the thread's current device: the runtime's context
        err = cudart.cudaHostRegister(address, nbytes, _CUDA_HOST_REGISTER_PORTABLE)
        if int(err) != _CUDA_SUCCESS:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)}")

    def unpin(address: int) -> None:
        cudart.cudaHostUnregister(address)

    return pin, unpin


class _LockedMapping(mmap.mmap):
    """A mapping (MAP_SHARED, Python's default: a forked child shares locked pages rather than
    copying them on a write) that unlocks itself before it is unmapped. The tensors over it hold
    it (``torch.frombuffer`` keeps the buffer's owner), so that is when the last of them dies."""

    unpin: Unpinner | None = None
    address = 0

    def __del__(self) -> None:
        if self.unpin is not None:
            self.unpin(self.address)
            self.unpin = None


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype, pinner: tuple[Pinner, Unpinner]) -> torch.Tensor:
    """An uninitialised host tensor of exactly its own bytes (page-rounded), locked by ``pinner``."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)  # nothing to lock
    # Anonymous: pages come on first touch, or with the lock.
    return _locked(_LockedMapping(-1, nbytes), pinner).view(dtype).view(shape)


def map_shared_file(path: str, nbytes: int, pinner: tuple[Pinner, Unpinner] | None) -> torch.Tensor:
    """The first ``nbytes`` of ``path`` as flat uint8, shared with every process that maps it
    (the tensor-parallel ranks' tier), locked by ``pinner`` unless it is None. As with
    ``pinned_empty``, the lock goes before the mapping does: an unmapped range left registered
    keeps its pages locked until the process ends."""
    with open(path, "r+b") as f:
        mapping = _LockedMapping(f.fileno(), nbytes)  # MAP_SHARED; the mapping outlives the fd
    return _locked(mapping, pinner) if pinner is not None else torch.frombuffer(mapping, dtype=torch.uint8)


def _locked(mapping: _LockedMapping, pinner: tuple[Pinner, Unpinner]) -> torch.Tensor:
    flat = torch.frombuffer(mapping, dtype=torch.uint8)
    pin, unpin = pinner
    pin(flat.data_ptr(), flat.numel())
    mapping.address, mapping.unpin = flat.data_ptr(), unpin
    return flat


def pinned_host_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``pinned_empty`` locked for ``device``'s runtime where it is a CUDA device, else plain memory."""
    if device.type != "cuda":
        return torch.empty(shape, dtype=dtype)
    return pinned_empty(shape, dtype, cuda_pinner(device))
