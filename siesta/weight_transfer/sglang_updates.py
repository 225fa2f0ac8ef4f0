"""SGLang's update bodies in siesta's wire terms (``wire.UpdateInfo``), so one updater checks and writes all of them.

``/update_weights_from_distributed`` declares ``names``, ``dtypes`` and ``shapes``. With
``load_format`` None the trainer broadcasts each tensor as declared, in order: siesta's
unpacked update. With ``"flattened_bucket"`` it broadcasts one uint8 tensor holding every
tensor's bytes in order with nothing between them (SGLang's ``FlattenedTensorBucket``, whose
metadata is not sent: both sides cut it from the declaration): siesta's packed update with a
single bucket as large as the whole. ``/update_weights_from_tensor`` hands over tensors already
opened (``pickled_tensors``): their own names, dtypes and shapes are the declaration.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from siesta.brief import brief
from siesta.weight_transfer.wire import WIRE_DTYPES, WeightTransferError, dtype_name

FLATTENED_BUCKET = "flattened_bucket"
DISTRIBUTED_LOAD_FORMATS = (None, FLATTENED_BUCKET)
_DTYPE_PREFIX = "torch."  # a trainer that sends str(dtype) as is


def distributed_update_info(names: Any, dtypes: Any, shapes: Any, load_format: str | None) -> dict[str, Any]:
    """The update_info of a ``/update_weights_from_distributed`` body (checked by ``parse_update_info``)."""
    if load_format not in DISTRIBUTED_LOAD_FORMATS:
        raise WeightTransferError(
            f"load_format {brief(load_format)} is not one siesta reads from a group: it takes None or 'flattened_bucket'"
        )
    if not isinstance(names, list) or not names:
        raise WeightTransferError("names must list at least one tensor")
    if not isinstance(dtypes, list) or not all(isinstance(d, str) for d in dtypes):
        raise WeightTransferError(f"dtypes must be a list of dtype names, got {brief(dtypes)}")
    info: dict[str, Any] = {
        "names": names,
        "dtype_names": [d.removeprefix(_DTYPE_PREFIX) for d in dtypes],
        "shapes": shapes,
    }
    if load_format == FLATTENED_BUCKET:
        info["packed"] = True
        info["packed_buffer_size_bytes"] = _declared_bytes(info)  # one bucket: the tensor past it closes none
    return info


def _declared_bytes(info: dict[str, Any]) -> int:
    """The bytes the declared tensors take (those parse_update_info will refuse count nothing)."""
    shapes = info["shapes"] if isinstance(info["shapes"], list) else []
    total = 0
    for dtype, shape in zip(info["dtype_names"], shapes):
        if dtype in WIRE_DTYPES and isinstance(shape, list) and all(isinstance(s, int) for s in shape):
            total += math.prod(shape) * WIRE_DTYPES[dtype].itemsize
    return max(total, 1)


def tensor_update_info(named: list[tuple[str, torch.Tensor]]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The update_info that declares tensors already at hand, and the tensors in its order."""
    if not named:
        raise WeightTransferError("serialized_named_tensors holds no tensor")
    info = {
        "names": [name for name, _ in named],
        "dtype_names": [dtype_name(t.dtype) for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
    }
    return info, [t for _, t in named]
