"""A SOCK_SEQPACKET Unix-socket server on the broker's Reactor: what the
side sockets (fd_channel, step_channel) share. A subclass answers one
datagram at a time in `_datagram(conn, data)`; the peer's credentials come
from the kernel (SO_PEERCRED, read at accept), never from the peer.

No thread per connection: the reactor's poller reports a readable
connection and one of its fixed workers reads one datagram and answers it
(reactor.py), so idle connections cost an fd each, and neither an accept
that fails nor a connection that misbehaves stops the others.

No send waits: a reply the peer's queue has no room for (a peer that does
not read; the kernel queues what the send buffer holds) waits in the
connection's outbox, and the connection is watched for room instead of for
its next request. A worker blocked on such a send would be one of a fixed few: a
few dozen peers that never read would stop the broker answering anyone.

Invariants:
  * the socket file is 0600 (the broker's folder is 0700 too);
  * _conns holds every open connection, each watched by the reactor until
    it is dropped (unwatched, then closed, exactly once);
  * at most max_connections are open: at the cap, connections silent
    since their accept for SILENT_S make room (closed), else one more is
    accepted and closed: a peer that connects and says nothing cannot
    lock the others out;
  * no worker waits to send: a connection whose outbox is not empty reads
    no request until it is; one (not a session's channel, which gets
    notices nobody asked for) whose peer asks again before it has read its
    last reply is dropped, so a connection's unread replies, and the chunk
    fds they carry, stay one reply's worth; and one whose peer has taken nothing from it
    for SEND_TIMEOUT_S (a peer that does not read) is dropped at the
    reactor's next tick, so it holds neither a worker nor, for long, a
    place or the fds its outbox copied;
  * a connection serves at most one session (`bind`), and a session holds
    at most the server's `per_session` connections: a client cannot fill
    the socket's cap with connections of its own;
  * `close()` stops accepting, ends every connection and removes the file.
"""

from __future__ import annotations

import array
import collections
import errno
import fcntl
import logging
import os
import socket
import struct
import termios
import threading
import time

log = logging.getLogger("vtm.broker")

SEND_TIMEOUT_S = 5
MAX_QUEUED_NOTICES = 64  # notices that wait behind a reply in an outbox; past them, a notice is not sent
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
                 "heard", "outbox", "waiting_since", "ending")

    def __init__(self, sock: socket.socket, pid: int, uid: int):
        self.sock = sock
        self.fd = sock.fileno()
        self.pid = pid
        self.uid = uid
        self.session = None  # the session it serves (SeqpacketServer.bind)
        self.anchor = False  # the session's liveness channel (fd_channel)
        self.busy = threading.Lock()  # held while a worker reads and answers a datagram
        self.send_lock = threading.Lock()  # guards outbox and the sends: replies and notices never interleave
        self.dropped = False
        self.accepted_at = time.monotonic()
        self.heard = False  # whether it has sent a datagram
        self.outbox: collections.deque[tuple[bytes, list[int]]] = collections.deque()  # (datagram, its own fds)
        self.waiting_since: float | None = None  # since when the outbox has not been empty
        self.ending = False  # shut down by a sweep: its worker drops it at its next report (SeqpacketServer.end)

    def post(self, data: bytes) -> bool:
        """Sends without waiting (a notice), after what the outbox holds:
        False when the peer's queue is full or the connection is gone."""
        with self.send_lock:
            if self.outbox:
                if len(self.outbox) >= MAX_QUEUED_NOTICES:
                    return False
                self.outbox.append((data, []))
                return True
            try:
                self.sock.send(data, socket.MSG_DONTWAIT)
                return True
            except OSError:
                return False

    def queue(self, datagrams) -> None:
        """Sends (data, fds) datagrams in order, those the peer's queue has
        no room for left in the outbox (with copies of their fds: the
        caller closes its own). Raises OSError when the connection failed.
        Called by the connection's own worker, which watches for room."""
        with self.send_lock:
            self.queue_locked(datagrams)

    def queue_locked(self, datagrams) -> None:
        """queue(), send_lock held."""
        for data, fds in datagrams:
            if not self.outbox and _sent(self.sock, data, fds):
                continue
            self.outbox.append((data, _copies(fds)))
            if self.waiting_since is None:
                self.waiting_since = time.monotonic()

    def flush(self) -> None:
        """Sends what the outbox holds, as far as the peer's queue has room."""
        with self.send_lock:
            sent = False
            while self.outbox:
                data, fds = self.outbox[0]
                if not _sent(self.sock, data, fds):
                    break
                self.outbox.popleft()
                _close_all(fds)
                sent = True
            # A peer that reads, however slowly, is not stuck: the wait
            # counts from the last datagram it took.
            self.waiting_since = None if not self.outbox else time.monotonic() if sent else self.waiting_since

    def stuck(self, now: float) -> bool:
        """Whether its outbox has waited SEND_TIMEOUT_S since the peer last
        took a datagram: its peer does not read."""
        since = self.waiting_since
        return since is not None and now - since > SEND_TIMEOUT_S

    def shut(self) -> None:
        """Shuts the socket down (both ways): the reactor reports it, and the
        worker that serves the report drops the connection."""
        with self.send_lock:  # not after close(): the fd number may be another socket's by then
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed already

    def close(self) -> None:
        """Closes the socket and what the outbox holds; under the send lock,
        so that no notice goes to the fd number once it is reused."""
        with self.send_lock:
            self.sock.close()
            for _, fds in self.outbox:
                _close_all(fds)
            self.outbox.clear()


