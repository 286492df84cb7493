"""What the server refuses to take on, so that no request (careless or
hostile) can stall the event loop or queue unbounded work: the size of a
request body, the sequences one request may ask for, and the sequences
queued in the engine at once. The limits' values are ServerLimits
(config.py).

- BodyLimit (ASGI middleware): a body over `max_body_bytes` is answered 413
  from its Content-Length before a byte of it is read, or as soon as a
  body sent without one (chunked) grows past the limit; the connection is
  then closed, since the rest of the body is never read.
- BodyReader: reads a body and parses it (JSON, then pydantic), on a
  worker thread when it is large (the tokenizer and this are the only
  per-request work that grows with the body), within a memory bound that
  does not grow with the number of clients: the bodies held at once stay
  within `max_buffered_body_bytes` (one that would pass it gets a 503 with
  Retry-After before more of it is read), and large bodies are parsed one
  at a time (JSON token ids take about eight times their bytes as Python
  lists, json.loads' and pydantic's copy). A route may check the decoded
  JSON before it is validated (a token-id prompt too long for the model is
  refused there, before pydantic copies it).
- Admission: a count of the sequences (prompts x n) admitted and not yet
  finished. Reserved on the event loop before anything is submitted,
  released on the engine thread as each request ends (every request ends:
  see engine_loop.py), so the count never drifts and a refused request
  changes nothing.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any, Callable, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flexinfer.server.errors import APIError, bad_request
from flexinfer.server.validation import validation_message

Body = TypeVar("Body", bound=BaseModel)

# Bodies larger than this are parsed on a worker thread, one at a time.
# json.loads and pydantic hold the GIL, so this only lets the loop in
# between (two parses at once would take as long as one after the other);
# the body limit is what bounds the time (about 10 ms a MB on the
# development VM).
_PARSE_INLINE_BYTES = 256 << 10


class Admission:
    """Sequences admitted and not yet finished; thread-safe (released on the engine thread)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._queued = 0
        self._mu = threading.Lock()

    @property
    def queued(self) -> int:
        return self._queued

    def reserve(self, count: int) -> bool:
        """Take `count` places, or none (False) if that would pass the limit."""
        if count < 0:  # it would give places to others, and its release fail on the engine thread
            raise ValueError(f"cannot reserve {count} places")
        with self._mu:
            if self._queued + count > self.limit:
                return False
            self._queued += count
            return True

    def release(self, count: int) -> None:
        with self._mu:
            self._queued -= count
            assert self._queued >= 0, "released more sequences than were admitted"


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server accepts ({limit} bytes, "
                         f"--max-body-bytes)", "invalid_request_error", None, "request_too_large")


class BodyLimit:
    """ASGI middleware: refuse bodies over `limit` bytes (413, then close)."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            if not length.isdigit():
                response = bad_request("the Content-Length header is not a number").response()
            else:
                response = too_large(self.limit).response()
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        received = 0
        limit = self.limit

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # Raised into whoever reads the body: the route's
                    # error handler answers it (errors.py).
                    raise too_large(limit)
            return message

        closing_send = send
        if length is None:
            async def closing_send(message: Message) -> None:
                # A refused streamed body is never read to its end: the
                # connection cannot carry another request.
                if message["type"] == "http.response.start" and message["status"] == 413:
                    message = dict(message, headers=[*message.get("headers", []), (b"connection", b"close")])
                await send(message)

        await self.app(scope, limited_receive, closing_send)


class BodyReader:
    """Reads and parses the bodies of one server's requests. Invariant:
    `held` is the sum of what the bodies being received or parsed reserved
    (their Content-Length, or the bytes received so far of one sent without
    it), at most `budget_bytes`; changed on the event loop only."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.held = 0
        self._parsing = asyncio.Semaphore(1)

    async def parse(self, request, model: type[Body], check: Callable[[Any], None] | None = None) -> Body:
        """The request's JSON body as `model`; a 400 (validation.py says why)
        for what is not. `check(data)` sees the decoded JSON before it is
        validated (on the worker thread of a large body) and may refuse it
        (raise an APIError)."""
        length = request.headers.get("content-length")
        reserved = 0
        try:
            if length is not None:  # a number within max_body_bytes (BodyLimit)
                reserved = self._reserve(int(length))
            # Not request.body(): the Request would keep the bytes for as long
            # as its handler runs (a stream: the whole generation).
            chunks = []
            async for chunk in request.stream():
                if length is None:
                    reserved += self._reserve(len(chunk))
                chunks.append(chunk)
            raw = b"".join(chunks)
            del chunks
            if len(raw) <= _PARSE_INLINE_BYTES:
                return _parse(raw, model, check)
            async with self._parsing:
                return await asyncio.to_thread(_parse, raw, model, check)
        except ClientDisconnect:  # the client left mid-body: nobody hears the answer, and it is no server bug
            raise APIError(499, "the client closed the connection before its body arrived",
                           code="client_closed") from None
        finally:
            self.held -= reserved

    def _reserve(self, count: int) -> int:
        if self.held + count > self.budget_bytes:
            # The connection stays open: uvicorn drops the rest of the body
            # unread once the answer is sent, so a client that sends all of
            # its body before it reads (most do) gets the 503, not a reset.
            raise APIError(503, f"the server holds as many request bodies as it takes at once ({self.budget_bytes} "
                                f"bytes, --max-buffered-body-bytes); retry later", "service_unavailable", None,
                           "service_unavailable", headers={"retry-after": "1"})
        self.held += count
        return count


def _parse(raw: bytes, model: type[Body], check: Callable[[Any], None] | None) -> Body:
    try:
        data = json.loads(raw)
    except ValueError as exc:  # also bytes that are not UTF-8
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    except RecursionError:  # the parser recurses once per level of nesting
        raise bad_request("the body is not valid JSON: it is nested too deeply") from None
    if check is not None:
        check(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise bad_request(*validation_message(model, exc.errors())) from None

