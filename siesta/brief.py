"""Bounded text of untrusted values: what an error message may quote of a caller's input.

``repr`` of a value built by a pickle or a JSON body is not bounded by the input's size: a
706-byte pickle of nested lists that share one list (pickle's memo) repr'd to 322 MB, and
every level multiplied it by ten. ``brief`` quotes at most a few levels, items and characters
of anything; ``bounded`` cuts a whole message, the last guard before it leaves the process.
"""

from __future__ import annotations

import reprlib

MAX_QUOTE_CHARS = 200
MAX_MESSAGE_CHARS = 4096
_CUT = "... ({} more characters)"

_repr = reprlib.Repr()
_repr.maxlevel = 3
_repr.maxlist = _repr.maxtuple = _repr.maxset = _repr.maxfrozenset = _repr.maxdeque = 6
_repr.maxdict = 6
_repr.maxstring = _repr.maxother = 160  # a path in full, as a caller wrote it
_repr.maxlong = 40


def brief(value: object, limit: int = MAX_QUOTE_CHARS) -> str:
    """A repr of ``value`` of at most about ``limit`` characters, whatever it holds."""
    try:
        text = _repr.repr(value)
    except Exception:  # noqa: BLE001 - a value whose own repr raises is still described
        text = f"<{type(value).__name__}>"
    return bounded(text, limit)


def bounded(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``message`` cut to ``limit`` characters, saying how much was left out."""
    if len(message) <= limit:
        return message
    return message[:limit] + _CUT.format(len(message) - limit)
