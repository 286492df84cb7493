"""OpenAI-style errors: every failure the server answers is a JSON body
{"error": {"message", "type", "param", "code"}} with its HTTP status.

APIError is what handlers raise; `install_error_handlers` makes FastAPI
answer it, unknown routes, and any bug (500, without a traceback in the
body) in that shape. Request bodies are parsed and validated by the routes
themselves (limits.py: 400 with pydantic's errors in one line, as the
OpenAI API answers), never by FastAPI, whose validation errors would be
422s. A 500 keeps the connection open: only a response that had already
begun when the bug struck ends its connection.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flexinfer.server.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger("flexinfer.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.info, self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def model_not_found(asked: str, served: str, param: str | None = None) -> APIError:
    return APIError(404, f"The model `{asked}` does not exist (this server serves `{served}`).", "not_found_error",
                    param, "model_not_found")


def unavailable(message: str) -> APIError:
    return APIError(503, message, "service_unavailable", None, "service_unavailable")


def too_busy(message: str) -> APIError:
    """429, as OpenAI's rate limits answer (its clients retry it after a pause)."""
    return APIError(429, message, "requests", None, "rate_limit_exceeded")


def error_response(status: int, info: ErrorInfo, headers: dict[str, str] | None = None) -> JSONResponse:
    # A message may quote what the client sent (the model it asked for), and
    # JSON can carry a lone surrogate ("\ud800") that UTF-8 cannot: quoted
    # as is, rendering the error would fail, and the client get a 500.
    info = info.model_copy(update={key: value.encode("utf-8", "backslashreplace").decode("utf-8")
                                   for key, value in info.model_dump().items() if isinstance(value, str)})
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, ErrorInfo(message=str(exc.detail), type=kind))

    # Not `exception_handler(Exception)`: Starlette raises the exception again
    # after that handler answers, and uvicorn then closes the connection.
    app.add_middleware(InternalErrors)


class InternalErrors:
    """ASGI middleware: a bug in a handler is answered 500 and the connection kept."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception as exc:
            if started:  # the status line is sent: nothing else can be said on this connection
                raise
            log.exception("unhandled error serving %s", scope.get("path"))
            response = error_response(500, ErrorInfo(message=f"internal error: {type(exc).__name__}",
                                                     type="internal_server_error"))
            await response(scope, receive, send)
