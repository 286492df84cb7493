"""Isolation between the broker's clients (issue 17, findings 4, 9 and 11):
a client's memory is freed only when its process is gone or it closed its
session, a freed chunk goes to another client only once every process that
mapped it has unmapped it, and the pool's capacity bounds the memory that
the chunks hold across every process (counted as memfds on the host
backend: the fds and mappings of the broker and of each client)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

import vtm
from broker_testing import (CHUNK, ROW, BrokerProcess, child_allocate, child_allocate_release_hold, child_quarantined,
                            client_state, end_liveness_stream, held, memfd_inodes, pattern, wait_until)
from broker_testing import broker  # noqa: F401 (a fixture)
from broker_testing import spawn  # noqa: F401 (a fixture)
from vtm.broker import step_channel

CTX = multiprocessing.get_context("spawn")
ROWS_PER_CHUNK = 65  # 64 KiB chunks of 1,000-byte rows: n * 65 rows need n chunks




def test_a_live_client_whose_session_ended_keeps_its_chunks(broker):
    # 16 chunks: the victim maps 12 and loses its liveness channel while its
    # process (this one) lives. Its chunks must go to nobody: the other
    # client is refused rather than handed the bytes the victim still maps.
    with vtm.connect(broker.address, name="other") as other:
        victim = vtm.connect(broker.address, name="victim")
        try:
            space = victim.create_space(row_bytes=ROW, max_tokens=2000, max_slots=1)
            vt = space.create(12 * ROWS_PER_CHUNK).result()
            slot, rows = vt.slot, 12 * ROWS_PER_CHUNK
            view = space.tensor(np.uint8)
            view[slot, :rows * ROW] = pattern(range(rows))
            end_liveness_stream(victim)
            wait_until(lambda: client_state(other, "victim") != "live", 10, "the broker saw the channel end")
            ospace = other.create_space(row_bytes=ROW, max_tokens=2000, max_slots=1)
            with pytest.raises(vtm.OutOfMemory):
                ospace.create(12 * ROWS_PER_CHUNK).result()
            small = ospace.create(4 * ROWS_PER_CHUNK).result()  # the 4 free chunks are anybody's
            assert not set(small.page_chunks()[:4]) & set(vt.page_chunks())
            other_view = ospace.tensor(np.uint8)
            other_view[small.slot, :4 * ROWS_PER_CHUNK * ROW] = 77
            assert (view[slot, :rows * ROW] == pattern(range(rows))).all(), "the victim's bytes changed"
            del view
            assert client_state(other, "victim") == "quarantined"
            assert held(other) == 16
            # The victim learns at its next call; it unmaps everything before
            # the error reaches the caller, then closes the session itself.
            with pytest.raises(vtm.Unavailable):
                vt.extend(rows + 1).result()
            assert victim.imports == 0 and victim._mapper.mapped_pages(space.id, slot) == 0
            wait_until(lambda: client_state(other, "victim") is None, 10, "the victim's session closed")
            # The broker forgets the session first, then closes its spaces: under load a
            # stats call may come in between.
            wait_until(lambda: held(other) == 4, 10, "the victim's chunks went back")
            small.release().result()
            assert ospace.create(12 * ROWS_PER_CHUNK).result().mapped_bytes == 12 * 64 * 1024
            other.check()
        finally:
            victim.close()


def test_a_quarantined_clients_chunks_return_when_its_process_exits(broker, spawn):
    q = CTX.Queue()
    child = spawn(child_quarantined, broker.address, 10 * ROWS_PER_CHUNK, q)
    kind, chunks = q.get(timeout=60)
    assert kind == "dropped", chunks
    with vtm.connect(broker.address, name="observer") as mgr:
        wait_until(lambda: client_state(mgr, "cut-off") != "live", 10, "the broker saw the channel end")
        time.sleep(0.5)  # nothing comes back while the process lives
        assert held(mgr) == 10 and client_state(mgr, "cut-off") == "quarantined"
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        wait_until(lambda: held(mgr) == 0 and client_state(mgr, "cut-off") is None, 5, "the exit freed the chunks")
        mgr.check()


def test_only_a_client_that_lives_on_is_reported_quarantined(tmp_path, spawn):
    """A killed process's sockets close a moment before its pidfd reports
    its exit, so its channel ends while it seems to live. vtmd warned for
    about half the clients killed that their memory was quarantined until
    they exit; it warns only of a client still quarantined a second later."""
    b = BrokerProcess(tmp_path, capacity_chunks=64)
    try:
        q, hold = CTX.Queue(), CTX.Event()
        children = [spawn(child_allocate, b.address, 2 * ROWS_PER_CHUNK, q, hold) for _ in range(8)]
        assert [q.get(timeout=120)[0] for _ in children] == ["ok"] * len(children)
        with vtm.connect(b.address, name="observer") as mgr:
            for child in children:
                os.kill(child.pid, signal.SIGKILL)
            wait_until(lambda: client_state(mgr, "child") is None and held(mgr) == 0, 10, "the kills freed the chunks")
            cut_off = vtm.connect(b.address, name="cut-off")
            try:
                end_liveness_stream(cut_off)
                wait_until(lambda: client_state(mgr, "cut-off") == "quarantined", 10, "the broker saw the channel end")
                time.sleep(2.5)  # past the second, and the reaper's next round
            finally:
                cut_off.close()
    finally:
        b.proc.send_signal(signal.SIGTERM)
        try:
            log = b.proc.communicate(timeout=15)[0]  # vtmd's log, its stderr
        finally:
            b.kill()
    warnings = [line for line in log.splitlines() if "quarantined" in line]
    assert len(warnings) == 1 and "'cut-off'" in warnings[0], log


@pytest.mark.parametrize("fast_path", [True, False], ids=["step-socket", "grpc"])
def test_a_release_unmaps_in_the_client_before_the_broker_frees(broker, fast_path):
    with vtm.connect(broker.address, fast_path=fast_path) as mgr:
        space = mgr.create_space(row_bytes=ROW, max_tokens=2000, max_slots=1)
        vt = space.create(4 * ROWS_PER_CHUNK).result()
        slot = vt.slot
        assert mgr._mapper.mapped_pages(space.id, slot) == 4 and mgr.imports == 4
        seen = []  # (pages mapped, chunks imported) when the release leaves for the broker
        if fast_path:
            call = mgr._transport._steps.call

            def spy(op, pairs):
                if op == step_channel.RELEASE:
                    seen.append((mgr._mapper.mapped_pages(space.id, slot), mgr.imports))
                return call(op, pairs)
            mgr._transport._steps.call = spy
        else:
            release = mgr._stub.Release

            def spy(request, **kwargs):
                seen.append((mgr._mapper.mapped_pages(space.id, slot), mgr.imports))
                return release(request, **kwargs)
            mgr._stub.Release = spy
        vt.release().result()
        assert seen == [(0, 0)]
        assert held(mgr) == 0
        mgr.check()


class _UnmapFailsOnce:
    """A client's mapper whose next unmap_slot fails before it unmaps
    anything, as a backend's unmap may (the rest passes through)."""

    def __init__(self, mapper):
        self._mapper = mapper
        self.failures = 0

    def unmap_slot(self, space_id, slot):
        if self.failures == 0:
            self.failures += 1
            raise vtm.BackendError("injected: unmapping the slot failed")
        return self._mapper.unmap_slot(space_id, slot)

    def __getattr__(self, name):
        return getattr(self._mapper, name)


