"""Weight pushes from a trainer process into a served engine, beside the copies they replace.

This process is the trainer; the engine is ``siesta serve`` in a subprocess, driven over
HTTP as an RL framework drives it, so CUDA IPC really crosses processes. One run measures:

- ``plain_copy``: the trainer's tensors copied into same-shaped bf16 tensors in this process
  (the ceiling); ``plain_cast_copy`` the same from fp32 masters (a cast on copy);
- ``ipc_first``: the first ``ipc`` push (the engine opens the handles for the first time);
- ``ipc``: later pushes of the same bf16 tensors, unpacked (p50);
- ``ipc_fp32``: pushes of fp32 masters (the engine casts on copy);
- ``ipc_packed``: pushes packed into a persistent device buffer (512 MiB buckets);
- ``rl_step``: the engine's part of an RL step: sleep(level=2), wake_up(weights), push,
  finish, wake_up(kv_cache), with the engine's own seconds from /metrics;
- ``correctness``: the engine's greedy logprobs after a push against transformers' on the
  trainer's tensors; fp32 and RL-step pushes must give the bf16 push's logprobs exactly;
- ``nccl``: trainer on one GPU, engine on another: a push against a plain
  ``torch.distributed`` broadcast of the same bytes (needs 2 GPUs; on the CPU it runs on gloo,
  as a smoke test of the same code).

GB/s are bytes over wall seconds; ``of_plain_copy`` is the arm's GB/s over the plain copy's.
``python -m siesta.bench.weight_transfer --model random:llama-3-8b --json out.json``; also
the ``weight_transfer`` section of ``siesta.bench.gpu``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from siesta.bench.common import median, print_table, random_prompts

# Options of this bench (``--reps`` sets ``wt_reps``); siesta.bench.gpu's namespace lacks
# them, so its section runs with these defaults.
DEFAULTS: dict[str, Any] = {
    "wt_reps": 10,  # timed pushes per arm after the first
    "wt_arm_time_s": 30.0,  # stop repeating an arm after this
    "wt_kv_cache_bytes": 4 << 30,
    "wt_engine_max_model_len": 4096,
    "wt_bucket_bytes": 512 << 20,
    "wt_rl_steps": 3,
    "wt_prompt_len": 32,
    "wt_check_tokens": 8,
    "wt_engine_flags": "",  # more `siesta serve` flags, e.g. "--enforce-eager"
    "wt_nccl_device": "cuda:1",
    "wt_startup_timeout_s": 600.0,
    "wt_skip_nccl": False,
}
HEALTH_POLL_S = 0.25
STOP_TIMEOUT_S = 30.0
LOG_TAIL_CHARS = 4000
GOAL_PUSH_MS = 25.0
GOAL_FIRST_PUSH_S = 4.0
GOAL_RL_STEP_S = 0.5
GOAL_NCCL_OF_BROADCAST = 0.8
GB = 1e9
TRANSFER_SECONDS = 'siesta_weight_transfer_seconds_total{{backend="{}"}}'
TRANSFER_BYTES = 'siesta_weight_transfer_bytes_total{{backend="{}"}}'


def _opts(args: argparse.Namespace) -> SimpleNamespace:
    o = SimpleNamespace(**{k: getattr(args, k, v) for k, v in DEFAULTS.items()})
    o.model = getattr(args, "model", None) or "random:llama-3-8b"
    device = getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    o.device = torch.device(device)
    if o.device.type == "cuda" and o.device.index is None:
        o.device = torch.device("cuda", torch.cuda.current_device())
    return o


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


# -- the served engine ---------------------------------------------------------------------


@dataclass
class ServedEngine:
    url: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(o: SimpleNamespace, device: str, backend: str) -> ServedEngine:
    """``siesta serve`` in a subprocess with the weight-transfer backend, healthy or raising."""
    import httpx

    port = _free_port()
    log_path = Path(tempfile.mkdtemp(prefix="siesta-wt-bench-")) / "server.log"
    cmd = [sys.executable, "-m", "siesta.entrypoints.cli", "serve", o.model, "--port", str(port), "--dev-mode",
           "--device", device, "--dtype", "bfloat16", "--kv-cache-bytes", str(int(o.wt_kv_cache_bytes)),
           "--max-model-len", str(o.wt_engine_max_model_len), "--log-level", "warning",
           "--weight-transfer-config", json.dumps({"backend": backend}), *shlex.split(o.wt_engine_flags)]  # fmt: skip
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")  # the trainer shares the cores
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    engine = ServedEngine(f"http://127.0.0.1:{port}", process, log_path)
    deadline = time.monotonic() + o.wt_startup_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"siesta serve exited with {process.returncode}:\n{engine.log_tail()}")
        try:
            if httpx.get(f"{engine.url}/health", timeout=2.0).status_code == 200:
                return engine
        except httpx.TransportError:
            pass
        time.sleep(HEALTH_POLL_S)
    engine.stop()
    raise RuntimeError(f"siesta serve was not healthy within {o.wt_startup_timeout_s:.0f}s:\n{engine.log_tail()}")


class TimedClient:
    """The engine client, each call timed (name, seconds); update payload sizes noted while
    ``count_payload`` (encoding the payload to count it costs the trainer's side 25+ ms a push
    of ~19k tensors, so pushes that are timed leave it off)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.calls: list[tuple[str, float]] = []
        self.payload_chars = 0
        self.count_payload = True

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.client, name)
        if not callable(fn):
            return fn

        def call(*a: Any, **kw: Any) -> Any:
            if self.count_payload and name == "update_weights" and a and isinstance(a[0], dict):
                self.payload_chars += len(json.dumps(a[0]))
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.calls.append((name, time.perf_counter() - t0))

        return call


