"""The server's engine: turns one HTTP request into engine requests and their updates.

A ``Generation`` is one HTTP request: prompts x n choices, each an engine request whose
outputs arrive on one shared ``OutputStream``. Its text is produced here (detokenization,
stop strings) by the same ``OutputProcessor`` the offline ``LLM`` uses. Closing a generation
that has not finished aborts what is left of it in the core, which frees its blocks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from siesta.entrypoints.server.prompts import TokenizedPrompt
from siesta.entrypoints.server.sampling_params import child_params
from siesta.ipc.client import EngineCoreClient, OutputStream
from siesta.output_processor import OutputProcessor, RequestState
from siesta.request import EngineCoreRequest
from siesta.sampling import SamplingParams


@dataclass
class Choice:
    index: int  # OpenAI's choice index: prompt_index * n + sample
    request_id: str  # the engine request
    prompt: TokenizedPrompt
    state: RequestState


@dataclass
class _Planned:
    request_id: str
    index: int
    prompt: TokenizedPrompt
    params: SamplingParams


class Generation:
    def __init__(
        self,
        llm: AsyncLLM,
        request_id: str,
        prompts: list[TokenizedPrompt],
        choices: list[Choice],
        stream: OutputStream,
    ) -> None:
        self.llm = llm
        self.request_id = request_id
        self.prompts = prompts
        self.choices = choices
        self.n = len(choices) // len(prompts)  # choices per prompt
        self._stream = stream
        self._by_engine_id = {c.request_id: c for c in choices}
        self._closed = False
        self._on_close: list[Callable[[], object]] = []

    @property
    def finished(self) -> bool:
        return all(c.state.finished for c in self.choices)

    async def updates(self) -> AsyncIterator[list[Choice]]:
        """The choices that changed, batch by batch, until every choice finished.

        Raises EngineDeadError if the core dies meanwhile.
        """
        while not self.finished:
            outputs = await self._stream.get()
            changed, to_abort = self.llm.processor.process(outputs)
            if to_abort:  # stopped by a stop string here: the core must free them
                self.llm.core.abort_nowait(to_abort, stopped=True)
            if changed:
                yield [self._by_engine_id[s.request_id] for s in changed if s.request_id in self._by_engine_id]

    def abort(self) -> None:
        """Ask the core to end what is unfinished; the aborts arrive as outputs, ending ``updates``."""
        if not self._closed:
            self.llm.core.abort_nowait([c.request_id for c in self.choices if not c.state.finished])

    def on_close(self, callback: Callable[[], object]) -> None:
        self._on_close.append(callback)

    def close(self) -> None:
        """Abort anything unfinished and forget the generation; safe to call twice."""
        if self._closed:
            return
        self.abort()
        self._closed = True
        ids = [c.request_id for c in self.choices]
        self.llm.core.close_stream(ids)
        for rid in ids:
            self.llm.processor.pop(rid)
        self.llm.forget(self)
        for callback in self._on_close:
            callback()


class AsyncLLM:
    def __init__(self, core: EngineCoreClient, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(tokenizer, core.metrics)
        self._live: dict[str, Generation] = {}

    async def generate(
        self,
        request_id: str,
        prompts: list[TokenizedPrompt],
        params: SamplingParams | list[SamplingParams],
        cache_salt: str | None = None,
        choice_ids: list[str] | None = None,
    ) -> Generation:
        """Queue every choice in the core; raises (RequestRejected, ...) with nothing left behind.

        ``params`` is one for all prompts or one per prompt (SGLang's batches); every prompt
        gets the same n. ``choice_ids`` names the engine requests (SGLang's ``rid``), prompt
        by prompt and sample by sample; by default they derive from ``request_id``.
        """
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in use")
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        plan = _plan(request_id, prompts, per_prompt, choice_ids)
        taken = [p.request_id for p in plan if p.request_id in self.processor.states]
        if taken or len({p.request_id for p in plan}) != len(plan):
            raise ValueError(f"request id {(taken or [request_id])[0]!r} is already in use")
        stream = self.core.open_stream(p.request_id for p in plan)
        choices = [
            Choice(
                p.index,
                p.request_id,
                p.prompt,
                self.processor.add(p.request_id, p.prompt.text, p.prompt.token_ids, p.params),
            )
            for p in plan
        ]
        generation = Generation(self, request_id, prompts, choices, stream)
        self._live[request_id] = generation
        requests = [EngineCoreRequest(c.request_id, c.prompt.token_ids, c.state.params, cache_salt) for c in choices]
        try:
            await self.core.add_requests(requests)  # one message: queued in one step, or not at all
        except BaseException:
            generation.close()
            raise
        return generation

    def forget(self, generation: Generation) -> None:
        if self._live.get(generation.request_id) is generation:
            del self._live[generation.request_id]

    async def abort(self, request_ids: list[str]) -> None:
        """Abort HTTP requests by the ids their responses carry (engine request ids work too)."""
        engine_ids: list[str] = []
        for rid in request_ids:
            generation = self._live.get(rid)
            engine_ids.extend([c.request_id for c in generation.choices] if generation else [rid])
        await self.core.abort_requests(engine_ids)

    async def abort_all(self) -> int:
        """Abort every request this server has in flight; returns how many engine requests."""
        engine_ids = [c.request_id for g in self._live.values() for c in g.choices if not c.state.finished]
        if engine_ids:
            await self.core.abort_requests(engine_ids)
        return len(engine_ids)


def _plan(
    request_id: str, prompts: list[TokenizedPrompt], params: list[SamplingParams], choice_ids: list[str] | None
) -> list[_Planned]:
    """Every choice: its engine request id (the HTTP id itself when there is one choice)."""
    n = params[0].n
    if len(params) != len(prompts) or any(p.n != n for p in params):
        raise ValueError("every prompt of a request must have its own params and the same n")
    if choice_ids is not None and len(choice_ids) != len(prompts) * n:
        raise ValueError(f"{len(choice_ids)} request ids for {len(prompts) * n} choices")
    single = len(prompts) == 1 and n == 1
    plan = []
    for p_index, (prompt, prompt_params) in enumerate(zip(prompts, params)):
        for sample in range(n):
            index = p_index * n + sample
            rid = request_id if single else f"{request_id}-{index}"
            if choice_ids is not None:
                rid = choice_ids[index]
            child = prompt_params if n == 1 else child_params(prompt_params, sample)
            plan.append(_Planned(rid, index, prompt, child))
    return plan
