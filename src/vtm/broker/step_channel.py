"""The step socket: the fast path of the hot calls (Create, Extend, Step,
Release) on a SOCK_SEQPACKET Unix socket next to the gRPC one (PATH.step).

Why: on the development VM a gRPC call from Python costs ~300 us of
transport before the broker does any work, while a datagram round trip costs
~20 us; a decode step over 32 vTensors must stay within ~300 us in all.
gRPC stays the canonical, documented API: this socket carries only these
four calls, with the same semantics and the same errors, and a client uses it
only when Hello advertises it (HelloReply.step_socket), so old clients and
old brokers keep working over gRPC.

Frames (little endian, fixed-size fields packed with struct; the table is in
docs/broker.md):

  request: op u32 | count u32 | request id u64 | count x entries of u64s
      AUTH     the lease (ASCII) instead of the entries; the first frame, once
      CREATE   (space id, tokens)       EXTEND (vTensor id, tokens)
      STEP     count x (vTensor id, tokens)      RELEASE (vTensor id, 0)
      EXTEND_LOW (vTensor id, tokens, low)
      STEP_LOW count x (vTensor id, tokens, low); low KEEP_LOW keeps the mark
      CREATE_AHEAD, STEP_AHEAD  as CREATE and STEP, for rows mapped ahead of
               need (client.py, map_ahead.py): refused at once rather than
               waiting for, or asking other clients for, memory
  reply:   status u32 (0 ok, 1 error) | fds u32 | request id u64 | length u32 | 0 u32
      ok:    vTensor id u64 | slot u64 | tokens u64 | released u32 | groups u32
             | fds x serial u64 (the chunks of the attached fds, in order)
             | groups x (space id u32 | pages u32 | pages x (slot u32, page u32, chunk i64, serial u64))
      error: name length u16 | the vtm exception class name | the message (UTF-8)

A reply longer than one datagram (MAX_DATAGRAM bytes) continues in further
datagrams; `length` counts the bytes of all of them. The vTensor fields
describe the vTensor a CREATE made or a RELEASE released.

Authentication is the fd socket's: the broker checks the peer with
SO_PEERCRED (same uid, the pid the kernel gave when the session attached its
channel) and the lease, then binds the connection to that session for its
life; a failed check gets an error reply and the connection is closed. Page effects are the gRPC
reply's; a reply also attaches (SCM_RIGHTS) one fd per chunk that the call
made the client map and that it mapped nowhere before, which saves the fd
socket round trip (the client closes those it had kept imported); at most
MAX_FDS of them, all on the first datagram, so a client never holds more than
that many unimported fds: it fetches any others from the fd socket.
"""

from __future__ import annotations

import os
import socket
import struct

import vtm
from vtm import errors
from vtm.broker.fd_channel import MAX_FDS
from vtm.broker.seqpacket import SeqpacketServer
from vtm.broker.session import LIVE

AUTH, CREATE, EXTEND, STEP, RELEASE, EXTEND_LOW, STEP_LOW, CREATE_AHEAD, STEP_AHEAD = 1, 2, 3, 4, 5, 6, 7, 8, 9
OP_NAMES = {CREATE: "create", EXTEND: "extend", STEP: "step", RELEASE: "release", EXTEND_LOW: "extend",
            STEP_LOW: "step", CREATE_AHEAD: "create", STEP_AHEAD: "step"}
# u64s an entry of each op has: the ops that set a low mark carry it third.
WIDTH = {CREATE: 2, EXTEND: 2, STEP: 2, RELEASE: 2, EXTEND_LOW: 3, STEP_LOW: 3, CREATE_AHEAD: 2, STEP_AHEAD: 2}
KEEP_LOW = (1 << 64) - 1  # a STEP_LOW entry that keeps the vTensor's low mark

REQUEST = struct.Struct("<IIQ")
PAIR = struct.Struct("<QQ")
REPLY = struct.Struct("<IIQII")
OK = struct.Struct("<QQQII")
GROUP = struct.Struct("<II")
PAGE = struct.Struct("<IIqQ")
SERIAL = struct.Struct("<Q")
NAME_LEN = struct.Struct("<H")

