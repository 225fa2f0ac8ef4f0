"""A 4xx names the field as the user wrote it (``a.b.0``), never pydantic's union and validator
tags (``sampling_params.function-after[_refuse(), SGLangSamplingParams]``)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from siesta.entrypoints.server.errors import describe_errors, field_path
from siesta.entrypoints.server.protocol import CompletionRequest
from siesta.entrypoints.server.sglang.protocol import GenerateRequest
from siesta.entrypoints.server.sglang.weight_protocol import InitWeightsUpdateGroupRequest


@pytest.mark.parametrize(
    ("model", "body", "param", "needle"),
    [
        (GenerateRequest, {"input_ids": [1], "sampling_params": {"json_schema": "{}"}},
         "sampling_params.json_schema", "is not supported"),
        (GenerateRequest, {"input_ids": [1], "sampling_params": {"temperature": "hot"}},
         "sampling_params.temperature", "valid number"),
        (GenerateRequest, {"input_ids": [[1], ["x"]]}, "input_ids.1.0", "valid integer"),
        (CompletionRequest, {"prompt": [True]}, "prompt.0", "not the boolean true"),
        (CompletionRequest, {"prompt": "x", "logit_bias": {"5": "y"}}, "logit_bias.5", "valid number"),
        (InitWeightsUpdateGroupRequest, {"master_address": "h", "master_port": "x", "rank_offset": 1, "world_size": 2},
         "master_port", "valid integer"),
    ],
)  # fmt: skip
def test_the_param_is_the_users_field_path(model, body, param, needle):
    with pytest.raises(ValidationError) as err:
        model.model_validate(body)
    message, first = describe_errors(err.value.errors())
    assert first == param
    assert needle in message
    assert "[" not in message.split(":")[0] and "function-" not in message


def test_only_pydantic_tags_leave_the_path():
    loc = ("body", "sampling_params", "function-after[_refuse(), SGLangSamplingParams]", "stop", 0, "str")
    assert field_path(loc) == ["body", "sampling_params", "stop", "0"]
    assert field_path(("prompt", "list[function-before[_not_a_bool(), int]]", 3)) == ["prompt", "3"]


def test_an_sglang_master_port_given_as_a_string_is_taken():
    body = {"master_address": "h", "master_port": "29500", "rank_offset": 1, "world_size": 2}  # AReaL's
    assert InitWeightsUpdateGroupRequest.model_validate(body).master_port == 29500
