"""Prompts of a request body as token ids, checked against the vocabulary before they travel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from siesta.entrypoints.server.errors import APIError
from siesta.entrypoints.server.limits import PromptLimit
from siesta.entrypoints.server.protocol import MAX_PROMPTS, ChatMessage, PromptInput
from siesta.tokenizer import chat_to_ids, encode, truncate_ids

_BAD_REQUEST = 400
_TEXT_PART = "text"


@dataclass
class TokenizedPrompt:
    text: str | None
    token_ids: list[int]


def prompt_count(prompt: PromptInput) -> int:
    return len(_as_list(prompt))


def completion_prompts(
    tokenizer: PreTrainedTokenizerBase | None,
    prompt: PromptInput,
    vocab_size: int,
    limit: PromptLimit,
    truncate_to: int | None = None,
) -> list[TokenizedPrompt]:
    """A string, strings, token ids or lists of token ids -> one TokenizedPrompt each; with
    ``truncate_to`` (truncate_prompt_tokens) only each prompt's last tokens.

    Slow for long texts: the routes run it in a worker thread. A prompt that cannot fit is
    refused before it is tokenized, unless it is to be truncated."""
    items = _as_list(prompt)
    if not items:
        raise APIError(_BAD_REQUEST, "prompt must not be empty", "prompt")
    if len(items) > MAX_PROMPTS:
        raise APIError(_BAD_REQUEST, f"prompt holds {len(items)} prompts; at most {MAX_PROMPTS} per request", "prompt")
    if truncate_to is None:
        for item in items:
            (limit.check_text if isinstance(item, str) else limit.check_ids)(len(item), "prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(TokenizedPrompt(item, _encode(tokenizer, item, truncate_to)))
        else:
            out.append(TokenizedPrompt(None, truncate_ids(_check_ids(item, vocab_size), truncate_to)))
        if truncate_to is not None:
            limit.check_ids(len(out[-1].token_ids), "prompt")
    return out


def _as_list(prompt: PromptInput) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    # The body's validation settled which member of PromptInput this is: its first item says,
    # where looking at every item ran 2M isinstance calls on the event loop for a long prompt.
    if prompt and isinstance(prompt[0], int):
        return [prompt]  # one prompt of token ids
    return list(prompt)


def _encode(tokenizer: PreTrainedTokenizerBase | None, text: str, truncate_to: int | None) -> list[int]:
    if tokenizer is None:
        raise APIError(_BAD_REQUEST, "this model has no tokenizer: send the prompt as token ids", "prompt")
    try:
        return encode(tokenizer, text, truncate_to)
    except Exception as e:  # noqa: BLE001 - tokenizers raise many types on odd text (lone surrogates, ...)
        raise APIError(_BAD_REQUEST, f"cannot tokenize the prompt: {e}", "prompt") from None


def _check_ids(ids: list[int], vocab_size: int) -> list[int]:
    if not ids or (0 <= min(ids) and max(ids) < vocab_size):  # min/max in C: a long prompt costs ~10 ms
        return list(ids)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(_BAD_REQUEST, f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})", "prompt")
    return list(ids)


def chat_prompt(
    tokenizer: PreTrainedTokenizerBase | None,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    truncate_to: int | None = None,
) -> TokenizedPrompt:
    """The conversation through the chat template; with ``truncate_to`` its last tokens only."""
    if tokenizer is None:
        raise APIError(_BAD_REQUEST, "this model has no tokenizer, so it has no chat template: use /v1/completions")
    conversation = [_message_dict(m) for m in messages]
    try:
        ids = chat_to_ids(tokenizer, conversation, add_generation_prompt)
    except Exception as e:  # noqa: BLE001 - a template may reject a conversation with any error type
        raise APIError(_BAD_REQUEST, f"cannot apply the chat template: {e}", "messages") from None
    return TokenizedPrompt(None, truncate_ids(ids, truncate_to))


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": _content_text(message.content)}
    if message.name is not None:
        out["name"] = message.name
    return out


def _content_text(content: str | list | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.type != _TEXT_PART or part.text is None:
            raise APIError(_BAD_REQUEST, f"only text content parts are supported, got {part.type!r}", "messages")
        parts.append(part.text)
    return "\n".join(parts)
