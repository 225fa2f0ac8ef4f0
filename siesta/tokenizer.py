"""Text in and out: prompt encoding, chat templates, incremental detokenization, stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

# Tokens of prompt context decoded before the first output token, so that
# tokenizers which render a leading space from context (sentencepiece) get it right.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=True)


def chat_to_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    **template_kwargs: Any,
) -> list[int]:
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; pass chat_template= or use a completion prompt")
    out = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        tokenize=True,
        **template_kwargs,
    )
    # transformers 5 returns a BatchEncoding; 4.x a plain list.
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return list(ids)


class IncrementalDetokenizer:
    """Turns output tokens into text deltas without re-decoding the whole output each time.

    Decodes a short sliding window of tokens; a delta is released only once it no
    longer ends in a partial UTF-8 character.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.kwargs = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:
            self.kwargs["spaces_between_special_tokens"] = False

    def push(self, token_ids: Sequence[int]) -> str:
        self.ids.extend(token_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], **self.kwargs)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], **self.kwargs)
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]


def find_stop(text: str, new_chars: int, stops: Sequence[str], include: bool) -> tuple[str, str] | None:
    """First stop string that ends within the last ``new_chars`` characters of ``text``.

    Returns (text cut at the stop, the stop string), or None.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        # A match may start before the new characters but must end inside them.
        start = max(0, len(text) - new_chars - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    if best is None:
        return None
    idx, stop = best
    return (text[: idx + len(stop)] if include else text[:idx]), stop
