"""Placeholder of the tensor-parallel context (the model's sharded layers replace it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None


SINGLE = TensorParallel()
