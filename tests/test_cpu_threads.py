"""An engine rank's CPU threads: the cores this process may use, one left to a served API server."""

from __future__ import annotations

import pytest

from siesta import cpu_threads


@pytest.fixture
def cores(monkeypatch):
    def set_cores(n: int, quota: str | None = None, omp: str | None = None):
        monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: set(range(n)))
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        if omp is not None:
            monkeypatch.setenv("OMP_NUM_THREADS", omp)
        monkeypatch.setattr(cpu_threads, "_cgroup_quota_cores", lambda: None if quota is None else int(quota))

    return set_cores


def test_a_served_engine_leaves_one_core_to_the_api_server(cores):
    cores(2)
    assert cpu_threads.engine_threads(None, "api_server", torch_default=2) == 1
    assert cpu_threads.engine_threads(None, "llm", torch_default=2) == 2
    cores(1)
    assert cpu_threads.engine_threads(None, "api_server", torch_default=1) == 1  # never none


def test_the_affinity_mask_and_a_cgroup_quota_cap_torchs_count(cores):
    cores(8, quota="3")
    assert cpu_threads.usable_cores() == 3
    assert cpu_threads.engine_threads(None, "llm", torch_default=8) == 3
    cores(4)
    assert cpu_threads.engine_threads(None, "llm", torch_default=16) == 4


def test_ranks_share_the_cores_and_the_user_wins(cores):
    cores(8)
    assert cpu_threads.engine_threads(None, "api_server", ranks=2, torch_default=8) == 3
    assert cpu_threads.engine_threads(5, "api_server", ranks=2, torch_default=8) == 5
    cores(8, omp="6")
    assert cpu_threads.engine_threads(None, "api_server", ranks=2, torch_default=8) == 6


def test_cgroup_v2_cpu_max_is_read(tmp_path, monkeypatch):
    path = tmp_path / "cpu.max"
    monkeypatch.setattr(cpu_threads, "CGROUP_CPU_MAX", path)
    assert cpu_threads._cgroup_quota_cores() is None  # no file
    path.write_text("max 100000\n")
    assert cpu_threads._cgroup_quota_cores() is None
    path.write_text("150000 100000\n")
    assert cpu_threads._cgroup_quota_cores() == 2


def test_the_engine_applies_them(monkeypatch):
    import torch

    from siesta import LLM

    before = torch.get_num_threads()
    try:
        llm = LLM("random:tiny-llama", kv_cache_bytes=1 << 20, cpu_threads=1)
        assert torch.get_num_threads() == 1 and llm.config.cpu.threads == 1
    finally:
        torch.set_num_threads(before)
