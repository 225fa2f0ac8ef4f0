"""The GPU benches' decode timing: every row of the batch is still decoding through the timed steps,
even when chunked prefill took many steps and decoded the first rows meanwhile."""

from __future__ import annotations

from siesta import LLM
from siesta.bench.steps import start_decoding


def test_every_row_decodes_through_the_timed_steps() -> None:
    # 8 prompts of 100 tokens at 64 tokens a step: 13 prefill steps, the first rows decoding early.
    llm = LLM("random:tiny-llama", device="cpu", max_num_batched_tokens=64, max_model_len=1024)
    steps = 5
    ids = start_decoding(llm, 8, 100, steps)
    requests = llm.engine.scheduler.requests
    for _ in range(steps):
        llm.step()
        assert all(rid in requests and not requests[rid].status.finished for rid in ids)
    llm.abort(ids)
