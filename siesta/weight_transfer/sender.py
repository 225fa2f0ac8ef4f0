"""The trainer's side: push ``model.named_parameters()`` (or a state dict) into an engine.

The engine is anything with the four weight-transfer calls: a served siesta through
``siesta.client.SiestaClient`` (HTTP) or an in-process ``siesta.LLM``::

    sender = WeightSender(SiestaClient(url), backend="nccl")  # or "ipc" on the engine's device
    sender.init()                                     # once: the group, or nothing for ipc
    version = sender.push(model)                      # start, update(s), finish

nccl: the update's metadata goes to the engine in one call while this process broadcasts the
bytes (rank 0 of the group), in buckets when ``packed``. ipc: CUDA tensors travel as IPC
handles to the trainer's own memory (nothing is copied before the engine reads it); CPU
tensors through a shared-memory file this sender owns. Names are mapped to checkpoint names
(``siesta.weight_transfer.names``); the engine casts dtypes on its device.
"""

from __future__ import annotations

import base64
import contextlib
import os
import pickle
import socket
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from siesta.config import WeightTransferConfig
from siesta.control import WeightTransferControl
from siesta.weight_transfer.group import SOURCE_RANK, TransferGroup, open_group
from siesta.weight_transfer.handles import CUDA_EVENT_SYNC_ARG, SHM_DIR, shm_handle
from siesta.weight_transfer.names import checkpoint_tensors
from siesta.weight_transfer.wire import bucket_bounds, dtype_name, parse_update_info

_DEFAULTS = WeightTransferConfig()
# Spare time for the engine's answer after the last byte went out.
REPLY_GRACE_S = 30.0


