"""Where an ipc weight push's time goes on the engine's side (diagnostic, GPU only).

A spawned child holds the weights of a random shape on the GPU and hands their CUDA IPC
handles to this process, which times each phase of taking them apart: unpickling the handle
list, opening the handles (first and again), and copying the opened tensors into plain
device tensors, into tensors of a virtual-memory arena (where the engine keeps its weights),
and the same copies between two of this process's own tensors as the reference.

``python -m siesta.bench.ipc_probe --model random:llama-3-8b``
"""

from __future__ import annotations

import argparse
import base64
import json
import pickle
import time
from typing import Any

import torch
import torch.multiprocessing as mp

REPS = 5


def _child(model: str, conn: Any) -> None:
    from torch.multiprocessing.reductions import reduce_tensor

    from siesta.model.loader import resolve_model

    torch.cuda.set_device(0)
    tensors = [t for _, t in resolve_model(model).iter_weights(torch.bfloat16, "cuda")]
    torch.cuda.synchronize()
    conn.send(base64.b64encode(pickle.dumps([reduce_tensor(t)[1] for t in tensors])).decode())
    conn.recv()  # hold the tensors until the parent is done


def _timed(fn, reps: int = REPS) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from siesta.core.vmm import VirtualArena
    from siesta.weight_transfer.handles import unpickle_handles

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-3-8b")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(args.model, child), daemon=True)
    proc.start()
    payload = parent.recv()
    out: dict[str, Any] = {"payload_chars": len(payload)}
    t0 = time.perf_counter()
    handles = unpickle_handles(payload)
    out["unpickle_ms"] = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    shared = [rebuild_cuda_tensor(*h) for h in handles]
    torch.cuda.synchronize()
    out["first_open_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = [rebuild_cuda_tensor(*h) for h in handles]  # torch's cache: no new open
    out["reopen_ms"] = (time.perf_counter() - t0) * 1e3
    del again
    nbytes = sum(t.numel() * t.element_size() for t in shared)
    out["tensors"], out["bytes"] = len(shared), nbytes
    plain = [torch.empty_like(t) for t in shared]
    arena = VirtualArena(nbytes + 256 * len(shared), torch.device("cuda", 0))
    placed, offset = [], 0
    for t in shared:
        n = t.numel() * t.element_size()
        placed.append(arena.tensor[offset : offset + n].view(t.dtype).view(t.shape))
        offset += -(-n // 256) * 256
    own = [torch.empty_like(t) for t in shared]
    for name, src, dst in [("ipc_to_plain", shared, plain), ("ipc_to_arena", shared, placed),
                           ("plain_to_plain", plain, own), ("plain_to_arena", plain, placed),
                           ("arena_to_plain", placed, own)]:  # fmt: skip
        ms = _timed(lambda: [d.copy_(s) for s, d in zip(src, dst)]) * 1e3
        out[name + "_ms"] = ms
        out[name + "_GB_s"] = nbytes / ms / 1e6
    # Apart: reading the shared memory alone, writing the arena alone, a kernel (not a memcpy) copy.
    for name, fn in [("ipc_read", lambda: [s.amax() for s in shared]), ("arena_fill", lambda: [d.fill_(1) for d in placed]),
                     ("plain_read", lambda: [s.amax() for s in plain]),
                     ("ipc_to_arena_kernel", lambda: [torch.mul(s, 1, out=d) for s, d in zip(shared, placed)])]:  # fmt: skip
        ms = _timed(fn) * 1e3
        out[name + "_ms"] = ms
        out[name + "_GB_s"] = nbytes / ms / 1e6
    parent.send("done")
    proc.join(30)
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
