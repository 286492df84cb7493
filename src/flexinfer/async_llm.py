"""AsyncLLM: the asyncio face of an LLM, for servers. Each request's
StreamEvents are handed from the engine thread to the event loop with
call_soon_threadsafe; leaving the `async for` early (a client went away, a
task was cancelled) cancels the request and releases its KV."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from flexinfer.engine_loop import RequestStream
from flexinfer.llm import LLM
from flexinfer.outputs import RequestOutput, StreamEvent
from flexinfer.sampling import SamplingParams


class AsyncRequest:
    """One request: `async for event in request` and `await request.result()`, in either order."""

    def __init__(self, llm: LLM, prompt, params: SamplingParams | None, priority: int):
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[StreamEvent | None] = asyncio.Queue()
        # Set with the end of the stream: result() waits for it and leaves
        # the events to `async for`, so either may come first.
        self._ended = asyncio.Event()

        def deliver(event: StreamEvent | None) -> None:  # on the engine thread
            try:
                loop.call_soon_threadsafe(self._receive, event)
            except RuntimeError:  # the event loop is closed: nobody is listening
                pass

        self.handle: RequestStream = llm.submit(prompt, params, priority, stream=True, deliver=deliver)

    def _receive(self, event: StreamEvent | None) -> None:  # on the event loop
        self._queue.put_nowait(event)
        if event is None:
            self._ended.set()

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.handle.prompt_token_ids

    async def __aiter__(self) -> AsyncIterator[StreamEvent]:
        try:
            while (event := await self._queue.get()) is not None:
                yield event
        finally:
            if not self.handle.done:
                self.handle.cancel()

    def cancel(self) -> None:
        self.handle.cancel()

    async def result(self) -> RequestOutput:
        """The RequestOutput once done (cancelling it if the caller is cancelled)."""
        try:
            await self._ended.wait()
        except asyncio.CancelledError:
            self.handle.cancel()
            raise
        return self.handle.result()


class AsyncLLM:
    def __init__(self, llm: LLM):
        self.llm = llm

    def submit(self, prompt, params: SamplingParams | None = None, priority: int = 0) -> AsyncRequest:
        """Queue a prompt (str or token ids); raises InvalidArgument at once for a malformed one."""
        return AsyncRequest(self.llm, prompt, params, priority)
