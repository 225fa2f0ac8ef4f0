"""Deterministic mode's GEMM (``triton_matmul``) against cuBLAS, per Llama-3-8B matrix and row count.

    python -m siesta.bench.invariant_matmul [--json PATH] [--device cuda] [--smoke]
                                            [--candidates 64x64x64w4s4,128x256x64w8s3,...]

bf16, M in ``ROWS`` (decode at 1, 64 and 256 rows, an 8k prefill). Each figure is the time of
one call inside a CUDA graph of ``CALLS_PER_GRAPH`` calls cycling through enough weight copies
that every call reads HBM, median over ``GRAPH_REPLAYS`` replays. Per shape and M: µs for cuBLAS
(``F.linear``) and the kernel, their ratio, the kernel's error against cuBLAS, and whether its
first row has the bits it has at M=1 (the invariance the kernel exists for). ``bench/gpu.sh
--sections deterministic`` gives the end-to-end cost; this says which matrix it comes from, and
so which shapes a ``config_for`` entry should be tuned for.

``--candidates`` also times other tile configs (BLOCK_M x BLOCK_N x BLOCK_K, warps, stages) on the
same inputs, for tuning ``config_for`` per (N, K): each with its µs, and whether its rows have the
bits of the shipped config's at M=1 (whether the tile shape reaches the bits at all, which decides
whether a config may ever differ between two engines that must agree).

``--smoke`` runs tiny fp32 shapes through Triton's interpreter on the CPU
(``TRITON_INTERPRET=1 python -m siesta.bench.invariant_matmul --smoke --device cpu``), only to
check that the script runs end to end.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from siesta.bench.common import print_table, write_json
from siesta.bench.kernel_timing import candidates_cli, time_call, weight_copies
from siesta.model.triton_matmul import MatmulConfig, config_for, matmul

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
    # Other tile configs on the same inputs: their µs and whether their rows equal the shipped config's bits.
    candidates: list[dict] | None = None


def parse_config(text: str) -> MatmulConfig:
    """``64x128x64w4s4``: BLOCK_M x BLOCK_N x BLOCK_K, num_warps, num_stages (group_m 8); a
    trailing ``t`` takes the persistent TMA kernel."""
    tma = text.endswith("t")
    blocks, rest = text.removesuffix("t").split("w")
    warps, stages = rest.split("s")
    m, n, k = (int(v) for v in blocks.split("x"))
    return MatmulConfig(block_m=m, block_n=n, block_k=k, group_m=8, num_warps=int(warps), num_stages=int(stages),
                        persistent_tma=tma)  # fmt: skip


def _candidates(x: torch.Tensor, weights: list[torch.Tensor], shipped: torch.Tensor, alone: torch.Tensor,
                configs: list[MatmulConfig], device: torch.device) -> list[dict]:  # fmt: skip
    out = []
    for config in configs:
        got = matmul(x, weights[0], config=config)
        us = time_call(lambda i, c=config: matmul(x, weights[i], config=c), len(weights), device, CALLS_PER_GRAPH)
        out.append({"config": asdict(config), "us": us, "bits_as_shipped": torch.equal(got, shipped),
                    "row_bits_as_shipped_alone": torch.equal(got[0], alone[0])})  # fmt: skip
    return out


def bench(name: str, n: int, k: int, rows: tuple[int, ...], dtype: torch.dtype, device: torch.device,
          configs: list[MatmulConfig] | None = None) -> list[Result]:  # fmt: skip
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
        others = _candidates(x, weights, out, alone, configs, device) if configs else None
        results.append(Result(name, n, k, m, asdict(config_for(n, k, m, dtype)), cublas, invariant, invariant / cublas,
                              err, torch.equal(out[0], alone[0]), others))  # fmt: skip
        tried = "; ".join(f"{c['config']['block_m']}x{c['config']['block_n']} {c['us']:.1f}"
                          f"{'' if c['bits_as_shipped'] else ' (other bits)'}" for c in others or [])  # fmt: skip
        print(f"  {name} M={m}: cuBLAS {cublas:9.2f} us, invariant {invariant:9.2f} us ({invariant / cublas:.2f}x)"
              f"{'; ' + tried if tried else ''}")  # fmt: skip
    return results


def run(device: torch.device, smoke: bool = False, candidates: list[MatmulConfig] | None = None) -> dict:
    """Every shape at every row count (``--smoke``: tiny fp32 shapes): the JSON ``main`` writes."""
    shapes, rows, dtype = (SMOKE_SHAPES, SMOKE_ROWS, torch.float32) if smoke else (LLAMA3_8B, ROWS, torch.bfloat16)
    torch.manual_seed(0)
    results = [r for name, n, k in shapes for r in bench(name, n, k, rows, dtype, device, candidates)]
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    return {"device": device_name, "dtype": str(dtype), "results": [asdict(r) for r in results]}


def summary_rows(res: dict) -> list[list]:
    """Per shape, the kernel over cuBLAS at one row and at the most rows timed, and the bits."""
    rows = []
    for shape in dict.fromkeys(r["shape"] for r in res["results"]):
        cells = [r for r in res["results"] if r["shape"] == shape]
        rows.append([f"invariant GEMM / cuBLAS, {shape} (M={cells[0]['m']} / {cells[-1]['m']})",
                     f"{cells[0]['slowdown']:.2f} / {cells[-1]['slowdown']:.2f}",
                     f"row bits as alone: {all(c['row_bits_as_alone'] for c in cells)}"])  # fmt: skip
    return rows


def main() -> None:
    args, res = candidates_cli(__doc__, "tiny fp32 shapes: checks the script runs", parse_config,
                               "other tile configs to time, e.g. 64x64x64w4s4,128x256x64w8s3", run)  # fmt: skip
    print_table(
        f"Batch-invariant GEMM against cuBLAS, {res['device']}, {res['dtype']}, weights cycled beyond L2",
        ["shape", "M", "cuBLAS us", "invariant us", "invariant/cuBLAS", "rel err", "row bits as M=1"],
        [[r["shape"], r["m"], r["cublas_us"], r["invariant_us"], r["slowdown"], r["rel_err"], r["row_bits_as_alone"]]
         for r in res["results"]],
    )  # fmt: skip
    write_json(args.json, res)


if __name__ == "__main__":
    main()
