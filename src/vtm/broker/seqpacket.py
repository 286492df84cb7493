"""A SOCK_SEQPACKET Unix-socket server on the broker's Reactor: what the
side sockets (fd_channel, step_channel) share. A subclass answers one
datagram at a time in `_datagram(conn, data)`; the peer's credentials come
from the kernel (SO_PEERCRED, read at accept), never from the peer.

No thread per connection: the reactor's poller reports a readable
connection and one of its fixed workers reads one datagram and answers it
(reactor.py), so idle connections cost an fd each, and neither an accept
that fails nor a connection that misbehaves stops the others.

Invariants:
  * the socket file is 0600 (the broker's folder is 0700 too);
  * _conns holds every open connection, each watched by the reactor until
    it is dropped (unwatched, then closed, exactly once);
  * at most max_connections are open: at the cap, connections silent
    since their accept for SILENT_S make room (closed), else one more is
    accepted and closed: a peer that connects and says nothing cannot
    lock the others out;
  * a reply that cannot be sent within SEND_TIMEOUT_S (a peer that does not
    read) drops the connection instead of holding a worker;
  * `close()` stops accepting, ends every connection and removes the file.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import threading
import time

log = logging.getLogger("vtm.broker")

SEND_TIMEOUT_S = 5
SILENT_S = 10.0  # a connection that has sent nothing for this long gives way at the cap (as a Hello's attach)
_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux >= 6.5
_ACCEPT_BATCH = 64
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of `conn`, as the
    kernel saw it connect: the pid is in this process's PID namespace."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def peer_pidfd(conn: socket.socket, pid: int) -> int:
    """A pidfd (owned by the caller) of the process at the other end of
    `conn`: from the socket itself where the kernel offers it (no window in
    which the pid could be reused), else pidfd_open(pid)."""
    try:
        return conn.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
    except OSError:
        return os.pidfd_open(pid)


class Connection:
    """One accepted connection and what the server binds to it."""

    __slots__ = ("sock", "fd", "pid", "uid", "session", "anchor", "busy", "send_lock", "dropped", "accepted_at",
                 "heard")

    def __init__(self, sock: socket.socket, pid: int, uid: int):
        self.sock = sock
        self.fd = sock.fileno()
        self.pid = pid
        self.uid = uid
        self.session = None  # the session it authenticated as
        self.anchor = False  # the session's liveness channel (fd_channel)
        self.busy = threading.Lock()  # held while a worker reads and answers a datagram
        self.send_lock = threading.Lock()  # replies and notices never interleave
        self.dropped = False
        self.accepted_at = time.monotonic()
        self.heard = False  # whether it has sent a datagram

    def post(self, data: bytes) -> bool:
        """Sends without waiting (a notice): False when the peer's buffer is
        full or the connection is gone."""
        with self.send_lock:
            try:
                self.sock.send(data, socket.MSG_DONTWAIT)
                return True
            except OSError:
                return False


class SeqpacketServer:
    def __init__(self, path: str, reactor, max_connections: int, max_datagram: int):
        self.path = path
        self._reactor = reactor
        self._max_connections = max_connections
        self._max_datagram = max_datagram
        self._mu = threading.Lock()
        self._conns: dict[int, Connection] = {}
        self._stopping = False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._sock.bind(path)
            os.chmod(path, 0o600)
            self._sock.listen(128)
            self._sock.setblocking(False)
            reactor.watch(self._sock.fileno(), self._on_listener)
        except BaseException:
            self._sock.close()
            raise

    # -- for subclasses ---------------------------------------------------

    def _datagram(self, conn: Connection, data: bytes) -> bool:
        """Answers one datagram; False closes the connection."""
        raise NotImplementedError

    def _closed(self, conn: Connection) -> None:
        """The connection is gone (the peer closed it, or it was dropped)."""

    def send(self, conn: Connection, data: bytes, fds=()) -> None:
        with conn.send_lock:
            if fds:
                socket.send_fds(conn.sock, [data], fds)
            else:
                conn.sock.send(data)

    # -- the reactor's callbacks ---------------------------------------------

    def _on_listener(self, fd: int) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, _ = self._sock.accept()
            except BlockingIOError:
                break
            except OSError as exc:
                if self._stopping:
                    return
                log.warning("accepting on %s failed: %s", self.path, exc)
                if exc.errno in _OUT_OF_FDS:
                    time.sleep(0.1)  # let connections close before the next try instead of spinning
                break
            self._adopt(sock)
        if not self._stopping:
            self._reactor.rearm(fd)

    def _adopt(self, sock: socket.socket) -> None:
        try:
            sock.setblocking(True)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", SEND_TIMEOUT_S, 0))
            pid, uid, _ = peer_credentials(sock)
            conn = Connection(sock, pid, uid)
            with self._mu:
                at_cap = len(self._conns) >= self._max_connections
            if at_cap:
                self._drop_silent()
            with self._mu:
                if self._stopping or len(self._conns) >= self._max_connections:
                    if not self._stopping:
                        log.warning("%s: %d connections open, refusing one more", self.path, len(self._conns))
                    sock.close()
                    return
                self._conns[conn.fd] = conn
            self._reactor.watch(conn.fd, self._on_readable)
        except OSError as exc:
            log.warning("a connection to %s failed at once: %s", self.path, exc)
            with self._mu:
                self._conns.pop(sock.fileno(), None)
            sock.close()

    def _drop_silent(self) -> None:
        """Closes the connections that have sent nothing since SILENT_S after
        their accept (and are not being served)."""
        now = time.monotonic()
        with self._mu:
            silent = [c for c in self._conns.values() if not c.heard and now - c.accepted_at > SILENT_S]
        for conn in silent:
            if not conn.busy.acquire(blocking=False):
                continue  # it speaks now
            try:
                if not conn.heard:
                    log.warning("%s: closing a connection silent for %.0f s to make room", self.path,
                                now - conn.accepted_at)
                    self.drop(conn)
                    continue
            finally:
                conn.busy.release()
            # It spoke since: a report for it that came while this held it
            # was passed over (reactor.py), so it is watched again.
            if not conn.dropped:
                self._reactor.rearm(conn.fd)

    def _on_readable(self, fd: int) -> None:
        with self._mu:
            conn = self._conns.get(fd)
        if conn is None or not conn.busy.acquire(blocking=False):
            return  # a report for a connection gone (or being served): see reactor.py
        keep = False
        try:
            data = conn.sock.recv(self._max_datagram, socket.MSG_DONTWAIT)
            conn.heard = True
            keep = bool(data) and self._datagram(conn, data)
        except BlockingIOError:
            keep = True  # a spurious report: nothing to read yet
        except OSError:
            keep = False
        except Exception:  # noqa: BLE001 - a bug in one answer must not take the server down
            log.exception("answering on %s failed", self.path)
        finally:
            conn.busy.release()
        if keep and not conn.dropped:
            self._reactor.rearm(fd)
        else:
            self.drop(conn)

    def drop(self, conn: Connection) -> None:
        """Closes a connection (idempotent); `_closed` runs once."""
        with self._mu:
            if conn.dropped:
                return
            conn.dropped = True
            if self._conns.get(conn.fd) is conn:
                del self._conns[conn.fd]
        self._reactor.unwatch(conn.fd)
        try:
            self._closed(conn)
        finally:
            conn.sock.close()

    def close(self) -> None:
        with self._mu:
            self._stopping = True
            conns = list(self._conns.values())
        self._reactor.unwatch(self._sock.fileno())
        self._sock.close()
        for conn in conns:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)  # wakes a worker blocked on it
            except OSError:
                pass
            if conn.busy.acquire(timeout=SEND_TIMEOUT_S):
                conn.busy.release()
            self.drop(conn)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
