"""CPU decode attention: the torch path, the compiled kernel as at a past commit, and the kernel now.

    python -m siesta.bench.cpu_attention [--rounds 7] [--baseline REV] [--json out.json]

SmolLM2-135M heads (9 query, 3 KV, head_dim 64), fp32, block size 16, a 30-layer
block-first cache, 64 decode rows at context 600-1,100 on shuffled block ids: the
decode step of ``siesta bench throughput --dtype float32`` at batch 64. Each arm
attends every layer once per round; arms take turns (A, B, C, A, B, C ...) so machine
noise hits them alike, and the medians over rounds are reported next to the machine's
read bandwidth (a sum over a large tensor, measured in the same run).

Each arm is also timed as the engine runs it: every layer's attention right after a matmul
(the o_proj of the layer before), which leaves torch's OpenMP team spinning for a while on
the cores. Only the attention calls are counted. The kernel now splits its rows over that
team; the arm "kernel, python threads" is the same kernel split over Python threads, as it
was before, and shares the cores with the spinning team.
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import random
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from siesta.attention.base import AttentionMetadata, KVCache
from siesta.attention.cpu_attention import CpuAttention, build_kernel, load_kernel
from siesta.attention.torch_ref import TorchAttention
from siesta.bench.common import machine, print_table, write_json

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, LAYERS = 9, 3, 64, 16, 30
ROWS, MIN_CONTEXT, MAX_CONTEXT = 64, 600, 1100
SPARE_BLOCKS = 64  # blocks no row uses, so the shuffled ids are not a permutation of the rows' own
SEED = 0
DEFAULT_ROUNDS = 7
SUM_BYTES = 512 << 20  # the bandwidth probe's tensor: far past the last-level cache
FP32_BYTES = 4
GIGA = 1e9
MS = 1e-3
REPO = Path(__file__).resolve().parents[2]
KERNEL_PATH = "siesta/attention/cpu_decode.c"
LOADER_PATH = "siesta/attention/cpu_attention.py"
# The first kernel (one KV head at a time over each row's blocks, scalar expf).
DEFAULT_BASELINE = "dd39092"


def decode_step(seed: int) -> tuple[torch.Tensor, KVCache, AttentionMetadata]:
    """q, a random 30-layer cache and the metadata of one decode step over shuffled blocks."""
    rng = random.Random(seed)
    lens = [rng.randint(MIN_CONTEXT, MAX_CONTEXT) for _ in range(ROWS)]
    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    cache = KVCache.allocate(sum(blocks) + SPARE_BLOCKS, LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.float32,
                             torch.device("cpu"))  # fmt: skip
    cache.tensor.normal_(generator=torch.Generator().manual_seed(seed))
    ids = list(range(cache.num_blocks))
    rng.shuffle(ids)
    tables = torch.zeros(ROWS, max(blocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.tensor(ids[used : used + n])
        used += n
    starts = list(range(ROWS + 1))
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables, slot_mapping=torch.full((ROWS,), -1, dtype=torch.int64), max_query_len=1,
        max_seq_len=max(lens), query_start_loc_cpu=starts, seq_lens_cpu=lens,
    )  # fmt: skip
    q = torch.randn(ROWS, Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed + 1))
    return q, cache, meta


def read_probe() -> Callable[[], float]:
    """A timer of ``x.sum()`` over a tensor far larger than the caches: the machine's read GB/s."""
    x = torch.ones(SUM_BYTES // FP32_BYTES)

    def gbps() -> float:
        t0 = time.perf_counter()
        x.sum()
        return SUM_BYTES / (time.perf_counter() - t0) / GIGA

    return gbps


def _at(rev: str, path: str) -> bytes:
    return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, capture_output=True, check=True).stdout


def past_kernel(rev: str) -> ctypes.CDLL | None:
    """The kernel at commit ``rev``, built with the flags its loader gave it (None if it does not build)."""
    loader = ast.parse(_at(rev, LOADER_PATH))
    flags = next(ast.literal_eval(node.value) for node in loader.body
                 if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "CFLAGS")  # fmt: skip
    return build_kernel(_at(rev, KERNEL_PATH), tuple(flags))


