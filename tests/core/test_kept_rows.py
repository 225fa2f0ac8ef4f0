"""The last layer's tail (o_proj, MLP, final norm) on the read rows alone: a prompt chunk runs
it on its sampled and scored rows only, and every answer keeps its bits (on the CPU) or
matches transformers (on CUDA, eager)."""

from __future__ import annotations

import pytest
import torch

from conftest import hf_twin

from siesta import LLM, SamplingParams
from siesta.core import model_runner
from siesta.model import cpu_linear, llama

AFTER_ATTENTION = llama.DecoderLayer.after_attention  # taken before any test wraps it


def _generate(monkeypatch: pytest.MonkeyPatch, keep: bool, params: list[SamplingParams], device: str = "cpu"):
    """The LLM, outputs of three prompts (chunked: 48 tokens a step) and the rows each step's
    last layer tail saw; ``keep`` False: the tail on every row of every step."""
    if not keep:
        monkeypatch.setattr(model_runner.ModelRunner, "_kept_rows", staticmethod(lambda inputs: None))
    llm = LLM("random:tiny-llama", dtype="float32", device=device, enforce_eager=True, kv_cache_bytes=1 << 22,
              max_model_len=512, max_num_batched_tokens=48)  # fmt: skip
    last = llm.engine.source.hf_config.num_hidden_layers - 1
    tail_rows: list[int] = []

    def counting(self, attn_out, residual, *rest):  # rest: the step's L2 prefetches, from a forward
        if self.self_attn.layer_idx == last:
            tail_rows.append(attn_out.shape[0])
        return AFTER_ATTENTION(self, attn_out, residual, *rest)

    monkeypatch.setattr(llama.DecoderLayer, "after_attention", counting)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (100, 7, 61)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, prompts, outs, tail_rows


def _answers(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]


@pytest.mark.parametrize("scored", [False, True])
def test_a_prompt_chunk_runs_the_tail_on_its_read_rows_with_the_same_bits(monkeypatch, scored: bool) -> None:
    if cpu_linear.load_gemm() is None:
        pytest.skip("no C compiler (a GPU host): the libraries' linears round by row count")
    greedy = SamplingParams(temperature=0, max_tokens=6, logprobs=3)
    params = [greedy.replace(prompt_logprobs=2) if scored else greedy, greedy, greedy]
    *_, kept, kept_rows = _generate(monkeypatch, True, params)
    *_, full, full_rows = _generate(monkeypatch, False, params)
    # Every step has at most 48 rows, so both runs' linears are the same CPU kernel, whose rows'
    # bits do not depend on the batch: the answers must match exactly, NaN rows never read.
    assert _answers(kept) == _answers(full)
    assert sum(full_rows) == 168 + 3 * 5  # every prompt token, then 5 decode steps of each request
    if scored:  # the first prompt's 99 scored rows go through the tail with the sampled ones
        assert sum(kept_rows) >= 99 + 3 * 6
    else:  # each request's sampled rows only: its first token, then its decode steps
        assert sum(kept_rows) == 3 * 6
    if not scored:  # the first two steps hold only the 100-token prompt's first 96: no tail at all
        assert len(kept_rows) == len(full_rows) - 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's eager forward: bench/gpu.sh runs it")
def test_on_cuda_the_kept_rows_logprobs_match_transformers(monkeypatch) -> None:
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5, prompt_logprobs=1)
    llm, prompts, outs, tail_rows = _generate(monkeypatch, True, [SamplingParams(temperature=0, max_tokens=1), params,
                                                                   SamplingParams(temperature=0, max_tokens=1)], "cuda")  # fmt: skip
    assert sum(tail_rows) == 3 + len(prompts[1]) - 1  # the three sampled rows and the 7-token prompt's scored ones
    hf = hf_twin(llm.engine.source)
    prompt = torch.tensor([prompts[1]])
    with torch.inference_mode():
        ref = torch.log_softmax(hf(prompt).logits[0].double(), -1)
    (step,) = outs[1].outputs[0].logprobs
    for token, lp in step.items():
        assert abs(lp.logprob - ref[-1, token].item()) < 1e-3
    for pos, scores in enumerate(outs[1].prompt_logprobs[1:]):
        token = prompts[1][pos + 1]
        assert abs(scores[token].logprob - ref[pos, token].item()) < 1e-3


def test_steps_that_read_most_of_their_rows_keep_them_all() -> None:
    meta = object()
    ids = torch.zeros(8, dtype=torch.long)
    decode = model_runner.StepInputs(ids, ids, meta, torch.arange(8), [])
    assert model_runner.ModelRunner._kept_rows(decode) is None
    chunk = model_runner.StepInputs(ids, ids, meta, torch.tensor([7]), [])
    assert torch.equal(model_runner.ModelRunner._kept_rows(chunk), torch.tensor([7]))
