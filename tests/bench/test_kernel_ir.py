"""kernel_ir reads what a jit function compiled: counted from a stand-in of Triton's compiled
kernel (the CPU compiles none), and nothing from an interpreted function."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


def test_the_shipped_attention_tiles_as_a_hopper_card_compiles_them() -> None:
    """Compiled here for sm_90 (Triton's own LLVM and ptxas; in a subprocess, as the suite runs
    Triton's interpreter): every attention tile the engine ships fits the shared memory a Hopper
    block may have, and the split-KV decode on three stages keeps the next K/V tile in flight
    (two buffers, a wait that leaves copies outstanding), which it did not while each step read
    its own block-table entries."""
    import triton
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not os.access(ptxas, os.X_OK):
        pytest.skip(f"this Triton ships no ptxas for this machine ({ptxas})")
    done = subprocess.run([sys.executable, "-m", "siesta.bench.kernel_ir", "--json", "-"], capture_output=True,
                          text=True, timeout=900, env=os.environ | {"TRITON_INTERPRET": "0"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(done.stdout.splitlines()[-1])}
    kinds = ("decode", "invariant_decode", "crowded_invariant_decode", "prefill_split", "unified")
    assert set(rows) == {f"{k}_{c}" for k in kinds for c in ("bf16", "fp8")} | {
        f"{k}_{c}" for k in ("decode", "prefill_split", "unified") for c in ("fp32", "fp8_fp32")}
    for name, row in rows.items():
        assert 0 < row["shared"] <= kernel_ir.HOPPER_SHARED_BYTES, name
    assert rows["decode_fp8"]["num_stages"] == 3
    assert rows["decode_fp8"]["tile_buffers"] == 2 and rows["decode_fp8"]["in_flight_waits"] >= 1
    assert rows["decode_bf16"]["tile_buffers"] == 1 and rows["decode_bf16"]["in_flight_waits"] == 0
    assert rows["decode_fp8"]["mma_v2_layouts"] and rows["prefill_split_bf16"]["wgmma_dots"]


def test_compile_for_refuses_an_interpreted_function() -> None:
    from siesta.attention import triton_kernels

    if hasattr(triton_kernels.decode_split_kernel, "cache_key"):
        pytest.skip("compiled Triton: this test is for the interpreter (TRITON_INTERPRET=1)")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=0"):
        kernel_ir.compile_for(triton_kernels.decode_split_kernel, {}, {}, num_warps=4, num_stages=2)
