"""C kernels for the CPU: a source built with the machine's C compiler into the siesta cache,
keyed by its source, flags and CPU, and loaded with ctypes (whose calls release the GIL).

Every supported setup has gcc or cc; without one, ``build`` returns None and each caller keeps
its torch path. Below ``attention/`` and ``model/``, which both build kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from siesta.cache_dir import cache_dir
from siesta.cpu_info import cpu_model

logger = logging.getLogger(__name__)

# Reassociation lets gcc vectorize sums. Not -ffast-math: a shared object built with it sets
# flush-to-zero for the whole process when it is loaded. -fopenmp: kernels split their work
# with OpenMP, whose runtime is torch's (the loader reuses the libgomp torch loaded), so
# torch.set_num_threads holds and a call costs no Python thread hand-off.
CFLAGS = ("-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
          "-fno-math-errno", "-fopenmp", "-fPIC", "-shared")  # fmt: skip
KERNEL_SUBDIR = "kernels"
# Headers every source may include, built beside it and part of its cache key.
HEADERS = (Path(__file__).with_name("exp_nonpositive.h"),)


def build(name: str, source: bytes, flags: tuple[str, ...] = CFLAGS) -> ctypes.CDLL | None:
    """``source`` compiled with ``flags`` into the cache as ``name-<machine>-<key>.so`` and loaded;
    None without a working C compiler (the reason is logged)."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        logger.warning("no C compiler found: the CPU runs %s's work through torch (slower)", name)
        return None
    headers = {h.name: h.read_bytes() for h in HEADERS}
    key_parts = [source, " ".join(flags).encode(), cpu_model().encode(), *headers.values()]
    key = hashlib.sha256(b"".join(key_parts)).hexdigest()[:16]
    cache = cache_dir() / KERNEL_SUBDIR
    path = cache / f"{name}-{platform.machine()}-{key}.so"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, then renamed: safe across processes
            built = Path(tmp) / path.name
            src = Path(tmp) / f"{name}.c"
            src.write_bytes(source)
            for header, text in headers.items():
                (Path(tmp) / header).write_bytes(text)
            try:
                result = subprocess.run([cc, *flags, str(src), "-o", str(built), "-lm"], capture_output=True, text=True)
            except OSError as e:
                logger.warning("cannot run the C compiler %s (%s): %s's work goes through torch", cc, e, name)
                return None
            if result.returncode != 0:
                logger.warning("building the CPU kernel %s failed, using torch:\n%s", name, result.stderr[-2000:])
                return None
            os.replace(built, path)
    return ctypes.CDLL(str(path))
