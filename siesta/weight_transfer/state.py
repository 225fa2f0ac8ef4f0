"""Whether the engine's weights are whole, and the weight update in progress.

The engine generates only from whole weights of one version. They stop being whole when a
level-2 sleep releases them, or when an update fails after writing part of what it declared
(a trainer that died mid-transfer): the parameters it had not written yet must be written
(the same update again, or any complete one) or reloaded before the engine generates again.
While an update is open (``start_weight_update`` .. ``finish_weight_update``) the engine does
not step at all, so no KV is computed, let alone stored, under half-new weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LEVEL2_RELEASE = "a level-2 sleep released the weights"
# How torn weights become whole again; every refusal they cause says it.
REPAIR = "send the missing tensors again (update_weights) or load a checkpoint (update_weights(model_path))"
EXAMPLES = 3


@dataclass
class WeightState:
    expected: frozenset[str]  # every parameter key a complete update writes
    missing: set[str] = field(default_factory=set)  # keys to write before the weights are whole
    reason: str | None = None  # why they are missing
    open: bool = False  # an update is in progress
    written: set[str] = field(default_factory=set)  # keys written by the open update

    @property
    def whole(self) -> bool:
        return not self.missing

    @property
    def torn(self) -> bool:
        """Part old, part new: an update broke off (not a level-2 release waiting to be refilled)."""
        return bool(self.missing) and self.reason != LEVEL2_RELEASE

    @property
    def blocks_generation(self) -> bool:
        return self.open or not self.whole

    def start(self) -> None:
        if not self.open:
            self.open, self.written = True, set()

    def wrote(self, keys: set[str]) -> None:
        self.missing -= keys
        if self.open:
            self.written |= keys
        if not self.missing:
            self.reason = None

    def failed(self, reason: str, unwritten: set[str]) -> None:
        """An update broke off: ``unwritten`` (what it declared and did not write) must come."""
        self.missing |= unwritten
        self.reason = reason

    def released(self) -> None:
        self.missing, self.reason = set(self.expected), LEVEL2_RELEASE

    @property
    def only_released(self) -> bool:
        """Released at level 2 and not one tensor written since: a reload from the source fixes it."""
        return self.reason == LEVEL2_RELEASE and self.missing == self.expected

    def close(self) -> None:
        self.open, self.written = False, set()

    def describe(self) -> str:
        examples = ", ".join(sorted(self.missing)[:EXAMPLES])
        return f"{self.reason}: {len(self.missing)} of {len(self.expected)} weight tensors are not written (e.g. {examples})"
