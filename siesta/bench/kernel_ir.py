"""The compiled Triton IR of the kernels a bench launched, written out to be read off the card.

A kernel's speed on Hopper turns on what Triton made of it: whether a ``tl.dot`` became a wgmma
(``versionMajor = 3``) or mma.sync (``versionMajor = 2``), whether its operands were staged through
shared memory by async copies, and what shared memory the launch needs. Two of this project's
regressions were decided by that and could only be inferred from timings (runs 51g-52a: fp8 tiles
widened straight to bf16 ran 12-27 % slower on wgmma tiles only). ``dump`` writes each compiled
variant's TTGIR to one text file with a header of its launch metadata and those markers counted,
and returns the headers, so a run's JSON says what ran and the file can be read afterwards.

Under Triton's interpreter (the CPU) nothing is compiled: ``dump`` writes and returns nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

# What to count in a variant's TTGIR: the MMA each dot became, and how tiles reach shared memory.
MARKERS = {
    "wgmma_dots": "ttng.warp_group_dot ",
    "mma_v3_layouts": "versionMajor = 3",
    "mma_v2_layouts": "versionMajor = 2",
    "shared_allocs": "ttg.local_alloc",
    "async_copies": "ttg.async_copy_global_to_local",
    "fp_casts": "tt.fp_to_fp",
}
_METADATA = ("name", "num_warps", "num_stages", "shared")


def compiled_variants(fn: Any) -> Iterator[Any]:
    """The compiled kernels a ``triton.jit`` function holds, on every device (none when
    interpreted)."""
    for entry in getattr(fn, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        yield from cache.values()


def describe(kernel: Any) -> dict[str, Any]:
    """A compiled variant's launch metadata and its TTGIR's markers counted."""
    ttgir = _ttgir(kernel)
    meta = {key: getattr(kernel.metadata, key, None) for key in _METADATA}
    return meta | {name: ttgir.count(text) for name, text in MARKERS.items()}


def dump(fns: Mapping[str, Any], path: str | Path | None) -> list[dict[str, Any]]:
    """Every compiled variant of ``fns`` (label -> jit function): its header, and with ``path``
    its TTGIR after the header in that file."""
    rows: list[dict[str, Any]] = []
    chunks: list[str] = []
    for label, fn in fns.items():
        for kernel in compiled_variants(fn):
            row = {"kernel": label} | describe(kernel)
            rows.append(row)
            chunks.append(f"=== {row}\n{_ttgir(kernel)}\n")
    if path is not None and chunks:
        Path(path).write_text("".join(chunks))
    return rows


def _ttgir(kernel: Any) -> str:
    return str(kernel.asm.get("ttgir", ""))
