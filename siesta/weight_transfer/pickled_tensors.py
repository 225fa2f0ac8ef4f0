"""SGLang's serialized tensors (``/update_weights_from_tensor``), opened without running the sender's pickle.

Each entry of ``serialized_named_tensors`` (one per engine rank) is base64 of
``ForkingPickler.dumps(obj)`` (SGLang's ``MultiprocessingSerializer``). The pickle carries no
tensor data, only how to open the sender's memory: CUDA IPC handles, or on the CPU a
shared-memory file by name (torch's ``file_system`` sharing strategy). ``obj`` is a list of
``(name, tensor)`` (``load_format`` None or ``"direct"``), where a tensor may be SGLang's
``LocalSerializedTensor`` (one such pickle per rank), or for ``"flattened_bucket"``
``{"flattened_tensor": bytes as uint8, "metadata": [FlattenedTensorMetadata]}``.

Unpickling runs whatever callables a pickle names, so this unpickler resolves a fixed table of
names and nothing else, each to siesta's own function or an inert value:

- torch's rebuild functions (``rebuild_tensor``, ``rebuild_typed_storage``,
  ``rebuild_storage_filename``, ``rebuild_storage_empty``, ``rebuild_cuda_tensor`` and SGLang's
  ``_rebuild_cuda_tensor_modified``, which names the GPU by UUID): each checks its arguments
  (classes, dtypes, the shared file and torch's manager socket, the tensor's extent inside its
  storage) before torch opens anything (``rebuild_storage_filename``, ``rebuild_cuda_tensor``)
  or a view is made (``Tensor.set_``, which does not bound-check a view against its storage);
- the classes they take (``torch.Tensor``, ``Parameter``, the storage classes) as markers,
  never callable; ``torch.Size``; torch's dtypes;
- SGLang's two dataclasses, by class name under any ``sglang.`` module (they move between
  releases), as plain records of their fields.

Refused by name: anything else, and torch's default CPU strategy (``file_descriptor``), whose
descriptors only reach a child of the sender: the trainer sets
``torch.multiprocessing.set_sharing_strategy("file_system")``.
"""

from __future__ import annotations

import io
import math
import mmap
import os
import pickle
import re
import stat
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from siesta.brief import MAX_QUOTE_CHARS, bounded, brief
from siesta.weight_transfer.handles import CUDA_DEVICE_ARG, CUDA_REBUILD_ARGS, SHM_DIR, HandleOpener, decode_base64
from siesta.weight_transfer.receivers import typed_view
from siesta.weight_transfer.wire import TensorMeta, WeightTransferError

FLATTENED_BUCKET = "flattened_bucket"
LOAD_FORMATS = (None, "direct", FLATTENED_BUCKET)  # "direct": SGLang's name-by-name load, which is siesta's
FIELD = "serialized_named_tensors"
BUCKET_KEYS = {"flattened_tensor", "metadata"}
# torch's file_system strategy: a manager socket in a directory it made, and a file under /dev/shm.
SHM_MANAGER_DIR = "torch-shm-dir-"
SHM_MANAGER_SOCKET = "manager.sock"
SHM_NAME = re.compile(r"/torch_\d+_\d+_\d+")
# torch's refcounted shared mapping keeps its count ahead of the data, one alignment unit
# (TH_ALLOC_ALIGNMENT); the engine maps the file privately and leaves the count alone.
SHM_HEADER_BYTES = 64
SGLANG_PACKAGE = "sglang"
# The names torch's dtypes pickle as (``str(dtype)`` less "torch."); the update itself takes fewer.
DTYPE_NAMES = (
    "float32", "float64", "float16", "bfloat16", "uint8", "int8", "int16", "int32", "int64", "bool",
    "float8_e4m3fn", "float8_e5m2", "complex64", "complex128",
)  # fmt: skip
# Positions in rebuild_cuda_tensor's arguments (torch.multiprocessing.reductions).
_CUDA_TENSOR_CLS, _CUDA_SIZE, _CUDA_STRIDE, _CUDA_OFFSET, _CUDA_STORAGE_CLS, _CUDA_DTYPE = 0, 1, 2, 3, 4, 5
_CUDA_STORAGE_BYTES = 8
FILE_DESCRIPTOR_REFUSAL = (
    "the trainer shared a CPU tensor by file descriptor (torch's default strategy), which only a child of the "
    "trainer can open: call torch.multiprocessing.set_sharing_strategy('file_system') before serializing"
)


