"""CPU linears, fp32: MKL (``F.linear``) against oneDNN's matmul and siesta's kernel (``cpu_gemm.c``).

    python -m siesta.bench.cpu_linear [--rows 1,8,32,128,512,2048] [--march x86-64-v3] [--json PATH]

SmolLM2-135M's matrices (qkv, o_proj, gate_up, down, lm_head), x of M rows, each matrix
timed alone (in cache from the second call on), and ``layers (cold)``: one pass over 30
layers' four matrices, each a distinct tensor (~425 MB, past any cache), as a decode step
reads them. Each figure is the best of ``--repeats`` calls after two warm-up calls: on a
machine shared with other work, the best call is the one least disturbed. Reported per
shape and M: GFLOP/s of each path, and the kernel's and oneDNN's speed-ups over MKL.

``--march`` builds the kernel for another target than this machine (``x86-64-v3``: AVX2 and
FMA, as on CPUs without AVX-512). To hold the libraries to the same, restrict them too:
``MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``
(``MKL_VERBOSE=1`` and ``ONEDNN_VERBOSE=1`` print the ISA each library then runs); the JSON
records which were set.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from siesta.bench.common import machine, print_table, write_json
from siesta.c_kernels import NATIVE
from siesta.cpu_info import isa_limits
from siesta.model import cpu_linear

# (name, out_features, in_features) of SmolLM2-135M.
SHAPES = (("qkv", 960, 576), ("o_proj", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
          ("lm_head", 49152, 576))  # fmt: skip
LAYERS = 30  # SmolLM2-135M's
COLD = "layers (cold)"
WARMUP_CALLS = 2


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(WARMUP_CALLS):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _paths(x: torch.Tensor, w: torch.Tensor, kernel: ctypes.CDLL | None) -> dict[str, Callable[[], object]]:
    paths: dict[str, Callable[[], object]] = {"mkl": functools.partial(F.linear, x, w)}
    matmul = cpu_linear.onednn_matmul()
    if matmul is not None:
        paths["onednn"] = functools.partial(matmul, x, w, None, "none", [], "")
    if kernel is not None and cpu_linear.linear_tiled(x, w, None, kernel) is not None:
        paths["kernel"] = functools.partial(cpu_linear.linear_tiled, x, w, None, kernel)
    return paths


def _timed(res: dict[str, float | int | str], paths: dict[str, Callable[[], object]], flop: int, repeats: int) -> None:
    with torch.inference_mode():
        for path, fn in paths.items():
            res[f"{path}_gflops"] = flop / _best_seconds(fn, repeats) / 1e9


def _cold_layers(m: int, gen: torch.Generator, repeats: int,
                 kernel: ctypes.CDLL | None) -> dict[str, float | int | str]:  # fmt: skip
    layer_shapes = [(n, k) for name, n, k in SHAPES if name != "lm_head"]
    weights = [torch.randn(n, k, generator=gen) for _ in range(LAYERS) for n, k in layer_shapes]
    inputs = {k: torch.randn(m, k, generator=gen) for _, k in layer_shapes}
    per_matrix = [_paths(inputs[w.shape[1]], w, kernel) for w in weights]
    every_pass = {path: [p[path] for p in per_matrix] for path in per_matrix[0]}
    paths = {path: functools.partial(_each, calls) for path, calls in every_pass.items()}
    res: dict[str, float | int | str] = {"matrix": COLD, "rows": m}
    _timed(res, paths, sum(2 * m * w.numel() for w in weights), repeats)
    return res


def _each(calls: list[Callable[[], object]]) -> None:
    for call in calls:
        call()


def run(rows: list[int], repeats: int, march: str = NATIVE) -> list[dict[str, float | int | str]]:
    kernel = cpu_linear.load_gemm(march)
    results = []
    gen = torch.Generator().manual_seed(0)
    for name, n, k in SHAPES:
        w = torch.randn(n, k, generator=gen)
        for m in rows:
            res: dict[str, float | int | str] = {"matrix": name, "rows": m}
            _timed(res, _paths(torch.randn(m, k, generator=gen), w, kernel), 2 * m * n * k, repeats)
            results.append(res)
    for m in rows:
        results.append(_cold_layers(m, gen, max(1, repeats // 4), kernel))  # a pass is ~30x a matrix's call
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,32,128,512,2048", help="comma-separated row counts")
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--march", default=NATIVE, help="the kernel's target (gcc's -march), e.g. x86-64-v3 for AVX2")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results = run([int(r) for r in args.rows.split(",") if r], args.repeats, args.march)
    cols = ["mkl_gflops", "onednn_gflops", "kernel_gflops"]
    nan = float("nan")
    rows = [[r["matrix"], r["rows"], *(r.get(c, nan) for c in cols), r.get("kernel_gflops", nan) / r["mkl_gflops"],
             r.get("onednn_gflops", nan) / r["mkl_gflops"]] for r in results]  # fmt: skip
    print_table(f"CPU linears, fp32, {torch.get_num_threads()} threads, kernel for -march={args.march} "
                f"(GFLOP/s, best of {args.repeats})",
                ["matrix", "rows", "mkl", "onednn", "kernel", "kernel / mkl", "onednn / mkl"], rows)  # fmt: skip
    write_json(args.json, {"machine": machine(), "threads": torch.get_num_threads(), "repeats": args.repeats,
                           "march": args.march, "isa_limits": isa_limits(), "results": results})  # fmt: skip


if __name__ == "__main__":
    main()
