"""The batched sampler against independent oracles.

Oracles are written here in plain Python / float64 (and HF's repetition
penalty processor), never by calling the sampler's own stages.
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from siesta.core.sampler import (
    TOP_P_CANDIDATES,
    Sampler,
    SampleResult,
    SamplingRow,
    apply_allowed_token_ids,
    apply_bans,
    apply_logit_bias,
    apply_penalties,
    bad_word_bans,
    filter_logits,
    make_generator,
)
from siesta.sampling import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
GREEDY = SamplingParams(temperature=0.0)
# A small vocabulary with well separated logits: no ties, and every top_p below sits
# at least 0.01 away from a cumulative-mass boundary.
SMALL_LOGITS = [2.0, -1.0, 1.1, 0.3, -3.0, 1.5, 0.0, -0.4, 0.8, -1.7]
DRAWS = 50_000
# Per-token tolerance on empirical frequencies, in binomial standard deviations.
SIGMAS = 5.0


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


def row(
    params: SamplingParams = GREEDY,
    *,
    generator: torch.Generator | None = None,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    banned: Sequence[int] = (),
) -> SamplingRow:
    return SamplingRow(params, generator, prompt, output, banned)


def random_logits(rows: int, vocab: int, seed: int, device: torch.device, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=generator) * scale).to(device)


def tokens(results: list[SampleResult]) -> list[int]:
    return [r.token_id for r in results]


# -- oracles ---------------------------------------------------------------------------


def expected_distribution(logits: Sequence[float], params: SamplingParams) -> list[float]:
    """vLLM's filtering, one token at a time: temperature, min_p, top_k, top_p, renormalise."""
    scaled = [x / params.temperature for x in logits]
    weights = [math.exp(x - max(scaled)) for x in scaled]  # p / p_max
    keep = [w >= params.min_p for w in weights]
    order = sorted(range(len(logits)), key=lambda i: -scaled[i])
    if params.top_k > 0:
        for i in order[params.top_k :]:
            keep[i] = False
    if params.top_p < 1.0:
        kept_total = sum(weights[i] for i in order if keep[i])
        mass_above = 0.0
        for i in order:
            if keep[i]:
                keep[i] = mass_above < params.top_p
                mass_above += weights[i] / kept_total
    total = sum(w for w, k in zip(weights, keep) if k)
    return [w / total if k else 0.0 for w, k in zip(weights, keep)]


