"""Request bodies of SGLang's routes, field for field SGLang's.

A field SGLang defines but siesta does not honour is refused by name unless it is off, as
on the OpenAI routes (``siesta.entrypoints.server.protocol``); a field no one defines is
ignored with a warning. Values are range-checked once, by ``SamplingParams``.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from siesta.entrypoints.server.protocol import Float, Int, TokenId
from siesta.entrypoints.server.sglang.top_p import FLAG as TOP_P_FLAG

logger = logging.getLogger(__name__)
# SGLang's default output length (its SamplingParams.max_new_tokens).
DEFAULT_MAX_NEW_TOKENS = 128
# SGLang's: logprobs of output tokens only.
OUTPUT_LOGPROBS_ONLY = -1
_OFF: Any = None

# SGLang's sampling fields siesta does not implement, with the value that means off.
SAMPLING_NOT_IMPLEMENTED: dict[str, Any] = {
    "json_schema": _OFF, "regex": _OFF, "ebnf": _OFF, "structural_tag": _OFF, "stop_regex": _OFF,
    "logit_bias": _OFF,
}  # fmt: skip
# SGLang's request fields siesta does not implement.
GENERATE_NOT_IMPLEMENTED: dict[str, Any] = {
    "input_embeds": _OFF, "image_data": _OFF, "video_data": _OFF, "audio_data": _OFF, "lora_path": _OFF,
    "lora_id": _OFF, "session_params": _OFF, "custom_logit_processor": _OFF, "return_hidden_states": False,
    "token_ids_logprob": _OFF, "bootstrap_host": _OFF, "bootstrap_port": _OFF,
    "bootstrap_room": _OFF, "data_parallel_rank": _OFF, "return_output_logprob_only": False,
    "modalities": _OFF,
}  # fmt: skip
# Fields SGLang defines that change nothing a client can see here.
IGNORED = frozenset({"log_metrics", "no_logs", "stream_interval", "priority", "conversation_id", "label",
                     "background", "request_id", "routed_dp_rank", "http_worker_ipc", "rid"})  # fmt: skip


def _is_off(value: Any, off: Any) -> bool:
    return value is None or value is False or value in ([], {}, "") or value == off


def refuse_unimplemented(extra: dict[str, Any] | None, not_implemented: dict[str, Any], where: str) -> None:
    for name, value in (extra or {}).items():
        if name in not_implemented:
            if not _is_off(value, not_implemented[name]):
                raise ValueError(f"{where}{name} is not supported by siesta yet; leave it out")
        elif name not in IGNORED:
            logger.warning("ignoring the unknown request field %r", f"{where}{name}")


class SGLangSamplingParams(BaseModel):
    """SGLang's ``sampling_params`` object."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _refuse(self) -> SGLangSamplingParams:
        refuse_unimplemented(self.model_extra, SAMPLING_NOT_IMPLEMENTED, "sampling_params.")
        return self

    max_new_tokens: Int | None = DEFAULT_MAX_NEW_TOKENS  # None: up to the context limit
    min_new_tokens: Int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    temperature: Float = 1.0
    top_p: Float = 1.0
    top_k: Int = -1
    min_p: Float = 0.0
    frequency_penalty: Float = 0.0
    presence_penalty: Float = 0.0
    repetition_penalty: Float = 1.0
    n: Int = Field(1, ge=1)
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    no_stop_trim: StrictBool = False  # keep the matched stop string in the text
    sampling_seed: Int | None = None
    # SGLang passes these to a custom logit processor (none runs here, so SGLang ignores them);
    # slime's return_top_p_token_ids is honoured (sglang/top_p.py).
    custom_params: dict[str, Any] | None = None

    @property
    def wants_top_p_sets(self) -> bool:
        return bool((self.custom_params or {}).get(TOP_P_FLAG))


PerPrompt = Any  # a value, or a list of one value per prompt (SGLang's batch form)


class GenerateRequest(BaseModel):
    """SGLang's ``GenerateReqInput``: ``text`` or ``input_ids``, one prompt or a batch."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _check(self) -> GenerateRequest:
        refuse_unimplemented(self.model_extra, GENERATE_NOT_IMPLEMENTED, "")
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        return self

    text: str | list[str] | None = None
    input_ids: Annotated[list[TokenId] | list[list[TokenId]] | None, Field(union_mode="left_to_right")] = None
    sampling_params: SGLangSamplingParams | list[SGLangSamplingParams] | None = None
    rid: str | list[str] | None = None
    stream: StrictBool = False
    return_logprob: StrictBool | list[StrictBool] = False
    logprob_start_len: Int | list[Int] = OUTPUT_LOGPROBS_ONLY
    top_logprobs_num: Int | list[Int] = 0
    return_text_in_logprobs: StrictBool = False
    extra_key: str | None = None  # SGLang's cache namespace: siesta's cache_salt
    # A mixture-of-experts model's routing (the server run with --enable-return-routed-experts):
    # meta_info.routed_experts covers the tokens [routed_experts_start_len, seqlen - 1).
    return_routed_experts: StrictBool = False
    routed_experts_start_len: Int = 0

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)


class AbortRequest(BaseModel):
    rid: str = ""
    abort_all: StrictBool = False


class PauseGenerationRequest(BaseModel):
    # abort: end in-flight requests; retract: freeze them, their KV may be dropped and
    # recomputed; in_place: freeze them with their KV.
    mode: Literal["abort", "retract", "in_place"] = "abort"


MemoryTag = Literal["kv_cache", "weights", "cuda_graph"]


class MemoryOccupationRequest(BaseModel):
    tags: list[MemoryTag] | None = None  # None: everything
    clear_connector_cache: StrictBool = True  # siesta's: false keeps the KV tiers through the release