# Names refused with the reason, as soon as the pickle names them.
_REFUSED = {
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"): FILE_DESCRIPTOR_REFUSAL,
    ("multiprocessing.resource_sharer", "DupFd"): FILE_DESCRIPTOR_REFUSAL,
}


class _Marker:
    """A class the pickle names, handed to the rebuild functions as an argument; never called."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


TENSOR, PARAMETER = _Marker("torch.Tensor"), _Marker("torch.nn.Parameter")
UNTYPED_STORAGE, TYPED_STORAGE = _Marker("torch.UntypedStorage"), _Marker("torch.TypedStorage")
_STORAGE_CLASSES = {UNTYPED_STORAGE: torch.UntypedStorage, TYPED_STORAGE: torch.TypedStorage}


class _Record:
    """One of SGLang's dataclasses, rebuilt as its fields only (pickle makes it with ``__new__``
    and hands it its ``__dict__``)."""

    FIELDS: ClassVar[frozenset[str]] = frozenset()

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or set(state) != self.FIELDS:
            keys = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise WeightTransferError(f"SGLang's {type(self).__name__} has fields {sorted(self.FIELDS)}, got {keys}")
        self.__dict__.update(state)


class FlattenedTensorMetadata(_Record):
    FIELDS = frozenset({"name", "shape", "dtype", "start_idx", "end_idx", "numel"})


class LocalSerializedTensor(_Record):
    FIELDS = frozenset({"values"})


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise WeightTransferError(f"{what} must be a sequence of integers, got {brief(value)}")
    return tuple(value)


def _check_extent(size: tuple[int, ...], stride: tuple[int, ...], offset: int, storage_elements: int) -> None:
    """The elements a (size, stride, offset) view reads must lie inside its storage."""
    if len(size) != len(stride) or min(size, default=0) < 0 or min(stride, default=0) < 0 or offset < 0:
        raise WeightTransferError(f"a shared tensor's size {size}, stride {stride} and offset {offset} do not fit")
    if math.prod(size) == 0:
        return
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= storage_elements:
        raise WeightTransferError(
            f"a shared tensor reaches element {last} of a storage that holds {storage_elements}: its sizes do not add up"
        )


def _map_shared_file(path: str, size: int) -> torch.UntypedStorage:
    """The trainer's shared file, mapped copy-on-write by its name, without torch's manager.

    torch's own ``rebuild_storage_filename`` connects to the trainer's ``torch_shm_manager`` and
    keeps that connection for the life of this process (libshm caches it), so the manager, and
    the trainer's stdout it holds, outlived the trainer until the engine exited. The file is
    opened read-only and never created: one gone meanwhile is an error, not a new empty file.
    The mapping goes with the last tensor over it; the engine copies out before it answers."""
    if size == 0:
        return torch.UntypedStorage()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise WeightTransferError(f"cannot open the shared tensor {path}: {e.strerror}") from None
    try:
        if os.fstat(fd).st_size < SHM_HEADER_BYTES + size:
            raise WeightTransferError(f"{path} is shorter than the tensor's storage ({size} bytes)")
        mapped = mmap.mmap(fd, SHM_HEADER_BYTES + size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=torch.uint8, offset=SHM_HEADER_BYTES, count=size).untyped_storage()


def _shm_path(handle: Any, size: int) -> str:
    if not isinstance(handle, bytes) or not SHM_NAME.fullmatch(handle.decode("ascii", "replace")):
        raise WeightTransferError(f"a shared CPU tensor names {brief(handle)}, not a file torch shares under {SHM_DIR}")
    path = SHM_DIR + handle.decode()
    try:
        st = os.stat(path)
    except OSError as e:
        raise WeightTransferError(f"cannot open the shared tensor {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode) or st.st_size < SHM_HEADER_BYTES + size:
        raise WeightTransferError(f"{path} holds {st.st_size} bytes, the tensor's storage {size}")
    return path


def _shm_manager(manager: Any) -> None:
    path = manager.decode("utf-8", "replace") if isinstance(manager, bytes) else ""
    parent = os.path.basename(os.path.dirname(path))
    if os.path.basename(path) != SHM_MANAGER_SOCKET or not parent.startswith(SHM_MANAGER_DIR):
        raise WeightTransferError(f"a shared CPU tensor names {brief(manager)}, not torch's shared-memory manager")
    try:
        is_socket = stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        is_socket = False
    if not is_socket:
        raise WeightTransferError(f"torch's shared-memory manager {path} is gone: the trainer must keep running")


@dataclass(frozen=True)
class _TypedBytes:
    """A shared storage and the dtype its tensor reads it as (torch's TypedStorage, undeprecated)."""

    storage: torch.UntypedStorage
    dtype: torch.dtype


class _Rebuilders:
    """The functions the pickle may call, bound to this engine's device."""

    def __init__(self, device: torch.device, opener: HandleOpener) -> None:
        self.device = device
        self.opener = opener

    def storage_from_file(self, cls: Any, manager: Any, handle: Any, size: Any, dtype: Any = None) -> Any:
        if cls is not UNTYPED_STORAGE or dtype is not None or isinstance(size, bool) or not isinstance(size, int):
            raise WeightTransferError("a shared CPU storage must be an untyped storage of a whole number of bytes")
        path = _shm_path(handle, size)
        _shm_manager(manager)
        return _map_shared_file(path, size)

    def empty_storage(self, cls: Any) -> Any:
        if cls is not UNTYPED_STORAGE:
            raise WeightTransferError("an empty shared storage must be an untyped storage")
        return torch.UntypedStorage()

    def typed_storage(self, storage: Any, dtype: Any) -> _TypedBytes:
        if not isinstance(storage, torch.UntypedStorage) or not isinstance(dtype, torch.dtype):
            raise WeightTransferError("a typed storage wraps a shared untyped storage with a torch dtype")
        return _TypedBytes(storage, dtype)

    def cpu_tensor(self, cls: Any, storage: Any, metadata: Any) -> torch.Tensor:
        if cls not in (TENSOR, PARAMETER) or not isinstance(storage, _TypedBytes):
            raise WeightTransferError("a shared CPU tensor is a tensor over a shared storage")
        if not isinstance(metadata, tuple) or len(metadata) != 4:
            raise WeightTransferError("a shared CPU tensor carries (offset, size, stride, requires_grad)")
        offset, size, stride, _ = metadata
        size, stride = _ints(size, "a shared tensor's size"), _ints(stride, "a shared tensor's stride")
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise WeightTransferError(f"a shared tensor's offset must be an integer, got {brief(offset)}")
        _check_extent(size, stride, offset, storage.storage.nbytes() // storage.dtype.itemsize)
        # What torch's rebuild_tensor does, on the untyped storage (its TypedStorage is deprecated).
        return torch.empty(0, dtype=storage.dtype).set_(storage.storage, offset, size, stride)

    def cuda_tensor(self, *args: Any) -> torch.Tensor:
        if self.device.type != "cuda":
            raise WeightTransferError(
                "the trainer shared a CUDA tensor with an engine on the CPU: share CPU tensors "
                "(torch.multiprocessing.set_sharing_strategy('file_system'))"
            )
        if len(args) != CUDA_REBUILD_ARGS:
            raise WeightTransferError(f"a CUDA tensor handle has {CUDA_REBUILD_ARGS} arguments, got {len(args)}")
        args = list(args)
        if args[_CUDA_TENSOR_CLS] not in (TENSOR, PARAMETER) or args[_CUDA_STORAGE_CLS] not in _STORAGE_CLASSES:
            raise WeightTransferError("a CUDA tensor handle names a tensor and a storage class")
        dtype = args[_CUDA_DTYPE]
        if not isinstance(dtype, torch.dtype):
            raise WeightTransferError(f"a CUDA tensor handle's dtype must be a torch dtype, got {brief(dtype)}")
        size, stride = _ints(args[_CUDA_SIZE], "a CUDA tensor's size"), _ints(args[_CUDA_STRIDE], "its stride")
        storage_bytes, offset = args[_CUDA_STORAGE_BYTES], args[_CUDA_OFFSET]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (storage_bytes, offset)):
            raise WeightTransferError("a CUDA tensor handle's offset and storage size must be integers")
        _check_extent(size, stride, offset, storage_bytes // dtype.itemsize)
        index, uuid = self.opener.gpu()
        device = args[CUDA_DEVICE_ARG]
        if device not in (index, uuid):  # torch's index, or the UUID SGLang's patched reduction puts there
            raise WeightTransferError(
                f"the shared CUDA tensor lives on GPU {brief(device)} and this engine on GPU {index} ({uuid}): the trainer "
                "must share from the engine's GPU, naming it by UUID (SGLang's monkey_patch_torch_reductions)"
            )
        args[_CUDA_TENSOR_CLS] = torch.Tensor
        args[_CUDA_STORAGE_CLS] = _STORAGE_CLASSES[args[_CUDA_STORAGE_CLS]]
        return self.opener.open({uuid: args})


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, names: dict[tuple[str, str], Any], sglang: dict[str, Any]) -> None:
        super().__init__(io.BytesIO(data))
        self._names = names
        self._sglang = sglang

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _REFUSED:
            raise WeightTransferError(_REFUSED[module, name])
        found = self._names.get((module, name))
        if found is None and module.split(".")[0] == SGLANG_PACKAGE:
            found = self._sglang.get(name)
        if found is None:
            raise WeightTransferError(f"it names {module}.{name}, which is not part of a shared tensor")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise WeightTransferError("it holds a persistent id, which no shared tensor has")


class SerializedTensors:
    """Decodes one rank's entry of ``serialized_named_tensors`` into ``(name, tensor)`` pairs that
    view the sender's memory (copy them before the sender's call returns)."""

    def __init__(self, device: torch.device) -> None:
        # Nothing kept open between updates: each of SGLang's calls shares fresh buffers.
        self.opener = HandleOpener(device, keep_mappings=False)
        r = _Rebuilders(device, self.opener)
        self._names: dict[tuple[str, str], Any] = {
            ("torch.multiprocessing.reductions", "rebuild_tensor"): r.cpu_tensor,
            ("torch.multiprocessing.reductions", "rebuild_typed_storage"): r.typed_storage,
            ("torch.multiprocessing.reductions", "rebuild_storage_filename"): r.storage_from_file,
            ("torch.multiprocessing.reductions", "rebuild_storage_empty"): r.empty_storage,
            ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): r.cuda_tensor,
            ("torch", "Tensor"): TENSOR,
            ("torch._tensor", "Tensor"): TENSOR,
            ("torch.nn.parameter", "Parameter"): PARAMETER,
            ("torch.storage", "UntypedStorage"): UNTYPED_STORAGE,
            ("torch", "UntypedStorage"): UNTYPED_STORAGE,
            ("torch.storage", "TypedStorage"): TYPED_STORAGE,
            ("torch", "Size"): torch.Size,
            **{("torch", name): getattr(torch, name) for name in DTYPE_NAMES},
        }
        self._sglang: dict[str, Any] = {
            "_rebuild_cuda_tensor_modified": r.cuda_tensor,
            "FlattenedTensorMetadata": FlattenedTensorMetadata,
            "LocalSerializedTensor": LocalSerializedTensor,
        }

    def decode(self, payload: Any, load_format: str | None, rank: int = 0) -> list[tuple[str, torch.Tensor]]:
        if load_format not in LOAD_FORMATS:
            raise WeightTransferError(
                f"load_format {brief(load_format)} is not one siesta reads; it takes None, 'direct' or 'flattened_bucket'"
            )
        obj = self._load(payload, f"{FIELD}[{rank}]")
        if load_format == FLATTENED_BUCKET:
            return _unflatten(obj)
        return [(name, self._per_rank(t, rank)) for name, t in _named_pairs(obj)]

    def _load(self, payload: Any, field: str) -> Any:
        data = payload if isinstance(payload, bytes) else decode_base64(payload, field)
        try:
            return _TensorUnpickler(data, self._names, self._sglang).load()
        except WeightTransferError as e:
            raise WeightTransferError(f"{field}: {e}") from None
        except Exception as e:  # noqa: BLE001 - a malformed pickle is the sender's error
            raise WeightTransferError(f"{field} does not decode: {type(e).__name__}: {bounded(str(e), MAX_QUOTE_CHARS)}") from None

    def _per_rank(self, value: Any, rank: int) -> torch.Tensor:
        if isinstance(value, LocalSerializedTensor):  # one more pickle per rank inside: this rank's
            values = value.values
            if not isinstance(values, list) or not rank < len(values) or not isinstance(values[rank], bytes):
                raise WeightTransferError(f"a LocalSerializedTensor holds no serialized tensor for rank {rank}")
            value = self._load(values[rank], f"{FIELD}: LocalSerializedTensor.values[{rank}]")
        if not isinstance(value, torch.Tensor):
            raise WeightTransferError(f"{FIELD} pairs a name with {type(value).__name__}, not a tensor")
        return value

    def close(self) -> None:
        self.opener.close()


