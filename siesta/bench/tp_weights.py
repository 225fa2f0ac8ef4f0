"""What a tensor-parallel rank pays to take its slice of the full tensors a trainer sends,
against copying a shard that arrived already cut (what sending each rank only its shard buys).

Per rank of a random shape's decoder layers (the unfused Hugging Face tensors; the embedding
and head are left out, their row cuts are contiguous): the time of ``WeightTarget.write`` from
the full tensors (row cuts are contiguous ranges, o_proj's and down_proj's column cuts strided
reads), the time of copying pre-cut contiguous shards of the same bytes into the same
parameters, and tensor parallel 1's whole-tensor copies as the baseline. No process group is
needed: the ranks' models are built one after another in this process.

``python -m siesta.bench.tp_weights --shape llama-3-8b --layers 2 --tp 2 --device cuda``
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from siesta.attention.torch_ref import TorchAttention
from siesta.bench.common import median, print_table, write_json
from siesta.model import registry
from siesta.model.interface import CausalModel
from siesta.model.random_init import RANDOM_SHAPES, parameter_layout
from siesta.model.weights import WeightTarget
from siesta.parallel import TensorParallel

REPS = 5
MAX_POSITIONS = 16  # rotary tables only; nothing runs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], None], device: torch.device, reps: int) -> float:
    fn()  # warm: first-touch pages on the CPU, allocator and kernels on CUDA
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return median(times)


def _rank_model(config: Any, tp: TensorParallel, dtype: torch.dtype, device: torch.device) -> CausalModel:
    with torch.device("meta"):
        model = registry.build_model(config, MAX_POSITIONS, TorchAttention(), tp)
    return model.to(dtype=dtype).to_empty(device=device)


def measure(shape: str, layers: int, tp_size: int, device: torch.device, dtype: torch.dtype, reps: int) -> dict:
    config = RANDOM_SHAPES[shape].config()
    config.num_hidden_layers = layers
    full = {
        name: torch.randn(dims, dtype=dtype, device=device)
        for name, dims in parameter_layout(config)
        if ".layers." in name
    }
    full_bytes = sum(t.numel() * t.element_size() for t in full.values())
    rows = []
    for tp in [TensorParallel(0, 1)] + [TensorParallel(r, tp_size) for r in range(tp_size)]:
        model = _rank_model(config, tp, dtype, device)
        params = model.parameter_table()
        targets: list[tuple[WeightTarget, torch.Tensor]] = [(model.weight_target(n, params), t) for n, t in full.items()]
        # Per cut: a stacked expert tensor pushed whole lands in two ranges of each rank's (gate, up).
        shards = [(cut.dest, cut.of(tensor).contiguous()) for target, tensor in targets for cut in target.cuts]
        shard_bytes = sum(s.numel() * s.element_size() for _, s in shards)

        def slice_full(targets=targets) -> None:
            with torch.no_grad():
                for target, tensor in targets:
                    target.write(tensor)

        def copy_shards(shards=shards) -> None:
            with torch.no_grad():
                for dest, shard in shards:
                    dest.copy_(shard)

        sliced, pre_cut = _timed(slice_full, device, reps), _timed(copy_shards, device, reps)
        rows.append({
            "tp_size": tp.size, "rank": tp.rank, "bytes_kept": shard_bytes,
            "slice_full_s": sliced, "copy_shard_s": pre_cut,
            "slice_GBps": shard_bytes / sliced / 1e9, "shard_GBps": shard_bytes / pre_cut / 1e9,
        })  # fmt: skip
        del model, targets, shards
    return {"shape": shape, "layers": layers, "dtype": str(dtype), "device": str(device), "tensors": len(full),
            "full_bytes": full_bytes, "reps": reps, "threads": torch.get_num_threads(), "ranks": rows}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3-8b", choices=sorted(RANDOM_SHAPES))
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--reps", type=int, default=REPS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = measure(args.shape, args.layers, args.tp, torch.device(args.device), getattr(torch, args.dtype), args.reps)
    table = [
        [r["tp_size"], r["rank"], r["bytes_kept"] / 1e6, r["slice_full_s"] * 1e3, r["copy_shard_s"] * 1e3,
         r["slice_GBps"], r["shard_GBps"]]
        for r in result["ranks"]
    ]  # fmt: skip
    print_table(
        f"{args.shape}, {args.layers} layers, {args.dtype} on {args.device}: a rank's copy of its slice",
        ["tp", "rank", "MB kept", "slice full (ms)", "copy shard (ms)", "slice GB/s", "shard GB/s"],
        table,
    )
    write_json(args.json, result)


if __name__ == "__main__":
    main()
