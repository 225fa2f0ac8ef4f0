"""Decode steps while the weights' sleep backup is being pinned, three arms in one run:

- ``first_sleep``: no backup until a sleep needs it (nothing pinned beside the steps);
- ``beside_steps``: pinned from start-up on whatever the device does (how siesta did it
  before the quiet gate: ``host_backup.QUIET_S`` set to 0);
- ``between_steps``: pinned from start-up on, a chunk only once no step has run for
  ``QUIET_S`` (the default).

Each arm is a fresh engine of ``--model``: batch-1 decode steps are timed right after start-up
(where a background backup is still to be pinned), then the engine idles until its backup is
ready, and the steps are timed again. ``cudaHostRegister`` holds the driver's lock, which a
step's launches and event queries wait for (H100, 8B shape: 8.3 ms a step beside the pinning
against 5.8 without, run 50g). ``python -m siesta.bench.gpu --sections backup_pinning``.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch

from siesta.bench.steps import decode_step_s

# arm -> (weight_backup, QUIET_S for its engine: None keeps the default)
ARMS: dict[str, tuple[str, float | None]] = {
    "first_sleep": ("first_sleep", None),
    "beside_steps": ("background", 0.0),
    "between_steps": ("background", None),
}
READY_TIMEOUT_S = 300.0  # a 61 GB backup pins in well under this on an idle engine
POLL_S = 0.05


def _arm(args: argparse.Namespace, mode: str, quiet_s: float | None) -> dict[str, Any]:
    from siesta import LLM
    from siesta.core import host_backup

    saved = host_backup.QUIET_S
    if quiet_s is not None:
        host_backup.QUIET_S = quiet_s  # read when the engine makes its backup
    try:
        llm = LLM(args.model, dtype="bfloat16", max_model_len=args.max_model_len, device=args.device,
                  gpu_memory_utilization=0.85, weight_backup=mode)  # fmt: skip
    finally:
        host_backup.QUIET_S = saved
    backup = llm.engine.memory.backup
    early = decode_step_s(llm, 1, args.decode_context, args.decode_steps)
    t0 = time.perf_counter()
    waited = None
    if mode == "background":  # idle until the thread has pinned it all
        while not backup.ready and time.perf_counter() - t0 < READY_TIMEOUT_S:
            time.sleep(POLL_S)
        waited = time.perf_counter() - t0
    later = decode_step_s(llm, 1, args.decode_context, args.decode_steps)
    out = {"weight_backup": mode, "quiet_s": host_backup.QUIET_S if quiet_s is None else quiet_s,
           "early_step_ms": early * 1e3, "later_step_ms": later * 1e3, "backup_ready": backup.ready,
           "idle_until_ready_s": waited, "backup_bytes": backup.nbytes}  # fmt: skip
    del llm, backup
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {name: _arm(args, mode, quiet) for name, (mode, quiet) in ARMS.items()}
    base = res["first_sleep"]["early_step_ms"]
    for name in ("beside_steps", "between_steps"):
        res[name]["early_over_first_sleep"] = res[name]["early_step_ms"] / base
    return res


def summary_rows(res: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for name in ("beside_steps", "between_steps"):
        cell = res.get(name) or {}
        if "early_over_first_sleep" in cell:
            rows.append([f"b1 step while the backup pins {name.replace('_', ' ')}", cell["early_over_first_sleep"],
                         f"{cell['early_step_ms']:.2f} ms vs {res['first_sleep']['early_step_ms']:.2f} with none; "
                         f"ready after {cell['idle_until_ready_s'] or 0:.1f} s idle"])  # fmt: skip
    return rows
