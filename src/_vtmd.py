"""vtmd's entry point: the vtmd command (pyproject.toml) and python -m vtm.broker.

Its first statements catch SIGTERM and SIGINT; until then the default action
ends vtmd with status 143 (SIGINT: a traceback, status 130), where vtmd
stopped later says "vtmd: stopped" and exits 0 on SIGTERM, 130 on SIGINT
(Ctrl-C, as every vtm and flexinfer command; docs/broker.md): the first
signal decides. It is a module of its own, outside the vtm package, because
importing anything of vtm first runs `import vtm` (its C++ extension) before
a line of ours, and the broker's modules (grpc and the rest) take ~0.1 s more. Importing this
module is starting vtmd: nothing else imports it.

What remains uncovered, because no Python code runs before it: the
interpreter's own start, from exec to here (10-20 ms on the development VM,
more on a cold page cache); and under python -m vtm.broker, runpy importing
the vtm package before vtm/broker/__main__.py imports this (~5 ms more).

A signal caught before main() is noted and honoured by it: the note needs
nothing that is not loaded yet (`_signal` is loaded at the interpreter's
start; `signal` would import enum, and threading takes a while too).
"""

import _signal

_caught = []  # the signals received, in order: those before main() took over, then its own
# 128 + SIGINT: what a shell reports for a command that Ctrl-C ended.
_EXIT_INTERRUPTED = 130


def _note(signum, _frame):
    _caught.append(signum)


_signal.signal(_signal.SIGTERM, _note)
_signal.signal(_signal.SIGINT, _note)


def main(argv=None) -> int:
    import threading

    stop = threading.Event()

    def on_signal(signum, _frame):
        _caught.append(signum)
        stop.set()

    for sig in (_signal.SIGTERM, _signal.SIGINT):
        _signal.signal(sig, on_signal)
    if _caught:  # looked at after the new handlers: a signal in between sets `stop` itself
        stop.set()
    from vtm.broker import server

    status = server.main(argv, stop)
    return _EXIT_INTERRUPTED if status == 0 and _caught[:1] == [_signal.SIGINT] else status
