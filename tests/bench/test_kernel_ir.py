"""kernel_ir reads what a jit function compiled: counted from a stand-in of Triton's compiled
kernel (the CPU compiles none), and nothing from an interpreted function."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from siesta.bench import kernel_ir

TTGIR = """
#mma = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 1], instrShape = [16, 128, 16]}>
%a = ttg.local_alloc %x : (tensor<64x128xbf16>) -> !ttg.memdesc<64x128xbf16>
%t = ttg.async_copy_global_to_local %p, %a : tensor<64x128x!tt.ptr<f8E4M3FN>> -> <64x128xf8E4M3FN>
%w = tt.fp_to_fp %k : tensor<64x128xf8E4M3FN> -> tensor<64x128xf32>
%d = ttng.warp_group_dot %a, %b, %c : !ttg.memdesc<64x128xbf16> * !ttg.memdesc<128x128xbf16> -> tensor<64x128xf32, #mma>
%e = ttng.warp_group_dot %a, %b, %d : !ttg.memdesc<64x128xbf16> * !ttg.memdesc<128x128xbf16> -> tensor<64x128xf32, #mma>
"""


def _kernel(ttgir: str, name: str = "decode_split_kernel") -> SimpleNamespace:
    meta = SimpleNamespace(name=name, num_warps=4, num_stages=1, shared=81920)
    return SimpleNamespace(asm={"ttgir": ttgir}, metadata=meta)


def test_the_markers_and_metadata_of_each_variant_on_every_device(tmp_path: Path) -> None:
    # Triton keeps (kernel cache, ...) per device; older versions the cache alone.
    fn = SimpleNamespace(device_caches={0: ({"a": _kernel(TTGIR)}, "target", "backend"), 1: {"b": _kernel("")}})
    rows = kernel_ir.dump({"decode": fn}, tmp_path / "ir.txt")
    assert rows[0] == {"kernel": "decode", "name": "decode_split_kernel", "num_warps": 4, "num_stages": 1,
                       "shared": 81920, "wgmma_dots": 2, "mma_v3_layouts": 1, "mma_v2_layouts": 0, "shared_allocs": 1,
                       "async_copies": 1, "fp_casts": 1}  # fmt: skip
    assert rows[1]["wgmma_dots"] == 0 and len(rows) == 2
    text = (tmp_path / "ir.txt").read_text()
    assert text.count("=== ") == 2 and "ttng.warp_group_dot" in text


def test_an_interpreted_function_compiled_nothing_and_writes_no_file(tmp_path: Path) -> None:
    from siesta.attention import triton_kernels

    if hasattr(triton_kernels.decode_split_kernel, "device_caches"):
        pytest.skip("compiled Triton: this test is for the interpreter (TRITON_INTERPRET=1)")
    assert kernel_ir.dump({"decode": triton_kernels.decode_split_kernel}, tmp_path / "ir.txt") == []
    assert not (tmp_path / "ir.txt").exists()
