"""A checkpoint a caller names for an update (``update_weights_from_disk``, ``update_weights(path)``).

Two checks before the first tensor is read:

- The path resolves to a model siesta loads, or the call is refused with one message whatever
  the path is: a caller on the network learns nothing of the engine's file system (the detail,
  "does not exist" or "has no config.json", goes to the server's log, for its operator).
- Its config gives every weight the served model's shape. Reading first and refusing on the
  first shape that differs cost ``random:llama-3-8b`` 2.15 GB and 10.7 s of a stalled engine.
"""

from __future__ import annotations

import logging
from typing import Any

from siesta.brief import brief
from siesta.model.llama import DecoderShape
from siesta.model.loader import ModelSource, accepted_models, resolve_model
from siesta.model.registry import shape_of
from siesta.weight_transfer.wire import WeightTransferError

logger = logging.getLogger(__name__)


def update_source(model_path: Any, served: DecoderShape) -> ModelSource:
    """The checkpoint at ``model_path``, checked to fit the served model; else WeightTransferError."""
    if not isinstance(model_path, str) or not model_path:
        raise WeightTransferError(f"model_path must be a path or random:<shape>, got {brief(model_path)}")
    try:
        source = resolve_model(model_path)
        shape = shape_of(source.hf_config)  # its family's numbers: a mixture of experts' too
    except Exception as e:  # noqa: BLE001 - any reason reads the same to the caller
        logger.warning("update from %r refused: %s", model_path, e)
        raise WeightTransferError(
            f"model_path {brief(model_path)} is not a model siesta can load here; {accepted_models()}"
        ) from None
    # The served family's fields: a checkpoint of another family lacks some (None: they differ).
    differ = [f"{name} {getattr(shape, name, None)} (served: {getattr(served, name)})"
              for name in served.weight_shape_fields
              if getattr(shape, name, None) != getattr(served, name)]  # fmt: skip
    if differ:
        raise WeightTransferError(
            f"model_path {brief(model_path)} holds another architecture than the served model: {'; '.join(differ)}; "
            "nothing was read or written"
        )
    return source
