"""Weight transfer from a trainer process: vLLM's API (init, start, update, finish) over an
NCCL/gloo group or IPC handles, checked before any byte moves (``wire``), written in place
(``updater``), fail-closed (``state``); ``sender`` is the trainer's side."""

from siesta.weight_transfer.sender import WeightSender
from siesta.weight_transfer.wire import WeightTransferError

__all__ = ["WeightSender", "WeightTransferError"]
