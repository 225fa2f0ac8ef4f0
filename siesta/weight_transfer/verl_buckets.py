"""verl's IPC bucket protocol (its vLLM path), turned into SGLang's serialized tensors.

verl's ``ServerAdapter.update_weights`` (``verl/workers/rollout/vllm_rollout/vllm_rollout.py``)
binds a ZeroMQ REQ socket at ``ipc:///tmp/rl-colocate-zmq-{gpu uuid}.sock`` and calls
``collective_rpc("update_weights_from_ipc")``; the worker extension connects a REP socket there.
The trainer sends ``reduce_tensor(buffer)`` of one uint8 bucket buffer, ``(rebuild_cuda_tensor,
args)``, pickled; the worker answers ``b""``. Then, per bucket, once the buffer holds it:
``{"bucket_meta": {name: {"name", "shape", "dtype", "offset"}}, "is_last": bool}``, answered
``b""`` when the engine may overwrite the buffer.

On the CPU the same messages carry the buffer shared by torch's ``file_system`` strategy:
``ForkingPickler.dumps(reduce_tensor(buffer))``, a ``(rebuild_tensor, (cls, storage,
metadata))`` whose storage names the shared file (plain pickle would copy its bytes).

Nothing here opens the trainer's memory: the handle is read by an unpickler that records what it
names (torch's rebuild functions, classes and dtypes, nothing else) and each bucket becomes one
entry of SGLang's ``serialized_named_tensors`` of (name, view) pairs, each view the same handle
with its own dtype, shape and offset, pickled with torch's own rebuild functions. The engine
opens those through its restricted unpickler (``pickled_tensors``), checks every name and shape,
and copies, so CUDA IPC and shared memory take one code path.
"""

from __future__ import annotations

import base64
import io
import math
import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing import reductions

from siesta.weight_transfer.wire import WIRE_DTYPES, WeightTransferError, restricted_load

IPC_PREFIX = "ipc:///tmp/rl-colocate-zmq-"
IPC_SUFFIX = ".sock"
_CUDA_ARGS = 15
# Positions in rebuild_cuda_tensor's arguments (torch.multiprocessing.reductions).
_SIZE, _STRIDE, _OFFSET, _DTYPE, _STORAGE_BYTES = 1, 2, 3, 5, 8
_FUNCTIONS = {
    name: getattr(reductions, name)
    for name in ("rebuild_cuda_tensor", "rebuild_tensor", "rebuild_typed_storage", "rebuild_storage_filename")
}
_CLASSES = {
    ("torch", "Tensor"): torch.Tensor,
    ("torch._tensor", "Tensor"): torch.Tensor,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
    ("torch", "Size"): torch.Size,
    ("torch", "uint8"): torch.uint8,
}
_CLASSES.update({("torch", name): dtype for name, dtype in WIRE_DTYPES.items()})


def socket_path(gpu_uuid: str) -> str:
    """verl's socket for the GPU its trainer and this engine share (vLLM's ``GPU-...`` UUID)."""
    return f"{IPC_PREFIX}{gpu_uuid}{IPC_SUFFIX}"


@dataclass
class _Call:
    """A rebuild the pickle asks for, recorded, never run: ``fn(*args)`` once pickled again."""

    fn: str
    args: tuple[Any, ...]


class _Recorder:
    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any) -> _Call:
        return _Call(self.name, args)


class _HandleUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.multiprocessing.reductions" and name in _FUNCTIONS:
            return _Recorder(name)
        found = _CLASSES.get((module, name))
        if found is None:
            raise WeightTransferError(
                f"verl's buffer handle names {module}.{name}, which is not part of a shared tensor"
            )
        if found in (torch.UntypedStorage, torch.storage.TypedStorage, torch.Tensor):
            return _Inert(found)  # a class the rebuild takes as an argument: never called here
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise WeightTransferError("verl's buffer handle holds a persistent id, which no shared tensor has")


@dataclass(frozen=True)
class _Inert:
    cls: type


