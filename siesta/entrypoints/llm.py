"""The offline API, a drop-in for vLLM's ``LLM``: the engine core driven in-process."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from siesta.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig, SchedulerConfig
from siesta.core.engine_core import EngineCore, EngineCoreRequest
from siesta.metrics import MetricsRegistry
from siesta.output_processor import OutputProcessor, RequestState
from siesta.request import RequestOutput
from siesta.sampling import SamplingParams
from siesta.tokenizer import chat_to_ids, encode

PromptType = str | list[int] | dict[str, Any]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        kv_cache_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int = 256,
        enable_chunked_prefill: bool = True,
        kv_transfer_config: KVTransferConfig | dict[str, Any] | str | None = None,
        device: str | None = None,
        enforce_eager: bool = False,
        attention_backend: str = "auto",
        enable_sleep_mode: bool = True,
    ) -> None:
        scheduler = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_chunked_prefill=enable_chunked_prefill,
        )
        self.config = EngineConfig(
            model=ModelConfig(model=model, tokenizer=tokenizer, dtype=dtype, max_model_len=max_model_len, seed=seed),
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_bytes=kv_cache_bytes,
                gpu_memory_utilization=gpu_memory_utilization,
                enable_prefix_caching=enable_prefix_caching,
            ),
            scheduler=scheduler,
            kv_transfer=KVTransferConfig.from_any(kv_transfer_config),
            device=device,
            enforce_eager=enforce_eager,
            attention_backend=attention_backend,
            enable_sleep_mode=enable_sleep_mode,
        )
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.source.load_tokenizer()
        self.metrics = MetricsRegistry()
        self.processor = OutputProcessor(self.tokenizer, self.metrics)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    # -- generation --------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        groups = [self._add(p, sp) for p, sp in zip(prompt_list, params)]
        return self._run(groups, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": chat_to_ids(self._require_tokenizer(), conv, add_generation_prompt, chat_template)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _add(self, prompt: PromptType, params: SamplingParams) -> tuple[str, list[str]]:
        text, token_ids, cache_salt = self._tokenize(prompt)
        parent = str(next(self._ids))
        children = [parent] if params.n == 1 else [f"{parent}-{i}" for i in range(params.n)]
        added: list[str] = []
        try:
            for i, rid in enumerate(children):
                child_params = params if params.n == 1 else _child_params(params, i)
                self.engine.add_request(EngineCoreRequest(rid, token_ids, child_params, cache_salt))
                self.processor.add(rid, text, token_ids, child_params)
                added.append(rid)
        except Exception:
            self.engine.abort_requests(added)
            for rid in added:
                self.processor.pop(rid)
            raise
        return parent, children

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int], str | None]:
        if isinstance(prompt, str):
            return prompt, encode(self._require_tokenizer(), prompt), None
        if isinstance(prompt, dict):
            salt = prompt.get("cache_salt")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"]), salt
            if "prompt" in prompt:
                return prompt["prompt"], encode(self._require_tokenizer(), prompt["prompt"]), salt
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt), None
        raise TypeError(f"unsupported prompt type {type(prompt).__name__}")

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token-id prompts or tokenizer=")
        return self.tokenizer

    def _run(self, groups: list[tuple[str, list[str]]], use_tqdm: bool) -> list[RequestOutput]:
        parent_of = {child: parent for parent, children in groups for child in children}
        left = {parent: len(children) for parent, children in groups}
        done: dict[str, RequestState] = {}
        try:
            with tqdm(total=len(groups), desc="Processed prompts", disable=not use_tqdm) as bar:
                while len(done) < len(parent_of):
                    for state in self._step():
                        if state.finished and state.request_id in parent_of and state.request_id not in done:
                            done[state.request_id] = self.processor.pop(state.request_id)
                            left[parent_of[state.request_id]] -= 1
                            bar.update(left[parent_of[state.request_id]] == 0)
        except BaseException:
            unfinished = [rid for rid in parent_of if rid not in done]
            self.engine.abort_requests(unfinished)
            self.engine.step()
            for rid in unfinished:
                self.processor.pop(rid)
            raise
        return [OutputProcessor.request_output(parent, [done[c] for c in children]) for parent, children in groups]

    def _step(self) -> list[RequestState]:
        out = self.engine.step()
        self.metrics.apply(out.stats)
        changed, to_abort = self.processor.process(out.outputs)
        if to_abort:
            self.engine.abort_requests(to_abort)
        return changed

    # -- observability -----------------------------------------------------------------

    def get_metrics(self) -> dict[str, float]:
        self.metrics.apply(self.engine.drain_stats())
        return self.metrics.as_dict()


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return list(prompts)


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts")
    return params


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """One of n samples: its own output, and its own seed so the n samples differ."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)
