"""Pause and sleep as a state machine: where the engine stands, and how a call may move it.

Generating -> pausing (a ``wait`` pause drains the requests in flight) -> paused -> asleep (at a
level, with what it released) -> awake and paused -> generating (``resume``). The engine core
(``core/engine_core.py``) runs the effects of each move: aborting, dropping caches, releasing
memory (``core/sleep_memory.py``), queueing what was held (``core/admission.py``).

A pause while paused or asleep is never refused: trainers send one from several places, and
retry loops turn a refusal into a crash. It never restarts generation: its mode moves only up
``wait`` < ``keep`` < ``abort`` (``abort`` ends what a ``keep`` froze or a ``wait`` drains), and
the caches it asks to drop are dropped (SGLang's ``retract`` after ``in_place`` lets the frozen
requests' KV go). DESIGN.md, SGLang's routes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from siesta.control import PAUSE_MODES, SLEEP_LEVELS, WAKE_TAGS

WAIT = "wait"
ABORT = "abort"
# A second pause moves only up this order: it may end more, never restart generation.
PAUSE_STRENGTH = {"wait": 0, "keep": 1, "abort": 2}


def check_pause_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")


def check_sleep_level(level: int) -> None:
    if level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, got {level!r}")


def check_tags(tags: list[str] | None, call: str) -> list[str]:
    """The memory kinds a sleep releases or a wake-up restores; None: both."""
    tags = list(WAKE_TAGS) if tags is None else list(tags)
    unknown = sorted(set(tags) - set(WAKE_TAGS))
    if unknown:
        raise ValueError(f"unknown {call} tags {unknown}: expected any of {', '.join(WAKE_TAGS)}")
    if call == "sleep" and "kv_cache" not in tags:
        # The weights cannot leave while the KV cache stays: a wake-up restores weights first.
        raise ValueError(f"sleep tags {tags} must include kv_cache: the KV cache is released with anything")
    return tags


@dataclass
class PauseState:
    mode: str | None = None  # set while paused or pausing
    done: bool = False  # the pause took effect (a wait pause first drains)
    resets: tuple[bool, bool] = (False, False)  # (prefix cache, connector) to clear once paused
    sleep_level: int | None = None
    releases: list[str] = field(default_factory=lambda: list(WAKE_TAGS))  # what this sleep releases (level >= 1)

    @property
    def holding(self) -> bool:
        """Paused or pausing: requests added now wait for resume."""
        return self.mode is not None

    @property
    def paused(self) -> bool:
        return self.mode is not None and self.done

    @property
    def sleeping(self) -> bool:
        return self.sleep_level is not None

    @property
    def draining(self) -> bool:
        """A wait pause whose requests in flight have not all finished."""
        return self.mode == WAIT and not self.done

    @property
    def allows_scheduling(self) -> bool:
        # Unpaused, or draining in-flight requests for a pause (or sleep) in wait mode.
        return self.mode is None or self.draining

    def begin(self, mode: str, clear_cache: bool, clear_connector_cache: bool) -> None:
        self.mode, self.done = mode, False
        self.resets = (clear_cache, clear_connector_cache)

    def strengthen(self, mode: str) -> bool:
        """A pause while paused: the stronger mode of the two; whether it moved."""
        if PAUSE_STRENGTH[mode] > PAUSE_STRENGTH[self.mode]:
            self.mode = mode
            return True
        return False

    def add_resets(self, clear_cache: bool, clear_connector_cache: bool) -> None:
        """A pause still draining drops, once paused, every cache any of its calls asked to."""
        held_cache, held_connector = self.resets
        self.resets = (held_cache or clear_cache, held_connector or clear_connector_cache)

    def fall_asleep(self, level: int, releases: list[str]) -> None:
        self.sleep_level, self.releases = level, releases

    def wake(self) -> None:
        self.sleep_level = None

    def end(self) -> None:
        """Resumed: generating again."""
        self.mode, self.done = None, False
