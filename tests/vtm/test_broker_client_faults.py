"""A broker client whose own memory calls fail (a map, an unmap, an import in
this process, not at the broker): its mappings must still follow the
broker's, or its session must end; and it must never tell the broker that it
unmapped what it still maps.

On the host backend an unmap or a map is an mmap, which fails with ENOMEM
once a process has vm.max_map_count mappings; on CUDA it is a driver call.
The client's mapper is built with faults=True here (its backend inside a
FaultInjectingBackend), so each failure is a real call failing part-way
through the client's work."""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest

import vtm
from broker_testing import ROW, client_state, held, pattern, wait_until
from broker_testing import broker  # noqa: F401 (a fixture)
from vtm import _core

ROWS_PER_CHUNK = 65  # 64 KiB chunks of 1,000-byte rows: n * 65 rows need n chunks


@pytest.fixture
def faulty_clients(monkeypatch):
    """Every vtm.connect from here on builds its mapper with faults=True:
    mgr._mapper.faults is its FaultInjector."""
    monkeypatch.setattr(_core, "ClientMapper", functools.partial(_core.ClientMapper, faults=True))


def holds_its_bytes(space, chunks: int) -> None:
    """A new vTensor of `chunks` chunks in `space` reads back what is written through the space's view."""
    rows = chunks * ROWS_PER_CHUNK
    vt = space.create(rows).result()
    view = space.tensor(np.uint8)
    view[vt.slot, :rows * ROW] = pattern(range(rows))
    assert (view[vt.slot, :rows * ROW] == pattern(range(rows))).all()


@pytest.mark.parametrize("failing", [1, 2], ids=["first-vtensor", "second-vtensor"])
def test_a_shrink_whose_unmap_fails_here_keeps_every_page_and_byte(broker, faulty_clients, failing):
    """A shrink unmaps here before it asks the broker. When the second
    vTensor's unmap failed, the first's pages stayed unmapped while the
    broker kept them, and the error said nothing changed: its rows faulted
    at the next write (a segfault on the host backend), and its rows mapped
    ahead were still counted as mapped. Now every page unmapped is mapped
    again, the bytes are where they were, and the shrink can be retried."""
    with vtm.connect(broker.address, name="shrinker") as mgr:
        space = mgr.create_space(row_bytes=ROW, max_tokens=2000, max_slots=2)
        rows = 4 * ROWS_PER_CHUNK
        vts = [space.create(rows).result() for _ in range(2)]
        view = space.tensor(np.uint8)
        for i, vt in enumerate(vts):
            view[vt.slot, :rows * ROW] = pattern(range(i, i + rows))
        mgr._mapper.faults.fail_nth("unmap", failing)
        with pytest.raises(vtm.BackendError, match="injected"):
            mgr.shrink({vt: ROWS_PER_CHUNK for vt in vts}).result()
        assert mgr.healthy
        for i, vt in enumerate(vts):
            assert mgr._mapper.mapped_pages(space.id, vt.slot) == 4
            assert vt.num_tokens == rows
            assert (view[vt.slot, :rows * ROW] == pattern(range(i, i + rows))).all()
        assert held(mgr) == 8
        mgr.check()
        mgr.shrink({vt: ROWS_PER_CHUNK for vt in vts}).result()
        assert [mgr._mapper.mapped_pages(space.id, vt.slot) for vt in vts] == [1, 1]
        assert held(mgr) == 2
        for i, vt in enumerate(vts):
            assert (view[vt.slot, :ROWS_PER_CHUNK * ROW] == pattern(range(i, i + rows))[:ROWS_PER_CHUNK * ROW]).all()
        mgr.check()


@pytest.mark.parametrize("fast_path", [True, False], ids=["step-socket", "grpc"])
@pytest.mark.parametrize("op, nth", [("import_fd", 2), ("map", 2), ("set_access", 1)])
def test_a_reply_that_cannot_be_mapped_here_ends_the_session(broker, faulty_clients, op, nth, fast_path):
    """The broker grew a vTensor and this process failed to map the new
    pages (the second page's import or map failed, or the one set_access
    of their run). The error reached the caller as
    a BackendError with the session still up, and the broker counted pages
    as the vTensor's that were not mapped here: the next extend within them
    asked nothing of the broker, and a write to them faulted. Now the
    session is lost (Unavailable) and revoked before the caller sees it; a
    reconnect starts from what the broker says."""
    with vtm.connect(broker.address, name="watcher") as other, \
            vtm.connect(broker.address, name="client", fast_path=fast_path) as mgr:
        space = mgr.create_space(row_bytes=ROW, max_tokens=2000, max_slots=1)
        vt = space.create(ROWS_PER_CHUNK).result()
        mgr._mapper.faults.fail_nth(op, nth)
        with pytest.raises(vtm.Unavailable, match="mapping what the vtm broker changed failed in this process"):
            vt.extend(5 * ROWS_PER_CHUNK).result()
        assert not mgr.healthy
        assert mgr._mapper.mapped_pages(space.id, vt.slot) == 0 and mgr.imports == 0
        wait_until(lambda: client_state(other, "client") is None, 10, "the session said goodbye")
        wait_until(lambda: held(other) == 0, 10, "the broker freed the session's chunks")
        mgr.reconnect()
        holds_its_bytes(space, 5)
        assert held(other) == 5
        mgr.check()


