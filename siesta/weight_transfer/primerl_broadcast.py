"""prime-rl's weight broadcast, received: ``/init_broadcaster``, then each ``/update_weights``.

prime-rl's trainer (``prime_rl.transports.weights.nccl``) is rank 0 of vLLM's
``StatelessProcessGroup``: a ``TCPStore`` it hosts at ``host:port`` for ``inference_world_size
+ 1`` members, each engine rank joining as ``rank_offset + local_rank + 1``; over it a NCCL
communicator (``PyNcclCommunicator``, one warm-up all-reduce of a zero). Per update it sends:

1. an int64 ``[1]``: how many state dicts follow (the non-layer weights, then one per layer);
2. per state dict, an int64 ``[1]`` (the metadata's length), a uint8 tensor of that length
   (a pickle of ``{dtype: [(name, shape, numel), ...]}``), then per dtype, in that order, one
   tensor of that dtype holding the dict's tensors flattened and concatenated.

On the CPU the same sequence runs over a ``ProcessGroupGloo`` on the same store, under the
``CPU_ARM_PREFIX`` prefix (siesta's CPU arm: prime-rl has none; its tests use it). The NCCL arm
needs vLLM's unique-id exchange and is not built yet: a CUDA engine refuses the call by name.

The metadata pickle is read by an unpickler that builds only ``torch.Size`` and torch dtypes.
Names and shapes are checked by the engine when the received tensors are loaded.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from siesta.weight_transfer.group import GLOO, SOURCE_RANK, TransferGroup, connect_store, make_process_group
from siesta.weight_transfer.wire import WIRE_DTYPES, WeightTransferError

CPU_ARM_PREFIX = "prime-rl-gloo"
# The broadcast's metadata pickle may name only these.
_ALLOWED = {("torch", "Size"), *(("torch", name) for name in WIRE_DTYPES)}
# No state dict's metadata is this large (names and shapes of one layer's tensors).
MAX_METADATA_BYTES = 64 << 20


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


def join(init: BroadcasterInit) -> TransferGroup:
    """This engine's membership of the trainer's group (blocks until every member joined)."""
    init.check()
    # StatelessProcessGroup's members pass the world size, so each counts itself in.
    store = connect_store(init.host, init.port, init.world_size, False, init.timeout_s, counts_itself=True)
    group = make_process_group(torch.distributed.PrefixStore(CPU_ARM_PREFIX, store), init.rank, init.world_size,
                               GLOO, init.timeout_s)  # fmt: skip
    transfer = TransferGroup(group, store, init.rank, init.world_size, torch.device("cpu"), init.timeout_s)
    warmup = torch.zeros(1)
    group.allreduce([warmup]).wait()  # PyNcclCommunicator's warm-up, which the trainer runs too
    return transfer


def receive_state_dicts(group: TransferGroup) -> Iterator[dict[str, torch.Tensor]]:
    """Every state dict of one update, in the order the trainer sends them."""
    for _ in range(_receive_int(group)):
        size = _receive_int(group)
        if not 0 < size <= MAX_METADATA_BYTES:
            raise WeightTransferError(
                f"the trainer announced {size} bytes of metadata; expected 1 to {MAX_METADATA_BYTES}"
            )
        raw = torch.empty(size, dtype=torch.uint8)
        group.broadcast(raw)
        metadata = _read_metadata(raw.numpy().tobytes())
        state: dict[str, torch.Tensor] = {}
        for dtype, entries in metadata.items():
            flat = torch.empty(sum(numel for _, _, numel in entries), dtype=dtype)
            group.broadcast(flat)
            offset = 0
            for name, shape, numel in entries:
                state[name] = flat[offset : offset + numel].view(shape).clone()
                offset += numel
        yield state


def _receive_int(group: TransferGroup) -> int:
    value = torch.zeros(1, dtype=torch.int64)
    group.broadcast(value, SOURCE_RANK)
    return int(value.item())


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise WeightTransferError(f"the broadcast's metadata names {module}.{name}, which prime-rl's never holds")
        return super().find_class(module, name)


def _read_metadata(data: bytes) -> dict[torch.dtype, list[tuple[str, torch.Size, int]]]:
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except WeightTransferError:
        raise
    except Exception as e:  # noqa: BLE001 - a torn or foreign pickle
        raise WeightTransferError(f"the broadcast's metadata is not prime-rl's ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, dict) or not all(isinstance(k, torch.dtype) for k in metadata):
        raise WeightTransferError("the broadcast's metadata must map dtypes to (name, shape, numel) entries")
    for entries in metadata.values():
        for entry in entries:
            name, shape, numel = entry
            if not isinstance(name, str) or int(torch.Size(shape).numel()) != numel:
                raise WeightTransferError(f"the broadcast's metadata entry {entry!r} does not add up")
    return metadata
