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
import struct
import threading

MAX_FDS = 200  # below the kernel's SCM_MAX_FD (253)
_MAX_MSG = 1 << 16


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of `conn`."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


class FdServer:
    """Serves chunk fds to sessions. `lookup(lease)` gives the live session or
    None; `dup_fd(chunk, serial)` a new fd for a chunk (closed here after
    sending)."""

    def __init__(self, path: str, lookup, dup_fd):
        self.path = path
        self._lookup = lookup
        self._dup_fd = dup_fd
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.bind(path)
        os.chmod(path, 0o600)
        self._sock.listen(64)
        self._stopping = False
        self._conns = set()
        self._mu = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="vtmd-fds", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._mu:
                if self._stopping:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="vtmd-fds-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            pid, uid, _ = peer_credentials(conn)
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
        except OSError:
            return
        finally:
            with self._mu:
                self._conns.discard(conn)
            conn.close()

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

    def close(self) -> None:
        with self._mu:
            self._stopping = True
            conns = list(self._conns)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=5)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


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
