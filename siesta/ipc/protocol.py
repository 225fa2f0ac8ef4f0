"""The messages between the API server and the engine-core process (msgpack, via msgspec).

Compatibility rules, which every struct here follows:

- ``omit_defaults=True``: a field that holds its default is not sent. A newer sender that
  leaves a new option at its default produces the bytes an older receiver already decodes.
- A field missing from the bytes decodes as its default, and unknown fields are ignored, so a
  newer receiver accepts an older sender's messages.
- The server wraps each call as ``Call(call_id, body)`` with the body left raw, and the core
  decodes the body in a second pass: an operation the core does not know is answered with an
  error ``Reply`` instead of breaking the stream.

Server -> core: ``Call`` whose body is one ``CoreCall``. Core -> server: one ``CoreMessage``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from siesta.metrics import StatsSnapshot
from siesta.request import EngineCoreOutput, EngineCoreRequest
from siesta.weight_transfer.sglang_group import DEFAULT_GROUP_NAME


class Call(msgspec.Struct, omit_defaults=True):
    """Envelope of every server -> core message; ``body`` is an encoded ``CoreCall``."""

    call_id: int
    body: msgspec.Raw


# -- calls (server -> core) ------------------------------------------------------------


class CoreCall(msgspec.Struct, tag_field="op", omit_defaults=True):
    """Base of the operations the core performs; ``op`` names each on the wire."""


class AddRequest(CoreCall, tag="add", omit_defaults=True):
    request: EngineCoreRequest


class AddRequests(CoreCall, tag="add_many", omit_defaults=True):
    """Every choice of one HTTP request in one message: all are queued, or none."""

    requests: list[EngineCoreRequest] = []


class AbortRequests(CoreCall, tag="abort", omit_defaults=True):
    request_ids: list[str] = []
    stopped: bool = False  # ended by a stop string the front end found: finished, not aborted


class Pause(CoreCall, tag="pause", omit_defaults=True):
    mode: str = "abort"
    clear_cache: bool = True
    clear_connector_cache: bool = True


class Resume(CoreCall, tag="resume", omit_defaults=True):
    pass


class IsPaused(CoreCall, tag="is_paused", omit_defaults=True):
    pass


class Sleep(CoreCall, tag="sleep", omit_defaults=True):
    level: int = 1
    mode: str = "abort"
    clear_connector_cache: bool = True
    tags: list[str] | None = None  # what level >= 1 releases; None: weights and KV cache


class WakeUp(CoreCall, tag="wake_up", omit_defaults=True):
    tags: list[str] | None = None  # None: weights and KV cache


class IsSleeping(CoreCall, tag="is_sleeping", omit_defaults=True):
    pass


class ResetPrefixCache(CoreCall, tag="reset_prefix_cache", omit_defaults=True):
    reset_running_requests: bool = False
    reset_connector: bool = False


class UpdateWeights(CoreCall, tag="update_weights", omit_defaults=True):
    """A checkpoint path, or a weight-transfer ``update_info`` (exactly one)."""

    model_path: str | None = None
    update_info: Any = None
    weight_version: str | None = None  # None: the next version


class InitWeightTransfer(CoreCall, tag="init_weight_transfer", omit_defaults=True):
    init_info: Any = None


class StartWeightUpdate(CoreCall, tag="start_weight_update", omit_defaults=True):
    is_checkpoint_format: bool = True


class FinishWeightUpdate(CoreCall, tag="finish_weight_update", omit_defaults=True):
    weight_version: str | None = None  # None: the next version, if the update wrote anything


class GetWorldSize(CoreCall, tag="get_world_size", omit_defaults=True):
    pass


# SGLang's weight calls: named groups, updates that are one call each, the version rename.


class InitWeightsUpdateGroup(CoreCall, tag="init_weights_update_group", omit_defaults=True):
    init_info: Any = None  # SGLang's body: master_address, master_port, rank_offset, world_size, ...


class DestroyWeightsUpdateGroup(CoreCall, tag="destroy_weights_update_group", omit_defaults=True):
    group_name: str = DEFAULT_GROUP_NAME


class OneCallOptions(msgspec.Struct, omit_defaults=True):
    weight_version: str | None = None  # None: the next version
    abort_all_requests: bool = False
    flush_cache: bool = True
    empty_cache: bool = False


class UpdateWeightsFromDistributed(CoreCall, tag="update_weights_from_distributed", omit_defaults=True):
    names: Any = None
    dtypes: Any = None
    shapes: Any = None
    group_name: str = DEFAULT_GROUP_NAME
    load_format: str | None = None
    options: OneCallOptions = msgspec.field(default_factory=OneCallOptions)


class UpdateWeightsFromTensor(CoreCall, tag="update_weights_from_tensor", omit_defaults=True):
    serialized: list[str] = []  # one base64 pickle per engine rank
    load_format: str | None = None
    options: OneCallOptions = msgspec.field(default_factory=OneCallOptions)


class UpdateWeightsFromDisk(CoreCall, tag="update_weights_from_disk", omit_defaults=True):
    model_path: str = ""
    options: OneCallOptions = msgspec.field(default_factory=OneCallOptions)


class UpdateWeightVersion(CoreCall, tag="update_weight_version", omit_defaults=True):
    new_version: str = ""
    abort_all_requests: bool = True  # SGLang's default


class GetInfo(CoreCall, tag="get_info", omit_defaults=True):
    pass


class Shutdown(CoreCall, tag="shutdown", omit_defaults=True):
    pass


CoreCallUnion = (
    AddRequest | AddRequests | AbortRequests | Pause | Resume | IsPaused | Sleep | WakeUp | IsSleeping
    | ResetPrefixCache | UpdateWeights | InitWeightTransfer | StartWeightUpdate | FinishWeightUpdate
    | GetWorldSize | GetInfo | Shutdown | InitWeightsUpdateGroup | DestroyWeightsUpdateGroup
    | UpdateWeightsFromDistributed | UpdateWeightsFromTensor | UpdateWeightsFromDisk | UpdateWeightVersion
)  # fmt: skip

# The message of each verb of siesta.control.EngineControl (the weight version is a field of the
# core's info). Their fields are the verb's arguments under its names and defaults, save where
# the wire holds the argument otherwise: update_weights' path or update_info, the bare init info
# (tests/test_control_surface.py).
CONTROL_CALLS: dict[str, type[CoreCall]] = {
    "init_weight_transfer_engine": InitWeightTransfer,
    "start_weight_update": StartWeightUpdate,
    "update_weights": UpdateWeights,
    "finish_weight_update": FinishWeightUpdate,
    "get_world_size": GetWorldSize,
    "pause": Pause,
    "resume": Resume,
    "is_paused": IsPaused,
    "sleep": Sleep,
    "wake_up": WakeUp,
    "is_sleeping": IsSleeping,
    "reset_prefix_cache": ResetPrefixCache,
    "abort_requests": AbortRequests,
    "update_weight_version": UpdateWeightVersion,
    "get_weight_version": GetInfo,
}


# -- messages (core -> server) -----------------------------------------------------------


class EngineInfo(msgspec.Struct, omit_defaults=True):
    """What the server needs to know about the loaded model; sent once the core is ready."""

    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    weight_version: str = "0"
    pid: int = 0
    # Whether the KV tiers can be kept through a pause or sleep (clear_connector_cache=False).
    retains_tier: bool = True
    # Whether the engine records the experts tokens are routed to (enable_return_routed_experts):
    # vLLM's routes then return them with every answer.
    records_routing: bool = False
    # The logprob oracle's key of the engine (``siesta.fidelity_report``): /metrics serves its report.
    numerics_key: str = ""


class RemoteError(msgspec.Struct, omit_defaults=True):
    """An exception raised in the core: its (known) type name and its message."""

    type: str
    message: str


class CoreMessage(msgspec.Struct, tag_field="kind", omit_defaults=True):
    """Base of what the core sends; ``kind`` names each on the wire."""


class Ready(CoreMessage, tag="ready", omit_defaults=True):
    info: EngineInfo


class CoreState(msgspec.Struct, omit_defaults=True):
    """What the core's state queries answer, as of the message that carries it. Sent with every
    output and reply, so the server answers is_paused, is_sleeping and the weight version at
    once instead of behind the step in flight (seconds under load on a CPU)."""

    paused: bool = False
    sleeping: bool = False
    weight_version: str = "0"


class StepOutputs(CoreMessage, tag="outputs", omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    stats: StatsSnapshot = msgspec.field(default_factory=StatsSnapshot)
    state: CoreState | None = None


class Reply(CoreMessage, tag="reply", omit_defaults=True):
    call_id: int
    result: Any = None
    error: RemoteError | None = None
    state: CoreState | None = None


class Fatal(CoreMessage, tag="fatal", omit_defaults=True):
    """The core is about to exit (startup failed, or its loop broke)."""

    error: RemoteError


CoreMessageUnion = Ready | StepOutputs | Reply | Fatal


class CallCodec:
    """Encodes calls on the server side, decodes them in two passes on the core side."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._envelope = msgspec.msgpack.Decoder(Call)
        self._body = msgspec.msgpack.Decoder(CoreCallUnion)

    def encode(self, call_id: int, body: CoreCall) -> bytes:
        return self._encoder.encode(Call(call_id=call_id, body=msgspec.Raw(self._encoder.encode(body))))

    def decode_envelope(self, data: bytes) -> Call:
        return self._envelope.decode(data)

    def decode_body(self, call: Call) -> CoreCall:
        """Raises ``msgspec.ValidationError`` for an operation (or arguments) this side does not know."""
        return self._body.decode(call.body)


class MessageCodec:
    """Core -> server messages."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessageUnion)

    def encode(self, message: CoreMessage) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes) -> CoreMessage:
        return self._decoder.decode(data)
