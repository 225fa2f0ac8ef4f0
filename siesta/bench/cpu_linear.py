"""CPU linears, fp32: MKL (``F.linear``) against oneDNN's matmul and the few-row kernel.

    python -m siesta.bench.cpu_linear [--rows 1,8,9,64,512,2048] [--json PATH]

SmolLM2-135M's matrices (qkv, o_proj, gate_up, down, lm_head); x of M rows. Each figure is
the best of ``--repeats`` calls after two warm-up calls: on a machine shared with other
work, the best call is the one least disturbed. Reported per shape and M: GFLOP/s of each
path and oneDNN's speed-up over MKL.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from siesta.bench.common import machine, print_table, write_json
from siesta.model import cpu_linear

# (name, out_features, in_features) of SmolLM2-135M.
SHAPES = (("qkv", 960, 576), ("o_proj", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
          ("lm_head", 49152, 576))  # fmt: skip
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


def run(rows: list[int], repeats: int) -> list[dict[str, float | int | str]]:
    matmul = cpu_linear.onednn_matmul()
    results = []
    gen = torch.Generator().manual_seed(0)
    for name, n, k in SHAPES:
        w = torch.randn(n, k, generator=gen)
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            flop = 2 * m * n * k
            res: dict[str, float | int | str] = {"matrix": name, "rows": m}
            paths: dict[str, Callable[[], object]] = {"mkl": functools.partial(F.linear, x, w)}
            if matmul is not None:
                paths["onednn"] = functools.partial(matmul, x, w, None, "none", [], "")
            if m <= cpu_linear.MAX_ROWS and cpu_linear._linear_rows(x, w, None) is not None:
                paths["rows_kernel"] = functools.partial(cpu_linear._linear_rows, x, w, None)
            with torch.inference_mode():
                for path, fn in paths.items():
                    res[f"{path}_gflops"] = flop / _best_seconds(fn, repeats) / 1e9
            results.append(res)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,9,64,512,2048", help="comma-separated row counts")
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results = run([int(r) for r in args.rows.split(",") if r], args.repeats)
    cols = ["mkl_gflops", "onednn_gflops", "rows_kernel_gflops"]
    rows = [[r["matrix"], r["rows"], *(r.get(c, float("nan")) for c in cols),
             r.get("onednn_gflops", float("nan")) / r["mkl_gflops"]] for r in results]  # fmt: skip
    print_table(f"CPU linears, fp32, {torch.get_num_threads()} threads (GFLOP/s, best of {args.repeats})",
                ["matrix", "rows", "mkl", "onednn", "rows kernel", "onednn / mkl"], rows)  # fmt: skip
    write_json(args.json, {"machine": machine(), "threads": torch.get_num_threads(), "repeats": args.repeats, "results": results})


if __name__ == "__main__":
    main()
