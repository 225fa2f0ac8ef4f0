"""What ``/proc/cpuinfo`` says about this machine's CPU (the CPU linears pick their library by
its vendor; benchmarks record its model), and the limits set on the ISA the libraries use.

The C kernels are keyed by what the compiler targets, not by this: one model name covers
CPUs with and without AVX-512 (siesta/c_kernels.py)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

_CPUINFO = Path("/proc/cpuinfo")
# Environment variables that hold torch's libraries to a smaller ISA than the CPU's (MKL's
# sgemm; oneDNN's JIT, under its current and its former name; torch's own vectorized ops).
ISA_LIMITS = ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")


def cpuinfo_field(name: str) -> str:
    """The first ``name : value`` line's value ("model name", "vendor_id"); "" where there is none."""
    try:
        for line in _CPUINFO.read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return ""


def cpu_model() -> str:
    return cpuinfo_field("model name") or platform.processor()


def cpu_vendor() -> str:
    """"GenuineIntel", "AuthenticAMD", ...; "" where unknown."""
    return cpuinfo_field("vendor_id")


def isa_limits() -> dict[str, str]:
    """The ISA_LIMITS set in this process's environment: a benchmark's figures depend on them."""
    return {name: os.environ[name] for name in ISA_LIMITS if name in os.environ}