MAX_DATAGRAM = 1 << 16
# A client's step connection is its worker's (one); the second is room for
# one being replaced. More would only let a client fill the socket's cap.
PER_SESSION = 2
MAX_REQUEST = MAX_DATAGRAM  # 4,095 pairs (2,730 triples): larger steps go over gRPC
MAX_PAIRS = (MAX_REQUEST - REQUEST.size) // PAIR.size
MAX_TRIPLES = (MAX_REQUEST - REQUEST.size) // (3 * 8)
_MAX_LEASE = 256


def encode_request(op: int, request_id: int, words) -> bytes:
    """A request frame; `words` is the entries' u64s, flat (a0, b0, a1, b1, ...)."""
    count = len(words) // WIDTH.get(op, 2)  # an unknown op (a test's) as pairs
    return REQUEST.pack(op, count, request_id) + struct.pack(f"<{len(words)}Q", *words)


def encode_ok(request_id: int, vtensor: tuple, groups, serials) -> bytes:
    """vtensor: (id, slot, tokens, released); groups: [(space id, effects)]."""
    parts = [b"", OK.pack(*vtensor, len(groups)), struct.pack(f"<{len(serials)}Q", *serials)]
    for space_id, effects in groups:
        parts.append(GROUP.pack(space_id, len(effects)))
        parts.extend(PAGE.pack(*e) for e in effects)
    length = REPLY.size + sum(len(p) for p in parts)
    parts[0] = REPLY.pack(0, len(serials), request_id, length, 0)
    return b"".join(parts)


def encode_error(request_id: int, exc: BaseException) -> bytes:
    name = type(exc).__name__.encode()
    body = NAME_LEN.pack(len(name)) + name + str(exc).encode("utf-8", "replace")
    return REPLY.pack(1, 0, request_id, REPLY.size + len(body), 0) + body


def reply_datagrams(payload: bytes, fds) -> list[tuple[bytes, list[int]]]:
    """A reply as (data, fds) datagrams of MAX_DATAGRAM bytes, the fds (at
    most MAX_FDS) on the first."""
    return [(payload[start:start + MAX_DATAGRAM], fds if start == 0 else [])
            for start in range(0, max(len(payload), 1), MAX_DATAGRAM)]


class Reply:
    """A decoded ok reply; owns `fds` until the caller closes them."""

    __slots__ = ("vtensor", "groups", "serials", "fds")

    def __init__(self, vtensor, groups, serials, fds):
        self.vtensor = vtensor  # (id, slot, tokens, released)
        self.groups = groups  # [(space id, [(slot, page, chunk, serial)])]
        self.serials = serials
        self.fds = fds


def decode_reply(data: bytes, fds: list, request_id: int):
    """A Reply, or raises the vtm error the broker reported; ValueError for
    a frame that does not parse (the connection is then unusable)."""
    try:
        return _decode_reply(data, fds, request_id)
    except struct.error as exc:
        raise ValueError(f"malformed reply: {exc}") from None


def _decode_reply(data: bytes, fds: list, request_id: int):
    status, nfds, rid, length, _ = REPLY.unpack_from(data)
    if rid != request_id or length != len(data):
        raise ValueError(f"the broker answered request {rid} ({len(data)} of {length} bytes), "
                         f"expected request {request_id}")
    if status == 1:
        (name_len,) = NAME_LEN.unpack_from(data, REPLY.size)
        start = REPLY.size + NAME_LEN.size
        name = data[start:start + name_len].decode("ascii", "replace")
        raise error_named(name, data[start + name_len:].decode("utf-8", "replace"))
    if status != 0 or nfds != len(fds):
        raise ValueError(f"malformed reply: status {status}, {len(fds)} fds of {nfds}")
    at = REPLY.size
    vt_id, slot, tokens, released, ngroups = OK.unpack_from(data, at)
    at += OK.size
    serials = list(struct.unpack_from(f"<{nfds}Q", data, at))
    at += SERIAL.size * nfds
    groups = []
    for _ in range(ngroups):
        space_id, npages = GROUP.unpack_from(data, at)
        at += GROUP.size
        end = at + npages * PAGE.size
        if end > len(data):
            raise ValueError("malformed reply: page effects past its end")
        groups.append((space_id, list(PAGE.iter_unpack(data[at:end]))))
        at = end
    if at != len(data):
        raise ValueError("malformed reply: trailing bytes")
    return Reply((vt_id, slot, tokens, released), groups, serials, fds)


