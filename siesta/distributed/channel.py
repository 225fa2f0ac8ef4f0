"""Calls from rank 0 to the other ranks, and their answers, over ZeroMQ on local sockets.

Internal to one engine (its own child processes), so messages are pickled (protocol 5: a step
plan's numpy arrays go out of band, without a copy into the message). Every rank also sends a
heartbeat from a thread of its own, which runs while the rank waits in a collective (the GIL
is released there): a rank whose heartbeats stop is hung; one whose process is gone died.
"""

from __future__ import annotations

import os
import pickle
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import zmq

STOP = "stop"
LINGER_MS = 1000


@dataclass(frozen=True)
class Call:
    seq: int
    op: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    reply: bool  # False: a step, answered only by the step's collectives


@dataclass(frozen=True)
class Answer:
    kind: str  # "reply" | "heartbeat" | "ready" | "failed" | "note" (news nobody asked for: (topic, payload))
    rank: int
    seq: int = -1
    ok: bool = True
    value: Any = None  # the call's result, or the error's text


def dumps(obj: Any) -> list[Any]:
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return [head, *buffers]


def loads(frames: list[Any]) -> Any:
    return pickle.loads(frames[0], buffers=frames[1:])


class RankChannel:
    """A rank's end: calls in, answers out, heartbeats beside them."""

    def __init__(self, rank: int, command_address: str, answer_address: str, heartbeat_s: float) -> None:
        self.rank = rank
        self._ctx = zmq.Context()
        self._commands = self._ctx.socket(zmq.PULL)
        self._commands.connect(command_address)
        self._answers = self._ctx.socket(zmq.PUSH)
        self._answers.setsockopt(zmq.LINGER, LINGER_MS)
        self._answers.connect(answer_address)
        self._answer_address = answer_address
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._parent = os.getppid()
        threading.Thread(target=self._beat, args=(heartbeat_s,), name="rank-heartbeat", daemon=True).start()

    def receive(self) -> Call:
        return loads(self._commands.recv_multipart(copy=False))

    def answer(self, call: Call, ok: bool, value: Any) -> None:
        self._send(self._answers, Answer("reply", self.rank, call.seq, ok, value))

    def note(self, topic: str, payload: Any) -> None:
        """From any thread of the rank."""
        self._send(self._answers, Answer("note", self.rank, value=(topic, payload)))

    def ready(self, value: Any) -> None:
        self._send(self._answers, Answer("ready", self.rank, value=value))

    def failed(self, error: BaseException) -> None:
        text = "".join(traceback.format_exception_only(type(error), error)).strip()
        self._send(self._answers, Answer("failed", self.rank, ok=False, value=text))

    def close(self) -> None:
        self._stop.set()
        self._commands.close(linger=0)
        self._answers.close()
        self._ctx.term()

    def _beat(self, interval_s: float) -> None:
        # A socket of its own: ZeroMQ sockets are not shared between threads.
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._answer_address)
        while not self._stop.wait(interval_s):
            if os.getppid() != self._parent:
                os._exit(1)  # rank 0 is gone: nobody will call, and the device memory must come back
            self._send(sock, Answer("heartbeat", self.rank))
        sock.close()

    def _send(self, sock: zmq.Socket, answer: Answer) -> None:
        # The main thread and a rank's helper threads (notes) share the answers socket, one at a time.
        with self._lock:
            sock.send_multipart(dumps(answer), copy=False)
