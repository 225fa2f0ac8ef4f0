"""Both sides of a CUDA IPC weight push, timed and profiled, on a mixture-of-experts shape cut to
``--layers`` layers (what fits twice on the card).

The engine is an in-process ``LLM`` in a spawned child that takes the sender's calls over a pipe
(no HTTP, so its own seconds and profile are its alone); the trainer is this process. Arms:

- the trainer's layout: per expert, as checkpoints and Megatron/transformers-4 trainers name
  the experts (``mlp.experts.E.{gate,up,down}_proj.weight``, ~390 tensors a layer), or stacked
  as transformers 5 models hold them (``mlp.experts.gate_up_proj`` / ``down_proj``);
- the engine's copies: multi-tensor launches under ``updater.FOREACH_MAX_BYTES`` or one each;
  and, as before the model kept its bound targets, every target bound again on every push;
- beside them, a device copy of the same tensors in this process, one copy each and by
  ``_foreach_copy_``.

    python -m siesta.bench.push_profile --layers 10 --json out.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import multiprocessing as mp
import pstats
import re
import statistics
import tempfile
import time
from typing import Any

import torch

from siesta.bench.common import cut_model

LAYOUTS = ("per_expert", "stacked")
COPY_ARMS = ("foreach", "one_each")
# The engine's arms: (FOREACH_MAX_BYTES, None for the updater's own; bind every target again).
ENGINE_ARMS = {"foreach": (None, False), "one_each": (0, False), "foreach_rebound": (None, True)}
PROFILE_ROWS = 22
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _profile_text(prof: cProfile.Profile) -> str:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(PROFILE_ROWS)
    return out.getvalue()


def _engine(conn: Any, model: str, device: str) -> None:
    """The child: an LLM that runs the calls it is sent, timing (and on request profiling) each."""
    from siesta import LLM
    from siesta.weight_transfer import updater

    default = updater.FOREACH_MAX_BYTES
    llm = LLM(model, dtype="bfloat16", device=device, kv_cache_bytes=1 << 30, max_model_len=512, enforce_eager=True,
              weight_transfer_config={"backend": "ipc"})  # fmt: skip
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        verb, args, profile, (foreach, rebind) = msg
        updater.FOREACH_MAX_BYTES = default if foreach is None else foreach
        if rebind:  # as before targets were kept: every push binds each one again
            llm.engine.runner.model.__dict__.pop("_bound_targets", None)
        prof = cProfile.Profile() if profile else None
        t0 = time.perf_counter()
        try:
            if prof:
                prof.enable()
            out, error = getattr(llm, verb)(*args), None
        except Exception as e:  # noqa: BLE001 - handed to the trainer
            out, error = None, f"{type(e).__name__}: {e}"
        finally:
            if prof:
                prof.disable()
        conn.send((out, error, time.perf_counter() - t0, _profile_text(prof) if prof else None))


class _PipeEngine:
    """The four weight-transfer calls, forwarded to the child; its seconds per update_weights kept."""

    def __init__(self, conn: Any) -> None:
        self.conn, self.profile, self.arm = conn, False, ENGINE_ARMS["foreach"]
        self.update_s: list[float] = []
        self.profiles: list[str] = []

    def _call(self, verb: str, *args: Any) -> Any:
        profile = self.profile and verb == "update_weights"
        self.conn.send((verb, args, profile, self.arm))
        out, error, seconds, text = self.conn.recv()
        if error:
            raise RuntimeError(f"the engine's {verb}: {error}")
        if verb == "update_weights":
            self.update_s.append(seconds)
        if text:
            self.profiles.append(text)
        return out

    def __getattr__(self, verb: str) -> Any:
        return lambda *args: self._call(verb, *args)


def stacked(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> transformers 5's stacked ``gate_up_proj`` ``[E, 2I, H]`` (gate rows,
    then up) and ``down_proj`` ``[E, H, I]`` per layer; the rest as they are. Frees as it goes."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name in list(tensors):
        m = _EXPERT.match(name)
        if m is None:
            out[name] = tensors.pop(name)
            continue
        groups.setdefault(m["prefix"], {}).setdefault(m["proj"], {})[int(m["e"])] = tensors.pop(name)
    for prefix, projs in groups.items():
        experts = sorted(projs["gate_proj"])
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]]) for e in experts])  # fmt: skip
        out[f"{prefix}.down_proj"] = torch.stack([projs["down_proj"][e] for e in experts])
        projs.clear()
    return out


def device_copies(tensors: dict[str, torch.Tensor], device: str, reps: int) -> dict[str, Any]:
    """One copy each and one ``_foreach_copy_``, into fresh tensors (p50 of ``reps`` after a warm-up)."""
    srcs = list(tensors.values())
    dsts = [torch.empty_like(t) for t in srcs]
    nbytes = sum(t.numel() * t.element_size() for t in srcs)
    res: dict[str, Any] = {}
    for arm in COPY_ARMS:
        times = []
        for _ in range(reps + 1):
            _sync(device)
            t0 = time.perf_counter()
            if arm == "foreach":
                torch._foreach_copy_(dsts, srcs)
            else:
                for d, s in zip(dsts, srcs):
                    d.copy_(s)
            _sync(device)
            times.append(time.perf_counter() - t0)
        p50 = statistics.median(times[1:])
        res[arm] = {"p50_ms": p50 * 1e3, "GB_s": nbytes / p50 / 1e9}
    del dsts
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return res


def pushes(engine: _PipeEngine, tensors: dict[str, torch.Tensor], reps: int) -> dict[str, Any]:
    """Per copy arm, ``reps`` pushes after a first: wall p50, the engine's update_weights p50, the
    rest (the trainer's side and the pipe); the last push of each arm profiled on both sides."""
    from siesta.weight_transfer import WeightSender

    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    sender = WeightSender(engine, "ipc")
    sender.init()
    sender.push(tensors)  # the first opens the handles
    res: dict[str, Any] = {"tensors": len(tensors), "bytes": nbytes}
    for arm, engine_arm in ENGINE_ARMS.items():
        engine.arm, engine.update_s, engine.profiles, walls = engine_arm, [], [], []
        for i in range(reps + 1):
            engine.profile = i == reps
            trainer = cProfile.Profile() if engine.profile else None
            t0 = time.perf_counter()
            if trainer:
                trainer.enable()
            sender.push(tensors)
            if trainer:
                trainer.disable()
            walls.append(time.perf_counter() - t0)
        wall, update = statistics.median(walls[:-1]), statistics.median(engine.update_s[:-1])
        res[arm] = {"push_p50_ms": wall * 1e3, "GB_s": nbytes / wall / 1e9, "engine_update_p50_ms": update * 1e3,
                    "trainer_and_pipe_p50_ms": (wall - update) * 1e3, "engine_profile": engine.profiles[-1],
                    "trainer_profile": _profile_text(trainer)}  # fmt: skip
    sender.close()
    return res


def run(args: argparse.Namespace) -> dict[str, Any]:
    from siesta.model.loader import resolve_model

    out: dict[str, Any] = {"model": args.model, "layers": args.layers, "device": args.device}
    with tempfile.TemporaryDirectory(prefix="siesta-push-profile-") as folder:
        model = cut_model(args.model, args.layers, folder)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_engine, args=(child, model, args.device), daemon=True)
        proc.start()
        try:
            if parent.recv() != "ready":
                raise RuntimeError("the engine did not start")
            engine = _PipeEngine(parent)
            for layout in args.layouts:
                tensors = dict(resolve_model(f"{model}@1").iter_weights(torch.bfloat16, args.device))  # another seed
                if layout == "stacked":
                    tensors = stacked(tensors)
                out[layout] = {"device_copy": device_copies(tensors, args.device, args.reps)}
                out[layout] |= pushes(engine, tensors, args.reps)
                del tensors
        finally:
            parent.send(None)
            proc.join(30)
    return out


