"""How the `flexinfer` command shows log records: one line each,
`flexinfer: warning: ...`, tracebacks only when asked for.

The engine and the vtm broker client log what a user should know (a broker
gone away, a step that failed) on the `flexinfer` and `vtm` loggers, many with
log.exception. Unconfigured, Python prints each message and its traceback
under it: a broker going away printed 63 lines and 3 tracebacks before the
command's own one-line error. While a command runs, `command_logging` gives
those loggers one handler that writes each record as one line (its exception's
message appended), at level warning; `--verbose` or FLEXINFER_LOG=debug shows
debug records and the tracebacks, FLEXINFER_LOG=info|warning|error sets the
level alone. `flexinfer serve` keeps its own logging (server/main.py) and
asks `debug_requested` whether to log at debug level.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Iterator

from vtm.log_lines import OneLineFormatter

ENV = "FLEXINFER_LOG"
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_LOGGERS = ("flexinfer", "vtm")


def debug_requested(verbose: bool) -> bool:
    """--verbose, or FLEXINFER_LOG=debug."""
    return verbose or os.environ.get(ENV, "").strip().lower() == "debug"


@contextlib.contextmanager
def command_logging(verbose: bool) -> Iterator[None]:
    """The flexinfer and vtm loggers write one-line records to stderr while
    the block runs, and are left as they were after it (main() may run many
    times in one process: the tests, a caller's own program)."""
    debug = debug_requested(verbose)
    asked = os.environ.get(ENV, "").strip().lower()
    level = logging.DEBUG if debug else _LEVELS.get(asked, logging.WARNING)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter("flexinfer", tracebacks=debug))
    loggers = [logging.getLogger(name) for name in _LOGGERS]
    saved = [(logger.level, logger.propagate) for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False  # else a handler on the root logger prints each record again
    try:
        if asked and asked not in _LEVELS:
            loggers[0].warning("%s=%s is not one of %s: using warning", ENV, asked, ", ".join(_LEVELS))
        yield
    finally:
        for logger, (old_level, old_propagate) in zip(loggers, saved):
            logger.removeHandler(handler)
            logger.setLevel(old_level)
            logger.propagate = old_propagate
