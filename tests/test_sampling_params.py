"""SamplingParams: vLLM's defaults, vLLM's ranges, and errors that name the field."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest

from siesta.sampling import (
    MAX_BAD_WORDS_TOTAL_TOKENS,
    MAX_LOGPROBS,
    MAX_NUM_BAD_WORDS,
    RequestOutputKind,
    SamplingParams,
)

# vLLM's SamplingParams defaults, written out by hand (after __post_init__ normalisation).
VLLM_DEFAULTS: dict[str, Any] = {
    "n": 1,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "seed": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "max_tokens": 16,
    "min_tokens": 0,
    "stop": [],
    "stop_token_ids": [],
    "ignore_eos": False,
    "logprobs": None,
    "prompt_logprobs": None,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False,
    "detokenize": True,
    "output_kind": RequestOutputKind.CUMULATIVE,
    "logit_bias": None,
    "allowed_token_ids": None,
    "bad_words": [],
    "truncate_prompt_tokens": None,
    "bad_words_token_ids": None,  # vLLM's _bad_words_token_ids
    "routed_experts_prompt_start": 0,
}
# siesta's own, off by default: a default request behaves as vLLM's.
SIESTA_DEFAULTS: dict[str, Any] = {"scaled_logprobs": False, "return_routed_experts": False}


def test_defaults_equal_vllm() -> None:
    params = SamplingParams()
    assert {f.name: getattr(params, f.name) for f in fields(params)} == VLLM_DEFAULTS | SIESTA_DEFAULTS
    assert MAX_LOGPROBS == 20


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", 1.5),
        ("n", True),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_k", -2),
        ("top_k", 2.0),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("seed", 1.5),
        ("seed", 2**64),
        ("presence_penalty", 2.01),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("logprobs", MAX_LOGPROBS + 1),
        ("prompt_logprobs", -1),
        ("prompt_logprobs", MAX_LOGPROBS + 1),
        ("prompt_logprobs", 1.0),
        ("stop", [""]),
        ("stop", ["ok", ""]),
        ("stop", ""),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1, "2"]),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"5": 1.0}),
        ("logit_bias", {True: 1.0}),
        ("logit_bias", {5: float("nan")}),
        ("logit_bias", {5: float("inf")}),
        ("logit_bias", {5: "1"}),
        ("logit_bias", [5, 1.0]),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [3, -1]),
        ("allowed_token_ids", [2.0]),
        ("bad_words", [""]),
        ("bad_words", "word"),
        ("bad_words", ["ok", 3]),
        ("truncate_prompt_tokens", 0),
        ("truncate_prompt_tokens", -2),
        ("truncate_prompt_tokens", 1.5),
        ("truncate_prompt_tokens", True),
        ("output_kind", 1),
        ("bad_words_token_ids", [[]]),
        ("bad_words_token_ids", [5]),
        ("bad_words_token_ids", [[1, -3]]),
        ("bad_words_token_ids", [[1]] * (MAX_NUM_BAD_WORDS + 1)),
        ("bad_words_token_ids", [[1] * (MAX_BAD_WORDS_TOTAL_TOKENS + 1)]),
    ],
)
def test_invalid_value_names_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=17, max_tokens=16)
    assert SamplingParams(min_tokens=500, max_tokens=None).min_tokens == 500


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_p": 1e-3},
        {"top_k": -1},
        {"top_k": 1},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 1e-3},
        {"max_tokens": None},
        {"max_tokens": 1, "min_tokens": 1},
        {"logprobs": 0},
        {"logprobs": MAX_LOGPROBS},
        {"prompt_logprobs": 0},
        {"prompt_logprobs": MAX_LOGPROBS},
        {"seed": -(2**63)},
        {"seed": 2**64 - 1},
        {"logit_bias": {0: -100.0, 7: 250.5}},  # no clamp offline: vLLM clamps over HTTP only
        {"allowed_token_ids": [0]},
        {"truncate_prompt_tokens": -1},
        {"truncate_prompt_tokens": 1},
        {"detokenize": False},
        {"output_kind": RequestOutputKind.FINAL_ONLY},
        {"bad_words_token_ids": [[1]] * MAX_NUM_BAD_WORDS},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict[str, Any]) -> None:
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == value


def test_stop_is_normalised_to_a_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop_token_ids=(7, 9)).stop_token_ids == [7, 9]


def test_stop_lists_are_copied() -> None:
    stops = ["x"]
    params = SamplingParams(stop=stops)
    stops.append("y")
    assert params.stop == ["x"]
    clone = params.clone()
    clone.stop.append("z")
    assert params.stop == ["x"]


@pytest.mark.parametrize(("temperature", "greedy"), [(0.0, True), (9e-6, True), (1e-5, False), (0.7, False)])
def test_greedy_below_vllm_epsilon(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).greedy is greedy


def test_replace_validates_again() -> None:
    params = SamplingParams(temperature=0.5, stop="END")
    changed = params.replace(top_k=40)
    assert (changed.top_k, changed.temperature, changed.stop) == (40, 0.5, ["END"])
    assert params.top_k == 0
    with pytest.raises(ValueError, match="top_p"):
        params.replace(top_p=2.0)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, False),
        ({"repetition_penalty": 1.2}, True),
        ({"presence_penalty": 0.1}, True),
        ({"frequency_penalty": -0.1}, True),
    ],
)
def test_has_penalties(kwargs: dict[str, Any], expected: bool) -> None:
    assert SamplingParams(**kwargs).has_penalties is expected


def test_stop_strings_need_detokenize() -> None:
    with pytest.raises(ValueError, match="stop strings need detokenize"):
        SamplingParams(stop=["\n"], detokenize=False)
    assert SamplingParams(stop_token_ids=[2], detokenize=False).stop_token_ids == [2]


def test_bad_words_drop_repeats_and_containers_are_copied() -> None:
    bias, allowed = {5: 1.0}, [1, 2]
    params = SamplingParams(bad_words=["a", "b", "a"], logit_bias=bias, allowed_token_ids=allowed)
    bias[6] = 2.0
    allowed.append(3)
    assert (params.bad_words, params.logit_bias, params.allowed_token_ids) == (["a", "b"], {5: 1.0}, [1, 2])
    clone = params.clone()
    clone.logit_bias[7] = 0.5
    clone.allowed_token_ids.append(9)
    assert (params.logit_bias, params.allowed_token_ids) == ({5: 1.0}, [1, 2])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logit_bias": {100: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [3, 100]}, "allowed_token_ids"),
        ({"bad_words": ["x"], "bad_words_token_ids": [[3, 100]]}, "bad_words"),
    ],
)
def test_token_ids_are_checked_against_the_vocabulary(kwargs: dict[str, Any], field: str) -> None:
    params = SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=rf"^{field} holds token id 100, outside the vocabulary \[0, 100\)"):
        params.verify_token_ids(100)
    params.verify_token_ids(101)


@pytest.mark.parametrize(("k", "kept"), [(None, None), (-1, 64), (1, 1), (64, 64)])
def test_prompt_truncation(k: int | None, kept: int | None) -> None:
    assert SamplingParams(truncate_prompt_tokens=k).prompt_truncation(max_model_len=64) == kept


def test_truncation_beyond_max_model_len_is_refused() -> None:
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be <= max_model_len=64"):
        SamplingParams(truncate_prompt_tokens=65).prompt_truncation(max_model_len=64)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, False),
        ({"bad_words": ["x"], "bad_words_token_ids": [[5], [6]]}, False),  # one-token words need no history
        ({"bad_words": ["xy"], "bad_words_token_ids": [[5], [6, 7]]}, True),
        ({"presence_penalty": 0.5}, True),
    ],
)
def test_reads_output_tokens(kwargs: dict[str, Any], expected: bool) -> None:
    assert SamplingParams(**kwargs).reads_output_tokens is expected
