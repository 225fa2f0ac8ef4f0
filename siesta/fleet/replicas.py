"""Replicas on this host: one ``siesta serve`` process each, on its own port and its own GPUs.

A replica is one tensor-parallel group: ``tp`` GPUs, named to it by ``CUDA_VISIBLE_DEVICES``
(the engine then sees them as cuda:0..tp-1, which is where its ranks go). The GPUs handed out
are those this process may use: its own ``CUDA_VISIBLE_DEVICES`` when set (a scheduler's
allocation), else every GPU torch sees. On a host with no GPU the replicas run on the CPU and
no variable is set.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 300.0
POLL_S = 0.25
STOP_TIMEOUT_S = 20.0
LOG_TAIL_CHARS = 4000


class ReplicaError(RuntimeError):
    """A replica would not start, or there are not enough GPUs for the ones asked for."""


def visible_devices() -> list[str]:
    """The GPUs this process may hand out, as CUDA_VISIBLE_DEVICES names them."""
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    if named is not None:
        return [d.strip() for d in named.split(",") if d.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        return []


def device_groups(replicas: int, tp: int, devices: Sequence[str]) -> list[tuple[str, ...] | None]:
    """Each replica's GPUs: consecutive runs of ``tp`` (neighbours on one switch, usually); None
    for every replica when there is no GPU at all (CPU replicas)."""
    if replicas < 1 or tp < 1:
        raise ValueError(f"replicas and tensor-parallel size must be >= 1, got {replicas} and {tp}")
    if not devices:
        return [None] * replicas
    if replicas * tp > len(devices):
        raise ReplicaError(f"{replicas} replicas of {tp} GPUs need {replicas * tp}; this process may use "
                           f"{len(devices)} ({','.join(devices)})")  # fmt: skip
    return [tuple(devices[i * tp:(i + 1) * tp]) for i in range(replicas)]


@dataclass(frozen=True)
class ReplicaSpec:
    index: int
    host: str
    port: int
    devices: tuple[str, ...] | None  # CUDA_VISIBLE_DEVICES, or None on the CPU
    tp: int = 1

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self, serve_args: Sequence[str]) -> list[str]:
        cmd = [sys.executable, "-m", "siesta.entrypoints.cli", "serve", *serve_args,
               "--host", self.host, "--port", str(self.port)]  # fmt: skip
        if "--dev-mode" not in serve_args:
            cmd.append("--dev-mode")  # the control routes the fleet drives
        if self.tp > 1 and not _names_tp(serve_args):
            cmd += ["--tensor-parallel-size", str(self.tp)]
        return cmd

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.devices)
        return env


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the process that started it dies, so that a fleet
    (or a Ray actor) killed outright leaves no replica behind; the engine core follows its API
    server by itself. Linux's prctl(PR_SET_PDEATHSIG); elsewhere a no-op."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


_PR_SET_PDEATHSIG = 1
_LINUX = sys.platform == "linux"


def _names_tp(args: Sequence[str]) -> bool:
    return any(a in ("--tensor-parallel-size", "-tp") or a.startswith("--tensor-parallel-size=") for a in args)


@dataclass
class LocalReplica:
    spec: ReplicaSpec
    process: subprocess.Popen
    log_path: Path
    _stopped: bool = field(default=False, repr=False)

    @property
    def url(self) -> str:
        return self.spec.url

    @classmethod
    def launch(cls, spec: ReplicaSpec, serve_args: Sequence[str], log_dir: Path,
               env: dict[str, str] | None = None) -> LocalReplica:  # fmt: skip
        """Start the process (not waiting for it: replicas start side by side)."""
        log_path = log_dir / f"replica-{spec.index}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(spec.command(serve_args), stdout=log, stderr=subprocess.STDOUT,
                                       env=spec.env(env), start_new_session=True,
                                       # one prctl call before exec: nothing a thread could hold
                                       preexec_fn=_die_with_parent if _LINUX else None)  # noqa: PLW1509
        return cls(spec, process, log_path)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]

    def wait_healthy(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ReplicaError(f"replica {self.spec.index} exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(POLL_S)
        raise ReplicaError(f"replica {self.spec.index} was not healthy within {timeout_s:.0f}s:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL, as a crash would: no store is finished, no socket closed cleanly."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # the engine core and ranks too
            self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # serve's Ctrl-C: streams end, stores finish
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def launch_local(specs: Sequence[ReplicaSpec], serve_args: Sequence[str], log_dir: Path | None = None,
                 env: dict[str, str] | None = None) -> list[LocalReplica]:  # fmt: skip
    """Start every replica, then wait for all; on a failure stop those that started."""
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="siesta-fleet-"))
    replicas = [LocalReplica.launch(spec, serve_args, log_dir, env) for spec in specs]
    try:
        for replica in replicas:
            replica.wait_healthy()
    except BaseException:
        for replica in replicas:
            replica.stop()
        raise
    return replicas