@pytest.mark.parametrize("record", [False, True], ids=["release", "record-and-release"])
def test_a_release_whose_unmap_fails_is_released_at_vtmd_by_the_next(broker, record):
    """A release whose unmap failed here marked the vTensor released and
    never asked vtmd (its pages might still be mapped here), so vtmd held its
    slot and pages until the session ended, and release() was refused. Now
    it stays unusable but not released, and the next release() unmaps it and
    asks vtmd."""
    with vtm.connect(broker.address) as mgr:
        space = mgr.create_space(row_bytes=ROW, max_tokens=2000, max_slots=1)
        vt = space.create(4 * ROWS_PER_CHUNK).result()
        slot = vt.slot
        mapper = mgr._mapper
        mgr._mapper = _UnmapFailsOnce(mapper)
        with pytest.raises(vtm.BackendError, match="injected"):
            if record:
                space.prefix_record(vt, list(range(4 * ROWS_PER_CHUNK)), release=True).result()
            else:
                vt.release().result()
        assert mgr._mapper.failures == 1
        assert not vt.released and space.free_slots == 0
        with pytest.raises(vtm.FailedPrecondition, match=r"release\(\) it again"):
            vt.num_tokens  # noqa: B018 - its release began: unusable
        stats = mgr.stats()
        assert stats["spaces"][space.name]["vtensors"] == 1 and stats["chunks_held"] == 4, stats
        assert space.prefix_nodes() == []  # nothing reached vtmd
        vt.release().result()
        assert vt.released and space.free_slots == 1
        assert mapper.mapped_pages(space.id, slot) == 0 and mgr.imports == 0
        assert mgr.stats()["spaces"][space.name]["vtensors"] == 0 and held(mgr) == 0
        with pytest.raises(vtm.FailedPrecondition, match="already released"):
            vt.release().result()
        assert space.create(4 * ROWS_PER_CHUNK).result().mapped_bytes == 4 * CHUNK  # the slot is free again
        mgr.check()


