"""Fixtures of the end-to-end tests.

One dev-mode server on the embedded model serves most modules; modules that need other
flags start their own. Every test leaves the shared server awake and resumed.

The shared server and the offline engine live for the whole session, not the package:
``--dist loadfile`` hands out files largest first, so a worker interleaves e2e modules with
the others, and a package-scoped server was stopped and started again at every return to
tests/e2e (13 starts of 10-25 s each in one run). Idle between modules, they cost no CPU.
"""

from __future__ import annotations

import httpx
import pytest

from e2e.servers import DEV_MAX_MODEL_LEN, OFFLINE_KV_CACHE_BYTES, SERVER_KV_CACHE_BYTES, start_server, stop_server


@pytest.fixture(scope="session")
def dev_server():
    server = start_server(
        "--dev-mode", "--max-model-len", str(DEV_MAX_MODEL_LEN), "--kv-cache-bytes", str(SERVER_KV_CACHE_BYTES)
    )
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def offline_llm():
    """The in-process engine on the same model: the oracle for the server's greedy text."""
    from siesta import LLM

    return LLM(max_model_len=DEV_MAX_MODEL_LEN, kv_cache_bytes=OFFLINE_KV_CACHE_BYTES)


@pytest.fixture(scope="module")
def http(dev_server):
    """A client of the shared server, one per module."""
    with httpx.Client(base_url=dev_server.url, timeout=120.0) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(offline_llm):
    return offline_llm.get_tokenizer()
