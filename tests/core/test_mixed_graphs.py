"""Whole-step graphs for steps with prefill rows: the stand-in forward of a bucket, over a real
step's rows and padding, gives the eager forward's hidden states and KV writes (run through the
buffers under Triton's interpreter on any machine; captured and replayed on CUDA)."""

from __future__ import annotations

import pytest
import torch
from forward_paths import both_paths, dummy_inputs

from siesta import LLM
from siesta.core.mixed_graphs import MixedGraphs
from siesta.core.model_runner import ModelRunner

CUDA = torch.cuda.is_available()
# (cached, new) tokens per request: an extend over a prefix spanning blocks beside decode rows
# (the resume's step), a fresh prompt among them, and two extends.
RESUME = [(70, 11), (90, 1), (45, 1), (120, 1), (33, 1)]  # 15 tokens, 5 requests: bucket (32, 5)
FRESH = [(0, 9), (40, 8), (3, 1)]  # 18 tokens, 3 requests: bucket (32, 3)
TWO_EXTENDS = [(20, 30), (64, 17), (7, 1)]  # 48 tokens: bucket (64, 3)
MAX_MODEL_LEN = 256


def _runner(device: str, dtype: str, enforce_eager: bool, **kwargs) -> ModelRunner:
    llm = LLM(model="random:tiny-llama", dtype=dtype, device=device, attention_backend="triton",
              max_model_len=MAX_MODEL_LEN, kv_cache_bytes=8 << 20, max_num_batched_tokens=64,
              enforce_eager=enforce_eager, **kwargs)  # fmt: skip
    return llm.engine.runner


def _graphs(runner: ModelRunner, max_tokens: int = 64, max_reqs: int = 16, max_model_len: int = MAX_MODEL_LEN,
            ) -> MixedGraphs:  # fmt: skip
    return MixedGraphs(runner.model, runner.kv_cache, max_tokens, max_reqs, max_model_len, runner.block_size,
                       use_graphs=False)  # fmt: skip


@pytest.fixture(scope="module")
def eager_runner() -> ModelRunner:
    """fp32 and eager, on the GPU where there is one (Triton runs CPU tensors only under its
    interpreter, which the suite turns on where there is none)."""
    return _runner("cuda" if CUDA else "cpu", "float32", enforce_eager=True)


def _stand_in_plan(runner: ModelRunner, graphs: MixedGraphs, bucket: tuple[int, int]):
    shape = runner.model.local
    q = torch.empty(bucket[0], shape.num_heads, shape.head_dim)
    k_cache = runner.kv_cache.layer(0)[0]
    return runner.backend.mixed_plan(q, k_cache, graphs._stand_in(bucket))


@pytest.mark.parametrize("plan_len", [MAX_MODEL_LEN, 4096], ids=["unified", "split"])
@pytest.mark.parametrize("specs,bucket", [(RESUME, (32, 5)), (FRESH, (32, 3)), (TWO_EXTENDS, (64, 3))],
                         ids=["resume", "fresh", "two_extends"])  # fmt: skip
def test_a_bucket_stand_in_over_padded_rows_matches_the_eager_forward(eager_runner, specs, bucket, plan_len) -> None:
    """Planned for contexts of 256 (one unified launch) or 4,096 (the decode and prefill rows
    split into key ranges, most of them empty here) over the real rows' short contexts."""
    graphs = _graphs(eager_runner, max_model_len=plan_len)
    assert graphs.bucket_for(sum(q for _, q in specs), len(specs)) == bucket
    plan = _stand_in_plan(eager_runner, graphs, bucket)
    assert (plan.prefill_splits > 1 and plan.decode_splits > 1) == (plan_len > MAX_MODEL_LEN)
    eager, eager_cache, stepped, stepped_cache = both_paths(
        eager_runner, lambda i: graphs.run(i.input_ids, i.positions, i.meta), specs
    )
    assert not stepped.isnan().any()
    # The bucket plans its own split counts (for max_model_len): fp32 sums in another order.
    torch.testing.assert_close(stepped, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stepped_cache, eager_cache, rtol=1e-5, atol=1e-5)


def test_buckets_hold_a_stand_in_below_the_budget_and_the_batch_limit(eager_runner) -> None:
    graphs = _graphs(eager_runner, max_tokens=48, max_reqs=4)
    # R - 1 decodes at most max_reqs, R below T, T up to the first bucket that holds the budget.
    assert graphs.buckets == [(32, 2), (32, 3), (32, 5), (64, 2), (64, 3), (64, 5)]
    assert graphs.bucket_for(30, 5) == (32, 5)
    assert graphs.bucket_for(33, 2) == (64, 2)
    assert graphs.bucket_for(65, 2) is None  # past the largest token bucket
    assert graphs.bucket_for(10, 6) is None  # more requests than any bucket holds


def test_a_step_no_bucket_holds_is_left_to_the_pieces(eager_runner) -> None:
    graphs = _graphs(eager_runner, max_tokens=32, max_reqs=4)
    inputs = dummy_inputs(eager_runner, [(0, 33)])  # past the budget's bucket (a forced chunk, say)
    assert graphs.run(inputs.input_ids, inputs.positions, inputs.meta) is None


def test_the_runner_replays_few_token_steps_whole(eager_runner, monkeypatch: pytest.MonkeyPatch) -> None:
    eager_runner.mixed_graphs = _graphs(eager_runner)
    try:
        served = []
        run = eager_runner.mixed_graphs.run
        monkeypatch.setattr(eager_runner.mixed_graphs, "run", lambda *a: served.append(a[0].shape[0]) or run(*a))
        eager, _, stepped, _ = both_paths(eager_runner, eager_runner._forward, RESUME)
        assert served == [sum(q for _, q in RESUME)]
        torch.testing.assert_close(stepped, eager, rtol=1e-5, atol=1e-5)
    finally:
        eager_runner.mixed_graphs = None


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_deterministic_mode_keeps_the_pieces() -> None:
    runner = _runner("cuda", "bfloat16", enforce_eager=False, deterministic=True)
    assert runner.mixed_graphs is None and runner.piecewise is not None


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("specs", [RESUME, FRESH, TWO_EXTENDS], ids=["resume", "fresh", "two_extends"])
def test_engine_replays_whole_graphs_for_few_token_steps(specs) -> None:
    runner = _runner("cuda", "bfloat16", enforce_eager=False)
    graphs = runner.mixed_graphs
    assert graphs is not None and len(graphs.graphs) == len(graphs.buckets)
    eager, eager_cache, stepped, stepped_cache = both_paths(runner, runner._forward, specs)
    # bf16: the padded rows change the matmuls' shapes, so cuBLAS may sum in another order.
    torch.testing.assert_close(stepped.float(), eager.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(stepped_cache.float(), eager_cache.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_greedy_tokens_with_whole_step_graphs_match_eager(kv_cache_dtype: str) -> None:
    """Short prompts in small chunks beside decodes: every step with prefill rows is replayed
    whole (a bucket holds each), and the tokens are the eager engine's."""
    from siesta import SamplingParams

    prompts = [{"prompt_token_ids": list(range(5 + 11 * i, 5 + 11 * i + 30 + 17 * i))} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(model="random:tiny-llama", dtype="float32", max_model_len=256, kv_cache_bytes=8 << 20,
                  max_num_batched_tokens=48, enforce_eager=eager, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
        if not eager:
            assert llm.engine.runner.mixed_graphs is not None
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[False] == outs[True]
