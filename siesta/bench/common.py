"""Helpers shared by the benchmarks: prompts, percentiles, tables, JSON."""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import random
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from siesta.c_kernels import isa_features
from siesta.cpu_info import cpu_model

ERROR_FRAMES = 4  # of a failed part's traceback, into its record
# Token ids below this are left out of random prompts: they are the special tokens of most vocabularies.
_FIRST_ORDINARY_TOKEN = 100


def random_prompts(num: int, min_len: int, max_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Distinct random token-id prompts with lengths uniform in [min_len, max_len]."""
    rng = random.Random(seed)
    return [
        [rng.randrange(_FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(num)
    ]


def machine() -> dict[str, Any]:
    """What a result was measured on: figures from two VMs of one size differ by 2x."""
    return {"cpu": cpu_model(), "logical_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "kernel_isa": isa_features()}  # fmt: skip


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[max(0, min(98, round(q) - 1))]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]  # no rows: the headers
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 1e6 else f"{value:,.0f}"
    return str(value)


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {path}")


# What a part's line in the log keeps: enough to read it back should a command limit cut the
# section before its JSON is written. Long lists (timelines, per-request latencies) are counted.
PART_LOG_CHARS = 8000
PART_LOG_LIST_ITEMS = 8


def _compact(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _compact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return f"[{len(value)} items]" if len(value) > PART_LOG_LIST_ITEMS else [_compact(v) for v in value]
    return value


def log_part(section: str, part: str, value: Any) -> None:
    """One part of a long section, printed as it finishes (long lists counted, not listed)."""
    print(f"[{section}.{part}] {json.dumps(_compact(value), default=str)[:PART_LOG_CHARS]}", flush=True)


def release_memory() -> None:
    """Give back what engines that are gone held: device memory, and the pinned host memory that
    torch's caching host allocator keeps after a tier's buffer is freed (a bench that makes
    engines one after another, or starts a server after them, would otherwise hold every tier
    it ever pinned: 48 GiB each at the seed's scale)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        host_empty = getattr(torch._C, "_host_emptyCache", None)  # CUDA builds of torch >= 2.5
        if host_empty is not None:
            host_empty()


def host_memory_gib() -> dict[str, float]:
    """This process's resident memory (pinned buffers included) and the host's available memory, in
    GiB, from /proc: what a section leaves to the next one. Empty where /proc is not Linux's."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for path, key, name in (("/proc/self/status", "VmRSS:", "process_rss"),
                                ("/proc/meminfo", "MemAvailable:", "host_available")):  # fmt: skip
            with open(path) as f:
                kib = next((int(line.split()[1]) for line in f if line.startswith(key)), None)
            if kib is not None:
                out[name] = round(kib / 2**20, 2)
    return out


def run_part(out: dict[str, Any], section: str, name: str, step: Callable[[], Any]) -> None:
    """One part of a section into ``out[name]`` (its error, if it fails: the other parts still run),
    its seconds into ``out[name + "_s"]``; logged as it finishes, then the memory given back."""
    t0 = time.perf_counter()
    try:
        out[name] = step()
    except Exception as e:  # noqa: BLE001 - one part's failure is reported, the rest still run
        # the innermost frames say where (an error message such as a failed capture's does not)
        frames = traceback.format_tb(e.__traceback__)[-ERROR_FRAMES:]
        out[name] = {"error": f"{type(e).__name__}: {e}", "where": "".join(frames)}
    out[f"{name}_s"] = time.perf_counter() - t0
    log_part(section, name, out[name])
    release_memory()


def cut_model(model: str, layers: int, folder: str) -> str:
    """``random:<folder>``: random weights of ``model``'s architecture cut to its first ``layers``
    layers, every one of them as the whole model's (the config written into ``folder``)."""
    from siesta.model.loader import resolve_model
    from siesta.model.random_init import RANDOM_PREFIX

    config = copy.deepcopy(resolve_model(model).hf_config)
    config.num_hidden_layers = layers
    if getattr(config, "mlp_only_layers", None):
        config.mlp_only_layers = [i for i in config.mlp_only_layers if i < layers]
    config.save_pretrained(folder)
    return f"{RANDOM_PREFIX}{folder}"
