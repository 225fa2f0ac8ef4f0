"""Timing an engine's steps, shared by the GPU benches (one device, and tensor parallel)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from siesta.bench.common import random_prompts

HBM_BYTES_PER_S = 4.2e12  # measured device-to-device copy on the lent H200 (the CPU's stand-in)
COPY_PROBE_BYTES = 2 << 30  # far beyond L2 (50-60 MB), so the copy streams HBM
COPY_PROBE_REPS = 5
TOP_KERNELS = 8  # device_kernels keeps this many by default
PROFILE_TOP_KERNELS = 16  # what the step profiles (and the per-part profiles of decode_kernels) keep
PROFILED_STEPS = 10
WARM_STEPS = 3  # decode steps after the last prefill, before timing


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hbm_bytes_per_s() -> float:
    """This card's device-to-device copy rate (bytes read plus written per second), the rooflines'
    bandwidth: an H100 streams ~3.3e12 and an H200 ~4.2e12, so one constant would misstate one."""
    if not torch.cuda.is_available():
        return HBM_BYTES_PER_S
    src = torch.empty(COPY_PROBE_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync()
    t0 = time.perf_counter()
    for _ in range(COPY_PROBE_REPS):
        dst.copy_(src)
    sync()
    rate = 2 * COPY_PROBE_BYTES * COPY_PROBE_REPS / (time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return rate


class BatchDoesNotFit(RuntimeError):
    """A decode batch whose KV the engine cannot hold at once (a card with less memory)."""


def start_decoding(llm, batch: int, context: int, steps: int) -> list[str]:
    """``batch`` greedy requests of ``context`` random tokens, prefilled and a few steps into
    decoding, each with room for ``steps`` more: every row is still decoding when they are timed.

    Chunked prefill decodes the rows prefilled first while later ones still prefill, so each
    request's budget covers those steps too (at most one per ``max_num_batched_tokens`` of the
    batch's prompts, plus one per request that a step's budget cuts)."""
    from siesta import SamplingParams

    vocab = llm.engine.vocab_size
    prefill_steps = -(-batch * context // llm.config.scheduler.max_num_batched_tokens) + batch
    params = SamplingParams(temperature=0, max_tokens=prefill_steps + steps + WARM_STEPS + 8, ignore_eos=True)
    held = llm.engine.runner.num_blocks * llm.config.cache.block_size
    if batch * (context + params.max_tokens) > held:
        # Rows would wait for others to finish, and the timed steps would not hold the batch.
        raise BatchDoesNotFit(f"the KV cache holds {held:,} tokens; {batch} rows of {context} + "
                              f"{params.max_tokens} need {batch * (context + params.max_tokens):,}")  # fmt: skip
    ids = [llm.add_request({"prompt_token_ids": p}, params) for p in random_prompts(batch, context, context, vocab, 7)]
    requests = llm.engine.scheduler.requests
    while any(r.num_output_tokens == 0 for r in requests.values()):
        llm.step()
    for _ in range(WARM_STEPS):
        llm.step()
    live = [rid for rid in ids if rid in requests]
    if len(live) != batch:
        raise RuntimeError(f"{batch - len(live)} of {batch} rows finished before the timed steps")
    return ids


def decode_step_s(llm, batch: int, context: int, steps: int) -> float:
    ids = start_decoding(llm, batch, context, steps)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        llm.step()
    sync()
    dt = (time.perf_counter() - t0) / steps
    llm.abort(ids)
    return dt


def device_kernels(
    fn: Callable[[], Any], top: int = TOP_KERNELS, idle: dict[str, float] | None = None
) -> tuple[float, int, dict[str, float]]:
    """Device busy ms, kernel launches and ms per kernel name of one call of ``fn`` (torch.profiler).
    ``idle``, where given, receives the ``top`` kernel names with the most device idle time
    before them (ms from the previous kernel's end to their start): what a graph's gaps wait on."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()  # on the CPU (a smoke run) ops stand in for kernels
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        sync()
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    per_name: dict[str, float] = {}
    spans: list[tuple[float, float, str]] = []
    for e in prof.events():
        if e.device_type != kind:
            continue
        ms = (e.device_time_total if cuda else e.cpu_time_total) / 1e3
        per_name[e.name] = per_name.get(e.name, 0.0) + ms
        spans.append((e.time_range.start, e.time_range.end, e.name))
    launches = len(spans)
    costliest = dict(sorted(per_name.items(), key=lambda kv: -kv[1])[:top])
    if idle is not None:
        idle.update(_idle_before(spans, top))
    return sum(per_name.values()), launches, {k[:80]: round(v, 3) for k, v in costliest.items()}


def _idle_before(spans: list[tuple[float, float, str]], top: int) -> dict[str, float]:
    """Per kernel name, the ms the device sat idle before it: ``spans`` are (start us, end us,
    name); a kernel that overlaps the one before it (another stream) waited for nothing."""
    gaps: dict[str, float] = {}
    busy_until = None
    for start, end, name in sorted(spans):
        if busy_until is not None and start > busy_until:
            gaps[name] = gaps.get(name, 0.0) + (start - busy_until) / 1e3
        busy_until = end if busy_until is None else max(busy_until, end)
    return {k[:80]: round(v, 3) for k, v in sorted(gaps.items(), key=lambda kv: -kv[1])[:top]}


# CUDA runtime calls that block the host until the device catches up (a step that makes them
# cannot queue its next kernels while the device runs), beside the launches themselves; by
# exact name (cudaMemcpy blocks, cudaMemcpyAsync need not).
BLOCKING_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                            "aten::_local_scalar_dense"})  # fmt: skip
LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC",
                          "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync"})  # fmt: skip


