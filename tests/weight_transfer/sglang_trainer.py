"""A trainer that talks to an engine the way slime, AReaL and verl talk to SGLang.

It joins the weight-update group through torch's own path, as slime's
``distributed_utils.init_process_group`` and SGLang's ``init_custom_process_group`` do:
``rendezvous("tcp://...")`` (this process, rank 0, hosts the TCPStore), ``PrefixStore(group_name,
store)``, then torch's ``_new_process_group_helper`` for a named group. Nothing here mirrors
siesta's code, so a test passes only if siesta's engine side finds the keys where torch put them.

Run as a script it is a trainer that dies, or goes silent, in the middle of an update.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import sys
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

TRAINER_RANK = 0
SILENT_S = 600.0


def init_group_like_sglang(
    master_address: str, master_port: int, world_size: int, group_name: str, backend: str, timeout_s: float
) -> dist.ProcessGroup:
    """Rank 0 of a named group, exactly as slime's trainer builds it (blocks until every rank joined)."""
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", TRAINER_RANK, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, backend_options=None, timeout=timeout
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast_each(group: dist.ProcessGroup, tensors: list[torch.Tensor]) -> None:
    """slime's unbucketed send: every tensor broadcast from rank 0, in order, then waited on."""
    handles = [dist.broadcast(t, TRAINER_RANK, group=group, async_op=True) for t in tensors]
    for handle in handles:
        handle.wait()


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """SGLang's flattened bucket: each tensor's bytes, in order, with nothing between them."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def serialize(obj: Any) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)``: torch's reductions."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


@dataclass
class BucketMeta:
    """A stand-in for SGLang's ``FlattenedTensorMetadata``, pickled under SGLang's name."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclass
class PerRankTensor:
    """A stand-in for SGLang's ``LocalSerializedTensor``: one serialized tensor per engine rank."""

    values: list[bytes]


def _under_sglang_name(cls: type, module: str, name: str) -> None:
    """Pickle names a class by its module and name, and checks that they lead back to it."""
    cls.__module__, cls.__qualname__, cls.__name__ = module, name, name
    parts = module.split(".")
    for i in range(1, len(parts) + 1):  # importing a dotted name imports its parents first
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    setattr(sys.modules[module], name, cls)


_under_sglang_name(BucketMeta, "sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
_under_sglang_name(PerRankTensor, "sglang.srt.model_executor.model_runner", "LocalSerializedTensor")


def flattened_bucket(named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """What slime serializes for ``load_format="flattened_bucket"``."""
    metadata, start = [], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        metadata.append(BucketMeta(name, t.shape, t.dtype, start, start + nbytes, nbytes))
        start += nbytes
    return {"flattened_tensor": flatten([t for _, t in named]), "metadata": metadata}


class Background:
    """An HTTP call on its own thread: SGLang's engine answers only once the broadcast arrived."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to join's caller
            self.error = e

    def join(self, timeout_s: float) -> Any:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"no answer within {timeout_s:.0f}s")
        if self.error is not None:
            raise self.error
        return self.result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--group-name", default="weight_update_group")
    ap.add_argument("--mode", choices=["die-after", "hang-after", "send"], required=True)
    ap.add_argument("--tensors", type=int, default=1, help="float32 tensors of --numel to broadcast first")
    ap.add_argument("--numel", type=int, default=16)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    args = ap.parse_args()
    print("starting", flush=True)
    group = init_group_like_sglang("127.0.0.1", args.port, 2, args.group_name, "gloo", args.timeout_s)
    print("joined", flush=True)
    broadcast_each(group, [torch.arange(args.numel, dtype=torch.float32) + i for i in range(args.tensors)])
    print("sent", flush=True)
    if args.mode == "hang-after":
        time.sleep(SILENT_S)
    elif args.mode == "die-after":
        os._exit(1)  # dies with the rest of the update unsent
    else:
        # Everything was sent and waited on. Leave without the interpreter's teardown, which
        # destroys the group while gloo's threads still run and at times ends in
        # std::terminate (exit -6): a trainer artefact, not what the tests check.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
