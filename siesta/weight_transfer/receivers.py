"""The engine's end of each backend: bytes in, batches of declared tensors out.

A receiver neither knows the model nor writes weights: it hands each bucket, as tensors of
the declared names, dtypes and shapes, to the ``accept`` callback of the updater, which
checked every name and shape before the first byte moved. The tensors are the full ones the
trainer sent, on every tensor-parallel rank; the updater copies out of each only the slice its
rank holds (``WeightTarget``), straight from the buffer handed over here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

from siesta.config import WeightTransferConfig
from siesta.weight_transfer.group import TransferGroup, open_group
from siesta.weight_transfer.handles import HandleOpener, unpickle_handles
from siesta.weight_transfer.wire import TensorMeta, UpdateInfo, WeightTransferError, parse_nccl_init

logger = logging.getLogger(__name__)

Batch = list[tuple[TensorMeta, torch.Tensor]]
Accept = Callable[[Batch], None]


class TransferFailed(RuntimeError):
    """The bytes did not arrive (a trainer that died or went silent); the group is closed."""


class Rendezvous(Protocol):
    """How an engine rank joins the trainer's group: siesta's (vLLM's init info) or SGLang's."""

    rejoin: str  # the call that joins again once a failed broadcast closed the group

    def join(self, init_info: Any, local_rank: int, device: torch.device, timeout_s: float) -> TransferGroup: ...


class SiestaRendezvous:
    """vLLM's init info into siesta's own group (``siesta.weight_transfer.group``)."""

    rejoin = "init_weight_transfer_engine"

    def join(self, init_info: Any, local_rank: int, device: torch.device, timeout_s: float) -> TransferGroup:
        info = parse_nccl_init(init_info)
        rank = info.rank_offset + local_rank
        if rank >= info.world_size:
            raise WeightTransferError(
                f"rank_offset {info.rank_offset} puts this engine at rank {rank}, outside world_size {info.world_size}"
            )
        try:
            return open_group(info.master_address, info.master_port, rank, info.world_size, device, timeout_s)
        except RuntimeError as e:  # no store there, or the trainer did not join in time: the caller's to fix
            raise WeightTransferError(
                f"could not join the weight-transfer group at {info.master_address}:{info.master_port} as rank "
                f"{rank} of {info.world_size} within {timeout_s:.0f}s: {e}"
            ) from None


class Receiver:
    backend = ""

    def __init__(self, config: WeightTransferConfig, device: torch.device, local_rank: int = 0) -> None:
        self.config = config
        self.device = device
        self.local_rank = local_rank

    @property
    def ready(self) -> bool:
        raise NotImplementedError

    def not_ready(self) -> str:
        """Why ``receive`` cannot run yet, and what to call."""
        return f"the {self.backend} weight transfer is not initialised: call init_weight_transfer_engine first"

    def init(self, init_info: Any) -> None:
        raise NotImplementedError

    def receive(self, info: UpdateInfo, accept: Accept) -> None:
        raise NotImplementedError

    def drain(self, info: UpdateInfo) -> None:
        """Take a refused update's bytes and drop them, so the trainer's send completes."""

    def begin_update(self) -> None:
        """A new update starts (start_weight_update, or an update_weights that opens one)."""

    def close(self) -> None:
        pass


def typed_view(raw: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """Bytes as the declared tensor; a tensor that follows one of another dtype may start
    off its own alignment, and is copied out first."""
    if raw.storage_offset() % meta.dtype.itemsize:
        raw = raw.clone()
    return raw.view(meta.dtype).view(meta.shape)


def _split(buffer: torch.Tensor, tensors: list[TensorMeta]) -> Batch:
    """Views of a bucket's bytes as the tensors packed into it, in order."""
    views = buffer[: sum(t.nbytes for t in tensors)].split([t.nbytes for t in tensors])
    return [(t, typed_view(v, t)) for t, v in zip(tensors, views)]


class NcclReceiver(Receiver):
    """Receives broadcasts from the trainer (rank 0) in the group the init info names, joined
    through ``rendezvous``: siesta's by default, SGLang's for ``/init_weights_update_group``."""

    backend = "nccl"

    def __init__(
        self,
        config: WeightTransferConfig,
        device: torch.device,
        local_rank: int = 0,
        rendezvous: Rendezvous | None = None,
    ) -> None:
        super().__init__(config, device, local_rank)
        self.rendezvous = rendezvous or SiestaRendezvous()
        self.group: TransferGroup | None = None

    @property
    def ready(self) -> bool:
        return self.group is not None

    def not_ready(self) -> str:
        return f"no weight-transfer group: call {self.rendezvous.rejoin} first"

    def init(self, init_info: Any, join_timeout_s: float | None = None) -> None:
        """Join the group; the rendezvous is bounded by ``join_timeout_s`` (else the transfer
        timeout), every broadcast after it by the transfer timeout."""
        self.close()  # a trainer that restarts opens a new group
        timeout = self.config.timeout_s if join_timeout_s is None else join_timeout_s
        self.group = self.rendezvous.join(init_info, self.local_rank, self.device, timeout)
        self.group.timeout_s = self.config.timeout_s
        logger.info("joined a weight-transfer group (%s) as rank %d of %d",
                    self.rendezvous.rejoin, self.group.rank, self.group.world_size)  # fmt: skip

    def receive(self, info: UpdateInfo, accept: Accept) -> None:
        group = self._group()
        try:
            if info.packed:
                buckets = info.buckets()
                scratch = torch.empty(
                    max(sum(t.nbytes for t in b) for b in buckets), dtype=torch.uint8, device=self.device
                )
                for bucket in buckets:
                    buffer = scratch[: sum(t.nbytes for t in bucket)]
                    group.broadcast(buffer)
                    accept(_split(buffer, bucket))
            else:
                for meta in info.tensors:
                    tensor = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
                    group.broadcast(tensor)
                    accept([(meta, tensor)])
        except (RuntimeError, TimeoutError) as e:
            self.close()  # a group with a failed collective is out of step: the trainer must init again
            raise TransferFailed(
                f"the weight broadcast failed ({type(e).__name__}: {e}); {self.rendezvous.rejoin} again"
            ) from e

    def drain(self, info: UpdateInfo) -> None:
        if self.group is not None:
            self.receive(info, lambda batch: None)

    def _group(self) -> TransferGroup:
        if self.group is None:
            raise WeightTransferError(self.not_ready())
        return self.group

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


class IpcReceiver(Receiver):
    """Copies straight out of buffers the trainer shares on this device (no host round trip)."""

    backend = "ipc"

    def __init__(self, config: WeightTransferConfig, device: torch.device, local_rank: int = 0) -> None:
        super().__init__(config, device, local_rank)
        self.opener = HandleOpener(device, config.ipc_keep_mappings)
        self._ready = False
        # The last ipc_handles_pickled and what it unpickled to: a trainer that shares the same
        # tensors sends the same string every push, and unpickling is pure.
        self._last_pickled: tuple[str, Any] | None = None

    @property
    def ready(self) -> bool:
        return self._ready

    def init(self, init_info: Any) -> None:
        if init_info not in (None, {}):
            keys = sorted(init_info) if isinstance(init_info, dict) else type(init_info).__name__
            raise WeightTransferError(f"the ipc backend takes an empty init_info, got {keys}")
        self._ready = True

    def receive(self, info: UpdateInfo, accept: Accept) -> None:
        if not self._ready:
            raise WeightTransferError("call init_weight_transfer_engine first (the ipc backend takes init_info {})")
        handles = self._handles(info)
        if info.packed:
            accept(self._unpack(handles, info))
            return
        if not isinstance(handles, list) or len(handles) != len(info.tensors):
            count = len(handles) if isinstance(handles, list) else type(handles).__name__
            raise WeightTransferError(f"ipc_handles must hold one handle per tensor ({len(info.tensors)}), got {count}")
        shared = self.opener.open_all(handles)
        accept([(meta, self._as_declared(meta, tensor)) for meta, tensor in zip(info.tensors, shared)])

    def begin_update(self) -> None:
        self.opener.settle()  # the mappings the last update used stay open, the rest go

    def _handles(self, info: UpdateInfo) -> Any:
        if (info.ipc_handles is None) == (info.ipc_handles_pickled is None):
            raise WeightTransferError("an ipc update needs exactly one of ipc_handles and ipc_handles_pickled")
        if info.ipc_handles_pickled is not None:
            last = self._last_pickled
            if last is not None and last[0] == info.ipc_handles_pickled:
                return last[1]
            handles = unpickle_handles(info.ipc_handles_pickled)
            self._last_pickled = (info.ipc_handles_pickled, handles)
            return handles
        return info.ipc_handles

    def _unpack(self, handle: Any, info: UpdateInfo) -> Batch:
        if isinstance(handle, list) and len(handle) == 1:
            handle = handle[0]
        buffer = self.opener.open(handle)
        flat = buffer.reshape(-1).view(torch.uint8) if buffer.dtype != torch.uint8 else buffer.reshape(-1)
        if info.nbytes > flat.numel():
            raise WeightTransferError(
                f"the packed tensors take {info.nbytes} bytes but the shared buffer holds {flat.numel()}: "
                "the bucket's sizes do not add up"
            )
        return _split(flat, info.tensors)

    @staticmethod
    def _as_declared(meta: TensorMeta, shared: torch.Tensor) -> torch.Tensor:
        if shared.dtype == torch.uint8 and meta.dtype != torch.uint8:  # raw shared-memory bytes
            if shared.numel() != meta.nbytes:
                raise WeightTransferError(
                    f"{meta.name}: the shared buffer holds {shared.numel()} bytes, its shape and dtype need {meta.nbytes}"
                )
            return typed_view(shared, meta)
        if shared.dtype != meta.dtype or tuple(shared.shape) != meta.shape:
            raise WeightTransferError(
                f"{meta.name}: the shared tensor is {list(shared.shape)} {shared.dtype}, "
                f"update_info declares {list(meta.shape)} {meta.dtype}"
            )
        return shared

    def close(self) -> None:
        self.opener.close()
        self._last_pickled = None


class LocalReceiver(Receiver):
    """Tensors this process already holds (opened from handles a trainer shared), handed over as
    the update declares them; the updater's checks and writes are those of every backend."""

    backend = "tensor"

    def __init__(self, config: WeightTransferConfig, device: torch.device, tensors: list[torch.Tensor]) -> None:
        super().__init__(config, device)
        self.tensors = tensors

    @property
    def ready(self) -> bool:
        return True

    def receive(self, info: UpdateInfo, accept: Accept) -> None:
        if len(self.tensors) != len(info.tensors):
            raise WeightTransferError(f"{len(info.tensors)} tensors declared, {len(self.tensors)} handed over")
        accept(list(zip(info.tensors, self.tensors)))


RECEIVERS: dict[str, type[Receiver]] = {NcclReceiver.backend: NcclReceiver, IpcReceiver.backend: IpcReceiver}


def make_receiver(config: WeightTransferConfig, device: torch.device, local_rank: int = 0) -> Receiver:
    return RECEIVERS[config.backend](config, device, local_rank)
