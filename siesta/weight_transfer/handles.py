"""Opening the buffers a trainer on the same device shares, without copying them first.

Two kinds of handle, both in the ``ipc_handles`` of an update:

- CUDA: torch's own (``torch.multiprocessing.reductions.reduce_tensor``), keyed by the GPU's
  UUID as vLLM sends them: ``{uuid: (rebuild_cuda_tensor, args)}`` or ``{uuid: args}``. Over
  HTTP they arrive pickled (``ipc_handles_pickled``, base64); they are unpickled by an
  unpickler that builds only torch's tensor-rebuild types, never arbitrary objects.
- shared memory (CPU): ``{"shm": path, "offset": bytes, "nbytes": bytes}``, a file under
  ``/dev/shm`` that the trainer fills and the engine maps.

Opened mappings are kept while the trainer keeps sharing them (``ipc_keep_mappings``). A
sender that shares the same tensor again with the very same handle (siesta's does, for
tensors it did not have to copy) costs the engine nothing but the copy: no open, no
reference count, no event. A new share of a storage already open goes through torch, which
reuses the mapping and settles the share's reference count; the engine then waits on the
share's event, as torch does only when it first opens a storage. A mapping the latest update
did not use is dropped when the next one starts; one it used keeps the trainer's memory allocated until the next
update, which costs nothing for the trainer's own parameters or a reused bucket.
"""

from __future__ import annotations

import base64
import binascii
import os
import pickle
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from siesta.brief import brief
from siesta.weight_transfer.wire import WIRE_DTYPES, WeightTransferError, restricted_load

SHM_DIR = "/dev/shm"
SHM_KEY = "shm"
CUDA_REBUILD_ARGS = 15
# Positions in rebuild_cuda_tensor's arguments.
CUDA_DEVICE_ARG = 6  # the device index: the trainer's numbering may differ
CUDA_EVENT_ARG, CUDA_EVENT_SYNC_ARG = 13, 14  # the event after the trainer's writes, and whether to wait
MAX_SHM_MAPPINGS = 4

# What a pickled CUDA handle may name, and nothing else.
_ALLOWED_GLOBALS = {
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.nn.parameter", "Parameter"),
    ("torch.storage", "TypedStorage"),
    ("torch.storage", "UntypedStorage"),
    ("torch", "uint8"),  # a packed bucket's buffer
    *(("torch", name) for name in WIRE_DTYPES),
}


class _HandleUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise WeightTransferError(
                f"ipc_handles_pickled names {module}.{name}, which is not part of a CUDA IPC handle"
            )
        return super().find_class(module, name)