def _sent(sock: socket.socket, data: bytes, fds) -> bool:
    """Sends one datagram without waiting: False when the peer's queue has
    no room (nothing sent); OSError when the connection failed."""
    try:
        if fds:
            socket.send_fds(sock, [data], fds, socket.MSG_DONTWAIT)
        else:
            sock.send(data, socket.MSG_DONTWAIT)
        return True
    except BlockingIOError:
        return False


def _unread_bytes(sock: socket.socket) -> int:
    """Bytes sent on `sock` that its peer has not read yet (SIOCOUTQ: for a
    Unix socket, what the kernel still queues at the peer)."""
    out = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, out, True)
    return out[0]


def _stuck(conn: Connection, now: float) -> str | None:
    if conn.stuck(now):
        return f"that has not read its replies for {now - conn.waiting_since:.0f} s"
    return None


def _silent(conn: Connection, now: float) -> str | None:
    if not conn.heard and now - conn.accepted_at > SILENT_S:
        return f"silent for {now - conn.accepted_at:.0f} s since its accept, to make room"
    return None


def _close_all(fds) -> None:
    for fd in fds:
        os.close(fd)


def _copies(fds) -> list[int]:
    """Duplicates of `fds`, all or none (EMFILE halfway closes those made)."""
    copies = []
    try:
        for fd in fds:
            copies.append(os.dup(fd))
    except BaseException:
        _close_all(copies)
        raise
    return copies


