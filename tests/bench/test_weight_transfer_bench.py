"""The weight-transfer bench's CPU path: a served tiny engine, shared-memory pushes, gloo for
the nccl arm. Every arm reports, with positive byte counts (no timing is asserted)."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest
import torch

from siesta.bench import weight_transfer as wt

ARMS = ("plain_copy", "plain_cast_copy", "ipc_first", "ipc", "ipc_fp32", "ipc_packed", "rl_step", "nccl")


@pytest.fixture(scope="module")
def result() -> dict:
    args = argparse.Namespace(model="random:tiny-llama", device="cpu", wt_reps=1, wt_rl_steps=1,
                              wt_kv_cache_bytes=32 << 20, wt_engine_max_model_len=256, wt_bucket_bytes=64 << 10,
                              wt_prompt_len=12, wt_check_tokens=4, wt_startup_timeout_s=300.0)  # fmt: skip
    return wt.weight_transfer(args)


def test_every_arm_reports_positive_bytes(result):
    json.dumps(result)  # the JSON the bench writes
    for arm in ARMS:
        assert "error" not in result[arm], (arm, result[arm])
        assert result[arm]["bytes"] > 0, arm
    assert result["tensors"] > 0 and result["bytes"] == result["ipc"]["bytes"]
    assert result["ipc_fp32"]["bytes"] == 2 * result["ipc"]["bytes"]  # fp32 masters of the bf16 weights
    assert result["ipc"]["pushes"] >= 1 and result["ipc_packed"]["pushes"] >= 1
    assert len(result["rl_step"]["steps"]) == 1 and result["rl_step"]["asleep_after"] is False
    assert result["nccl"]["backend"].startswith("gloo")
    assert result["engine_transfer_bytes_total"] > 0
    assert len(wt.summary_rows(result)) == 3


def test_pushes_change_the_engine_and_match_transformers(result):
    check = result["correctness"]
    assert check["bf16_push"]["changed_by_push"]
    assert check["bf16_push"]["max_abs_logprob_diff"] < 0.1  # bf16 on both sides
    # fp32 masters cast to the bf16 weights, packed buckets and the RL step's push: the same weights.
    for arm in ("packed_push", "fp32_push", "rl_step_push"):
        assert check[arm] == {"same_tokens": True, "max_abs_logprob_diff": 0.0}, arm


def test_the_nccl_arm_skips_honestly_with_one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    o = SimpleNamespace(device=torch.device("cuda", 0), wt_nccl_device="cuda:1")
    assert wt._nccl_arm(o, {}) == {"skipped": "needs 2 GPUs, found 1"}


def test_the_gpu_bench_namespace_gets_this_benchs_defaults():
    o = wt._opts(argparse.Namespace(model="random:llama-3-8b", device="cpu", max_model_len=32768))
    assert o.wt_reps == wt.DEFAULTS["wt_reps"] and o.wt_bucket_bytes == 512 << 20
    assert o.device == torch.device("cpu")


def test_copies_that_do_not_fit_beside_the_engine_are_skipped_and_said(monkeypatch):
    """The 30B MoE's 61 GB on one card: the trainer's and the engine's copies fit, a transformers
    copy or fp32 masters would not. Those checks say so, and the pushes still run and are checked."""
    assert wt._fits(torch.device("cpu"), 1 << 62)  # a CPU run keeps its copies in host memory
    monkeypatch.setattr(wt, "_fits", lambda device, nbytes: False)
    args = argparse.Namespace(model="random:tiny-llama", device="cpu", wt_reps=1, wt_rl_steps=1,
                              wt_kv_cache_bytes=32 << 20, wt_engine_max_model_len=256, wt_bucket_bytes=64 << 10,
                              wt_prompt_len=12, wt_check_tokens=4, wt_startup_timeout_s=300.0, wt_skip_nccl=True)  # fmt: skip
    res = wt.weight_transfer(args)
    json.dumps(res)
    assert "does not fit" in res["correctness"]["bf16_push"]["skipped"]
    assert "do not fit" in res["ipc_fp32"]["skipped"] and "plain_cast_copy" not in res
    assert res["ipc"]["bytes"] > 0 and res["correctness"]["packed_push"]["same_tokens"]
    assert res["correctness"]["rl_step_push"] == {"same_tokens": True, "max_abs_logprob_diff": 0.0}