def reference_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Penalties one row and one token at a time, in float64."""
    out = logits.double().cpu().clone()
    vocab = out.shape[1]
    for i, r in enumerate(rows):
        penalty = r.params.repetition_penalty
        for token in set(r.prompt_token_ids) | set(r.output_token_ids):
            if 0 <= token < vocab:
                value = out[i, token].item()
                out[i, token] = value / penalty if value > 0 else value * penalty
        for token, count in Counter(r.output_token_ids).items():
            if 0 <= token < vocab:
                out[i, token] -= r.params.frequency_penalty * count + r.params.presence_penalty
    return out


def assert_matches_distribution(drawn: list[int], expected: list[float]) -> None:
    counts = Counter(drawn)
    n = len(drawn)
    chi_square = 0.0
    for token, p in enumerate(expected):
        if p == 0.0:
            assert counts[token] == 0, f"token {token} is filtered out but was drawn {counts[token]} times"
            continue
        tolerance = SIGMAS * math.sqrt(p * (1 - p) / n)
        assert abs(counts[token] / n - p) <= tolerance, (token, counts[token] / n, p)
        chi_square += (counts[token] - n * p) ** 2 / (n * p)
    dof = sum(p > 0 for p in expected) - 1
    assert chi_square <= dof + SIGMAS * math.sqrt(2 * max(dof, 1)), chi_square


# -- greedy and bans --------------------------------------------------------------------


def test_greedy_is_argmax(device: torch.device) -> None:
    logits = random_logits(16, 1000, seed=1, device=device)
    results = Sampler()(logits, [row() for _ in range(16)])
    assert tokens(results) == logits.argmax(dim=-1).tolist()
    assert all(r.logprob is None and r.rank is None and r.top_logprobs == [] for r in results)


def test_greedy_rows_stay_argmax_in_a_mixed_batch(device: torch.device) -> None:
    logits = random_logits(8, 500, seed=2, device=device)
    params = [GREEDY, SamplingParams(), SamplingParams(temperature=1e-6), SamplingParams(top_p=0.5)] * 2
    results = Sampler()(logits, [row(p) for p in params])
    argmax = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            assert results[i].token_id == argmax[i]


@pytest.mark.parametrize("gap", [1e-3, 1e-5, 0.0])
def test_greedy_takes_the_best_of_near_ties(device: torch.device, gap: float) -> None:
    """Random logits seldom tie: here the best two are ``gap`` apart (an exact tie goes to the
    lower id, as torch.argmax), at both ends and across the chunks the argmax kernels split."""
    for vocab in (10, 1000, 49152, 128_256):
        picks = [(vocab - 1, 1), (1, vocab - 1), (vocab // 2 + 1, vocab // 2), (vocab // 3 + 2, 3)]
        logits = torch.full((len(picks), vocab), -5.0)
        for i, (winner, second) in enumerate(picks):
            logits[i, winner] = 2.0 + gap
            logits[i, second] = 2.0
        results = Sampler()(logits.to(device), [row() for _ in picks])
        expected = [min(w, s) if gap == 0.0 else w for w, s in picks]
        assert tokens(results) == expected, (vocab, gap)


def test_bfloat16_logits_are_accepted(device: torch.device) -> None:
    logits = random_logits(4, 300, seed=3, device=device).bfloat16()
    assert tokens(Sampler()(logits, [row() for _ in range(4)])) == logits.float().argmax(dim=-1).tolist()


def test_banned_tokens_are_never_sampled(device: torch.device) -> None:
    logits = torch.tensor([SMALL_LOGITS] * DRAWS, device=device)
    banned = [0, 5, 2]  # the three likeliest tokens
    drawn = tokens(Sampler(seed=4)(logits, [row(SamplingParams(), banned=banned) for _ in range(DRAWS)]))
    assert not set(drawn) & set(banned)
    allowed = [-math.inf if i in banned else x for i, x in enumerate(SMALL_LOGITS)]
    expected = expected_distribution(allowed, SamplingParams())
    assert_matches_distribution(drawn, expected)


def test_greedy_skips_a_banned_argmax(device: torch.device) -> None:
    logits = torch.tensor([SMALL_LOGITS, SMALL_LOGITS], device=device)
    results = Sampler()(logits, [row(banned=[0]), row()])
    assert tokens(results) == [5, 0]


def test_out_of_vocab_ids_are_ignored(device: torch.device) -> None:
    logits = torch.tensor([SMALL_LOGITS], device=device)
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    results = Sampler()(logits, [row(params, prompt=[10, 99], output=[-1], banned=[len(SMALL_LOGITS), 0])])
    assert tokens(results) == [5]


# -- filtering and the distribution drawn ---------------------------------------------


FILTER_CASES = [
    SamplingParams(),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=2.0),
    SamplingParams(top_k=3),
    SamplingParams(top_p=0.65),
    SamplingParams(top_p=0.8),
    SamplingParams(min_p=0.2),
    SamplingParams(temperature=1.5, top_k=6, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=0.7, top_k=1),
]


@pytest.mark.parametrize("params", FILTER_CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-min{p.min_p}")
def test_filtered_support_and_probabilities(params: SamplingParams, device: torch.device) -> None:
    logits = torch.tensor([SMALL_LOGITS], device=device)
    filtered = filter_logits(logits, [params])
    probs = filtered.double().softmax(dim=-1)[0].cpu()
    expected = torch.tensor(expected_distribution(SMALL_LOGITS, params), dtype=torch.float64)
    assert torch.equal(probs > 0, expected > 0)
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("params", FILTER_CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-min{p.min_p}")
def test_empirical_distribution_matches(params: SamplingParams, device: torch.device) -> None:
    logits = torch.tensor([SMALL_LOGITS] * DRAWS, device=device)
    drawn = tokens(Sampler(seed=5)(logits, [row(params) for _ in range(DRAWS)]))
    assert_matches_distribution(drawn, expected_distribution(SMALL_LOGITS, params))


def test_rows_keep_their_own_filters_in_one_batch(device: torch.device) -> None:
    params = [
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.65),
        SamplingParams(),
        SamplingParams(min_p=0.3),
        SamplingParams(top_k=6, top_p=0.9),
        SamplingParams(top_k=2, top_p=0.9),
    ]
    per_row = DRAWS // len(params)
    logits = torch.tensor([SMALL_LOGITS] * (per_row * len(params) + 1), device=device)
    rows = [row(p) for p in params for _ in range(per_row)]
    # One seeded row among them: unseeded rows then draw apart from it.
    rows.append(row(SamplingParams(seed=1), generator=make_generator(1, device)))
    drawn = tokens(Sampler(seed=6)(logits, rows))
    for j, p in enumerate(params):
        assert_matches_distribution(drawn[j * per_row : (j + 1) * per_row], expected_distribution(SMALL_LOGITS, p))


def test_top_p_after_different_top_ks_in_one_batch(device: torch.device) -> None:
    # Every top-p row here also has top-k, which lets top-p skip the full sort.
    params = [SamplingParams(top_k=6, top_p=0.9), SamplingParams(top_k=2, top_p=0.9)]
    logits = torch.tensor([SMALL_LOGITS] * len(params), device=device)
    probs = filter_logits(logits, params).double().softmax(dim=-1).cpu()
    for i, p in enumerate(params):
        expected = torch.tensor(expected_distribution(SMALL_LOGITS, p), dtype=torch.float64)
        torch.testing.assert_close(probs[i], expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("scale", "top_p", "nucleus_range"),
    [
        (4.0, 0.9, (1, TOP_P_CANDIDATES[0])),
        (2.0, 0.9, (TOP_P_CANDIDATES[0], TOP_P_CANDIDATES[1])),
        (0.05, 0.95, (TOP_P_CANDIDATES[1], None)),
    ],
)
def test_top_p_nucleus_on_a_large_vocab(
    scale: float, top_p: float, nucleus_range: tuple[int, int | None], device: torch.device
) -> None:
    vocab = 20_000
    logits = random_logits(1, vocab, seed=7, device=device, scale=scale)
    kept = filter_logits(logits, [SamplingParams(top_p=top_p)])[0].isfinite().cpu()
    probs = logits[0].double().softmax(dim=-1).cpu()
    low, high = nucleus_range
    assert low < int(kept.sum()) and (high is None or int(kept.sum()) < high)
    # The nucleus is the likeliest tokens, holds top_p, and no kept token is surplus.
    assert probs[kept].min() > probs[~kept].max()
    mass = probs[kept].sum().item()
    slack = 1e-4
    assert mass >= top_p - slack
    assert mass - probs[kept].min().item() < top_p + slack


def test_top_k_larger_than_vocab_keeps_everything(device: torch.device) -> None:
    logits = torch.tensor([SMALL_LOGITS], device=device)
    assert bool(filter_logits(logits, [SamplingParams(top_k=100)]).isfinite().all())


# -- reproducibility ------------------------------------------------------------------


STEPS = 12
SEEDED = SamplingParams(seed=1234, top_p=0.95, top_k=200, temperature=1.3)


def run_seeded(device: torch.device, seed: int, position: int, batch: int) -> list[int]:
    """The seeded row's tokens over STEPS steps, at ``position`` among ``batch`` rows."""
    sampler = Sampler(seed=position)  # the shared generator differs between runs on purpose
    own = make_generator(seed, device)
    others = {i: make_generator(seed + 1 + i, device) for i in range(batch) if i != position and i % 2}
    drawn = []
    for step in range(STEPS):
        logits = random_logits(batch, 500, seed=1000 + step * 31 + batch, device=device, scale=1.0)
        logits[position] = random_logits(1, 500, seed=step, device=device, scale=1.0)[0]
        rows = [row(SamplingParams(), generator=others.get(i)) for i in range(batch)]
        rows[position] = row(SEEDED.replace(seed=seed), generator=own)
        drawn.append(sampler(logits, rows)[position].token_id)
    return drawn


