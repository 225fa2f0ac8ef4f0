"""C kernels for the CPU: a source built with the machine's C compiler into the siesta cache
and loaded with ctypes (whose calls release the GIL).

A build is keyed by its source, its headers, its flags and what the compiler makes of those
flags here: the macros it predefines for them (``__AVX512F__``, ``__ARM_NEON``, ... and
``__VERSION__``). Two CPUs sold under one model name, with and without AVX-512, so get two
libraries, and a cache carried to another machine never loads one built for other features.

A build that fails is recorded once, beside where its library would go (``<name>-...failed``,
holding the compiler's output): later starts log one line naming that file and keep their
torch path, rather than compiling again and printing the errors in every process. Processes
that build the same kernel at once (tensor-parallel ranks starting together) take turns on a
file lock, so one compiles and the others load what it built.

Every supported setup has gcc or cc; without one, ``build`` returns None and each caller keeps
its torch path. Below ``attention/`` and ``model/``, which both build kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from siesta.cache_dir import cache_dir

logger = logging.getLogger(__name__)

NATIVE = "native"
MARCH_ENV = "SIESTA_CPU_MARCH"
_NATIVE_FLAG = f"-march={NATIVE}"
# Reassociation lets gcc vectorize sums. Not -ffast-math: a shared object built with it sets
# flush-to-zero for the whole process when it is loaded. -fopenmp: kernels split their work
# with OpenMP, whose runtime is torch's (the loader reuses the libgomp torch loaded), so
# torch.set_num_threads holds and a call costs no Python thread hand-off.
CFLAGS = ("-O3", _NATIVE_FLAG, "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
          "-fno-math-errno", "-fopenmp", "-fPIC", "-shared")  # fmt: skip
KERNEL_SUBDIR = "kernels"
FAILED_SUFFIX = ".failed"
LOCK_SUFFIX = ".lock"
# Headers every source may include, built beside it and part of its cache key.
HEADERS = (Path(__file__).with_name("exp_nonpositive.h"),)
# How much of the compiler's output the failing build's one warning quotes (the file has all of it).
_QUOTED_ERROR_CHARS = 300


def with_march(flags: tuple[str, ...], march: str) -> tuple[str, ...]:
    """``flags`` building for ``march`` ("x86-64-v3": AVX2 and FMA) in place of the machine's own."""
    if march == NATIVE:
        return flags
    if _NATIVE_FLAG not in flags:
        raise ValueError(f"no {_NATIVE_FLAG} in {flags} to replace")
    return tuple(f"-march={march}" if f == _NATIVE_FLAG else f for f in flags)


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


@functools.cache
def predefined_macros(cc: str, flags: tuple[str, ...]) -> bytes | None:
    """What ``cc`` predefines under ``flags`` (its version, and the ISA features the flags turn
    on), once per process; None where it cannot say (the reason is logged)."""
    try:
        result = subprocess.run([cc, *flags, "-dM", "-E", "-x", "c", os.devnull], capture_output=True)
    except OSError as e:
        logger.warning("cannot run the C compiler %s (%s): the CPU kernels' work goes through torch", cc, e)
        return None
    if result.returncode != 0:
        logger.warning("the C compiler %s refuses the flags %s: the CPU kernels' work goes through torch\n%s", cc,
                       " ".join(flags), result.stderr.decode(errors="replace")[-_QUOTED_ERROR_CHARS:])  # fmt: skip
        return None
    return b"\n".join(sorted(result.stdout.splitlines()))


def runs_here(march: str, flags: tuple[str, ...] = CFLAGS) -> bool:
    """Whether this machine has every ISA feature a build for ``march`` may use: the feature
    macros (``__AVX2__``, ``__FMA__``, ...) that ``march`` predefines, ``native`` does too."""
    cc = compiler()
    if cc is None:
        return False
    native, target = predefined_macros(cc, flags), predefined_macros(cc, with_march(flags, march))
    return native is not None and target is not None and _features(target) <= _features(native)


def _features(macros: bytes) -> set[bytes]:
    return {line for line in macros.splitlines() if re.fullmatch(rb"#define __[A-Z0-9_]+__ 1", line)}


