"""The CPU KV cache: an anonymous mapping that commits memory only where KV is written, and
gives it back on sleep. Measured as the process's resident bytes (Linux /proc)."""

from __future__ import annotations

import sys

import pytest
import torch

from siesta.attention.base import KVCache
from siesta.core.device_memory import SleepableMemory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")

MiB = 1 << 20


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_large_cpu_cache_costs_only_what_it_holds_and_sleep_gives_it_back() -> None:
    before = _resident_bytes()
    kv = KVCache.allocate(8192, 4, 16, 8, 64, torch.float32, torch.device("cpu"))  # 2 GiB
    assert kv.tensor.numel() * 4 == 2048 * MiB
    assert _resident_bytes() - before < 64 * MiB, "allocating must not commit the pages"
    assert torch.count_nonzero(kv.tensor[:8]) == 0  # unwritten slots read as zeros
    kv.tensor[:2048].fill_(1.0)  # a quarter of the blocks hold KV
    written = _resident_bytes() - before
    assert 480 * MiB < written < 640 * MiB
    memory = SleepableMemory([torch.zeros(4)], kv, torch.device("cpu"))
    report = memory.release_kv_cache()
    assert report.bytes == 2048 * MiB
    assert _resident_bytes() - before < 64 * MiB, "sleep must return the written pages"
    assert torch.count_nonzero(kv.tensor) == 0
    memory.restore_kv_cache()
    kv.tensor[3].fill_(2.0)  # usable again, at the same address
    assert kv.tensor[3].sum() == 2.0 * kv.tensor[3].numel()