def _metric(client: Any, key: str) -> float:
    return float(client.metrics().get(key, 0.0))


def _engine_logprobs(client: Any, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    out = client.completions(prompt, max_tokens=n, temperature=0.0, logprobs=1, ignore_eos=True, return_token_ids=True)
    choice = out["choices"][0]
    return list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]


# -- arms ----------------------------------------------------------------------------------


def _copy_arm(srcs: list[torch.Tensor], dtype: torch.dtype, reps: int, device: torch.device) -> dict[str, Any]:
    """Copies of ``srcs`` into fresh same-shaped ``dtype`` tensors, in this process (p50)."""
    dsts = [torch.empty(s.shape, dtype=dtype, device=s.device) for s in srcs]
    times = []
    for rep in range(reps + 1):  # the first warms up
        _sync(device)
        t0 = time.perf_counter()
        for s, d in zip(srcs, dsts):
            d.copy_(s)
        _sync(device)
        if rep:
            times.append(time.perf_counter() - t0)
    read = sum(s.numel() * s.element_size() for s in srcs)
    written = sum(d.numel() * d.element_size() for d in dsts)
    del dsts
    p50 = median(times)
    return {"bytes": read, "written_bytes": written, "tensors": len(srcs), "p50_ms": p50 * 1e3,
            "min_ms": min(times) * 1e3, "GB_s": read / p50 / GB}  # fmt: skip


def _push_arm(
    client: Any, tensors: dict[str, torch.Tensor], o: SimpleNamespace, backend: str = "ipc", **sender_kw: Any
) -> dict[str, Any]:
    """The first push of ``tensors`` and up to ``wt_reps`` more: wall, the engine's own
    receive seconds (/metrics), each HTTP call's seconds and the trainer's own part."""
    from siesta.weight_transfer import WeightSender

    timed = TimedClient(client)
    sender = WeightSender(timed, backend, **sender_kw)
    nbytes = _nbytes(tensors)
    pushes: list[dict[str, Any]] = []
    try:
        t0 = time.perf_counter()
        sender.init()
        init_s = time.perf_counter() - t0
        started = time.perf_counter()
        for i in range(o.wt_reps + 1):
            engine_s0 = _metric(client, TRANSFER_SECONDS.format(backend))
            timed.calls.clear()
            timed.payload_chars, timed.count_payload = 0, i == 0  # the first push's; p50 is of the rest
            t0 = time.perf_counter()
            version = sender.push(tensors)
            wall = time.perf_counter() - t0
            engine_s = _metric(client, TRANSFER_SECONDS.format(backend)) - engine_s0
            calls: dict[str, float] = {}
            for name, s in timed.calls:
                calls[name] = calls.get(name, 0.0) + s
            pushes.append({"wall_s": wall, "engine_receive_s": engine_s, "calls_s": calls,
                           "trainer_side_s": wall - sum(calls.values()), "payload_chars": timed.payload_chars,
                           "version": version})  # fmt: skip
            if i and time.perf_counter() - started > o.wt_arm_time_s:
                break
    finally:
        sender.close()
    first, later = pushes[0], pushes[1:] or pushes[:1]
    p50 = median([p["wall_s"] for p in later])
    receive = median([p["engine_receive_s"] for p in later])
    names = sorted({n for p in later for n in p["calls_s"]})
    return {
        "bytes": nbytes,
        "tensors": len(tensors),
        "init_s": init_s,
        "first_s": first["wall_s"],
        "first_GB_s": nbytes / first["wall_s"] / GB,
        "first_engine_receive_s": first["engine_receive_s"],
        "pushes": len(later),
        "push_ms": [round(p["wall_s"] * 1e3, 3) for p in later],
        "p50_ms": p50 * 1e3,
        "GB_s": nbytes / p50 / GB,
        "engine_receive_ms_p50": receive * 1e3,
        "engine_receive_GB_s": nbytes / receive / GB if receive > 0 else None,
        "calls_ms_p50": {n: median([p["calls_s"].get(n, 0.0) for p in later]) * 1e3 for n in names},
        "trainer_side_ms_p50": median([p["trainer_side_s"] for p in later]) * 1e3,
        "update_payload_chars": first["payload_chars"],
        "weight_version": later[-1]["version"],
    }


