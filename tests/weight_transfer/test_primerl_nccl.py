"""prime-rl's NCCL broadcaster (``primerl_broadcast.join_nccl``), joined as vLLM's PyNccl joins.

The trainer side is written here from vLLM's source, field for field: ``PyNcclCommunicator`` over
a ``StatelessProcessGroup`` has rank 0 publish its NCCL unique id with ``broadcast_obj`` (a
pickle of the ctypes ``ncclUniqueId`` of ``vllm.distributed.device_communicators.pynccl_wrapper``,
``_fields_ = [("internal", c_byte * 128)]``, under ``broadcast_from/0/0`` of the TCPStore rank 0
hosts), then ``ncclCommInitRank`` and a warm-up all-reduce of an fp32 zero.

On the CPU: the unique id read off a real store, and foreign pickles refused without running
them. With two GPUs (the trainer on the second): the whole join and a broadcast of prime-rl's
state-dict sequence, through torch's NCCL binding on both sides.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import sys
import threading
import types
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from siesta.weight_transfer import primerl_broadcast as pb
from siesta.weight_transfer.wire import WeightTransferError

VLLM_MODULE = "vllm.distributed.device_communicators.pynccl_wrapper"
TIMEOUT_S = 60.0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def vllm_unique_id_class(monkeypatch: pytest.MonkeyPatch):
    """vLLM's ctypes ``ncclUniqueId`` under its own module path, so it pickles as vLLM's does."""
    parts = VLLM_MODULE.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))

    class ncclUniqueId(ctypes.Structure):  # noqa: N801 - vLLM's name
        _fields_ = [("internal", ctypes.c_byte * 128)]

    ncclUniqueId.__module__, ncclUniqueId.__qualname__ = VLLM_MODULE, "ncclUniqueId"
    sys.modules[VLLM_MODULE].ncclUniqueId = ncclUniqueId
    return ncclUniqueId


def _vllm_pickle(cls, raw: bytes) -> bytes:
    uid = cls()
    ctypes.memmove(ctypes.addressof(uid), raw, len(raw))
    return pickle.dumps(uid)


def test_the_unique_id_is_read_as_vllm_publishes_it(vllm_unique_id_class) -> None:
    raw = bytes((i * 37 + 11) % 256 for i in range(128))
    port = _free_port()
    hosted = {}

    def trainer() -> None:  # StatelessProcessGroup.create(rank=0, world_size=2), then broadcast_obj
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=TIMEOUT_S))
        store.set("broadcast_from/0/0", _vllm_pickle(vllm_unique_id_class, raw))
        hosted["store"] = store

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    init = pb.BroadcasterInit("127.0.0.1", port, 0, 1, 20.0)
    store = pb.connect_store(init.host, init.port, init.world_size, False, init.timeout_s, counts_itself=True)
    assert pb.read_unique_id(store.get(pb.UNIQUE_ID_KEY)) == raw
    thread.join(TIMEOUT_S)


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo should-not-run",))


@pytest.mark.parametrize(
    "payload,message",
    [
        (pickle.dumps(_Boom()), "is a posix.system|is a nt.system"),
        (pickle.dumps(b"\x00" * 128), "not vLLM's ncclUniqueId"),
        (b"\x80\x04not a pickle", "not vLLM's"),
    ],
    ids=["foreign-callable", "plain-bytes", "torn"],
)
def test_anything_else_is_refused_without_running_it(payload: bytes, message: str) -> None:
    with pytest.raises(WeightTransferError, match=message):
        pb.read_unique_id(payload)


def test_a_unique_id_of_the_wrong_size_is_refused(vllm_unique_id_class, monkeypatch: pytest.MonkeyPatch) -> None:
    class Short(ctypes.Structure):
        _fields_ = [("internal", ctypes.c_byte * 64)]

    Short.__module__ = VLLM_MODULE
    Short.__qualname__ = Short.__name__ = "ncclUniqueId"
    monkeypatch.setattr(sys.modules[VLLM_MODULE], "ncclUniqueId", Short)
    with pytest.raises(WeightTransferError, match="must be 128 bytes"):
        pb.read_unique_id(pickle.dumps(Short()))


# ---------------------------------------------------------------------------- two GPUs

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL ranks need a GPU each: two GPUs")


def _trainer_process(port: int, state: dict[str, torch.Tensor], ready) -> None:  # noqa: ANN001
    """prime-rl's NCCLWeightBroadcastSender on cuda:1: the group, PyNccl's join, one update."""
    device = torch.device("cuda", 1)
    torch.cuda.set_device(device)
    parts = VLLM_MODULE.split(".")
    for i in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))

    class ncclUniqueId(ctypes.Structure):  # noqa: N801
        _fields_ = [("internal", ctypes.c_byte * 128)]

    ncclUniqueId.__module__, ncclUniqueId.__qualname__ = VLLM_MODULE, "ncclUniqueId"
    sys.modules[VLLM_MODULE].ncclUniqueId = ncclUniqueId
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=TIMEOUT_S))
    uid = torch.cuda.nccl.unique_id()
    store.set("broadcast_from/0/0", _vllm_pickle(ncclUniqueId, uid))
    comm = torch.cuda.nccl.init_rank(2, uid, 0)
    torch.cuda.nccl.all_reduce([torch.zeros(1, device=device)], comms=[comm])
    ready.set()

    def send(t: torch.Tensor) -> None:
        torch.cuda.nccl.broadcast([t.to(device)], root=0, comms=[comm])

    send(torch.tensor([1], dtype=torch.int64))
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, t in state.items():
        by_dtype.setdefault(t.dtype, []).append((name, t))
    meta = pickle.dumps({d: [(n, t.shape, t.numel()) for n, t in items] for d, items in by_dtype.items()})
    send(torch.tensor([len(meta)], dtype=torch.int64))
    send(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
    for items in by_dtype.values():
        send(torch.cat([t.flatten() for _, t in items]))
    torch.cuda.synchronize(device)


@TWO_GPUS
def test_a_broadcast_from_a_trainer_on_another_gpu() -> None:
    ctx = torch.multiprocessing.get_context("spawn")
    state = {"model.embed_tokens.weight": torch.randn(64, 32).to(torch.bfloat16),
             "model.norm.weight": torch.randn(32)}  # fmt: skip
    port = _free_port()
    ready = ctx.Event()
    trainer = ctx.Process(target=_trainer_process, args=(port, state, ready), daemon=True)
    trainer.start()
    group = pb.join_nccl(pb.BroadcasterInit("127.0.0.1", port, 0, 1, TIMEOUT_S), torch.device("cuda", 0))
    assert ready.wait(TIMEOUT_S)
    (received,) = list(pb.receive_state_dicts(group))
    trainer.join(TIMEOUT_S)
    assert set(received) == set(state)
    for name, t in state.items():
        assert received[name].device.type == "cpu" and torch.equal(received[name], t)
