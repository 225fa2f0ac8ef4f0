"""The engine core: scheduler + model runner driven one step at a time.

It speaks token ids only; text, chat templates and stop strings live in the
frontend (``siesta.output_processor``). The offline ``LLM`` drives it in-process,
the server drives it in its own process (``siesta.ipc``).
"""

from __future__ import annotations

import logging

import msgspec

from siesta.config import ConfigError, EngineConfig
from siesta.core.model_runner import ModelRunner
from siesta.core.scheduler import Scheduler
from siesta.kv.hashing import ExtraKeys
from siesta.kv.kv_manager import KVManager, cdiv
from siesta.metrics import EngineStats, StatsSnapshot
from siesta.model.loader import ModelSource, resolve_model
from siesta.request import EngineCoreOutput, Request
from siesta.sampling import SamplingParams

logger = logging.getLogger(__name__)


class EngineCoreRequest(msgspec.Struct, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str | None = None
    arrival_time: float = 0.0


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    stats: StatsSnapshot = msgspec.field(default_factory=StatsSnapshot)


class RequestRejected(ValueError):
    """A request that can never run here; the message says why. Nothing else is affected."""


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None) -> None:
        self.config = config
        self.source = source or resolve_model(config.model.model, config.model.seed, config.model.tokenizer)
        self.max_model_len = self._max_model_len()
        config.validate(self.max_model_len)
        self.weight_version = config.model.weight_version
        self.runner = ModelRunner(config, self.source, self.max_model_len)
        self.vocab_size = self.runner.model.shape.vocab_size
        self.stats = EngineStats()
        self.kv = KVManager(self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, self.stats)
        self.eos_token_ids = frozenset(self.source.eos_token_ids)
        self._pending: list[EngineCoreOutput] = []

    def _max_model_len(self) -> int:
        limit = self.source.hf_config.max_position_embeddings
        wanted = self.config.model.max_model_len
        if wanted is None:
            return limit
        if wanted > limit:
            raise ConfigError(f"max_model_len={wanted} exceeds the model's context length ({limit})")
        return wanted

    # -- requests ----------------------------------------------------------------------

    def add_request(self, req: EngineCoreRequest) -> None:
        """Validate and queue; raises RequestRejected (naming the problem) and changes nothing on failure."""
        self._validate(req)
        request = Request(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            sampling_params=req.sampling_params,
            eos_token_ids=self.eos_token_ids,
            cache_salt=req.cache_salt,
        )
        request.hash_extra = self._hash_extra(req.cache_salt)
        self.scheduler.add_request(request)

    def _hash_extra(self, cache_salt: str | None) -> bytes:
        return ExtraKeys(self.source.fingerprint, self.weight_version, cache_salt).encode()

    def _validate(self, req: EngineCoreRequest) -> None:
        n = len(req.prompt_token_ids)
        if req.request_id in self.scheduler.requests:
            raise RequestRejected(f"request id {req.request_id!r} is already in use")
        if n == 0:
            raise RequestRejected("the prompt is empty: at least one token is needed")
        if n >= self.max_model_len:
            raise RequestRejected(
                f"the prompt has {n} tokens but max_model_len is {self.max_model_len}: "
                "at least one token must remain for the output"
            )
        bad = next((t for t in req.prompt_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestRejected(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        max_tokens = req.sampling_params.max_tokens
        total = self.max_model_len if max_tokens is None else min(n + max_tokens, self.max_model_len)
        # The last sampled token is never written to the cache.
        needed = cdiv(total - 1, self.config.cache.block_size)
        if needed > self.kv.pool.num_blocks:
            raise RequestRejected(
                f"the request needs {needed} KV blocks ({total - 1} tokens) but the cache holds only "
                f"{self.kv.pool.num_blocks} blocks of {self.config.cache.block_size} tokens; "
                "shorten the prompt or max_tokens, or give the cache more memory"
            )

    def abort_requests(self, request_ids: list[str]) -> None:
        self._pending.extend(self.scheduler.abort_requests(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # -- the step loop -----------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if not sched.is_empty:
            try:
                samples = self.runner.execute(sched)
            except Exception as e:  # noqa: BLE001 - one bad step must not take the engine down
                logger.exception("step failed; failing its %d requests", len(sched.scheduled))
                ids = [item.request.request_id for item in sched.scheduled]
                outputs.extend(self.scheduler.fail_requests(ids, f"{type(e).__name__}: {e}"))
            else:
                outputs.extend(self.scheduler.update(sched, samples, self.weight_version))
        return EngineCoreOutputs(outputs=outputs, stats=self.stats.drain())

    def drain_stats(self) -> StatsSnapshot:
        return self.stats.drain()

    def reset_prefix_cache(self) -> bool:
        self.kv.reset_prefix_cache()
        return True