def _rl_step_arm(client: Any, tensors: dict[str, torch.Tensor], o: SimpleNamespace) -> dict[str, Any]:
    """sleep(2) -> wake_up(weights) -> push -> finish -> wake_up(kv_cache), timed part by part."""
    from siesta.weight_transfer import WeightSender

    sender = WeightSender(client, "ipc")
    sender.init()
    steps = []
    keys = {"sleep_seconds": "siesta_sleep_seconds_total", "wake_seconds": "siesta_wake_seconds_total",
            "weight_transfer_seconds": TRANSFER_SECONDS.format("ipc")}  # fmt: skip
    try:
        for _ in range(o.wt_rl_steps):
            m0 = client.metrics()
            t0 = time.perf_counter()
            client.sleep(level=2)
            t1 = time.perf_counter()
            client.wake_up(tags=["weights"])
            t2 = time.perf_counter()
            sender.push(tensors)  # start, update, finish
            t3 = time.perf_counter()
            client.wake_up(tags=["kv_cache"])
            t4 = time.perf_counter()
            m1 = client.metrics()
            steps.append({"total_s": t4 - t0, "sleep_s": t1 - t0, "wake_weights_s": t2 - t1, "push_finish_s": t3 - t2,
                          "wake_kv_cache_s": t4 - t3,
                          "engine": {k: m1.get(v, 0.0) - m0.get(v, 0.0) for k, v in keys.items()}})  # fmt: skip
    finally:
        sender.close()
    parts = ("total_s", "sleep_s", "wake_weights_s", "push_finish_s", "wake_kv_cache_s")
    return {
        "bytes": _nbytes(tensors),
        "steps": steps,
        "p50_s": median([s["total_s"] for s in steps]),
        "parts_p50_s": {p: median([s[p] for s in steps]) for p in parts},
        "engine_p50_s": {k: median([s["engine"][k] for s in steps]) for k in keys},
        "asleep_after": client.is_sleeping(),
    }


def _hf_reference(source: Any, tensors: dict[str, torch.Tensor], device: torch.device, ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities at every position of ``ids``, on the trainer's tensors."""
    from transformers import AutoModelForCausalLM

    # Built on the device itself: ``to_empty`` from meta would leave the rotary buffers unset.
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(source.hf_config, dtype=torch.bfloat16)
    result = hf.load_state_dict(tensors, strict=False)
    unexpected = list(result.unexpected_keys)
    tied = hf.config.tie_word_embeddings
    missing = [k for k in result.missing_keys if "rotary" not in k and not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"the oracle did not take the trainer's tensors: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")  # fmt: skip
    hf.tie_weights()
    hf.eval()
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([ids], device=device)).logits[0].float(), -1).cpu()
    del hf
    return ref


def _compare(tokens: list[int], logprobs: list[float], ref: torch.Tensor, prompt_len: int) -> dict[str, Any]:
    rows = ref[prompt_len - 1 : prompt_len - 1 + len(tokens)]
    diffs = [abs(lp - rows[i, t].item()) for i, (t, lp) in enumerate(zip(tokens, logprobs))]
    agree = sum(int(rows[i].argmax().item() == t) for i, t in enumerate(tokens))
    return {"max_abs_logprob_diff": max(diffs), "top1_agreement": agree / len(tokens), "tokens_checked": len(tokens)}


