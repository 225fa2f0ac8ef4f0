"""What the engine calls its weights, and what its cached KV is keyed by.

Two names, kept apart on purpose:

- ``name``, the weight version outputs report (vLLM's and SGLang's string: "0", "1", "step-7").
  Callers pick it, renames change it, and a process starting again counts from its start
  value: a name says which weights served a request in this process, nothing more.
- ``key``, what every cache key carries (``ExtraKeys``) and every tier entry is filed under.
  It names the weights themselves, never a counter: the checkpoint the engine loaded is
  ``SOURCE_KEY`` (with the model fingerprint beside it in every key, so a restart on the same
  files finds its disk tier again), and every write of weights gets a key never used before
  by any process (``fresh_key``: 128 random bits). So a restarted engine that pushes its "1"
  cannot meet the KV an earlier process computed under its "1", and a reload of the source
  (a wake-up after a level-2 sleep with no push) reaches only KV the source computed.

The engine cannot tell whether written weights equal the ones they replace without reading
every byte (a digest of an 8B model's 16 GB costs more than its IPC push, 16.5 ms on the
H200), so any write is new weights; naming the current version keeps the name, not the KV.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field

SOURCE_KEY = "source"
# Version strings become labels, log lines and JSON fields: bounded like any other input.
MAX_VERSION_CHARS = 256
_COUNTED = re.compile(r"^(.*\+)?(\d+)$")  # "7" or "step+7": a base and a count
_SUFFIX = "+"


class VersionError(ValueError):
    """A weight version string that cannot be used (empty, too long, not text)."""


def check_version(version: object) -> str:
    """``version`` as a string, or VersionError naming what is wrong with it."""
    if isinstance(version, bool) or not isinstance(version, (str, int)):
        raise VersionError(f"a weight version is a string, got {type(version).__name__}")
    text = str(version)
    if not text:
        raise VersionError("a weight version must not be empty")
    if len(text) > MAX_VERSION_CHARS:
        raise VersionError(f"a weight version has at most {MAX_VERSION_CHARS} characters, got {len(text)}")
    if not text.isprintable():
        raise VersionError("a weight version must be printable text (no control characters)")
    return text


def fresh_key() -> str:
    """A key no process has used: KV computed under it came from the weights just written."""
    return f"w-{uuid.uuid4().hex}"


def _split(name: str) -> tuple[str, int | None]:
    match = _COUNTED.match(name)
    if match is None:
        return name + _SUFFIX, None
    return match.group(1) or "", int(match.group(2))


@dataclass
class WeightVersions:
    name: str  # what outputs report
    key: str  # what cached KV is filed under
    source_name: str  # the name the loaded checkpoint was served under at start
    # The highest count given out per base ("" for plain integers), so that an automatic name
    # never repeats in this process, even after a reload went back to the source's name.
    _highest: dict[str, int] = field(default_factory=dict)

    @classmethod
    def at_start(cls, name: str) -> WeightVersions:
        versions = cls(check_version(name), SOURCE_KEY, check_version(name))
        versions._count(versions.name)
        return versions

    def next_name(self) -> str:
        """The name of the next weights when the caller names none: "3" after "2" (and after
        every number used so far), "step+1" after "step", "step+2" after "step+1"."""
        base, count = _split(self.name)
        n = max(count or 0, self._highest.get(base, 0)) + 1
        return check_version(f"{base}{n}")

    def wrote(self, name: str | None) -> str:
        """New weights were written: a fresh key, and ``name`` (else the next name)."""
        name = self.next_name() if name is None else check_version(name)
        self.key = fresh_key()
        self.rename(name)
        return name

    def reloaded_source(self) -> None:
        """The checkpoint the engine started from is back: its key and its name."""
        self.key = SOURCE_KEY
        self.rename(self.source_name)

    def rename(self, name: str) -> None:
        self.name = check_version(name)
        self._count(self.name)

    def _count(self, name: str) -> None:
        base, count = _split(name)
        if count is not None:
            self._highest[base] = max(count, self._highest.get(base, 0))
