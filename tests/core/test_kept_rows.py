"""The last layer's tail (o_proj, MLP, final norm) on the read rows alone: a prompt chunk runs
it on its sampled and scored rows only, and every answer keeps its bits."""

from __future__ import annotations

import pytest
import torch

from siesta import LLM, SamplingParams
from siesta.core import model_runner
from siesta.model import llama

AFTER_ATTENTION = llama.DecoderLayer.after_attention  # taken before any test wraps it


def _generate(monkeypatch: pytest.MonkeyPatch, keep: bool, params: list[SamplingParams]):
    """Outputs of three prompts (chunked: 48 tokens a step) and the rows each step's last
    layer tail saw; ``keep`` False: the tail on every row of every step."""
    if not keep:
        monkeypatch.setattr(model_runner.ModelRunner, "_kept_rows", staticmethod(lambda inputs: None))
    llm = LLM("random:tiny-llama", dtype="float32", device="cpu", kv_cache_bytes=1 << 22, max_model_len=512,
              max_num_batched_tokens=48)  # fmt: skip
    last = llm.engine.source.hf_config.num_hidden_layers - 1
    tail_rows: list[int] = []

    def counting(self, attn_out, residual):
        if self.self_attn.layer_idx == last:
            tail_rows.append(attn_out.shape[0])
        return AFTER_ATTENTION(self, attn_out, residual)

    monkeypatch.setattr(llama.DecoderLayer, "after_attention", counting)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (100, 7, 61)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return outs, tail_rows


def _answers(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]


@pytest.mark.parametrize("scored", [False, True])
def test_a_prompt_chunk_runs_the_tail_on_its_read_rows_with_the_same_bits(monkeypatch, scored: bool) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=6, logprobs=3)
    params = [greedy.replace(prompt_logprobs=2) if scored else greedy, greedy, greedy]
    kept, kept_rows = _generate(monkeypatch, True, params)
    full, full_rows = _generate(monkeypatch, False, params)
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


def test_steps_that_read_most_of_their_rows_keep_them_all() -> None:
    meta = object()
    ids = torch.zeros(8, dtype=torch.long)
    decode = model_runner.StepInputs(ids, ids, meta, torch.arange(8), [])
    assert model_runner.ModelRunner._kept_rows(decode) is None
    chunk = model_runner.StepInputs(ids, ids, meta, torch.tensor([7]), [])
    assert torch.equal(model_runner.ModelRunner._kept_rows(chunk), torch.tensor([7]))
