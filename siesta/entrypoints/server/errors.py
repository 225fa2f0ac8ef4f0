"""Every error leaves the server as OpenAI's JSON shape: ``{"error": {message, type, param, code}}``.

Engine errors map to statuses by type: bad arguments (ValueError, a refused retention, a
rejected request) are 400, a control call at the wrong time (EngineStateError) 409, a full
waiting queue 429 with Retry-After, a weight
transfer whose trainer went away mid-way 502, a dead engine core 503. Validation of a JSON body is 400, as vLLM answers it (OpenAI clients raise
BadRequestError); validation of query parameters is 422, FastAPI's convention.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from siesta.brief import bounded
from siesta.control import EngineOverloaded, EngineStateError
from siesta.entrypoints.server.jsonio import AsciiJSONResponse
from siesta.ipc.remote_errors import EngineDeadError
from siesta.weight_transfer.updater import UpdateFailed

logger = logging.getLogger(__name__)

_VALUE_ERROR_PREFIX = "Value error, "  # pydantic's prefix for a validator's ValueError
RETRY_AFTER_S = "1"  # a full queue drains by a batch in about a second's steps
_BODY = "body"
# Location parts pydantic adds for the branch of a union it tried: type names, and model classes.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "list", "dict", "tuple", "set", "none", "any"})
_CLASS_NAME = re.compile(r"[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*")
_TYPE_MISMATCH = "_type"  # pydantic's error types for a value of the wrong type (string_type, list_type, ...)


class APIError(Exception):
    """An error with its HTTP status, raised by route code."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_type(status: int) -> str:
    """OpenAI-style type names: BadRequestError, NotFoundError, ..."""
    if status == HTTPStatus.UNPROCESSABLE_ENTITY:  # Python 3.13 renamed its phrase
        return "UnprocessableEntityError"
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Server" if status >= HTTPStatus.INTERNAL_SERVER_ERROR else "Client"
    name = phrase.title().replace(" ", "").replace("-", "")
    return name if name.endswith("Error") else name + "Error"


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    # Bounded, whatever the message quotes of the request (siesta.brief).
    return {"error": {"message": bounded(message), "type": error_type(status), "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> AsciiJSONResponse:
    return AsciiJSONResponse(error_body(status, message, param), status_code=status)


def status_for(exc: BaseException) -> int:
    """The HTTP status of an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc.status
    if isinstance(exc, EngineDeadError):
        return HTTPStatus.SERVICE_UNAVAILABLE
    if isinstance(exc, EngineStateError):
        return HTTPStatus.CONFLICT
    if isinstance(exc, EngineOverloaded):
        return HTTPStatus.TOO_MANY_REQUESTS
    if isinstance(exc, UpdateFailed):  # the trainer, upstream of this call, went away
        return HTTPStatus.BAD_GATEWAY
    if isinstance(exc, NotImplementedError):
        return HTTPStatus.NOT_IMPLEMENTED
    if isinstance(exc, ValueError):  # RequestRejected, ConnectorRetentionError, ConfigError, ...
        return HTTPStatus.BAD_REQUEST
    return HTTPStatus.INTERNAL_SERVER_ERROR


def param_of(message: str, fields: set[str]) -> str | None:
    """The parameter an engine message names first (SamplingParams starts with the field)."""
    first = message.split(" ", 1)[0].rstrip(":,")
    return first if first in fields else None


def field_path(loc: Any) -> list[str]:
    """A pydantic error location as the user wrote it: field names and list indices, without
    the tags pydantic adds for each branch of a union and each validator it ran through
    (``function-after[_refuse(), SGLangSamplingParams]``, ``list[str]``, ``int``)."""
    return [str(part) for part in loc if isinstance(part, int) or not _is_pydantic_tag(str(part))]


def _is_pydantic_tag(part: str) -> bool:
    return "[" in part or "(" in part or part in _TYPE_TAGS or _CLASS_NAME.fullmatch(part) is not None


def describe_errors(errors: list[dict[str, Any]], skip_root: bool = False) -> tuple[str, str | None]:
    """(one message naming every bad field by its path, the first path) for pydantic's errors.

    A value that fits no branch of a union gets one error per branch; where one of them says
    more than "not of this type" (a validator's message, a bad field inside), the bare type
    mismatches of the same field are left out. ``skip_root`` drops the first location part
    (FastAPI's ``body`` or ``query``).
    """
    found = []
    for err in errors:
        path = field_path(err.get("loc", ()))[1 if skip_root else 0 :]
        message = str(err.get("msg", "invalid")).removeprefix(_VALUE_ERROR_PREFIX)
        if err.get("type") == "json_invalid":
            path, message = [_BODY], f"the body is not valid JSON: {err.get('ctx', {}).get('error', message)}"
        found.append((path, message, str(err.get("type", "")).endswith(_TYPE_MISMATCH)))
    telling = {p[0] for p, _, mismatch in found if p and not mismatch}
    parts: list[str] = []
    first: str | None = None
    for path, message, mismatch in found:
        if mismatch and path and path[0] in telling:
            continue
        name = ".".join(path) or "request"
        named = message.split(" ", 1)[0].rstrip(":,")
        if named == name or named.startswith(name + "."):  # a validator that names the field itself
            name, part = named, message
        else:
            part = f"{name}: {message}"
        if part not in parts:
            parts.append(part)
        first = first or name
    return "; ".join(parts) or "invalid request", first


def validation_message(exc: RequestValidationError) -> tuple[str, str | None, bool]:
    """(message naming each bad parameter, the first one, whether any error is in the body)."""
    errors = list(exc.errors())
    in_body = any(tuple(err.get("loc", ()))[:1] == (_BODY,) for err in errors)
    message, first = describe_errors(errors, skip_root=True)
    return message, first, in_body


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> AsciiJSONResponse:
        message, param, in_body = validation_message(exc)
        status = HTTPStatus.BAD_REQUEST if in_body else HTTPStatus.UNPROCESSABLE_ENTITY
        return error_response(status, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> AsciiJSONResponse:
        body = error_body(exc.status_code, str(exc.detail))
        return AsciiJSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> AsciiJSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    for cls in (EngineDeadError, EngineStateError, EngineOverloaded, UpdateFailed, NotImplementedError, ValueError):
        app.add_exception_handler(cls, _engine_error)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> AsciiJSONResponse:
        logger.exception("unexpected error serving %s %s", request.method, request.url.path)
        return error_response(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {type(exc).__name__}: {exc}")


async def _engine_error(_: Request, exc: Exception) -> AsciiJSONResponse:
    response = error_response(status_for(exc), str(exc))
    if isinstance(exc, EngineOverloaded):
        response.headers["Retry-After"] = RETRY_AFTER_S
    return response
