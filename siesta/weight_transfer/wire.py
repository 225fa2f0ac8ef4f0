"""The weight-transfer wire format: what a trainer declares, checked before a byte moves.

It is vLLM's, so a trainer written for vLLM's ``nccl`` and ``ipc`` engines drives siesta
unchanged (DESIGN.md, "Weight transfer", spells it out for other frameworks):

- init info (nccl): ``master_address``, ``master_port``, ``rank_offset``, ``world_size``;
- update info: ``names``, ``dtype_names``, ``shapes`` (one entry per tensor, in send order),
  ``packed`` with ``packed_buffer_size_bytes`` / ``packed_num_buffers``, and for ipc
  ``ipc_handles`` (or ``ipc_handles_pickled``) with ``tensor_sizes`` when packed.

A packed transfer concatenates the tensors' bytes in order and cuts a bucket as soon as its
size exceeds ``packed_buffer_size_bytes`` (the tensor that crosses the line closes it), so
both sides derive the same buckets from the declared shapes and dtypes alone.
"""

from __future__ import annotations

import io
import math
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from siesta.brief import brief
from siesta.config import WeightTransferConfig

# The dtypes a weight may travel in; the engine casts each into its parameter's dtype.
WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
MAX_PORT = 65535
# Ranks of a trainer-engine group: the trainer and every engine rank, a few thousand at most.
# Bounded because gloo sets up every peer before it reaches any (world_size 1e9 never answered).
MAX_WORLD_SIZE = 1 << 12
_UPDATE_KEYS = {
    "names", "dtype_names", "shapes", "packed", "packed_buffer_size_bytes", "packed_num_buffers",
    "ipc_handles", "ipc_handles_pickled", "tensor_sizes",
}  # fmt: skip
_INIT_KEYS = {"master_address", "master_port", "rank_offset", "world_size", "timeout_s"}  # timeout_s: siesta's (joining)


class WeightTransferError(ValueError):
    """An update or init the engine refuses; the message names the offending field or tensor."""


def restricted_load(unpickler: type[pickle.Unpickler], data: bytes, refusal: str) -> Any:
    """A trainer's pickle through ``unpickler`` (whose ``find_class`` allows only what that wire
    format holds). Its own refusals pass through; anything else a torn or foreign pickle raises
    becomes a ``WeightTransferError``: ``refusal`` with ``{error}`` filled in."""
    try:
        return unpickler(io.BytesIO(data)).load()
    except WeightTransferError:
        raise
    except Exception as e:  # noqa: BLE001 - a torn or foreign pickle is the sender's error
        raise WeightTransferError(refusal.format(error=f"{type(e).__name__}: {e}")) from None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, the spelling on the wire."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class NcclInitInfo:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int


@dataclass(frozen=True)
class UpdateInfo:
    tensors: list[TensorMeta]
    packed: bool
    packed_buffer_size_bytes: int
    packed_num_buffers: int
    # ipc only: one handle per tensor, or (packed) one handle of the whole bucket.
    ipc_handles: Any = None
    ipc_handles_pickled: str | None = None
    tensor_sizes: list[int] | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def buckets(self) -> list[list[TensorMeta]]:
        """The tensors of each packed bucket, cut as the sender cuts them."""
        return [
            self.tensors[a:b] for a, b in bucket_bounds([t.nbytes for t in self.tensors], self.packed_buffer_size_bytes)
        ]


