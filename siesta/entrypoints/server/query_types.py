"""Typed query parameters of the control routes.

A boolean takes exactly true/false/True/False/1/0. Anything else (FastAPI alone would also
take yes/no/on/off) is a 422 whose message names the parameter and what it takes, so a typo
can never silently pick the default, say a cleared tier.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator

from siesta.control import SLEEP_LEVELS, PauseMode, WakeTag

__all__ = ["MAX_SLEEP_LEVEL", "MIN_SLEEP_LEVEL", "PauseMode", "QueryBool", "WakeTag", "parse_bool"]

TRUE_VALUES = ("true", "True", "1")
FALSE_VALUES = ("false", "False", "0")
ACCEPTED = ("true", "false", "True", "False", "1", "0")
MIN_SLEEP_LEVEL, MAX_SLEEP_LEVEL = min(SLEEP_LEVELS), max(SLEEP_LEVELS)


def parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if value in TRUE_VALUES:
        return True
    if value in FALSE_VALUES:
        return False
    raise ValueError(f"expected one of {', '.join(ACCEPTED)}, got {value!r}")


QueryBool = Annotated[bool, BeforeValidator(parse_bool)]
