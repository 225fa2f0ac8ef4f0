"""Fuzz the generation and tokenizer routes from the server's own OpenAPI schema: never a 5xx,
always healthy.

Schemathesis draws bodies that fit the schema (positive) and bodies that break it (negative).
Generation lengths are capped before sending so the run stays short on a CPU; every other
field goes through as drawn.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from e2e.servers import HTTP_TIMEOUT_S

EXAMPLES = 40
MAX_FUZZ_TOKENS = 3
MAX_FUZZ_CHOICES = 2
MAX_FUZZ_PROMPTS = 3
REQUEST_TIMEOUT_S = 120
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens")
# The token-in/token-out routes carry their lengths in a sampling_params object (SGLang's: one
# per prompt, or one for all), under vLLM's or SGLang's names.
SAMPLING_LENGTHS = ("max_tokens", "max_new_tokens", "min_tokens", "min_new_tokens")


@pytest.fixture(scope="module")
def schema(dev_server):
    return schemathesis.openapi.from_url(f"{dev_server.url}/openapi.json")


def _cap(body: object, path: str = "") -> None:
    """Bound the work a drawn body asks for (tokens, choices, prompts); keep everything else."""
    if not isinstance(body, dict):
        return
    for name in LENGTH_FIELDS:
        if isinstance(body.get(name), int) and not isinstance(body.get(name), bool):
            body[name] = min(body[name], MAX_FUZZ_TOKENS)
    if not any(isinstance(body.get(name), int) for name in LENGTH_FIELDS):
        body["max_tokens"] = MAX_FUZZ_TOKENS  # chat's default is "up to the context limit"
    if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool):
        body["n"] = min(body["n"], MAX_FUZZ_CHOICES)
    for name in ("prompt", "messages"):
        if isinstance(body.get(name), list) and len(body[name]) > MAX_FUZZ_PROMPTS:
            body[name] = body[name][:MAX_FUZZ_PROMPTS]
    if isinstance(body.get("min_tokens"), int) and not isinstance(body.get("min_tokens"), bool):
        body["min_tokens"] = min(body["min_tokens"], MAX_FUZZ_TOKENS)
    for name in ("text", "input_ids"):
        if isinstance(body.get(name), list) and body[name] and isinstance(body[name][0], (str, list)):
            body[name] = body[name][:MAX_FUZZ_PROMPTS]
    sampling = body.get("sampling_params")
    length = "max_new_tokens" if path == "/generate" else "max_tokens"  # SGLang's default is 128
    if sampling is None and path in ("/generate", "/inference/v1/generate"):
        body["sampling_params"] = sampling = {}
    for params in sampling if isinstance(sampling, list) else [sampling]:
        _cap_sampling(params, length)


def _cap_sampling(params: object, length: str) -> None:
    if not isinstance(params, dict):
        return
    for name in SAMPLING_LENGTHS:
        if isinstance(params.get(name), int) and not isinstance(params.get(name), bool):
            params[name] = min(params[name], MAX_FUZZ_TOKENS)
    if params.get(length) is None:  # left out or null: the route's default, or the context limit
        params[length] = MAX_FUZZ_TOKENS
    if isinstance(params.get("n"), int) and not isinstance(params.get("n"), bool):
        params["n"] = min(params["n"], MAX_FUZZ_CHOICES)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])
@pytest.mark.parametrize(
    "path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/generate", "/inference/v1/generate"]
)
def test_no_server_errors(schema, dev_server, path, mode):
    operation = schema[path]["POST"]

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case):
        _cap(case.body, path)
        response = case.call(base_url=dev_server.url, timeout=REQUEST_TIMEOUT_S)
        case.validate_response(response, checks=[not_a_server_error])

    fuzz()
    assert httpx.get(f"{dev_server.url}/health", timeout=HTTP_TIMEOUT_S).status_code == 200
    metrics = dev_server.metrics()
    assert metrics["siesta_num_requests_running"] == 0


# SGLang's control routes change the shared server's state: few examples each, and the server is
# resumed and woken after every one, as every test leaves it.
CONTROL_EXAMPLES = 6
CONTROL_ROUTES = ["/abort_request", "/pause_generation", "/flush_cache", "/release_memory_occupation",
                  "/resume_memory_occupation"]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "mode"),
    [(path, mode) for path in CONTROL_ROUTES for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
     if not (path == "/flush_cache" and mode == GenerationMode.NEGATIVE)],  # no body: nothing to break
)  # fmt: skip
def test_no_server_errors_on_sglangs_control_routes(schema, dev_server, path, mode):
    operation = schema[path]["POST"]

    @settings(max_examples=CONTROL_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case):
        try:
            response = case.call(base_url=dev_server.url, timeout=REQUEST_TIMEOUT_S)
            case.validate_response(response, checks=[not_a_server_error])
        finally:
            for restore in ("/resume_memory_occupation", "/continue_generation"):
                assert httpx.post(dev_server.url + restore, json={}, timeout=REQUEST_TIMEOUT_S).status_code == 200

    fuzz()
    assert httpx.get(f"{dev_server.url}/health", timeout=HTTP_TIMEOUT_S).status_code == 200
    assert httpx.get(f"{dev_server.url}/is_sleeping", timeout=HTTP_TIMEOUT_S).json() == {"is_sleeping": False}
    assert httpx.get(f"{dev_server.url}/is_paused", timeout=HTTP_TIMEOUT_S).json() == {"is_paused": False}
