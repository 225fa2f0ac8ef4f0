"""The host's share of one eager attention call: Python only, every kernel launch stubbed out.

    python -m siesta.bench.attention_host [--calls 2000] [--repeats 3] [--json PATH]

A step with prefill rows runs attention eagerly between its piecewise graphs, once a layer; in
the kept resume's steps (4 decodes at 19.5k tokens beside a 44-token extend, Llama-3-8B heads,
fp8 cache) the device sat idle for 2.3-3.5 ms of a 12-16 ms step (H100 run 54b, ``mixed_step``),
waiting on the host. This times what siesta's own Python costs a layer on that batch (the KV
write, the split plans, the partial buffers, argument marshalling up to the launch), with
Triton's launch replaced by a no-op: the launcher's own cost is the same in every arm. Arms,
interleaved ``--repeats`` times: the launch sizes through ``siesta.host_ints`` (shipped) and
through ``triton.cdiv`` / ``triton.next_power_of_2`` (constexpr functions that unwrap every
argument through Triton's JIT machinery), with their ratio.
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager
from typing import Any

import torch
import triton

from siesta import host_ints
from siesta.attention import triton_kernels, triton_kv_write
from siesta.attention.base import AttentionMetadata, KVCache
from siesta.attention.triton_attention import TritonAttention
from siesta.bench.common import machine, median, print_table, write_json

# The kept resume's mixed step: four decodes and one extend, every context 19,500 tokens.
Q_LENS = (1, 1, 1, 1, 44)
CONTEXT = 19_500
BLOCK_SIZE = 128
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


class _NoLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid: Any):
        return lambda *args, **kwargs: None


@contextmanager
def _stubbed_launches():
    saved = {}
    for module in (triton_kernels, triton_kv_write):
        for name in dir(module):
            obj = getattr(module, name)
            if isinstance(obj, triton.runtime.KernelInterface):  # a jitted kernel, or the interpreter's stand-in
                saved[(module, name)] = obj
                setattr(module, name, _NoLaunch())
    try:
        yield
    finally:
        for (module, name), obj in saved.items():
            setattr(module, name, obj)


@contextmanager
def _triton_helpers():
    saved = host_ints.cdiv, host_ints.next_power_of_2
    host_ints.cdiv, host_ints.next_power_of_2 = triton.cdiv, triton.next_power_of_2
    try:
        yield
    finally:
        host_ints.cdiv, host_ints.next_power_of_2 = saved


def _batch() -> tuple[torch.Tensor, torch.Tensor, KVCache, AttentionMetadata]:
    starts = [0]
    for n in Q_LENS:
        starts.append(starts[-1] + n)
    blocks = host_ints.cdiv(CONTEXT, BLOCK_SIZE)
    reqs = len(Q_LENS)
    cache = KVCache.allocate(reqs * blocks, 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.float8_e4m3fn, "cpu")
    seq = [CONTEXT] * reqs
    meta = AttentionMetadata(
        torch.tensor(starts, dtype=torch.int32), torch.tensor(seq, dtype=torch.int32),
        torch.arange(reqs * blocks, dtype=torch.int32).view(reqs, blocks),
        torch.arange(starts[-1], dtype=torch.int64), max(Q_LENS), CONTEXT, starts, seq,
    )  # fmt: skip
    q = torch.randn(starts[-1], HEADS, HEAD_DIM, dtype=torch.bfloat16)
    kv = torch.randn(starts[-1], KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    return q, kv, cache, meta


def time_calls(calls: int) -> float:
    """Microseconds of host time per attention call (launches stubbed)."""
    q, kv, cache, meta = _batch()
    out = torch.empty_like(q)
    backend = TritonAttention()
    with _stubbed_launches():
        for _ in range(min(calls, 50)):
            backend.forward(q, kv, kv, cache, 0, meta, HEAD_DIM**-0.5, out=out)
        t0 = time.perf_counter()
        for _ in range(calls):
            backend.forward(q, kv, kv, cache, 0, meta, HEAD_DIM**-0.5, out=out)
    return (time.perf_counter() - t0) / calls * 1e6


def run(calls: int, repeats: int) -> dict[str, Any]:
    arms: dict[str, list[float]] = {"host_ints": [], "triton_helpers": []}
    for _ in range(repeats):
        arms["host_ints"].append(time_calls(calls))
        with _triton_helpers():
            arms["triton_helpers"].append(time_calls(calls))
    shipped, triton_us = median(arms["host_ints"]), median(arms["triton_helpers"])
    return {"machine": machine(), "batch": {"q_lens": list(Q_LENS), "context": CONTEXT, "heads": HEADS,
            "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "kv_dtype": "fp8_e4m3"}, "calls": calls,
            "us_per_call": arms, "host_ints_us": shipped, "triton_helpers_us": triton_us,
            "host_ints_over_triton_helpers": shipped / triton_us}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = run(args.calls, args.repeats)
    print_table("Attention host time a call (launches stubbed), the resume's mixed step",
                ["arm", "us a call (median)", "runs"],
                [["host_ints (shipped)", res["host_ints_us"], res["us_per_call"]["host_ints"]],
                 ["triton.cdiv / next_power_of_2", res["triton_helpers_us"], res["us_per_call"]["triton_helpers"]],
                 ["ratio", res["host_ints_over_triton_helpers"], ""]])  # fmt: skip
    write_json(args.json, res)


if __name__ == "__main__":
    main()
