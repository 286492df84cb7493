"""GracefulServer: uvicorn's Server with the signal handling `flexinfer
serve` needs.

SIGTERM or Ctrl-C first tells the app it is shutting down (so anything that
still arrives gets a 503), then starts uvicorn's graceful shutdown (stop
accepting, let in-flight requests finish for `timeout_graceful_shutdown`
seconds, cancel the rest, run the app's shutdown). A second Ctrl-C skips the
wait. Unlike uvicorn's default, the signal is not raised again afterwards,
which would end the process with the signal's status instead of 0.
"""

from __future__ import annotations

import contextlib
import signal
from types import FrameType
from typing import Callable, Iterator

import uvicorn

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]):
        super().__init__(config)
        self._on_signal = on_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_signal()
        if self.should_exit and sig == signal.SIGINT:
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
