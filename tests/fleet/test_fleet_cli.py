"""``siesta fleet`` as a user runs it: a process that starts the gateway and its replicas, prints
the fleet's URL as JSON, serves generation there until SIGINT, then leaves nothing running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from fleet.fleets import REPLICA_ENV, SERVE_ARGS, requires_smg, wait_gone
from siesta.fleet.gateway import free_port

pytestmark = [requires_smg, pytest.mark.timeout(300)]

REPLICAS = 2
START_S = 180.0
HTTP_TIMEOUT_S = 60.0



def _replica_pids(fleet_pid: int) -> list[int]:
    """The fleet process's children that run ``siesta serve``."""
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(fleet_pid)], capture_output=True, text=True)
    return [int(line.split()[0]) for line in out.stdout.splitlines() if " serve " in line]


def test_siesta_fleet_serves_its_url_until_interrupted() -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "siesta.entrypoints.cli", "fleet", "--replicas", str(REPLICAS), "--port", str(port),
           "--name", "cli", "--", *SERVE_ARGS]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ | REPLICA_ENV)  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line, f"siesta fleet exited ({proc.poll()}):\n{proc.stderr.read()[-4000:]}"
        info = json.loads(line)
        assert info["url"] == f"http://127.0.0.1:{port}" and info["fleet"] == "cli"
        assert [r["index"] for r in info["replicas"]] == list(range(REPLICAS))
        body = {"input_ids": [3, 17, 42, 7, 99], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
        response = httpx.post(f"{info['url']}/generate", json=body, timeout=HTTP_TIMEOUT_S)
        assert response.status_code == 200 and len(response.json()["output_ids"]) == 3, response.text
        replicas = _replica_pids(proc.pid)
        assert len(replicas) == REPLICAS
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, proc.stderr.read()[-4000:]
    wait_gone(replicas)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{info['url']}/health", timeout=2)
