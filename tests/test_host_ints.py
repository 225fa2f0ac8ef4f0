"""``siesta.host_ints`` gives Triton's integers: the launch sizes do not change with it."""

from __future__ import annotations

import triton

from siesta.host_ints import cdiv, next_power_of_2


def test_the_same_integers_as_tritons_helpers() -> None:
    for n in list(range(0, 4100)) + [19_500, 32_768, 32_769, 2**31 - 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 128, 256):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