def summary(res: dict[str, Any]) -> list[str]:
    lines = []
    for layout in LAYOUTS:
        cell = res.get(layout)
        if not cell:
            continue
        copies = cell["device_copy"]
        lines.append(f"{layout}: {cell['tensors']} tensors, {cell['bytes'] / 1e9:.1f} GB; device copy one each "
                     f"{copies['one_each']['p50_ms']:.1f} ms, foreach {copies['foreach']['p50_ms']:.1f} ms")  # fmt: skip
        for arm in ENGINE_ARMS:
            p = cell[arm]
            lines.append(f"  engine {arm}: push {p['push_p50_ms']:.0f} ms ({p['GB_s']:.0f} GB/s, "
                         f"{copies['one_each']['p50_ms'] / p['push_p50_ms']:.2f} of the one-each "
                         f"device copy), engine {p['engine_update_p50_ms']:.0f} ms, trainer + pipe "
                         f"{p['trainer_and_pipe_p50_ms']:.0f} ms")  # fmt: skip
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=10,
                    help="the shape cut to this many layers: the trainer's copy, its device copy and the engine's "
                         "hold them three times (10 of Qwen3-30B-A3B's fit 80 GB, 20 did not)")  # fmt: skip
    ap.add_argument("--layouts", default=",".join(LAYOUTS), type=lambda s: s.split(","))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profiles", action="store_true", help="print both sides' profiles")
    args = ap.parse_args()
    res = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    for layout in LAYOUTS:
        for arm in ENGINE_ARMS if args.profiles and layout in res else ():
            print(f"== {layout}, {arm}: engine\n{res[layout][arm]['engine_profile']}")
            print(f"== {layout}, {arm}: trainer\n{res[layout][arm]['trainer_profile']}")
    print("\n".join(summary(res)))


if __name__ == "__main__":
    main()
