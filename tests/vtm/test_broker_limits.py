"""Bounded work in the broker (issue 17, findings 5 and 6): idle sessions
hold no thread and are capped (--max-sessions), spaces are bounded by the
pool's capacity and counted per client, and closed spaces cost nothing
(in-process: tests/vtm/test_regressions.py)."""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time

import grpc
import pytest

import vtm
from broker_testing import CHUNK, ROW, BrokerProcess, child_idle_sessions, median_seconds, rss_bytes
from vtm.broker.service import MAX_LISTED_INDEX_BYTES
from vtm.proto.vtm.v1 import vtm_pb2, vtm_pb2_grpc
from broker_testing import spawn  # noqa: F401 (a fixture)
from vtm_testing import UNDER_ASAN

CTX = multiprocessing.get_context("spawn")
MiB = 1 << 20


def honest_work(address: str) -> None:
    """What an engine does: connect, map, write, release, with a short deadline."""
    with vtm.connect(address, name="honest", timeout=10) as mgr:
        space = mgr.create_space(row_bytes=ROW, max_tokens=1000, max_slots=1)
        vt = space.create(300).result()
        vt.extend(600).result()
        assert vt.mapped_bytes == 10 * CHUNK
        vt.release().result()
        mgr.check()


def test_hundreds_of_idle_sessions_leave_the_broker_serving(tmp_path, spawn):
    b = BrokerProcess(tmp_path, capacity_chunks=64, extra_args=["--max-sessions", "1000"])
    try:
        q, done = CTX.Queue(), CTX.Event()
        for _ in range(3):
            spawn(child_idle_sessions, b.address, 100, q, done)
        reports = [q.get(timeout=120) for _ in range(3)]
        assert reports == [("open", 100)] * 3, reports
        honest_work(b.address)
        with vtm.connect(b.address, name="observer") as mgr:
            assert len(mgr.stats()["clients"]) == 301
        done.set()
    finally:
        b.kill()


def test_sessions_beyond_the_cap_are_refused_and_the_others_unaffected(tmp_path):
    b = BrokerProcess(tmp_path, capacity_chunks=64, extra_args=["--max-sessions", "3"])
    managers = []
    try:
        managers = [vtm.connect(b.address, name=f"c{i}") for i in range(3)]
        with pytest.raises(vtm.OutOfMemory, match="at most 3 sessions"):
            vtm.connect(b.address, name="one too many")
        space = managers[0].create_space(row_bytes=ROW, max_tokens=1000, max_slots=1)
        assert space.create(100).result().mapped_bytes == 2 * CHUNK
        managers.pop().close()
        honest_work(b.address)  # a freed place is taken again
    finally:
        for mgr in managers:
            mgr.close()
        b.kill()


def _in_process_broker(tmp_path, max_calls: int, **kwargs):
    """A vtmd in this process, so that a test can hold a session's lock
    (the calls of the session then wait for it, each holding a gRPC thread)."""
    from vtm.broker.server import Broker

    return Broker("unix:" + str(tmp_path / "vtmd" / "sock"), backend="host", capacity_bytes=64 * CHUNK,
                  chunk_bytes=CHUNK, granularity=CHUNK, max_calls_in_flight_per_client=max_calls, **kwargs)


def _creates(mgr, stub, n: int) -> list:
    """n Create calls of `mgr`'s session, sent at once over `stub`."""
    from vtm.broker import status

    space = next(iter(mgr._spaces.values()))
    request = vtm_pb2.CreateRequest(space_id=space.id, num_tokens=100)
    return [stub.Create.future(request, timeout=60, metadata=((status.LEASE_KEY, mgr._lease),)) for _ in range(n)]


def _counted(broker, expected: dict) -> None:
    """Waits until vtmd counts `expected` calls in flight (pid or None -> calls)."""
    deadline = time.monotonic() + 30
    while broker.service.calls_in_flight() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    assert broker.service.calls_in_flight() == expected


def _settle(calls: list, waiting: int) -> list:
    """The calls still waiting once all but `waiting` of them were answered."""
    deadline = time.monotonic() + 30
    while sum(call.done() for call in calls) < len(calls) - waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    return [call for call in calls if not call.done()]


