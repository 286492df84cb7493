"""vtmd's entry point (the vtmd command, python -m vtm.broker).

SIGTERM and SIGINT are caught before the broker's modules load: loading
grpc and the rest takes ~0.1 s, in which the default action ended a vtmd
stopped as it started with status 143 (SIGINT: a traceback), where a later
one stops with status 0. The interpreter's own start and `import vtm` (the
package, which the entry point's import runs first) still come before this.
"""

from __future__ import annotations

import signal
import threading


def main(argv=None) -> int:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    from vtm.broker import server

    return server.main(argv, stop)
