"""The gateway in front of a fleet: SGLang's model gateway (``smg`` on PyPI) in its own process.

siesta does not route: smg does (its ``cache_aware`` policy by default: a radix tree per replica
of the prompts it sent there, which for siesta is also what that replica's tier holds, since
the tier keeps what the replica computed across sleep). Behind ``--enable-rl`` smg mounts its RL
control plane (``/v1/rl/*``): the worker list, a passthrough to one worker's engine routes and
a fan-out of one engine route to every worker a selector matches, with per-worker answers.
``siesta.fleet.client`` builds its transactions on those.

Replicas are registered through smg's worker API as SGLang engines (``runtime_type: sglang``):
siesta answers SGLang's routes (``/generate``, ``/get_server_info``, ``/v1/loads``,
``/pause_generation`` ...), and smg then reads each replica's weight version at registration
(``/get_server_info``) and polls its load (``/v1/loads``). Registered as vLLM, smg would report
no weight version at all. Labels name the fleet and the replica's index, so a selector
(``siesta.fleet=NAME``) reaches exactly one fleet's replicas.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

# The release the fleet is built and tested against (pyproject's test extras pin it). Its RL
# control plane is new (smg-project/smg #2411): later releases may change /v1/rl's shapes.
SMG_VERSION = "1.13.0"
# PyPI's wheels of that release for Linux: x86_64 manylinux_2_17, aarch64 manylinux_2_28 (glibc
# 2.28 or later); no musllinux. Elsewhere pip falls back to the sdist, a Rust build.
SMG_WHEEL_PLATFORMS = "Linux x86_64 (manylinux_2_17) and aarch64 (manylinux_2_28)"
FLEET_LABEL = "siesta.fleet"
REPLICA_LABEL = "siesta.replica"
RANKS_LABEL = "siesta.ranks"
# smg's label that its registry reports as a worker's weight version (and selectors match).
WEIGHT_VERSION_LABEL = "weight_version"
STARTUP_TIMEOUT_S = 60.0
REGISTER_TIMEOUT_S = 120.0
POLL_S = 0.1
STOP_TIMEOUT_S = 10.0
HTTP_TIMEOUT_S = 30.0
LOG_TAIL_CHARS = 4000


class GatewayError(RuntimeError):
    """The gateway would not start, or refused a registry call."""


def smg_missing() -> str | None:
    """Why smg cannot run here, or None when it can (the tests skip with this reason)."""
    if importlib.util.find_spec("smg") is None:
        return (f"smg=={SMG_VERSION} is not installed (pip install -e '.[test]'); PyPI has wheels for "
                f"{SMG_WHEEL_PLATFORMS} only, this is {platform.system()} {platform.machine()}")  # fmt: skip
    try:
        from smg import smg_rs  # noqa: F401 - the Rust extension: the wheel's platform part
    except ImportError as e:
        return f"smg is installed but its extension does not load here ({e}); wheels: {SMG_WHEEL_PLATFORMS}"
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    # cache_aware: tier-aware for siesta (see the module's doc); round_robin is the baseline the
    # routing bench compares it with. Any of smg's --policy choices.
    policy: str = "cache_aware"
    # One fan-out must reach every replica at once: a weight broadcast completes only when every
    # rank of the group is receiving, so a fan-out narrower than the fleet would deadlock.
    fanout_concurrency: int = 256
    control_timeout_s: int = 600
    # Sticky sessions (smg's --sticky-sessions, keyed by this header, else by the request's rid):
    # a request goes where its key went before, whatever the policy. Off by default: the prefix
    # tree already sends a resumed request (same rid: its prompt plus what it had) and a
    # session's next turn (its history is the prefix) to the replica that holds them, and keeps
    # new prompts balanced, where pinning skewed the load (bench/results/fleet-routing-*).
    session_header: str | None = None
    # How often smg probes a replica's /health; a replica that fails stays registered (the
    # fleet client drops it: the gateway alone must not change which replicas serve).
    health_check_interval_s: int = 10
    log_level: str = "warn"
    extra_args: tuple[str, ...] = ()

    def command(self, prometheus_port: int) -> list[str]:
        cmd = [sys.executable, "-m", "smg", "launch", "--host", self.host, "--port", str(self.port),
               "--policy", self.policy, "--enable-rl", "--rl-fanout-concurrency", str(self.fanout_concurrency),
               "--rl-control-timeout-secs", str(self.control_timeout_s), "--log-level", self.log_level,
               "--prometheus-host", self.host, "--prometheus-port", str(prometheus_port),
               "--health-check-interval-secs", str(self.health_check_interval_s),
               "--shutdown-grace-period-secs", "1", "--no-remove-unhealthy-workers"]  # fmt: skip
        if self.session_header:
            cmd += ["--sticky-sessions", "--routing-key-headers", self.session_header]
        return cmd + list(self.extra_args)


@dataclass
class Gateway:
    """A running smg process and its worker registry."""

    config: GatewayConfig
    process: subprocess.Popen | None  # None: a gateway started elsewhere (attach)
    log_path: Path | None
    http: httpx.Client = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    @classmethod
    def start(cls, config: GatewayConfig, log_dir: Path | None = None) -> Gateway:
        missing = smg_missing()
        if missing:
            raise GatewayError(missing)
        log_dir = log_dir or Path(tempfile.mkdtemp(prefix="siesta-gateway-"))
        log_path = log_dir / f"smg-{config.port}.log"
        # Its own Prometheus port: smg's default (29000) would collide with a second gateway.
        prometheus_port = free_port(config.host)
        with open(log_path, "wb") as log:
            process = subprocess.Popen(config.command(prometheus_port), stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)  # fmt: skip
        gateway = cls(config, process, log_path, httpx.Client(base_url=f"http://{config.host}:{config.port}",
                                                              timeout=HTTP_TIMEOUT_S))  # fmt: skip
        gateway._wait_up()
        return gateway

    @classmethod
    def attach(cls, url: str) -> Gateway:
        """The registry of a gateway this process did not start."""
        host, _, port = url.rstrip("/").split("://", 1)[-1].rpartition(":")
        http = httpx.Client(base_url=url, timeout=HTTP_TIMEOUT_S)
        return cls(GatewayConfig(host=host, port=int(port)), None, None, http)

    def _exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def _wait_up(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._exited():
                raise GatewayError(f"smg exited with {self.process.returncode}:\n{self.log()}")
            try:
                if self.http.get("/v1/rl/workers").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(POLL_S)
        self.stop()
        raise GatewayError(f"smg did not answer within {STARTUP_TIMEOUT_S:.0f}s:\n{self.log()}")

    def log(self) -> str:
        if self.log_path is None:
            return "(a gateway started elsewhere: its log is there)"
        return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]

    # -- the registry --------------------------------------------------------------------

    def register(self, url: str, fleet: str, index: int, ranks: int = 1, labels: dict[str, str] | None = None) -> str:
        """Add one replica; returns its worker id once smg lists it ready."""
        ours = {FLEET_LABEL: fleet, REPLICA_LABEL: str(index), RANKS_LABEL: str(ranks)}
        body = {"url": url, "runtime_type": "sglang", "labels": ours | (labels or {})}
        worker_id = str(self._call("POST", "/workers", body)["worker_id"])
        self._wait_for(lambda w: w.get("health") == "ready", worker_id, f"replica {index} ({url}) ready")
        return worker_id

    def relabel(self, worker_id: str, labels: dict[str, str]) -> None:
        """Merge labels into a worker's (PATCH keeps its routing state; PUT would re-register it)."""
        self._call("PATCH", f"/workers/{worker_id}", {"labels": labels})
        self._wait_for(lambda w: all(w.get("labels", {}).get(k) == v for k, v in labels.items()), worker_id,
                       f"labels {labels} on worker {worker_id}")  # fmt: skip

    def deregister(self, worker_id: str) -> None:
        self._call("DELETE", f"/workers/{worker_id}")
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        while time.monotonic() < deadline:
            if all(w["id"] != worker_id for w in self.workers()):
                return
            time.sleep(POLL_S)
        raise GatewayError(f"worker {worker_id} was still listed {REGISTER_TIMEOUT_S:.0f}s after its removal")

    def workers(self) -> list[dict[str, Any]]:
        """smg's RL view of every worker: id, url, health, weight_version, labels, capabilities."""
        return list(self._call("GET", "/v1/rl/workers")["workers"])

    def _wait_for(self, predicate, worker_id: str, what: str) -> None:
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        while time.monotonic() < deadline:
            worker = next((w for w in self.workers() if w["id"] == worker_id), None)
            if worker is not None and predicate(worker):
                return
            if self._exited():
                raise GatewayError(f"smg exited with {self.process.returncode}:\n{self.log()}")
            time.sleep(POLL_S)
        raise GatewayError(f"timed out after {REGISTER_TIMEOUT_S:.0f}s waiting for {what}:\n{self.log()}")

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        response = self.http.request(method, path, json=body)
        if response.status_code >= 400:
            raise GatewayError(f"smg answered {method} {path} with {response.status_code}: {response.text}")
        return response.json() if response.content else None

    # -- the process ---------------------------------------------------------------------

    def stop(self) -> None:
        self.http.close()
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # its own session: the router and its threads
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
