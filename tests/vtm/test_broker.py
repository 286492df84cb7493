"""The broker (vtmd) with clients in several processes, on the host backend.

Each test starts its own vtmd process on a Unix socket in its temporary
folder (killed in teardown whatever happens); client processes are spawned
with multiprocessing and always joined or killed. Bytes are checked through
each process's own space.tensor() views of the same physical chunks.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import select
import signal
import socket
import time

import numpy as np
import pytest

import vtm
from vtm.broker.seqpacket import _unread_bytes
from vtm.broker.transport import StepTransport
from broker_testing import (CHUNK, ROW, BrokerProcess, RowView, child_allocate, child_extend_forever, child_record,
                            held, pattern)
from broker_testing import broker  # noqa: F401 (a fixture)
from broker_testing import spawn  # noqa: F401 (a fixture)

CTX = multiprocessing.get_context("spawn")




def wait_until(predicate, timeout: float, step: float = 0.02, on_fail=None) -> float:
    """Seconds until predicate() held; fails after `timeout` (saying on_fail())."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"condition not met within {timeout} s" + (f": {on_fail()}" if on_fail else ""))
        time.sleep(step)
    return time.monotonic() - t0


@pytest.mark.parametrize("fast_path", [True, False], ids=["step-socket", "grpc"])
def test_same_api_and_bytes_in_one_client(broker, fast_path):
    with vtm.connect(broker.address, name="solo", fast_path=fast_path) as mgr:
        assert isinstance(mgr._transport, StepTransport) == fast_path
        assert (mgr.backend, mgr.chunk_bytes, mgr.capacity_bytes) == ("host", CHUNK, 16 * CHUNK)
        space = mgr.create_space(row_bytes=ROW, max_tokens=1000, max_slots=3, name="kv")
        assert (space.name, space.row_bytes, space.max_slots, space.free_slots) == ("kv", ROW, 3, 3)
        assert space.slot_bytes == 16 * CHUNK and space.pages_per_slot == 16
        vt = space.create(100).result()
        assert (vt.num_tokens, vt.mapped_bytes) == (100, 2 * CHUNK)
        assert vt.address == space.base_address + vt.slot * space.slot_bytes
        vt.extend(150).result()
        mgr.step({vt: 400}).result()
        assert vt.num_tokens == 400 and vt.mapped_bytes == 7 * CHUNK
        assert [c is not None for c in vt.page_chunks()] == [True] * 7 + [False] * 9
        view = space.tensor(np.uint8)
        view[vt.slot, :400 * ROW] = pattern(range(400))
        assert (view[vt.slot, :400 * ROW] == pattern(range(400))).all()
        stats = mgr.stats()
        assert stats["chunks_held"] == 7 and stats["spaces"]["kv"]["vtensors"] == 1
        assert [c["name"] for c in stats["clients"]] == ["solo"]
        mgr.check()
        assert space.free_slots == 2
        vt.release().result()
        assert vt.released and held(mgr) == 0
        with pytest.raises(vtm.FailedPrecondition):
            vt.extend(10).result()
        with pytest.raises(vtm.FailedPrecondition):
            vt.num_tokens  # noqa: B018
        space.close()
        assert space.closed


@pytest.mark.parametrize("fast_path", [True, False], ids=["step-socket", "grpc"])
def test_errors_map_to_the_in_process_exceptions(broker, fast_path):
    with vtm.connect(broker.address, fast_path=fast_path) as mgr:
        space = mgr.create_space(row_bytes=ROW, max_tokens=100, max_slots=1)
        with pytest.raises(vtm.InvalidArgument):
            mgr.create_space(row_bytes=0, max_tokens=10, max_slots=1)
        with pytest.raises(vtm.InvalidArgument):
            space.create(-1)
        # Past a frame's 64-bit word: refused at the call on both transports
        # (the step socket's create raised struct.error through its future).
        with pytest.raises(vtm.InvalidArgument):
            space.create(1 << 64)
        with pytest.raises(vtm.InvalidArgument):
            space.create(101).result()
        vt = space.create(10).result()
        with pytest.raises(vtm.InvalidArgument):
            mgr.step({vt: 1 << 64})
        with pytest.raises(vtm.InvalidArgument):
            vt.extend(1 << 64)
        with pytest.raises(vtm.OutOfMemory, match="no free slot"):
            space.create(10).result()
        big = mgr.create_space(row_bytes=CHUNK, max_tokens=100, max_slots=1)
        with pytest.raises(vtm.OutOfMemory):
            big.create(17).result()  # 17 chunks > 16 of capacity
        assert held(mgr) == 1  # the failed create changed nothing
        with pytest.raises(vtm.InvalidArgument):
            space.prefix_record(vt, list(range(11))).result()
        with pytest.raises(vtm.InvalidArgument):
            space.prefix_match([2**40]).result()
        # Ids that are not integers are a TypeError, as in process: the
        # client used to truncate 1.5, parse "12" and raise ValueError on "x".
        for bad in ([1.5, 2.5], ["12"], "abc"):
            with pytest.raises(TypeError):
                space.prefix_match(bad)
            with pytest.raises(TypeError):
                space.prefix_restore_bytes(bad)
            with pytest.raises(TypeError):
                space.prefix_record(vt, bad)
        assert space.prefix_nodes() == []
        vt.release().result()
        with pytest.raises(vtm.FailedPrecondition):
            vt.release().result()
        mgr.check()


