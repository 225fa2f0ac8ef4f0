"""``--api-key``: every route but the open ones needs ``Authorization: Bearer <key>``.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which wraps ``receive`` and
would hide a client's disconnect from the routes).
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from siesta.entrypoints.server.errors import error_response

# Probes and scrapers carry no key; neither does a browser reading the API's docs.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
_BEARER = "bearer "
_UNAUTHORIZED = 401


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = error_response(_UNAUTHORIZED, "invalid or missing API key: send 'Authorization: Bearer <key>'")
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        if header[: len(_BEARER)].lower() != _BEARER.encode():
            return False
        # Constant time: the comparison must not leak how much of a guess was right.
        return hmac.compare_digest(header[len(_BEARER) :].strip(), self.expected)
