"""SGLang's weight-update group, joined the way SGLang's engine joins it, from torch's public pieces.

A trainer written for SGLang (slime, AReaL, verl) and SGLang's engine both call their copy of
``init_custom_process_group(backend, init_method=f"tcp://{master_address}:{master_port}",
world_size, rank, group_name)`` (the trainer as rank 0, engine ranks from ``rank_offset``). That
is torch's ``rendezvous(init_method, rank, world_size)``, which makes rank 0 host a
``TCPStore``, then ``PrefixStore(group_name, store)`` and torch's private
``_new_process_group_helper``, which adds two more prefixes for a named group: its name with a
slash, then the backend's device with a slash. So every key the backend writes reaches the
TCPStore as ``/{group_name}/{group_name}//{device}//{key}`` (gloo's first key is
``.../cpu//0/0``), where the device is the first one torch's ``Backend.backend_capability``
lists for the backend: ``cuda`` for nccl, ``cpu`` for gloo. This module builds the same chain
of ``PrefixStore``s by hand around a ``TCPStore`` client, so the engine never touches torch's
registry of groups, and never the default group that tensor parallelism owns.

Two more things the trainer's side expects. Its TCPStore master waits, in its constructor,
until ``world_size`` members have counted themselves in the store (``wait_for_workers``): the
engine's client must count itself, or the trainer's rendezvous never returns. And SGLang runs
no collective at init: NCCL builds its communicator at the first broadcast (gloo connects its
mesh in the constructor), so no handshake is sent here either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from siesta.brief import brief
from siesta.weight_transfer.group import GLOO, NCCL, TransferGroup, connect_store, make_process_group
from siesta.weight_transfer.wire import MAX_PORT, MAX_WORLD_SIZE, WeightTransferError

DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's default
DEFAULT_BACKEND = NCCL
# The device torch's _new_process_group_helper names a single-backend group's store after:
# the first entry of Backend.backend_capability for the backend (torch 2.x).
BACKEND_DEVICE = {NCCL: "cuda", GLOO: "cpu"}
TRAINER_RANK = 0
REJOIN = "init_weights_update_group"
_INIT_KEYS = {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend",
              "timeout_s"}  # timeout_s: siesta's, the join's bound (joining.py)


@dataclass(frozen=True)
class SglangGroupInfo:
    """SGLang's ``/init_weights_update_group`` body."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = DEFAULT_BACKEND


def _int(d: dict[str, Any], key: str, minimum: int, maximum: int | None = None) -> int:
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (maximum and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise WeightTransferError(f"{brief(key)} must be an integer {bound}, got {brief(value)}")
    return value


def parse_sglang_group(init_info: Any) -> SglangGroupInfo:
    if not isinstance(init_info, dict):
        raise WeightTransferError(f"the group's init info must be a JSON object, got {type(init_info).__name__}")
    unknown = sorted(set(init_info) - _INIT_KEYS)
    if unknown:
        raise WeightTransferError(f"init_weights_update_group does not take {unknown}")
    address = init_info.get("master_address")
    if not isinstance(address, str) or not address:
        raise WeightTransferError(f"'master_address' must be a host name or address, got {brief(address)}")
    name = init_info.get("group_name", DEFAULT_GROUP_NAME)
    if not isinstance(name, str) or not name:
        raise WeightTransferError(f"'group_name' must be a non-empty string, got {brief(name)}")
    backend = init_info.get("backend", DEFAULT_BACKEND)
    if backend not in BACKEND_DEVICE:
        raise WeightTransferError(f"'backend' must be one of {sorted(BACKEND_DEVICE)}, got {brief(backend)}")
    return SglangGroupInfo(
        master_address=address,
        master_port=_int(init_info, "master_port", 1, MAX_PORT),
        rank_offset=_int(init_info, "rank_offset", TRAINER_RANK + 1),
        world_size=_int(init_info, "world_size", 2, MAX_WORLD_SIZE),
        group_name=name,
        backend=backend,
    )


def group_store(store: dist.Store, group_name: str, backend: str) -> dist.Store:
    """``store`` seen through the prefixes SGLang's helper and torch put around a named group's backend."""
    named = dist.PrefixStore(group_name, store)  # init_custom_process_group's own
    in_group = dist.PrefixStore(f"{group_name}/", named)  # _new_process_group_helper: the group
    return dist.PrefixStore(f"{BACKEND_DEVICE[backend]}/", in_group)  # ... and the backend's device


def open_sglang_group(info: SglangGroupInfo, local_rank: int, device: torch.device, timeout_s: float) -> TransferGroup:
    """Join the trainer's group as rank ``rank_offset + local_rank``; blocks (bounded) until gloo's
    mesh is up, or only until the store is reached for nccl, whose communicator comes with the
    first broadcast."""
    rank = info.rank_offset + local_rank
    if rank >= info.world_size:
        raise WeightTransferError(
            f"rank_offset {info.rank_offset} puts this engine at rank {rank}, outside world_size {info.world_size}"
        )
    if info.backend == NCCL and device.type != "cuda":
        raise WeightTransferError(f"backend 'nccl' needs CUDA and this engine runs on the {device.type}: use 'gloo'")
    try:
        store = connect_store(info.master_address, info.master_port, info.world_size, False, timeout_s, True)
        group = make_process_group(group_store(store, info.group_name, info.backend), rank, info.world_size,
                                   info.backend, timeout_s)  # fmt: skip
    except RuntimeError as e:  # no store there, or (gloo's mesh) no trainer joined under this name in time
        raise WeightTransferError(
            f"could not join weight update group {brief(info.group_name)} at {info.master_address}:{info.master_port} "
            f"as rank {rank} of {info.world_size} within {timeout_s:.0f}s: {e}"
        ) from None
    return TransferGroup(group, store, rank, info.world_size, device, timeout_s)


class SglangRendezvous:
    """The rendezvous an ``NcclReceiver`` joins through for SGLang's ``/init_weights_update_group``."""

    rejoin = REJOIN

    def join(self, init_info: Any, local_rank: int, device: torch.device, timeout_s: float) -> TransferGroup:
        info = init_info if isinstance(init_info, SglangGroupInfo) else parse_sglang_group(init_info)
        return open_sglang_group(info, local_rank, device, timeout_s)