_ISA_FEATURE = re.compile(rb"#define __(AVX[A-Z0-9_]*|FMA|F16C|SSE4_2|NEON|ARM_NEON|ARM_FEATURE_SVE|AMX[A-Z0-9_]*)__ 1")


def isa_features(march: str | None = None) -> list[str]:
    """The vector ISA features the CPU kernels are built with here (``AVX512F``, ``AVX2``, ``FMA``,
    ``ARM_NEON``...): what a CPU benchmark's figures were measured with. Empty without a compiler."""
    cc = compiler()
    macros = None if cc is None else predefined_macros(cc, with_march(CFLAGS, march or os.environ.get(MARCH_ENV, NATIVE)))
    if macros is None:
        return []
    return sorted(m.group(1).decode() for line in macros.splitlines() if (m := _ISA_FEATURE.fullmatch(line)))


def library_path(name: str, source: bytes, flags: tuple[str, ...], macros: bytes) -> Path:
    """Where ``source`` built with ``flags`` lies in the cache (``<name>-<machine>-<key>.so``)."""
    parts = [source, " ".join(flags).encode(), macros, *(h.read_bytes() for h in HEADERS)]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return cache_dir() / KERNEL_SUBDIR / f"{name}-{platform.machine()}-{key}.so"


def failure_marker(path: Path) -> Path:
    return path.with_suffix(FAILED_SUFFIX)


def build(name: str, source: bytes, flags: tuple[str, ...] = CFLAGS) -> ctypes.CDLL | None:
    """``source`` compiled with ``flags`` into the cache and loaded; None without a working C
    compiler, or where this build failed, now or on an earlier start (the reason is logged).
    ``SIESTA_CPU_MARCH`` (e.g. ``x86-64-v3``) builds every native kernel for that target instead:
    a cache for other machines, or this suite as an AVX2-only machine runs it."""
    march = os.environ.get(MARCH_ENV)
    if march and _NATIVE_FLAG in flags:
        flags = with_march(flags, march)
    cc = compiler()
    if cc is None:
        logger.warning("no C compiler found: the CPU runs %s's work through torch (slower)", name)
        return None
    macros = predefined_macros(cc, flags)
    if macros is None:
        return None
    path = library_path(name, source, flags, macros)
    marker = failure_marker(path)
    if not path.exists():
        if marker.exists():
            logger.warning("the CPU kernel %s failed to build here before (see %s): its work goes through torch", name,
                           marker)  # fmt: skip
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path.with_suffix(LOCK_SUFFIX)):
            if marker.exists():  # another process failed while this one waited: it has said so
                logger.info("the CPU kernel %s failed to build (see %s): its work goes through torch", name, marker)
                return None
            if not path.exists() and not _compile(cc, name, source, flags, path):
                return None
    return ctypes.CDLL(str(path))


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """Held by one process at a time (released by the kernel if it dies). The file stays:
    removing it would let a process lock a new file while another holds the old one."""
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile(cc: str, name: str, source: bytes, flags: tuple[str, ...], path: Path) -> bool:
    """Builds ``path``, or records the failure beside it; whether the library is there."""
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # built aside, then renamed into place
        built, src = Path(tmp) / path.name, Path(tmp) / f"{name}.c"
        src.write_bytes(source)
        for header in HEADERS:
            (Path(tmp) / header.name).write_bytes(header.read_bytes())
        try:
            result = subprocess.run([cc, *flags, str(src), "-o", str(built), "-lm"], capture_output=True, text=True)
        except OSError as e:
            logger.warning("cannot run the C compiler %s (%s): %s's work goes through torch", cc, e, name)
            return False
        if result.returncode != 0:
            marker = failure_marker(path)
            marker.write_text(result.stderr)
            logger.warning("building the CPU kernel %s failed, using torch (the compiler's output is in %s; this "
                           "machine will not try again): %s", name, marker, _first_error(result.stderr))  # fmt: skip
            return False
        os.replace(built, path)
    return True


def _first_error(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if "error" in line]
    return (errors[0] if errors else stderr.strip())[:_QUOTED_ERROR_CHARS]
