"""Joining a trainer's group on a thread of its own, so the engine steps meanwhile.

A rendezvous waits on the trainer: for its store to answer, for every rank to count itself in,
for gloo's mesh. A trainer that is late, at the wrong port or gone made the engine-core loop
wait for the whole timeout (254 s for a port nobody listens on, a concurrent stream froze). So
the receiver of the new group is built here, off the loop, and handed to the updater only
once it is up (``WeightUpdater.finish_join``); until then nothing of the engine's changes: the
old group of that name, if any, serves on.

A join is bounded by the caller's ``timeout_s`` (a field of the init info, siesta's own) or
``WeightTransferConfig.join_timeout_s`` (30 s): long enough for a trainer that starts its side
at the same time, short enough that a wrong address answers within a minute.
"""

from __future__ import annotations

import threading
from typing import Any

from siesta.brief import brief
from siesta.weight_transfer.receivers import NcclReceiver
from siesta.weight_transfer.wire import WeightTransferError

TIMEOUT_KEY = "timeout_s"
MAX_JOIN_TIMEOUT_S = 3600.0
# The finish waits this much past the join's own bound for the thread (a rank whose rendezvous
# is in its last retry when rank 0's already ended).
FINISH_GRACE_S = 5.0


def join_timeout(init_info: Any, default_s: float) -> tuple[Any, float]:
    """(the init info without siesta's ``timeout_s``, the join's timeout)."""
    if not isinstance(init_info, dict) or TIMEOUT_KEY not in init_info:
        return init_info, default_s
    rest = {k: v for k, v in init_info.items() if k != TIMEOUT_KEY}
    value = init_info[TIMEOUT_KEY]
    if value is None:
        return rest, default_s
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_JOIN_TIMEOUT_S:
        raise WeightTransferError(f"'{TIMEOUT_KEY}' must be seconds in (0, {MAX_JOIN_TIMEOUT_S:g}], got {brief(value)}")
    return rest, float(value)


class PendingJoin:
    """One receiver's rendezvous, running on its own thread."""

    def __init__(self, receiver: NcclReceiver, init_info: Any, timeout_s: float) -> None:
        self.receiver = receiver
        self.timeout_s = timeout_s
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(init_info,), name="siesta-join", daemon=True)
        self._thread.start()

    def _run(self, init_info: Any) -> None:
        try:
            self.receiver.init(init_info, self.timeout_s)
        except BaseException as e:  # noqa: BLE001 - handed to whoever finishes the join
            self.error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> NcclReceiver:
        """The joined receiver, once the thread ended (bounded); raises the join's error."""
        self._thread.join(self.timeout_s + FINISH_GRACE_S)
        if self._thread.is_alive():
            raise WeightTransferError(f"the rendezvous did not end within {self.timeout_s:.0f}s")
        if self.error is not None:
            raise self.error
        return self.receiver
