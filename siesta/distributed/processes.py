"""Rank 0's side: the other ranks' processes, the calls sent to them and their answers.

One thread reads every answer and heartbeat and watches the processes, so a rank that died or
went silent is known within a bounded time even while rank 0 waits in a collective or idles.
Then nothing waits on it: ``gather`` and ``check`` raise ``RankFailed`` naming the rank, and
``close`` takes the other processes down.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from siesta.distributed.channel import STOP, Answer, Call, RankChannel, dumps, loads

logger = logging.getLogger(__name__)

POLL_MS = 50
RANK_PROCESS_PREFIX = "siesta-rank-"
# Where a rank that cannot start says why, for rank 0 to report (a file: the rank dies before
# it has a channel).
STARTUP_ERROR_ENV = "SIESTA_RANK_STARTUP_ERROR"
UNGUARDED_SCRIPT = (
    "a tensor-parallel rank re-ran the script that started the engine: spawned processes import "
    "the main module, so put the code that makes the LLM under `if __name__ == \"__main__\":`"
)
HEARTBEATS_PER_TIMEOUT = 4  # heartbeats sent within one heartbeat timeout
CLOSE_TIMEOUT_S = 10.0


class RankFailed(RuntimeError):
    """A tensor-parallel rank died, hung or failed where every rank must succeed: the ranks
    are out of step and the engine cannot go on."""


class RankProcesses:
    """Ranks 1 .. size-1, each running ``target(channel, rank, size, *args)`` in a spawned process."""

    def __init__(self, size: int, target: str, args: tuple[Any, ...], heartbeat_timeout_s: float) -> None:
        self.size = size
        self._dir = tempfile.mkdtemp(prefix="siesta-ranks-")
        self._ctx = zmq.Context()
        answers = f"ipc://{self._dir}/answers"
        self._answers = self._ctx.socket(zmq.PULL)
        self._answers.bind(answers)
        self._commands: dict[int, zmq.Socket] = {}
        self._procs: dict[int, mp.process.BaseProcess] = {}
        self._heartbeat_timeout_s = heartbeat_timeout_s
        # From a rank's first message on: before it, the rank is importing and starting up
        # (its death is seen from its process, and the start timeout bounds the rest).
        self._last_seen: dict[int, float] = {}
        self._ready: dict[int, Any] = {}
        self._replies: dict[int, dict[int, Answer]] = {}
        self._notes: dict[str, list[Answer]] = {}  # unasked-for news from the ranks, by topic
        self._failure: str | None = None
        self._on_failure: list[Callable[[str], None]] = []
        self._cond = threading.Condition()
        self._seq = 0
        self._closing = False
        spawn = mp.get_context("spawn")
        for rank in self.ranks:
            address = f"ipc://{self._dir}/commands-{rank}"
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(address)
            self._commands[rank] = sock
            proc = spawn.Process(
                target=_rank_main, name=f"{RANK_PROCESS_PREFIX}{rank}", daemon=True,
                args=(target, rank, size, address, answers, heartbeat_timeout_s / HEARTBEATS_PER_TIMEOUT, args),
            )  # fmt: skip
            _start_with_env(proc, {STARTUP_ERROR_ENV: self._startup_error_path(rank)})
            self._procs[rank] = proc
        self._watcher = threading.Thread(target=self._watch, name="rank-watcher", daemon=True)
        self._watcher.start()

    def _startup_error_path(self, rank: int) -> str:
        return os.path.join(self._dir, f"startup-error-{rank}")

    @property
    def ranks(self) -> range:
        return range(1, self.size)

    @property
    def pids(self) -> dict[int, int | None]:
        return {rank: proc.pid for rank, proc in self._procs.items()}

    @property
    def failure(self) -> str | None:
        return self._failure

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """``callback(reason)`` from the watcher thread when a rank fails (e.g. to wake an idle loop)."""
        self._on_failure.append(callback)

    # -- calls -------------------------------------------------------------------------

    def wait_ready(self, timeout_s: float) -> list[Any]:
        """Every rank's start-up answer (rank order), once each has built its model."""
        with self._cond:
            self._wait(lambda: len(self._ready) == self.size - 1, timeout_s, "start", self._ready)
            return [self._ready[rank] for rank in self.ranks]

    def send(self, op: str, *args: Any, reply: bool = True, **kwargs: Any) -> int:
        self.check()
        self._seq += 1
        call = Call(self._seq, op, args, kwargs, reply)
        frames = dumps(call)
        for rank, sock in self._commands.items():
            self._send(rank, sock, frames)
        return self._seq

    def _send(self, rank: int, sock: zmq.Socket, frames: list[Any]) -> None:
        # A PUSH socket whose peer is gone blocks a send for good: poll, watching for failure.
        deadline = time.monotonic() + self._heartbeat_timeout_s
        while True:
            try:
                sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                self.check()
                if time.monotonic() > deadline:
                    self._fail(f"tensor-parallel rank {rank} takes no calls (its queue is full or gone)")
                    self.check()
                time.sleep(POLL_MS / 1000)

    def gather(self, seq: int, timeout_s: float) -> list[Answer]:
        """Every rank's answer to call ``seq``, in rank order; RankFailed if a rank died, hung or
        did not answer within ``timeout_s``."""
        with self._cond:
            got = self._replies.setdefault(seq, {})
            self._wait(lambda: len(got) == self.size - 1, timeout_s, f"call {seq}", got)
            del self._replies[seq]
            return [got[rank] for rank in self.ranks]

    @property
    def heartbeat_timeout_s(self) -> float:
        return self._heartbeat_timeout_s

    def wait_for_failure(self, timeout_s: float) -> str | None:
        """A rank's failure, waited for up to ``timeout_s``; None if every rank still runs."""
        with self._cond:
            self._cond.wait_for(lambda: self._failure is not None, timeout_s)
            return self._failure

    def take_notes(self, topic: str) -> list[Answer]:
        """The ranks' notes on ``topic`` since the last call (each note's value: (topic, payload))."""
        with self._cond:
            return self._notes.pop(topic, [])

    def check(self) -> None:
        if self._failure is not None:
            raise RankFailed(self._failure)

    def _wait(self, done: Callable[[], bool], timeout_s: float, what: str, got: dict[int, Any]) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            self.check()
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in self.ranks if r not in got]
                self._fail(f"tensor-parallel rank {missing[0]} did not answer {what} within {timeout_s:g}s")
                self.check()
            self._cond.wait(min(left, POLL_MS / 1000))

    # -- the watcher thread --------------------------------------------------------------

    def _watch(self) -> None:
        poller = zmq.Poller()
        poller.register(self._answers, zmq.POLLIN)
        while not self._closing:
            if poller.poll(POLL_MS):
                self._take(loads(self._answers.recv_multipart(copy=False)))
                continue
            self._check_processes()

    def _take(self, answer: Answer) -> None:
        with self._cond:
            self._last_seen[answer.rank] = time.monotonic()
            if answer.kind == "ready":
                self._ready[answer.rank] = answer.value
            elif answer.kind == "reply":
                self._replies.setdefault(answer.seq, {})[answer.rank] = answer
            elif answer.kind == "note":
                self._notes.setdefault(answer.value[0], []).append(answer)
            elif answer.kind == "failed":
                self._fail(f"tensor-parallel rank {answer.rank} failed: {answer.value}")
            self._cond.notify_all()

    def _check_processes(self) -> None:
        for rank, proc in self._procs.items():
            if proc.exitcode is not None and not self._closing:
                why = _read_text(self._startup_error_path(rank))
                self._fail(f"tensor-parallel rank {rank} died ({_describe_exit(proc.exitcode)})" + (f": {why}" if why else ""))
                return
        now = time.monotonic()
        for rank, seen in self._last_seen.items():
            if now - seen > self._heartbeat_timeout_s and not self._closing:
                self._fail(f"tensor-parallel rank {rank} is hung: no heartbeat for {now - seen:.1f}s")
                return

    def _fail(self, reason: str) -> None:
        with self._cond:
            if self._failure is not None:
                return
            self._failure = reason
            self._cond.notify_all()
        logger.error("%s; stopping the other ranks", reason)
        self._kill()
        for callback in self._on_failure:
            callback(reason)

    # -- shutdown ----------------------------------------------------------------------

    def close(self) -> None:
        """Stop every rank (an orderly stop where they still answer) and free the sockets."""
        if self._closing:
            return
        if self._failure is None:
            for sock in self._commands.values():
                try:
                    sock.send_multipart(dumps(Call(-1, STOP, (), {}, False)), copy=False, flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        self._closing = True
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for proc in self._procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()
        self._watcher.join(CLOSE_TIMEOUT_S)
        for sock in [*self._commands.values(), self._answers]:
            sock.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _kill(self) -> None:
        for proc in self._procs.values():
            if proc.exitcode is None and proc.pid is not None:
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self._procs.values():
            proc.join(CLOSE_TIMEOUT_S)


def _start_with_env(proc: mp.process.BaseProcess, env: dict[str, str]) -> None:
    """Start a spawned process with ``env`` added to what it inherits (spawn copies os.environ)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        proc.start()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def refuse_in_starting_rank() -> None:
    """Raise, telling rank 0 why, when a rank process is still starting: its main module is being
    imported (a script with no ``__main__`` guard re-runs the code that started the engine)."""
    current = mp.current_process()
    if not (current.name.startswith(RANK_PROCESS_PREFIX) and getattr(current, "_inheriting", False)):
        return
    path = os.environ.get(STARTUP_ERROR_ENV)
    if path:
        with open(path, "w") as f:
            f.write(UNGUARDED_SCRIPT)
    raise RuntimeError(UNGUARDED_SCRIPT)


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _rank_main(target: str, rank: int, size: int, commands: str, answers: str, heartbeat_s: float,
               args: tuple[Any, ...]) -> None:  # fmt: skip
    """A spawned rank: its channel, then ``target`` until rank 0 says stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group; rank 0 decides
    channel = RankChannel(rank, commands, answers, heartbeat_s)
    module, name = target.split(":")
    try:
        getattr(importlib.import_module(module), name)(channel, rank, size, *args)
    except BaseException as e:
        logger.exception("tensor-parallel rank %d failed", rank)
        channel.failed(e)
        channel.close()
        os._exit(1)
    channel.close()