@pytest.mark.parametrize("fast_path", [True, False], ids=["step-socket", "grpc"])
def test_low_mark_unmaps_below_it_and_refuses_lowering(broker, fast_path):
    """docs/api.md, "The low mark", through vtmd: the same unmaps, the same
    errors, the same bytes above the mark in this process's view."""
    with vtm.connect(broker.address, name="window", fast_path=fast_path) as mgr:
        space = mgr.create_space(row_bytes=ROW, max_tokens=1000, max_slots=2)  # 65.5 rows a page
        view = space.tensor(np.uint8)
        tokens = list(range(600))
        vt, other = space.create(300).result(), space.create(100).result()  # pages 0-4, 0-1
        view[vt.slot, :300 * ROW] = pattern(tokens[:300])
        before = vt.page_chunks()
        vt.extend(400, low=200).result()  # pages 0-2 lie wholly below row 200
        pages = vt.page_chunks()
        assert (vt.num_tokens, vt.low) == (400, 200)
        assert pages[:3] == [None] * 3 and pages[3:5] == before[3:5]
        assert {pages[5], pages[6]} <= set(before[:3]), "two unmapped chunks serve the two new pages"
        assert held(mgr) == 6 and mgr.stats()["chunks_free"] == 1
        assert (view[vt.slot, 200 * ROW:300 * ROW] == pattern(tokens[:300])[200 * ROW:]).all()
        view[vt.slot, 300 * ROW:400 * ROW] = pattern(tokens[:400])[300 * ROW:]
        mgr.step({other: 150, vt: (500, 330)}).result()  # page 4 goes too
        assert (other.num_tokens, other.low, vt.num_tokens, vt.low) == (150, 0, 500, 330)
        assert vt.page_chunks()[:5] == [None] * 5 and vt.page_chunks()[7] is not None
        assert (view[vt.slot, 330 * ROW:400 * ROW] == pattern(tokens[:400])[330 * ROW:]).all()
        state = (vt.num_tokens, vt.low, vt.page_chunks(), other.num_tokens, other.page_chunks(), held(mgr))
        for bad in (lambda: vt.extend(600, low=329), lambda: vt.extend(600, low=601),
                    lambda: mgr.step({other: 300, vt: (600, 100)}), lambda: mgr.step({vt: (600,)}),
                    lambda: vt.extend(600, low=-1)):
            with pytest.raises(vtm.InvalidArgument):
                bad().result()
            assert (vt.num_tokens, vt.low, vt.page_chunks(), other.num_tokens, other.page_chunks(),
                    held(mgr)) == state
        vt.extend(520).result()  # no low: the mark stays
        assert vt.low == 330
        mgr.check()
        # A match makes a vTensor of mark 0; the broker reports it.
        view[other.slot, :150 * ROW] = pattern(tokens[:150])
        space.prefix_record(other, tokens[:150]).result()
        other.release().result()
        match = space.prefix_match(tokens[:150] + [7]).result()
        assert (match.num_tokens, match.vtensor.low) == (150, 0)
        assert (view[match.vtensor.slot, :150 * ROW] == pattern(tokens[:150])).all()
        with pytest.raises(vtm.FailedPrecondition, match="low mark"):
            space.prefix_record(vt, tokens[:500]).result()
        for v in (vt, match.vtensor):
            v.release().result()
        space.clear_prefixes()
        assert held(mgr) == 0
        mgr.check()


