"""How many threads an engine rank computes with on the CPU.

torch starts one OpenMP thread per core it sees, and so does every process that imports it.
Beside ``siesta serve``'s API server (tokenizing in its own threads, streaming, parsing), an
engine that takes every core leaves that work nothing: its threads and the server's share the
cores, and each parallel region waits for its slowest thread. On a loaded 2-core machine a
16-token ``/generate`` then took 24-46 s, against 1.1 s with one engine thread.

So, as vLLM's CPU backend does, a served engine leaves one core to the API server; an offline
``LLM`` (no server beside it) takes them all; tensor-parallel ranks share them. The cores are
torch's own count (physical cores, or ``OMP_NUM_THREADS``) capped by what this process may run
on: its affinity mask and a cgroup CPU quota (a container limited to 2 CPUs on a 64-core host
sees 64 in its mask). ``--cpu-threads`` (``LLM(cpu_threads=)``) wins, and ``OMP_NUM_THREADS``
set by the user is taken as is, per rank.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max <period>"
# Cores left to the API server beside a served engine (vLLM: VLLM_CPU_NUM_OF_RESERVED_CPU).
SERVER_RESERVED_CORES = 1


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API (macOS)
        cores = os.cpu_count() or 1
    quota = _cgroup_quota_cores()
    return max(1, min(cores, quota) if quota is not None else cores)


def _cgroup_quota_cores() -> int | None:
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(1, math.ceil(int(quota) / int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def _omp_num_threads() -> int | None:
    value = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def engine_threads(requested: int | None, usage_context: str, ranks: int = 1, torch_default: int | None = None) -> int:
    """Threads for one of ``ranks`` ranks: ``requested``, else OMP_NUM_THREADS, else the cores
    torch would use and this process may (less the API server's one under serve), shared
    among the ranks."""
    if requested is not None:
        return requested
    from_env = _omp_num_threads()
    if from_env is not None:
        return from_env
    cores = min(torch_default or torch.get_num_threads(), usable_cores())
    if usage_context == "api_server" and cores > SERVER_RESERVED_CORES:
        cores -= SERVER_RESERVED_CORES
    return max(1, cores // ranks)


def apply(threads: int) -> None:
    """torch's intra-op threads (its OpenMP team, which the C kernels share) and MKL's."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
