"""The fd socket (PATH.fds, SOCK_SEQPACKET): chunk fds and the sessions'
channels.

gRPC cannot carry file descriptors, so a client trades chunk serials for
chunk fds here (SCM_RIGHTS): a request is one datagram of JSON,
{"lease": token, "serials": [...]}, at most MAX_FDS serials, none twice. The broker checks
the peer with SO_PEERCRED (same uid, the session's pid, which the kernel gave
when the session attached) and that every serial is mapped by that client
now, then answers one datagram, {"serials": [...]} with one fd per serial
attached in that order, or {"error": "..."} with none. A check that fails
gives no fd at all.

The same socket carries each session's channel (attach, reclaim notices,
acks, goodbye; src/vtm/broker/session_channel.py has the messages): one
connection per session, whose end the broker reports to the service
(BrokerService.channel_closed).

Invariant: an fd only ever goes to the process the session's channel
attached from, and only while that session is LIVE.
"""

from __future__ import annotations

import json
import os
import socket
import threading

from vtm import errors
from vtm.broker.seqpacket import SeqpacketServer
from vtm.broker.session import LIVE, PENDING
from vtm.broker.session_channel import MAX_MESSAGE

MAX_FDS = 200  # below the kernel's SCM_MAX_FD (253)
# A session's connections here: its channel and its fetch connection, and
# room for one being replaced. More would only let a client fill the cap.
PER_SESSION = 3


def _error(exc: errors.Error) -> dict:
    return {"error": str(exc), "class": type(exc).__name__}


class FdServer(SeqpacketServer):
    """Serves chunk fds and session channels. `service` is the
    BrokerService (lookup, attach, ack, bye, channel_closed); `dup_fd(chunk,
    serial)` gives a new fd of a chunk (closed here after sending)."""

    def __init__(self, path: str, service, dup_fd, reactor, max_connections: int):
        self._service = service
        self._dup_fd = dup_fd
        super().__init__(path, reactor, max_connections, MAX_MESSAGE, PER_SESSION)

    def _datagram(self, conn, data: bytes) -> bool:
        try:
            request = json.loads(data)
            if not isinstance(request, dict):
                raise ValueError
        except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
            self.send(conn, json.dumps({"error": "malformed request (expected a JSON object)"}).encode())
            return conn.session is not None and not conn.anchor
        if conn.anchor:
            return self._on_channel(conn, request)
        if request.get("attach") is True:
            return self._attach(conn, request.get("lease"))
        if request.get("bye") is True:
            return self._bye(conn, request.get("lease"))
        header, fds, keep = self._fetch(conn, request)
        try:
            self.send(conn, json.dumps(header).encode(), fds)
        finally:
            for fd in fds:
                os.close(fd)
        return keep

    def _closed(self, conn) -> None:
        if conn.anchor:
            self._service.channel_closed(conn.session)

    # -- the session's channel ------------------------------------------------

    def _attach(self, conn, lease) -> bool:
        session = self._service.lookup(lease) if isinstance(lease, str) else None
        if session is None and isinstance(lease, str) and self._service.evicted(lease):
            self.send(conn, json.dumps({**_error(errors.Unavailable(
                "vtmd ended this session before its attach, to make room (--max-sessions): say Hello again")),
                "evicted": True}).encode())
            return False
        if session is None:
            self.send(conn, json.dumps(_error(errors.Unavailable("no such lease (say Hello first)"))).encode())
            return False
        if conn.uid != os.getuid():
            self.send(conn, json.dumps(_error(errors.FailedPrecondition(
                f"peer uid {conn.uid} may not use this broker"))).encode())
            return False
        if not self.bind(conn, session):
            self.send(conn, json.dumps(_error(errors.FailedPrecondition(
                "this session holds as many connections to the fd socket as it may"))).encode())
            return False
        # Under the send lock: the session's first notice cannot overtake the reply.
        with conn.send_lock:
            try:
                self._service.attach(session, conn)
            except errors.Error as exc:
                conn.queue_locked([(json.dumps(_error(exc)).encode(), ())])
                return False
            conn.anchor = True
            conn.queue_locked([(json.dumps({"attached": True}).encode(), ())])
        self._service.attached(session)
        return True

    def _on_channel(self, conn, request: dict) -> bool:
        if "ack" in request:
            self._service.ack(conn.session, request["ack"])
            return True
        if request.get("bye") is True:
            return self._bye(conn, request.get("lease"))
        return True  # nothing else is said on a channel: ignored

    def _bye(self, conn, lease) -> bool:
        """Ends the session `lease` names and answers; the connection
        closes after (False)."""
        session = self._service.lookup(lease) if isinstance(lease, str) else None
        # A pending session holds nothing: whoever has its lease may end it.
        if session is not None and session.state != PENDING and (conn.uid != os.getuid() or
                                                                 conn.pid != session.pid):
            self.send(conn, json.dumps(_error(errors.FailedPrecondition(
                f"peer pid {conn.pid} does not hold this lease"))).encode())
            return False
        # The answer first: the session's end ends its connections, this one
        # too when it is the session's channel, and its peer would read EOF.
        try:
            self.send(conn, json.dumps({"bye": True}).encode())
        except OSError:
            pass  # the peer did not wait for it (say_bye(wait=False)): it ends all the same
        if session is not None:  # else gone already
            self._service.end_session(session)  # the client unmapped everything first
        return False

    # -- fds ------------------------------------------------------------------

    def _fetch(self, conn, request: dict):
        """(reply header, fds, whether the connection stays). A connection
        fetches for one session, its first fetch's: one that names no
        session of its peer is closed after the error, so that only
        sessions hold connections here (each at most PER_SESSION)."""
        lease, serials = request.get("lease"), request.get("serials")
        if (not isinstance(lease, str) or not isinstance(serials, list) or len(serials) > MAX_FDS
                or not all(isinstance(s, int) and not isinstance(s, bool) for s in serials)
                or len(set(serials)) != len(serials)):  # one fd per chunk: no request multiplies them
            return {"error": f"malformed request (a JSON object with a lease and at most {MAX_FDS} serials, "
                             "none twice)"}, [], conn.session is not None
        session = self._service.lookup(lease)
        if session is None:
            return {"error": "no such lease"}, [], False
        if conn.uid != os.getuid() or conn.pid != session.pid:
            return {"error": f"peer pid {conn.pid} uid {conn.uid} does not hold this lease"}, [], False
        if session.state != LIVE:
            return {"error": f"the session is {session.state}"}, [], False
        if not self.bind(conn, session):
            return {"error": "this connection fetches for another session, or this session holds as many "
                             "connections to the fd socket as it may"}, [], False
        fds = []
        with session.lock:
            if session.state != LIVE:
                return {"error": f"the session is {session.state}"}, [], True
            missing = [s for s in serials if s not in session.chunk_of]
            if missing:
                return {"error": f"chunks {missing[:8]} are not leased to this client"}, [], True
            try:
                for serial in serials:
                    fds.append(self._dup_fd(session.chunk_of[serial], serial))
            except Exception as exc:  # noqa: BLE001 - reported to the client, fds closed
                for fd in fds:
                    os.close(fd)
                return {"error": f"export failed: {exc}"}, [], True
        return {"serials": serials}, fds, True


