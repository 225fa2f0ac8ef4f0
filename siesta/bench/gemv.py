"""Decode GEMMs at batch 1..8: cuBLAS (``F.linear``) against the Triton ``gemv`` configs.

    python -m siesta.bench.gemv [--json PATH] [--device cuda] [--smoke] [--model qwen3-30b-a3b] [--rows 1]

Llama-3-8B shapes in bf16 (qkv, o_proj, gate_up, down, lm_head), or with ``--model
qwen3-30b-a3b`` the dense matrices of that MoE (qkv, o_proj, lm_head: its experts go
through the fused-MoE kernels), x of M rows in ``ROWS`` (or ``--rows``). Every figure
is the time of one call inside a CUDA graph of ``CALLS_PER_GRAPH`` calls (launch gaps
as a graphed decode step sees them, no host overhead), median over ``GRAPH_REPLAYS``
replays. The calls cycle through enough copies of the weight that one cycle touches
several times the L2 (or ``MIN_BYTES_PER_CYCLE``), so every weight comes from HBM as in
a real step.

Reported per shape and M: µs per call and TB/s (weight bytes / time) for cuBLAS and
each config, the error of each config against cuBLAS (configs beyond
``WRONG_ABOVE`` are flagged and never picked as best), the best config, and the
cuBLAS / best-Triton time ratio. Last, one decode step at M=1: the layer matrices x
the model's layers + lm_head, for cuBLAS, the best Triton config per shape and the
faster of the two per shape.

``--smoke`` runs tiny fp32 shapes through Triton's interpreter on the CPU
(``TRITON_INTERPRET=1 python -m siesta.bench.gemv --smoke --device cpu``), only
to check that the script runs end to end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from siesta.bench.common import print_table, write_json
from siesta.bench.kernel_timing import (
    GRAPH_REPLAYS,
    US_PER_MS,
    US_PER_S,
    bench_device,
    kernel_bench_parser,
    time_call,
    weight_copies,
)
from siesta.model.triton_gemv import GemvConfig, default_config, gemv

DTYPE = torch.bfloat16
SMOKE_DTYPE = torch.float32  # the interpreter's bf16 arithmetic is unreliable
LAYERS = 32
HIDDEN = 4096
MOE_LAYERS = 48
MOE_HIDDEN = 2048
ROWS = (1, 2, 4, 8)
CALLS_PER_GRAPH = 100
# Max |triton - cuBLAS| / max |cuBLAS| above which a config is wrong: both round an
# fp32 sum to bf16 (2**-8 relative), in different orders.
WRONG_ABOVE = 1e-2
TERA = 1e12


@dataclass(frozen=True)
class Shape:
    """One weight matrix [n, k] of a decode step, used ``per_step`` times in it."""

    name: str
    n: int
    k: int
    per_step: int


LLAMA3_8B = (
    Shape("qkv", 6144, HIDDEN, LAYERS),
    Shape("o_proj", HIDDEN, HIDDEN, LAYERS),
    Shape("gate_up", 28672, HIDDEN, LAYERS),
    Shape("down", HIDDEN, 14336, LAYERS),
    Shape("lm_head", 128256, HIDDEN, 1),
)
# Qwen3-30B-A3B's dense matrices: q|k|v (32 + 2 * 4 heads of 128), o_proj (32 heads of 128 in),
# the router (128 experts' logits).
QWEN3_30B_A3B = (
    Shape("qkv", 5120, MOE_HIDDEN, MOE_LAYERS),
    Shape("o_proj", MOE_HIDDEN, 4096, MOE_LAYERS),
    Shape("router", 128, MOE_HIDDEN, MOE_LAYERS),
    Shape("lm_head", 151936, MOE_HIDDEN, 1),
)
MODELS = {"llama-3-8b": LLAMA3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B}
# Ragged on purpose (N not a multiple of the tiles, K not of the chunks).
SMOKE_SHAPES = (Shape("qkv", 48, 96, 2), Shape("lm_head", 40, 72, 1))
SMOKE_ROWS = (1, 3)


def _cfg(block_n: int, block_k: int, warps: int, stages: int, split_k: int = 1, dot: bool = False) -> GemvConfig:
    return GemvConfig(block_n, block_k, warps, stages, split_k=split_k, tensor_cores=dot)


# Candidates, pruned by hand (from a wider sweep on an H200) to keep compiles and
# timing near a minute. The tl.sum path keeps a [M, block_n, block_k] fp32
# accumulator, so it is only timed up to SUM_PATH_MAX_ROWS rows; from 4 rows on the
# tensor cores won every shape of the wider sweep.
SUM_PATH_MAX_ROWS = 2
CANDIDATES = (
    # CUDA cores (tl.sum).
    _cfg(4, 1024, 4, 3),
    _cfg(8, 256, 2, 4),
    _cfg(8, 512, 4, 3),
    _cfg(8, 512, 4, 4),
    _cfg(8, 1024, 4, 3),
    _cfg(16, 256, 4, 4),
    _cfg(16, 512, 4, 3),
    _cfg(16, 512, 4, 4),
    _cfg(16, 512, 8, 3),
    _cfg(32, 256, 4, 3),
    # CUDA cores, split-K (more programs for N=4096, and N=2048: 128 programs of 16 rows).
    _cfg(16, 512, 4, 3, split_k=2),
    _cfg(8, 512, 4, 3, split_k=2),
    _cfg(16, 256, 4, 4, split_k=2),
    _cfg(16, 512, 4, 3, split_k=4),
    # Few outputs (a router's 128): narrow tiles, K split wide.
    _cfg(2, 1024, 4, 2),
    _cfg(4, 512, 4, 4),
    _cfg(4, 512, 4, 3, split_k=4),
    _cfg(8, 256, 4, 2, split_k=8),
    _cfg(4, 256, 2, 2, split_k=8),
    # Tensor cores (tl.dot, x padded to 16 rows).
    _cfg(32, 256, 4, 4, dot=True),
    _cfg(32, 512, 4, 3, dot=True),
    _cfg(64, 128, 4, 4, dot=True),
    _cfg(64, 256, 4, 3, dot=True),
    _cfg(64, 256, 4, 4, dot=True),
    _cfg(64, 512, 4, 2, dot=True),
    _cfg(128, 128, 4, 4, dot=True),
    # Tensor cores, split-K.
    _cfg(64, 256, 4, 3, split_k=2, dot=True),
    _cfg(64, 256, 4, 4, split_k=2, dot=True),
    _cfg(64, 256, 4, 3, split_k=4, dot=True),
    _cfg(128, 128, 8, 3, split_k=4, dot=True),
)
SMOKE_CANDIDATES = (_cfg(16, 32, 1, 1), _cfg(16, 32, 1, 1, split_k=2, dot=True))


@dataclass
class Timing:
    """One implementation on one shape and M."""

    impl: str  # "cublas" or "triton"
    config: dict | None = None
    us: float = float("nan")
    tbps: float = float("nan")
    rel_err: float | None = None  # against cuBLAS
    ok: bool = True
    error: str | None = None


@dataclass
class ShapeResult:
    shape: str
    n: int
    k: int
    m: int
    weight_bytes: int
    copies: int
    cublas: Timing
    default: Timing | None = None
    best: Timing | None = None
    speedup: float = float("nan")  # cuBLAS time / best Triton time
    triton: list[Timing] = field(default_factory=list)


def _describe(config: GemvConfig) -> str:
    path = "dot" if config.tensor_cores else "sum"
    return f"{path} n{config.block_n} k{config.block_k} w{config.num_warps} s{config.num_stages} sk{config.split_k}"


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.float().abs().max().clamp_min(torch.finfo(torch.float32).tiny)
    return ((out.float() - ref.float()).abs().max() / scale).item()


def _time(call: Callable[[int], object], copies: int, device: torch.device) -> float:
    return time_call(call, copies, device, CALLS_PER_GRAPH)


def _bench_triton(
    config: GemvConfig, x: torch.Tensor, weights: list[torch.Tensor], ref: torch.Tensor, weight_bytes: int
) -> Timing:
    timing = Timing("triton", config=asdict(config))
    try:
        timing.rel_err = relative_error(gemv(x, weights[0], config=config), ref)
        timing.ok = timing.rel_err <= WRONG_ABOVE
        timing.us = _time(lambda i: gemv(x, weights[i], config=config), len(weights), x.device)
    except Exception as exc:  # noqa: BLE001 - a config that fails to compile (shared memory) is a result
        timing.ok, timing.error = False, f"{type(exc).__name__}: {str(exc)[:200]}"
        return timing
    timing.tbps = weight_bytes / (timing.us / US_PER_S) / TERA
    return timing


def bench_shape(
    shape: Shape, m: int, weights: list[torch.Tensor], candidates: tuple[GemvConfig, ...], dtype: torch.dtype
) -> ShapeResult:
    device = weights[0].device
    x = torch.randn((m, shape.k), device=device).to(dtype)
    weight_bytes = weights[0].numel() * weights[0].element_size()
    ref = F.linear(x, weights[0])
    cublas = Timing("cublas", us=_time(lambda i: F.linear(x, weights[i]), len(weights), device))
    cublas.tbps = weight_bytes / (cublas.us / US_PER_S) / TERA
    result = ShapeResult(shape.name, shape.n, shape.k, m, weight_bytes, len(weights), cublas)
    default = default_config(m, shape.n, shape.k, weights[0].element_size())
    tried = [c for c in candidates if c.tensor_cores or m <= SUM_PATH_MAX_ROWS]
    for config in dict.fromkeys((*tried, default)):  # the default once, even if a candidate
        timing = _bench_triton(config, x, weights, ref, weight_bytes)
        result.triton.append(timing)
        if config == default:
            result.default = timing
        flag = "" if timing.ok else f"  WRONG/FAILED {timing.error or timing.rel_err}"
        print(f"  {shape.name} M={m} {_describe(config):32s} {timing.us:9.2f} us {timing.tbps:6.2f} TB/s{flag}")
    good = [t for t in result.triton if t.ok]
    if good:
        result.best = min(good, key=lambda t: t.us)
        result.speedup = cublas.us / result.best.us
    return result


def _weights(shape: Shape, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    # Scaled like a trained layer so outputs stay O(1) in bf16.
    scale = shape.k**-0.5
    weight_bytes = shape.n * shape.k * torch.finfo(dtype).bits // 8
    return [
        (torch.randn((shape.n, shape.k), device=device) * scale).to(dtype)
        for _ in range(weight_copies(weight_bytes, device))
    ]


def decode_step(results: list[ShapeResult], shapes: tuple[Shape, ...]) -> dict[str, float]:
    """ms of one M=1 decode step's GEMMs: cuBLAS, best Triton per shape, faster of both per shape."""
    per_step = {s.name: s.per_step for s in shapes}
    totals = {"cublas_ms": 0.0, "triton_ms": 0.0, "best_of_both_ms": 0.0, "triton_default_ms": 0.0}
    for r in results:
        if r.m != 1:
            continue
        count = per_step[r.shape] / US_PER_MS
        best_triton = r.best.us if r.best else float("inf")
        totals["cublas_ms"] += count * r.cublas.us
        totals["triton_ms"] += count * best_triton
        totals["best_of_both_ms"] += count * min(r.cublas.us, best_triton)
        default_us = r.default.us if r.default and r.default.ok else float("inf")
        totals["triton_default_ms"] += count * default_us
    return totals