def test_seeded_row_ignores_the_rest_of_the_batch(device: torch.device) -> None:
    alone = run_seeded(device, seed=1234, position=0, batch=1)
    assert len(set(alone)) > 1
    for position, batch in [(0, 5), (3, 5), (6, 7), (2, 3)]:
        assert run_seeded(device, seed=1234, position=position, batch=batch) == alone


def test_different_seeds_draw_differently(device: torch.device) -> None:
    assert run_seeded(device, seed=1234, position=0, batch=1) != run_seeded(device, seed=99, position=0, batch=1)


def test_shared_generator_is_seeded(device: torch.device) -> None:
    logits = random_logits(32, 400, seed=8, device=device, scale=1.0)
    rows = [row(SamplingParams()) for _ in range(32)]
    assert tokens(Sampler(seed=3)(logits, rows)) == tokens(Sampler(seed=3)(logits, rows))
    assert tokens(Sampler(seed=3)(logits, rows)) != tokens(Sampler(seed=4)(logits, rows))


# -- logprobs -------------------------------------------------------------------------


def spaced_logits(rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """Logits 0.005 apart: float32 keeps their order, so ranks are exact."""
    generator = torch.Generator().manual_seed(9)
    return torch.stack([torch.randperm(vocab, generator=generator) * 0.005 - 4.0 for _ in range(rows)]).to(device)


def test_logprobs_match_a_float64_reference(device: torch.device) -> None:
    vocab = 2000
    logits = spaced_logits(6, vocab, device)
    reference = torch.log_softmax(logits.double().cpu(), dim=-1)
    best = reference.argmax(dim=-1).tolist()
    rows = [
        row(SamplingParams(temperature=0.0, logprobs=5)),
        row(
            SamplingParams(logprobs=20, top_k=50, repetition_penalty=1.5, presence_penalty=1.0),
            prompt=[best[1]],
            output=[best[1]],
        ),
        row(SamplingParams(temperature=0.0, logprobs=0), banned=[best[2]]),
        row(SamplingParams(temperature=0.8)),
        row(SamplingParams(temperature=0.0, logprobs=3, frequency_penalty=2.0), output=[best[4]] * 3),
        row(SamplingParams(temperature=1.5, top_p=0.3, logprobs=1)),
    ]
    results = Sampler(seed=10)(logits, rows)
    for i, (r, result) in enumerate(zip(rows, results)):
        n = r.params.logprobs
        if n is None:
            assert (result.logprob, result.rank, result.top_logprobs) == (None, None, [])
            continue
        token = result.token_id
        assert result.logprob == pytest.approx(reference[i, token].item(), abs=1e-5)
        assert result.rank == 1 + int((reference[i] > reference[i, token]).sum())
        order = reference[i].argsort(descending=True)[:n].tolist()
        assert [t for t, _ in result.top_logprobs] == order
        assert [v for _, v in result.top_logprobs] == pytest.approx(reference[i, order].tolist(), abs=1e-5)
    # Bans and penalties moved these rows off their raw argmax; the reported logprobs stay raw.
    assert results[2].token_id != best[2] and results[2].rank == 2
    assert results[4].token_id != best[4] and results[4].rank > 1


def test_logprobs_zero_reports_only_the_sampled_token(device: torch.device) -> None:
    logits = spaced_logits(3, 300, device)
    reference = torch.log_softmax(logits.double().cpu(), dim=-1)
    results = Sampler()(logits, [row(SamplingParams(temperature=0.0, logprobs=0)) for _ in range(3)])
    for i, result in enumerate(results):
        assert result.top_logprobs == [] and result.rank == 1
        assert result.logprob == pytest.approx(reference[i].max().item(), abs=1e-5)


def test_penalties_and_temperature_leave_logprobs_raw(device: torch.device) -> None:
    logits = spaced_logits(1, 300, device)
    plain = Sampler()(logits, [row(SamplingParams(temperature=0.0, logprobs=5))])[0]
    penalised = SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=1.8, frequency_penalty=1.0)
    shifted = Sampler()(logits, [row(penalised, output=[plain.token_id] * 2)])[0]
    assert shifted.token_id != plain.token_id
    assert shifted.top_logprobs == plain.top_logprobs
    hot = Sampler()(logits, [row(SamplingParams(temperature=3.0, logprobs=5))])[0]
    assert hot.top_logprobs == plain.top_logprobs


