"""Server pieces without an engine process: request -> SamplingParams, prompts, typed booleans,
error shapes and statuses (a fake core stands in for the engine-core client)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from siesta.control import ConnectorRetentionError, EngineStateError, RequestRejected
from siesta.entrypoints.server.app import build_app
from siesta.entrypoints.server.errors import APIError, error_type, status_for
from siesta.entrypoints.server.limits import PromptLimit
from siesta.entrypoints.server.prompts import completion_prompts
from siesta.entrypoints.server.protocol import ChatCompletionRequest, CompletionRequest
from siesta.entrypoints.server.query_types import parse_bool
from siesta.entrypoints.server.sampling_params import chat_params, child_params, completion_params, tokenize_params
from siesta.entrypoints.server.state import ServerConfig
from siesta.ipc.protocol import EngineInfo
from siesta.ipc.remote_errors import EngineDeadError
from siesta.metrics import MetricsRegistry
from siesta.sampling import SamplingParams
from siesta.tokenizer import bad_words_token_ids

REFUSAL = "FakeConnector cannot keep its cache across a pause; drop clear_connector_cache=False"
VOCAB = 100


@pytest.mark.parametrize(("text", "value"), [("true", True), ("True", True), ("1", True),
                                             ("false", False), ("False", False), ("0", False)])  # fmt: skip
def test_parse_bool_accepts_six_spellings(text, value):
    assert parse_bool(text) is value


@pytest.mark.parametrize("text", ["yes", "no", "on", "off", "TRUE", "t", "", "2", " true"])
def test_parse_bool_rejects_everything_else(text):
    with pytest.raises(ValueError, match="true, false, True, False, 1, 0"):
        parse_bool(text)


def test_completion_defaults_follow_openai():
    params = completion_params(CompletionRequest(prompt="x"))
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.n) == (16, 1.0, 1.0, 0, 1)
    extras = CompletionRequest(prompt="x", top_k=5, min_p=0.1, repetition_penalty=1.2, ignore_eos=True, min_tokens=2,
                               stop_token_ids=[7], include_stop_str_in_output=True, skip_special_tokens=False)  # fmt: skip
    p = completion_params(extras)
    assert (p.top_k, p.min_p, p.repetition_penalty, p.ignore_eos, p.min_tokens) == (5, 0.1, 1.2, True, 2)
    assert (p.stop_token_ids, p.include_stop_str_in_output, p.skip_special_tokens) == ([7], True, False)


def test_logit_bias_keys_become_token_ids_and_biases_are_clamped():
    """OpenAI sends token ids as JSON keys (strings); vLLM clamps each bias to [-100, 100]."""
    body = CompletionRequest(prompt="x", logit_bias={"5": 3.5, "7": 250, "9": -1e9}, allowed_token_ids=[5, 7],
                             bad_words=["no"], truncate_prompt_tokens=-1)  # fmt: skip
    p = completion_params(body)
    assert p.logit_bias == {5: 3.5, 7: 100.0, 9: -100.0}
    assert (p.allowed_token_ids, p.bad_words, p.truncate_prompt_tokens) == ([5, 7], ["no"], -1)
    with pytest.raises(ValueError, match="^logit_bias keys must be token ids"):
        completion_params(CompletionRequest(prompt="x", logit_bias={"five": 1.0}))


def test_bad_words_become_token_ids_and_odd_text_is_a_400(embedded_tokenizer):
    params = tokenize_params(SamplingParams(bad_words=["Paris"]), embedded_tokenizer, VOCAB_EMBEDDED)
    assert params.bad_words_token_ids == bad_words_token_ids(embedded_tokenizer, ["Paris"])
    for words, tokenizer in ((["\ud800"], embedded_tokenizer), (["Paris"], None)):  # a lone surrogate; no tokenizer
        with pytest.raises(APIError) as err:
            tokenize_params(SamplingParams(bad_words=words), tokenizer, VOCAB_EMBEDDED)
        assert err.value.status == 400 and err.value.param == "bad_words"
    with pytest.raises(ValueError, match="^allowed_token_ids holds token id 100"):
        tokenize_params(SamplingParams(allowed_token_ids=[100]), None, VOCAB)


def test_chat_lengths_and_logprobs():
    messages = [{"role": "user", "content": "hi"}]
    assert chat_params(ChatCompletionRequest(messages=messages)).max_tokens is None
    both = ChatCompletionRequest(messages=messages, max_tokens=9, max_completion_tokens=4)
    assert chat_params(both).max_tokens == 4  # the newer field wins
    assert chat_params(ChatCompletionRequest(messages=messages, logprobs=True)).logprobs == 0
    assert chat_params(ChatCompletionRequest(messages=messages, logprobs=True, top_logprobs=3)).logprobs == 3
    with pytest.raises(APIError) as err:
        chat_params(ChatCompletionRequest(messages=messages, top_logprobs=3))
    assert err.value.status == 400 and err.value.param == "top_logprobs"


def test_n_children_get_their_own_seeds():
    params = completion_params(CompletionRequest(prompt="x", n=3, seed=10))
    assert [child_params(params, i).seed for i in range(3)] == [10, 11, 12]
    assert all(child_params(params, i).n == 1 for i in range(3))


LIMIT = PromptLimit(max_model_len=64, max_token_chars=4)


VOCAB_EMBEDDED = 49152


def test_prompt_shapes():
    assert [p.token_ids for p in completion_prompts(None, [1, 2], VOCAB, LIMIT)] == [[1, 2]]
    assert [p.token_ids for p in completion_prompts(None, [[1], [2, 3]], VOCAB, LIMIT)] == [[1], [2, 3]]
    for bad in ([], [[1], [VOCAB]], "text without a tokenizer", [1] * 64, "x" * 256):
        with pytest.raises(APIError) as err:
            completion_prompts(None, bad, VOCAB, LIMIT)
        assert err.value.status == 400 and err.value.param == "prompt"


def test_prompts_to_be_truncated_skip_the_length_checks_and_keep_their_last_tokens(embedded_tokenizer):
    long_ids = list(range(1, 81))  # longer than max_model_len=64: fine once cut to 5
    assert [p.token_ids for p in completion_prompts(None, long_ids, VOCAB, LIMIT, truncate_to=5)] == [long_ids[-5:]]
    limit = PromptLimit.of(embedded_tokenizer, max_model_len=8)
    huge = "the sea is wide " * limit.max_model_len * limit.max_token_chars  # refused untokenized otherwise
    (prompt,) = completion_prompts(embedded_tokenizer, huge, VOCAB_EMBEDDED, limit, truncate_to=4)
    assert prompt.token_ids == embedded_tokenizer.encode(huge)[-4:] and prompt.text == huge
    with pytest.raises(APIError, match="has 64 tokens but max_model_len is 64"):  # still no room for the output
        completion_prompts(None, long_ids, VOCAB, LIMIT, truncate_to=64)


def test_a_text_too_long_for_any_tokenization_is_refused_untokenized(embedded_tokenizer):
    """No token spans more characters than the longest vocabulary entry: that bounds the tokens
    of a text from below without tokenizing it."""
    limit = PromptLimit.of(embedded_tokenizer, max_model_len=100)
    longest = max(len(embedded_tokenizer.decode([i])) for i in range(len(embedded_tokenizer)))
    assert limit.max_token_chars >= longest
    text = "the sea is wide and deep " * 40  # 1,000 characters, ~200 tokens
    assert len(text) < limit.max_model_len * limit.max_token_chars  # not refused untokenized: it is tokenized
    with pytest.raises(APIError, match="has .* tokens but max_model_len is 100"):
        completion_prompts(embedded_tokenizer, [embedded_tokenizer.encode(text)], VOCAB_EMBEDDED, limit)
    huge = "x" * (limit.max_model_len * limit.max_token_chars)
    calls = []
    real = embedded_tokenizer.encode
    embedded_tokenizer.encode = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        with pytest.raises(APIError, match="characters, so at least"):
            completion_prompts(embedded_tokenizer, huge, VOCAB_EMBEDDED, limit)
        assert not calls  # refused before the tokenizer saw it
        completion_prompts(embedded_tokenizer, "a short prompt", VOCAB_EMBEDDED, limit)
        assert calls  # the spy does see tokenizations
    finally:
        embedded_tokenizer.encode = real


@pytest.mark.parametrize(
    ("exc", "status"),
    [(ConnectorRetentionError(REFUSAL), 400), (RequestRejected("long"), 400), (ValueError("v"), 400),
     (EngineStateError("asleep"), 409), (EngineDeadError("gone"), 503), (NotImplementedError(), 501),
     (RuntimeError("bug"), 500), (APIError(404, "m"), 404)],
)  # fmt: skip
def test_status_for_engine_errors(exc, status):
    assert status_for(exc) == status


def test_error_type_names():
    assert [error_type(s) for s in (400, 401, 404, 409, 422, 500, 503)] == [
        "BadRequestError", "UnauthorizedError", "NotFoundError", "ConflictError", "UnprocessableEntityError",
        "InternalServerError", "ServiceUnavailableError",
    ]  # fmt: skip


class FakeCore:
    """Just enough of EngineCoreClient for the routes: a connector that refuses retention."""

    def __init__(self) -> None:
        self.info = EngineInfo(model_name="fake", max_model_len=64, vocab_size=VOCAB, block_size=16, num_blocks=4)
        self.metrics = MetricsRegistry()
        self.is_alive, self.dead_reason = True, None
        self.calls: list[tuple] = []

    async def sleep(self, level=1, mode="abort", clear_connector_cache=True, tags=None):
        self.calls.append(("sleep", level, mode, clear_connector_cache))
        if not clear_connector_cache:
            raise ConnectorRetentionError(REFUSAL)

    async def pause(self, mode="abort", clear_cache=True, clear_connector_cache=True):
        self.calls.append(("pause", mode, clear_cache, clear_connector_cache))
        if not clear_connector_cache:
            raise ConnectorRetentionError(REFUSAL)

    async def resume(self):
        raise EngineStateError("the engine is asleep: wake_up() resumes it")

    async def shutdown(self):
        pass

    async def get_info(self):
        return self.info


@pytest.fixture
def fake():
    core = FakeCore()

    async def start():
        return core, None

    with TestClient(build_app(ServerConfig(dev_mode=True), start)) as client:
        yield client, core


def test_a_refused_retention_is_a_400_with_the_connectors_message(fake):
    client, core = fake
    for route in ("/sleep", "/pause"):
        r = client.post(route, params={"clear_connector_cache": "false"})
        assert r.status_code == 400
        assert r.json()["error"] == {"message": REFUSAL, "type": "BadRequestError", "param": None, "code": 400}
    assert core.calls == [("sleep", 1, "abort", False), ("pause", "abort", True, False)]


def test_omitted_booleans_take_the_engine_defaults(fake):
    client, core = fake
    assert client.post("/sleep").status_code == 200
    assert client.post("/pause", params={"mode": "keep"}).status_code == 200
    assert core.calls == [("sleep", 1, "abort", True), ("pause", "keep", True, True)]


def test_state_errors_are_409(fake):
    client, _ = fake
    r = client.post("/resume")
    assert r.status_code == 409 and r.json()["error"]["type"] == "ConflictError"


def test_dead_core_makes_health_503(fake):
    client, core = fake
    assert client.get("/health").status_code == 200
    core.is_alive, core.dead_reason = False, "the engine core process exited (exit code -9)"
    r = client.get("/health")
    assert r.status_code == 503 and "exit code -9" in r.json()["error"]["message"]


def test_without_dev_mode_there_are_no_control_routes():
    async def start():
        return FakeCore(), None

    with TestClient(build_app(ServerConfig(dev_mode=False), start)) as client:
        assert client.post("/sleep").status_code == 404
        assert client.get("/v1/models").json()["data"][0]["id"] == "fake"


@pytest.mark.parametrize(
    "field",
    ["max_tokens", "n", "temperature", "top_k", "seed", "logprobs", "min_tokens", "stop_token_ids", "prompt",
     "truncate_prompt_tokens", "allowed_token_ids", "logit_bias"],
)  # fmt: skip
def test_a_boolean_is_not_a_number(fake, field):
    """JSON's true is not 1: ``max_tokens: true`` is refused naming the field, not run as 1."""
    client, _ = fake
    value = [True] if field in ("stop_token_ids", "prompt", "allowed_token_ids") else True
    value = {"5": True} if field == "logit_bias" else value
    body = {"prompt": [1, 2], "max_tokens": 2} | {field: value}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"] and "not the boolean true" in r.json()["error"]["message"]
