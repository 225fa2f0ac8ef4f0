"""The push profile bench on the CPU (shared-memory handles, the tiny Qwen3-MoE): the stacked
layout against the per-expert tensors it joins, and both layouts' arms end to end."""

from __future__ import annotations

import argparse

import torch

from siesta.bench import push_profile
from siesta.model.loader import resolve_model


def test_stacked_joins_each_layers_experts_as_transformers_5_holds_them():
    per_expert = dict(resolve_model("random:tiny-qwen3-moe").iter_weights(torch.float32))
    out = push_profile.stacked(dict(per_expert))
    prefix = "model.layers.1.mlp.experts"
    experts = resolve_model("random:tiny-qwen3-moe").hf_config.num_experts
    for e in range(experts):
        gate, up = per_expert[f"{prefix}.{e}.gate_proj.weight"], per_expert[f"{prefix}.{e}.up_proj.weight"]
        assert torch.equal(out[f"{prefix}.gate_up_proj"][e], torch.cat([gate, up]))
        assert torch.equal(out[f"{prefix}.down_proj"][e], per_expert[f"{prefix}.{e}.down_proj.weight"])
    assert not any(".experts.0." in n for n in out)
    # Every byte is still there, once.
    assert sum(t.numel() for t in out.values()) == sum(t.numel() for t in per_expert.values())


def test_both_layouts_push_and_report_each_arm():
    args = argparse.Namespace(model="random:tiny-qwen3-moe", layers=2, layouts=list(push_profile.LAYOUTS), reps=1,
                              device="cpu")  # fmt: skip
    res = push_profile.run(args)
    assert res["per_expert"]["tensors"] > res["stacked"]["tensors"]
    assert res["per_expert"]["bytes"] == res["stacked"]["bytes"] > 0
    for layout in push_profile.LAYOUTS:
        for arm in push_profile.ENGINE_ARMS:
            cell = res[layout][arm]
            assert cell["push_p50_ms"] > 0 and cell["engine_update_p50_ms"] > 0
            assert "update_weights" in cell["engine_profile"] or "receive" in cell["engine_profile"]
            assert "function calls" in cell["trainer_profile"]  # profiled (its top rows vary)
    assert len(push_profile.summary(res)) == (1 + len(push_profile.ENGINE_ARMS)) * len(push_profile.LAYOUTS)