def _assert_refused(call, says: str) -> None:
    from vtm.broker import status

    assert call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, call.details()
    assert says in call.details() and "--max-calls-in-flight-per-client" in call.details(), call.details()
    assert isinstance(status.from_rpc_error(call, "call"), vtm.OutOfMemory)


def test_a_client_cannot_hold_the_brokers_threads_with_calls_in_flight(tmp_path, spawn):
    """Review: a client could keep any number of gRPC calls in flight at once.
    Each one that waits (for memory, up to ~2 s; or, as here, for its
    session's lock, which the session's calls take one at a time) holds one
    of vtmd's 32 gRPC threads, and 40 of them held all: another client's
    calls waited for them. A client has at most
    --max-calls-in-flight-per-client calls in flight (3 here): the calls past
    it are refused at once (RESOURCE_EXHAUSTED, vtm.OutOfMemory, naming the
    flag) and change nothing, and another process is served while the
    first one's 3 calls still wait."""
    from vtm.broker.server import GRPC_THREADS

    broker = _in_process_broker(tmp_path, max_calls=3)
    address = "unix:" + broker.path
    try:
        with vtm.connect(address, name="greedy") as greedy:
            greedy.create_space(row_bytes=ROW, max_tokens=1000, max_slots=4)
            session = broker.service.lookup(greedy._lease)
            with grpc.insecure_channel(address) as channel:
                with session.lock:  # the greedy client's calls wait behind it
                    calls = _creates(greedy, vtm_pb2_grpc.BrokerStub(channel), GRPC_THREADS + 8)
                    q = CTX.Queue()
                    spawn(_honest_child, address, q)
                    assert q.get(timeout=60) == "served"
                    waiting = _settle(calls, 3)
                    assert len(waiting) == 3, f"{len(waiting)} calls of one client in flight"
                    for call in calls:
                        if call not in waiting:
                            _assert_refused(call, "has 3 calls in flight already")
                assert all(call.result().vtensor_id for call in waiting)  # served once the lock is free
            assert len(session.vtensors) == 3  # the refused calls made nothing
            assert broker.service.calls_in_flight() == {}
    finally:
        broker.stop()


def test_the_calls_in_flight_of_a_process_count_together_over_its_sessions(tmp_path, spawn):
    """Review: the cap counted a session's calls, so a process with several
    sessions had --max-calls-in-flight-per-client in each (8 sessions of 4
    held all 32 threads). It counts a process's (the kernel's pid, from each
    session's attach), whatever names its sessions connect under; and the
    lease-free calls a session's lease comes with (vtm.connect's stats) count
    too. Another process is served meanwhile, and the refused calls change
    nothing."""
    broker = _in_process_broker(tmp_path, max_calls=3)
    address = "unix:" + broker.path
    try:
        with vtm.connect(address, name="first") as first, vtm.connect(address, name="second") as second:
            for mgr in (first, second):
                mgr.create_space(row_bytes=ROW, max_tokens=1000, max_slots=4)
            sessions = [broker.service.lookup(mgr._lease) for mgr in (first, second)]
            assert sessions[0].pid == sessions[1].pid == os.getpid()
            with grpc.insecure_channel(address) as channel:
                stub = vtm_pb2_grpc.BrokerStub(channel)
                with sessions[0].lock, sessions[1].lock:
                    calls = _creates(first, stub, 2)
                    _counted(broker, {os.getpid(): 2})
                    calls += _creates(second, stub, 2)  # 2 + 2 of one process: one too many
                    waiting = _settle(calls, 3)
                    assert len(waiting) == 3, f"{len(waiting)} calls of one process in flight"
                    refused = [call for call in calls if call not in waiting]
                    _assert_refused(refused[0], f"process {os.getpid()} (client 'second') has 3 calls in flight "
                                                "already over its sessions together")
                    assert broker.service.calls_in_flight() == {os.getpid(): 3}
                    with pytest.raises(vtm.OutOfMemory, match="has 3 calls in flight already"):
                        first.stats(timeout=10)  # lease-free, but it names the session: counted too
                    q = CTX.Queue()
                    spawn(_honest_child, address, q)
                    assert q.get(timeout=60) == "served"
                assert all(call.result().vtensor_id for call in waiting)
            assert [len(s.vtensors) for s in sessions] == [2, 1]  # the refused call made nothing
            assert broker.service.calls_in_flight() == {}
            assert first.stats(timeout=10)["clients"]
    finally:
        broker.stop()


