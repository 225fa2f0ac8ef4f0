"""Wire compatibility of the engine-core messages: defaults are omitted, missing fields decode as
defaults, an older sender drives a newer core, unknown operations are answered, errors keep type."""

from __future__ import annotations

import msgspec
import pytest

from siesta.config import ConfigError
from siesta.control import ConnectorRetentionError, EngineStateError, RequestRejected
from siesta.ipc import protocol
from siesta.ipc.protocol import (
    CallCodec,
    CoreCall,
    CoreMessage,
    MessageCodec,
    Pause,
    Reply,
    ResetPrefixCache,
    Sleep,
    StepOutputs,
    WakeUp,
)
from siesta.ipc.remote_errors import EngineCoreError, UnsupportedCallError, from_remote, to_remote
from siesta.request import EngineCoreOutput, EngineCoreRequest
from siesta.sampling import SamplingParams

CALLS = [c for c in vars(protocol).values() if isinstance(c, type) and issubclass(c, CoreCall) and c is not CoreCall]
MESSAGES = [c for c in vars(protocol).values() if isinstance(c, type) and issubclass(c, CoreMessage)]


def _raw(call: CoreCall) -> dict:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(call))


@pytest.mark.parametrize("cls", CALLS + MESSAGES + [protocol.Call, protocol.EngineInfo, protocol.RemoteError])
def test_every_struct_omits_defaults(cls):
    assert cls.__struct_config__.omit_defaults


def test_default_arguments_are_not_sent():
    assert _raw(Sleep()) == {"op": "sleep"}
    assert _raw(Pause()) == {"op": "pause"}
    assert _raw(WakeUp()) == {"op": "wake_up"}
    assert _raw(Sleep(clear_connector_cache=False)) == {"op": "sleep", "clear_connector_cache": False}
    assert _raw(Pause(mode="keep", clear_connector_cache=False)) == {
        "op": "pause", "mode": "keep", "clear_connector_cache": False,
    }  # fmt: skip


def test_missing_optional_fields_decode_as_defaults():
    codec = CallCodec()
    bare = msgspec.msgpack.encode({"call_id": 3, "body": {"op": "sleep"}})
    body = codec.decode_body(codec.decode_envelope(bare))
    assert body == Sleep(level=1, mode="abort", clear_connector_cache=True)
    bare = msgspec.msgpack.encode({"call_id": 4, "body": {"op": "pause", "mode": "wait"}})
    assert codec.decode_body(codec.decode_envelope(bare)) == Pause(
        mode="wait", clear_cache=True, clear_connector_cache=True
    )
    assert (
        codec.decode_body(
            codec.decode_envelope(msgspec.msgpack.encode({"call_id": 5, "body": {"op": "reset_prefix_cache"}}))
        )
        == ResetPrefixCache()
    )


class OldSleep(msgspec.Struct, tag="sleep", tag_field="op", omit_defaults=True):
    """A sleep call as a client from before clear_connector_cache existed defined it."""

    level: int = 1
    mode: str = "abort"


class NewerSleep(msgspec.Struct, tag="sleep", tag_field="op", omit_defaults=True):
    """A sleep call from a client newer than this engine, with an option it does not know."""

    level: int = 1
    mode: str = "abort"
    clear_connector_cache: bool = True
    some_future_option: int = 0


def _envelope(body: msgspec.Struct) -> bytes:
    return msgspec.msgpack.encode(protocol.Call(call_id=1, body=msgspec.Raw(msgspec.msgpack.encode(body))))


def test_an_older_client_drives_the_newer_engine():
    codec = CallCodec()
    decoded = codec.decode_body(codec.decode_envelope(_envelope(OldSleep(level=2, mode="keep"))))
    assert decoded == Sleep(level=2, mode="keep", clear_connector_cache=True)  # the safe default


def test_a_newer_clients_default_call_is_what_an_older_engine_already_reads():
    # Left at its default, the new option is not on the wire: the bytes are the old ones.
    assert msgspec.msgpack.encode(Sleep(level=2)) == msgspec.msgpack.encode(OldSleep(level=2))
    assert msgspec.msgpack.encode(NewerSleep(level=2)) == msgspec.msgpack.encode(OldSleep(level=2))


def test_unknown_fields_are_ignored():
    codec = CallCodec()
    decoded = codec.decode_body(
        codec.decode_envelope(_envelope(NewerSleep(clear_connector_cache=False, some_future_option=7)))
    )
    assert decoded == Sleep(clear_connector_cache=False)


def test_unknown_operations_raise_a_validation_error_not_a_crash():
    codec = CallCodec()
    call = codec.decode_envelope(msgspec.msgpack.encode({"call_id": 9, "body": {"op": "teleport"}}))
    with pytest.raises(msgspec.ValidationError):
        codec.decode_body(call)


def test_requests_round_trip_with_their_sampling_params():
    codec = CallCodec()
    params = SamplingParams(temperature=0.0, max_tokens=3, stop=["x"], logprobs=2, seed=5)
    req = EngineCoreRequest("r1", [1, 2, 3], params, cache_salt="salt")
    body = codec.decode_body(codec.decode_envelope(codec.encode(7, protocol.AddRequest(request=req))))
    assert body.request == req


def test_invalid_sampling_params_are_rejected_on_decode():
    codec = CallCodec()
    raw = {"call_id": 1, "body": {"op": "add", "request": {"request_id": "r", "prompt_token_ids": [1],
                                                          "sampling_params": {"temperature": -1.0}}}}  # fmt: skip
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        codec.decode_body(codec.decode_envelope(msgspec.msgpack.encode(raw)))


def test_core_messages_round_trip():
    codec = MessageCodec()
    out = StepOutputs(outputs=[EngineCoreOutput("a", [5], finish_reason="length")])
    assert codec.decode(codec.encode(out)) == out
    reply = Reply(call_id=2, result=True)
    assert codec.decode(codec.encode(reply)) == reply


@pytest.mark.parametrize(
    "exc", [ConnectorRetentionError("Mooncake cannot keep its cache; drop clear_connector_cache=False"),
            RequestRejected("too long"), EngineStateError("asleep"), ConfigError("bad"), ValueError("v"),
            UnsupportedCallError("op"), NotImplementedError("later")],
)  # fmt: skip
def test_errors_keep_their_type_and_message(exc):
    back = from_remote(MessageCodec().decode(MessageCodec().encode(Reply(call_id=1, error=to_remote(exc)))).error)
    assert type(back) is type(exc) and str(back) == str(exc)


def test_unknown_errors_arrive_as_engine_core_errors():
    back = from_remote(to_remote(KeyError("slot")))
    assert isinstance(back, EngineCoreError) and "KeyError" in str(back)
    assert isinstance(from_remote(protocol.RemoteError(type="FromTheFuture", message="m")), EngineCoreError)
