"""SamplingParams: vLLM's defaults, vLLM's ranges, and errors that name the field."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest

from siesta.sampling import MAX_LOGPROBS, SamplingParams

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
}


def test_defaults_equal_vllm() -> None:
    params = SamplingParams()
    assert {f.name: getattr(params, f.name) for f in fields(params)} == VLLM_DEFAULTS
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
