"""The front end's token work for sampling fields: prompt truncation and bad words as token ids."""

from __future__ import annotations

import pytest

from siesta.sampling import MAX_NUM_BAD_WORDS
from siesta.tokenizer import bad_words_token_ids, encode, truncate_ids

BOS, EOS = 1, 2


class WordTokenizer:
    """One token per word (ids from 10), BOS before and EOS after with special tokens, as
    Llama-style tokenizers do: the oracle for what left truncation keeps."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [10 + len(word) for word in text.split()]
        return [BOS, *ids, EOS] if add_special_tokens else ids


def test_left_truncation_keeps_the_special_tokens():
    # "a bb ccc dddd" -> BOS 11 12 13 14 EOS; 4 tokens leave room for the last 2 words.
    assert encode(WordTokenizer(), "a bb ccc dddd", truncate_to=4) == [BOS, 13, 14, EOS]
    assert encode(WordTokenizer(), "a bb", truncate_to=4) == [BOS, 11, 12, EOS]  # fits: untouched
    assert encode(WordTokenizer(), "a bb ccc dddd") == [BOS, 11, 12, 13, 14, EOS]


def test_truncation_without_special_tokens_keeps_the_last_tokens(embedded_tokenizer):
    text = "The quick brown fox jumps over the lazy dog"
    ids = embedded_tokenizer.encode(text)
    assert encode(embedded_tokenizer, text, truncate_to=3) == ids[-3:]
    assert truncate_ids(ids, 2) == ids[-2:] and truncate_ids(ids, None) == ids


def test_bad_words_as_vllm_tokenizes_them(embedded_tokenizer):
    tok = embedded_tokenizer

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    # One token either way: the bare and the spaced form are both banned.
    assert bad_words_token_ids(tok, ["Paris"]) == [ids("Paris"), ids(" Paris")]
    assert bad_words_token_ids(tok, [" Paris"]) == [ids("Paris"), ids(" Paris")]  # leading space stripped
    # The spaced form has another number of tokens: vLLM keeps the bare form only.
    assert len(ids("xylophone")) != len(ids(" xylophone"))
    assert bad_words_token_ids(tok, ["xylophone"]) == [ids("xylophone")]


def test_too_many_bad_words_are_refused_by_name(embedded_tokenizer):
    words = [f"w{i}" for i in range(MAX_NUM_BAD_WORDS)]
    with pytest.raises(ValueError, match="^bad_words make more than"):
        bad_words_token_ids(embedded_tokenizer, words)
    with pytest.raises(ValueError, match="^bad_words entries must tokenize"):
        bad_words_token_ids(WordTokenizer(), ["   "])
