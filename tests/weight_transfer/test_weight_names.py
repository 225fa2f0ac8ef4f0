"""A trainer's names and tensors as the engine takes them: wrappers stripped, ties sent once,
q/k/v and gate/up fused into the engine's layout when asked."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from siesta import LLM
from siesta.model.random_init import RANDOM_SHAPES
from siesta.weight_transfer.names import checkpoint_name, checkpoint_tensors


def test_wrapper_segments_are_stripped():
    assert checkpoint_name("module._orig_mod.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert checkpoint_name("model._fsdp_wrapped_module.layers.1.self_attn.q_proj.weight") == (
        "model.layers.1.self_attn.q_proj.weight"
    )


def test_a_tied_head_is_sent_once_and_an_untied_one_is_kept():
    torch.manual_seed(0)
    tied = AutoModelForCausalLM.from_config(RANDOM_SHAPES["tiny-qwen2"].config())
    names = [n for n, _ in checkpoint_tensors(tied)]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    untied = AutoModelForCausalLM.from_config(RANDOM_SHAPES["tiny-llama"].config())
    assert "lm_head.weight" in [n for n, _ in checkpoint_tensors(untied)]


def test_fused_tensors_are_the_engines_fused_parameters():
    """The oracle: the engine's own loader writing the unfused HF tensors."""
    cfg = RANDOM_SHAPES["tiny-qwen2"].config()  # q/k/v biases too
    torch.manual_seed(1)
    hf = AutoModelForCausalLM.from_config(cfg).float()
    llm = LLM("random:tiny-qwen2", dtype="float32", kv_cache_bytes=8 << 20)
    model = llm.engine.runner.model
    model.load_weights(hf.state_dict().items())
    fused = dict(checkpoint_tensors(hf, fuse=True))
    params = dict(model.named_parameters())
    for name in ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.qkv_proj.bias",
                 "model.layers.1.mlp.gate_up_proj.weight"):  # fmt: skip
        assert torch.equal(fused[name], params[name]), name
    assert not any(".q_proj." in n or ".up_proj." in n for n in fused)


def test_an_incomplete_group_travels_unfused():
    q = torch.ones(2, 2)
    out = dict(checkpoint_tensors([("model.layers.0.self_attn.q_proj.weight", q)], fuse=True))
    assert list(out) == ["model.layers.0.self_attn.q_proj.weight"]


def test_tensors_are_cast_and_made_contiguous():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()
    ((name, out),) = checkpoint_tensors([("module.model.norm.weight", t)], dtype=torch.bfloat16)
    assert name == "model.norm.weight" and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert torch.equal(out.float(), t)
