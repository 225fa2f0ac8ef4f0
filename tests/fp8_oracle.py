"""The fp8 KV cache's quantization, computed independently of siesta's code: the oracle of the
write paths (tests/attention) and of whole engines (tests/core), in float64.

The quotient ``x / scale`` is taken as fp32 makes it (what every backend divides in), saturated
to the format's largest value, then rounded to the nearest value of the format's grid, ties to
even (``torch.round``). The grids are written out from the formats' definitions here, not read
from ``siesta.attention.kv_quant``.
"""

from __future__ import annotations

import torch

# (mantissa bits, smallest normal exponent, largest value).
# e4m3fn: 4 exponent bits biased by 7, no infinities, its top mantissa code is NaN: 1.75 * 2**8.
# e5m2: 5 exponent bits biased by 15, IEEE-like: 1.75 * 2**15.
GRIDS = {torch.float8_e4m3fn: (3, 1 - 7, 1.75 * 2**8), torch.float8_e5m2: (2, 1 - 15, 1.75 * 2**15)}


def oracle_quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The fp8 values (in the format's units, float64) that ``x`` under ``scale`` must store."""
    mantissa_bits, min_exponent, largest = GRIDS[dtype]
    scale32 = torch.tensor(scale, dtype=torch.float32).double()
    quotient = (x.double() / scale32).float().double()  # the fp32 division, correctly rounded
    magnitude = quotient.abs().clamp(max=largest)
    _, exponent = torch.frexp(magnitude)  # magnitude = m * 2**exponent, m in [0.5, 1)
    spacing = torch.pow(2.0, ((exponent - 1).clamp(min=min_exponent) - mantissa_bits).double())
    return torch.copysign(torch.round(magnitude / spacing) * spacing, quotient)


def oracle_dequantized(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What a read of ``x`` written under ``scale`` gives back, in float64."""
    return oracle_quantize(x, scale, dtype) * torch.tensor(scale, dtype=torch.float32).double()