def lose_a_session_that_cannot_unmap(mgr):
    """A space and a vTensor of 4 chunks whose extend loses the session (its
    second new page fails to map here), and whose revoke fails to unmap the
    pages mapped so far: (space, vTensor)."""
    space = mgr.create_space(row_bytes=ROW, max_tokens=2000, max_slots=1)
    vt = space.create(ROWS_PER_CHUNK).result()
    mgr._mapper.faults.fail_nth("map", 2)
    mgr._mapper.faults.fail_nth("unmap", 1)
    with pytest.raises(vtm.Unavailable):
        vt.extend(4 * ROWS_PER_CHUNK).result()
    return space, vt


def test_a_client_says_no_goodbye_while_it_cannot_unmap(broker, faulty_clients):
    """The session is lost and the revoke's unmap fails, so a page is still
    mapped here. The client said goodbye anyway, and the broker handed the
    page's chunk to the next client while this process could still write
    it. Now it says none until it has unmapped everything: here at close(),
    whose unmap succeeds."""
    with vtm.connect(broker.address, name="other") as other:
        mgr = vtm.connect(broker.address, name="stuck")
        try:
            space, vt = lose_a_session_that_cannot_unmap(mgr)
            assert mgr._mapper.mapped_pages(space.id, vt.slot) > 0
            time.sleep(0.5)
            assert client_state(other, "stuck") == "live" and held(other) == 4
            ospace = other.create_space(row_bytes=ROW, max_tokens=2000, max_slots=1)
            with pytest.raises(vtm.OutOfMemory):
                ospace.create(13 * ROWS_PER_CHUNK).result()  # 12 of the 16 chunks are anybody's, not the stuck 4
        finally:
            mgr.close()
        wait_until(lambda: client_state(other, "stuck") is None, 10, "the goodbye at close")
        assert held(other) == 0
        assert ospace.create(16 * ROWS_PER_CHUNK).result().mapped_bytes == 16 * 64 * 1024


def test_a_close_whose_unmap_fails_says_no_goodbye(broker, faulty_clients):
    with vtm.connect(broker.address, name="other") as other:
        mgr = vtm.connect(broker.address, name="closing")
        space = mgr.create_space(row_bytes=ROW, max_tokens=2000, max_slots=1)
        space.create(3 * ROWS_PER_CHUNK).result()
        mgr._mapper.faults.fail_nth("unmap", 1)
        mgr.close()
        wait_until(lambda: client_state(other, "closing") == "quarantined", 10, "the broker saw the session end")
        assert held(other) == 3


def test_a_reconnect_waits_until_the_lost_sessions_pages_are_unmapped(broker, faulty_clients):
    """The revoke of a lost session could not unmap a page. reconnect()
    then moved the spaces into the new session through reservations that
    still mapped it: the rename failed part-way, the spaces were dropped,
    and a second reconnect() came back healthy with none (every create
    failed from then on). Now reconnect() unmaps what is left first and
    refuses, changing nothing, while it cannot; once it can, the old
    session says goodbye and the spaces come back."""
    with vtm.connect(broker.address, name="other") as other, vtm.connect(broker.address, name="stuck") as mgr:
        space, _ = lose_a_session_that_cannot_unmap(mgr)
        mgr._mapper.faults.fail_nth("unmap", 1)  # nor the reconnect's first try
        with pytest.raises(vtm.BackendError, match="still maps chunks of the lost vtm session"):
            mgr.reconnect()
        assert not mgr.healthy and not space.closed and client_state(other, "stuck") == "live"
        mgr.reconnect()
        assert mgr.healthy and mgr._mapper.mapped_pages(space.id, 0) == 0
        wait_until(lambda: held(other) == 0, 10, "the old session said goodbye")
        holds_its_bytes(space, 3)
        assert held(other) == 3
        mgr.check()


def test_a_close_whose_unmap_fails_leaves_its_vtensors_held_not_released(broker, faulty_clients):
    """A space's close marked its vTensors released before it unmapped
    them; when the unmap failed, the broker kept the space, its vTensors and
    their chunks, while `released` said they were gone (FlexInfer forgets a
    swap record once its vTensors are released). Now they stay unusable but
    not released, and a second close() closes it all."""
    with vtm.connect(broker.address, name="other") as other, vtm.connect(broker.address, name="closing") as mgr:
        space = mgr.create_space(row_bytes=ROW, max_tokens=2000, max_slots=2)
        vts = [space.create(2 * ROWS_PER_CHUNK).result() for _ in range(2)]
        mgr._mapper.faults.fail_nth("unmap", 2)
        with pytest.raises(vtm.BackendError, match="injected"):
            space.close()
        assert [vt.released for vt in vts] == [False, False] and not space.closed
        with pytest.raises(vtm.FailedPrecondition, match=r"release\(\) it again"):
            vts[0].num_tokens  # noqa: B018 - unusable
        assert held(other) == 4
        space.close()
        assert [vt.released for vt in vts] == [True, True] and space.closed
        assert held(other) == 0 and mgr.imports == 0
        mgr.check()
