"""The prefill's FLOP count against a count by hand from each architecture's published numbers."""

import pytest
import torch

from siesta.bench.flops import prefill_flops
from siesta.model.random_init import RANDOM_SHAPES
from siesta.model.registry import build_model

TOKENS = 8192


def _meta_model(name: str):
    with torch.device("meta"):
        return build_model(RANDOM_SHAPES[name].config(), 4096, None)


def _attention(layers: int, heads: int, head_dim: int, n: int) -> float:
    return 4 * layers * heads * head_dim * n * (n + 1) / 2  # QK^T and PV, causal pairs


@pytest.mark.parametrize("kept", [1, 3])
def test_llama_3_8b_counts_the_head_and_last_mlp_on_the_kept_rows_only(kept):
    h, layers, vocab = 4096, 32, 128256
    before = h * (4096 + 2 * 1024)  # q, k, v
    after = 4096 * h + 3 * h * 14336  # o_proj, gate, up, down
    expected = (2 * TOKENS * (layers * before + (layers - 1) * after) + 2 * kept * (after + vocab * h)
                + _attention(layers, 32, 128, TOKENS))  # fmt: skip
    assert prefill_flops(_meta_model("llama-3-8b"), TOKENS, kept) == pytest.approx(expected, rel=1e-12)


def test_a_tied_head_is_counted_once_on_the_kept_row():
    h, layers, vocab = 576, 30, 49152
    before, after = h * (576 + 2 * 192), 576 * h + 3 * h * 1536
    expected = (2 * TOKENS * (layers * before + (layers - 1) * after) + 2 * (after + vocab * h)
                + _attention(layers, 9, 64, TOKENS))  # fmt: skip
    assert prefill_flops(_meta_model("smollm2-135m"), TOKENS) == pytest.approx(expected, rel=1e-12)


def test_qwen3_30b_a3b_counts_its_routed_experts_only():
    h, layers, vocab, experts, top_k, inter = 2048, 48, 151936, 128, 8, 768
    before = h * (32 * 128 + 2 * 4 * 128)
    after = 32 * 128 * h + experts * h + top_k * 3 * h * inter  # o_proj, router, the k experts a token reads
    expected = (2 * TOKENS * (layers * before + (layers - 1) * after) + 2 * (after + vocab * h)
                + _attention(layers, 32, 128, TOKENS))  # fmt: skip
    flops = prefill_flops(_meta_model("qwen3-30b-a3b"), TOKENS)
    assert flops == pytest.approx(expected, rel=1e-12)
    # What runs before 65 counted: the head over every row, about 7 % more at 8k tokens.
    assert 0.06 < 2 * vocab * h * (TOKENS - 1) / flops < 0.08
