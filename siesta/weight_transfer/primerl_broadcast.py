"""prime-rl's weight broadcast, received: ``/init_broadcaster``, then each ``/update_weights``.

prime-rl's trainer (``prime_rl.transports.weights.nccl``) is rank 0 of vLLM's
``StatelessProcessGroup``: a ``TCPStore`` it hosts at ``host:port`` for ``inference_world_size
+ 1`` members, each engine rank joining as ``rank_offset + local_rank + 1``; over it a NCCL
communicator (``PyNcclCommunicator``, one warm-up all-reduce of a zero). Per update it sends:

1. an int64 ``[1]``: how many state dicts follow (the non-layer weights, then one per layer);
2. per state dict, an int64 ``[1]`` (the metadata's length), a uint8 tensor of that length
   (a pickle of ``{dtype: [(name, shape, numel), ...]}``), then per dtype, in that order, one
   tensor of that dtype holding the dict's tensors flattened and concatenated.

The NCCL arm (a CUDA host) joins as PyNccl does: the trainer's NCCL unique id is the first object
rank 0 publishes through the group (``StatelessProcessGroup.broadcast_obj``: a pickle of vLLM's
ctypes ``ncclUniqueId`` under the store key ``broadcast_from/0/0``), read by an unpickler that
builds nothing but those 128 bytes; the communicator is torch's own NCCL binding
(``torch.cuda.nccl.init_rank``), its broadcasts on a stream of its own. Two ranks of one NCCL
communicator may not share a GPU, so this arm needs the trainer on another GPU: it is tested up
to the unique id on the CPU, and end to end only where two GPUs are (``tests/frameworks``).

On the CPU the same sequence runs over a ``ProcessGroupGloo`` on the same store, under the
``CPU_ARM_PREFIX`` prefix (siesta's CPU arm: prime-rl has none; its tests use it).

The metadata pickle is read by an unpickler that builds only ``torch.Size`` and torch dtypes.
Names and shapes are checked by the engine when the received tensors are loaded.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from siesta.weight_transfer.group import (
    GLOO,
    POLL_S,
    SOURCE_RANK,
    TransferGroup,
    TransferTimeout,
    connect_store,
    make_process_group,
)
from siesta.weight_transfer.wire import WIRE_DTYPES, WeightTransferError, restricted_load

CPU_ARM_PREFIX = "prime-rl-gloo"
# The broadcast's metadata pickle may name only these.
_ALLOWED = {("torch", "Size"), *(("torch", name) for name in WIRE_DTYPES)}
# No state dict's metadata is this large (names and shapes of one layer's tensors).
MAX_METADATA_BYTES = 64 << 20
# StatelessProcessGroup.broadcast_obj's key for rank 0's first object: PyNccl's unique id.
UNIQUE_ID_KEY = "broadcast_from/0/0"
NCCL_UNIQUE_ID_BYTES = 128
_VLLM_UNIQUE_ID = ("vllm.distributed.device_communicators.pynccl_wrapper", "ncclUniqueId")
_CTYPES_UNPICKLE = ("_ctypes", "_unpickle")  # how a pickled ctypes structure is rebuilt


class BroadcastGroup(Protocol):
    """What receiving needs of a group: its device, an in-place broadcast from the trainer, close."""

    device: torch.device

    def broadcast(self, tensor: torch.Tensor, src: int = SOURCE_RANK) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class BroadcasterInit:
    """prime-rl's ``/init_broadcaster`` body."""

    host: str
    port: int
    rank_offset: int
    inference_world_size: int
    timeout_s: float

    @property
    def rank(self) -> int:
        return self.rank_offset + 1  # rank 0 is the trainer; this engine's (only) rank follows

    @property
    def world_size(self) -> int:
        return self.inference_world_size + 1

    def check(self) -> None:
        if not 0 < self.port < 65536:
            raise WeightTransferError(f"port must be in [1, 65535], got {self.port}")
        if self.rank_offset < 0 or self.rank >= self.world_size:
            raise WeightTransferError(
                f"rank_offset {self.rank_offset} puts this engine at rank {self.rank}, outside the "
                f"{self.world_size} ranks of inference_world_size {self.inference_world_size} plus the trainer"
            )
        if self.timeout_s <= 0:
            raise WeightTransferError(f"timeout must be > 0 seconds, got {self.timeout_s}")


class _UniqueIdMarker:
    """Stands for vLLM's ``ncclUniqueId`` class while its pickle is read: nothing is built."""


class _UniqueIdBytes(bytes):
    """Bytes that came out of a pickled ``ncclUniqueId`` (not any pickled bytes)."""


def _unique_id_bytes(cls: type, state: Any) -> bytes:
    """``_ctypes._unpickle``'s stand-in: the structure's bytes, checked, instead of the structure."""
    raw = state[1] if cls is _UniqueIdMarker and isinstance(state, tuple) and len(state) == 2 else None
    if not isinstance(raw, bytes) or len(raw) != NCCL_UNIQUE_ID_BYTES:
        raise WeightTransferError(f"the trainer's NCCL unique id must be {NCCL_UNIQUE_ID_BYTES} bytes of vLLM's "
                                  "ncclUniqueId")  # fmt: skip
    return _UniqueIdBytes(raw)


class _UniqueIdUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == _VLLM_UNIQUE_ID:
            return _UniqueIdMarker
        if (module, name) == _CTYPES_UNPICKLE:
            return _unique_id_bytes
        raise WeightTransferError(f"the trainer's NCCL unique id is a {module}.{name}; siesta reads vLLM's "
                                  f"{'.'.join(_VLLM_UNIQUE_ID)} (PyNcclCommunicator over a StatelessProcessGroup)")  # fmt: skip


