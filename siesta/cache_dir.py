"""Where siesta keeps what it builds once per machine (converted GGUFs, compiled kernels).

Below every package that caches, so that the model loaders and the attention kernels share it
without importing each other."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "SIESTA_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/siesta")


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR).expanduser()
