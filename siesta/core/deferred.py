"""A control call whose answer comes later, while the engine goes on stepping.

Joining a trainer's group waits on the trainer (``weight_transfer/joining.py``). The engine
core starts it and hands back a ``Deferred``; the engine-core loop keeps stepping, asks
``done()`` each turn and answers the call with ``finish()`` (its result, or its error) once
it is. In process (the offline ``LLM``) ``wait()`` does the same in place.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

POLL_S = 0.005


@dataclass
class Deferred:
    done: Callable[[], bool]
    finish: Callable[[], Any]  # the call's result, or raises its error; once, after done()

    def wait(self) -> Any:
        while not self.done():
            time.sleep(POLL_S)
        return self.finish()