def _trainer_source(model: str) -> Any:
    """The trainer's weights: another seed of a random shape (so a push changes the engine's),
    else the model's own weights."""
    from siesta.model.loader import resolve_model
    from siesta.model.random_init import RANDOM_PREFIX

    if model.startswith(RANDOM_PREFIX):
        shape, _, seed = model.removeprefix(RANDOM_PREFIX).partition("@")
        return resolve_model(f"{RANDOM_PREFIX}{shape}@{int(seed or 0) + 1}")
    return resolve_model(model)


# -- nccl: two devices ---------------------------------------------------------------------


def _broadcast_peer(port: int, device: str, sizes: list[int], reps: int, timeout_s: float) -> None:
    """Rank 1 of the plain-broadcast baseline: receive every bucket ``reps + 1`` times, then ack."""
    import torch.distributed as dist

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    group, _ = _plain_group(port, 1, dev, timeout_s)
    buffer = torch.empty(max(sizes), dtype=torch.uint8, device=dev)
    ack = torch.zeros(1, dtype=torch.int64, device=dev)
    opts = dist.BroadcastOptions()
    for _ in range(reps + 1):
        for size in sizes:
            opts.rootRank = 0
            group.broadcast([buffer[:size]], opts).wait()
        opts.rootRank = 1
        group.broadcast([ack], opts).wait()
    _sync(dev)
    _close_group(group)


