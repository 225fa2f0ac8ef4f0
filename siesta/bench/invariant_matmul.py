"""Deterministic mode's GEMM (``triton_matmul``) against cuBLAS, per Llama-3-8B matrix and row count.

    python -m siesta.bench.invariant_matmul [--json PATH] [--device cuda] [--smoke]

bf16, M in ``ROWS`` (decode at 1, 64 and 256 rows, an 8k prefill). Each figure is the time of
one call inside a CUDA graph of ``CALLS_PER_GRAPH`` calls cycling through enough weight copies
that every call reads HBM, median over ``GRAPH_REPLAYS`` replays. Per shape and M: µs for cuBLAS
(``F.linear``) and the kernel, their ratio, the kernel's error against cuBLAS, and whether its
first row has the bits it has at M=1 (the invariance the kernel exists for). ``bench/gpu.sh
--sections deterministic`` gives the end-to-end cost; this says which matrix it comes from, and
so which shapes a ``config_for`` entry should be tuned for.

``--smoke`` runs tiny fp32 shapes through Triton's interpreter on the CPU
(``TRITON_INTERPRET=1 python -m siesta.bench.invariant_matmul --smoke --device cpu``), only to
check that the script runs end to end.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from siesta.bench.common import print_table, write_json
from siesta.bench.kernel_timing import time_call, weight_copies
from siesta.model.triton_matmul import config_for, matmul

HIDDEN = 4096
# (name, N, K): qkv, o_proj, gate_up, down, lm_head.
LLAMA3_8B = (("qkv", 6144, HIDDEN), ("o_proj", HIDDEN, HIDDEN), ("gate_up", 28672, HIDDEN),
             ("down", HIDDEN, 14336), ("lm_head", 128256, HIDDEN))  # fmt: skip
ROWS = (1, 64, 256, 8192)
SMOKE_SHAPES = (("qkv", 48, 96), ("lm_head", 40, 72))
SMOKE_ROWS = (1, 3)
CALLS_PER_GRAPH = 20


@dataclass
class Result:
    shape: str
    n: int
    k: int
    m: int
    config: dict
    cublas_us: float
    invariant_us: float
    slowdown: float  # invariant / cuBLAS
    rel_err: float  # max |invariant - cuBLAS| / max |cuBLAS|
    row_bits_as_alone: bool


def bench(name: str, n: int, k: int, rows: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> list[Result]:
    weight_bytes = n * k * torch.finfo(dtype).bits // 8
    weights = [(torch.randn(n, k, device=device) * k**-0.5).to(dtype) for _ in range(weight_copies(weight_bytes, device))]
    first_row = torch.randn(1, k, device=device).to(dtype)
    alone = matmul(first_row, weights[0])
    results = []
    for m in rows:
        x = torch.cat([first_row, torch.randn(m - 1, k, device=device).to(dtype)])
        ref = F.linear(x, weights[0]).float()
        out = matmul(x, weights[0])
        cublas = time_call(lambda i: F.linear(x, weights[i]), len(weights), device, CALLS_PER_GRAPH)
        invariant = time_call(lambda i: matmul(x, weights[i]), len(weights), device, CALLS_PER_GRAPH)
        err = ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        results.append(Result(name, n, k, m, asdict(config_for(n, k, dtype)), cublas, invariant, invariant / cublas,
                              err, torch.equal(out[0], alone[0])))  # fmt: skip
        print(f"  {name} M={m}: cuBLAS {cublas:9.2f} us, invariant {invariant:9.2f} us ({invariant / cublas:.2f}x)")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write all results to this path")
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (only with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 shapes: checks the script runs")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("on the CPU Triton needs its interpreter: run with TRITON_INTERPRET=1 (and --smoke)")
    shapes, rows, dtype = (SMOKE_SHAPES, SMOKE_ROWS, torch.float32) if args.smoke else (LLAMA3_8B, ROWS, torch.bfloat16)
    torch.manual_seed(0)
    results = [r for name, n, k in shapes for r in bench(name, n, k, rows, dtype, device)]
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print_table(
        f"Batch-invariant GEMM against cuBLAS, {device_name}, {dtype}, weights cycled beyond L2",
        ["shape", "M", "cuBLAS us", "invariant us", "invariant/cuBLAS", "rel err", "row bits as M=1"],
        [[r.shape, r.m, r.cublas_us, r.invariant_us, r.slowdown, r.rel_err, r.row_bits_as_alone] for r in results],
    )
    write_json(args.json, {"device": device_name, "dtype": str(dtype), "results": [asdict(r) for r in results]})


if __name__ == "__main__":
    main()
