"""--api-key guards the API (not the probes); the control routes exist only in dev mode."""

from __future__ import annotations

import httpx
import openai
import pytest

from e2e.servers import HTTP_TIMEOUT_S, SERVER_KV_CACHE_BYTES, start_server, stop_server
from siesta.client import SiestaAPIError, SiestaClient

KEY = "sekrit-key"
CONTROL_ROUTES = [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("POST", "/pause"),
                  ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/reset_prefix_cache"),
                  ("POST", "/update_weights"), ("POST", "/abort_requests"), ("POST", "/init_weight_transfer_engine"),
                  ("POST", "/start_weight_update"), ("POST", "/finish_weight_update"), ("GET", "/get_world_size"),
                  ("GET", "/weight_version")]  # fmt: skip
TINY = ("random:tiny-llama", "--kv-cache-bytes", str(SERVER_KV_CACHE_BYTES))


@pytest.fixture(scope="module")
def keyed_server():
    server = start_server("--api-key", KEY, "--kv-cache-bytes", str(SERVER_KV_CACHE_BYTES))
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def env_server():
    """Key and dev mode from the environment, on a model without a tokenizer."""
    server = start_server(*TINY, env={"SIESTA_API_KEY": KEY, "SIESTA_SERVER_DEV_MODE": "1"})
    yield server
    stop_server(server)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_api_needs_the_key(keyed_server):
    url = keyed_server.url
    body = {"prompt": "Hi", "max_tokens": 2}
    for headers in ({}, _auth("wrong"), {"Authorization": KEY}):
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 401, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{url}/v1/models", timeout=HTTP_TIMEOUT_S).status_code == 401
    assert httpx.post(f"{url}/v1/completions", json=body, headers=_auth(KEY), timeout=HTTP_TIMEOUT_S).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong").models.list()
    assert openai.OpenAI(base_url=f"{url}/v1", api_key=KEY).models.list().data


def test_probes_stay_open(keyed_server):
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{keyed_server.url}{path}", timeout=HTTP_TIMEOUT_S).status_code == 200, path


@pytest.mark.parametrize(("method", "path"), CONTROL_ROUTES)
def test_control_routes_are_404_without_dev_mode(keyed_server, method, path):
    r = httpx.request(method, f"{keyed_server.url}{path}", headers=_auth(KEY))
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "NotFoundError"


def test_env_enables_dev_mode_and_the_key(env_server):
    with pytest.raises(SiestaAPIError) as err:
        SiestaClient(env_server.url).is_sleeping()
    assert err.value.status_code == 401
    with SiestaClient(env_server.url, api_key=KEY) as client:
        client.sleep(level=0)
        assert client.is_sleeping() is True
        client.wake_up()
        assert client.is_sleeping() is False


def test_a_model_without_tokenizer_takes_token_ids(env_server):
    with SiestaClient(env_server.url, api_key=KEY) as client:
        out = client.completions([1, 2, 3, 4], max_tokens=3, temperature=0.0)
        assert len(out["choices"][0]["text"]) == 0 and out["usage"]["completion_tokens"] == 3
        with pytest.raises(SiestaAPIError) as err:
            client.completions("text needs a tokenizer", max_tokens=1)
        assert err.value.status_code == 400 and "tokenizer" in err.value.message
        with pytest.raises(SiestaAPIError) as err:
            client.chat([{"role": "user", "content": "hi"}], max_tokens=1)
        assert err.value.status_code == 400
