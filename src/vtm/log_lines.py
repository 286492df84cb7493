"""How the commands show log records: one line each, `PROG: LEVEL: message`,
the way they print their own errors (`vtmd: error: ...`), the exception's
message appended, its traceback only when asked for.

Unconfigured, Python's last-resort handler prints a record's bare message, so
a log line could not be told from another program's. vtmd (server.py) and
flexinfer (flexinfer/cli_log.py) put this formatter on their loggers' handler.
"""

from __future__ import annotations

import logging


class OneLineFormatter(logging.Formatter):
    """`PROG: LEVEL: message[: the exception's message]` on one line; with
    `tracebacks`, the traceback follows on the lines below."""

    def __init__(self, prog: str, tracebacks: bool):
        super().__init__()
        self.prog = prog
        self.tracebacks = tracebacks

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        error = record.exc_info[1] if record.exc_info else None
        if error is not None:
            message += f": {error}" if str(error) else f": {type(error).__name__}"
        line = f"{self.prog}: {record.levelname.lower()}: " + " ".join(message.split("\n"))
        if self.tracebacks and error is not None:
            line += "\n" + self.formatException(record.exc_info).rstrip("\n")
        return line