def error_named(name: str, message: str) -> errors.Error:
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.Error)):
        cls = errors.InternalError
    return cls(message)


class StepServer(SeqpacketServer):
    """Serves the step socket on the broker's reactor, each connection bound
    to one session after its AUTH frame. `service` is the BrokerService (its
    ops run under the session lock, as the gRPC calls do); `dup_fd(chunk,
    serial)` gives a new fd of a chunk, closed here once sent.

    Invariants: a connection serves only the session it authenticated as,
    and only while that session is LIVE; a frame that does not parse gets an
    InvalidArgument reply and changes nothing."""

    def __init__(self, path: str, service, dup_fd, reactor, max_connections: int):
        self._service = service
        self._dup_fd = dup_fd
        self._ops = {CREATE: self._create, EXTEND: self._extend, STEP: self._step, RELEASE: self._release,
                     EXTEND_LOW: self._extend_low, STEP_LOW: self._step_low, CREATE_AHEAD: self._create_ahead,
                     STEP_AHEAD: self._step_ahead}
        super().__init__(path, reactor, max_connections, MAX_REQUEST + 1, PER_SESSION)

    def _datagram(self, conn, data: bytes) -> bool:
        if conn.session is None:
            session, error = self._authenticate(data, conn.pid, conn.uid)
            rid = REQUEST.unpack_from(data)[2] if len(data) >= REQUEST.size else 0
            if error is None and not self.bind(conn, session):
                error = vtm.FailedPrecondition(f"this session holds {PER_SESSION} step connections already")
            if error is not None:
                self.send(conn, encode_error(rid, error))
                return False
            self.send(conn, encode_ok(rid, (0, 0, 0, 0), [], []))
            return True
        payload, fds = self._answer(conn.session, data)
        try:
            conn.queue(reply_datagrams(payload, fds))
        finally:
            for fd in fds:
                os.close(fd)
        return True

    def _authenticate(self, data: bytes, pid: int, uid: int):
        """(session, None) or (None, the error to report)."""
        if len(data) < REQUEST.size or len(data) > REQUEST.size + _MAX_LEASE:
            return None, vtm.InvalidArgument("the first frame must be AUTH with the lease")
        op, _, _ = REQUEST.unpack_from(data)
        if op != AUTH:
            return None, vtm.InvalidArgument("the first frame must be AUTH with the lease")
        try:
            lease = data[REQUEST.size:].decode("ascii")
        except UnicodeDecodeError:
            return None, vtm.InvalidArgument("the lease is not ASCII")
        session = self._service.lookup(lease)
        if session is None or session.state != LIVE:
            return None, vtm.Unavailable("no such lease (say Hello and attach first, or the session ended)")
        if uid != os.getuid() or pid != session.pid:
            return None, vtm.FailedPrecondition(f"peer pid {pid} uid {uid} does not hold this lease")
        return session, None

    def _answer(self, session, data: bytes):
        """(reply bytes, fds to attach) for one request frame."""
        request_id = 0
        fds = []
        try:
            if len(data) < REQUEST.size:
                raise vtm.InvalidArgument(f"a request frame has at least {REQUEST.size} bytes, got {len(data)}")
            op, count, request_id = REQUEST.unpack_from(data)
            handler = self._ops.get(op)
            if handler is None:
                raise vtm.InvalidArgument(f"unknown op {op}")
            width = WIDTH[op]
            if len(data) != REQUEST.size + count * width * 8:
                raise vtm.InvalidArgument(f"a frame of {count} entries of {width} u64s has "
                                          f"{REQUEST.size + count * width * 8} bytes, got {len(data)}")
            if op not in (STEP, STEP_LOW, STEP_AHEAD) and count != 1:
                raise vtm.InvalidArgument(f"{OP_NAMES[op]} takes one entry, got {count}")
            pairs = struct.unpack_from(f"<{width * count}Q", data, REQUEST.size)

            def body():
                vtensor = handler(session, pairs)
                groups, _, fresh = self._service.collect(session)
                fresh = fresh[:MAX_FDS]
                try:
                    for serial in fresh:
                        fds.append(self._dup_fd(session.chunk_of[serial], serial))
                except Exception:  # noqa: BLE001 - the client fetches what lacks an fd on the fd socket
                    for fd in fds:
                        os.close(fd)
                    fds.clear()
                return encode_ok(request_id, vtensor, [(s, e) for s, _, e in groups], fresh[:len(fds)])

            return self._service.run_op(session, body), fds
        except Exception as exc:  # noqa: BLE001 - reported; the connection lives on
            for fd in fds:
                os.close(fd)
            if not isinstance(exc, vtm.Error):
                exc = vtm.InternalError(f"{type(exc).__name__}: {exc}")  # a bug, reported as one
            return encode_error(request_id, exc), []

    # Each returns the (id, slot, tokens, released) of the vTensor it made or released.

    def _create(self, session, pairs, speculative=False):
        vt_id = self._service.create(session, pairs[0], pairs[1], speculative=speculative)
        state = session.vt_state[vt_id]
        return vt_id, state.slot, state.num_tokens, 0

    def _create_ahead(self, session, pairs):
        return self._create(session, pairs, speculative=True)

    def _extend(self, session, pairs):
        self._service.extend(session, pairs[0], pairs[1])
        return 0, 0, 0, 0

    def _step(self, session, pairs, speculative=False):
        self._service.step(session, [(vt_id, n, None) for vt_id, n in zip(pairs[0::2], pairs[1::2])],
                           speculative=speculative)
        return 0, 0, 0, 0

    def _step_ahead(self, session, pairs):
        return self._step(session, pairs, speculative=True)

    def _extend_low(self, session, triple):
        self._service.extend(session, triple[0], triple[1], None if triple[2] == KEEP_LOW else triple[2])
        return 0, 0, 0, 0

    def _step_low(self, session, triples):
        self._service.step(session, [(vt_id, n, None if low == KEEP_LOW else low)
                                     for vt_id, n, low in zip(triples[0::3], triples[1::3], triples[2::3])])
        return 0, 0, 0, 0

    def _release(self, session, pairs):
        self._service.release(session, pairs[0])
        return pairs[0], 0, 0, 1