# -- penalties ------------------------------------------------------------------------


PENALTY_ROWS = [
    row(SamplingParams(repetition_penalty=1.3), prompt=[1, 2, 2, 5], output=[5, 7, 7, 7]),
    row(SamplingParams(presence_penalty=0.5, frequency_penalty=0.3), prompt=[3], output=[3, 3, 9, 10, 10]),
    row(
        SamplingParams(repetition_penalty=0.8, presence_penalty=-0.4, frequency_penalty=0.2),
        prompt=[4, 11, 40],
        output=[11, 12, 12, 63],
    ),
    row(SamplingParams(), prompt=[1, 2, 3], output=[4, 5]),
    # Token containers other than lists: numpy arrays and array('q') are read without a Python loop.
    row(
        SamplingParams(repetition_penalty=2.0, frequency_penalty=-1.0),
        prompt=np.arange(0, 64, 3),
        output=array("q", [6, 6, 50]),
    ),
]


def test_penalties_match_a_per_token_reference(device: torch.device) -> None:
    logits = random_logits(len(PENALTY_ROWS), 64, seed=11, device=device)
    penalised = apply_penalties(logits, PENALTY_ROWS)
    expected = reference_penalties(logits, PENALTY_ROWS)
    torch.testing.assert_close(penalised.double().cpu(), expected, atol=1e-5, rtol=1e-6)
    assert torch.equal(penalised[3], logits[3])


