"""The broker's step socket (src/vtm/broker/step_channel.py): the fast path of
create / extend / step / release. Same semantics as the gRPC calls (the
other broker tests run over it too, since clients use it by default); here:
replies spanning datagrams, a hung broker, authentication, and a fuzz of
1,000 malformed frames that must neither crash the broker nor change state."""

from __future__ import annotations

import os
import random
import signal
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

import vtm
from broker_testing import ROW, BrokerProcess, held, pattern
from broker_testing import broker  # noqa: F401 (a fixture)
from vtm.broker import step_channel as sc
from vtm.broker.transport import StepTransport


def raw_connection(broker, lease=None) -> socket.socket:
    """A step socket connection, authenticated with `lease` when given."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(10)
    conn.connect(broker.path + ".step")
    if lease is not None:
        conn.send(sc.REQUEST.pack(sc.AUTH, 0, 7) + lease.encode())
        assert sc.REPLY.unpack_from(conn.recv(sc.MAX_DATAGRAM))[:3] == (0, 0, 7)
    return conn


def error_of(reply: bytes):
    """(request id, vtm class name, message) of an error reply."""
    status, nfds, rid, length, _ = sc.REPLY.unpack_from(reply)
    assert (status, nfds, length) == (1, 0, len(reply)), reply
    (n,) = sc.NAME_LEN.unpack_from(reply, sc.REPLY.size)
    start = sc.REPLY.size + sc.NAME_LEN.size
    return rid, reply[start:start + n].decode(), reply[start + n:].decode()


def test_the_client_uses_it_and_a_large_reply_spans_datagrams(tmp_path):
    # 4 KiB chunks: a vTensor of 3,000 pages has a 72 KB reply (two
    # datagrams) and more new chunks than one reply attaches fds for.
    chunk = 4096
    b = BrokerProcess(tmp_path, capacity_chunks=3100, chunk_bytes=chunk)
    try:
        with vtm.connect(b.address, name="big") as mgr:
            assert isinstance(mgr._transport, StepTransport)
            rows = 3000 * chunk // ROW
            space = mgr.create_space(row_bytes=ROW, max_tokens=rows, max_slots=1)
            vt = space.create(rows).result()
            assert vt.mapped_bytes == 3000 * chunk and mgr.imports == 3000
            view = space.tensor(np.uint8)
            data = pattern(range(rows))
            view[vt.slot, :rows * ROW] = data
            assert (view[vt.slot, :rows * ROW] == data).all()
            assert held(mgr) == 3000
            mgr.check()
            vt.release().result()
            assert vt.released and held(mgr) == 0 and space.free_slots == 1
    finally:
        b.kill()


def test_a_hung_broker_gives_unavailable_within_the_deadline(broker):
    mgr = vtm.connect(broker.address, timeout=1.0)
    try:
        vt = mgr.create_space(row_bytes=ROW, max_tokens=1000, max_slots=1).create(10).result()
        os.kill(broker.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(vtm.Unavailable, match="did not answer extend"):
                vt.extend(500).result()
            assert time.monotonic() - t0 < 3.0
            t0 = time.monotonic()
            with pytest.raises(vtm.Unavailable):  # the manager is broken from then on: at once
                mgr.step({vt: 20}).result()
            assert time.monotonic() - t0 < 0.5
        finally:
            os.kill(broker.proc.pid, signal.SIGCONT)
    finally:
        mgr.close()


def test_the_step_socket_authenticates_every_connection(broker):
    with vtm.connect(broker.address, name="a") as a:
        vt = a.create_space(row_bytes=ROW, max_tokens=1000, max_slots=1).create(10).result()
        lease = a._metadata[0][1]
        step = sc.encode_request(sc.STEP, 3, [vt.id, 500])
        # No AUTH first: refused, and the connection is closed.
        conn = raw_connection(broker)
        conn.send(step)
        assert error_of(conn.recv(sc.MAX_DATAGRAM))[1] == "InvalidArgument"
        assert conn.recv(sc.MAX_DATAGRAM) == b""
        conn.close()
        # A lease nobody holds.
        conn = raw_connection(broker)
        conn.send(sc.REQUEST.pack(sc.AUTH, 0, 4) + b"f" * 32)
        assert error_of(conn.recv(sc.MAX_DATAGRAM))[:2] == (4, "Unavailable")
        conn.close()
        # The right lease from another process (its pid is not the session's).
        code = ("import sys, vtm\nfrom vtm.broker.step_channel import StepClient\n"
                "try:\n    StepClient(sys.argv[1], sys.argv[2], 5)\nexcept vtm.Error as e:\n"
                "    print(type(e).__name__, e)\n")
        done = subprocess.run([sys.executable, "-c", code, broker.path + ".step", lease], capture_output=True,
                              text=True, timeout=60, cwd=broker.folder)
        assert done.stdout.startswith("FailedPrecondition") and "does not hold this lease" in done.stdout, done
        assert vt.num_tokens == 10 and held(a) == 1
        # The session's own connection still works; after close, its lease is dead.
        # (a's own mapper is not told: the test stops using a here.)
        conn = raw_connection(broker, lease)
        conn.send(step)
        reply, fds, _, _ = socket.recv_fds(conn, sc.MAX_DATAGRAM, sc.MAX_FDS)
        for fd in fds:
            os.close(fd)
        assert sc.REPLY.unpack_from(reply)[:3] == (0, 7, 3)  # the 7 new chunks' fds attached
        assert held(a) == 8
    # The session ends with the client's goodbye (close), and its step
    # connections with it: nothing is served on them any more.
    conn.settimeout(5)
    try:
        conn.send(step)
        closed = conn.recv(sc.MAX_DATAGRAM) == b""
    except OSError:  # the send or the read found it closed
        closed = True
    assert closed
    conn.close()


# ----------------------------------------------------------------------------- fuzz

def _malformed(rng: random.Random, own_space: int, other_space: int, own_vt: int, other_vt: int) -> bytes:
    """One frame that must be refused: each is invalid, so none may change state."""
    big = rng.choice([1001, 2**62, 2**63, 2**64 - 1])
    rid = rng.randrange(2**64)
    choice = rng.randrange(13)
    if choice == 0:
        return rng.randbytes(rng.randrange(1, 80))  # garbage (a valid header by chance: p ~ 1e-9)
    if choice == 1:  # a header whose count disagrees with the length
        op = rng.choice([sc.CREATE, sc.EXTEND, sc.STEP, sc.RELEASE])
        count = rng.randrange(6)
        size = max(0, sc.PAIR.size * count + rng.choice([-8, -1, 1, 5, 16]))
        size += size == sc.PAIR.size * count  # count 0 and a negative change: one byte too many
        return sc.REQUEST.pack(op, count, rid) + rng.randbytes(size)
    if choice == 2:  # an unknown op (AUTH again included)
        return sc.encode_request(rng.choice([0, sc.AUTH, 10, 99, 2**32 - 1]), rid, [own_vt, 11])
    if choice == 3:  # one-pair ops with several pairs
        op = rng.choice([sc.CREATE, sc.EXTEND, sc.RELEASE, sc.CREATE_AHEAD])
        return sc.encode_request(op, rid, [own_vt, 11] * rng.choice([0, 2, 3]))
    if choice == 4:
        return sc.encode_request(sc.CREATE, rid, [rng.choice([other_space, 0, 999, 2**32 - 1, 2**64 - 1]), 1])
    if choice == 5:
        return sc.encode_request(sc.CREATE, rid, [own_space, big])
    if choice == 6:
        return sc.encode_request(sc.EXTEND, rid, [rng.choice([other_vt, 0, 10**9, 2**64 - 1]), 50])
    if choice == 7:
        return sc.encode_request(sc.EXTEND, rid, [own_vt, big])
    if choice == 8:
        targets = [[own_vt, 50], [rng.choice([other_vt, 12345]), 50]] if rng.random() < 0.5 else [[own_vt, big]]
        rng.shuffle(targets)
        return sc.encode_request(rng.choice([sc.STEP, sc.STEP_AHEAD]), rid, [x for t in targets for x in t])
    if choice == 9:
        return sc.encode_request(sc.RELEASE, rid, [rng.choice([other_vt, 0, 777]), 0])
    if choice == 11:  # a low mark past the rows asked for, or another client's vTensor; pairs where triples go
        words = rng.choice([[own_vt, 5, rng.choice([6, 50, 1001, 2**62, 2**63])], [other_vt, 50, 10], [own_vt, 50]])
        return sc.encode_request(sc.EXTEND_LOW, rid, words)
    if choice == 12:  # one bad entry spoils the step: all or nothing
        targets = [[own_vt, 50, sc.KEEP_LOW], rng.choice([[own_vt, 20, 30], [other_vt, 50, 0], [own_vt, big, 0]])]
        rng.shuffle(targets)
        return sc.encode_request(sc.STEP_LOW, rid, [x for t in targets for x in t])
    # A refused frame with bits flipped where they keep it refused: the count
    # (then it disagrees with the length) or the high half of the first id.
    frame = bytearray(sc.encode_request(rng.choice([sc.EXTEND, sc.RELEASE]), rid, [other_vt, 5]))
    for _ in range(rng.randrange(1, 4)):
        at = rng.choice([4, 5, 6, 7, 20, 21, 22, 23])
        frame[at] ^= 1 << rng.randrange(8)
    if frame[4:8] == b"\x01\x00\x00\x00" and frame[20:24] == b"\x00" * 4:
        frame[23] = 0x80  # flipped back to the original: keep it refused
    return bytes(frame)


def _state(mgr) -> dict:
    stats = mgr.stats()
    stats.pop("ops")
    return stats


def test_fuzz_malformed_frames_change_nothing(broker):
    rng = random.Random(4321)
    with vtm.connect(broker.address, name="fuzzer") as mine, vtm.connect(broker.address, name="bystander") as other:
        own_space = mine.create_space(row_bytes=ROW, max_tokens=1000, max_slots=1)
        own_vt = own_space.create(10).result()
        other_space = other.create_space(row_bytes=ROW, max_tokens=1000, max_slots=2, namespace="theirs")
        other_vt = other_space.create(100).result()
        other_space.prefix_record(other_vt, list(range(100))).result()
        before = _state(other)
        classes = {}
        conn = raw_connection(broker, mine._metadata[0][1])
        try:
            for i in range(1000):
                frame = _malformed(rng, own_space.id, other_space.id, own_vt.id, other_vt.id)
                conn.send(frame)
                rid, name, message = error_of(conn.recv(sc.MAX_DATAGRAM))
                if len(frame) >= sc.REQUEST.size:
                    assert rid == struct.unpack_from("<Q", frame, 8)[0], (i, frame)
                assert name in ("InvalidArgument", "NotFound", "FailedPrecondition"), (i, frame, name, message)
                classes[name] = classes.get(name, 0) + 1
            # Unauthenticated garbage: an error and a closed connection, every time.
            for _ in range(20):
                junk = raw_connection(broker)
                junk.send(rng.randbytes(rng.randrange(1, 300)))
                assert error_of(junk.recv(sc.MAX_DATAGRAM))[1] in ("InvalidArgument", "Unavailable")
                assert junk.recv(sc.MAX_DATAGRAM) == b""
                junk.close()
        finally:
            conn.close()
        assert broker.proc.poll() is None, "the broker died"
        assert _state(other) == before
        assert own_vt.num_tokens == 10 and other_vt.num_tokens == 100
        other.check()
        assert set(classes) == {"InvalidArgument", "NotFound", "FailedPrecondition"}, classes
        # Both clients still work, over their own step sockets.
        mine.step({own_vt: 20}).result()
        assert own_vt.num_tokens == 20
        assert other_space.prefix_match(list(range(101))).result().num_tokens == 100


def test_a_page_that_slides_up_does_not_send_its_fd_again():
    """A window's steady slide unmaps its lowest page and maps the same chunk
    (serial 7) at the next page up, in one step's effects: the client holds
    that chunk throughout, so it is not fresh (no fd dup'ed and sent), while
    a chunk new to the client is, and one it drops for good is forgotten."""
    from vtm.broker.quota import Ask, Quota
    from vtm.broker.session import Session

    session = Session(1, "window", Ask(), Quota())
    assert session.note_effects(1, [(0, 0, 100, 7), (0, 1, 101, 8)]) == [7, 8]
    # Page 0 slides out; its chunk moves to page 2; a new chunk 9 lands on page 3.
    assert session.note_effects(1, [(0, 0, 0, 0), (0, 2, 100, 7), (0, 3, 102, 9)]) == [9]
    assert session.chunk_of == {7: 100, 8: 101, 9: 102}
    assert session.serial_refs == {7: 1, 8: 1, 9: 1}
    # Page 1 slides out for good.
    assert session.note_effects(1, [(0, 1, 0, 0)]) == []
    assert session.chunk_of == {7: 100, 9: 102} and 8 not in session.serial_refs
    assert set(session.pages) == {(1, 0, 2), (1, 0, 3)}
