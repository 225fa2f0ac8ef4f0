"""The compiled Triton IR of the kernels a bench launched, written out to be read off the card.

A kernel's speed on Hopper turns on what Triton made of it: whether a ``tl.dot`` became a wgmma
(``versionMajor = 3``) or mma.sync (``versionMajor = 2``), whether its operands were staged through
shared memory by async copies, and what shared memory the launch needs. Two of this project's
regressions were decided by that and could only be inferred from timings (runs 51g-52a: fp8 tiles
widened straight to bf16 ran 12-27 % slower on wgmma tiles only). ``dump`` writes each compiled
variant's TTGIR to one text file with a header of its launch metadata and those markers counted,
and returns the headers, so a run's JSON says what ran and the file can be read afterwards.

Under Triton's interpreter (the CPU) nothing is compiled: ``dump`` writes and returns nothing.

``compile_for`` compiles a kernel for a card's architecture on any machine, GPU or not (Triton
carries its own LLVM and ptxas), so the TTGIR a card would run can be read here. Run as a module
it compiles the attention kernels on the tiles the engine ships, for Hopper, and prints each
variant's shared memory (against the 227 KiB a block may have), how many K/V buffers its key
loop's copies got, and how many waits leave copies in flight over the products (0: each tile's
copy is awaited as soon as it is issued, so nothing overlaps within a program)::

    TRITON_INTERPRET=0 python -m siesta.bench.kernel_ir [--arch 90] [--head-dim 128] [--json PATH]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
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


# Shared memory one block may opt into on Hopper (H100, H200): 227 KiB.
HOPPER_SHARED_BYTES = 232_448
# A K/V tile's shared buffers in TTGIR: ``memdesc<NxROWSxCOLSxDTYPE`` (N copies in flight).
_TILE_BUFFERS = re.compile(r"memdesc<(\d+)x\d+x\d+x(?:bf16|f16|f32|f8E4M3FN|f8E5M2)")


def compile_for(fn: Any, arg_types: Mapping[str, str], constexprs: Mapping[str, Any], *, num_warps: int,
                num_stages: int, arch: int = 90, aligned: tuple[str, ...] = ()) -> Any:  # fmt: skip
    """Compile jit function ``fn`` for NVIDIA compute capability ``arch``; no GPU needed.

    ``arg_types`` holds Triton's type of every runtime argument (``"*bf16"``, ``"i32"``, ...);
    ``aligned`` names those a launch would specialize as 16-divisible (pointers, strides)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not hasattr(fn, "cache_key"):
        raise RuntimeError("an interpreted function compiles nothing: run with TRITON_INTERPRET=0")
    params = inspect.signature(fn.fn).parameters
    consts = dict(constexprs)
    for name, param in params.items():  # constexprs left at their defaults
        if name not in consts and name not in arg_types and param.default is not inspect.Parameter.empty:
            consts[name] = param.default
    signature = {name: "constexpr" if name in consts else arg_types[name] for name in params}
    names = list(params)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn, signature, constexprs=consts, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})  # fmt: skip


# An async wait that leaves N >= 1 copy groups outstanding: loads kept in flight over the products.
_WAIT_IN_FLIGHT = re.compile(r"ttg\.async_wait[^\n]*\{num = [1-9]")


def tile_buffers(ttgir: str) -> int:
    """The most copies of one tile any shared buffer holds (0: no multi-copy buffer)."""
    return max((int(n) for n in _TILE_BUFFERS.findall(ttgir)), default=0)


def in_flight_waits(ttgir: str) -> int:
    """Async waits that keep copies in flight; 0 when every wait drains them all (no pipelining)."""
    return len(_WAIT_IN_FLIGHT.findall(ttgir))