def test_repetition_penalty_matches_transformers(device: torch.device) -> None:
    transformers = pytest.importorskip("transformers")
    vocab = 64
    logits = random_logits(len(PENALTY_ROWS), vocab, seed=12, device=device)
    only_repetition = [
        row(
            SamplingParams(repetition_penalty=r.params.repetition_penalty),
            prompt=r.prompt_token_ids,
            output=r.output_token_ids,
        )
        for r in PENALTY_ROWS
    ]
    ours = apply_penalties(logits, only_repetition).cpu()
    for i, r in enumerate(only_repetition):
        processor = transformers.RepetitionPenaltyLogitsProcessor(penalty=r.params.repetition_penalty)
        input_ids = torch.tensor([[*r.prompt_token_ids, *r.output_token_ids]])
        expected = processor(input_ids, logits[i : i + 1].cpu().clone())[0]
        torch.testing.assert_close(ours[i], expected)


def test_frequency_penalty_changes_the_greedy_choice(device: torch.device) -> None:
    logits = torch.tensor([SMALL_LOGITS], device=device)
    params = SamplingParams(temperature=0.0, frequency_penalty=0.3)
    for repeats in range(4):
        rows = [row(params, output=[0] * repeats)]
        expected = int(reference_penalties(logits, rows)[0].argmax())
        assert Sampler()(logits, rows)[0].token_id == expected
    assert expected == 5  # three repeats push token 0 (2.0 - 0.9) below token 5 (1.5)


def test_input_logits_are_not_modified(device: torch.device) -> None:
    logits = random_logits(4, 200, seed=13, device=device)
    before = logits.clone()
    rows = [
        row(SamplingParams(repetition_penalty=1.5, top_p=0.5), prompt=[1, 2], banned=[3]),
        row(SamplingParams(top_k=5, min_p=0.1), output=[7]),
        row(SamplingParams(temperature=0.0, presence_penalty=1.0, logprobs=2), output=[8]),
        row(SamplingParams(temperature=0.0), banned=[0, 1]),
    ]
    Sampler()(logits, rows)
    assert torch.equal(logits, before)