def test_calls_without_an_attached_session_count_together(tmp_path):
    """Review: lease-free calls (Hello, Stats, Trim, Check, SetQuota) were
    not counted at all, and those that wait (a SetQuota for the sessions it
    changes, a Stats or a Check behind the manager) could hold every gRPC
    thread. gRPC names no process for a Unix socket's peer, so the calls
    that carry no attached session's lease (Hello, vtmctl's) count
    together, as one client: past --max-calls-in-flight-per-client (2 here)
    they are refused at once, changing nothing, while the sessions of an
    attached process are served; a vtm.connect whose Hello is refused so
    asks again, and connects once one of them ends. The TCP control
    listener's calls, on threads of their own, are not counted."""
    from vtm.broker.server import tcp_target

    broker = _in_process_broker(tmp_path, max_calls=2, control="tcp:127.0.0.1:0")
    address = "unix:" + broker.path
    try:
        with vtm.connect(address, name="slow") as slow, vtm.connect(address, name="busy") as busy:
            space = busy.create_space(row_bytes=ROW, max_tokens=1000, max_slots=4)
            session = broker.service.lookup(slow._lease)
            with grpc.insecure_channel(address) as channel, \
                    grpc.insecure_channel(tcp_target(broker.control_address)) as control:
                stub = vtm_pb2_grpc.BrokerStub(channel)
                connected = []
                with session.lock:  # a set-quota for 'slow' waits for it, holding a thread
                    quotas = [stub.SetQuota.future(vtm_pb2.SetQuotaRequest(name="slow", priority=0), timeout=60)
                              for _ in range(2)]
                    _counted(broker, {None: 2})
                    for call in (stub.Stats.future(vtm_pb2.StatsRequest(), timeout=10),
                                 stub.Check.future(vtm_pb2.StatsRequest(), timeout=10),
                                 stub.Trim.future(vtm_pb2.TrimRequest(all=True), timeout=10),
                                 stub.Hello.future(vtm_pb2.HelloRequest(name="late"), timeout=10)):
                        _assert_refused(call, "callers without an attached session (Hello, vtmctl) have 2 calls "
                                              "in flight already")
                    assert [c["name"] for c in busy.stats()["clients"]] == ["slow", "busy"]  # no session made
                    assert space.create(100).result().mapped_bytes == 2 * CHUNK  # an attached process is served
                    stats = vtm_pb2_grpc.BrokerStub(control).Stats(vtm_pb2.StatsRequest(), timeout=10)
                    assert len(json.loads(stats.json)["clients"]) == 2
                    connecting = threading.Thread(target=lambda: connected.append(vtm.connect(address, timeout=30)))
                    connecting.start()
                    time.sleep(0.3)
                    assert not connected  # its Hello is refused, and asked again
                connecting.join(30)
                assert all(call.result() for call in quotas)
                assert len(connected) == 1 and connected[0].stats()["client_id"] == connected[0].client_id
                connected[0].close()
            assert broker.service.calls_in_flight() == {}
    finally:
        broker.stop()


def test_a_release_vtmd_refuses_leaves_the_vtensor_unreleased_until_one_it_answers(tmp_path):
    """A broker client unmaps a vTensor before it asks vtmd to release it,
    and called it released whatever vtmd answered: a refused release (here:
    the process has its call in flight already) left vtmd holding the
    vTensor, its slot and its pages until the session ended, while the
    client counted the slot free and refused a second release(). Now it is
    released once vtmd released it: a second release() asks again."""
    broker = _in_process_broker(tmp_path, max_calls=1)
    address = "unix:" + broker.path
    try:
        with vtm.connect(address, name="client", fast_path=False) as mgr, vtm.connect(address, name="other") as other:
            space = mgr.create_space(row_bytes=ROW, max_tokens=1000, max_slots=1)
            vt = space.create(100).result()
            other.create_space(row_bytes=ROW, max_tokens=1000, max_slots=1)
            other_session = broker.service.lookup(other._lease)
            with grpc.insecure_channel(address) as channel:
                with other_session.lock:
                    [waiting] = _creates(other, vtm_pb2_grpc.BrokerStub(channel), 1)
                    _counted(broker, {os.getpid(): 1})
                    with pytest.raises(vtm.OutOfMemory, match="--max-calls-in-flight-per-client"):
                        vt.release().result()
                assert waiting.result().vtensor_id
            assert not vt.released and space.free_slots == 0  # vtmd holds it and its slot
            with pytest.raises(vtm.FailedPrecondition, match=r"release\(\) it again"):
                vt.num_tokens  # unmapped here: unusable
            assert mgr.stats()["spaces"][space.name]["vtensors"] == 1
            vt.release().result()
            assert vt.released and space.free_slots == 1
            assert mgr.stats()["spaces"][space.name]["vtensors"] == 0
            with pytest.raises(vtm.FailedPrecondition, match="already released"):
                vt.release().result()
            assert space.create(100).result().mapped_bytes == 2 * CHUNK  # the slot is free again
            mgr.check()
    finally:
        broker.stop()


