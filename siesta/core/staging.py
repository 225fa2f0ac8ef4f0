"""Small host<->device copies of a step (its inputs, its sampled tokens) through pinned memory.

A pageable copy is staged by the driver and blocks the host while it does; a pinned
one is an ordinary asynchronous copy, ordered on the compute stream only, and the
sampled tokens' copy back waits for that stream alone, not for tier transfers on
their own streams.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def to_host_list(tensor: torch.Tensor) -> list:
    """``tensor.tolist()``, waiting only for the compute stream's work up to here."""
    if not tensor.is_cuda:
        return tensor.tolist()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()
    return host.tolist()
