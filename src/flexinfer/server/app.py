"""The FastAPI application: routes, and the server's lifetime around one LLM.

Lifetime: the app starts answering at once while the model loads in a
thread (requests and /health get 503 until it is ready, so a client or a
load balancer can tell "loading" from "down"); SIGTERM (see main.py) marks
it shutting down (503 again, for anything that still arrives), stops a load
still in progress at its next tensor (`stop_loading`), while uvicorn
lets in-flight requests finish for the shutdown timeout, then aborts them
(abort_in_flight: each still answers, with finish_reason "abort"); at the
end the LLM is closed, which cancels whatever still runs.

Nothing here waits on the engine or the vtm broker on the event loop:
bodies are parsed (when large) and requests submitted on worker threads,
/metrics reads the engine's figures on a thread of its own with a timeout
(metrics.py), and /health reads state only (`LLM.problem`: the engine
thread stopped, the broker lost), so it answers at once whatever the engine
is doing and says 503 whenever the engine cannot serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from flexinfer.errors import EngineClosed
from flexinfer.llm import LLM
from flexinfer.server.config import ServerLimits
from flexinfer.server.errors import install_error_handlers, model_not_found, unavailable
from flexinfer.server.limits import BodyLimit, BodyReader
from flexinfer.server.metrics import ServerMetrics
from flexinfer.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from flexinfer.server.serving import Serving

log = logging.getLogger("flexinfer.server")

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerState:
    """Phases: "loading" -> "ready" -> "shutting_down" (or "loading" ->
    "failed" when the model cannot be loaded). Invariant: `serving` is set
    exactly when the LLM loaded, and stays set until the LLM is closed.
    `stop_loading`, when given, is the event `load()` ends early on: set at
    the shutdown's start, so that a server stopped while it loads need not
    wait for the whole model (a load it stopped is no failure)."""

    def __init__(self, load: Callable[[], LLM], model_name: str,
                 on_load_error: Callable[[BaseException], None] | None, limits: ServerLimits,
                 on_ready: Callable[[LLM], None] | None, stop_loading: threading.Event | None = None):
        self.load = load
        self.stop_loading = stop_loading
        self.model_name = model_name
        self.on_load_error = on_load_error
        self.on_ready = on_ready
        self.limits = limits
        self.phase = "loading"
        self.load_error: BaseException | None = None
        self.serving: Serving | None = None
        self.created = int(time.time())
        timeout = limits.metrics_timeout_s
        self.metrics = ServerMetrics(lambda: self.serving.llm.stats(timeout) if self.serving is not None else None,
                                     timeout)

    def begin_shutdown(self) -> None:
        if self.stop_loading is not None:
            self.stop_loading.set()
        if self.phase in ("loading", "ready"):
            self.phase = "shutting_down"
        if self.serving is not None:
            self.serving.shutting_down = True

    def abort_in_flight(self) -> None:
        """The shutdown timeout has passed: end the requests still running
        with finish_reason "abort" (Serving.abort_all)."""
        if self.serving is not None:
            self.serving.abort_all()

    def ready(self) -> Serving:
        """The serving endpoints, or the 503 that says why there are none."""
        if self.phase == "ready" and self.serving is not None:
            return self.serving
        if self.phase == "loading":
            raise unavailable("the model is still loading")
        if self.phase == "failed":
            raise unavailable(f"the model failed to load: {self.load_error}")
        raise unavailable("the server is shutting down")

    async def run_load(self) -> None:
        try:
            llm = await asyncio.to_thread(self.load)
        except BaseException as exc:  # reported, and the server told to stop
            if isinstance(exc, EngineClosed) and self.stop_loading is not None and self.stop_loading.is_set():
                log.info("the shutdown stopped the model's load")  # asked for: no failure
                return
            self.phase, self.load_error = "failed", exc
            log.error("the model failed to load: %s: %s", type(exc).__name__, exc)
            if self.on_load_error is not None:
                self.on_load_error(exc)
            return
        self.serving = Serving(llm, self.model_name, self.metrics, self.limits)
        if self.phase == "loading":
            self.phase = "ready"
            log.info("model %s loaded: ready", self.model_name)
            if self.on_ready is not None:
                self.on_ready(llm)

    async def close(self, loading: asyncio.Task) -> None:
        self.begin_shutdown()
        # A load in progress ends at its next tensor (stop_loading, set above) or,
        # without the event, when it is done: then what it made is closed.
        await loading
        self.metrics.close()
        if self.serving is not None:
            await asyncio.to_thread(self.serving.llm.close)


def create_app(load: Callable[[], LLM], model_name: str,
               on_load_error: Callable[[BaseException], None] | None = None,
               limits: ServerLimits | None = None, on_ready: Callable[[LLM], None] | None = None,
               stop_loading: threading.Event | None = None) -> FastAPI:
    """An app serving the LLM that `load()` returns (called once, in a thread,
    at startup). `on_load_error(exc)` is told when it fails, `on_ready(llm)`
    (on the event loop) when it is loaded and served; `stop_loading`, the
    event load() stops early on, is set when the shutdown begins."""
    limits = limits or ServerLimits()
    state = ServerState(load, model_name, on_load_error, limits, on_ready, stop_loading)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = asyncio.create_task(state.run_load())
        try:
            yield
        finally:
            await state.close(loading)

    app = FastAPI(title="FlexInfer", lifespan=lifespan)
    app.state.server = state
    app.add_middleware(BodyLimit, limit=limits.max_body_bytes)
    bodies = BodyReader(limits.max_buffered_body_bytes)
    install_error_handlers(app)  # outermost: its middleware also answers a bug in the one above

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        problem = state.ready().llm.problem
        if problem is not None:
            raise unavailable(problem)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        await state.metrics.refresh()
        return Response(state.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> ModelCard:
        model = model.removesuffix("/")  # a name may hold slashes (org/model); one at the end is the route's
        if not model:
            raise StarletteHTTPException(404)
        if model != model_name:
            raise model_not_found(model, model_name)
        return card()

    def card() -> ModelCard:
        return ModelCard(id=model_name, created=state.created, max_model_len=state.ready().llm.max_model_len)

    # The bodies are read here rather than declared as parameters, so that
    # FastAPI does not parse them on the event loop (limits.BodyReader).
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        serving = state.ready()
        body = await bodies.parse(request, CompletionRequest, serving.refuse_long_token_prompts)
        return await serving.completions(request, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        serving = state.ready()
        return await serving.chat(request, await bodies.parse(request, ChatCompletionRequest))

    return app