def _plain_group(port: int, rank: int, device: torch.device, timeout_s: float) -> tuple[Any, Any]:
    """A bare two-rank torch.distributed group (NCCL on GPUs, gloo on CPUs) over its own store."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore("siesta-wt-bench-baseline", store)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
    return group, store


def _close_group(group: Any) -> None:
    for name in ("shutdown", "abort"):
        fn = getattr(group, name, None)
        if callable(fn):
            try:
                fn()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
            return


def _broadcast_baseline(
    sizes: list[int], trainer: torch.device, engine: str, reps: int, timeout_s: float
) -> dict[str, Any]:
    """Rank 0 here, rank 1 in a spawned process on the engine's device: the bucket byte counts
    a packed push sends, broadcast plainly, then a one-element ack back (as the push waits for
    the engine's answer). p50 seconds after a warm-up round."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    port = _free_port()
    ctx = mp.get_context("spawn")
    peer = ctx.Process(target=_broadcast_peer, args=(port, engine, sizes, reps, timeout_s), daemon=True)
    peer.start()
    try:
        group, store = _plain_group(port, 0, trainer, timeout_s)
        buffer = torch.empty(max(sizes), dtype=torch.uint8, device=trainer)
        ack = torch.zeros(1, dtype=torch.int64, device=trainer)
        opts = dist.BroadcastOptions()
        times = []
        for rep in range(reps + 1):
            _sync(trainer)
            t0 = time.perf_counter()
            for size in sizes:
                opts.rootRank = 0
                group.broadcast([buffer[:size]], opts).wait()
            opts.rootRank = 1
            group.broadcast([ack], opts).wait()
            _sync(trainer)
            if rep:
                times.append(time.perf_counter() - t0)
        _close_group(group)
        del store
    finally:
        peer.join(timeout_s)
        if peer.is_alive():
            peer.kill()
    total = sum(sizes)
    p50 = median(times)
    return {"bytes": total, "broadcasts": len(sizes), "p50_ms": p50 * 1e3, "GB_s": total / p50 / GB,
            "peer_exitcode": peer.exitcode}  # fmt: skip


def _nccl_arm(o: SimpleNamespace, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    from siesta.client import SiestaClient
    from siesta.weight_transfer.wire import bucket_bounds

    if o.device.type == "cuda":
        found = torch.cuda.device_count()
        if found < 2:
            return {"skipped": f"needs 2 GPUs, found {found}"}
        trainer, engine_device, backend = torch.device("cuda", 0), o.wt_nccl_device, "nccl"
        if torch.device(engine_device) == trainer:
            return {"skipped": f"the engine's device {engine_device} is the trainer's"}
    else:
        trainer, engine_device, backend = torch.device("cpu"), "cpu", "gloo (CPU: the nccl backend's CPU path)"
    tensors = {n: t.to(trainer) for n, t in tensors.items()}
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    buckets = [sum(sizes[a:b]) for a, b in bucket_bounds(sizes, o.wt_bucket_bytes)]
    timeout_s = max(120.0, o.wt_arm_time_s * 2)
    baseline = _broadcast_baseline(buckets, trainer, engine_device, o.wt_reps, timeout_s)
    engine = start_engine(o, engine_device, "nccl")
    try:
        with SiestaClient(engine.url) as client:
            push = _push_arm(client, tensors, o, backend="nccl", packed=True, bucket_bytes=o.wt_bucket_bytes,
                             device=trainer)  # fmt: skip
    except Exception as e:
        raise RuntimeError(f"{type(e).__name__}: {e}\nengine log:\n{engine.log_tail()}") from e
    finally:
        engine.stop()
    return {"backend": backend, "trainer_device": str(trainer), "engine_device": engine_device,
            "bucket_bytes": o.wt_bucket_bytes, "broadcast": baseline, "push": push, "bytes": push["bytes"],
            "of_broadcast": push["GB_s"] / baseline["GB_s"],
            "goal_met": push["GB_s"] / baseline["GB_s"] >= GOAL_NCCL_OF_BROADCAST}  # fmt: skip


# -- the whole bench -----------------------------------------------------------------------


def _run_arm(out: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    t0 = time.perf_counter()
    try:
        out[name] = fn()
    except Exception as e:  # noqa: BLE001 - report and go on to the next arm
        import traceback

        traceback.print_exc()
        out[name] = {"error": f"{type(e).__name__}: {e}"[:4000]}
    out[name]["arm_s"] = time.perf_counter() - t0
    print(f"[weight_transfer] {name}: {json.dumps(out[name], default=str)[:600]}", flush=True)


def _same(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]]) -> dict[str, Any]:
    """Two greedy runs of the engine: the same tokens, and how far their logprobs differ."""
    diff = max((abs(x - y) for x, y in zip(a[1], b[1])), default=float("nan"))
    return {"same_tokens": a[0] == b[0], "max_abs_logprob_diff": diff if a[0] == b[0] else float("nan")}


def _ipc_arms(o: SimpleNamespace, source: Any, tensors: dict[str, torch.Tensor], prompt: list[int],
              res: dict[str, Any], check: dict[str, Any]) -> None:  # fmt: skip
    """The ipc arms against one served engine on the trainer's device, and their correctness."""
    from siesta.client import SiestaClient

    dev = o.device
    t0 = time.perf_counter()
    engine = start_engine(o, str(dev), "ipc")
    res["engine_start_s"] = time.perf_counter() - t0
    n = o.wt_check_tokens
    try:
        with SiestaClient(engine.url) as client:
            before = _engine_logprobs(client, prompt, n)  # the engine's own weights
            _run_arm(res, "ipc", lambda: _push_arm(client, tensors, o))
            if "error" not in res["ipc"]:
                ipc = res["ipc"]
                res["ipc_first"] = {"bytes": ipc["bytes"], "s": ipc["first_s"], "GB_s": ipc["first_GB_s"],
                                    "engine_receive_s": ipc["first_engine_receive_s"]}  # fmt: skip
            after = _engine_logprobs(client, prompt, n)

            def correctness() -> dict[str, Any]:
                ref = _hf_reference(source, tensors, dev, prompt + after[0])
                out = _compare(*after, ref, len(prompt)) | {"prompt_tokens": len(prompt)}
                out["changed_by_push"] = before != after
                return out

            # A transformers copy of the model beside the trainer's and the engine's (on one card,
            # the 30B MoE's 61 GB would be a third): checked where it fits, else said so.
            if _fits(dev, res["bytes"]):
                _run_arm(check, "bf16_push", correctness)
            else:
                check["bf16_push"] = {"skipped": f"a transformers copy ({res['bytes'] / GB:.0f} GB) does not fit"}
            _empty_cache(dev)
            # The same weights again, by other paths: the engine's greedy run must not move.
            packed = {"packed": True, "bucket_bytes": o.wt_bucket_bytes}
            _run_arm(res, "ipc_packed", lambda: _push_arm(client, tensors, o, **packed))
            check["packed_push"] = _same(after, _engine_logprobs(client, prompt, n))
            # fp32 masters whose bf16 cast is `tensors` (twice their bytes), and the cast copy's
            # destination (as many again).
            if _fits(dev, 3 * res["bytes"]):
                masters = {k: t.float() for k, t in tensors.items()}
                cast = functools.partial(_copy_arm, list(masters.values()), torch.bfloat16, o.wt_reps, dev)
                _run_arm(res, "plain_cast_copy", cast)
                _run_arm(res, "ipc_fp32", functools.partial(_push_arm, client, masters, o))
                del masters
                _empty_cache(dev)
                check["fp32_push"] = _same(after, _engine_logprobs(client, prompt, n))
            else:
                res["ipc_fp32"] = {"skipped": f"fp32 masters ({2 * res['bytes'] / GB:.0f} GB) do not fit"}
            _run_arm(res, "rl_step", lambda: _rl_step_arm(client, tensors, o))
            check["rl_step_push"] = _same(after, _engine_logprobs(client, prompt, n))
            res["engine_transfer_bytes_total"] = _metric(client, TRANSFER_BYTES.format("ipc"))
    except Exception as e:
        raise RuntimeError(f"{type(e).__name__}: {e}\nengine log:\n{engine.log_tail()}") from e
    finally:
        engine.stop()


def _fits(device: torch.device, nbytes: int) -> bool:
    """Whether ``nbytes`` more fit on ``device`` now (the host, a CPU run: always)."""
    if device.type != "cuda":
        return True
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0] > nbytes


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def weight_transfer(args: argparse.Namespace) -> dict[str, Any]:
    """Every arm in one run (a section of siesta.bench.gpu); see the module's docstring."""
    o = _opts(args)
    dev = o.device
    source = _trainer_source(o.model)
    t0 = time.perf_counter()
    tensors = dict(source.iter_weights(torch.bfloat16, dev))  # HF names, as a trainer holds them
    _sync(dev)
    res: dict[str, Any] = {"model": o.model, "trainer_weights": source.name, "device": str(dev),
                           "tensors": len(tensors), "bytes": _nbytes(tensors),
                           "trainer_init_s": time.perf_counter() - t0}  # fmt: skip
    vocab = source.hf_config.vocab_size
    prompt = random_prompts(1, o.wt_prompt_len, o.wt_prompt_len, vocab, seed=11)[0]
    check: dict[str, Any] = {}
    _run_arm(res, "plain_copy", functools.partial(_copy_arm, list(tensors.values()), torch.bfloat16, o.wt_reps, dev))
    _empty_cache(dev)

    try:
        _ipc_arms(o, source, tensors, prompt, res, check)
    except Exception as e:  # noqa: BLE001 - the nccl arm may still run
        import traceback

        traceback.print_exc()
        res["ipc_error"] = f"{type(e).__name__}: {e}"[:4000]
    res["correctness"] = check
    if o.wt_skip_nccl:
        res["nccl"] = {"skipped": "--skip-nccl"}
    else:
        _run_arm(res, "nccl", functools.partial(_nccl_arm, o, tensors))
    del tensors
    _ratios(res)
    return res