def test_one_process_holds_at_most_its_share_of_the_sessions(tmp_path, spawn):
    """Review: one process could take every place of --max-sessions (one that
    leaks a session per request, say), and then no other client connected.
    A process holds at most a quarter of them, at least 16."""
    b = BrokerProcess(tmp_path, capacity_chunks=64, extra_args=["--max-sessions", "20"])
    managers = []
    try:
        managers = [vtm.connect(b.address, name="leaky", timeout=10) for _ in range(16)]
        with pytest.raises(vtm.OutOfMemory, match="holds 16 sessions of vtmd already"):
            vtm.connect(b.address, name="leaky", timeout=10)
        q = CTX.Queue()
        spawn(_honest_child, b.address, q)
        assert q.get(timeout=60) == "served"  # another process connects and works
        managers.pop().close()
        managers.append(vtm.connect(b.address, name="leaky", timeout=10))  # a closed one frees its place
    finally:
        for mgr in managers:
            mgr.close()
        b.kill()


def _honest_child(address, q):
    try:
        honest_work(address)
        q.put("served")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        q.put(f"{type(exc).__name__}: {exc}")


def test_spaces_are_bounded_by_the_capacity_and_counted_per_client(tmp_path):
    b = BrokerProcess(tmp_path, capacity_chunks=16)
    try:
        with vtm.connect(b.address, name="greedy") as mgr:
            t0 = time.monotonic()
            with pytest.raises(vtm.InvalidArgument, match="page table"):
                mgr.create_space(row_bytes=CHUNK, max_tokens=1, max_slots=2_000_000)
            with pytest.raises(vtm.InvalidArgument, match="page table"):
                mgr.create_space(row_bytes=ROW, max_tokens=1 << 30, max_slots=1)
            assert time.monotonic() - t0 < 5  # refused up front, nothing allocated
            spaces = []
            with pytest.raises(vtm.OutOfMemory, match="spaces"):
                while len(spaces) < 1000:
                    spaces.append(mgr.create_space(row_bytes=ROW, max_tokens=100, max_slots=1))
            assert 8 <= len(spaces) < 1000
            spaces.pop().close()
            spaces.append(mgr.create_space(row_bytes=ROW, max_tokens=100, max_slots=1))  # a closed one frees its place
            with vtm.connect(b.address, name="neighbour") as other:
                other.create_space(row_bytes=ROW, max_tokens=100, max_slots=1)  # counted per client
    finally:
        b.kill()




def _cycles(mgr, n: int) -> None:
    for _ in range(n):
        space = mgr.create_space(row_bytes=ROW, max_tokens=6000, max_slots=4)
        space.create(10).result()
        space.close()


def test_closed_spaces_cost_nothing_in_the_broker(tmp_path):
    b = BrokerProcess(tmp_path, capacity_chunks=16)
    try:
        with vtm.connect(b.address, name="cycler") as mgr:
            _cycles(mgr, 500)  # allocator and caches warm
            rss0, stats0 = rss_bytes(b.proc.pid), median_seconds(mgr.stats)
            # Under AddressSanitizer (make test-sanitize) freed memory waits in
            # its quarantine (256 MiB) before reuse: RSS grows by design there,
            # and is not checked, nor many cycles run.
            _cycles(mgr, 1500 if UNDER_ASAN else 9500)
            rss1, stats1 = rss_bytes(b.proc.pid), median_seconds(mgr.stats)
            if not UNDER_ASAN:
                assert rss1 - rss0 < 16 * MiB, f"vtmd grew from {rss0 / MiB:.1f} to {rss1 / MiB:.1f} MiB"
            assert stats1 < 3 * stats0 + 0.002, f"stats() went from {stats0 * 1e3:.2f} to {stats1 * 1e3:.2f} ms"
            stats = mgr.stats()
            assert stats["spaces"] == {} and stats["chunks_held"] == 0
            mgr.check()
    finally:
        b.kill()


