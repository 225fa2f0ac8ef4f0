"""The core's loop in-process, over inproc sockets, with a fake engine: replies, deferral, errors."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from siesta.control import ConnectorRetentionError, EngineStateError
from siesta.core.engine_core import EngineCoreOutputs
from siesta.ipc.core_proc import EngineCoreProc
from siesta.ipc.protocol import (
    CallCodec,
    EngineInfo,
    GetInfo,
    IsPaused,
    MessageCodec,
    Pause,
    Reply,
    Resume,
    Shutdown,
    Sleep,
    StepOutputs,
)
from siesta.ipc.remote_errors import from_remote
from siesta.request import EngineCoreOutput

DRAIN_STEPS = 3
TURN_MS = 10
REFUSAL = "FakeConnector cannot keep its cache across a pause: drop clear_connector_cache=False"


class FakeEngine:
    """Pauses in ``wait`` mode complete after DRAIN_STEPS steps; each step emits one token."""

    weight_version = "0"

    def __init__(self) -> None:
        self.paused = self.sleeping = False
        self.draining = 0
        self.steps = 0

    def has_work(self) -> bool:
        return False  # like the real engine during a sleep in wait mode: the loop must not rely on it

    def drain_outputs(self) -> EngineCoreOutputs:
        return EngineCoreOutputs()

    def step(self) -> EngineCoreOutputs:
        self.steps += 1
        if self.draining:
            self.draining -= 1
            self.paused = self.draining == 0
        return EngineCoreOutputs(outputs=[EngineCoreOutput("r", [self.steps])])

    def pause(self, mode: str = "abort", clear_cache: bool = True, clear_connector_cache: bool = True) -> None:
        if not clear_connector_cache:
            raise ConnectorRetentionError(REFUSAL)
        if self.paused or self.draining:
            raise EngineStateError("already paused")
        if mode == "wait":
            self.draining = DRAIN_STEPS
        else:
            self.paused = True

    def sleep(self, level: int = 1, mode: str = "abort", clear_connector_cache: bool = True, tags=None) -> None:
        self.pause(mode, True, clear_connector_cache)
        self.sleeping = True

    def resume(self) -> None:
        self.paused, self.draining = False, 0

    def is_paused(self) -> bool:
        return self.paused

    def is_sleeping(self) -> bool:
        return self.sleeping


@pytest.fixture
def loop():
    ctx = zmq.Context()
    to_core, core_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    core_out, from_core = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_core.bind("inproc://calls")
    core_in.connect("inproc://calls")
    from_core.bind("inproc://messages")
    core_out.connect("inproc://messages")
    engine = FakeEngine()
    info = EngineInfo(model_name="fake", max_model_len=8, vocab_size=8, block_size=4, num_blocks=2)
    proc = EngineCoreProc(engine, core_in, core_out, lambda: info)
    yield Harness(proc, engine, to_core, from_core)
    for sock in (to_core, core_in, core_out, from_core):
        sock.close(linger=0)
    ctx.term()


class Harness:
    def __init__(self, proc: EngineCoreProc, engine: FakeEngine, to_core: zmq.Socket, from_core: zmq.Socket) -> None:
        self.proc, self.engine, self.to_core, self.from_core = proc, engine, to_core, from_core
        self.calls, self.messages = CallCodec(), MessageCodec()
        self.next_id = 0

    def send(self, body) -> int:
        self.next_id += 1
        self.to_core.send(self.calls.encode(self.next_id, body))
        return self.next_id

    def turn(self) -> list:
        self.proc.turn(TURN_MS)
        out = []
        while True:
            try:
                out.append(self.messages.decode(self.from_core.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return out


def _replies(messages: list) -> dict[int, Reply]:
    return {m.call_id: m for m in messages if isinstance(m, Reply)}


def test_immediate_calls_are_answered_in_the_same_turn(loop):
    ids = [loop.send(IsPaused()), loop.send(Pause(mode="keep")), loop.send(IsPaused()), loop.send(GetInfo())]
    replies = _replies(loop.turn())
    assert [replies[i].result for i in ids[:3]] == [False, None, True]
    assert msgspec.convert(replies[ids[3]].result, EngineInfo).model_name == "fake"


def test_a_waiting_pause_is_answered_only_once_it_completes_after_its_outputs(loop):
    call = loop.send(Pause(mode="wait"))
    seen: list = []
    for _ in range(DRAIN_STEPS + 2):
        seen.extend(loop.turn())
        if call in _replies(seen):
            break
    assert loop.engine.steps == DRAIN_STEPS  # the loop stepped although has_work() said no
    reply_at = next(i for i, m in enumerate(seen) if isinstance(m, Reply))
    outputs = [m for m in seen[:reply_at] if isinstance(m, StepOutputs)]
    assert len(outputs) == DRAIN_STEPS  # every step's outputs went out before the reply
    assert _replies(seen)[call].error is None
    assert loop.turn() == []  # and then the loop idles


def test_sleep_wait_is_deferred_too(loop):
    call = loop.send(Sleep(mode="wait"))
    assert call not in _replies(loop.turn())
    messages = loop.turn() + loop.turn() + loop.turn()
    assert _replies(messages)[call].error is None and loop.engine.is_sleeping()


def test_a_resume_cancels_a_draining_pause(loop):
    pause = loop.send(Pause(mode="wait"))
    loop.turn()
    resume = loop.send(Resume())
    replies = _replies(loop.turn())
    assert replies[resume].error is None
    error = from_remote(replies[pause].error)
    assert isinstance(error, EngineStateError) and "cancelled" in str(error)


def test_errors_come_back_typed_and_the_loop_goes_on(loop):
    refused = loop.send(Pause(clear_connector_cache=False))
    again = loop.send(Pause(mode="keep"))
    twice = loop.send(Pause(mode="keep"))
    replies = _replies(loop.turn())
    error = from_remote(replies[refused].error)
    assert isinstance(error, ConnectorRetentionError) and str(error) == REFUSAL
    assert replies[again].error is None
    assert isinstance(from_remote(replies[twice].error), EngineStateError)


def test_unknown_operations_and_garbage_do_not_stop_the_loop(loop):
    loop.to_core.send(msgspec.msgpack.encode({"call_id": 77, "body": {"op": "teleport", "where": "mars"}}))
    loop.to_core.send(b"\x00not msgpack at all")
    ok = loop.send(IsPaused())
    replies = _replies(loop.turn())
    error = from_remote(replies[77].error)
    assert isinstance(error, ValueError) and "cannot decode" in str(error)
    assert replies[ok].result is False


def test_shutdown_stops_the_loop(loop):
    call = loop.send(Shutdown())
    assert _replies(loop.turn())[call].error is None
    assert loop.proc.handler.stopping


def test_a_call_is_answered_before_the_next_step_with_the_outputs_it_made_first(loop):
    """A control call waits at most for the step running when it arrived: its reply (and the
    outputs it produced, such as aborted requests) leave before the loop steps again."""
    loop.engine.has_work = lambda: True  # a busy engine: every turn steps
    loop.engine.drain_outputs = lambda: EngineCoreOutputs(outputs=[EngineCoreOutput("aborted", finish_reason="abort")])
    call = loop.send(IsPaused())
    messages = loop.turn()
    kinds = [type(m).__name__ for m in messages]
    assert kinds == ["StepOutputs", "Reply", "StepOutputs"]  # the call's outputs, its reply, then the step
    assert messages[0].outputs[0].request_id == "aborted" and messages[1].call_id == call
    assert messages[2].outputs[0].new_token_ids == [loop.engine.steps]


class _Joining:
    """A join that ends when the test says, with a result or an error."""

    def __init__(self) -> None:
        self.ended = False
        self.error: Exception | None = None

    def deferred(self):
        from siesta.core.deferred import Deferred

        def finish() -> str:
            if self.error is not None:
                raise self.error
            return "weight_update_group"

        return Deferred(lambda: self.ended, finish)


def test_a_join_is_answered_once_it_ends_and_the_loop_serves_and_steps_meanwhile(loop):
    from siesta.ipc.protocol import InitWeightsUpdateGroup

    joining = _Joining()
    loop.engine.begin_weights_update_group = lambda info: joining.deferred()
    loop.engine.has_work = lambda: True  # a stream is running: it must keep stepping
    call = loop.send(InitWeightsUpdateGroup(init_info={}))
    seen: list = []
    for _ in range(5):
        seen.extend(loop.turn())
    assert call not in _replies(seen)
    assert loop.engine.steps >= 5  # one step a turn while the trainer has not come
    other = loop.send(IsPaused())  # control calls are answered meanwhile
    assert _replies(loop.turn())[other].result is False
    joining.ended = True
    reply = _replies(loop.turn())[call]
    assert reply.error is None and reply.result == "weight_update_group"
    loop.engine.resume()  # a resume does not cancel a join
    failed = _Joining()
    loop.engine.begin_weights_update_group = lambda info: failed.deferred()
    call = loop.send(InitWeightsUpdateGroup(init_info={}))
    loop.turn()
    failed.ended, failed.error = True, ValueError("could not join: nobody at 127.0.0.1:1")
    reply = _replies(loop.turn())[call]
    assert "nobody at" in from_remote(reply.error).args[0]


def test_an_idle_loop_with_a_join_in_progress_does_not_spin(loop):
    from siesta.ipc.protocol import InitWeightsUpdateGroup

    joining = _Joining()
    loop.engine.begin_weights_update_group = lambda info: joining.deferred()
    loop.send(InitWeightsUpdateGroup(init_info={}))
    loop.turn()  # takes the call
    before = loop.engine.steps
    for _ in range(3):
        loop.turn()
    assert loop.engine.steps == before  # nothing to step: it waits on its input, polling the join
