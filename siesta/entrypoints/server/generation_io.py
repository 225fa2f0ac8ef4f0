"""Driving a generation to its end for either route: wait for all of it, or stream it as SSE."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from http import HTTPStatus
from typing import Any

from siesta.entrypoints.server.async_llm import Choice, Generation
from siesta.entrypoints.server.errors import APIError, error_body, param_of
from siesta.entrypoints.server.jsonio import SSE_DONE, sse
from siesta.entrypoints.server.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from siesta.entrypoints.server.responses import usage
from siesta.ipc.remote_errors import EngineDeadError

EVENT_STREAM = "text/event-stream"
FINISH_ERROR = "error"
_FIELDS = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)

ChunkFn = Callable[[list[Choice]], list[dict[str, Any]]]
EnvelopeFn = Callable[[list[dict[str, Any]]], dict[str, Any]]


def sampling_error(exc: ValueError) -> APIError:
    """A SamplingParams error as a 400 naming its field."""
    message = str(exc)
    return APIError(HTTPStatus.BAD_REQUEST, message, param_of(message, _FIELDS))


def _failure(choices: list[Choice]) -> str | None:
    failed = next((c for c in choices if c.state.finish_reason == FINISH_ERROR), None)
    return None if failed is None else f"generation failed in the engine: {failed.state.error}"


async def collect(generation: Generation) -> None:
    """Wait for every choice; a choice the engine failed makes the whole request a 500."""
    try:
        async for _ in generation.updates():
            pass
    finally:
        generation.close()
    failure = _failure(generation.choices)
    if failure is not None:
        raise APIError(HTTPStatus.INTERNAL_SERVER_ERROR, failure)


async def stream_events(
    generation: Generation, chunks: ChunkFn, envelope: EnvelopeFn, options: StreamOptions | None
) -> AsyncIterator[str]:
    """SSE events: the route's chunks, then usage if asked, then ``[DONE]``.

    Errors after the headers are sent travel as an ``{"error": ...}`` event.
    """
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    try:
        async for changed in generation.updates():
            for chunk in chunks(changed):
                if continuous:
                    chunk["usage"] = usage(generation)
                yield sse(chunk)
            failure = _failure(changed)
            if failure is not None:
                yield sse(error_body(HTTPStatus.INTERNAL_SERVER_ERROR, failure))
                break
        else:
            if include_usage:
                yield sse(envelope([]) | {"usage": usage(generation)})
    except EngineDeadError as e:
        yield sse(error_body(HTTPStatus.SERVICE_UNAVAILABLE, str(e)))
    finally:
        generation.close()
    yield SSE_DONE
