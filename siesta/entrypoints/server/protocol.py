"""Request bodies of the OpenAI routes, with the extra sampling fields vLLM accepts.

The models check types only; value ranges are checked once, by ``SamplingParams``, whose
errors name the field (a 400). A field of OpenAI's or vLLM's that siesta does not implement
is refused by name unless it is off (null, false, empty, or its default), so a client never
silently gets less than it asked for; a field no one defines is ignored with a warning.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, model_validator

# One HTTP request fans out into prompts x n engine requests; this bounds the fan-out.
MAX_CHOICES = 128
MAX_PROMPTS = 1024


def _not_a_bool(value: Any) -> Any:
    # JSON's true is not 1: a number field given a boolean is refused, not read as 1.
    if isinstance(value, bool):
        raise ValueError(f"a number is expected, not the boolean {str(value).lower()}")
    return value


Int = Annotated[int, BeforeValidator(_not_a_bool)]
Float = Annotated[float, BeforeValidator(_not_a_bool)]
# A prompt's token id: a true int passes pydantic's own strict check, in Rust, before any Python
# runs (a 14 MB body of token ids called _not_a_bool 2M times on the event loop: 1.2 s of
# validation while /health stalled); anything else (a bool, "5", 5.0) takes Int's path.
TokenId = Annotated[StrictInt | Int, Field(union_mode="left_to_right")]
# Tried in this order, the first that fits wins: token ids (the RL case) are checked once, not
# once per member of the union as pydantic's smart mode does.
PromptInput = Annotated[str | list[TokenId] | list[list[TokenId]] | list[str], Field(union_mode="left_to_right")]


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


# OpenAI's and vLLM's fields siesta does not implement (yet), with the value that means off.
_OFF: Any = None
NOT_IMPLEMENTED: dict[str, Any] = {
    "best_of": 1, "suffix": _OFF,
    "response_format": {"type": "text"}, "tools": _OFF, "tool_choice": "none",
    "parallel_tool_calls": _OFF, "functions": _OFF, "function_call": _OFF, "guided_json": _OFF,
    "guided_regex": _OFF, "guided_choice": _OFF, "guided_grammar": _OFF, "structured_outputs": _OFF,
    "use_beam_search": False, "length_penalty": 1.0, "priority": 0, "kv_transfer_params": _OFF, "vllm_xargs": _OFF, "audio": _OFF,
    "modalities": _OFF, "prediction": _OFF, "reasoning_effort": _OFF, "chat_template": _OFF,
    "chat_template_kwargs": _OFF, "continue_final_message": False, "documents": _OFF, "mm_processor_kwargs": _OFF,
    "web_search_options": _OFF, "top_logprobs_num": _OFF, "return_logprob": False,
}  # fmt: skip
# Chat's echo (the last message's content before the reply) is not completions' echo.
CHAT_NOT_IMPLEMENTED: dict[str, Any] = NOT_IMPLEMENTED | {"echo": False}
logger = logging.getLogger(__name__)


def _is_off(value: Any, off: Any) -> bool:
    return value is None or value is False or value in ([], {}, "") or value == off


class SamplingFields(BaseModel):
    """Fields both routes share: OpenAI's, then vLLM's extras."""

    model_config = ConfigDict(extra="allow")  # looked at, then refused or ignored: below
    not_implemented: ClassVar[dict[str, Any]] = NOT_IMPLEMENTED

    @model_validator(mode="after")
    def _refuse_what_siesta_does_not_do(self) -> SamplingFields:
        for name, value in (self.model_extra or {}).items():
            if name in self.not_implemented:
                if not _is_off(value, self.not_implemented[name]):
                    raise ValueError(f"{name} is not supported by siesta yet; leave it out")
            else:
                logger.warning("ignoring the unknown request field %r", name)
        return self

    model: str | None = None  # None: the served model
    n: Int = Field(1, ge=1, le=MAX_CHOICES)
    temperature: Float | None = None
    top_p: Float | None = None
    seed: Int | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    min_tokens: Int = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    cache_salt: str | None = None
    # vLLM's: the prompt's token ids and the generated ones beside the text (streamed: each
    # chunk's ids, the prompt's in a choice's first chunk).
    return_token_ids: bool = False
    # vLLM's: logprob tokens as "token_id:<id>" (text that does not round-trip is no use to RL).
    return_tokens_as_token_ids: bool = False
    # vLLM's: each prompt token's logprob, rank and top-n alternatives (not in streams).
    prompt_logprobs: Int | None = None
    # OpenAI's: token id (a JSON key, so a string) -> bias, clamped to [-100, 100] as vLLM does.
    logit_bias: dict[str, Float] | None = None
    # vLLM's: only these tokens may be sampled; words never completed; keep the prompt's last k
    # tokens (-1: max_model_len).
    allowed_token_ids: list[Int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: Int | None = None


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: Int | None = 16  # 0 only with echo: the prompt and nothing generated
    logprobs: Int | None = None  # top-n alternatives per token
    echo: bool | None = False  # the prompt before the completion (and its tokens' logprobs first)


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    not_implemented: ClassVar[dict[str, Any]] = CHAT_NOT_IMPLEMENTED
    messages: list[ChatMessage]
    max_tokens: Int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Int | None = None
    logprobs: bool | None = False
    top_logprobs: Int | None = None
    add_generation_prompt: bool = True


class UpdateWeightsRequest(BaseModel):
    """A checkpoint to load (siesta's), a weight-transfer call (vLLM's ``update_info``), or
    prime-rl's ``weight_dir`` (its trainer's shards, or its broadcast: ``primerl_routes``)."""

    model_config = ConfigDict(extra="forbid")
    model_path: str | None = None
    update_info: dict[str, Any] | None = None
    weight_dir: str | None = None
    weight_version: str | Int | None = None  # None: the next version

    @model_validator(mode="after")
    def _one_source(self) -> UpdateWeightsRequest:
        if sum(v is not None for v in (self.model_path, self.update_info, self.weight_dir)) != 1:
            raise ValueError("give exactly one of model_path (a checkpoint), update_info (a weight transfer) and "
                             "weight_dir (prime-rl's)")  # fmt: skip
        return self


class InitWeightTransferRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    init_info: dict[str, Any]


class StartWeightUpdateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    is_checkpoint_format: StrictBool = True


class FinishWeightUpdateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weight_version: str | Int | None = None  # None: the next version, if the update wrote anything


class AbortRequestsRequest(BaseModel):
    request_ids: list[str]
