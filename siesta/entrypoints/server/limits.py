"""What one HTTP request may cost the server, checked before the cost is paid.

- The body: a request larger than ``max_request_body_bytes`` is a 413, answered from its
  Content-Length (or once the streamed body passes the limit), before any of it is parsed.
- The fan-out: prompts x n engine requests per HTTP request, at most ``max_request_fanout``.
- A text prompt that cannot fit: no token is longer than the tokenizer's longest vocabulary
  entry, so a text of C characters has at least C / L tokens; past ``max_model_len`` it is
  refused without being tokenized. Tokenizing itself runs in a worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from transformers import PreTrainedTokenizerBase

from siesta.entrypoints.server.errors import APIError, error_body
from siesta.entrypoints.server.jsonio import AsciiJSONResponse

_CONTENT_LENGTH = b"content-length"


class BodySizeLimit:
    """ASGI middleware: bodies over ``max_bytes`` are refused (413) before the app reads them.

    A declared Content-Length is checked at once. A body sent without one (chunked) is read
    here up to the limit, then handed on: the app never sees a byte of one that is too large.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(_CONTENT_LENGTH)
        if declared is not None:
            if declared.isdigit() and int(declared) > self.max_bytes:
                await self._refuse(scope, receive, send, int(declared))
                return
            await self.app(scope, receive, send)
            return
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, size)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: int) -> None:
        status = HTTPStatus.REQUEST_ENTITY_TOO_LARGE
        message = (f"the request body has {size} bytes or more; at most {self.max_bytes} are taken "
                   "(--max-request-body-bytes)")  # fmt: skip
        await AsciiJSONResponse(error_body(status, message), status_code=status)(scope, receive, send)


def check_fanout(num_prompts: int, n: int, limit: int) -> None:
    if num_prompts * n > limit:
        raise APIError(
            HTTPStatus.BAD_REQUEST,
            f"{num_prompts} prompts x n={n} is {num_prompts * n} engine requests; at most {limit} per request "
            "(--max-request-fanout): split it",
            "n" if num_prompts == 1 else "prompt",
        )


@dataclass(frozen=True)
class PromptLimit:
    """A prompt must leave room for one output token: fewer than ``max_model_len`` tokens."""

    max_model_len: int
    max_token_chars: int  # characters of the longest vocabulary entry

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase | None, max_model_len: int) -> PromptLimit:
        longest = 1
        if tokenizer is not None:
            longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        return cls(max_model_len, max(longest, 1))

    def check_text(self, chars: int, param: str) -> None:
        """Refuse, untokenized, a text too long for any tokenization to fit."""
        if chars >= self.max_model_len * self.max_token_chars:
            raise APIError(
                HTTPStatus.BAD_REQUEST,
                f"the prompt has {chars} characters, so at least {chars // self.max_token_chars} tokens, "
                f"but max_model_len is {self.max_model_len}: at least one token must remain for the output",
                param,
            )

    def check_completion(self, prompt_tokens: int, max_tokens: int | None, min_tokens: int = 0) -> None:
        """vLLM's answer to a max_tokens that does not fit beside the prompt: a 400, not a cut.
        A min_tokens that cannot fit is one too, max_tokens given or not (without it, the
        request would run to the context limit and end short of its minimum)."""
        room = self.max_model_len - prompt_tokens
        if min_tokens > room:
            raise APIError(
                HTTPStatus.BAD_REQUEST,
                f"min_tokens={min_tokens} cannot be met: the prompt has {prompt_tokens} tokens and max_model_len "
                f"is {self.max_model_len}, so at most {room} tokens can be generated",
                "min_tokens",
            )
        if max_tokens is not None and prompt_tokens + max_tokens > self.max_model_len:
            raise APIError(
                HTTPStatus.BAD_REQUEST,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} in the "
                "completion). Please reduce the length of the prompt or max_tokens.",
                "max_tokens",
            )

    def check_ids(self, count: int, param: str) -> None:
        if count >= self.max_model_len:
            raise APIError(
                HTTPStatus.BAD_REQUEST,
                f"the prompt has {count} tokens but max_model_len is {self.max_model_len}: "
                "at least one token must remain for the output",
                param,
            )


def content_chars(messages: list[Any]) -> int:
    """The characters of a conversation's text, which its rendered prompt holds at least."""
    total = 0
    for m in messages:
        content = m.content
        if isinstance(content, str):
            total += len(content)
        elif content:
            total += sum(len(p.text or "") for p in content)
    return total
