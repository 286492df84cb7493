"""The broker's event loop: one thread waits (epoll) on every side-socket
connection and every client's pidfd, and a fixed pool of worker threads runs
what became ready.

Why: a thread per session (as a gRPC server stream or a blocking reader per
connection holds) lets clients exhaust the broker by merely connecting, so an
idle session must cost a few fds and no thread (issue 17, finding 5). Threads
are started here once, at construction: serving a new connection never
starts one, so it cannot fail for want of one.

Callbacks registered with every_second() run on a worker about once a
second (the poller's tick): sweeps, with no thread of their own.

Each fd is watched one-shot (EPOLLONESHOT): when it fires, its callback runs
on a worker and the fd stays disarmed until the callback calls rearm(), so
one connection's datagrams are handled one at a time and in order, and a
client flooding one connection occupies at most one worker.

Invariants:
  * _callbacks holds every watched fd with its callback; unwatch() removes it
    before the caller closes the fd;
  * a callback may run for an fd that was unwatched, closed and reused after
    epoll reported it (the report races the unwatch): callbacks therefore
    read without blocking and treat "nothing to read" as a spurious wakeup;
  * after close(), no callback starts and every thread here has ended.

Threading: watch, rearm and unwatch may be called from any thread; callbacks
run on the workers and must not raise (one that does is logged).
"""

from __future__ import annotations

import logging
import os
import queue
import select
import threading
import time

log = logging.getLogger("vtm.broker")

_ONESHOT = select.EPOLLIN | select.EPOLLONESHOT
_ONESHOT_WRITABLE = select.EPOLLOUT | select.EPOLLONESHOT
TICK_S = 1.0


def _tick(callback) -> None:
    callback()


class Reactor:
    def __init__(self, workers: int, name: str = "vtmd-io"):
        if workers < 1:
            raise ValueError("a reactor needs at least one worker")
        self._epoll = select.epoll()
        self._mu = threading.Lock()
        self._callbacks: dict[int, object] = {}
        self._ticks: list = []  # every_second's callbacks
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._stopping = False
        self._threads = []  # those started
        try:
            for i in range(-1, workers):
                thread = threading.Thread(target=self._poll if i < 0 else self._work,
                                          name=f"{name}-{'poll' if i < 0 else i}", daemon=True)
                thread.start()
                self._threads.append(thread)
        except BaseException:
            self.close()
            raise

    def watch(self, fd: int, callback) -> None:
        """Calls callback(fd) on a worker once `fd` is readable, then again
        after each rearm(fd) (or, after rearm_writable(fd), once writable)."""
        with self._mu:
            if self._stopping:
                raise OSError("the broker is stopping")
            self._callbacks[fd] = callback
            try:
                self._epoll.register(fd, _ONESHOT)
            except OSError:
                del self._callbacks[fd]
                raise

    def rearm(self, fd: int) -> None:
        with self._mu:
            if fd in self._callbacks:
                self._epoll.modify(fd, _ONESHOT)

    def rearm_writable(self, fd: int) -> None:
        """As rearm(), but the callback runs once `fd` can be written to
        (a connection whose replies wait for room)."""
        with self._mu:
            if fd in self._callbacks:
                self._epoll.modify(fd, _ONESHOT_WRITABLE)

    def every_second(self, callback) -> None:
        """Calls callback() on a worker about every TICK_S, until stop_ticking."""
        with self._mu:
            self._ticks.append(callback)

    def stop_ticking(self, callback) -> None:
        with self._mu:
            if callback in self._ticks:
                self._ticks.remove(callback)

    def unwatch(self, fd: int) -> None:
        with self._mu:
            if self._callbacks.pop(fd, None) is not None:
                try:
                    self._epoll.unregister(fd)
                except OSError:
                    pass  # already closed: epoll dropped it itself

    def _poll(self) -> None:
        next_tick = time.monotonic() + TICK_S
        while True:
            try:
                events = self._epoll.poll(max(0.0, next_tick - time.monotonic()))
            except InterruptedError:
                continue
            except OSError:
                return  # closed under us
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + TICK_S
                with self._mu:
                    ticks = list(self._ticks)
                for tick in ticks:
                    self._ready.put((_tick, tick))
            for fd, _ in events:
                if fd == self._wake_r:
                    return
                with self._mu:
                    callback = self._callbacks.get(fd)
                if callback is not None:
                    self._ready.put((callback, fd))

    def _work(self) -> None:
        while True:
            item = self._ready.get()
            if item is None:
                return
            callback, fd = item
            try:
                callback(fd)
            except Exception:  # noqa: BLE001 - one connection's bug must not stop the others
                log.exception("a broker callback failed")

    def close(self) -> None:
        """Stops the poller and the workers (after the callbacks running now)."""
        with self._mu:
            if self._stopping:
                return
            self._stopping = True
            self._callbacks.clear()
        os.write(self._wake_w, b"x")
        for _ in self._threads:
            self._ready.put(None)  # one per worker (the poller leaves on the wake-up; its None is never read)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=10)
        self._epoll.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
