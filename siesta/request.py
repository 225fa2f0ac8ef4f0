"""A request as the front end hands it to the engine core, its life there, and what the core reports back."""

from __future__ import annotations

import base64
import enum
import io
import time
from array import array
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch

from siesta.sampling import SamplingParams

TOKEN_TYPECODE = "q"  # int64, the dtype of every token-id tensor


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    LOADING = "loading"  # holds blocks; its KV is on the way from a tier
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt and output ids as machine integers: hashed as bytes without a conversion, and not
    # walked by the cyclic collector (a 19.5k-token list is, at every young collection).
    all_token_ids: array = field(init=False, repr=False)
    num_computed_tokens: int = 0
    # Tokens sampled on the device whose ids the host has not seen yet: with async scheduling
    # the next step is scheduled (and computes them) before they are read back.
    num_unseen: int = 0
    # Prefix-cache hits (device + tiers) at the request's first scheduling.
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    # Keys of the full blocks of all_token_ids, under hash_extra (see siesta.kv.hashing).
    block_hashes: list[bytes] = field(default_factory=list)
    hash_extra: bytes = b""
    # Its device KV spans a weight update: nothing it computes may be cached under a key.
    kv_mixes_versions: bool = False
    # Prompt positions [0, n) whose logits were scored for prompt logprobs (each scores the
    # next prompt token). Survives preemption, so a recompute sends none of them twice.
    num_prompt_logprob_positions: int = 0

    def __post_init__(self) -> None:
        # Raises OverflowError / TypeError for an id no int64 holds (see Admission._checked_tokens).
        self.all_token_ids = array(TOKEN_TYPECODE, self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Whether prompt logprobs were asked for and some prompt positions are not scored yet."""
        wanted = self.sampling_params.prompt_logprobs is not None
        return wanted and self.num_prompt_logprob_positions < self.num_prompt_tokens - 1

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)


class Logprob(msgspec.Struct, omit_defaults=True):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class SampledLogprobs(msgspec.Struct, omit_defaults=True):
    """The sampled token's logprob and the top-n alternatives at one position."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = []


class PromptLogprobs(msgspec.Struct, omit_defaults=True):
    """Prompt tokens [start, start + len(logprobs)), each scored under the tokens before it
    (raw logits), with its rank and the top-n alternatives (empty when n is 0)."""

    start: int
    logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float]]] = []


class RoutedExperts(msgspec.Struct, omit_defaults=True):
    """Each token's top-k expert ids in every decoder layer, in router order (the largest
    weight first): the request's tokens ``[start, start + rows)`` of prompt then output, up to
    its last token, which is never computed (SGLang's ``seqlen - 1`` rows). ``data`` is C-order
    ``[rows, num_layers, top_k]`` of little-endian ``dtype`` (int8 up to 128 experts, else
    int16: a compact wire); -1 where no id is known (a dense layer, a block of KV loaded from
    the host or disk tier)."""

    start: int
    num_layers: int
    top_k: int
    dtype: str
    data: bytes

    @property
    def rows(self) -> int:
        return len(self.data) // (np.dtype(self.dtype).itemsize * self.num_layers * self.top_k)

    def array(self) -> np.ndarray:
        """``[rows, num_layers, top_k]`` int32."""
        ids = np.frombuffer(self.data, dtype=np.dtype(self.dtype).newbyteorder("<"))
        return ids.astype(np.int32).reshape(self.rows, self.num_layers, self.top_k)

    def sglang_base64(self) -> str:
        """SGLang's ``meta_info["routed_experts"]``: base64 of the int32 little-endian array."""
        return base64.b64encode(self.array().astype("<i4").tobytes()).decode("ascii")

    def npy_base64(self) -> str:
        """vLLM's ``choice["routed_experts"]``: base64 of the ``.npy`` file of ``[rows, layers, top_k]``
        (its header names the dtype and shape; the ids in the compact dtype)."""
        ids = np.frombuffer(self.data, dtype=np.dtype(self.dtype).newbyteorder("<"))
        buf = io.BytesIO()
        np.save(buf, ids.reshape(self.rows, self.num_layers, self.top_k), allow_pickle=False)
        return base64.b64encode(buf.getvalue()).decode("ascii")


class EngineCoreRequest(msgspec.Struct, omit_defaults=True):
    """A request as the front end hands it to the engine core (in process, or on the wire)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str | None = None
    arrival_time: float = 0.0


class EngineCoreOutput(msgspec.Struct, omit_defaults=True):
    """New tokens of one request from one step (or its end)."""

    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: list[SampledLogprobs] | None = None
    # The prompt tokens this step scored (a chunk of the prompt: several outputs carry one each).
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    weight_version: str = "0"
    error: str | None = None
    # On the output that finishes a request that asked for them (SamplingParams.return_routed_experts).
    routed_experts: RoutedExperts | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class WeightVersionSpan(msgspec.Struct):
    """Output tokens [start, end) were sampled under ``weight_version``."""

    weight_version: str
    start: int
    end: int


class CompletionOutput(msgspec.Struct):
    """vLLM-shaped: one sampled continuation of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Which weights sampled which tokens: one span unless a weight update landed mid-request.
    weight_versions: list[WeightVersionSpan] = []
    # Once finished, where SamplingParams.return_routed_experts asked: the experts of this
    # continuation's tokens (prompt then output), see RoutedExperts.
    routed_experts: RoutedExperts | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput(msgspec.Struct):
    """vLLM-shaped: everything produced for one prompt so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    weight_version: str = "0"
    # vLLM's shape: one entry per prompt token, None for the first (nothing precedes it); each
    # holds the prompt token and the top-n. None unless prompt_logprobs was asked for.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