def read_unique_id(data: bytes) -> bytes:
    """The 128 bytes of the ``ncclUniqueId`` that vLLM's ``broadcast_obj`` pickled into ``data``."""
    uid = restricted_load(_UniqueIdUnpickler, data, "the trainer's NCCL unique id is not vLLM's ({error})")
    if not isinstance(uid, _UniqueIdBytes):
        raise WeightTransferError("the trainer's first broadcast object is not vLLM's ncclUniqueId")
    return bytes(uid)


@dataclass
class NcclBroadcastGroup:
    """This engine's rank of the trainer's NCCL communicator (torch's binding), on its own stream."""

    comm: Any
    store: dist.Store
    stream: Any  # torch.cuda.Stream
    rank: int
    world_size: int
    device: torch.device
    timeout_s: float

    def _wait(self, what: str) -> None:
        done = torch.cuda.Event()
        done.record(self.stream)
        deadline = time.monotonic() + self.timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                self.close()  # its stream may never drain: the group is not used again
                raise TransferTimeout(f"no {what} from the trainer within {self.timeout_s:.0f}s")
            time.sleep(POLL_S)

    def broadcast(self, tensor: torch.Tensor, src: int = SOURCE_RANK) -> None:
        """In place from ``src`` (the trainer); returns once ``tensor`` holds the data."""
        if self.comm is None:
            raise WeightTransferError("the broadcast group was closed; call /init_broadcaster again")
        self._after_current_work()
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            torch.cuda.nccl.broadcast([tensor], root=src, streams=[self.stream], comms=[self.comm])
        self._wait("broadcast")

    def _after_current_work(self) -> None:
        """The NCCL stream waits for what the current stream queued (a zero fill of the buffer)."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def warm_up(self) -> None:
        """PyNccl's: an all-reduce of one fp32 zero, which the trainer runs too."""
        zero = torch.zeros(1, device=self.device)
        self._after_current_work()
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            torch.cuda.nccl.all_reduce([zero], streams=[self.stream], comms=[self.comm])
        self._wait("warm-up all-reduce")

    def close(self) -> None:
        self.comm = None


def join_nccl(init: BroadcasterInit, device: torch.device) -> NcclBroadcastGroup:
    """This engine's rank of the trainer's NCCL group, as vLLM's PyNcclCommunicator joins it
    (blocks until every member joined)."""
    init.check()
    store = connect_store(init.host, init.port, init.world_size, False, init.timeout_s, counts_itself=True)
    uid = read_unique_id(store.get(UNIQUE_ID_KEY))
    stream = torch.cuda.Stream(device)
    with torch.cuda.device(device):
        comm = torch.cuda.nccl.init_rank(init.world_size, uid, init.rank)
    group = NcclBroadcastGroup(comm, store, stream, init.rank, init.world_size, device, init.timeout_s)
    group.warm_up()
    return group


def join(init: BroadcasterInit) -> TransferGroup:
    """This engine's membership of the trainer's group over gloo, the CPU arm (blocks until every
    member joined)."""
    init.check()
    # StatelessProcessGroup's members pass the world size, so each counts itself in.
    store = connect_store(init.host, init.port, init.world_size, False, init.timeout_s, counts_itself=True)
    group = make_process_group(torch.distributed.PrefixStore(CPU_ARM_PREFIX, store), init.rank, init.world_size,
                               GLOO, init.timeout_s)  # fmt: skip
    transfer = TransferGroup(group, store, init.rank, init.world_size, torch.device("cpu"), init.timeout_s)
    warmup = torch.zeros(1)
    group.allreduce([warmup]).wait()  # PyNcclCommunicator's warm-up, which the trainer runs too
    return transfer


def receive_state_dicts(group: BroadcastGroup) -> Iterator[dict[str, torch.Tensor]]:
    """Every state dict of one update, in the order the trainer sends them, on the host."""
    for _ in range(_receive_int(group)):
        size = _receive_int(group)
        if not 0 < size <= MAX_METADATA_BYTES:
            raise WeightTransferError(
                f"the trainer announced {size} bytes of metadata; expected 1 to {MAX_METADATA_BYTES}"
            )
        raw = torch.empty(size, dtype=torch.uint8, device=group.device)
        group.broadcast(raw)
        metadata = _read_metadata(raw.cpu().numpy().tobytes())
        state: dict[str, torch.Tensor] = {}
        for dtype, entries in metadata.items():
            flat = torch.empty(sum(numel for _, _, numel in entries), dtype=dtype, device=group.device)
            group.broadcast(flat)
            offset = 0
            for name, shape, numel in entries:
                state[name] = flat[offset : offset + numel].view(shape).to("cpu", copy=True)
                offset += numel
        yield state


def _receive_int(group: BroadcastGroup) -> int:
    value = torch.zeros(1, dtype=torch.int64, device=group.device)
    group.broadcast(value, SOURCE_RANK)
    return int(value.item())


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise WeightTransferError(f"the broadcast's metadata names {module}.{name}, which prime-rl's never holds")
        return super().find_class(module, name)


def _read_metadata(data: bytes) -> dict[torch.dtype, list[tuple[str, torch.Size, int]]]:
    metadata = restricted_load(_MetadataUnpickler, data, "the broadcast's metadata is not prime-rl's ({error})")
    if not isinstance(metadata, dict) or not all(isinstance(k, torch.dtype) for k in metadata):
        raise WeightTransferError("the broadcast's metadata must map dtypes to (name, shape, numel) entries")
    for entries in metadata.values():
        for entry in entries:
            name, shape, numel = entry
            if not isinstance(name, str) or int(torch.Size(shape).numel()) != numel:
                raise WeightTransferError(f"the broadcast's metadata entry {entry!r} does not add up")
    return metadata
