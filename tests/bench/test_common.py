"""Bench helpers: the machine facts every CPU result carries."""

from __future__ import annotations

import mmap
import os
import platform
import sys
from pathlib import Path

import pytest
import torch

from siesta.bench import common
from siesta.bench.common import machine


def _model_name_from_cpuinfo() -> str:
    path = Path("/proc/cpuinfo")
    lines = path.read_text().splitlines() if path.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor()


def test_machine_names_the_cpu_and_its_threads() -> None:
    facts = machine()
    assert facts["cpu"] == _model_name_from_cpuinfo()
    assert facts["logical_cpus"] == os.cpu_count()
    assert facts["torch_threads"] == torch.get_num_threads()
    assert facts["torch"] == torch.__version__


def test_machine_names_the_isa_the_kernels_are_built_with() -> None:
    """Read against /proc/cpuinfo's own flags: a native build uses only what the CPU has."""
    facts = machine()
    if platform.machine() != "x86_64" or not Path("/proc/cpuinfo").exists():
        assert isinstance(facts["kernel_isa"], list)
        return
    flags = {f.upper() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
             for f in line.split(":", 1)[1].split()}  # fmt: skip
    assert facts["kernel_isa"], "a native build on x86-64 uses at least SSE4.2"
    for feature in facts["kernel_isa"]:
        assert feature.replace("_", "") in {f.replace("_", "") for f in flags}, feature


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_host_memory_counts_what_this_process_holds() -> None:
    size = 512 << 20
    before = common.host_memory_gib()
    # Fresh pages from the kernel, each touched: a bytearray may reuse heap pages that earlier
    # tests freed and the allocator kept resident (then the RSS does not move: seen in the suite).
    held = mmap.mmap(-1, size)
    held.write(b"\1" * size)
    after = common.host_memory_gib()
    assert after["process_rss"] - before["process_rss"] >= 0.4
    assert 0 < after["host_available"]
    held.close()


def test_a_table_without_rows_prints_its_headers(capsys) -> None:
    """A diagnostic section that adds no summary row once ended the run with a TypeError."""
    from siesta.bench.common import print_table

    print_table("t", ["measure", "value"], [])
    assert capsys.readouterr().out.splitlines()[-2:] == ["measure  value", "-------  -----"]


def test_a_failed_part_is_recorded_with_where_it_failed_and_the_next_part_runs() -> None:
    out: dict = {}

    def inner() -> None:
        raise RuntimeError("operation failed during capture")

    common.run_part(out, "demo", "broken", lambda: inner())
    common.run_part(out, "demo", "fine", lambda: {"ok": 1})
    assert out["broken"]["error"] == "RuntimeError: operation failed during capture"
    assert "in inner" in out["broken"]["where"]  # the frame that raised, not only the message
    assert out["fine"] == {"ok": 1} and out["broken_s"] >= 0
