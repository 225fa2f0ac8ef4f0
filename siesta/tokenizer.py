"""Text in and out: prompt encoding, chat templates, incremental detokenization, stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from siesta.sampling import MAX_BAD_WORDS_TOTAL_TOKENS, MAX_NUM_BAD_WORDS

# Tokens of prompt context decoded before the first output token, so that
# tokenizers which render a leading space from context (sentencepiece) get it right.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def encode(tokenizer: PreTrainedTokenizerBase, text: str, truncate_to: int | None = None) -> list[int]:
    """The prompt's token ids; with ``truncate_to``, at most that many, the text's last ones."""
    ids = tokenizer.encode(text, add_special_tokens=True)
    if truncate_to is None or len(ids) <= truncate_to:
        return ids
    return _truncate_left(tokenizer, text, ids, truncate_to)


def _truncate_left(tokenizer: PreTrainedTokenizerBase, text: str, ids: list[int], keep: int) -> list[int]:
    """What a tokenizer with ``truncation_side="left"`` (vLLM's) gives for ``max_length=keep``:
    the special tokens it adds (a BOS) stay, and the text's tokens make room for them."""
    plain = tokenizer.encode(text, add_special_tokens=False)
    added = len(ids) - len(plain)
    # Where the text's own tokens sit among the special ones (BOS before, EOS after, ...).
    start = next((i for i in range(added + 1) if ids[i : i + len(plain)] == plain), None) if added > 0 else None
    if start is None:
        return ids[-keep:]
    kept_text = plain[len(plain) - max(keep - added, 0) :]
    return ids[:start] + kept_text + ids[start + len(plain) :]


def truncate_ids(token_ids: Sequence[int], truncate_to: int | None) -> list[int]:
    """A token-id prompt's last ``truncate_to`` tokens (vLLM truncates those as they are)."""
    ids = list(token_ids)
    return ids if truncate_to is None else ids[-truncate_to:]


def bad_words_token_ids(tokenizer: PreTrainedTokenizerBase, words: Sequence[str]) -> list[list[int]]:
    """vLLM's token sequences for ``bad_words``: each word as it stands, and after a space.

    The spaced form (the word in mid-text) counts only where the space changes the first
    token and not the number of tokens, as vLLM has it; a word of no tokens is an error.
    """
    sequences: list[list[int]] = []
    total = 0
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            raise ValueError(f"bad_words entries must tokenize to at least one token, got {word!r}")
        sequences.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
        # Checked as they grow, so that a long list stops early.
        if len(sequences) > MAX_NUM_BAD_WORDS:
            raise ValueError(f"bad_words make more than {MAX_NUM_BAD_WORDS} token sequences; shorten the list")
        total += len(bare) + (len(spaced) if sequences[-1] is spaced else 0)
        if total > MAX_BAD_WORDS_TOTAL_TOKENS:
            raise ValueError(f"bad_words make more than {MAX_BAD_WORDS_TOTAL_TOKENS} tokens; shorten the words")
    return sequences


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