def bucket_bounds(sizes: list[int], buffer_bytes: int) -> list[tuple[int, int]]:
    """[start, end) tensor indices of each bucket: a bucket ends with the tensor that takes it
    past ``buffer_bytes`` (vLLM's rule; a tensor larger than a bucket travels alone)."""
    bounds: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total > buffer_bytes:
            bounds.append((start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        bounds.append((start, len(sizes)))
    return bounds


def _require_object(what: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise WeightTransferError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _int_field(d: dict[str, Any], key: str, minimum: int, default: int | None = None) -> int:
    value = d.get(key, default)
    if value is None:
        raise WeightTransferError(f"missing {brief(key)}")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise WeightTransferError(f"{brief(key)} must be an integer >= {minimum}, got {brief(value)}")
    return value


def parse_nccl_init(init_info: Any) -> NcclInitInfo:
    d = _require_object("init_info", init_info)
    unknown = sorted(set(d) - _INIT_KEYS)
    if unknown:
        raise WeightTransferError(f"init_info has fields the nccl backend does not take: {unknown}")
    address = d.get("master_address")
    if not isinstance(address, str) or not address:
        raise WeightTransferError(f"'master_address' must be a host name or address, got {brief(address)}")
    port = _int_field(d, "master_port", 1)
    if port > MAX_PORT:
        raise WeightTransferError(f"'master_port' must be at most {MAX_PORT}, got {port}")
    world_size = _int_field(d, "world_size", 2)
    if world_size > MAX_WORLD_SIZE:
        raise WeightTransferError(f"'world_size' must be at most {MAX_WORLD_SIZE}, got {world_size}")
    rank_offset = _int_field(d, "rank_offset", 1)
    return NcclInitInfo(address, port, rank_offset, world_size)


def parse_update_info(update_info: Any, defaults: WeightTransferConfig) -> UpdateInfo:
    """Validate the declared tensors; raises WeightTransferError naming the first problem."""
    d = _require_object("update_info", update_info)
    unknown = sorted(set(d) - _UPDATE_KEYS)
    if unknown:
        raise WeightTransferError(f"update_info has fields siesta does not take: {unknown}")
    names, dtype_names, shapes = d.get("names"), d.get("dtype_names"), d.get("shapes")
    for key, value in (("names", names), ("dtype_names", dtype_names), ("shapes", shapes)):
        if not isinstance(value, list):
            raise WeightTransferError(f"update_info needs {brief(key)} as a list, got {type(value).__name__}")
    if not len(names) == len(dtype_names) == len(shapes):
        raise WeightTransferError(
            f"names, dtype_names and shapes must have one entry per tensor: got {len(names)}, "
            f"{len(dtype_names)} and {len(shapes)}"
        )
    tensors = _LAST_TENSORS.parse(names, dtype_names, shapes)
    packed = d.get("packed", False)
    if not isinstance(packed, bool):
        raise WeightTransferError(f"'packed' must be true or false, got {brief(packed)}")
    sizes = d.get("tensor_sizes")
    if sizes is not None:
        sizes = _tensor_sizes(sizes, tensors)
    return UpdateInfo(
        tensors=tensors,
        packed=packed,
        packed_buffer_size_bytes=_int_field(d, "packed_buffer_size_bytes", 1, defaults.packed_buffer_size_bytes),
        packed_num_buffers=_int_field(d, "packed_num_buffers", 1, defaults.packed_num_buffers),
        ipc_handles=d.get("ipc_handles"),
        ipc_handles_pickled=d.get("ipc_handles_pickled"),
        tensor_sizes=sizes,
    )


class _TensorListMemo:
    """The last declared tensor list, parsed. A trainer declares the same few hundred tensors in
    every push; comparing the lists is far cheaper than checking and building each entry again,
    and the result depends on nothing else."""

    def __init__(self) -> None:
        self._key: tuple[list, list, list] | None = None
        self._tensors: list[TensorMeta] = []

    def parse(self, names: list, dtype_names: list, shapes: list) -> list[TensorMeta]:
        key = self._key
        if key is not None and key[0] == names and key[1] == dtype_names and key[2] == shapes:
            return list(self._tensors)
        tensors = [_tensor_meta(n, dt, sh) for n, dt, sh in zip(names, dtype_names, shapes)]
        seen: set[str] = set()
        for t in tensors:
            if t.name in seen:
                raise WeightTransferError(f"tensor {brief(t.name)} appears twice in one update")
            seen.add(t.name)
        # Copies: the caller's lists may change after this call.
        self._key, self._tensors = (list(names), list(dtype_names), [list(sh) for sh in shapes]), tensors
        return list(tensors)


_LAST_TENSORS = _TensorListMemo()


def _tensor_meta(name: Any, dtype: Any, shape: Any) -> TensorMeta:
    if not isinstance(name, str) or not name:
        raise WeightTransferError(f"tensor names must be non-empty strings, got {brief(name)}")
    if dtype not in WIRE_DTYPES:
        raise WeightTransferError(f"{name}: dtype {brief(dtype)} cannot be a weight; send one of {', '.join(WIRE_DTYPES)}")
    if not isinstance(shape, (list, tuple)) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        raise WeightTransferError(f"{name}: shape must be a list of non-negative integers, got {brief(shape)}")
    return TensorMeta(name, WIRE_DTYPES[dtype], tuple(shape))


def _tensor_sizes(sizes: Any, tensors: list[TensorMeta]) -> list[int]:
    """The sender's byte count per tensor must be what its shape and dtype say."""
    if not isinstance(sizes, list) or len(sizes) != len(tensors):
        count = len(sizes) if isinstance(sizes, list) else type(sizes).__name__
        raise WeightTransferError(f"tensor_sizes must have one entry per tensor ({len(tensors)}), got {count}")
    for t, size in zip(tensors, sizes):
        if size != t.nbytes:
            raise WeightTransferError(
                f"{t.name}: tensor_sizes says {brief(size)} bytes but shape {list(t.shape)} of "
                f"{dtype_name(t.dtype)} is {t.nbytes} bytes: the bucket's sizes do not add up"
            )
    return list(sizes)