def test_records_of_new_tokens_cannot_grow_the_broker(tmp_path):
    """A client that records its pages under ever new tokens adds nodes but
    no chunks, and before the prefix index had a bound (docs/api.md, "The
    prefix index's bound") grew vtmd by each record's tokens, for all its
    clients. Now the broker's index stays within its budget and the others'
    work goes on."""
    # One malloc arena: each of vtmd's 32 threads would otherwise keep the
    # memory of the requests it decoded in an arena of its own, and the RSS
    # of two equal rounds differ by that (40 MiB in one of three runs).
    b = BrokerProcess(tmp_path, capacity_chunks=32, env={"MALLOC_ARENA_MAX": "1"})
    try:
        with vtm.connect(b.address, name="recorder") as mgr:
            n = 1 << 19
            space = mgr.create_space(row_bytes=1, max_tokens=n, max_slots=1)
            vt = space.create(n).result()
            budget = mgr.stats()["index_budget_bytes"]
            records = 2 * budget // (4 * n)  # twice the budget's worth of tokens
            # A second round, whose tokens replace the first's, for the RSS
            # check; not under AddressSanitizer, where freed memory waits in
            # its quarantine first.
            rounds = 1 if UNDER_ASAN else 2
            rss = []
            for i in range(rounds * records):
                space.prefix_record(vt, list(range(i * n, (i + 1) * n))).result()
                if (i + 1) % records == 0:
                    rss.append(rss_bytes(b.proc.pid))
            st = mgr.stats()
            assert st["tree_tokens"] * 4 <= budget + 4 * n
            assert st["index_bytes"] <= budget + 4 * n + 4096 and st["index_drops_total"] > 0
            if not UNDER_ASAN:
                assert rss[1] - rss[0] < budget // 2, f"vtmd grew from {rss[0] / MiB:.0f} to {rss[1] / MiB:.0f} MiB"
            mgr.check()
        honest_work(b.address)
    finally:
        b.kill()


def test_a_tree_too_large_for_a_reply_is_refused_before_it_is_listed(tmp_path):
    """PrefixNodes built the whole tree in vtmd for each call, however large
    the index budget let it grow (an eighth of the pool and the host tier),
    and a client could not even receive it (gRPC's 4 MiB): a few calls at
    once on a tree of a large pool took more memory than the host has. A
    tree past MAX_LISTED_INDEX_BYTES is refused before anything is built, to
    a client that takes replies of any size too; a small one is listed."""
    b = BrokerProcess(tmp_path, capacity_chunks=32)
    try:
        with vtm.connect(b.address, name="recorder") as mgr:
            n = 1 << 19  # 2 MiB of index a record
            space = mgr.create_space(row_bytes=1, max_tokens=n, max_slots=1, namespace="large")
            vt = space.create(n).result()
            for i in range(MAX_LISTED_INDEX_BYTES // (4 * n) + 1):
                space.prefix_record(vt, list(range(i * n, (i + 1) * n))).result()
            assert mgr.stats()["index_bytes"] > MAX_LISTED_INDEX_BYTES
            with pytest.raises(vtm.FailedPrecondition, match="bytes of index"):
                space.prefix_nodes()
            options = [("grpc.max_receive_message_length", 1 << 30)]
            with grpc.insecure_channel(b.address, options=options) as channel:
                with pytest.raises(grpc.RpcError) as refused:
                    vtm_pb2_grpc.BrokerStub(channel).PrefixNodes(vtm_pb2.SpaceRequest(space_id=space.id), timeout=60,
                                                                metadata=mgr._metadata)
                assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            small = mgr.create_space(row_bytes=ROW, max_tokens=100, max_slots=1, namespace="small")
            small.prefix_record(small.create(10).result(), list(range(10))).result()
            assert [(node["start"], node["end"]) for node in small.prefix_nodes()] == [(0, 10)]
            mgr.check()
        honest_work(b.address)
    finally:
        b.kill()
