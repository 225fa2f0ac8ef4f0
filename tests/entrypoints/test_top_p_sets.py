"""slime's top-p sets, read off the reported logprobs, against the sampler's own truncation
(``filter_logits``: the tokens it leaves finite are the ones it can draw); and the encoding
slime decodes (base64 int32 ids and offsets)."""

from __future__ import annotations

import base64
import math

import pytest
import torch

from siesta.core.sampler import filter_logits
from siesta.entrypoints.server.sglang.top_p import CANDIDATES, Nucleus, TopPSets
from siesta.request import Logprob
from siesta.sampling import SamplingParams

VOCAB = 64


def reported(logits: torch.Tensor, temperature: float, sampled: int) -> dict[int, Logprob]:
    """What the sampler reports with scaled logprobs: the likeliest CANDIDATES and the sampled token."""
    logprobs = (logits / temperature).log_softmax(-1)
    ranks = logprobs.argsort(descending=True)
    entries = {int(t): Logprob(float(logprobs[t]), rank=i + 1) for i, t in enumerate(ranks[:CANDIDATES])}
    entries.setdefault(sampled, Logprob(float(logprobs[sampled]), rank=int((logprobs > logprobs[sampled]).sum()) + 1))
    return entries


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=12),
        SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05),
        SamplingParams(temperature=1.0, top_k=5),
    ],
)
def test_the_sets_are_the_tokens_the_sampler_keeps(params):
    gen = torch.Generator().manual_seed(7)
    nucleus = Nucleus.of(params)
    exact = 0
    for _ in range(40):
        logits = torch.randn(VOCAB, generator=gen) * 3
        kept = filter_logits(logits.clone().unsqueeze(0), [params])[0].isfinite()
        want = [int(t) for t in logits.argsort(descending=True) if kept[t]]
        got = nucleus.kept(reported(logits, params.temperature, want[0]), want[0])
        if got is not None:  # None: the set reaches past the reported tokens
            assert got == want
            exact += 1
    assert exact >= 20


def test_greedy_rows_report_the_token_and_unfiltered_rows_report_nothing():
    assert Nucleus.of(SamplingParams(temperature=0.0)).kept({}, 9) == [9]
    assert Nucleus.of(SamplingParams(temperature=1.0)) is None


def test_a_set_past_the_reported_tokens_falls_back_to_the_sampled_token_and_is_counted():
    flat = torch.zeros(VOCAB)  # uniform: top_p 0.9 keeps ~58 tokens, far past the 20 reported
    params = SamplingParams(temperature=1.0, top_p=0.9)
    sets = TopPSets.of(Nucleus.of(params), [3], [reported(flat, 1.0, 3)])
    assert sets.token_ids == [3] and sets.offsets == [0, 1] and sets.truncated == 1
    meta = sets.meta()
    assert list(torch.frombuffer(bytearray(base64.b64decode(meta["top_p_token_offsets"])), dtype=torch.int32)) == [0, 1]
    assert sets.renormalised(0, 3, reported(flat, 1.0, 3)) == 0.0


def test_logprobs_are_renormalised_over_the_set():
    logits = torch.tensor([4.0, 3.0, 0.0] + [-5.0] * (VOCAB - 3))
    params = SamplingParams(temperature=1.0, top_k=2)
    entries = reported(logits, 1.0, 1)
    sets = TopPSets.of(Nucleus.of(params), [1], [entries])
    assert sets.token_ids == [0, 1]
    assert math.isclose(sets.renormalised(0, 1, entries), math.log(math.exp(3) / (math.exp(4) + math.exp(3))),
                        rel_tol=1e-6)  # fmt: skip