def run(rounds: int, baseline: str = DEFAULT_BASELINE) -> dict[str, Any]:
    q, cache, meta = decode_step(SEED)
    rows = list(range(ROWS))
    scale = HEAD_DIM**-0.5
    past, now = past_kernel(baseline), load_kernel()
    if past is None or now is None:
        raise SystemExit("a kernel did not build (see the log): nothing to compare")
    arms = {"torch": TorchAttention(), "kernel@baseline": CpuAttention(kernel=past),
            "kernel, python threads": CpuAttention(kernel=SimpleNamespace(paged_decode=now.paged_decode)),
            "kernel": CpuAttention(kernel=now)}  # fmt: skip
    outs = {name: torch.empty_like(q) for name in arms}
    hidden = Q_HEADS * HEAD_DIM
    x, w = torch.randn(ROWS, hidden), torch.randn(hidden, hidden)

    def all_layers(name: str, matmul_first: bool) -> float:
        """Seconds in attention over every layer (with a matmul before each, if asked)."""
        spent = 0.0
        for layer in range(LAYERS):
            if matmul_first:
                F.linear(x, w)
            t0 = time.perf_counter()
            arms[name]._decode(q, cache, layer, meta, scale, rows, outs[name])
            spent += time.perf_counter() - t0
        return spent

    probe = read_probe()
    for name in arms:  # warm-up: builds, thread pools, first touch
        all_layers(name, True)
    times: dict[tuple[str, bool], list[float]] = {(name, m): [] for name in arms for m in (False, True)}
    read_gbps: list[float] = []
    for _ in range(rounds):  # the probe takes its turn too: the ceiling drifts with the machine
        read_gbps.append(probe())
        for name, matmul_first in times:
            times[name, matmul_first].append(all_layers(name, matmul_first) / LAYERS)
    kv_bytes = sum(meta.seq_lens_cpu) * 2 * KV_HEADS * HEAD_DIM * FP32_BYTES  # K and V of one layer
    ms = {key: statistics.median(t) / MS for key, t in times.items()}
    err = max((outs[name] - outs["torch"]).abs().max().item() for name in arms)
    return {
        "machine": machine(), "baseline": baseline, "rows": ROWS, "context": [MIN_CONTEXT, MAX_CONTEXT], "layers": LAYERS, "rounds": rounds,
        "kv_mb_per_layer": kv_bytes / 1e6, "read_gbps": statistics.median(read_gbps), "max_abs_diff_vs_torch": err,
        "arms": {name: {"ms_per_layer": ms[name, False], "gbps": kv_bytes / (ms[name, False] * MS) / GIGA,
                        "x_vs_torch": ms["torch", False] / ms[name, False],
                        "x_vs_baseline": ms["kernel@baseline", False] / ms[name, False],
                        "ms_per_layer_after_matmul": ms[name, True]}
                 for name in arms},
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    p.add_argument("--baseline", default=DEFAULT_BASELINE, help="git revision of the kernel to compare against")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    result = run(args.rounds, args.baseline)
    rows = [[n, a["ms_per_layer"], a["gbps"], a["x_vs_baseline"], a["x_vs_torch"], a["ms_per_layer_after_matmul"]]
            for n, a in result["arms"].items()]  # fmt: skip
    print_table(f"decode attention, {ROWS} rows at context {MIN_CONTEXT}-{MAX_CONTEXT}, "
                f"{result['kv_mb_per_layer']:.1f} MB of K/V a layer (medians of {args.rounds} rounds)",
                ["arm", "ms/layer", "GB/s", f"x {args.baseline}", "x torch", "ms/layer after a matmul"], rows)  # fmt: skip
    print(f"machine read bandwidth (sum over {SUM_BYTES >> 20} MB): {result['read_gbps']:.1f} GB/s")
    print(f"max |difference| from torch: {result['max_abs_diff_vs_torch']:.2e}")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
