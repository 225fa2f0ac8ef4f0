"""Timing one kernel call as a decode step meets it: its weight read from HBM, not L2, and the
launch inside a CUDA graph (``bench.gemv``, ``bench.invariant_matmul``).

The caller makes ``weight_copies`` copies of the weight and times ``call(i)``, which uses copy
``i``: one cycle through the copies overflows L2 several times, so no call finds its weight
there. On the CPU (smoke runs under Triton's interpreter) the figure is only a sanity check.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from siesta.core.host_backup import CAPTURE_LOCK

GRAPH_REPLAYS = 5
SMOKE_REPS = 2
# One cycle through the weight copies must touch this many times the L2, and at least
# MIN_BYTES_PER_CYCLE, so that no call finds its weight in L2.
L2_MULTIPLE = 4
MIN_BYTES_PER_CYCLE = 256 << 20
MIN_COPIES = 2
US_PER_MS = 1e3
US_PER_S = 1e6


def weight_copies(weight_bytes: int, device: torch.device) -> int:
    """Copies of one weight whose cycle overflows L2 enough that each call reads HBM."""
    if device.type != "cuda":
        return MIN_COPIES
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    target = max(L2_MULTIPLE * l2, MIN_BYTES_PER_CYCLE)
    return max(MIN_COPIES, -(-target // weight_bytes))


def time_call(call: Callable[[int], object], copies: int, device: torch.device, calls_per_graph: int) -> float:
    """µs per ``call(copy)``: the median over replays of a CUDA graph cycling through the copies."""
    return _time_cuda(call, copies, calls_per_graph) if device.type == "cuda" else _time_cpu(call, copies)


def _time_cuda(call: Callable[[int], object], copies: int, calls_per_graph: int) -> float:
    for i in range(copies):  # compiles, cuBLAS heuristics and workspace: outside the capture
        call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # A live engine's host backup pins memory while the device is quiet, which invalidates a
    # capture in global mode (the moe knobs sweep, H100 run 64a): it waits for this one.
    with CAPTURE_LOCK, torch.cuda.graph(graph):
        for i in range(calls_per_graph):
            call(i % copies)
    graph.replay()  # the first replay uploads the graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(GRAPH_REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * US_PER_MS / calls_per_graph)
    del graph
    return statistics.median(samples)


def _time_cpu(call: Callable[[int], object], copies: int) -> float:
    call(0)
    begin = time.perf_counter()
    for i in range(SMOKE_REPS):
        call(i % copies)
    return (time.perf_counter() - begin) * US_PER_S / SMOKE_REPS


def kernel_bench_parser(doc: str, smoke_help: str) -> argparse.ArgumentParser:
    """The kernel benches' command line: ``--json``, ``--device`` and ``--smoke``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write all results to this path")
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (only with --smoke)")
    parser.add_argument("--smoke", action="store_true", help=smoke_help)
    return parser


def bench_device(args: argparse.Namespace) -> torch.device:
    """``--device``, refused on the CPU unless Triton's interpreter is on."""
    device = torch.device(args.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("on the CPU Triton needs its interpreter: run with TRITON_INTERPRET=1 (and --smoke)")
    return device


def candidates_cli(
    doc: str, smoke_help: str, parse_candidate: Callable[[str], Any], candidates_help: str,
    run: Callable[[torch.device, bool, list | None], dict],
) -> tuple[argparse.Namespace, dict]:
    """A tile-sweeping bench's main up to its table: the command line with ``--candidates``
    (comma-separated, each read by ``parse_candidate``), the device, then ``run``'s result."""
    parser = kernel_bench_parser(doc, smoke_help)
    parser.add_argument("--candidates", type=lambda t: [parse_candidate(c) for c in t.split(",")], default=None,
                        help=candidates_help)  # fmt: skip
    args = parser.parse_args()
    return args, run(bench_device(args), args.smoke, args.candidates)
