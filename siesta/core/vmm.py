"""Device memory at a fixed virtual address whose physical backing can be dropped and re-mapped.

CUDA's virtual memory management splits an allocation in two: an address range
(reserved once, kept for the engine's life) and physical pages mapped into it.
Sleep unmaps and releases the pages, so the driver gets the memory back; wake
maps fresh pages at the same addresses. Every tensor view into the range, and
every CUDA graph captured on those addresses, stays valid across the cycle.

Uses the driver API through ``cuda.bindings`` (NVIDIA's cuda-python); torch sees
the range as an ordinary tensor through ``__cuda_array_interface__``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Physical pages come in chunks: a sleep or wake is a few dozen driver calls, not one per page,
# and no single allocation needs one contiguous run of free physical memory.
CHUNK_BYTES = 1 << 30


def vmm_available() -> bool:
    """Whether this process can build arenas: CUDA present and cuda-python installed."""
    if not torch.cuda.is_available():
        return False
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False
    return True


def _driver() -> Any:
    from cuda.bindings import driver

    return driver


def _check(result: Any, what: str) -> Any:
    """Unpack a cuda-python result tuple ``(CUresult, *values)``, raising on an error code."""
    if not isinstance(result, tuple):
        result = (result,)
    err, *values = result
    drv = _driver()
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        raise RuntimeError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


class _Mapping:
    """The address range and its physical pages. Freed when the last tensor viewing it is gone."""

    def __init__(self, nbytes: int, index: int) -> None:
        drv = _driver()
        self.index = index
        self.prop = drv.CUmemAllocationProp()
        self.prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = index
        gran = _check(
            drv.cuMemGetAllocationGranularity(
                self.prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
            ),
            "cuMemGetAllocationGranularity",
        )
        self.size = -(-max(nbytes, 1) // gran) * gran
        chunk = -(-min(CHUNK_BYTES, self.size) // gran) * gran
        self.chunks = [(off, min(chunk, self.size - off)) for off in range(0, self.size, chunk)]
        self.handles: list[Any] = []
        self.access = drv.CUmemAccessDesc()
        self.access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.access.location.id = index
        self.access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.base = int(_check(drv.cuMemAddressReserve(self.size, gran, 0, 0), "cuMemAddressReserve"))
        self.mapped = False
        # What torch.as_tensor reads to wrap the range without copying; the tensor keeps ``self`` alive.
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (self.base, False), "version": 3}

    def map(self) -> None:
        if self.mapped:
            return
        drv = _driver()
        try:
            for off, size in self.chunks:
                handle = _check(drv.cuMemCreate(size, self.prop, 0), "cuMemCreate")
                self.handles.append(handle)
                _check(drv.cuMemMap(drv.CUdeviceptr(self.base + off), size, 0, handle, 0), "cuMemMap")
            _check(drv.cuMemSetAccess(drv.CUdeviceptr(self.base), self.size, [self.access], 1), "cuMemSetAccess")
        except RuntimeError:
            self.release_pages()  # a half-mapped arena helps nobody: give back what was taken
            raise
        self.mapped = True

    def release_pages(self) -> None:
        drv = _driver()
        for (off, size), handle in zip(self.chunks, self.handles):
            drv.cuMemUnmap(drv.CUdeviceptr(self.base + off), size)  # fails harmlessly where unmapped
            _check(drv.cuMemRelease(handle), "cuMemRelease")
        self.handles.clear()
        self.mapped = False

    def __del__(self) -> None:
        try:
            torch.cuda.synchronize(self.index)
            self.release_pages()
            _driver().cuMemAddressFree(_driver().CUdeviceptr(self.base), self.size)
        except Exception:  # noqa: BLE001 - at interpreter exit the driver may already be gone
            pass


class VirtualArena:
    """``nbytes`` of device memory at an address that outlives its physical pages.

    ``tensor`` (uint8) and views of it are what callers use; the memory goes back to the
    driver for good once the arena and every such view are gone.
    """

    def __init__(self, nbytes: int, device: torch.device) -> None:
        torch.cuda.init()
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self.nbytes = nbytes
        with torch.cuda.device(index):
            torch.empty(1, device=self.device)  # the primary context, current on this thread
            self._mapping = _Mapping(nbytes, index)
            self._mapping.map()
        self.tensor = torch.as_tensor(self._mapping, device=self.device)

    @property
    def address(self) -> int:
        return self._mapping.base

    @property
    def mapped(self) -> bool:
        return self._mapping.mapped

    def map(self) -> None:
        """Back the range with fresh physical pages (contents undefined)."""
        with torch.cuda.device(self.device):
            self._mapping.map()

    def unmap(self) -> None:
        """Give the physical pages back to the driver; the addresses stay reserved."""
        if self.mapped:
            torch.cuda.synchronize(self.device)  # nothing may still be reading or writing them
            self._mapping.release_pages()


def place_parameters(model: torch.nn.Module, device: torch.device, alignment: int = 256) -> VirtualArena:
    """Give every parameter of ``model`` (on the meta device) storage inside one new arena.

    Tied parameters stay tied: one Parameter object gets one place. Contents are
    uninitialised; loading the checkpoint comes next.
    """
    unique: dict[int, torch.nn.Parameter] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        unique.setdefault(id(p), p)
    offsets: dict[int, int] = {}
    total = 0
    for key, p in unique.items():
        offsets[key] = total
        total += -(-p.numel() * p.element_size() // alignment) * alignment
    arena = VirtualArena(total, device)
    placed: dict[int, torch.nn.Parameter] = {}
    for key, p in unique.items():
        nbytes = p.numel() * p.element_size()
        view = arena.tensor[offsets[key] : offsets[key] + nbytes].view(p.dtype).view(p.shape)
        placed[key] = torch.nn.Parameter(view, requires_grad=p.requires_grad)
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = placed[id(p)]
    return arena