def _summary_rows(results: list[ShapeResult]) -> list[list]:
    rows = []
    for r in results:
        best = r.best
        rows.append([
            r.shape, r.m, r.cublas.us, r.cublas.tbps,
            best.us if best else float("nan"), best.tbps if best else float("nan"),
            r.default.us if r.default else float("nan"), r.speedup,
            _describe(GemvConfig(**best.config)) if best else "none correct",
            sum(not t.ok for t in r.triton),
        ])  # fmt: skip
    return rows


def main() -> None:
    parser = kernel_bench_parser(__doc__, "tiny shapes, two configs: checks the script runs")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-3-8b", help="whose matrices")
    parser.add_argument("--rows", type=lambda t: tuple(int(r) for r in t.split(",")), default=None,
                        help=f"rows of x, comma-separated (default {','.join(map(str, ROWS))})")  # fmt: skip
    args = parser.parse_args()
    device = bench_device(args)
    shapes, rows, candidates, dtype = (
        (SMOKE_SHAPES, SMOKE_ROWS, SMOKE_CANDIDATES, SMOKE_DTYPE)
        if args.smoke
        else (MODELS[args.model], ROWS, CANDIDATES, DTYPE)
    )
    rows = args.rows or rows
    torch.manual_seed(0)
    began = time.perf_counter()
    results: list[ShapeResult] = []
    for shape in shapes:
        weights = _weights(shape, dtype, device)
        for m in rows:
            results.append(bench_shape(shape, m, weights, candidates, dtype))
        del weights
    step = decode_step(results, shapes)
    elapsed = time.perf_counter() - began

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print_table(
        f"GEMM per call, {device_name}, {dtype}, weights cycled beyond L2 ({elapsed:.0f} s)",
        ["shape", "M", "cuBLAS us", "TB/s", "Triton us", "TB/s", "default us", "cuBLAS/Triton", "best config", "wrong"],
        _summary_rows(results),
    )
    print_table(
        f"One decode step's matrices at M=1 ({' + '.join(f'{s.per_step} x {s.name}' for s in shapes)}), ms",
        ["cuBLAS", "best Triton", "best of both", "Triton default"],
        [[step["cublas_ms"], step["triton_ms"], step["best_of_both_ms"], step["triton_default_ms"]]],
    )
    write_json(
        args.json,
        {
            "device": device_name,
            "model": "smoke" if args.smoke else args.model,
            "dtype": str(dtype),
            "calls_per_graph": CALLS_PER_GRAPH,
            "graph_replays": GRAPH_REPLAYS,
            "elapsed_s": elapsed,
            "decode_step_m1": step,
            "results": [asdict(r) for r in results],
        },
    )


if __name__ == "__main__":
    main()
