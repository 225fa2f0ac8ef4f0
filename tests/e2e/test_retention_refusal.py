"""Over HTTP, keeping a tier the connector cannot keep is a 400 carrying the connector's
message, and the server is neither paused nor asleep afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from e2e.servers import HTTP_TIMEOUT_S, OFFLOAD_CONFIG, SERVER_KV_CACHE_BYTES, start_server, stop_server

TESTS_DIR = Path(__file__).parent.parent
MULTI_WITH_REFUSING_CHILD = json.dumps({
    "kv_connector": "MultiConnector",
    "kv_connector_extra_config": {"connectors": [
        json.loads(OFFLOAD_CONFIG),
        {"kv_connector": "NoRetentionConnector", "kv_connector_module_path": "tiers.no_retention_connector",
         "kv_connector_extra_config": {"cpu_bytes_to_use": 100_000_000}},
    ]},
})  # fmt: skip


@pytest.fixture(scope="module")
def server():
    s = start_server("--dev-mode", "--kv-transfer-config", MULTI_WITH_REFUSING_CHILD,
                     "--kv-cache-bytes", str(SERVER_KV_CACHE_BYTES), "--max-model-len", "1024",
                     env={"PYTHONPATH": str(TESTS_DIR)})  # fmt: skip
    yield s
    stop_server(s)


@pytest.mark.parametrize("route", ["/sleep?level=1&clear_connector_cache=false", "/pause?clear_connector_cache=false"])
def test_refused_before_anything_pauses(server, route):
    r = httpx.post(server.url + route, timeout=60)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "NoRetentionConnector" in message and "clear_connector_cache=False" in message
    assert httpx.get(server.url + "/is_paused", timeout=HTTP_TIMEOUT_S).json()["is_paused"] is False
    assert httpx.get(server.url + "/is_sleeping", timeout=HTTP_TIMEOUT_S).json()["is_sleeping"] is False
    done = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=60)
    assert done.status_code == 200
