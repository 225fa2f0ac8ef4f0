"""What the fleet tests share: real replicas (``siesta serve``) behind the real gateway binary
(smg, from PyPI), all on loopback, started by the tests.

Every test needs smg; where it cannot run (no wheel for this platform) the tests skip, saying so.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from siesta.fleet.gateway import GatewayConfig, free_port, smg_missing

SMG_MISSING = smg_missing()
requires_smg = pytest.mark.skipif(SMG_MISSING is not None, reason=SMG_MISSING or "")

BLOCK = 16  # the tier's block size below
# Small and fast: tiny random weights in fp32 (a transformers trainer matches them to 1e-4), a
# small device cache, a host tier that keeps what each replica computed, weight transfers that
# give up on a silent trainer within seconds.
TIER = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"block_size": BLOCK, "cpu_bytes_to_use": 100_000_000}})  # fmt: skip
TRANSFER_TIMEOUT_S = 5.0
SERVE_ARGS = ("random:tiny-llama", "--dtype", "float32", "--kv-cache-bytes", str(32 << 20), "--max-model-len", "1024",
              "--kv-transfer-config", TIER,
              "--weight-transfer-config", json.dumps({"backend": "nccl", "timeout_s": TRANSFER_TIMEOUT_S}))  # fmt: skip
# One torch thread a replica: three replicas and the test share two cores.
REPLICA_ENV = {"OMP_NUM_THREADS": "1"}


def replica_env() -> dict[str, str]:
    return os.environ | REPLICA_ENV


def gateway_config(**kwargs) -> GatewayConfig:
    return GatewayConfig(port=free_port(), **kwargs)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pids: list[int], timeout_s: float = 30.0) -> None:
    """Until none of ``pids`` runs; fails naming what outlived its fleet."""
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in pids), f"processes outlived their fleet: {[p for p in pids if alive(p)]}"
