"""GracefulServer: uvicorn's Server with the signal handling `flexinfer
serve` needs.

SIGTERM or Ctrl-C first tells the app it is shutting down (so anything that
still arrives gets a 503), then starts uvicorn's graceful shutdown (stop
accepting, let in-flight requests finish for `timeout_graceful_shutdown`
seconds, cancel the rest, run the app's shutdown). A second signal skips the
wait: what still runs is aborted at once, and answered so, as when the wait
is over. Only a third quits without answering (uvicorn's force_exit, which
would otherwise come with the second: every handler then cut, a stream
without its end, a plain-text 500 for the rest). Unlike uvicorn's default,
the signal is not raised again afterwards, which would end the process
before its own cleanup and message: `first_signal` tells the caller which
one stopped it (serve's exit status: 0 for SIGTERM, 130 for Ctrl-C).

When the timeout has passed, the app is told to abort what still runs
(`on_grace_over`) and its handlers get ABORT_ANSWER_S more to answer so
(finish_reason "abort"): a handler that uvicorn cancels can only cut its
stream, or leave uvicorn to answer a plain-text 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from types import FrameType
from typing import Callable, Iterator

import uvicorn

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# How long the handlers of aborted requests have to answer before uvicorn
# cancels them: the engine ends an aborted request at its next step.
ABORT_ANSWER_S = 5.0


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None],
                 on_grace_over: Callable[[], None]):
        """`config.timeout_graceful_shutdown`: how long in-flight requests
        may run after the signal (None: as long as they take); then
        `on_grace_over()` runs on the event loop, and the config's timeout
        is raised by ABORT_ANSWER_S: only then does uvicorn cancel them."""
        self._grace = config.timeout_graceful_shutdown
        if self._grace is not None:
            config.timeout_graceful_shutdown = self._grace + ABORT_ANSWER_S
        super().__init__(config)
        self._on_signal = on_signal
        self._on_grace_over = on_grace_over
        self._signals = 0
        self.first_signal: int | None = None  # the signal that began the shutdown
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._grace is None:
            await super().shutdown(sockets)
            return
        grace_over = asyncio.get_running_loop().call_later(self._grace, self._on_grace_over)
        try:
            await super().shutdown(sockets)
        finally:
            grace_over.cancel()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_signal()
        self._signals += 1
        if self.first_signal is None:
            self.first_signal = sig
        if self._signals == 2 and self._loop is not None:
            self._loop.call_soon_threadsafe(self._on_grace_over)
        elif self._signals > 2:
            self.force_exit = True
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
