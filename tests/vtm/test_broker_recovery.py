"""A broker restart is a preemption, not a failure (issue 17, finding 8).

A client whose session is lost (the broker was SIGKILLed and restarted)
reports vtm.Unavailable and `healthy` False; `reconnect()` opens a new
session and rebuilds its spaces at the same reservations, so the tensor
views a model holds keep working; and `vtm.connect` waits for a broker that
is still starting instead of failing at once.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import numpy as np
import pytest

import vtm
from broker_testing import CHUNK, ROW, BrokerProcess, RowView, held, pattern
from broker_testing import broker  # noqa: F401 (a fixture)


def test_connect_waits_for_a_broker_that_is_starting(tmp_path):
    """`vtmd & flexinfer serve --manager ...` failed at once: "no such socket"."""
    folder = tmp_path / "b"
    folder.mkdir()
    result = {}

    def connect():
        try:
            result["mgr"] = vtm.connect("unix:" + str(folder / "vtmd" / "sock"), timeout=30)
        except vtm.Error as exc:
            result["error"] = exc

    client = threading.Thread(target=connect)
    client.start()
    time.sleep(0.5)  # the client is waiting: no socket yet
    assert client.is_alive(), result
    broker = BrokerProcess(folder)
    try:
        client.join(30)
        assert "mgr" in result, result
        mgr = result["mgr"]
        vt = mgr.create_space(row_bytes=ROW, max_tokens=100, max_slots=1).create(50).result()
        assert vt.mapped_bytes == CHUNK
        mgr.close()
    finally:
        broker.kill()
    with pytest.raises(vtm.Unavailable, match="no such socket"):
        vtm.connect("unix:" + str(tmp_path / "nowhere" / "sock"), timeout=0.3)


@pytest.mark.parametrize("socket_there", [False, True], ids=["no-socket-yet", "socket-refuses"])
def test_connect_stops_waiting_once_its_stop_is_set(tmp_path, socket_there):
    """`stop` ends connect's wait for a broker at once, whether the socket is
    not there yet or is there and refuses (a dead vtmd's): a server told to
    stop while it started waited for the whole timeout."""
    path = tmp_path / "sock"
    refusing = None
    if socket_there:  # bound, never listening: a connection is refused, as at a dead vtmd's socket
        refusing = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        refusing.bind(str(path))
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    start = time.monotonic()
    try:
        with pytest.raises(vtm.Unavailable, match="stopped waiting for the vtm broker at .*: its stop was set"):
            vtm.connect(f"unix:{path}", timeout=60, stop=stop)
    finally:
        if refusing is not None:
            refusing.close()
    assert time.monotonic() - start < 5


def test_connect_refuses_a_stop_that_is_no_event(tmp_path):
    with pytest.raises(vtm.InvalidArgument, match="stop must be a threading.Event, got True"):
        vtm.connect(f"unix:{tmp_path / 'sock'}", timeout=60, stop=True)


def test_a_restarted_broker_gets_the_spaces_back_at_the_same_reservation(broker):
    mgr = vtm.connect(broker.address, timeout=5)
    space = mgr.create_space(row_bytes=ROW, max_tokens=1000, max_slots=2, namespace="recovery")
    view = RowView(space, "host")
    base = space.base_address
    tokens = list(range(300))
    vt = space.create(300).result()
    view.write(vt.slot, 0, pattern(tokens))
    space.prefix_record(vt, tokens).result()
    assert mgr.healthy

    broker.kill()
    with pytest.raises(vtm.Unavailable):
        vt.extend(600).result()
    assert not mgr.healthy
    assert mgr.imports == 0  # revoked: nothing of the lost session stays mapped here
    with pytest.raises(vtm.Unavailable):
        mgr.reconnect(timeout=0.5)  # no broker yet
    assert not mgr.healthy

    broker.start()
    mgr.reconnect(timeout=10)
    assert mgr.healthy and mgr.reconnects == 1
    assert vt.released  # the old session's vTensors are gone with it
    assert space.base_address == base and not space.closed
    assert (space.namespace, space.row_bytes, space.max_slots) == ("recovery", ROW, 2)
    # The old view of the space maps the new session's chunks.
    again = space.create(300).result()
    view.write(again.slot, 0, pattern(tokens))
    assert np.array_equal(view.read(again.slot, 0, 300 * ROW), pattern(tokens))
    # The restarted broker's tree is empty: nothing matches until recorded anew.
    assert space.prefix_match(tokens + [9]).result().num_tokens == 0
    space.prefix_record(again, tokens).result()
    match = space.prefix_match(tokens[:200] + [9]).result()
    assert match.num_tokens == 200
    assert np.array_equal(view.read(match.vtensor.slot, 0, 200 * ROW), pattern(tokens[:200]))
    match.vtensor.release().result()
    again.release().result()
    mgr.check()
    mgr.close()
    # The new session ended cleanly: the broker holds nothing of it.
    with vtm.connect(broker.address, timeout=5) as other:
        other.create_space(row_bytes=ROW, max_tokens=10, max_slots=1)
        stats = other.stats()
        assert [c["name"] for c in stats["clients"]] == [other.name]
        other.trim()
        assert held(other) == 0


def test_spaces_come_back_when_new_ids_collide(broker):
    """Review of finding 8: spaces were renamed one at a time, so a new id
    equal to another space's old one failed the reconnect."""
    mine = vtm.connect(broker.address, timeout=5)
    first = mine.create_space(row_bytes=ROW, max_tokens=100, max_slots=1, name="first")  # id 1
    second = mine.create_space(row_bytes=ROW, max_tokens=100, max_slots=2, name="second")  # id 2
    views = [(space, RowView(space, "host"), space.base_address) for space in (first, second)]
    broker.kill()
    with pytest.raises(vtm.Unavailable):
        first.create(1).result()
    broker.start()
    other = vtm.connect(broker.address, timeout=5)
    other.create_space(row_bytes=ROW, max_tokens=100, max_slots=1)  # takes id 1: "first" becomes 2
    try:
        mine.reconnect(timeout=10)
        assert (first.id, second.id) == (2, 3)
        for space, view, base in views:
            assert space.base_address == base and not space.closed
            vt = space.create(50).result()
            view.write(vt.slot, 0, pattern(list(range(50))))
            assert np.array_equal(view.read(vt.slot, 0, 50 * ROW), pattern(list(range(50))))
            vt.release().result()
        mine.check()
    finally:
        other.close()
        mine.close()


def test_a_space_closed_while_the_session_is_lost_stays_closed(broker):
    """Found reviewing an engine built across a broker restart: close() on a
    lost session raised Unavailable and kept the space, and reconnect() then
    rebuilt it in the new session, where nobody would ever close it. The
    session took the space with it: close() now succeeds, and reconnect()
    brings back only the spaces still open; a space whose id a new one takes
    does not get in its way."""
    mine = vtm.connect(broker.address, timeout=5)
    kept = mine.create_space(row_bytes=ROW, max_tokens=100, max_slots=1, name="kept")
    gone = mine.create_space(row_bytes=ROW, max_tokens=100, max_slots=1, name="gone")
    vt = gone.create(10).result()
    broker.kill()
    with pytest.raises(vtm.Unavailable):
        kept.create(1).result()
    gone.close()
    assert gone.closed and vt.released
    for use in (lambda: gone.create(1), gone.close):
        with pytest.raises(vtm.FailedPrecondition, match="closed"):
            use()
    broker.start()
    try:
        mine.reconnect(timeout=10)
        assert list(mine.stats()["spaces"]) == ["kept"]
        assert not kept.closed and kept.create(50).result().mapped_bytes == CHUNK
        again = mine.create_space(row_bytes=ROW, max_tokens=100, max_slots=1, name="gone")
        assert again.create(10).result().mapped_bytes == CHUNK
        mine.check()
    finally:
        mine.close()


def test_a_space_whose_close_finds_the_session_lost_stays_closed(broker):
    """Review: only a close() that knew the session lost kept its space
    from coming back. One that found out itself (the broker stopped
    answering during it) raised Unavailable, and reconnect() rebuilt the
    space in the new session, where nobody would ever close it."""
    mine = vtm.connect(broker.address, timeout=1)
    kept = mine.create_space(row_bytes=ROW, max_tokens=100, max_slots=1, name="kept")
    gone = mine.create_space(row_bytes=ROW, max_tokens=100, max_slots=1, name="gone")
    gone.create(10).result()
    os.kill(broker.proc.pid, signal.SIGSTOP)
    try:
        try:
            gone.close()
        except vtm.Unavailable:
            pass
        else:  # once, in a run of two pytest workers on two cores: why, not known
            pytest.fail(f"close() returned; the session was lost before it: {mine._liveness.broken!r}")
        assert not mine.healthy
    finally:
        os.kill(broker.proc.pid, signal.SIGCONT)
    try:
        mine.reconnect(timeout=10)
        assert list(mine.stats()["spaces"]) == ["kept"] and gone.closed
        with pytest.raises(vtm.FailedPrecondition, match="closed"):
            gone.create(1)
        assert kept.create(50).result().mapped_bytes == CHUNK
        mine.check()
    finally:
        mine.close()


def test_a_rebuild_the_new_broker_refuses_half_way_changes_nothing(tmp_path):
    """Review of finding 8: a reconnect that failed half way lost the spaces
    it had not rebuilt, and the next one "succeeded" with none left. The
    restarted broker here has a smaller capacity, so its page-table budget
    (64 entries a chunk, at least 2^20) refuses the second space."""
    broker = BrokerProcess(tmp_path, capacity_chunks=32768)  # a budget of 2^21 entries
    try:
        mgr = vtm.connect(broker.address, timeout=5)
        small = mgr.create_space(row_bytes=ROW, max_tokens=100, max_slots=1, name="small")
        large = mgr.create_space(row_bytes=ROW, max_tokens=100, max_slots=70000, name="large")  # 1.19M entries
        broker.kill()
        with pytest.raises(vtm.Unavailable):
            small.create(1).result()
        broker.capacity_bytes = 64 * CHUNK  # a budget of 2^20 entries: "large" no longer fits
        broker.start()
        with pytest.raises(vtm.Error) as refused:
            mgr.reconnect(timeout=10)
        assert not isinstance(refused.value, vtm.Unavailable)
        assert not mgr.healthy and not small.closed and not large.closed
        with vtm.connect(broker.address, timeout=5) as probe:  # the half-made session left nothing behind
            assert [c["name"] for c in probe.stats()["clients"]] == [probe.name]
        broker.kill()
        broker.capacity_bytes = 32768 * CHUNK
        broker.start()
        mgr.reconnect(timeout=10)
        assert mgr.healthy and small.create(10).result().mapped_bytes == CHUNK
        assert large.create(10).result().mapped_bytes == CHUNK
        mgr.check()
        mgr.close()
    finally:
        broker.kill()


def test_a_broker_back_with_another_chunk_size_is_refused_every_time(tmp_path):
    """Found by fuzzing engines through vtmd: the refused reconnect had
    already taken the new broker's chunk size, so the next one compared it
    with itself and succeeded, and an engine computed on reservations that
    did not fit (a segfault). And once refused, the right broker was refused
    too. Now the client keeps its geometry until a reconnect is accepted."""
    broker = BrokerProcess(tmp_path)
    try:
        mgr = vtm.connect(broker.address, timeout=5)
        space = mgr.create_space(row_bytes=ROW, max_tokens=100, max_slots=2)
        broker.kill()
        with pytest.raises(vtm.Unavailable):
            space.create(1).result()
        broker.chunk_bytes *= 2
        broker.capacity_bytes *= 2
        broker.start()
        for _ in range(2):
            with pytest.raises(vtm.FailedPrecondition, match="chunks of"):
                mgr.reconnect(timeout=10)
            assert not mgr.healthy and mgr.chunk_bytes == CHUNK
        with vtm.connect(broker.address, timeout=5) as probe:  # the refused sessions left nothing behind
            assert [c["name"] for c in probe.stats()["clients"]] == [probe.name]
        broker.kill()
        broker.chunk_bytes //= 2
        broker.capacity_bytes //= 2
        broker.start()
        mgr.reconnect(timeout=10)
        assert mgr.healthy and space.create(10).result().mapped_bytes == CHUNK
        mgr.check()
        mgr.close()
    finally:
        broker.kill()


def test_operations_of_the_lost_session_never_reach_the_new_one(broker):
    mgr = vtm.connect(broker.address, timeout=5)
    space = mgr.create_space(row_bytes=ROW, max_tokens=1000, max_slots=4)
    vts = [space.create(100).result() for _ in range(2)]
    broker.kill()
    with pytest.raises(vtm.Unavailable):
        space.create(1).result()
    stale = [vt.extend(500) for vt in vts]  # queued in the lost session
    broker.start()
    mgr.reconnect(timeout=10)
    for fut in stale:
        with pytest.raises((vtm.Unavailable, vtm.FailedPrecondition)):
            fut.result()
    fresh = space.create(100).result()
    assert held(mgr) == 2  # only the new vTensor's pages (2 chunks of rows of 1000 bytes)
    fresh.release().result()
    mgr.check()
    mgr.close()


def test_reconnect_on_a_healthy_or_closed_manager(broker):
    mgr = vtm.connect(broker.address, timeout=5)
    mgr.reconnect()  # healthy: nothing to do
    assert mgr.reconnects == 0
    mgr.close()
    assert not mgr.healthy
    with pytest.raises(vtm.FailedPrecondition):
        mgr.reconnect()
    with vtm.Manager(backend="host", capacity_bytes=4 * CHUNK, chunk_bytes=CHUNK, granularity=CHUNK) as local:
        assert local.healthy
        local.reconnect()
    assert not local.healthy
    assert os.path.exists(broker.path)
