"""The GPU bench's ``backup_pinning`` section on the CPU (tiny Llama): its three arms run, each a
fresh engine, the background ones idle until their backup is ready, and the table reads them.
On the CPU nothing is pinned (no driver lock): the times say nothing, the plumbing is what runs."""

from __future__ import annotations

import argparse
import json

from siesta.bench import gpu
from siesta.core import host_backup


def test_the_section_runs_its_three_arms_and_leaves_the_quiet_time_as_it_was() -> None:
    args = gpu.build_parser().parse_args([])
    small = {"model": "random:tiny-llama", "device": "cpu", "max_model_len": 256, "decode_context": 32,
             "decode_steps": 3}  # fmt: skip
    out = gpu.SECTIONS["backup_pinning"](argparse.Namespace(**(vars(args) | small)))
    json.dumps(out)
    assert host_backup.QUIET_S == 0.5
    assert out["beside_steps"]["quiet_s"] == 0.0 and out["between_steps"]["quiet_s"] == host_backup.QUIET_S
    for name in ("beside_steps", "between_steps"):
        assert out[name]["weight_backup"] == "background" and out[name]["backup_ready"]
        assert out[name]["early_over_first_sleep"] > 0 and out[name]["idle_until_ready_s"] is not None
    assert out["first_sleep"]["idle_until_ready_s"] is None and not out["first_sleep"]["backup_ready"]
    rows = [r[0] for r in gpu.summary({"backup_pinning": out})]
    assert rows == ["b1 step while the backup pins beside steps", "b1 step while the backup pins between steps"]
