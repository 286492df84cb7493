"""A SOCK_SEQPACKET Unix-socket server, one thread per connection: what the
broker's side sockets (fd_channel, step_channel) share. A subclass answers
the datagrams of one connection in `_handle(conn, pid, uid)`, given the
peer's credentials from SO_PEERCRED.

Invariants: the socket file is 0600 (the broker's folder is 0700 too);
`close()` stops accepting, shuts every open connection down, and removes
the socket file; a connection's handler ends when its peer goes away.
"""

from __future__ import annotations

import os
import socket
import struct
import threading


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of `conn`."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


class SeqpacketServer:
    def __init__(self, path: str, thread_name: str):
        self.path = path
        self._thread_name = thread_name
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._sock.bind(path)
            os.chmod(path, 0o600)
            self._sock.listen(64)
        except BaseException:
            self._sock.close()
            raise
        self._stopping = False
        self._conns: set[socket.socket] = set()
        self._mu = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name=thread_name, daemon=True)
        self._thread.start()

    def _handle(self, conn: socket.socket, pid: int, uid: int) -> None:
        raise NotImplementedError

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
            threading.Thread(target=self._serve, args=(conn,), name=f"{self._thread_name}-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            pid, uid, _ = peer_credentials(conn)
            self._handle(conn, pid, uid)
        except OSError:
            return
        finally:
            with self._mu:
                self._conns.discard(conn)
            conn.close()

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
