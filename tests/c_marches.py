"""The targets the C kernels' tests build for: this machine's own (``native``), and on x86-64
AVX2 with FMA (``x86-64-v3``) as well, so that a kernel that breaks on AVX2-only CPUs (no
AVX-512: 16 vector registers of 32 bytes) fails on any x86-64 CI machine, not only on one."""

from __future__ import annotations

import contextlib
import ctypes
import platform
from collections.abc import Callable, Iterator
from types import ModuleType

import pytest

from siesta import c_kernels
from siesta.c_kernels import NATIVE

# Per machine (platform.machine()): the portable targets built beside the native one.
PORTABLE_MARCHES = {"x86_64": ("x86-64-v3",)}
MARCHES = (NATIVE, *PORTABLE_MARCHES.get(platform.machine(), ()))


def kernel_for(march: str, load: Callable[[str], ctypes.CDLL | None]) -> ctypes.CDLL:
    """``load(march)``'s build, which must be there; skipped where this machine cannot run it."""
    if not c_kernels.runs_here(march):
        pytest.skip(f"this machine lacks features that -march={march} builds use")
    lib = load(march)
    assert lib is not None, f"the CPU machines (CI's too) have a C compiler: the kernel must build for -march={march}"
    return lib


@contextlib.contextmanager
def serving(module: ModuleType, loader: str, lib: ctypes.CDLL) -> Iterator[ctypes.CDLL]:
    """``module.<loader>()`` answers ``lib`` meanwhile: the engine's paths run that build."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, loader, lambda march=NATIVE: lib)
        yield lib
