"""What ``/proc/cpuinfo`` says about this machine's CPU: kernels are built for it, and the CPU
linears pick their library by its vendor."""

from __future__ import annotations

import platform
from pathlib import Path

_CPUINFO = Path("/proc/cpuinfo")


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
