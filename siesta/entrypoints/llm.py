"""The offline API, a drop-in for vLLM's ``LLM``: the engine core driven in-process."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from siesta.config import EngineConfig, EngineFlags
from siesta.control import EngineStateError
from siesta.core.engine_core import EngineCore
from siesta.metrics import MetricsRegistry
from siesta.output_processor import OutputProcessor
from siesta.request import EngineCoreRequest, RequestOutput
from siesta.sampling import RequestOutputKind, SamplingParams
from siesta.tokenizer import bad_words_token_ids, chat_to_ids, encode, truncate_ids

PromptType = str | list[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, **flags: Any) -> None:
        """``model`` and the engine flags: ``siesta.config.EngineFlags``'s fields, by keyword (the
        signature below is theirs), as vLLM's ``LLM`` takes its engine arguments."""
        self.config = EngineConfig.from_flags(model=model, **flags)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.source.load_tokenizer()
        self.metrics = MetricsRegistry(model_name=self.engine.source.name)  # the name a server would serve it as
        self.metrics.serve_fidelity(self.engine.numerics_key)
        self.processor = OutputProcessor(self.tokenizer, self.metrics)
        self._ids = itertools.count()
        # Requests not yet handed back: parent id -> child ids (n > 1), and the reverse.
        self._children: dict[str, list[str]] = {}
        self._parent_of: dict[str, str] = {}
        self._done: set[str] = set()  # finished children
        self._unreported: set[str] = set()  # parents that progressed since the last step()

    def _require_running(self) -> None:
        if self.engine.is_sleeping() or self.engine.is_paused():
            raise EngineStateError("the engine is paused or asleep: resume() or wake_up() first")

    def get_tokenizer(self):
        return self.tokenizer

    # -- generation --------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        self._require_running()
        return self._run(self.add_requests(prompts, sampling_params), use_tqdm)

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

    def add_request(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> str:
        """Queue one prompt without waiting for it; ``step()`` drives it. Returns its request id."""
        return self._add(prompt, sampling_params or SamplingParams())

    def add_requests(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[str]:
        """Queue a batch, all or nothing, as ``generate`` does; ``step()`` drives it. Returns the
        request ids. Where a step loses nothing to the prompts not yet added (they already fill
        one, and the device runs ahead of the host), the engine takes it while adding the rest."""
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        parents: list[str] = []
        started, added_tokens = False, 0
        try:
            for prompt, sp in zip(prompt_list, params):
                parents.append(parent := self._add(prompt, sp))
                if not started:
                    added_tokens += sum(len(self.processor.states[c].prompt_token_ids) for c in self._children[parent])
                    started = self._start_early(added_tokens)
        except Exception:
            # All or nothing: a bad prompt leaves no half-added batch behind.
            self.abort(parents)
            raise
        return parents

    def _add(self, prompt: PromptType, params: SamplingParams) -> str:
        params = self._prepare_params(params)
        text, token_ids, cache_salt = self._tokenize(prompt, params.prompt_truncation(self.engine.max_model_len))
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
        self._children[parent] = children
        self._parent_of.update((c, parent) for c in children)
        return parent

    def _prepare_params(self, params: SamplingParams) -> SamplingParams:
        """The request's own copy, with its bad words as token ids (the core has no tokenizer), and
        asking for its routing where the engine records it (vLLM's rule)."""
        params = params.with_routing(self.engine.runner.routed is not None)
        if not params.bad_words:
            return params
        token_ids = bad_words_token_ids(self._require_tokenizer(), params.bad_words)
        return params.replace(bad_words_token_ids=token_ids)

    def _tokenize(self, prompt: PromptType, truncate_to: int | None = None) -> tuple[str | None, list[int], str | None]:
        """(text, token ids, cache salt); with ``truncate_to`` only the prompt's last tokens."""
        if isinstance(prompt, str):
            return prompt, encode(self._require_tokenizer(), prompt, truncate_to), None
        if isinstance(prompt, dict):
            salt = prompt.get("cache_salt")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), truncate_ids(prompt["prompt_token_ids"], truncate_to), salt
            if "prompt" in prompt:
                return prompt["prompt"], encode(self._require_tokenizer(), prompt["prompt"], truncate_to), salt
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, truncate_ids(prompt, truncate_to), None
        raise TypeError(f"unsupported prompt type {type(prompt).__name__}")

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token-id prompts or tokenizer=")
        return self.tokenizer

    def _run(self, parents: list[str], use_tqdm: bool) -> list[RequestOutput]:
        try:
            with tqdm(total=len(parents), desc="Processed prompts", disable=not use_tqdm) as bar:
                while not all(self._group_finished(p) for p in parents):
                    if not self.engine.has_work():
                        if self.engine.weights.open:
                            raise EngineStateError("a weight update is open: finish_weight_update() first")
                        raise EngineStateError("the engine is paused or asleep: resume() or wake_up() first")
                    self._drive_once()
                    bar.update(sum(map(self._group_finished, parents)) - bar.n)
        except BaseException:
            self.abort([p for p in parents if p in self._children])
            raise
        return [self._collect(p) for p in parents]

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests (from ``add_request``) that progressed,
        finished ones for the last time, as their ``output_kind`` says: everything so far
        (CUMULATIVE), what is new since the last output (DELTA), or only the finished
        output (FINAL_ONLY). ``generate`` always returns whole outputs, as vLLM's does."""
        self._drive_once()
        outputs = []
        for parent in sorted(self._unreported, key=int):
            states = [self.processor.states[c] for c in self._children[parent]]
            kind = states[0].params.output_kind
            delta = kind is RequestOutputKind.DELTA
            if self._group_finished(parent):
                outputs.append(self._collect(parent, delta))
            elif kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(OutputProcessor.request_output(parent, states, delta))
        self._unreported.clear()
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._children)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests (ids from ``add_request``); their blocks are freed at once."""
        self.abort(request_ids)

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (ids from ``add_request``); their blocks are freed at once."""
        for parent in request_ids:
            children = self._children.pop(parent, [])
            self.engine.abort_requests(children)
            for child in children:
                self.processor.pop(child)
                self._parent_of.pop(child, None)
                self._done.discard(child)
            self._unreported.discard(parent)
        self._drive_once()  # hand the aborts' outputs and stats through

    def _start_early(self, added_tokens: int) -> bool:
        """Step while a batch is still being added, where that loses nothing (H100 run 55a: 16
        prompts of 19.5k tokens took 9.4 ms to add, all before the first tier load began)."""
        if not self.engine.step_loses_nothing_to_more_adds(added_tokens):
            return False
        self._drive_once()
        return True

    def _drive_once(self) -> None:
        out = self.engine.step()
        self.metrics.apply(out.stats)
        changed, to_abort = self.processor.process(out.outputs)
        if to_abort:
            self.engine.abort_requests(to_abort, stopped=True)
        for state in changed:
            parent = self._parent_of.get(state.request_id)
            if parent is None:
                continue
            self._unreported.add(parent)
            if state.finished:
                self._done.add(state.request_id)

    def _group_finished(self, parent: str) -> bool:
        return all(c in self._done for c in self._children[parent])

    def _collect(self, parent: str, delta: bool = False) -> RequestOutput:
        children = self._children.pop(parent)
        states = [self.processor.pop(c) for c in children]
        for c in children:
            self._parent_of.pop(c, None)
            self._done.discard(c)
        self._unreported.discard(parent)
        return OutputProcessor.request_output(parent, states, delta)

    # -- pause, sleep, weights (siesta.control.EngineControl) ----------------------------

    def pause(self, mode: str = "abort", clear_cache: bool = True, clear_connector_cache: bool = True) -> None:
        """Stop generating (see ``EngineCore.pause``); with ``mode="wait"`` returns once in-flight requests end."""
        self.engine.pause(mode, clear_cache, clear_connector_cache)
        self._drain()

    def resume(self) -> None:
        self.engine.resume()

    def is_paused(self) -> bool:
        return self.engine.is_paused()

    def sleep(
        self, level: int = 1, mode: str = "abort", clear_connector_cache: bool = True, tags: list[str] | None = None
    ) -> None:
        """Pause and hand device memory back (see ``EngineCore.sleep``)."""
        self.engine.sleep(level, mode, clear_connector_cache, tags)
        self._drain()

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return self.engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def init_weight_transfer_engine(self, request: dict[str, Any]) -> None:
        """vLLM's weight-transfer API, phase 1 (once): ``{"init_info": {...}}`` or the bare init info.
        With the nccl backend this joins the trainer's group, so the trainer must join it meanwhile."""
        self.engine.init_weight_transfer_engine(request)

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        """Open an update: nothing is generated until ``finish_weight_update``."""
        self.engine.start_weight_update(is_checkpoint_format)

    def update_weights(self, weights: Any, weight_version: str | None = None) -> str:
        """Write new weights in place; returns the weight version.

        ``weights``: ``{"update_info": {...}}`` (vLLM's weight-transfer call: the bytes come
        through the configured backend), a state dict or (name, tensor) pairs with Hugging Face
        names (e.g. a trainer's ``state_dict()``), or a model path. Outside an open update,
        tensors and paths advance the version at once.
        """
        return self.engine.update_weights(weights, weight_version)

    def finish_weight_update(self, weight_version: str | None = None) -> str:
        """Publish the update's version (the next one unless named) and evict older KV everywhere."""
        return self.engine.finish_weight_update(weight_version)

    def get_world_size(self) -> int:
        return self.engine.get_world_size()

    def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> str:
        """Rename the weights (SGLang's): outputs report ``new_version``; cached KV stays reachable."""
        version = self.engine.update_weight_version(new_version, abort_all_requests)
        if abort_all_requests:
            self._drive_once()  # hand the aborted requests' outputs through, as abort() does
        return version

    def get_weight_version(self) -> str:
        return self.engine.weight_version

    @property
    def weight_version(self) -> str:
        return self.engine.weight_version

    def _drain(self) -> None:
        # A "wait" pause completes once in-flight requests finish; their outputs stay for step().
        while not self.engine.is_paused():
            self._drive_once()
        self._drive_once()  # hand aborted requests' outputs and the pause's stats through

    # -- observability -----------------------------------------------------------------

    def get_metrics(self) -> dict[str, float]:
        self.metrics.apply(self.engine.drain_stats())
        return self.metrics.as_dict()


def _flags_signature() -> inspect.Signature:
    """``LLM.__init__``'s signature, read from ``EngineFlags``: ``model``, then every flag by keyword."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for i, f in enumerate(dataclasses.fields(EngineFlags)):
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if i == 0 else inspect.Parameter.KEYWORD_ONLY
        params.append(inspect.Parameter(f.name, kind, default=f.default, annotation=f.type))
    return inspect.Signature(params, return_annotation=None)


LLM.__init__.__signature__ = _flags_signature()  # type: ignore[attr-defined]


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
