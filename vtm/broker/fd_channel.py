"""The fd side channel: gRPC cannot carry file descriptors, so a client
trades chunk serials for chunk fds on a SOCK_SEQPACKET Unix socket
(SCM_RIGHTS), next to the broker's gRPC socket.

A request is one datagram of JSON, {"lease": token, "serials": [...]}, at
most MAX_FDS serials. The broker checks the peer with SO_PEERCRED (same uid,
the pid the session said hello with) and that every serial is mapped by that
client now, then answers one datagram, {"serials": [...]} with one fd per
serial attached in that order, or {"error": "..."} with none. A check that
fails gives no fd at all.
"""

from __future__ import annotations

import json
import os
import socket
import threading

from vtm.broker.seqpacket import SeqpacketServer

MAX_FDS = 200  # below the kernel's SCM_MAX_FD (253)
_MAX_MSG = 1 << 16


class FdServer(SeqpacketServer):
    """Serves chunk fds to sessions. `lookup(lease)` gives the live session or
    None; `dup_fd(chunk, serial)` a new fd for a chunk (closed here after
    sending)."""

    def __init__(self, path: str, lookup, dup_fd):
        self._lookup = lookup
        self._dup_fd = dup_fd
        super().__init__(path, "vtmd-fds")

    def _handle(self, conn: socket.socket, pid: int, uid: int) -> None:
        while True:
            data = conn.recv(_MAX_MSG)
            if not data:
                return
            header, fds = self._answer(data, pid, uid)
            try:
                socket.send_fds(conn, [json.dumps(header).encode()], fds)
            finally:
                for fd in fds:
                    os.close(fd)

    def _answer(self, data: bytes, pid: int, uid: int):
        try:
            request = json.loads(data)
            lease, serials = request["lease"], request["serials"]
            if not isinstance(lease, str) or not isinstance(serials, list) or len(serials) > MAX_FDS:
                raise ValueError
            if not all(isinstance(s, int) and not isinstance(s, bool) for s in serials):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            return {"error": f"malformed request (a JSON object with a lease and at most {MAX_FDS} serials)"}, []
        session = self._lookup(lease)
        if session is None:
            return {"error": "no such lease"}, []
        if uid != os.getuid() or pid != session.pid:
            return {"error": f"peer pid {pid} uid {uid} does not hold this lease"}, []
        fds = []
        with session.lock:
            if session.closed:
                return {"error": "the session is closed"}, []
            missing = [s for s in serials if s not in session.chunk_of]
            if missing:
                return {"error": f"chunks {missing[:8]} are not leased to this client"}, []
            try:
                for serial in serials:
                    fds.append(self._dup_fd(session.chunk_of[serial], serial))
            except Exception as exc:  # noqa: BLE001 - reported to the client, fds closed
                for fd in fds:
                    os.close(fd)
                return {"error": f"export failed: {exc}"}, []
        return {"serials": serials}, fds


class FdClient:
    """A client's connection to the fd socket; one request at a time."""

    def __init__(self, path: str, lease: str, timeout: float):
        self._lease = lease
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.settimeout(timeout)
        self._sock.connect(path)
        self._mu = threading.Lock()

    def fetch(self, serials: list[int]) -> list[tuple[int, int]]:
        """(serial, fd) for every serial; the caller owns (closes) each fd."""
        out = []
        try:
            for start in range(0, len(serials), MAX_FDS):
                batch = serials[start:start + MAX_FDS]
                with self._mu:
                    self._sock.send(json.dumps({"lease": self._lease, "serials": batch}).encode())
                    msg, fds, _, _ = socket.recv_fds(self._sock, _MAX_MSG, MAX_FDS)
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
