"""A client that goes away aborts its generation, streaming or not, even while it is frozen.

Starlette notices a gone client only when it next writes (or, for older ASGI servers, while a
streaming body runs); a request that waits on a paused engine writes nothing. So every
generation gets a task that listens for ``http.disconnect`` and aborts it at once.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.requests import Request

from siesta.entrypoints.server.async_llm import Generation

_DISCONNECT = "http.disconnect"


def abort_on_disconnect(request: Request, generation: Generation) -> None:
    task = asyncio.get_running_loop().create_task(_watch(request, generation), name="siesta-disconnect-watch")
    generation.on_close(task.cancel)


async def _watch(request: Request, generation: Generation) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        while True:
            message = await request.receive()
            if message["type"] == _DISCONNECT:
                generation.abort()
                return