def _attention_arg_types(fn: Any, kv: str, q: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """Runtime argument types of the attention kernels, read off their parameter names."""
    import triton.language as tl

    types: dict[str, str] = {}
    for name, param in inspect.signature(fn.fn).parameters.items():
        constexpr = param.annotation in (tl.constexpr, "tl.constexpr", "triton.language.constexpr")
        if constexpr and param.default is not inspect.Parameter.empty:
            continue  # a switch with a default (the fused merge, PDL): compiled at it, not as a runtime branch
        if name.startswith(("k_cache", "v_cache")):
            types[name] = f"*{kv}"
        elif name.startswith(("query_start", "seq_lens", "block_tables")):
            types[name] = "*i32"
        elif name.startswith("part_"):
            types[name] = "*fp32"
        elif name.endswith("_ptr"):
            types[name] = f"*{q}"
        elif name in ("scale_log2", "k_scale", "v_scale"):
            types[name] = "fp32"
        else:
            types[name] = "i32"
    # As a launch specializes them; the kernel's do_not_specialize arguments are left out.
    unspecialized = set(fn.do_not_specialize)
    aligned = tuple(n for n in types if (n.endswith("_ptr") or n.startswith("stride")) and n not in unspecialized)
    return types, aligned


def attention_variants(head_dim: int = 128, group: int = 4, page_size: int = 16) -> list[dict[str, Any]]:
    """The attention kernels on the tiles the engine ships for ``head_dim``, per cache dtype:
    label, kernel, constexprs and launch knobs, as ``triton_attention`` launches them."""
    import torch

    from siesta.attention import triton_attention as ta
    from siesta.attention import triton_kernels as kernels
    from siesta.attention import triton_tiles as tiling

    common = {"HEAD_DIM": head_dim, "BLOCK_D": head_dim, "GROUP": group, "PAGE_SIZE": page_size}
    caches = (("bf16", "bf16", torch.bfloat16, False), ("fp8", "fp8e4nv", torch.bfloat16, True),
              ("fp32", "fp32", torch.float32, False), ("fp8_fp32", "fp8e4nv", torch.float32, True))  # fmt: skip
    out = []
    for label, kv, dtype, fp8 in caches:
        q = "fp32" if dtype == torch.float32 else "bf16"
        base = common | {"DOT_PRECISION": ta._dot_precision(dtype), "KV_FP8": fp8}
        pre = tiling.prefill_tiles(head_dim, dtype)
        block_m = ta._prefill_block_m(pre, group)
        dec = tiling.decode_tiles(head_dim, dtype, fp8)
        decodes = [("decode", dec)]
        if dtype != torch.float32:  # deterministic mode's rows, alone and crowded
            sm = tiling._FALLBACK_SM_COUNT
            decodes += [("invariant_decode", tiling.invariant_decode_tiles(head_dim, dtype, 1, sm, fp8)),
                        ("crowded_invariant_decode", tiling.invariant_decode_tiles(head_dim, dtype, sm, sm, fp8))]
        for name, tiles in decodes:
            block_h = max(tiles.block_m, ta._decode_block_h(group))
            out.append({"label": f"{name}_{label}", "fn": kernels.decode_split_kernel, "kv": kv, "q": q,
                        "constexprs": base | {"NUM_Q_HEADS": 32, "BLOCK_H": block_h, "BLOCK_N": tiles.block_n,
                                              "WRITE_PARTIALS": True}, "tiles": tiles})  # fmt: skip
        prefill = base | {"BLOCK_M": block_m, "BLOCK_Q": block_m // group, "BLOCK_N": pre.block_n}
        out.append({"label": f"prefill_split_{label}", "fn": kernels.prefill_split_kernel, "kv": kv, "q": q,
                    "constexprs": prefill | {"NUM_Q_HEADS": 32}, "tiles": pre})  # fmt: skip
        out.append({"label": f"unified_{label}", "fn": kernels.unified_kernel, "kv": kv, "q": q, "tiles": pre,
                    "constexprs": prefill | {"DECODE_BLOCK_H": ta._decode_block_h(group),
                                             "DECODE_BLOCK_N": tiling.decode_tiles(head_dim, dtype).block_n,
                                             "SKIP_DECODE": False}})  # fmt: skip
    return out


def compile_attention(arch: int = 90, head_dim: int = 128) -> list[dict[str, Any]]:
    """Each shipped attention variant compiled for ``arch``: its shared bytes and K/V buffers."""
    rows = []
    for v in attention_variants(head_dim):
        types, aligned = _attention_arg_types(v["fn"], v["kv"], v["q"])
        tiles = v["tiles"]
        kernel = compile_for(v["fn"], types, v["constexprs"], num_warps=tiles.num_warps,
                             num_stages=tiles.num_stages, arch=arch, aligned=aligned)  # fmt: skip
        ttgir = _ttgir(kernel)
        rows.append({"variant": v["label"]} | describe(kernel)
                    | {"tile_buffers": tile_buffers(ttgir), "in_flight_waits": in_flight_waits(ttgir)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability, as 90 for sm_90 (Hopper)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--json", default=None, help="write the rows here ('-': stdout only, as JSON)")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("TRITON_INTERPRET is set: the interpreter compiles nothing; run with TRITON_INTERPRET=0")
    rows = compile_attention(args.arch, args.head_dim)
    if args.json == "-":
        print(json.dumps(rows))
        return
    for r in rows:
        fits = "fits" if r["shared"] <= HOPPER_SHARED_BYTES else "TOO BIG"
        print(f"{r['variant']:32} w{r['num_warps']} s{r['num_stages']}  shared {r['shared']:>7,} ({fits})  "
              f"K/V buffers {r['tile_buffers']}  waits in flight {r['in_flight_waits']}  wgmma {r['wgmma_dots']}  "
              f"mma.sync layouts {r['mma_v2_layouts']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
