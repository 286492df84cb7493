"""vtm.connect(..., map_ahead_pages=L): a growing vTensor keeps L pages
mapped ahead of its rows, and a step that fits in them is decided in the
client, without a round trip (src/vtm/broker/client.py, "mapping ahead").
Checked by the bytes written through the tensor view row by row, by the
broker's own count of the steps it ran, and against the limit and the order
of operations, which must not change."""

from __future__ import annotations

import numpy as np
import pytest

import vtm
from broker_testing import CHUNK, ROW, BrokerProcess, pattern
from broker_testing import broker  # noqa: F401 (a fixture)

ROWS_PER_PAGE = CHUNK / ROW  # 65.5: rows straddle pages


def broker_steps(mgr) -> int:
    """Steps the broker's manager ran (every client's)."""
    return mgr.stats()["ops"].get("step", {}).get("count", 0)


def test_steps_inside_the_pages_ahead_take_no_round_trip_and_every_row_is_mapped(broker):
    tokens = [(7 * i + 3) % 1009 for i in range(600)]
    want = pattern(tokens)
    with vtm.connect(broker.address, name="ahead", map_ahead_pages=1) as mgr, \
            vtm.connect(broker.address, name="reader") as other:
        space = mgr.create_space(row_bytes=ROW, max_tokens=1000, max_slots=2, namespace="ns")
        view = space.tensor(np.uint8)
        vt = space.create(1).result()
        view[vt.slot, :ROW] = want[:ROW]
        before = broker_steps(mgr)
        for n in range(2, len(tokens) + 1):
            mgr.step({vt: n}).result()
            assert vt.num_tokens == n
            view[vt.slot, (n - 1) * ROW:n * ROW] = want[(n - 1) * ROW:n * ROW]  # faults if not mapped
        ran = broker_steps(mgr) - before
        # One refill a page (about 9 pages), not one step a row (599).
        assert 0 < ran <= -(-len(tokens) // int(ROWS_PER_PAGE)) + 1, ran
        assert vt.mapped_bytes <= (-(-len(tokens) * ROW // CHUNK) + 1) * CHUNK
        space.prefix_record(vt, tokens).result()  # the broker holds at least the rows asked for
        vt.release().result()
        mgr.check()
        theirs = other.create_space(row_bytes=ROW, max_tokens=1000, max_slots=2, namespace="ns")
        match = theirs.prefix_match(tokens + [1]).result()
        assert match.num_tokens == len(tokens)
        assert (np.asarray(theirs.tensor(np.uint8)[match.vtensor.slot, :len(tokens) * ROW]) == want).all()
        match.vtensor.release().result()


def test_a_create_maps_ahead_too_and_a_batched_step_decides_each_vtensor(broker):
    with vtm.connect(broker.address, name="ahead", map_ahead_pages=2) as mgr:
        space = mgr.create_space(row_bytes=ROW, max_tokens=1000, max_slots=4)
        vts = [space.create(10 * k + 1).result() for k in range(4)]
        for vt, k in zip(vts, range(4)):
            assert vt.num_tokens == 10 * k + 1 and vt.mapped_bytes == 3 * CHUNK  # its page and two ahead
        before = broker_steps(mgr)
        for i in range(1, 120):
            mgr.step({vt: 10 * k + 1 + i for k, vt in enumerate(vts)}).result()
        assert [vt.num_tokens for vt in vts] == [10 * k + 120 for k in range(4)]
        crossed = sum(-(-(10 * k + 120) * ROW // CHUNK) - (-(-(10 * k + 1) * ROW // CHUNK)) for k in range(4))
        assert 0 < broker_steps(mgr) - before <= crossed  # refills only, at most one a page
        view = space.tensor(np.uint8)
        for vt in vts:
            view[vt.slot, :vt.num_tokens * ROW] = 1
        for vt in vts:
            vt.release().result()
        mgr.check()


@pytest.mark.parametrize("limited", ["at-connect", "while-connected"])
def test_a_client_with_a_limit_maps_exactly_and_fits_what_it_fit_before(tmp_path, limited):
    """Pages ahead are given back only with their vTensor: under a limit
    they would refuse an allocation that fits without them (4 one-page
    vTensors under a 4-page limit), so a client with a limit maps none.
    A limit the operator sets after the client connected: the broker
    refuses its pages ahead from then on, and it maps exactly too."""
    from vtm.broker import ctl

    extra = []
    if limited == "at-connect":
        quota = tmp_path / "quotas.toml"
        quota.write_text(f'[clients."tight"]\nlimit_bytes = {4 * CHUNK}\n')
        extra = ["--quota-file", str(quota)]
    b = BrokerProcess(tmp_path, capacity_chunks=16, extra_args=extra)
    try:
        with vtm.connect(b.address, name="tight", map_ahead_pages=2) as mgr:
            if limited == "while-connected":
                assert ctl.main(["--address", b.address, "set-quota", "tight", "--limit", str(4 * CHUNK)]) == 0
            space = mgr.create_space(row_bytes=ROW, max_tokens=1000, max_slots=4)
            vts = [space.create(10).result() for _ in range(4)]
            assert [vt.mapped_bytes for vt in vts] == [CHUNK] * 4
            mgr.step({vts[0]: 60}).result()  # inside its page: fine
            with pytest.raises(vtm.OutOfMemory, match="limited"):
                mgr.step({vts[0]: 70}).result()  # a fifth page
            for vt in vts:
                vt.release().result()
            mgr.check()
    finally:
        b.kill()


def test_pages_ahead_never_ask_other_clients_for_memory(broker):
    """A full pool refuses the rows asked ahead at once (the exact rows are
    then asked as usual): no lower-priority client gets a reclaim notice
    for pages nobody needs yet."""
    from vtm.broker import ctl

    assert ctl.main(["--address", broker.address, "set-quota", "high", "--priority", "10"]) == 0
    with vtm.connect(broker.address, name="low") as low, \
            vtm.connect(broker.address, name="high", map_ahead_pages=4) as high:
        held = low.create_space(row_bytes=ROW, max_tokens=2000, max_slots=1).create(14 * int(ROWS_PER_PAGE)).result()
        space = high.create_space(row_bytes=ROW, max_tokens=1000, max_slots=2)
        vt = space.create(10).result()  # 1 page of the 2 free: the 4 ahead would need a reclaim
        assert vt.mapped_bytes == CHUNK and low.reclaim_notices == 0
        # The refused create still took its page's rows: steps inside it need no round trip.
        before = broker_steps(high)
        for n in range(11, 60):
            high.step({vt: n}).result()
        assert vt.num_tokens == 59 and broker_steps(high) == before
        assert low.reclaim_notices == 0 and held.mapped_bytes == 14 * CHUNK
        vt.release().result()
        held.release().result()


def test_pages_ahead_take_free_memory_only_and_never_evict_a_cached_prefix(broker):
    """'low' holds 10 pages and keeps a 4-page prefix in the tree, 2 chunks
    are free. A create of 1 page with 4 ahead would have evicted the prefix
    for pages nobody needs yet; it takes its 1 page from the free 2 instead."""
    with vtm.connect(broker.address, name="low") as low, \
            vtm.connect(broker.address, name="ahead", map_ahead_pages=4) as ahead:
        space = low.create_space(row_bytes=ROW, max_tokens=2000, max_slots=2, namespace="ns")
        held = space.create(int(10 * ROWS_PER_PAGE)).result()
        tokens = list(range(int(4 * ROWS_PER_PAGE) - 1))
        vt = space.create(len(tokens)).result()
        space.prefix_record(vt, tokens).result()
        vt.release().result()
        assert low.stats()["chunks_in_tree"] == 4
        theirs = ahead.create_space(row_bytes=ROW, max_tokens=1000, max_slots=1, namespace="other")
        mine = theirs.create(10).result()
        assert mine.mapped_bytes == CHUNK
        stats = low.stats()
        assert stats["chunks_in_tree"] == 4 and stats["evictions_total"] == 0, stats
        match = space.prefix_match(tokens + [10**6]).result()
        assert match.num_tokens == len(tokens)
        for v in (match.vtensor, mine, held):
            v.release().result()


def test_a_record_past_the_rows_the_vtensor_holds_is_refused_as_without_map_ahead(broker):
    """The broker counts the rows mapped ahead as the vTensor's; the client
    still refuses a record of rows never grown into (they hold no KV)."""
    for ahead in (0, 2):
        with vtm.connect(broker.address, name=f"rec{ahead}", map_ahead_pages=ahead) as mgr:
            space = mgr.create_space(row_bytes=ROW, max_tokens=1000, max_slots=1)
            vt = space.create(10).result()
            with pytest.raises(vtm.InvalidArgument, match="holds only 10"):
                space.prefix_record(vt, list(range(100))).result()
            mgr.step({vt: 12}).result()
            assert space.prefix_record(vt, list(range(12))).result() == 12
            assert space.prefix_nodes()[0]["end"] == 12
            vt.release().result()
            mgr.check()


def test_a_step_after_a_release_still_fails_in_order(broker):
    """A step submitted after its vTensor's release is not decided in the
    client: it runs after the release, on the broker, and fails there."""
    with vtm.connect(broker.address, name="ahead", map_ahead_pages=1) as mgr:
        space = mgr.create_space(row_bytes=ROW, max_tokens=1000, max_slots=1)
        vt = space.create(10).result()
        released = vt.release()
        with pytest.raises(vtm.Error):
            mgr.step({vt: 11}).result()
        released.result()
        mgr.check()


def test_map_ahead_pages_must_be_a_count(broker):
    with pytest.raises(vtm.InvalidArgument, match="map_ahead_pages"):
        vtm.connect(broker.address, map_ahead_pages=-1)