# -- logit_bias, allowed_token_ids, bad_words ----------------------------------------------


def bad_words(*words: list[int]) -> SamplingParams:
    """Greedy params with bad words given as token sequences (the front end's work)."""
    return SamplingParams(temperature=0.0, bad_words=[f"w{i}" for i in range(len(words))], bad_words_token_ids=list(words))


def test_logit_bias_and_allowed_ids_match_a_plain_reference(device: torch.device) -> None:
    logits = random_logits(4, 50, seed=21, device=device)
    rows = [
        row(SamplingParams(logit_bias={3: 2.5, 49: -7.0, 0: 0.25})),
        row(SamplingParams(allowed_token_ids=[5, 9, 9, 40])),  # a repeated id is still one token
        row(SamplingParams()),
        row(SamplingParams(logit_bias={9: 1.0}, allowed_token_ids=[9, 10])),
    ]
    expected = logits.double().cpu().clone()
    for i, r in enumerate(rows):
        if r.params.allowed_token_ids:
            mask = torch.ones(50, dtype=torch.bool)
            mask[r.params.allowed_token_ids] = False
            expected[i, mask] = -math.inf
        for token, bias in (r.params.logit_bias or {}).items():
            expected[i, token] += bias
    processed = apply_logit_bias(apply_allowed_token_ids(logits, rows), rows)
    torch.testing.assert_close(processed.double().cpu(), expected)


def test_rows_without_the_fields_pay_nothing(device: torch.device) -> None:
    logits = random_logits(3, 40, seed=22, device=device)
    rows = [row(SamplingParams(top_p=0.5)), row(), row(SamplingParams(logit_bias={}))]
    for stage in (apply_allowed_token_ids, apply_bans, apply_logit_bias):
        assert stage(logits, rows) is logits  # no copy, no launch


def test_a_bias_flips_the_greedy_choice_of_its_row_only(device: torch.device) -> None:
    logits = torch.tensor([SMALL_LOGITS] * 3, device=device)
    rows = [row(SamplingParams(temperature=0.0, logit_bias={3: 2.0})), row(), row(SamplingParams(temperature=0.0, logit_bias={0: -1.0}))]
    # Token 3: 0.3 + 2.0 beats token 0's 2.0; token 0 at 1.0 falls behind token 5 (1.5).
    assert tokens(Sampler()(logits, rows)) == [3, 0, 5]


def test_allowed_token_ids_restrict_sampled_and_greedy_rows(device: torch.device) -> None:
    allowed, draws = [1, 4, 7], DRAWS // 5  # three tokens of fair mass: fewer draws tell
    logits = torch.tensor([SMALL_LOGITS] * draws, device=device)
    drawn = tokens(Sampler(seed=23)(logits, [row(SamplingParams(allowed_token_ids=allowed))] * draws))
    masked = [x if i in allowed else -math.inf for i, x in enumerate(SMALL_LOGITS)]
    assert_matches_distribution(drawn, expected_distribution(masked, SamplingParams()))
    greedy = Sampler()(logits[:2], [row(SamplingParams(temperature=0.0, allowed_token_ids=allowed)), row()])
    assert tokens(greedy) == [7, 0]  # 0.8 is the best of the allowed


def test_bias_comes_before_the_repetition_penalty(device: torch.device) -> None:
    """vLLM biases, then penalises: token 0 (1.0, seen) becomes (1.0 - 3.0) * 2 = -4 and loses to
    token 1 (-3.0); penalising first would give 1.0 / 2 - 3.0 = -2.5 and keep token 0."""
    logits = torch.tensor([[1.0, -3.0, -9.0]], device=device)
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={0: -3.0})
    assert tokens(Sampler()(logits, [row(params, prompt=[0])])) == [1]


