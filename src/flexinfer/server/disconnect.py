"""Responses that notice a client going away, so that its generation is
cancelled and its KV released at once, not when the next token would be
sent (or never, for a request still waiting in the queue).

After the request body has been read, the ASGI `receive` channel yields
only `http.disconnect`: one task waits on it beside the work, and whichever
ends first ends the other.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

async def _until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStreamResponse(StreamingResponse):
    """Server-sent events from an async generator of bytes.

    Invariant: when `__call__` returns or raises, the generator has been
    closed (its `finally` has run if it had started) and `on_close` has
    run, whether it ran out, the client went away, sending failed, or the
    server cancelled the task at shutdown. Starlette's
    StreamingResponse watches for a disconnect only on older ASGI spec
    versions and leaves the generator to the garbage collector."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None] | None = None):
        """`on_close()` runs at the end too: a generator that never started
        (the client left before the first event) runs no `finally`."""
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        watch = asyncio.ensure_future(_until_disconnected(receive))
        try:
            await asyncio.wait((stream, watch), return_when=asyncio.FIRST_COMPLETED)
            if stream.done():
                # Raises what sending raised; a client gone mid-send is not an error here.
                try:
                    stream.result()
                except OSError:
                    pass
        finally:
            for task in (stream, watch):
                task.cancel()
            await asyncio.gather(stream, watch, return_exceptions=True)
            try:
                await self.body_iterator.aclose()
            finally:
                if self._on_close is not None:
                    self._on_close()


async def unless_disconnected(request: Request, work: Awaitable[None]) -> bool:
    """Run `work` to its end (True), or cancel it if the client goes away first (False)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(request.receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # raises what the work raised
            return True
        return False
    finally:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