@dataclass(frozen=True)
class SharedBuffer:
    """verl's bucket buffer, as its handle names it: a CUDA IPC handle or a shared file."""

    call: _Call
    nbytes: int

    @classmethod
    def parse(cls, data: bytes) -> SharedBuffer:
        handle = restricted_load(_HandleUnpickler, data, "verl's buffer handle does not decode: {error}")
        if isinstance(handle, tuple) and len(handle) == 2 and isinstance(handle[0], _Recorder):
            call = _Call(handle[0].name, tuple(handle[1]))  # reduce_tensor's (fn, args), sent as is
        elif isinstance(handle, _Call):
            call = handle  # the tensor itself, pickled by ForkingPickler
        else:
            raise WeightTransferError("verl's buffer handle must be reduce_tensor(buffer): (rebuild function, args)")
        return cls(call, _buffer_bytes(call))

    def view(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> _Call:
        """The handle of ``buffer[offset:offset + nbytes].view(dtype).view(shape)``."""
        nbytes = math.prod(shape) * dtype.itemsize
        if offset % dtype.itemsize or offset < 0 or offset + nbytes > self.nbytes:
            raise WeightTransferError(f"a {dtype} tensor of shape {list(shape)} at byte {offset} does not lie, aligned, "
                                      f"inside the {self.nbytes}-byte bucket")  # fmt: skip
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        args = list(self.call.args)
        if self.call.fn == "rebuild_cuda_tensor":
            args[_SIZE], args[_STRIDE], args[_OFFSET], args[_DTYPE] = shape, stride, offset // dtype.itemsize, dtype
            return _Call(self.call.fn, tuple(args))
        tensor_cls, storage, _ = args
        untyped = storage.args[0] if isinstance(storage, _Call) and storage.fn == "rebuild_typed_storage" else storage
        typed = _Call("rebuild_typed_storage", (untyped, dtype))
        return _Call("rebuild_tensor", (tensor_cls, typed, (offset // dtype.itemsize, shape, stride, False)))


def _buffer_bytes(call: _Call) -> int:
    if call.fn == "rebuild_cuda_tensor":
        if len(call.args) != _CUDA_ARGS or call.args[_DTYPE] is not torch.uint8:
            raise WeightTransferError("verl's CUDA buffer handle must share a uint8 buffer (15 rebuild arguments)")
        return int(math.prod(call.args[_SIZE]))
    if call.fn == "rebuild_tensor" and len(call.args) == 3 and isinstance(call.args[2], tuple):
        _, size, _, _ = call.args[2]
        return int(math.prod(size))
    raise WeightTransferError(f"verl's buffer handle rebuilds with {call.fn}, not a shared uint8 buffer")


@dataclass(frozen=True)
class Bucket:
    """One ``bucket_meta`` message: the tensors the buffer holds now, in its order."""

    tensors: list[tuple[str, torch.dtype, tuple[int, ...], int]]  # name, dtype, shape, byte offset
    is_last: bool

    @classmethod
    def parse(cls, data: bytes) -> Bucket:
        message = restricted_load(_MetaUnpickler, data, "verl's bucket metadata does not decode: {error}")
        if not isinstance(message, dict) or not isinstance(message.get("bucket_meta"), dict):
            raise WeightTransferError('verl\'s bucket metadata is {"bucket_meta": {name: {...}}, "is_last": bool}')
        tensors = []
        for name, meta in message["bucket_meta"].items():
            try:
                shape, dtype, offset = tuple(int(s) for s in meta["shape"]), meta["dtype"], int(meta["offset"])
            except (KeyError, TypeError, ValueError):
                raise WeightTransferError(f"verl's bucket entry {name!r} needs shape, dtype and offset") from None
            if not isinstance(dtype, torch.dtype):
                raise WeightTransferError(f"verl's bucket entry {name!r} has dtype {dtype!r}, not a torch dtype")
            tensors.append((str(name), dtype, shape, offset))
        return cls(tensors, bool(message.get("is_last")))


class _MetaUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _CLASSES.get((module, name))
        if found is None or isinstance(found, type) and found is not torch.Size:
            raise WeightTransferError(f"verl's bucket metadata names {module}.{name}: it holds sizes and dtypes only")
        return found


class _Pickler(pickle.Pickler):
    """Pickles recorded rebuilds as torch's own calls (what ForkingPickler writes for a share)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _Call):
            return _FUNCTIONS[obj.fn], _real(obj.args)
        return NotImplemented


def _real(value: Any) -> Any:
    """The classes a recorded rebuild takes, back in place of their inert stand-ins."""
    if isinstance(value, _Inert):
        return value.cls
    if isinstance(value, tuple):
        return tuple(_real(v) for v in value)
    return value


def serialized_entry(buffer: SharedBuffer, bucket: Bucket) -> str:
    """One rank's ``serialized_named_tensors`` entry: the bucket's tensors as views of the buffer."""
    pairs = [(name, buffer.view(dtype, shape, offset)) for name, dtype, shape, offset in bucket.tensors]
    out = io.BytesIO()
    _Pickler(out).dump(pairs)
    return base64.b64encode(out.getvalue()).decode("ascii")
