"""Arrival counts: the last of a group of programs to finish does the group's closing work, in the
same launch, where a second kernel would otherwise read what they wrote.

Each program of a group stores its part, then ``arrive``s on the group's counter: a barrier
(every thread's stores issued) and one atomic add with acquire-release semantics at gpu scope,
which publishes the program's stores and returns how many arrived before it. The program that
reads ``group size - 1`` is the last: it reads the others' parts from L2 (``.cg``; this SM's L1
may hold an earlier launch's lines of the same scratch), closes the group in a fixed order (the
same bits as a separate kernel with that order), and sets the counter back to zero, so every
launch leaves the counters as it found them.

The counters are one zeroed int32 buffer a device (``counters``), shared by every user: launches
on the engine's stream never overlap (a programmatic dependent launch here only waits), and each
leaves them zero. Users: the split decode's merge (``attention/triton_attention.py``,
``FUSE_DECODE_MERGE``), the experts' down-and-sum over a token's k experts
(``model/triton_moe.py``, ``DOWN_SUM_SPLIT``) and one token's router (``model/triton_router.py``,
``FUSE_ONE_ROW``).
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)

# Counters a device holds: a launch with more groups than this closes them by a separate kernel.
SLOTS = 1 << 16

_counters: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device, groups: int) -> torch.Tensor | None:
    """The device's zeroed counters for a launch of ``groups`` groups, or None (close them apart):
    too many groups, or a CUDA graph being captured before any eager launch made them (memory
    from the graph's pool would not stay zeroed between replays; the graphs' eager warm-up makes
    them first)."""
    if groups > SLOTS:
        return None
    found = _counters.get(device)
    if found is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            logger.warning("a graph captured before any eager launch made the arrival counters: closed apart")
            return None
        found = _counters[device] = torch.zeros(SLOTS, dtype=torch.int32, device=device)
    return found


@triton.jit
def arrive(counter_ptr):
    """Count this program in on ``counter_ptr`` once its stores are issued; how many came before."""
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")


@triton.jit
def reset(counter_ptr):
    """The last program, its closing work done: the counter back at zero for the next launch."""
    tl.store(counter_ptr, 0)
