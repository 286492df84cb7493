"""`flexinfer serve`: the server's command-line flags and its main loop
(uvicorn, one process, one event loop; the engine runs in its own thread).

Signals: SIGTERM or Ctrl-C starts a graceful shutdown (graceful.py): new
requests get 503 and the listening socket closes, in-flight requests may
finish for --shutdown-timeout seconds and are then aborted (they answer
with finish_reason "abort"), the LLM is closed, and the process exits with
status 0 after SIGTERM, 130 after Ctrl-C (SIGINT), as every flexinfer
command does: the first signal decides.

This module imports FastAPI and uvicorn only inside `serve`, so the other
`flexinfer` commands do not pay for them.
"""

from __future__ import annotations

import argparse
import errno
import logging
import signal
import socket
import sys
import threading
from typing import Callable

from flexinfer.cli_log import debug_requested
from flexinfer.errors import FlexInferError
from flexinfer.llm import LLM
from flexinfer.server.config import ServerLimits

_LIMITS = ServerLimits()
# The exit statuses serve returns besides 0 (cli.py's, for the same causes).
_EXIT_BAD_INPUT, _EXIT_INTERRUPTED = 2, 130


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: %(default)s)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: the --model value)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests may take to finish before they are "
                        "cancelled (default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="server log verbosity (default: %(default)s)")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--max-seqs-per-request", type=int, default=_LIMITS.max_seqs_per_request,
                   help="most sequences (prompts x n) one request may ask for; more is a 400")
    p.add_argument("--max-queued-seqs", type=int, default=_LIMITS.max_queued_seqs,
                   help="most sequences admitted and not yet finished, over all requests; a request that "
                        "would pass it gets a 429 (retry later), one that asks for more than it a 400")
    p.add_argument("--max-body-bytes", type=int, default=_LIMITS.max_body_bytes,
                   help="largest request body; a larger one gets a 413 before it is read")
    p.add_argument("--max-buffered-body-bytes", type=int, default=_LIMITS.max_buffered_body_bytes,
                   help="request bodies held at once, over all requests (received or waiting to be parsed); "
                        "a body that would pass it gets a 503 with Retry-After; at least --max-body-bytes")


def serve(args: argparse.Namespace, load: Callable[[threading.Event], LLM], early_warning: str | None = None) -> int:
    """Serve until SIGTERM / Ctrl-C. `load(stop)` builds the LLM (in a thread,
    while the server already answers 503), ending early once `stop` is set:
    a signal while it loads stops it at its next tensor. Returns the exit
    status: 0, 130 when Ctrl-C stopped it, or 2 when the model failed to load.
    `early_warning`: the capacity_warning, where the sizes alone tell it
    before the load (an in-process pool): said then, not again once the
    model is loaded."""
    try:
        import uvicorn

        from flexinfer.server.app import create_app
        from flexinfer.server.graceful import GracefulServer
    except ImportError as exc:
        # Not `pip install 'vtm[serve]'`: "vtm" on PyPI is another project's.
        raise FlexInferError(f"flexinfer serve needs the serve extra ({exc}): in the repository's folder, "
                             "pip install '.[serve]' (or make, which installs every extra)") from None

    if args.shutdown_timeout < 0:
        raise FlexInferError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    for flag in ("max_seqs_per_request", "max_queued_seqs", "max_body_bytes", "max_buffered_body_bytes"):
        if getattr(args, flag) < 1:
            raise FlexInferError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.max_buffered_body_bytes < args.max_body_bytes:
        raise FlexInferError(f"--max-buffered-body-bytes ({args.max_buffered_body_bytes}) must be at least "
                             f"--max-body-bytes ({args.max_body_bytes}), or the largest body could never be taken")
    limits = ServerLimits(max_seqs_per_request=args.max_seqs_per_request, max_queued_seqs=args.max_queued_seqs,
                          max_body_bytes=args.max_body_bytes, max_buffered_body_bytes=args.max_buffered_body_bytes)
    # Bound before the model loads: a port in use fails at once, with a clear message.
    sock = _listen(args.host, args.port)
    name = args.served_model_name or args.model
    log_level = "debug" if debug_requested(args.verbose) else args.log_level  # flexinfer --verbose, as every command
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")

    host, port = sock.getsockname()[:2]
    url = f"http://{_url_host(host)}:{port}"

    def on_load_error(exc: BaseException) -> None:  # on the event loop, after `server` exists
        server.should_exit = True

    def on_ready(llm: LLM) -> None:
        for line in ready_lines(llm, name, url, warn=early_warning is None):
            print(line, file=sys.stderr, flush=True)

    stop_loading = threading.Event()
    app = create_app(lambda: load(stop_loading), name, on_load_error, limits, on_ready, stop_loading)
    config = uvicorn.Config(app, log_level=log_level, access_log=args.access_log, lifespan="on",
                            timeout_graceful_shutdown=args.shutdown_timeout)
    server = GracefulServer(config, app.state.server.begin_shutdown, app.state.server.abort_in_flight)
    print(f"flexinfer: serving {name} on {url} (model loading; /health answers 200 once ready)",
          file=sys.stderr, flush=True)
    if early_warning is not None:
        print(early_warning, file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    error = app.state.server.load_error
    if error is not None:
        print(f"flexinfer: error: the model failed to load: {error}", file=sys.stderr)
        return _EXIT_BAD_INPUT
    return _EXIT_INTERRUPTED if server.first_signal == signal.SIGINT else 0


def ready_lines(llm: LLM, name: str, url: str, warn: bool = True) -> list[str]:
    """What `serve` says on stderr once the model is loaded: where it serves,
    the context length and the KV capacity in tokens; and, with `warn`, the
    capacity_warning (unless it was said before the load)."""
    kv = llm.kv_budget
    capacity = kv.max_tokens
    lines = [f"flexinfer: ready: serving {name} on {url}, context length {llm.max_model_len} tokens, "
             f"KV capacity {capacity} tokens ({kv.chunks * kv.chunk_bytes / (1 << 20):g} MiB)"]
    warning = capacity_warning(capacity, llm.max_model_len) if warn else None
    return lines + ([warning] if warning else [])


def capacity_warning(capacity_tokens: int, max_model_len: int) -> str | None:
    """The warning for a pool that cannot hold one request of the full
    context length (longer requests are refused with a 400, never admitted
    to fail later), or None."""
    if capacity_tokens >= max_model_len:
        return None
    return (f"flexinfer: warning: the KV pool holds {capacity_tokens} tokens, less than one request of "
            f"max_model_len {max_model_len}: requests needing more are refused")


def _listen(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise FlexInferError(f"--port must be in [0, 65535], got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise FlexInferError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError as exc:
        sock.close()
        hint = " (another server has it: --port 0 picks a free one)" if exc.errno == errno.EADDRINUSE else ""
        raise FlexInferError(f"cannot listen on {host}:{port}: {exc.strerror}{hint}") from None
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host

