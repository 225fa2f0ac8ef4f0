"""The host's share of eager attention a layer, over a whole step of layers.

    python -m siesta.bench.attention_host [--steps 100] [--layers 32] [--repeats 3] [--json PATH]

A step with prefill rows runs attention eagerly between its piecewise graphs, once a layer; in
the kept resume's steps (4 decodes at 19.5k tokens beside a 44-token extend, Llama-3-8B heads,
fp8 cache) the device sat idle for 2.3-3.5 ms of a 12-16 ms step (H100 run 54b, ``mixed_step``),
waiting on the host. Every layer of a step shares one metadata, and what attention derives from
it (the split plans, the partial buffers) is derived by the first layer and read back by the
others (``AttentionMetadata.step_cache``). Arms, interleaved ``--repeats`` times, each the mean
over ``--steps`` steps of ``--layers`` layers:

* ``stubbed``: siesta's Python alone, every Triton launch replaced by a no-op;
* ``stubbed_every_layer``: the same with a fresh metadata every layer, so every layer derives
  its plans anew (what each layer paid before the step cache);
* on CUDA, ``launched`` and ``launched_every_layer``: the same with the real launches, Triton's
  launcher included, over a ``LAUNCHED_CONTEXT``-token context (512: short, so the device keeps
  up and the wall time is the host's).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from contextlib import contextmanager, nullcontext
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
LAUNCHED_CONTEXT = 512
BLOCK_SIZE = 128
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
LAYERS = 32  # Llama-3-8B


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


def _batch(context: int, device: str) -> tuple[torch.Tensor, torch.Tensor, KVCache, AttentionMetadata]:
    starts = [0]
    for n in Q_LENS:
        starts.append(starts[-1] + n)
    blocks = host_ints.cdiv(context, BLOCK_SIZE)
    reqs = len(Q_LENS)
    cache = KVCache.allocate(reqs * blocks, 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.float8_e4m3fn, device)
    seq = [context] * reqs
    meta = AttentionMetadata(
        torch.tensor(starts, dtype=torch.int32, device=device), torch.tensor(seq, dtype=torch.int32, device=device),
        torch.arange(reqs * blocks, dtype=torch.int32, device=device).view(reqs, blocks),
        torch.arange(starts[-1], dtype=torch.int64, device=device), max(Q_LENS), context, starts, seq,
    )  # fmt: skip
    q = torch.randn(starts[-1], HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    kv = torch.randn(starts[-1], KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    return q, kv, cache, meta


def time_layers(steps: int, layers: int, every_layer: bool, launched: bool) -> float:
    """Microseconds of host time a layer: ``steps`` steps of ``layers`` attention calls, one
    metadata a step (or a fresh one every layer: ``every_layer``), launches stubbed unless
    ``launched`` (CUDA)."""
    device = "cuda" if launched else "cpu"
    q, kv, cache, meta = _batch(LAUNCHED_CONTEXT if launched else CONTEXT, device)
    out = torch.empty_like(q)
    backend = TritonAttention()
    # Fresh step caches made ahead, each dropped once used (as a step's metadata is), so the
    # timed loop neither copies metadata nor holds every step's scratch buffers.
    metas = [dataclasses.replace(meta) for _ in range(steps * (layers if every_layer else 1))]

    def step() -> None:
        m = metas.pop()
        for layer in range(layers):
            if every_layer and layer:
                m = metas.pop()
            backend.forward(q, kv, kv, cache, 0, m, HEAD_DIM**-0.5, out=out)

    with nullcontext() if launched else _stubbed_launches():
        for _ in range(3):  # warm-up (compiles the kernels when launched)
            backend.forward(q, kv, kv, cache, 0, dataclasses.replace(meta), HEAD_DIM**-0.5, out=out)
        if launched:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if launched:
            torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (steps * layers) * 1e6


def run(steps: int, layers: int, repeats: int) -> dict[str, Any]:
    arms: dict[str, list[float]] = {"stubbed": [], "stubbed_every_layer": []}
    if torch.cuda.is_available():
        arms |= {"launched": [], "launched_every_layer": []}
    for _ in range(repeats):
        for arm, times in arms.items():
            times.append(time_layers(steps, layers, arm.endswith("every_layer"), arm.startswith("launched")))
    us = {arm: median(times) for arm, times in arms.items()}
    ratios = {arm: us[arm] / us[f"{arm}_every_layer"] for arm in arms if not arm.endswith("every_layer")}
    return {"machine": machine(), "batch": {"q_lens": list(Q_LENS), "context": CONTEXT,
            "launched_context": LAUNCHED_CONTEXT, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
            "kv_dtype": "fp8_e4m3"}, "steps": steps, "layers": layers, "us_per_layer_runs": arms,
            "us_per_layer": us, "step_cache_over_every_layer": ratios}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = run(args.steps, args.layers, args.repeats)
    us, runs = res["us_per_layer"], res["us_per_layer_runs"]
    rows = [[arm, us[arm], runs[arm]] for arm in us]
    rows += [[f"{arm}: step cache / every layer", r, ""] for arm, r in res["step_cache_over_every_layer"].items()]
    print_table("Attention host time a layer, the resume's mixed step", ["arm", "us a layer (median)", "runs"], rows)
    write_json(args.json, res)


if __name__ == "__main__":
    main()