class SeqpacketServer:
    def __init__(self, path: str, reactor, max_connections: int, max_datagram: int, per_session: int):
        self.path = path
        self._reactor = reactor
        self._max_connections = max_connections
        self._max_datagram = max_datagram
        self._per_session = per_session
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
            reactor.every_second(self._drop_stuck)
        except BaseException:
            self._reactor.unwatch(self._sock.fileno())
            self._sock.close()
            raise

    # -- for subclasses ---------------------------------------------------

    def _datagram(self, conn: Connection, data: bytes) -> bool:
        """Answers one datagram; False closes the connection."""
        raise NotImplementedError

    def _closed(self, conn: Connection) -> None:
        """The connection is gone (the peer closed it, or it was dropped)."""

    def send(self, conn: Connection, data: bytes, fds=()) -> None:
        """Sends one datagram (the caller closes its fds), or leaves it in
        the outbox; from the connection's own worker (_datagram)."""
        conn.queue([(data, fds)])

    def bind(self, conn: Connection, session) -> bool:
        """Makes `conn` serve `session`; False (nothing changed) when the
        session holds per_session connections here already."""
        with self._mu:
            if conn.session is session:
                return True
            if conn.session is not None:
                return False
            if sum(1 for c in self._conns.values() if c.session is session) >= self._per_session:
                return False
            conn.session = session
            return True

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
            sock.setblocking(False)  # no worker ever waits on a connection
            pid, uid, _ = peer_credentials(sock)
            conn = Connection(sock, pid, uid)
            with self._mu:
                at_cap = self._open() >= self._max_connections
            if at_cap:
                self._end_where(lambda c, now: _stuck(c, now) or _silent(c, now))
            with self._mu:
                if self._stopping or self._open() >= self._max_connections:
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

    def _open(self) -> int:
        """Connections open and not ending (those a sweep shut down are
        dropped as soon as a worker sees them): _mu held."""
        return sum(1 for c in self._conns.values() if not c.ending)

    def _drop_stuck(self) -> None:
        """Ends the connections whose peer has not read its replies for
        SEND_TIMEOUT_S (the reactor's tick): they hold no worker, but their
        outbox holds copies of chunk fds."""
        self._end_where(_stuck)

    def end_session(self, session) -> None:
        """Ends every connection that serves `session` (it ended): a
        client may not keep connections of a session that is gone, which
        no per-session cap would count any more."""
        # Every client that exits or says goodbye ends here: nothing an
        # operator must hear of (it was a warning on every clean exit).
        self._end_where(lambda c, now: "of a session that ended" if c.session is session else None, logging.DEBUG)

    def _end_where(self, doomed, level: int = logging.WARNING) -> None:
        """Ends the connections for which `doomed(conn, now)` gives a
        reason, logged at `level`: shut down (Connection.shut), so that the
        worker that next serves each drops it, at once if none serves it
        now. A sweep neither waits for a worker nor re-arms a connection, so
        it cannot leave one watched the wrong way while a worker serves it."""
        now = time.monotonic()
        with self._mu:
            picked = [(c, why) for c in self._conns.values() if not c.ending and (why := doomed(c, now))]
            for conn, _ in picked:
                conn.ending = True
        for conn, why in picked:
            log.log(level, "%s: closing a connection %s", self.path, why)
            conn.shut()

    def _on_readable(self, fd: int) -> None:
        with self._mu:
            conn = self._conns.get(fd)
        if conn is None or not conn.busy.acquire(blocking=False):
            return  # a report for a connection gone (or being served): see reactor.py
        keep = False
        try:
            if conn.outbox:  # room for the replies it waits for (or a spurious report)
                conn.flush()
                keep = not conn.stuck(time.monotonic())
            else:
                data = conn.sock.recv(self._max_datagram, socket.MSG_DONTWAIT)
                conn.heard = True
                if data and not conn.anchor and _unread_bytes(conn.sock) > 0:
                    # Every client waits for its reply before it asks again.
                    # A peer that asks without reading would pile replies up
                    # in the kernel's queue, where no outbox sees them: on a
                    # connected SOCK_SEQPACKET socket the kernel queues as
                    # much as the send buffer holds, and a fetch's reply
                    # carries up to MAX_FDS chunk fds, which count against
                    # this user's fds in flight until read (past its
                    # RLIMIT_NOFILE the kernel refuses every fd the broker
                    # passes, to every client). Read first: a connection
                    # closed with a request unread resets the peer's reads.
                    log.warning("%s: closing a connection whose peer asked again before it read its last reply",
                                self.path)
                    data = b""
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
            # Its next request waits until its replies are sent: an outbox
            # holds one reply at most, and notices.
            if conn.outbox:
                self._reactor.rearm_writable(fd)
            else:
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
            conn.close()

    def close(self) -> None:
        with self._mu:
            self._stopping = True
            conns = list(self._conns.values())
        self._reactor.stop_ticking(self._drop_stuck)
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