def _ratios(res: dict[str, Any]) -> None:
    copy_gbs = (res.get("plain_copy") or {}).get("GB_s")
    cast_gbs = (res.get("plain_cast_copy") or {}).get("GB_s")
    for arm in ("ipc", "ipc_first", "ipc_packed", "ipc_fp32"):
        node = res.get(arm) or {}
        if copy_gbs and node.get("GB_s"):
            node["of_plain_copy"] = node["GB_s"] / copy_gbs
    fp32 = res.get("ipc_fp32") or {}
    if cast_gbs and fp32.get("GB_s"):
        fp32["of_plain_cast_copy"] = fp32["GB_s"] / cast_gbs
    ipc, first, rl = res.get("ipc") or {}, res.get("ipc_first") or {}, res.get("rl_step") or {}
    res["goals"] = {
        f"ipc push p50 <= {GOAL_PUSH_MS:.0f} ms": ipc.get("p50_ms", float("inf")) <= GOAL_PUSH_MS,
        f"first ipc push <= {GOAL_FIRST_PUSH_S:.0f} s": first.get("s", float("inf")) <= GOAL_FIRST_PUSH_S,
        f"RL step <= {GOAL_RL_STEP_S} s": rl.get("p50_s", float("inf")) <= GOAL_RL_STEP_S,
        "engine receive >= 1 TB/s": (ipc.get("engine_receive_GB_s") or 0.0) >= 1000.0,
    }


