"""Request bodies of the OpenAI routes, with the extra sampling fields vLLM accepts.

The models check types only; value ranges are checked once, by ``SamplingParams``, whose
errors name the field (a 400). Unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, model_validator

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
PromptInput = str | list[str] | list[Int] | list[list[Int]]


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(BaseModel):
    """Fields both routes share: OpenAI's, then vLLM's extras."""

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


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: Int | None = 16
    logprobs: Int | None = None  # top-n alternatives per token


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Int | None = None
    logprobs: bool | None = False
    top_logprobs: Int | None = None
    add_generation_prompt: bool = True


class UpdateWeightsRequest(BaseModel):
    """A checkpoint to load (siesta's), or a weight-transfer call (vLLM's ``update_info``)."""

    model_config = ConfigDict(extra="forbid")
    model_path: str | None = None
    update_info: dict[str, Any] | None = None
    weight_version: str | Int | None = None  # None: the next version

    @model_validator(mode="after")
    def _one_source(self) -> UpdateWeightsRequest:
        if (self.model_path is None) == (self.update_info is None):
            raise ValueError("give exactly one of model_path (a checkpoint) and update_info (a weight transfer)")
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