class FdClient:
    """A client's connection to the fd socket for fetches; one request at a time."""

    def __init__(self, path: str, lease: str, timeout: float):
        self._lease = lease
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.settimeout(timeout)
        self._mu = threading.Lock()
        try:
            self._sock.connect(path)
            # A fetch of nothing at once (its session is live: the channel
            # attached first): at its connection cap the broker closes the
            # connections that have said nothing (seqpacket.py), and this
            # one may stay idle for long.
            self.fetch([])
        except BaseException:
            self._sock.close()
            raise

    def fetch(self, serials: list[int]) -> list[tuple[int, int]]:
        """(serial, fd) for every serial; the caller owns (closes) each fd."""
        out = []
        try:
            for start in range(0, max(len(serials), 1), MAX_FDS):
                batch = serials[start:start + MAX_FDS]
                with self._mu:
                    self._sock.send(json.dumps({"lease": self._lease, "serials": batch}).encode())
                    msg, fds, _, _ = socket.recv_fds(self._sock, MAX_MESSAGE, MAX_FDS)
                out.extend(zip([None] * len(fds), fds))  # owned here until checked
                if not msg:
                    raise ConnectionError("the broker closed the fd socket")
                header = json.loads(msg)
                if "error" in header:
                    raise PermissionError(header["error"])
                if header.get("serials") != batch or len(fds) != len(batch):
                    raise ConnectionError("the broker answered a different fd request")
                out[len(out) - len(fds):] = list(zip(batch, fds))
        except BaseException:
            for _, fd in out:
                os.close(fd)
            raise
        return out

    def close(self) -> None:
        self._sock.close()