@pytest.mark.parametrize("fast_path", [True, False], ids=["step-socket", "grpc"])
def test_window_space_records_holes_and_matches_its_window(broker, fast_path):
    """docs/api.md, "Window spaces", through vtmd: a record with holes, a
    windowed match's pages and low mark, the bytes in this process's view."""
    with vtm.connect(broker.address, name="window", fast_path=fast_path) as mgr:
        space = mgr.create_space(row_bytes=ROW, max_tokens=1000, max_slots=3, namespace="w", window_tokens=100)
        assert space.window_tokens == 100
        with pytest.raises(vtm.InvalidArgument):
            mgr.create_space(row_bytes=ROW, max_tokens=1000, max_slots=1, namespace="w", window_tokens=50)
        view = space.tensor(np.uint8)
        tokens = list(range(1000, 1400))
        vt = space.create(400).result()  # pages 0-6 (65.5 rows a page)
        view[vt.slot, :400 * ROW] = pattern(tokens)
        vt.extend(400, low=270).result()  # pages 0-3 unmapped
        assert space.prefix_record(vt, tokens).result() == 400
        [node] = space.prefix_nodes()
        assert node["pages"][:4] == [None] * 4 and None not in node["pages"][4:]
        vt.release().result()
        assert held(mgr) == 3
        # 400 rows: the window is rows 301-399, pages 4-6.
        match = space.prefix_match(tokens + [7]).result()
        first_row = -(-4 * CHUNK // ROW)  # 263: the first row wholly on page 4
        assert (match.num_tokens, match.vtensor.low) == (400, first_row)
        assert match.vtensor.page_chunks()[:4] == [None] * 4 and match.vtensor.page_chunks()[4:6] == node["pages"][4:6]
        assert (view[match.vtensor.slot, first_row * ROW:400 * ROW] == pattern(tokens)[first_row * ROW:]).all()
        # Leaving the path at row 350 needs rows 251-349: page 3 is a hole.
        assert space.prefix_match(tokens[:350] + [7]).result().num_tokens == 0
        mgr.check()
        match.vtensor.release().result()
        space.clear_prefixes()
        assert held(mgr) == 0


@pytest.mark.parametrize("fast_path", [True, False], ids=["step-socket", "grpc"])
def test_a_record_that_releases_needs_no_free_chunk_through_vtmd(broker, fast_path):
    """prefix_record(..., release=True) through vtmd: with the pool full, a
    plain record has no chunk for its copy of the partial last page; this
    one gives that page to the tree as it is and releases the vTensor
    (unmapped here first). Bad input changes nothing, as in process."""
    with vtm.connect(broker.address, name="swap", fast_path=fast_path) as mgr:
        space = mgr.create_space(row_bytes=ROW, max_tokens=2000, max_slots=4, name="kv")
        view = space.tensor(np.uint8)
        tokens = list(range(2000, 2100))
        vt = space.create(100).result()  # 2 chunks, the second partial
        view[vt.slot, :100 * ROW] = pattern(tokens)
        filler = space.create(14 * 65).result()  # the rest of the pool's 16 chunks
        assert held(mgr) == 16
        with pytest.raises(vtm.OutOfMemory):
            space.prefix_record(vt, tokens).result()
        assert space.prefix_record(vt, tokens, release=True).result() == 100
        assert vt.released and held(mgr) == 16  # the tree holds both chunks now
        with pytest.raises(vtm.FailedPrecondition):
            vt.release().result()
        filler.release().result()
        match = space.prefix_match(tokens + [7]).result()
        assert match.num_tokens == 100
        assert (view[match.vtensor.slot, :100 * ROW] == pattern(tokens)).all()
        match.vtensor.release().result()
        bad = space.create(10).result()
        with pytest.raises(vtm.InvalidArgument):
            space.prefix_record(bad, list(range(11)), release=True).result()
        assert not bad.released
        other = mgr.create_space(row_bytes=ROW, max_tokens=2000, max_slots=1, name="other")
        with pytest.raises(vtm.FailedPrecondition, match="belongs to space"):
            other.prefix_record(bad, list(range(10)), release=True).result()
        assert not bad.released  # it used to be released all the same
        bad.release().result()
        mgr.check()
        space.clear_prefixes()
        assert held(mgr) == 0


def test_two_clients_share_one_pool(broker, spawn):
    q = CTX.Queue()
    with vtm.connect(broker.address, name="parent") as mgr:
        space = mgr.create_space(row_bytes=ROW, max_tokens=4096, max_slots=2)
        vt = space.create(12 * 65).result()  # 12 of the pool's 16 chunks
        assert held(mgr) == 12
        # The child wants 8 chunks: more than the 4 left.
        p = spawn(child_allocate, broker.address, 8 * 65, q)
        assert q.get(timeout=60)[0] == "OutOfMemory"
        p.join(30)
        vt.release().result()
        # Now it fits; the child writes its memory and holds it.
        hold = CTX.Event()
        p = spawn(child_allocate, broker.address, 8 * 65, q, hold)
        status, pages = q.get(timeout=60)
        assert status == "ok" and sum(c is not None for c in pages) == 8
        assert held(mgr) == 8
        clients = {c["name"]: c for c in mgr.stats()["clients"]}
        assert clients["child"]["mapped_bytes"] == 8 * CHUNK and clients["parent"]["mapped_bytes"] == 0
        hold.set()
        p.join(30)
        assert p.exitcode == 0
        wait_until(lambda: held(mgr) == 0, 5)
        mgr.check()


def test_cross_process_prefix_sharing_is_byte_exact(tmp_path, spawn, backend):
    # Host: 64 KiB pages of 65.5 rows; cuda: 2 MiB pages of 104.9 rows.
    chunk, row = (CHUNK, ROW) if backend == "host" else (2 << 20, 20000)
    b = BrokerProcess(tmp_path, capacity_chunks=16, chunk_bytes=chunk, backend=backend)
    try:
        q, go_on, done = CTX.Queue(), CTX.Event(), CTX.Event()
        tokens = list(range(100, 400))  # 300 rows: full pages and a partial last one
        writer = spawn(child_record, b.address, tokens, q, go_on, done, row, backend)
        kind, writer_pages = q.get(timeout=120)
        assert kind == "recorded", writer_pages
        with vtm.connect(b.address, name="reader") as mgr:
            space = mgr.create_space(row_bytes=row, max_tokens=4096, max_slots=4, namespace="shared")
            match = space.prefix_match(tokens + [7]).result()
            assert match.num_tokens == 300
            vt = match.vtensor
            mine = vt.page_chunks()
            full = 300 * row // chunk  # pages wholly below the match: the writer's chunks
            assert full >= 2 and mine[:full] == writer_pages[:full]
            assert mine[full] is not None and mine[full] != writer_pages[full]  # a private copy
            view = RowView(space, backend)
            assert (view.read(vt.slot, 0, 300 * row) == pattern(tokens, row)).all()
            # Writing the next row goes into the private copy only.
            vt.extend(301).result()
            view.write(vt.slot, 300 * row, np.full(row, 99, np.uint8))
            go_on.set()
            assert q.get(timeout=30) == ("intact", True)
            # The writer leaves; the chunks it shared stay valid for the reader.
            done.set()
            writer.join(30)
            assert writer.exitcode == 0
            wait_until(lambda: len(mgr.stats()["clients"]) == 1, 5)
            assert (view.read(vt.slot, 0, 300 * row) == pattern(tokens, row)).all()
            mgr.check()
            vt.release().result()
            space.clear_prefixes()
            assert held(mgr) == 0
    finally:
        b.kill()


def test_sigkill_mid_extend_returns_chunks_within_a_second(tmp_path, spawn):
    b = BrokerProcess(tmp_path, capacity_chunks=1024)
    try:
        q = CTX.Queue()
        with vtm.connect(b.address, name="observer") as mgr:
            # The observer shares the victim's namespace, so the victim's
            # recorded prefix outlives it.
            space = mgr.create_space(row_bytes=ROW, max_tokens=60000, max_slots=1, namespace="doomed")
            p = spawn(child_extend_forever, b.address, q)
            while q.get(timeout=60) < 3000:  # it holds ~46 chunks and keeps extending
                pass
            before = mgr.stats()
            assert before["chunks_held"] > 40
            os.kill(p.pid, signal.SIGKILL)
            p.join(10)
            # Only the tree's 2 pages of the recorded 100 tokens stay held.
            elapsed = wait_until(lambda: held(mgr) == 2, 5.0, on_fail=lambda: mgr.stats())
            assert elapsed <= 1.0, f"the dead client's chunks came back after {elapsed:.2f} s"
            stats = mgr.stats()
            assert [c["name"] for c in stats["clients"]] == ["observer"]
            assert stats["chunks_in_tree"] == 2 and stats["tree_nodes"] == 1
            match = space.prefix_match(list(range(100)) + [0]).result()
            assert match.num_tokens == 100
            match.vtensor.release().result()
            mgr.check()
    finally:
        b.kill()


def test_dead_broker_gives_unavailable_promptly(broker):
    mgr = vtm.connect(broker.address, timeout=10)
    space = mgr.create_space(row_bytes=ROW, max_tokens=1000, max_slots=2)
    vt = space.create(100).result()
    broker.proc.kill()
    broker.proc.wait(10)
    t0 = time.monotonic()
    with pytest.raises(vtm.Unavailable):
        vt.extend(500).result()
    with pytest.raises(vtm.Unavailable):
        space.create(1).result()
    with pytest.raises(vtm.Unavailable):
        mgr.stats()
    assert time.monotonic() - t0 < 3.0
    mgr.close()
    with pytest.raises(vtm.Unavailable):
        vtm.connect(broker.address, timeout=0.5)


def test_sigterm_releases_everything_and_a_restarted_broker_serves(broker):
    old = vtm.connect(broker.address)
    space = old.create_space(row_bytes=ROW, max_tokens=1000, max_slots=2)
    space.create(500).result()
    t0 = time.monotonic()
    assert broker.terminate() == 0
    assert time.monotonic() - t0 < 4.0  # no waiting out the grace period on the client's stream
    assert not any(os.path.exists(broker.path + suffix) for suffix in ("", ".fds", ".step"))
    with pytest.raises(vtm.Unavailable):
        space.create(1).result()
    old.close()
    broker.start()
    with vtm.connect(broker.address) as mgr:
        assert held(mgr) == 0
        vt = mgr.create_space(row_bytes=ROW, max_tokens=1000, max_slots=2).create(500).result()
        assert vt.mapped_bytes == 8 * CHUNK


def test_stale_socket_is_replaced_and_a_live_one_refused(tmp_path):
    b = BrokerProcess(tmp_path, capacity_chunks=4)
    try:
        b.proc.kill()
        b.proc.wait(10)
        assert os.path.exists(b.path)  # left behind by the SIGKILL
        b.start()  # the stale socket is replaced
        second = BrokerProcess.__new__(BrokerProcess)
        second.__dict__.update(b.__dict__)
        with pytest.raises(RuntimeError, match="already listens"):
            second.start()
    finally:
        b.kill()


def test_vtmd_refuses_a_shared_socket_folder_and_bad_addresses(tmp_path):
    import subprocess
    import sys

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    for address, message in ((f"unix:{shared}/sock", "mode 0700"), ("tcp:1234", "unix:PATH")):
        done = subprocess.run([sys.executable, "-m", "vtm.broker", "--listen", address, "--backend", "host"],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not any((shared / name).exists() for name in ("sock", "sock.fds", "sock.step"))


def test_names_a_client_gives_are_short_and_printable(broker):
    """Found by a hostile client: a 100 KB client name and names with
    control characters were kept and shown by stats and vtmctl; a space's
    name and namespace, up to gRPC's 4 MB each for 64 spaces a session, let
    one client make the broker hold gigabytes."""
    from vtm.broker import ctl

    for name in ("x" * 257, "evil\x1b[2J"):
        with pytest.raises(vtm.InvalidArgument, match="a client name must be at most 256 printable"):
            vtm.connect(broker.address, name=name)
        assert ctl.main(["--address", broker.address, "set-quota", name, "--priority", "1"]) == 2
    with vtm.connect(broker.address, name="n" * 256) as mgr:
        for kwargs in (dict(name="s" * 257), dict(namespace="ns" * 600)):
            with pytest.raises(vtm.InvalidArgument, match="at most"):
                mgr.create_space(row_bytes=ROW, max_tokens=10, max_slots=1, **kwargs)
        mgr.create_space(row_bytes=ROW, max_tokens=10, max_slots=1, name="s" * 256, namespace="ns" * 512)
        assert list(mgr.stats()["spaces"]) == ["s" * 256]


def test_fd_socket_gives_only_leased_chunks(broker):
    from vtm.broker.fd_channel import FdClient

    with vtm.connect(broker.address, name="a") as a, vtm.connect(broker.address, name="b") as b:
        vt = a.create_space(row_bytes=ROW, max_tokens=1000, max_slots=1).create(100).result()
        b_space = b.create_space(row_bytes=ROW, max_tokens=1000, max_slots=1)
        b_vt = b_space.create(1).result()
        # b's own lease, a's chunk: refused, no fd.
        stolen = FdClient(a._fds._sock.getpeername(), b._metadata[0][1], 5)
        try:
            a_serials = [serial for serial in range(1, 10) if serial not in (b_vt.page_chunks()[0],)]
            with pytest.raises(PermissionError, match="not leased"):
                stolen.fetch(a_serials[:2])
            with pytest.raises(PermissionError, match="no such lease"):
                FdClient(a._fds._sock.getpeername(), "0" * 32, 5).fetch([1])
        finally:
            stolen.close()
        # Garbage never crashes the fd server; a connection that names no
        # session of its peer is closed after the error.
        for junk in (b"{", b"[]", b'{"lease": 1, "serials": "x"}', os.urandom(300), b"[" * 65_000):
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            raw.settimeout(10)
            raw.connect(a._fds._sock.getpeername())
            raw.send(junk)
            assert b"error" in raw.recv(4096)
            assert raw.recv(64) == b""
            raw.close()
        vt.extend(200).result()  # the broker still serves a's own fds
        assert vt.mapped_bytes == 4 * CHUNK


def test_a_fetch_cannot_multiply_chunk_fds(broker):
    """Found by a hostile client: a fetch naming one serial 200 times got
    200 fds of it, and a peer that fetched on without reading kept 222 such
    replies (44,400 fds) in flight on one connection. Past the user's
    RLIMIT_NOFILE of fds in flight the kernel refuses every fd the broker
    passes, and the broker dropped whichever client it was serving. A
    serial may appear once in a fetch, and a connection that asks again
    before reading its reply is closed: one reply's fds at most wait."""
    with vtm.connect(broker.address, name="a") as a:
        space = a.create_space(row_bytes=ROW, max_tokens=1000, max_slots=1)
        vt = space.create(100).result()
        serial = a._mapper.mapped_from(space.id, vt.slot, 0)[0][3]  # (slot, page, chunk, serial)
        lease = a._metadata[0][1]
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        raw.settimeout(10)
        try:
            raw.connect(a._fds._sock.getpeername())
            raw.send(json.dumps({"lease": lease, "serials": []}).encode())  # binds it to a's session
            assert json.loads(raw.recv(4096)) == {"serials": []}
            raw.send(json.dumps({"lease": lease, "serials": [serial] * 200}).encode())
            reply, fds, _, _ = socket.recv_fds(raw, 4096, 253)
            assert b"none twice" in reply and fds == []
            raw.send(json.dumps({"lease": lease, "serials": [serial]}).encode())
            assert select.select([raw], [], [], 10)[0], "no reply"
            raw.send(json.dumps({"lease": lease, "serials": [serial]}).encode())  # before reading the reply
            deadline = time.monotonic() + 10
            while _unread_bytes(raw) > 0:  # until the broker has read the second request
                assert time.monotonic() < deadline, "the broker does not read"
                time.sleep(0.01)
            reply, fds, _, _ = socket.recv_fds(raw, 4096, 253)
            for fd in fds:
                os.close(fd)
            assert json.loads(reply) == {"serials": [serial]} and len(fds) == 1
            assert raw.recv(4096) == b""  # closed: no second reply
        finally:
            raw.close()
        vt.extend(200).result()  # the client's own connections serve on
        assert vt.mapped_bytes == 4 * CHUNK
        a.check()


def test_proto_stubs_are_fresh(tmp_path):
    pytest.importorskip("grpc_tools")
    import pathlib
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "scripts"))
    try:
        import gen_proto
    finally:
        sys.path.pop(0)
    gen_proto.generate(tmp_path)
    for rel in gen_proto.GENERATED:
        assert (tmp_path / rel).read_bytes() == (gen_proto.SRC / rel).read_bytes(), \
            f"{rel} is stale: run scripts/gen_proto.py"


def test_proto_round_trip():
    from vtm.proto.vtm.v1 import vtm_pb2

    reply = vtm_pb2.OpReply(value=-3, vtensor_id=2**63, matched_tokens=7, vtensors=[
        vtm_pb2.VTensorState(vtensor_id=1, space_id=2, slot=3, num_tokens=4)], effects=[
        vtm_pb2.SpaceEffects(space_id=9, closed=True, pages=[vtm_pb2.PageEffect(slot=1, page=2, chunk=-1)])])
    again = vtm_pb2.OpReply.FromString(reply.SerializeToString())
    assert again == reply and again.effects[0].pages[0].chunk == -1 and again.vtensor_id == 2**63
