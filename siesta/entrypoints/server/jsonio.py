"""JSON out of the server: always ASCII, so text a client sent (echoed in an error message,
say) can never make encoding the response fail; and the SSE framing of streamed chunks."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse

SSE_DONE = "data: [DONE]\n\n"


def dumps(payload: Any) -> str:
    return json.dumps(payload, ensure_ascii=True, allow_nan=False, separators=(",", ":"))


class AsciiJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return dumps(content).encode("ascii")


def sse(payload: dict[str, Any]) -> str:
    return f"data: {dumps(payload)}\n\n"
