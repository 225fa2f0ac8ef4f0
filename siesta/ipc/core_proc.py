"""The engine-core process: a busy loop that takes calls, steps the engine and sends outputs.

Each turn: take every waiting call (block only while there is nothing to step) and answer
each as soon as its work is done, before the next step: the outputs the calls produced
(requests a pause aborted, the step in flight a control call read back) go first, so they
have ended on the server before the reply arrives. Then step the engine when it has work and
send the step's outputs. A control call therefore waits at most for the step running when it
arrived, never for another one. A pause or sleep in ``wait`` mode is answered only in the
turn whose step completes it.

A call that raises is answered with its error and changes nothing else: one bad request or
control call never stops the loop.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from siesta.config import EngineConfig
from siesta.control import EngineStateError
from siesta.core.engine_core import EngineCore
from siesta.distributed.processes import RankFailed
from siesta.ipc.handler import CallHandler, Engine, engine_info
from siesta.ipc.protocol import CallCodec, CoreMessage, CoreState, Fatal, MessageCodec, Ready, Reply, StepOutputs
from siesta.ipc.remote_errors import UnsupportedCallError, to_remote

logger = logging.getLogger(__name__)

# An idle core blocks this long on its input, then checks that the server still exists.
IDLE_POLL_MS = 1000
# An idle core with a join in progress looks at it this often (a join answers within this).
PENDING_POLL_MS = 10
# How long a closing socket keeps trying to deliver its last messages (a Fatal, say).
SOCKET_LINGER_MS = 2000
EXIT_FAILURE = 1
# Errors a caller provokes with bad arguments or at the wrong time: no traceback in the log.
_EXPECTED_ERRORS = (ValueError, EngineStateError, NotImplementedError)


@dataclass
class PendingReply:
    call_id: int
    ready: Callable[[], bool]
    finish: Callable[[], Any] | None = None  # the reply's result, or raises its error
    needs_steps: bool = True  # a draining pause; a join (False) ends on its own thread


class EngineCoreProc:
    def __init__(self, engine: Engine, input_socket: zmq.Socket, output_socket: zmq.Socket, info: Callable) -> None:
        self.engine = engine
        self.input = input_socket
        self.output = output_socket
        self.handler = CallHandler(engine, info)
        self.calls = CallCodec()
        self.messages = MessageCodec()
        self.poller = zmq.Poller()
        self.poller.register(input_socket, zmq.POLLIN)
        self._replies: list[Reply] = []
        self._pending: list[PendingReply] = []
        self._dirty = False  # a call may have queued outputs or changed the gauges
        self._parent = os.getppid()

    def run(self) -> None:
        while not self.handler.stopping:
            self.engine.ranks.check()  # a rank that died while nothing ran ends the core too
            got_input = self.turn()
            if not got_input and not self._busy() and os.getppid() != self._parent:
                logger.warning("the server process is gone; the engine core exits")
                return

    def turn(self, idle_timeout_ms: int = IDLE_POLL_MS) -> bool:
        """One pass of the loop; returns whether any call arrived."""
        timeout = 0 if self._busy() else (PENDING_POLL_MS if self._pending else idle_timeout_ms)
        got_input = self._receive(timeout)
        if self._replies:
            self._send_outputs(self.engine.drain_outputs())
            self._flush_replies()
        if self._busy():
            self._step()
        else:
            self._answer_ready()  # a join ended while nothing stepped
        self._flush_replies()
        return got_input

    def _busy(self) -> bool:
        # A pending wait-mode reply means a pause drains: only steps can finish its requests.
        # A join in progress needs no step: the loop polls it, blocking a little on its input.
        return self._dirty or any(p.needs_steps for p in self._pending) or self.engine.has_work()

    def _receive(self, timeout_ms: int) -> bool:
        if not self.poller.poll(timeout_ms):
            return False
        while True:
            try:
                data = self.input.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            self.process(data)

    def process(self, data: bytes) -> None:
        """Decode and run one call; its reply is queued (or deferred), never raised."""
        try:
            call = self.calls.decode_envelope(data)
        except msgspec.DecodeError:
            logger.error("dropped a message that is not a call (%d bytes)", len(data))
            return
        try:
            body = self.calls.decode_body(call)
        except msgspec.DecodeError as e:
            self._reply_error(call.call_id, UnsupportedCallError(f"this engine cannot decode the call: {e}"))
            return
        self._dirty = True
        try:
            outcome = self.handler.handle(body)
        except RankFailed:
            raise  # the ranks are out of step: the core exits and the server with it
        except Exception as e:  # every error goes back to the caller
            if not isinstance(e, _EXPECTED_ERRORS):
                logger.exception("call %s failed", type(body).__name__)
            self._reply_error(call.call_id, e)
            return
        if outcome.ends_pauses:
            self._cancel_stale_pending()
        if outcome.ready is None:
            self._replies.append(Reply(call_id=call.call_id, result=outcome.result))
        else:
            self._pending.append(PendingReply(call.call_id, outcome.ready, outcome.finish, outcome.needs_steps))

    def _reply_error(self, call_id: int, exc: BaseException) -> None:
        self._replies.append(Reply(call_id=call_id, error=to_remote(exc)))

    def _step(self) -> None:
        self._dirty = False
        self._send_outputs(self.engine.step())
        self._answer_ready()

    def _answer_ready(self) -> None:
        still = []
        for pending in self._pending:
            if not pending.ready():
                still.append(pending)
            elif pending.finish is None:
                self._replies.append(Reply(call_id=pending.call_id))
            else:
                self._finish(pending)
        self._pending = still

    def _finish(self, pending: PendingReply) -> None:
        try:
            result = pending.finish()
        except RankFailed:
            raise
        except Exception as e:  # the call's error goes back to its caller
            if not isinstance(e, _EXPECTED_ERRORS):
                logger.exception("a deferred call failed")
            self._reply_error(pending.call_id, e)
            return
        self._dirty = True  # a join changes what the gauges and info say
        self._replies.append(Reply(call_id=pending.call_id, result=result))

    def _send_outputs(self, out) -> None:
        if out.outputs or not out.stats.is_empty():
            self._send(StepOutputs(outputs=out.outputs, stats=out.stats))

    def _cancel_stale_pending(self) -> None:
        # A resume or wake-up that lands while a pause still drains cancels that pause (a join
        # in progress is not a pause: it goes on).
        if self.engine.is_paused() or self.engine.is_sleeping():
            return
        for pending in self._pending:
            if pending.needs_steps:
                error = EngineStateError("the pause was cancelled (resume or wake_up) before in-flight requests finished")
                self._reply_error(pending.call_id, error)
        self._pending = [p for p in self._pending if not p.needs_steps]

    def _flush_replies(self) -> None:
        for reply in self._replies:
            self._send(reply)
        self._replies = []

    def _send(self, message: CoreMessage) -> None:
        if isinstance(message, (StepOutputs, Reply)):
            message.state = CoreState(self.engine.is_paused(), self.engine.is_sleeping(), self.engine.weight_version)
        self.output.send(self.messages.encode(message), copy=False)


def run_engine_core(config: EngineConfig, input_address: str, output_address: str) -> None:
    """The spawned process's entry point: load the model, say Ready, serve until told to stop."""
    # Ctrl-C reaches the whole process group; the server decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, SOCKET_LINGER_MS)
    inp.connect(input_address)
    out.connect(output_address)
    codec = MessageCodec()
    try:
        engine = EngineCore(config)
        out.send(codec.encode(Ready(info=engine_info(engine))))
        EngineCoreProc(engine, inp, out, lambda: engine_info(engine)).run()
        engine.close()
    except Exception as e:  # tell the server why before exiting
        logger.exception("the engine core failed")
        out.send(codec.encode(Fatal(error=to_remote(e))))
        _close(ctx, inp, out)
        sys.exit(EXIT_FAILURE)
    _close(ctx, inp, out)


def _close(ctx: zmq.Context, *sockets: zmq.Socket) -> None:
    for sock in sockets:
        sock.close()
    ctx.term()
