"""Deterministic English-like prompts of chosen token lengths, for parity tests."""

from __future__ import annotations

import random

_SENTENCES = [
    "The river rose overnight and the bridge keepers walked the banks with lanterns.",
    "A good scheduler keeps every core busy without letting one request starve.",
    "She wrote the letter twice, once in ink and once in pencil, and sent neither.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "The committee postponed its vote until the engineers could measure the load.",
    "In the old harbour the fishing boats were painted blue, red and yellow.",
    "Prime numbers thin out as they grow, yet there is always another one.",
    "The recipe calls for two eggs, a cup of flour and a pinch of salt.",
    "Mountain weather changes quickly, so climbers carry layers and start early.",
    "The library moved its rare maps to a cooler room with steady humidity.",
    "Every compiler pass must keep the meaning of the program it rewrites.",
    "The orchestra tuned to the oboe before the conductor raised the baton.",
]


def english_text(seed: int, approx_words: int) -> str:
    rng = random.Random(seed)
    words: list[str] = []
    while len(words) < approx_words:
        words.extend(rng.choice(_SENTENCES).split())
    return " ".join(words[:approx_words])


def chat_prompt_ids(tokenizer, seed: int, num_tokens: int) -> list[int]:
    """A user turn asking about a text, cut so the whole chat prompt is ``num_tokens`` long."""
    text = english_text(seed, num_tokens)
    messages = [{"role": "user", "content": f"Summarise this text in your own words: {text}"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    if len(ids) <= num_tokens:
        return ids
    # Keep the chat framing: trim the middle of the user text, keep the assistant header at the end.
    tail = 8
    return ids[: num_tokens - tail] + ids[-tail:]