class StepClient:
    """A client's connection to the step socket; used by one thread (the
    client's worker) at a time. Any transport failure (a dead or hung broker,
    a reply that does not parse) raises OSError or ValueError and leaves the
    connection unusable; the caller reports vtm.Unavailable."""

    def __init__(self, path: str, lease: str, timeout: float):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._next_id = 1
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(path)
            reply = self._call(REQUEST.pack(AUTH, 0, 0) + lease.encode("ascii"), 0)
            for fd in reply.fds:
                os.close(fd)
        except BaseException:
            self._sock.close()
            raise

    def call(self, op: int, words) -> Reply:
        """Runs one op; the caller closes reply.fds."""
        request_id = self._next_id
        self._next_id += 1
        return self._call(encode_request(op, request_id, words), request_id)

    def _call(self, frame: bytes, request_id: int) -> Reply:
        self._sock.send(frame)
        chunks, fds = [], []
        try:
            received, length = 0, None
            while length is None or received < length:
                msg, got, flags, _ = socket.recv_fds(self._sock, MAX_DATAGRAM, MAX_FDS)
                fds.extend(got)
                if not msg:
                    raise ConnectionError("the broker closed the step socket")
                if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                    raise ValueError("a reply datagram was truncated")
                if length is None:
                    if len(msg) < REPLY.size:
                        raise ValueError(f"a reply of {len(msg)} bytes")
                    length = REPLY.unpack_from(msg)[3]
                chunks.append(msg)
                received += len(msg)
            return decode_reply(b"".join(chunks), fds, request_id)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def close(self) -> None:
        self._sock.close()