def test_bias_and_allowed_ids_leave_logprobs_raw(device: torch.device) -> None:
    logits = spaced_logits(1, 300, device)
    plain = Sampler()(logits, [row(SamplingParams(temperature=0.0, logprobs=3))])[0]
    worst, second_worst = logits[0].argsort()[:2].tolist()
    params = SamplingParams(
        temperature=0.0, logprobs=3, logit_bias={worst: 50.0}, allowed_token_ids=[worst, second_worst]
    )
    steered = Sampler()(logits, [row(params)])[0]
    assert steered.token_id == worst != plain.token_id
    assert steered.top_logprobs == plain.top_logprobs
    raw = torch.log_softmax(logits.double().cpu()[0], dim=-1)
    assert steered.logprob == pytest.approx(raw[worst].item(), abs=1e-5)
    assert steered.rank == 300


@pytest.mark.parametrize(
    ("words", "output", "banned"),
    [
        ([[5]], [], [5]),  # one token: always banned
        ([[5, 6]], [], []),  # its prefix is not in the output (vLLM matches the output only)
        ([[5, 6]], [1, 5], [6]),
        ([[5, 6]], [5, 1], []),
        ([[4, 5, 6], [5, 6], [7]], [9, 4, 5], [6, 6, 7]),
        ([[4, 5, 6]], [5], []),  # shorter than the prefix
    ],
)
def test_bad_word_bans(words: list[list[int]], output: list[int], banned: list[int]) -> None:
    assert bad_word_bans(words, output) == banned


def test_a_bad_word_is_never_completed_while_its_prefix_stays_allowed(device: torch.device) -> None:
    """A toy model that loves the two-token word [3, 4]: after 3 it wants 4, otherwise 3. The
    row with the bad word emits 3 but never 3 then 4, nor the one-token bad word 8; the
    row beside it, without bad words, repeats the word."""
    vocab = 10

    def model(history: list[int]) -> list[float]:
        scores = [0.0] * vocab
        scores[4 if history and history[-1] == 3 else 3] = 5.0
        scores[8] = 4.0
        return scores

    sampler = Sampler()
    rows_params = [bad_words([3, 4], [8]), GREEDY]
    outputs: list[list[int]] = [[], []]
    for _ in range(8):
        logits = torch.tensor([model(out) for out in outputs], device=device)
        step = sampler(logits, [row(p, output=list(out)) for p, out in zip(rows_params, outputs)])
        for out, result in zip(outputs, step):
            out.append(result.token_id)
    banned_row, free_row = outputs
    assert 3 in banned_row and 8 not in banned_row
    assert all((a, b) != (3, 4) for a, b in itertools.pairwise(banned_row))
    assert free_row == [3, 4] * 4


def test_row_count_must_match_logits() -> None:
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(2, 10), [row()])


def test_scaled_logprobs_are_of_the_sampled_distribution_and_greedy_rows_stay_raw(device):
    """SGLang's default logprobs: the processed logits (a penalty here) over the temperature,
    computed in float64 as the oracle; greedy rows and rows without the flag keep the raw ones."""
    vocab, seen = 64, [3, 7, 7]
    logits = random_logits(3, vocab, seed=11, device=device)
    scaled = SamplingParams(temperature=0.6, logprobs=2, repetition_penalty=1.7, scaled_logprobs=True, seed=1)
    greedy = SamplingParams(temperature=0.0, logprobs=2, scaled_logprobs=True)
    raw = SamplingParams(temperature=0.6, logprobs=2, seed=2)
    rows = [row(scaled, generator=make_generator(1, device), output=seen), row(greedy),
            row(raw, generator=make_generator(2, device))]  # fmt: skip
    results = Sampler(device=device)(logits, rows)
    host = logits.double().cpu()
    penalised = host[0].clone()
    for t in set(seen):  # HF's repetition penalty on the tokens seen
        penalised[t] = penalised[t] / 1.7 if penalised[t] > 0 else penalised[t] * 1.7
    want = [(penalised / 0.6).log_softmax(-1), host[1].log_softmax(-1), host[2].log_softmax(-1)]
    for result, expected in zip(results, want):
        assert result.logprob == pytest.approx(float(expected[result.token_id]), abs=1e-4)
        top = expected.topk(2).indices.tolist()
        assert [t for t, _ in result.top_logprobs] == top