def host_calls(fn: Callable[[], Any], top: int = TOP_KERNELS) -> dict[str, Any]:
    """Where one call of ``fn`` spends its host time: wall ms, the blocking runtime calls and the
    launches (count and host ms each), and the torch ops of most self time. A step whose wall
    exceeds its device time by much is either blocked (syncs) or launch-bound (many launches at
    tens of microseconds each)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        fn()
        sync()
    wall_ms = (time.perf_counter() - t0) * 1e3
    blocking: dict[str, list[float]] = {}
    launches: dict[str, list[float]] = {}
    ops: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        for names, into in ((BLOCKING_CALLS, blocking), (LAUNCH_CALLS, launches)):
            if e.key in names:
                into[e.key] = [e.count, round(e.cpu_time_total / 1e3, 3)]
        if e.key.startswith("aten::"):
            ops[e.key] = e.self_cpu_time_total / 1e3
    costliest = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:top])
    return {"wall_ms": wall_ms, "blocking_calls": blocking, "launch_calls": launches,
            "top_ops_self_ms": {k: round(v, 3) for k, v in costliest.items()}}  # fmt: skip


def engine_step_kernels(llm, batch: int, context: int) -> dict[str, Any]:
    """Per engine decode step (the defaults, in steady state): wall ms, device busy ms and
    kernel launches, and the costliest kernels; everything the step runs, graph or not."""
    ids = start_decoding(llm, batch, context, PROFILED_STEPS * 3)  # timed, profiled, then host calls

    def steps() -> None:
        for _ in range(PROFILED_STEPS):
            llm.step()

    sync()
    t0 = time.perf_counter()
    steps()
    sync()
    wall_ms = (time.perf_counter() - t0) * 1e3 / PROFILED_STEPS
    idle: dict[str, float] = {}
    busy_ms, launches, top = device_kernels(steps, top=PROFILE_TOP_KERNELS, idle=idle)
    host = host_calls(steps)
    llm.abort(ids)
    return {"wall_ms": wall_ms, "device_busy_ms": busy_ms / PROFILED_STEPS, "launches": launches / PROFILED_STEPS,
            "top_kernels_ms_per_step": {k: round(v / PROFILED_STEPS, 4) for k, v in top.items()},
            "idle_before_ms_per_step": {k: round(v / PROFILED_STEPS, 4) for k, v in idle.items()},
            "host_blocking_calls_per_step": _per_step(host["blocking_calls"]),
            "host_launch_calls_per_step": _per_step(host["launch_calls"]),
            "host_top_ops_self_ms_per_step": {k: round(v / PROFILED_STEPS, 4)
                                              for k, v in host["top_ops_self_ms"].items()}}  # fmt: skip


def _per_step(calls: dict[str, list[float]]) -> dict[str, list[float]]:
    """``{call: [count, host ms]}`` of the profiled steps, per step."""
    return {k: [count / PROFILED_STEPS, round(ms / PROFILED_STEPS, 4)] for k, (count, ms) in calls.items()}