def summary_rows(res: dict[str, Any]) -> list[list[Any]]:
    """Table rows (siesta.bench.gpu's summary and this module's main)."""

    def get(*path: str, default: Any = 0.0) -> Any:
        node: Any = res
        for p in path:
            if not isinstance(node, dict) or p not in node:
                return default
            node = node[p]
        return default if node is None else node

    rows = [
        ["ipc weight push p50 ms / GB/s", f"{get('ipc', 'p50_ms'):.1f} / {get('ipc', 'GB_s'):.0f}",
         f"goal <= {GOAL_PUSH_MS:.0f} ms (>= 640 GB/s); {get('ipc', 'of_plain_copy'):.0%} of a device copy "
         f"({get('plain_copy', 'p50_ms'):.1f} ms); engine receive {get('ipc', 'engine_receive_GB_s'):.0f} GB/s; "
         f"fp32 {get('ipc_fp32', 'p50_ms'):.1f} ms, packed {get('ipc_packed', 'p50_ms'):.1f} ms"],
        ["ipc first push s / RL step s", f"{get('ipc_first', 's'):.2f} / {get('rl_step', 'p50_s'):.2f}",
         f"goal <= {GOAL_FIRST_PUSH_S:.0f} / <= {GOAL_RL_STEP_S} (sleep 2, wake weights, push, finish, wake kv)"],
    ]  # fmt: skip
    nccl = get("nccl", default={})
    if "skipped" in nccl or "error" in nccl:
        rows.append(["nccl push / plain broadcast", "-", str(nccl.get("skipped") or nccl.get("error"))[:80]])
    elif nccl:
        rows.append(["nccl push / plain broadcast GB/s",
                     f"{get('nccl', 'push', 'GB_s'):.0f} / {get('nccl', 'broadcast', 'GB_s'):.0f}",
                     f"{get('nccl', 'of_broadcast'):.0%} of it; goal >= {GOAL_NCCL_OF_BROADCAST:.0%}"])  # fmt: skip
    return rows


_FLAGS: dict[str, tuple[str, type, str]] = {  # dest -> (flag, type, help)
    "wt_reps": ("--reps", int, "timed pushes per arm after the first"),
    "wt_arm_time_s": ("--arm-time-s", float, "stop repeating an arm after this"),
    "wt_kv_cache_bytes": ("--kv-cache-bytes", int, "the served engines' KV cache"),
    "wt_engine_max_model_len": ("--engine-max-model-len", int, "the served engines' max_model_len"),
    "wt_bucket_bytes": ("--bucket-bytes", int, "packed pushes' bucket size"),
    "wt_rl_steps": ("--rl-steps", int, "RL steps timed"),
    "wt_prompt_len": ("--prompt-len", int, "the correctness prompt's tokens"),
    "wt_check_tokens": ("--check-tokens", int, "greedy tokens compared"),
    "wt_engine_flags": ("--engine-flags", str, "more `siesta serve` flags, e.g. '--enforce-eager'"),
    "wt_nccl_device": ("--nccl-device", str, "the nccl arm's engine device (the trainer is on cuda:0)"),
    "wt_startup_timeout_s": ("--startup-timeout-s", float, "how long a served engine may take to be healthy"),
}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    for dest, (flag, kind, help_text) in _FLAGS.items():
        ap.add_argument(flag, dest=dest, type=kind, default=DEFAULTS[dest], help=help_text)
    ap.add_argument("--skip-nccl", dest="wt_skip_nccl", action="store_true")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:llama-3-8b")
    ap.add_argument("--device", default=None, help="the trainer's and the ipc engine's (default: cuda, else cpu)")
    ap.add_argument("--json", default=None)
    add_arguments(ap)
    args = ap.parse_args()
    res = {"device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "args": vars(args)}  # fmt: skip
    t0 = time.perf_counter()
    res |= weight_transfer(args)
    res["bench_s"] = time.perf_counter() - t0
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    title = f"weight transfer on {res['device_name']} ({res['model']})"
    print_table(title, ["measure", "value", "against"], summary_rows(res))


if __name__ == "__main__":
    main()