# What the sender calls: ``siesta.LLM``, ``siesta.client.SiestaClient``, ``siesta.fleet.FleetClient``
# or vLLM's equivalents (the weight-transfer verbs of siesta.control).
WeightTransferClient = WeightTransferControl


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _Background:
    """One engine call on its own thread (nccl: it returns only once the broadcasts arrived)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True, name="siesta-weight-call")
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller of join
            self.error = e

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self, timeout_s: float) -> Any:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the engine did not answer within {timeout_s:.0f}s")
        if self.error is not None:
            raise self.error
        return self.result


class _ShmArena:
    """A file under /dev/shm that holds the tensors of one update (the CPU's IPC)."""

    def __init__(self) -> None:
        self.path = f"{SHM_DIR}/siesta-weights-{os.getpid()}-{id(self):x}"
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def reserve(self, nbytes: int) -> torch.Tensor:
        if self.buffer.numel() < nbytes:
            fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, nbytes)
            finally:
                os.close(fd)
            self.buffer = torch.from_file(self.path, shared=True, size=nbytes, dtype=torch.uint8)
        return self.buffer

    def close(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        if os.path.exists(self.path):
            os.unlink(self.path)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


class WeightSender:
    def __init__(
        self,
        engine: WeightTransferClient,
        backend: str = "nccl",
        *,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        packed: bool | None = None,
        bucket_bytes: int = _DEFAULTS.packed_buffer_size_bytes,
        dtype: torch.dtype | None = None,
        fuse: bool = False,
        timeout_s: float = _DEFAULTS.timeout_s,
        device: torch.device | str | None = None,
        start_first: bool = False,
    ) -> None:
        if backend not in ("nccl", "ipc"):
            raise ValueError(f"backend must be nccl or ipc, got {backend!r}")
        self.engine = engine
        self.backend = backend
        self.master_address = master_address
        self.master_port = master_port
        # nccl packs by default (a few large broadcasts); ipc shares the tensors as they are.
        self.packed = backend == "nccl" if packed is None else packed
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self.fuse = fuse
        self.timeout_s = timeout_s
        self.device = None if device is None else torch.device(device)
        self.start_first = start_first  # vLLM's engines need start_weight_update; siesta's do not
        self.group: TransferGroup | None = None
        self._shm = _ShmArena()
        self._cuda_bucket: torch.Tensor | None = None
        # The handles of the last push, by tensor: the same tensor is shared again with the same
        # handle, which the engine recognises and reads with no IPC work at all. Only tensors
        # the caller owns are kept (no casts or fused copies: those would be held alive).
        self._handles: dict[tuple[Any, ...], tuple[torch.Tensor, tuple[Any, ...]]] = {}
        self._shared_now: set[tuple[Any, ...]] = set()
        self._last_pickle: tuple[Any, str] | None = None  # the last handles and their pickle

    # -- setup ---------------------------------------------------------------------------

    def init(self) -> None:
        """Once: nccl opens the group (this process is rank 0 and hosts its store)."""
        if self.backend == "ipc":
            self.engine.init_weight_transfer_engine({"init_info": {}})
            return
        device = self.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        port = self.master_port or free_port(self.master_address)
        world_size = 1 + int(self.engine.get_world_size())
        init_info = {"master_address": self.master_address, "master_port": port, "rank_offset": 1,
                     "world_size": world_size}  # fmt: skip
        call = _Background(lambda: self.engine.init_weight_transfer_engine({"init_info": init_info}))
        try:
            self.group = open_group(self.master_address, port, SOURCE_RANK, world_size, device, self.timeout_s)
        except BaseException:
            if call.done:
                call.join(0)  # the engine's own refusal says more than our timeout
            raise
        call.join(self.timeout_s)
        self.master_port, self.device = port, device

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self._shm.close()
        self._cuda_bucket = None
        self._handles = {}
        self._last_pickle = None

    # -- pushes --------------------------------------------------------------------------

    def push(self, weights: Any, weight_version: str | None = None) -> str:
        """A whole update: send (siesta's update_weights opens the update itself: one round
        trip less than vLLM's start_weight_update first), finish; returns the new version.

        If the send fails the update is finished anyway where the engine allows it (nothing
        was written: it resumes on the old weights), so no update is left open to hold it."""
        if self.start_first:
            self.engine.start_weight_update(True)
        try:
            self.send(weights)
        except BaseException:
            with contextlib.suppress(Exception):  # torn weights refuse to finish: the engine says why
                self.engine.finish_weight_update(None)
            raise
        return str(self.engine.finish_weight_update(weight_version))

    def send(self, weights: Any) -> None:
        """The tensors of an update the caller opened (``start_weight_update``)."""
        tensors = list(checkpoint_tensors(weights, self.dtype, self.fuse))
        if not tensors:
            return
        devices = {t.device for _, t in tensors}
        if self.backend == "ipc" and len(devices) > 1:
            raise ValueError(f"an ipc push shares tensors of one device; these are on {sorted(map(str, devices))}")
        if self.backend == "nccl":
            self._send_nccl(tensors)
        elif tensors[0][1].device.type == "cuda":
            self._send_cuda_ipc(tensors)
        else:
            self._send_shm(tensors)

    def _info(self, tensors: list[tuple[str, torch.Tensor]], **extra: Any) -> dict[str, Any]:
        info = {
            "names": [n for n, _ in tensors],
            "dtype_names": [dtype_name(t.dtype) for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors],
            "packed": self.packed,
            **extra,
        }
        if self.packed:
            info["packed_buffer_size_bytes"] = self.bucket_bytes
        parse_update_info(info, _DEFAULTS)  # the engine would refuse it: say so before any byte moves
        return info

    def _update(self, info: dict[str, Any]) -> Any:
        return self.engine.update_weights({"update_info": info})

    def _send_nccl(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        if self.group is None:
            raise RuntimeError("init() first: the nccl backend needs its group")
        info = self._info(tensors)
        call = _Background(lambda: self._update(info))
        device = self.group.device
        chunks = self._buckets(tensors) if self.packed else [[pair] for pair in tensors]
        for chunk in chunks:
            if call.done:  # the engine refused before taking the bytes: its error, not our timeout
                call.join(0)
            if self.packed:
                self.group.broadcast(torch.cat([_as_bytes(t.to(device)) for _, t in chunk]))
            else:
                self.group.broadcast(chunk[0][1].to(device))
        call.join(self.timeout_s + REPLY_GRACE_S)

    def _send_cuda_ipc(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        device = tensors[0][1].device
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        self._shared_now = set()
        if not self.packed:
            handles = [{uuid: self._share(t, keep=self.dtype is None and not self.fuse)} for _, t in tensors]
            torch.cuda.synchronize(device)  # every write to them is done before the engine reads
            self._update(self._info(tensors, ipc_handles_pickled=self._pickled(handles)))
        else:
            buckets = self._buckets(tensors)
            largest = max(sum(_sizes(b)) for b in buckets)
            if self._cuda_bucket is None or self._cuda_bucket.numel() < largest:
                # Kept across pushes: the engine opens the same handle once.
                self._cuda_bucket = torch.empty(largest, dtype=torch.uint8, device=device)
            for bucket in buckets:
                self._fill(self._cuda_bucket, bucket)
                torch.cuda.synchronize(device)
                handle = {uuid: self._share(self._cuda_bucket, keep=True)}
                self._update(self._info(bucket, ipc_handles_pickled=self._pickled(handle), tensor_sizes=_sizes(bucket)))
        self._handles = {k: v for k, v in self._handles.items() if k in self._shared_now}

    def _share(self, tensor: torch.Tensor, keep: bool) -> tuple[Any, ...]:
        """``reduce_tensor``'s rebuild arguments; those of the last push for the same tensor.

        The sender synchronises the device before every update, so the engine needs no event:
        a share is marked as needing none."""
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.device)
        self._shared_now.add(key)
        cached = self._handles.get(key)
        if cached is not None and cached[0].untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
            return cached[1]
        args = list(reduce_tensor(tensor)[1])
        args[CUDA_EVENT_SYNC_ARG] = False
        if keep:
            self._handles[key] = (tensor, tuple(args))
        return tuple(args)

    def _pickled(self, handles: Any) -> str:
        """The same handles as the last push pickle to the same string: reuse it (the engine, too,
        recognises the string and skips unpickling)."""
        last = self._last_pickle
        if last is not None and last[0] == handles:
            return last[1]
        pickled = _pickled(handles)
        self._last_pickle = (handles, pickled)
        return pickled

    def _send_shm(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        if not self.packed:
            buffer = self._shm.reserve(sum(_sizes(tensors)))
            handles, offset = [], 0
            for _, tensor in tensors:
                n = tensor.numel() * tensor.element_size()
                buffer[offset : offset + n].copy_(_as_bytes(tensor))
                handles.append(shm_handle(self._shm.path, offset, n))
                offset += n
            self._update(self._info(tensors, ipc_handles=handles))
            return
        for bucket in self._buckets(tensors):
            nbytes = sum(_sizes(bucket))
            self._fill(self._shm.reserve(nbytes), bucket)
            handle = shm_handle(self._shm.path, 0, nbytes)
            self._update(self._info(bucket, ipc_handles=handle, tensor_sizes=_sizes(bucket)))

    def _buckets(self, tensors: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
        return [tensors[a:b] for a, b in bucket_bounds(_sizes(tensors), self.bucket_bytes)]

    @staticmethod
    def _fill(buffer: torch.Tensor, bucket: list[tuple[str, torch.Tensor]]) -> None:
        offset = 0
        for _, tensor in bucket:
            n = tensor.numel() * tensor.element_size()
            buffer[offset : offset + n].copy_(_as_bytes(tensor))
            offset += n


def _sizes(tensors: list[tuple[str, torch.Tensor]]) -> list[int]:
    return [t.numel() * t.element_size() for _, t in tensors]


def _pickled(handles: Any) -> str:
    return base64.b64encode(pickle.dumps(handles)).decode("ascii")