def decode_base64(data: Any, field: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise WeightTransferError(f"{field} is not base64") from None


def unpickle_handles(data: str) -> Any:
    """``ipc_handles_pickled`` (base64 of a pickle) -> the handles, through the restricted unpickler."""
    raw = decode_base64(data, "ipc_handles_pickled")
    return restricted_load(_HandleUnpickler, raw, "ipc_handles_pickled does not decode: {error}")


def shm_handle(path: str, offset: int, nbytes: int) -> dict[str, Any]:
    return {SHM_KEY: path, "offset": offset, "nbytes": nbytes}


class HandleOpener:
    """Opens handles into tensors on this engine's device."""

    def __init__(self, device: torch.device, keep_mappings: bool = True) -> None:
        self.device = device
        self.keep_mappings = keep_mappings
        self._shm: dict[tuple[str, int, int], torch.Tensor] = {}
        self._cuda: dict[tuple[Any, ...], torch.Tensor] = {}
        self._cuda_used: set[tuple[Any, ...]] = set()
        self._uuid: tuple[int, str] | None = None

    def open(self, handle: Any) -> torch.Tensor:
        """A handle -> the tensor it shares (CUDA: typed as the trainer's; shm: flat bytes)."""
        return self._open(handle, {})

    def open_all(self, handles: list[Any]) -> list[torch.Tensor]:
        """The handles of one update: each shared-memory file checked and stat'ed once (a
        per-expert push names one file ~19k times; resolving its path each time took 0.8 s of a
        1.9 s receive on this machine's CPU)."""
        checked: dict[str, os.stat_result] = {}
        return [self._open(h, checked) for h in handles]

    def _open(self, handle: Any, checked: dict[str, os.stat_result]) -> torch.Tensor:
        """``checked``: the shared-memory files this update's handles found directly under
        /dev/shm so far, with their stat."""
        if isinstance(handle, dict) and SHM_KEY in handle:
            return self._open_shm(handle, checked)
        if self.device.type != "cuda":
            raise WeightTransferError("this engine runs on the CPU: send shared-memory handles, not CUDA ones")
        return self._open_cuda(handle)

    def _open_cuda(self, handle: Any) -> torch.Tensor:
        if not isinstance(handle, dict):
            raise WeightTransferError(f"a CUDA IPC handle maps GPU UUIDs to handles, got {type(handle).__name__}")
        index, uuid = self.gpu()
        if uuid not in handle:
            raise WeightTransferError(
                f"no IPC handle for this engine's GPU {uuid}: the trainer shared {sorted(map(str, handle))}; "
                "the ipc backend needs the trainer on the same GPU"
            )
        entry = handle[uuid]
        if isinstance(entry, (list, tuple)) and len(entry) == 2 and callable(entry[0]):
            func, args = entry
            if func is not rebuild_cuda_tensor:
                raise WeightTransferError("an IPC handle must be torch's rebuild_cuda_tensor and its arguments")
        else:
            args = entry
        if not isinstance(args, (list, tuple)) or len(args) != CUDA_REBUILD_ARGS:
            raise WeightTransferError(f"a CUDA IPC handle has {CUDA_REBUILD_ARGS} arguments (torch's reduce_tensor)")
        args = list(args)
        args[CUDA_DEVICE_ARG] = index
        key = tuple(args)
        tensor = self._cuda.get(key)
        if tensor is None:  # not the very share the last update used (a sender that re-shares)
            try:
                # Through torch: it reuses a storage it opened before and releases the new
                # share's reference count, which skipping it would leak in the trainer.
                tensor = rebuild_cuda_tensor(*args)
                if args[CUDA_EVENT_SYNC_ARG]:
                    # torch waits for the trainer's writes only when it first opens a storage.
                    event = torch.cuda.Event.from_ipc_handle(index, args[CUDA_EVENT_ARG])
                    torch.cuda.current_stream(index).wait_event(event)
            except Exception as e:  # noqa: BLE001 - a stale or foreign handle
                raise WeightTransferError(f"could not open a CUDA IPC handle: {type(e).__name__}: {e}") from None
        if self.keep_mappings:
            self._cuda[key] = tensor  # holds torch's cached storage open until an update stops using it
            self._cuda_used.add(key)
        return tensor

    def gpu(self) -> tuple[int, str]:
        """This engine's device index and the UUID trainers key their handles by (looked up once)."""
        if self._uuid is None:
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self._uuid = (index, str(torch.cuda.get_device_properties(index).uuid))
        return self._uuid

    def settle(self) -> None:
        """Between updates: keep the CUDA mappings the last one used, release the others."""
        self._cuda = {k: v for k, v in self._cuda.items() if k in self._cuda_used}
        self._cuda_used = set()

    def _open_shm(self, handle: dict[str, Any], checked: dict[str, os.stat_result]) -> torch.Tensor:
        path, offset, nbytes = handle.get(SHM_KEY), handle.get("offset", 0), handle.get("nbytes")
        st = checked.get(path) if isinstance(path, str) else None
        if st is None:
            st = checked[path] = self._shm_stat(path)
        for key, value in (("offset", offset), ("nbytes", nbytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise WeightTransferError(
                    f"a shared-memory handle's {brief(key)} must be a non-negative integer, got {brief(value)}"
                )
        if offset + nbytes > st.st_size:
            raise WeightTransferError(
                f"the handle reaches byte {offset + nbytes} of {path}, which holds {st.st_size}: its sizes do not add up"
            )
        key = (path, st.st_ino, st.st_size)
        buffer = self._shm.get(key)
        if buffer is None:
            if len(self._shm) >= MAX_SHM_MAPPINGS:
                self._shm.pop(next(iter(self._shm)))
            buffer = torch.from_file(path, shared=True, size=st.st_size, dtype=torch.uint8)
            self._shm[key] = buffer
        return buffer[offset : offset + nbytes]

    @staticmethod
    def _shm_stat(path: Any) -> os.stat_result:
        """``path``'s stat, once it is found to be a file directly under /dev/shm."""
        if not isinstance(path, str) or os.path.dirname(os.path.realpath(path)) != SHM_DIR:
            raise WeightTransferError(f"a shared-memory handle names a file directly under {SHM_DIR}, got {brief(path)}")
        try:
            return os.stat(path)
        except OSError as e:
            raise WeightTransferError(f"cannot open the shared-memory buffer {path}: {e.strerror}") from None

    def close(self) -> None:
        self._shm.clear()
        self._cuda.clear()
        self._cuda_used.clear()