def test_capacity_bounds_the_memory_of_every_process(tmp_path, spawn):
    # An 8-chunk pool. A former client maps all 8 and releases them; another
    # then takes 8. Its chunks may be the former client's only once that
    # client holds none of them; after a trim, the broker's new chunks plus
    # whatever the former client still holds may not pass the 8.
    b = BrokerProcess(tmp_path, capacity_chunks=8)
    try:
        q, done = CTX.Queue(), CTX.Event()
        former = spawn(child_allocate_release_hold, b.address, 8 * ROWS_PER_CHUNK, q, done)
        kind, imports = q.get(timeout=60)
        assert kind == "released", imports
        assert imports == 0, "the former client still holds the chunks it released"
        with vtm.connect(b.address, name="next") as mgr:
            space = mgr.create_space(row_bytes=ROW, max_tokens=4096, max_slots=1)
            for trim in (False, True):
                if trim:
                    mgr.trim()  # the broker gives its free chunks back: the next 8 are new
                vt = space.create(8 * ROWS_PER_CHUNK).result()
                view = space.tensor(np.uint8)
                view[vt.slot, :8 * ROWS_PER_CHUNK * ROW] = 1
                mine, theirs = memfd_inodes(os.getpid()), memfd_inodes(former.pid)
                assert len(mine) == 8 and not mine & theirs, "a former holder still maps this client's chunks"
                alive = mine | theirs | memfd_inodes(b.proc.pid)
                assert len(alive) <= 8, f"{len(alive)} chunks alive in a pool of 8"
                del view
                vt.release().result()
        done.set()
        former.join(30)
        assert former.exitcode == 0
    finally:
        b.kill()


def test_a_stale_report_of_a_reused_pidfd_number_ends_no_live_session(tmp_path):
    """The reactor may run a pidfd's callback for a report about an earlier
    fd of the same number (a session that ended by its goodbye or channel,
    whose pidfd was closed, its number taken by the next session's pidfd).
    That callback ended the live session: its chunks went back to the pool
    while its process still mapped them. Here the poller's stale report is
    queued by hand: the session stays, and its process's real exit is still
    seen (the watch armed again)."""
    from vtm.broker.server import Broker

    broker = Broker("unix:" + str(tmp_path / "vtmd" / "sock"), backend="host", capacity_bytes=16 * CHUNK,
                    chunk_bytes=CHUNK, granularity=CHUNK)
    try:
        with vtm.connect("unix:" + broker.path, name="live") as mgr:
            space = mgr.create_space(row_bytes=ROW, max_tokens=2000, max_slots=1)
            vt = space.create(4 * ROWS_PER_CHUNK).result()
            view = space.tensor(np.uint8)
            view[vt.slot, :4 * ROWS_PER_CHUNK * ROW] = pattern(range(4 * ROWS_PER_CHUNK))
            session = broker.service.lookup(mgr._lease)
            fd = session.pidfd
            broker.reactor._ready.put((broker.reactor._callbacks[fd], fd))
            time.sleep(0.5)
            assert client_state(mgr, "live") == "live" and held(mgr) == 4
            assert (view[vt.slot, :4 * ROWS_PER_CHUNK * ROW] == pattern(range(4 * ROWS_PER_CHUNK))).all()
            assert vt.extend(5 * ROWS_PER_CHUNK).result() is None and held(mgr) == 5
            mgr.check()
    finally:
        broker.stop()
