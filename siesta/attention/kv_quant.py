"""What the paged KV cache's bytes mean: its element dtype and, for fp8, the per-layer scales.

``--kv-cache-dtype`` (vLLM's and SGLang's names): ``auto`` stores K/V in the model's dtype (the
bytes are the values); ``fp8`` / ``fp8_e4m3`` store ``torch.float8_e4m3fn`` and ``fp8_e5m2``
``torch.float8_e5m2``, with one K scale and one V scale per layer (per tensor, fp32). A write
stores ``round_to_nearest_even(clamp(x / scale, -max, max))``; a read gives ``x.float() * scale``,
then the compute dtype. Every backend quantizes and dequantizes with exactly these operations, so
a block written by one reads the same through any other, and a prompt chunk attends to the very
values decode will read back (``DESIGN.md``, "fp8 KV cache").

A block's bytes mean something only under the scales that wrote them: ``format_key`` names the
dtype and a digest of the scales, and every cache key carries it (``siesta.kv.hashing.ExtraKeys``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

AUTO = "auto"
# The names --kv-cache-dtype takes, and the element dtype each stores (None: the model's own).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    AUTO: None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
DEFAULT_SCALE = 1.0  # vLLM's and SGLang's scale when the checkpoint ships none
_SCALE_DIGEST_BYTES = 8


@dataclass(frozen=True)
class Fp8Grid:
    """The values an fp8 format holds, for rounding by hand where a conversion cannot be trusted
    (Triton's interpreter rounds fp32 -> fp8 wrongly: 495 -> 256 in e5m2, subnormals to 0)."""

    mantissa_bits: int
    min_exponent: int  # of the normal numbers; below it the spacing stays 2**(min_exponent - mantissa_bits)
    max_value: float  # the largest finite value: what saturation clamps to


FP8_GRIDS: dict[torch.dtype, Fp8Grid] = {
    torch.float8_e4m3fn: Fp8Grid(mantissa_bits=3, min_exponent=-6, max_value=448.0),
    torch.float8_e5m2: Fp8Grid(mantissa_bits=2, min_exponent=-14, max_value=57344.0),
}


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` holds scaled fp8 values rather than the values themselves."""
    return dtype in FP8_GRIDS


def check_kv_cache_dtype(name: str) -> None:
    """ValueError naming what is accepted, for a name that is not."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={name!r} is not supported: use one of {', '.join(KV_CACHE_DTYPES)} "
                         "(auto: the model's dtype; fp8 is fp8_e4m3)")  # fmt: skip


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element dtype of a cache asked for by ``name`` in an engine computing in ``model_dtype``."""
    check_kv_cache_dtype(name)
    return KV_CACHE_DTYPES[name] or model_dtype


@dataclass(frozen=True)
class KVScales:
    """One K and one V scale (fp32) per layer, and where they came from."""

    k: tuple[float, ...]
    v: tuple[float, ...]
    origin: str = "default"  # "default" (1.0) or "checkpoint"

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v):
            raise ValueError(f"{len(self.k)} K scales but {len(self.v)} V scales")
        bad = [s for s in (*self.k, *self.v) if not (s > 0 and s < float("inf"))]
        if bad:
            raise ValueError(f"KV cache scales must be positive and finite, got {bad[:3]}")

    @classmethod
    def default(cls, num_layers: int) -> KVScales:
        return cls((DEFAULT_SCALE,) * num_layers, (DEFAULT_SCALE,) * num_layers)

    @classmethod
    def of(cls, k: Sequence[float], v: Sequence[float], origin: str) -> KVScales:
        """Scales as fp32 rounds them: the value every backend multiplies and divides by."""
        return cls(tuple(_fp32(s) for s in k), tuple(_fp32(s) for s in v), origin)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def layer(self, layer_idx: int) -> tuple[float, float]:
        return self.k[layer_idx], self.v[layer_idx]

    def digest(self) -> str:
        """The scales' identity: their fp32 bytes, hashed."""
        packed = struct.pack(f"<{2 * self.num_layers}f", *self.k, *self.v)
        return hashlib.blake2b(packed, digest_size=_SCALE_DIGEST_BYTES).hexdigest()


def _fp32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", float(value)))[0]


def format_key(dtype: torch.dtype, scales: KVScales | None) -> str:
    """What a block's bytes mean, for cache keys: the element dtype, and for fp8 the scales."""
    name = str(dtype).removeprefix("torch.")
    if not is_quantized(dtype):
        return name
    if scales is None:
        raise ValueError(f"a {name} KV cache needs its scales")
    return f"{name}:{scales.digest()}"


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in fp32, saturated to the format's largest value, rounded to nearest (even)."""
    limit = FP8_GRIDS[dtype].max_value
    # A tensor divisor, not a Python number: on CUDA torch multiplies by a scalar's reciprocal,
    # which rounds differently from the division the Triton write kernel makes (div_rn).
    divisor = torch.full((), scale, dtype=torch.float32, device=x.device)
    return torch.div(x.float(), divisor).clamp_(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The values fp8 ``x`` stands for under ``scale``: ``x.float() * scale``, then ``dtype``."""
    return (x.float() * scale).to(dtype)
