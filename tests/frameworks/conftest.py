"""The frameworks' request sequences against one real ``siesta serve`` and one trainer process.

One server (dev mode, ``random:tiny-llama`` in fp32, the nccl weight-transfer backend over gloo)
and one trainer (``trainer.py``) serve every framework module of a worker: a start costs 10-25 s
on the 2-core machine. Every test leaves the server awake and resumed; each pushes its own
weights before it checks anything against the trainer.
"""

from __future__ import annotations

import json

import pytest
from e2e.servers import start_server, stop_server

from frameworks.common import MAX_MODEL_LEN, TrainerProcess

TIMEOUT_S = 10.0  # the engine's bound on a silent trainer


@pytest.fixture(scope="session")
def rl_server():
    server = start_server(
        "--dev-mode", "random:tiny-llama", "--dtype", "float32", "--kv-cache-bytes", str(32 << 20),
        "--max-model-len", str(MAX_MODEL_LEN), "--weight-transfer-config", json.dumps({"backend": "nccl", "timeout_s": TIMEOUT_S}),
    )  # fmt: skip
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def trainer():
    proc = TrainerProcess()
    yield proc
    proc.close()


@pytest.fixture(scope="session")
def url(rl_server) -> str:
    return rl_server.url
