"""CPU prefill attention: torch's flash SDPA (the torch path) against the compiled kernel.

    python -m siesta.bench.cpu_prefill [--rounds 5] [--march x86-64-v3] [--json out.json]

fp32, block size 16, a block-first cache on shuffled block ids, every request's K/V already
in it (as after the step's writes). The cases are the chunks a step attends: whole prompts
of the throughput bench's lengths, a chunk after a cached prefix, and one step of the
prefill-heavy mix, at SmolLM2-135M's heads (9 query, 3 KV, head_dim 64, 30 layers), and one
prompt at Llama-3-8B's (32 query, 8 KV, head_dim 128, a few layers). Each arm attends every
layer once per round; arms take turns, so machine noise hits them alike, and the medians over
rounds are reported with the causal GFLOP/s (4 x heads x head_dim per query-key pair seen).

``--march`` builds the kernel for another target than this machine (``x86-64-v3``: AVX2 and
FMA, as on CPUs without AVX-512). ``MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2``
hold torch's flash SDPA (MKL's sgemm and ATen's vectorized softmax) to the same.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from siesta.attention.base import AttentionMetadata, KVCache
from siesta.attention.cpu_attention import CpuAttention, load_prefill_kernel
from siesta.attention.torch_ref import TorchAttention
from siesta.bench.common import machine, print_table, write_json
from siesta.c_kernels import NATIVE
from siesta.cpu_info import isa_limits

BLOCK_SIZE = 16
SEED = 0
DEFAULT_ROUNDS = 5
GIGA = 1e9
MS = 1e-3
ARMS = ("torch", "kernel")


@dataclass(frozen=True)
class Case:
    name: str
    chunks: tuple[tuple[int, int], ...]  # (new tokens, context) of each request
    q_heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    layers: int = 30


CASES = (
    Case("prompt 150", ((150, 150),)),
    Case("prompt 575", ((575, 575),)),
    Case("prompt 1000", ((1000, 1000),)),
    Case("prompt 2000", ((2000, 2000),)),
    Case("chunk 512 after 1536", ((512, 2048),)),
    Case("mix step: 4 prompts", ((230, 230), (870, 870), (512, 512), (436, 436))),
    Case("llama-8b heads, prompt 1000", ((1000, 1000),), q_heads=32, kv_heads=8, head_dim=128, layers=4),
)


def step(case: Case, seed: int) -> tuple[torch.Tensor, KVCache, AttentionMetadata]:
    """q, a random cache holding every request's context (new tokens too), and the step's metadata."""
    rng = random.Random(seed)
    blocks = [-(-ctx // BLOCK_SIZE) for _, ctx in case.chunks]
    cache = KVCache.allocate(sum(blocks), case.layers, BLOCK_SIZE, case.kv_heads, case.head_dim, torch.float32,
                             torch.device("cpu"))  # fmt: skip
    cache.tensor.normal_(generator=torch.Generator().manual_seed(seed))
    ids = list(range(cache.num_blocks))
    rng.shuffle(ids)
    tables = torch.zeros(len(blocks), max(blocks), dtype=torch.int32)
    starts, used = [0], 0
    for i, ((n, _), nb) in enumerate(zip(case.chunks, blocks)):
        tables[i, :nb] = torch.tensor(ids[used : used + nb])
        used += nb
        starts.append(starts[-1] + n)
    lens = [ctx for _, ctx in case.chunks]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables, slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int64),
        max_query_len=max(n for n, _ in case.chunks), max_seq_len=max(lens), query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
    )  # fmt: skip
    q = torch.randn(starts[-1], case.q_heads, case.head_dim, generator=torch.Generator().manual_seed(seed + 1))
    return q, cache, meta


def _new_slots(meta: AttentionMetadata, block_size: int) -> torch.Tensor:
    """Flat cache slots of every new token, in q's order."""
    slots = []
    for i, ctx in enumerate(meta.seq_lens_cpu):
        n = meta.query_start_loc_cpu[i + 1] - meta.query_start_loc_cpu[i]
        positions = torch.arange(ctx - n, ctx)
        slots.append(meta.block_tables[i, positions // block_size].long() * block_size + positions % block_size)
    return torch.cat(slots)


def causal_flops(case: Case) -> float:
    """Of one layer: QK^T and PV over every query-key pair a query sees."""
    pairs = sum(n * (ctx - n) + n * (n + 1) / 2 for n, ctx in case.chunks)
    return 4 * case.q_heads * case.head_dim * pairs


def time_case(case: Case, rounds: int, march: str = NATIVE) -> dict[str, Any]:
    q, cache, meta = step(case, SEED)
    rows, scale = list(range(meta.num_reqs)), case.head_dim**-0.5
    # The new tokens' K/V of every layer, as the torch path takes them beside the cache.
    slots = _new_slots(meta, cache.block_size)
    new_kv = [[c.reshape(-1, *c.shape[2:])[slots] for c in cache.layer(layer)] for layer in range(case.layers)]
    backends = {"torch": TorchAttention(), "kernel": CpuAttention(prefill_kernel=load_prefill_kernel(march))}
    outs = {name: torch.empty_like(q) for name in ARMS}

    def all_layers(name: str) -> None:
        for layer in range(case.layers):
            k, v = new_kv[layer]
            backends[name]._prefill_rows(q, k, v, cache, layer, meta, scale, rows, outs[name])

    for name in ARMS:  # warm-up: the kernel's build, first touch
        all_layers(name)
    times: dict[str, list[float]] = {name: [] for name in ARMS}
    for _ in range(rounds):
        for name in ARMS:
            t0 = time.perf_counter()
            all_layers(name)
            times[name].append((time.perf_counter() - t0) / case.layers)
    ms = {name: statistics.median(t) / MS for name, t in times.items()}
    flops = causal_flops(case)
    return {
        "chunks": case.chunks, "heads": [case.q_heads, case.kv_heads, case.head_dim], "layers": case.layers,
        "max_abs_diff": (outs["kernel"] - outs["torch"]).abs().max().item(),
        "arms": {name: {"ms_per_layer": v, "gflops": flops / (v * MS) / GIGA} for name, v in ms.items()},
        "x_vs_torch": ms["torch"] / ms["kernel"],
    }  # fmt: skip


def run(rounds: int, march: str = NATIVE) -> dict[str, Any]:
    if load_prefill_kernel(march) is None:
        raise SystemExit("the prefill kernel did not build (see the log): nothing to compare")
    return {"machine": machine(), "rounds": rounds, "threads": torch.get_num_threads(), "march": march,
            "isa_limits": isa_limits(),
            "cases": {case.name: time_case(case, rounds, march) for case in CASES}}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    p.add_argument("--march", default=NATIVE, help="the kernel's target (gcc's -march), e.g. x86-64-v3 for AVX2")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    result = run(args.rounds, args.march)
    rows = [[name, c["arms"]["torch"]["ms_per_layer"], c["arms"]["kernel"]["ms_per_layer"],
             c["arms"]["torch"]["gflops"], c["arms"]["kernel"]["gflops"], c["x_vs_torch"], c["max_abs_diff"]]
            for name, c in result["cases"].items()]  # fmt: skip
    print_table(f"prefill attention, fp32, {result['threads']} threads, kernel for -march={args.march} "
                f"(medians of {args.rounds} rounds)",
                ["case", "torch ms/layer", "kernel ms/layer", "torch GFLOP/s", "kernel GFLOP/s", "x torch",
                 "max |diff|"], rows)  # fmt: skip
    write_json(args.json, result)


if __name__ == "__main__":
    main()
