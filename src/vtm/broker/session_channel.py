"""The session's channel: the client's anchor in the broker, one connection
to the fd socket (PATH.fds, SOCK_SEQPACKET) held for the session's life.

Why a Unix socket and not a gRPC stream: the kernel tells the broker who is
at the other end (SO_PEERCRED: the pid in the broker's own PID namespace,
whatever namespace the client runs in; and a pidfd of that process), and an
idle connection costs the broker an fd, not a thread (a gRPC server stream
holds a thread). The broker frees a session's memory when the client says
goodbye or its process exits, never because this connection ended: a
channel that ends while the process lives leaves the session quarantined
(docs/broker.md, "Trust model").

Messages, one JSON object a datagram:

  client -> broker
    {"lease": L, "attach": true}   the channel's first datagram: the sender's
                                   pid becomes the session's
    {"ack": N}                     notice N answered (no reply)
    {"lease": L, "bye": true}      end the session, on any connection from the
                                   session's process, once the client has
                                   unmapped everything; answered {"bye": true}
  broker -> client
    {"attached": true} or {"error": MESSAGE, "class": VTM_ERROR}
    {"notice": "reclaim", "id": N, "bytes": B, "deadline_s": S, "reason": R}
    {"notice": "recall", "id": N, "deadline_s": S, "reason": R}
                                   give back the pages mapped ahead
    {"notice": "shutdown", "reason": R}
    {"notice": "quota", "priority": P, "guaranteed_bytes": G, "limit_bytes": L}
                                   the operator changed this session's grant
                                   (vtmctl set-quota; no answer)

Threading: one thread reads the channel (the client's listener); ack() may
be called from it, drop() and close() from any thread. The reader owns the socket while
it reads: close() from another thread only shuts the connection down (the
read returns) and the reader closes the fd on its way out. Closing it under
the blocked read would free the fd number while the read still holds it,
and the next socket opened in this process could be read in its place.
"""

from __future__ import annotations

import json
import socket
import threading

from vtm import errors

MAX_MESSAGE = 1 << 16


class Evicted(errors.Unavailable):
    """The broker ended the session between its Hello and its attach, to
    make room for others at --max-sessions: a new Hello may get one."""


def error_of(reply: dict) -> errors.Error:
    """The vtm error a broker's {"error": ..., "class": ...} reply reports."""
    cls = getattr(errors, str(reply.get("class", "")), None)
    if not (isinstance(cls, type) and issubclass(cls, errors.Error)):
        cls = errors.Unavailable
    return cls(str(reply.get("error", "the vtm broker refused")))


def _request(sock: socket.socket, message: dict) -> dict:
    sock.send(json.dumps(message).encode())
    data = sock.recv(MAX_MESSAGE)
    if not data:
        raise ConnectionError("the vtm broker closed the connection")
    return json.loads(data)


class SessionChannel:
    def __init__(self, path: str, lease: str, timeout: float):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(path)
            reply = _request(self._sock, {"lease": lease, "attach": True})
            if reply.get("evicted"):
                raise Evicted(str(reply.get("error")))
            if not reply.get("attached"):
                raise error_of(reply)
            self._sock.settimeout(None)  # the listener waits for notices for as long as the session lives
        except BaseException:
            self._sock.close()
            raise
        self._mu = threading.Lock()
        self._reading = False  # a thread is inside notices(): it closes the socket
        self._closed = False

    def notices(self):
        """The broker's notices, as dicts, until the channel ends (or is closed)."""
        with self._mu:
            if self._closed or self._reading:
                return
            self._reading = True
        try:
            while True:
                try:
                    data = self._sock.recv(MAX_MESSAGE)
                except OSError:
                    return
                if not data:
                    return
                try:
                    yield json.loads(data)
                except ValueError:
                    return  # not the broker speaking: the channel is unusable
        finally:
            with self._mu:
                self._reading = False
                close = self._closed
            if close:
                self._sock.close()

    def ack(self, notice_id: int) -> None:
        try:
            self._sock.send(json.dumps({"ack": notice_id}).encode())
        except OSError:
            pass  # the channel ending tells the listener

    def drop(self) -> None:
        """Ends the connection (the listener's read returns) and keeps the fd:
        what a transport reset does to a session's channel."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """Ends the channel from this side; the listener's read returns.
        Idempotent. The fd is closed here, or by the reader if one is reading."""
        with self._mu:
            if self._closed:
                return
            self._closed = True
            reading = self._reading
            self.drop()  # before the reader can leave and close the fd
        if not reading:
            self._sock.close()


def say_bye(path: str, lease: str, timeout: float, wait: bool = True) -> None:
    """Ends the session (the caller has unmapped everything). On a connection
    of its own, so it works whether the channel lives or not. wait=False
    leaves once the goodbye is sent: a hung broker reads it when it resumes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        message = {"lease": lease, "bye": True}
        if not wait:
            sock.send(json.dumps(message).encode())
            return
        reply = _request(sock, message)
        if not reply.get("bye"):
            raise error_of(reply)
