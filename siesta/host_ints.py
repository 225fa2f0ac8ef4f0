"""Integer helpers for host code that sizes kernel launches.

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions: called from the host, each
call unwraps its arguments through Triton's JIT machinery (a few microseconds). Attention runs
eagerly between the piecewise graphs of every step with prefill rows, so it sizes its launches
~20 times a layer; these plain versions give the same integers without that toll.
"""

from __future__ import annotations


def cdiv(x: int, y: int) -> int:
    return -(-x // y)


def next_power_of_2(n: int) -> int:
    """The least power of two >= ``n`` (0 for 0), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
