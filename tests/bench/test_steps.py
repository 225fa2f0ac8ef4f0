"""The GPU benches' decode timing: every row of the batch is still decoding through the timed steps,
even when chunked prefill took many steps and decoded the first rows meanwhile."""

from __future__ import annotations

import pytest
import torch

from siesta import LLM
from siesta.bench.steps import BatchDoesNotFit, _idle_before, host_calls, start_decoding


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


def test_a_batch_the_kv_cannot_hold_is_refused_before_it_runs() -> None:
    """Rows that wait for others to finish would leave the timed steps a smaller batch."""
    llm = LLM("random:tiny-llama", device="cpu", kv_cache_bytes=1 << 20, max_model_len=1024)
    held = llm.engine.runner.num_blocks * llm.config.cache.block_size
    with pytest.raises(BatchDoesNotFit, match=f"holds {held:,} tokens"):
        start_decoding(llm, 64, held // 64, 5)
    assert not llm.engine.scheduler.requests


def test_idle_time_is_charged_to_the_kernel_that_waited() -> None:
    """Gaps between kernels go to the kernel after them; one that overlaps (another stream) or
    starts inside a longer kernel's span waited for nothing."""
    spans = [(0.0, 10.0, "a"), (14.0, 20.0, "b"), (15.0, 30.0, "c"), (25.0, 28.0, "d"), (31.0, 32.0, "b")]
    assert _idle_before(spans, top=8) == {"b": 0.005}  # 4 us before the first b, 1 us before the second
    assert _idle_before([], top=8) == {}


def test_host_calls_counts_a_read_back_as_blocking() -> None:
    x = torch.arange(10.0)
    out = host_calls(lambda: (x * 2).sum().item())
    assert out["blocking_calls"]["aten::_local_scalar_dense"][0] == 1
    assert out["wall_ms"] > 0 and "aten::mul" in out["top_ops_self_ms"]
