"""The decoder against transformers on the same random weights, one model per architecture."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, hf_twin

from siesta import LLM, SamplingParams
from siesta.model.loader import resolve_model

TINY = ["tiny-llama", "tiny-llama3", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"]


@pytest.mark.parametrize("shape", TINY)
def test_logits_match_transformers(shape):
    llm = LLM(f"random:{shape}", dtype="float32", kv_cache_bytes=1 << 22, max_model_len=512)
    hf = hf_twin(llm.engine.source)
    prompt = torch.randint(3, hf.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = torch.log_softmax(hf(prompt).logits[0, -1].double(), -1)
    out = llm.generate({"prompt_token_ids": prompt[0].tolist()}, SamplingParams(max_tokens=1, logprobs=5, temperature=0),
                       use_tqdm=False)[0].outputs[0]  # fmt: skip
    (step,) = out.logprobs
    top = sorted(step.items(), key=lambda kv: -kv[1].logprob)[:5]
    assert [t for t, _ in top] == ref.topk(5).indices.tolist()
    for token, lp in top:
        assert abs(lp.logprob - ref[token].item()) < 1e-4


@pytest.mark.parametrize("shape", TINY)
def test_greedy_tokens_match_transformers(shape):
    source = resolve_model(f"random:{shape}")
    llm = LLM(f"random:{shape}", dtype="float32", kv_cache_bytes=1 << 22, max_model_len=512)
    hf = hf_twin(source)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 37, 130, 260)]
    params = SamplingParams(temperature=0, max_tokens=40)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, 40, source.eos_token_ids)
