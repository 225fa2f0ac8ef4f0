"""Piecewise graphs: a step with prefill rows, cut at attention, gives the eager forward's
hidden states and KV writes (pieces run through the buffers on any device; captured on CUDA)."""

from __future__ import annotations

import pytest
import torch
from forward_paths import both_paths, dummy_inputs

from siesta import LLM
from siesta.core.model_runner import ModelRunner
from siesta.core.piecewise_graphs import PiecewiseGraphs

CUDA = torch.cuda.is_available()
# (cached, new) tokens per request: prefill rows with and without a prefix, decode rows.
MIXED = [(20, 7), (0, 5), (33, 1), (10, 1)]  # 14 tokens: the 16-token bucket, two rows of padding
WIDER = [(0, 9), (40, 8), (3, 1)]  # 18 tokens: the 32-token bucket


def _runner(device: str, dtype: str, backend: str, enforce_eager: bool) -> ModelRunner:
    llm = LLM(model="random:tiny-llama", dtype=dtype, device=device, attention_backend=backend, max_model_len=256,
              kv_cache_bytes=8 << 20, max_num_batched_tokens=64, enforce_eager=enforce_eager)  # fmt: skip
    return llm.engine.runner


@pytest.mark.parametrize("specs", [MIXED, WIDER], ids=["bucket16", "bucket32"])
def test_pieces_through_the_buffers_match_the_eager_forward(specs) -> None:
    runner = _runner("cpu", "float32", "torch", enforce_eager=True)
    graphs = PiecewiseGraphs(runner.model, runner.kv_cache, max_tokens=64, use_graphs=False)
    assert graphs.bucket_for(sum(q for _, q in specs)) in (16, 32)
    eager, eager_cache, pieces, pieces_cache = both_paths(
        runner, lambda inputs: graphs.run(inputs.input_ids, inputs.positions, inputs.meta), specs
    )
    torch.testing.assert_close(pieces, eager, rtol=1e-5, atol=1e-5)
    # Within fp32 rounding, not bit for bit: the pieces run a padded bucket of rows, and a CPU
    # matmul library may pick its kernel (and so its order of sums) by the row count (oneDNN on
    # the H200 host's Xeon does; on the 2-core EPYC it happens to match).
    torch.testing.assert_close(pieces_cache, eager_cache, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("budget,buckets", [(64, [16, 32, 64]), (100, [16, 32, 64, 128]), (10, [16])])
def test_buckets_reach_the_step_budget(budget: int, buckets: list[int]) -> None:
    runner = _runner("cpu", "float32", "torch", enforce_eager=True)
    assert PiecewiseGraphs(runner.model, runner.kv_cache, max_tokens=budget, use_graphs=False).buckets == buckets


def test_the_runner_sends_steps_with_prefill_rows_through_the_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = _runner("cpu", "float32", "torch", enforce_eager=True)
    runner.piecewise = PiecewiseGraphs(runner.model, runner.kv_cache, max_tokens=64, use_graphs=False)
    served = []
    run = runner.piecewise.run
    monkeypatch.setattr(runner.piecewise, "run", lambda *a: served.append(a[0].shape[0]) or run(*a))
    eager, _, pieces, _ = both_paths(runner, runner._forward, MIXED)
    assert served == [sum(q for _, q in MIXED)]
    torch.testing.assert_close(pieces, eager, rtol=1e-5, atol=1e-5)


def test_a_step_past_the_largest_bucket_is_left_to_the_eager_path() -> None:
    runner = _runner("cpu", "float32", "torch", enforce_eager=True)
    graphs = PiecewiseGraphs(runner.model, runner.kv_cache, max_tokens=32, use_graphs=False)
    inputs = dummy_inputs(runner, [(0, 33)])
    assert graphs.run(inputs.input_ids, inputs.positions, inputs.meta) is None


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("specs", [MIXED, WIDER], ids=["bucket16", "bucket32"])
def test_engine_replays_captured_pieces_for_steps_with_prefill_rows(specs) -> None:
    runner = _runner("cuda", "bfloat16", "triton", enforce_eager=False)
    graphs = runner.piecewise
    assert graphs is not None and len(graphs.graphs) == len(graphs.buckets)
    assert all(len(pieces) == runner.model.shape.num_layers + 1 for pieces in graphs.graphs.values())
    eager, eager_cache, pieces, pieces_cache = both_paths(runner, runner._forward, specs)
    # bf16: the padded rows change the matmuls' shapes, so cuBLAS may sum in another order.
    torch.testing.assert_close(pieces.float(), eager.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(pieces_cache.float(), eager_cache.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_greedy_tokens_with_piecewise_graphs_match_eager() -> None:
    """Chunked prefills beside decodes: every step with prefill rows goes through the pieces."""
    from siesta import SamplingParams

    prompts = [{"prompt_token_ids": list(range(5 + 11 * i, 5 + 11 * i + 30 + 17 * i))} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(model="random:tiny-llama", dtype="float32", max_model_len=256, kv_cache_bytes=8 << 20,
                  max_num_batched_tokens=48, enforce_eager=eager)  # fmt: skip
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[False] == outs[True]