def _named_pairs(obj: Any) -> list[tuple[str, Any]]:
    if not isinstance(obj, (list, tuple)):
        raise WeightTransferError(
            f"{FIELD} holds {type(obj).__name__}: load_format None takes a list of (name, tensor)"
        )
    pairs = []
    for item in obj:
        if not isinstance(item, (list, tuple)) or len(item) != 2 or not isinstance(item[0], str):
            raise WeightTransferError(f"{FIELD} must list (name, tensor) pairs, got {type(item).__name__}")
        pairs.append((item[0], item[1]))
    return pairs


def _unflatten(obj: Any) -> list[tuple[str, torch.Tensor]]:
    """SGLang's flattened bucket: entry i is ``flat[start_idx:end_idx]`` (bytes of a uint8 bucket,
    or elements of a bucket of the entries' own dtype) as its dtype and shape."""
    if not isinstance(obj, dict) or set(obj) != BUCKET_KEYS:
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise WeightTransferError(f"a flattened bucket has keys {sorted(BUCKET_KEYS)}, got {keys}")
    flat, metadata = obj["flattened_tensor"], obj["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not isinstance(metadata, list):
        raise WeightTransferError("a flattened bucket is a 1-D tensor and a list of FlattenedTensorMetadata")
    named: list[tuple[str, torch.Tensor]] = []
    for entry in metadata:
        if not isinstance(entry, FlattenedTensorMetadata):
            raise WeightTransferError(f"a flattened bucket's metadata holds {type(entry).__name__}")
        named.append((entry.name, _bucket_entry(flat, entry)))
    return named


def _bucket_entry(flat: torch.Tensor, entry: FlattenedTensorMetadata) -> torch.Tensor:
    name, dtype = entry.name, entry.dtype
    shape = _ints(entry.shape, f"{brief(name)}'s shape")
    start, end = entry.start_idx, entry.end_idx
    if not isinstance(name, str) or not isinstance(dtype, torch.dtype):
        raise WeightTransferError(f"a flattened bucket's entry needs a name and a torch dtype, got {brief(name)}, {brief(dtype)}")
    bounds_are_ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end))
    if not bounds_are_ints or not 0 <= start <= end <= len(flat):
        raise WeightTransferError(f"{name}: [{brief(start)}, {brief(end)}) is not inside the bucket's {len(flat)} elements")
    raw = flat[start:end]
    meta = TensorMeta(name, dtype, shape)
    if raw.dtype == dtype and raw.numel() == math.prod(shape):
        return raw.view(shape)
    if raw.dtype == torch.uint8 and raw.numel() == meta.nbytes:
        return typed_view(raw, meta)
    raise WeightTransferError(
        f"{name}: {end - start} elements of {raw.dtype} in the bucket, but shape {list(shape)} of {dtype} is declared"
    )
