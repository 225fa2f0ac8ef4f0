"""Request bodies of SGLang's weight routes: SGLang's field names, types and defaults.

As in ``sglang.protocol``: a field SGLang defines that siesta cannot honour is refused by name
unless it is off (its default); a field nobody defines is ignored with a warning. SGLang's
``rid``, which every SGLang request may carry, is accepted and unused. Fields that siesta
honours by doing nothing are documented where they are declared.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from siesta.entrypoints.server.protocol import Int
from siesta.entrypoints.server.sglang.protocol import refuse_unimplemented
from siesta.weight_transfer.sglang_group import DEFAULT_BACKEND, DEFAULT_GROUP_NAME

DISK_LOAD_FORMATS = (None, "auto")  # siesta reads what the path holds (safetensors directory, GGUF)
Version = str | Int


def _version(value: Any) -> str | None:
    return None if value is None else str(value)


class SglangBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    # SGLang's fields siesta cannot honour, with the value that means off.
    NOT_HONOURED: ClassVar[dict[str, Any]] = {}

    @model_validator(mode="after")
    def _refuse_what_siesta_cannot_honour(self) -> SglangBody:
        refuse_unimplemented(self.model_extra, self.NOT_HONOURED, "")
        return self


class InitWeightsUpdateGroupRequest(SglangBody):
    master_address: str
    master_port: Int
    rank_offset: Int
    world_size: Int
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = DEFAULT_BACKEND
    timeout_s: float | None = None  # siesta's: how long the join waits for the trainer (default 30 s)


class DestroyWeightsUpdateGroupRequest(SglangBody):
    group_name: str = DEFAULT_GROUP_NAME


class OneCallFields(SglangBody):
    """What every update route shares."""

    weight_version: Version | None = None  # None: the engine's next version
    abort_all_requests: bool = False
    flush_cache: bool = True
    # Honoured: after the update, CUDA's caching allocator gives back what it holds unused.
    torch_empty_cache: bool = False

    @field_validator("weight_version", mode="after")
    @classmethod
    def _as_text(cls, value: Any) -> str | None:
        return _version(value)


class UpdateWeightsFromDistributedRequest(OneCallFields):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[Int]]
    group_name: str = DEFAULT_GROUP_NAME
    load_format: str | None = None  # None: one broadcast per tensor; "flattened_bucket": one for all


class UpdateWeightsFromTensorRequest(OneCallFields):
    serialized_named_tensors: list[str]  # base64, one per engine rank
    load_format: str | None = None  # None or "direct": (name, tensor) pairs; "flattened_bucket"
    # Honoured: siesta runs no draft model, so there is none to update or to leave alone.
    disable_draft_model: bool | None = None


class UpdateWeightsFromDiskRequest(OneCallFields):
    NOT_HONOURED = {"is_async": False, "keep_pause": False, "token_step": 0, "manifest": None}
    model_path: str
    load_format: str | None = None
    # Honoured: the weights are written in place, so captured graphs read the new ones already.
    recapture_cuda_graph: bool = False

    @field_validator("load_format")
    @classmethod
    def _readable(cls, value: str | None) -> str | None:
        if value not in DISK_LOAD_FORMATS:
            raise ValueError(f"load_format {value!r} is not supported by siesta; it reads the path as it is ('auto')")
        return value


class UpdateWeightVersionRequest(SglangBody):
    new_version: Version
    abort_all_requests: bool = True  # SGLang's default

    @field_validator("new_version", mode="after")
    @classmethod
    def _as_text(cls, value: Any) -> str:
        return str(value)
