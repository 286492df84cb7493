"""vtm.connect(..., map_ahead_pages=L): a growing vTensor keeps L pages
mapped ahead of its rows, and a step that fits in them is decided in the
client, without a round trip (src/vtm/broker/client.py, "mapping ahead").
Checked by the bytes written through the tensor view row by row, by the
broker's own count of the steps it ran, and against the limit and the order
of operations, which must not change."""

from __future__ import annotations

import time

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
def test_a_client_with_a_limit_maps_ahead_within_it_and_fits_what_it_fit_before(tmp_path, limited):
    """Under a 4-page limit, the first vTensor takes 2 pages ahead; the
    third one-page create is refused by the limit, so the client gives its
    pages ahead back and asks again: 4 one-page vTensors fit, as without
    mapping ahead. A fifth page is refused as before. The same with a
    limit the operator sets after the client connected."""
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
            vts = [space.create(10).result()]
            assert vts[0].mapped_bytes == 3 * CHUNK
            vts += [space.create(10).result() for _ in range(3)]
            assert [vt.mapped_bytes for vt in vts] == [CHUNK] * 4
            mgr.step({vts[0]: 60}).result()  # inside its page: fine
            with pytest.raises(vtm.OutOfMemory, match="^client 'tight' is limited"):
                mgr.step({vts[0]: 70}).result()  # a fifth page: refused after the pages ahead went
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


def four_vtensors_with_pages_ahead(mgr, want):
    """4 vTensors of 10 rows, 1 page and 2 ahead each (12 chunks), their
    rows written; and a reclaim handler that records what it is asked."""
    space = mgr.create_space(row_bytes=ROW, max_tokens=1000, max_slots=4)
    view = space.tensor(np.uint8)
    vts = [space.create(10).result() for _ in range(4)]
    for vt in vts:
        view[vt.slot, :10 * ROW] = want[:10 * ROW]
    assert sum(vt.mapped_bytes for vt in vts) == 12 * CHUNK
    asked = []

    def give_back(nbytes):
        asked.append(nbytes)
        vts.pop().release().result()
        return 3 * CHUNK
    mgr.set_reclaim_handler(give_back)
    return view, vts, asked


def they_kept_their_rows_and_grow_on(mgr, view, vts, want, sizes=(60, 120)):
    assert [(vt.num_tokens, vt.mapped_bytes) for vt in vts] == [(10, CHUNK)] * 4
    for vt in vts:
        assert (np.asarray(view[vt.slot, :10 * ROW]) == want[:10 * ROW]).all()
    for n in sizes:  # inside its page, then into a new one
        mgr.step({vt: n for vt in vts}).result()
        for vt in vts:
            view[vt.slot, :n * ROW] = want[:n * ROW]


@pytest.mark.parametrize("asker", ["same-priority", "higher-priority"])
def test_pages_ahead_are_recalled_from_any_client_before_a_sequence_is_asked_for(broker, asker):
    """'owner' maps 12 of the 16 chunks, 8 of them ahead. 'asker' needs 8:
    the broker recalls the pages ahead (whatever the owner's priority),
    which is enough, so no reclaim notice goes out and no sequence of the
    owner's is released. Before, a client of the same priority was refused
    and a lower one lost sequences."""
    from vtm.broker import ctl

    if asker == "higher-priority":
        assert ctl.main(["--address", broker.address, "set-quota", "asker", "--priority", "10"]) == 0
    want = pattern([(5 * i + 1) % 997 for i in range(300)])
    with vtm.connect(broker.address, name="owner", map_ahead_pages=2) as owner, \
            vtm.connect(broker.address, name="asker") as other:
        view, vts, asked = four_vtensors_with_pages_ahead(owner, want)
        theirs = other.create_space(row_bytes=ROW, max_tokens=2000, max_slots=1).create(8 * int(ROWS_PER_PAGE)).result()
        assert theirs.mapped_bytes == 8 * CHUNK
        assert (owner.recall_notices, owner.reclaim_notices, asked) == (1, 0, [])
        theirs.release().result()
        they_kept_their_rows_and_grow_on(owner, view, vts, want)
        for vt in vts:
            vt.release().result()
        owner.check()


def test_a_reclaim_notice_takes_the_pages_ahead_first_and_preempts_nothing(broker):
    """The operator lowers the limit of a client that maps 12 chunks, 8 of
    them ahead, to 6: its reclaim notice is answered by the pages ahead
    alone, and the handler (which releases a sequence) is not called."""
    from vtm.broker import ctl

    want = pattern([(5 * i + 1) % 997 for i in range(300)])
    with vtm.connect(broker.address, name="tenant", map_ahead_pages=2) as mgr:
        view, vts, asked = four_vtensors_with_pages_ahead(mgr, want)
        assert ctl.main(["--address", broker.address, "set-quota", "tenant", "--limit", str(6 * CHUNK)]) == 0
        deadline = time.monotonic() + 10
        while mgr.stats()["chunks_held"] > 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (mgr.reclaim_notices, asked) == (1, [])
        assert {c["name"]: c["owes_bytes"] for c in mgr.stats()["clients"]}["tenant"] == 0
        they_kept_their_rows_and_grow_on(mgr, view, vts, want, sizes=(60,))  # 2 pages more would pass the limit
        for vt in vts:
            vt.release().result()
        mgr.check()


@pytest.mark.parametrize("ahead", [0, 2])
def test_shrink_through_the_broker_gives_pages_back_and_keeps_the_rows(broker, ahead):
    """shrink past the rows grown into is refused here even where the
    broker maps more (its pages ahead); a shrink into a page shared with
    the tree copies it, so the rows written after the new end reach no
    other client's match."""
    tokens = [(3 * i + 2) % 1009 for i in range(300)]
    want = pattern(tokens)
    with vtm.connect(broker.address, name="shrinker", map_ahead_pages=ahead) as mgr, \
            vtm.connect(broker.address, name="reader") as other:
        space = mgr.create_space(row_bytes=ROW, max_tokens=1000, max_slots=2, namespace="ns")
        view = space.tensor(np.uint8)
        vt = space.create(10).result()
        with pytest.raises(vtm.InvalidArgument, match="exceed the 10"):
            vt.shrink(100).result()
        mgr.step({vt: 250}).result()
        view[vt.slot, :250 * ROW] = want[:250 * ROW]
        space.prefix_record(vt, tokens[:130]).result()  # pages 0-1 shared with the tree
        vt.shrink(100).result()
        assert vt.num_tokens == 100 and vt.mapped_bytes == 2 * CHUNK
        assert vt.page_chunks()[2:] == [None] * (len(vt.page_chunks()) - 2)
        assert (np.asarray(view[vt.slot, :100 * ROW]) == want[:100 * ROW]).all()
        with pytest.raises(vtm.InvalidArgument, match="exceed the 100"):
            mgr.shrink({vt: 101}).result()
        mgr.step({vt: 160}).result()
        view[vt.slot, 100 * ROW:160 * ROW] = 0xAB  # its own rows now, not the recorded ones
        theirs = other.create_space(row_bytes=ROW, max_tokens=1000, max_slots=1, namespace="ns")
        match = theirs.prefix_match(tokens[:130] + [1]).result()
        assert match.num_tokens == 130
        assert (np.asarray(theirs.tensor(np.uint8)[match.vtensor.slot, :130 * ROW]) == want[:130 * ROW]).all()
        match.vtensor.release().result()
        vt.release().result()
        mgr.check()


@pytest.mark.parametrize("op", ["create", "step", "prefix_record", "prefix_match"])
def test_a_clients_own_pages_ahead_never_refuse_its_next_allocation(broker, op):
    """vTensors with 2 pages ahead each hold all but at most one of the 16
    chunks. A create or a step that needs 2 or 3 pages, or a record or a
    match that copies a page into the full pool, gives the pages ahead back and runs,
    instead of failing for memory this client holds for steps to come."""
    tokens = [(11 * i + 4) % 1009 for i in range(130)]  # 2 pages, the second partial
    want = pattern(tokens)
    with vtm.connect(broker.address, name="ahead", map_ahead_pages=2) as mgr:
        space = mgr.create_space(row_bytes=ROW, max_tokens=1000, max_slots=8, namespace="ns")
        view = space.tensor(np.uint8)
        first = space.create(len(tokens) if op.startswith("prefix") else 10).result()
        view[first.slot, :first.num_tokens * ROW] = want[:first.num_tokens * ROW]
        if op == "prefix_match":
            space.prefix_record(first, tokens).result()  # the tree copies the partial page
        vts = [first]
        while mgr.stats()["chunks_held"] < (16 if op.startswith("prefix") else 15):
            vts.append(space.create(10).result())
        shrinks = mgr.stats()["ops"].get("shrink", {}).get("count", 0)
        if op == "create":
            vts.append(space.create(3 * int(ROWS_PER_PAGE)).result())
        elif op == "step":
            mgr.step({first: 300}).result()  # 5 pages: 2 more than the 3 it maps
            view[first.slot, 10 * ROW:300 * ROW] = 1
        elif op == "prefix_record":
            assert space.prefix_record(first, tokens).result() == len(tokens)
        else:
            match = space.prefix_match(tokens + [1]).result()
            assert match.num_tokens == len(tokens)
            assert (np.asarray(view[match.vtensor.slot, :len(tokens) * ROW]) == want).all()
            vts.append(match.vtensor)
        assert mgr.stats()["ops"]["shrink"]["count"] == shrinks + 1
        assert (np.asarray(view[first.slot, :10 * ROW]) == want[:10 * ROW]).all()
        for vt in vts:
            vt.release().result()
        mgr.check()


def test_a_clients_own_pages_ahead_go_before_a_lower_prioritys_sequences(broker):
    """'high' maps 12 chunks, 8 of them ahead; 'low' the other 4. high's
    next create is refused at once, gives its own pages ahead back and
    runs: low gets no notice and loses nothing (review: low lost a
    sequence while high kept its pages ahead)."""
    from vtm.broker import ctl

    assert ctl.main(["--address", broker.address, "set-quota", "high", "--priority", "10"]) == 0
    with vtm.connect(broker.address, name="high", map_ahead_pages=2) as high, \
            vtm.connect(broker.address, name="low") as low:
        mine = high.create_space(row_bytes=ROW, max_tokens=1000, max_slots=8)
        hv = [mine.create(10).result() for _ in range(4)]
        theirs = low.create_space(row_bytes=ROW, max_tokens=1000, max_slots=8)
        lv = [theirs.create(10).result() for _ in range(4)]
        asked = []
        low.set_reclaim_handler(lambda n: asked.append(n) or 0)
        hv.append(mine.create(10).result())
        assert (asked, low.reclaim_notices, low.recall_notices) == ([], 0, 0)
        assert high.stats()["chunks_held"] == 9 and all(not vt.released for vt in lv)
        for vt in hv + lv:
            vt.release().result()
        high.check()


def test_a_full_space_gives_back_no_page_ahead(broker):
    """No free slot is not a lack of memory: nothing to give back for it
    (review: every page ahead went, and the create failed anyway)."""
    with vtm.connect(broker.address, name="ahead", map_ahead_pages=2) as mgr:
        space = mgr.create_space(row_bytes=ROW, max_tokens=1000, max_slots=1)
        vt = space.create(10).result()
        with pytest.raises(vtm.OutOfMemory, match="no free slot"):
            space.create(10).result()
        assert vt.mapped_bytes == 3 * CHUNK and "shrink" not in mgr.stats()["ops"]
        vt.release().result()


def test_a_shrink_unmaps_here_first_and_maps_again_what_the_broker_refused(broker):
    """The broker hands a freed chunk to the next client at once, so the
    pages past the new end are unmapped here before it is asked. When it
    refuses (a shared end page to copy into a full pool), they are mapped
    again, with their bytes."""
    tokens = [(13 * i + 5) % 1009 for i in range(130)]
    want = pattern(tokens)
    with vtm.connect(broker.address, name="shrinker") as mgr, vtm.connect(broker.address, name="filler") as other:
        space = mgr.create_space(row_bytes=ROW, max_tokens=1000, max_slots=1, namespace="ns")
        view = space.tensor(np.uint8)
        vt = space.create(len(tokens)).result()  # pages 0-1
        view[vt.slot, :len(tokens) * ROW] = want
        space.prefix_record(vt, tokens).result()  # page 0 shared, page 1 copied for the tree
        # A second match locks the path too: a path one vTensor alone locks
        # gives way before OutOfMemory (the tree's copy of page 1, which vt
        # does not map, would go to the shrink's copy), a shared one does not.
        twin = mgr.create_space(row_bytes=ROW, max_tokens=1000, max_slots=1, namespace="ns")
        matched = twin.prefix_match(tokens + [0]).result().vtensor
        seen = []
        rpc = mgr._rpc

        def spy(what, *args, **kwargs):
            if what == "shrink":
                seen.append(vt.page_chunks()[:2])
            return rpc(what, *args, **kwargs)
        mgr._rpc = spy
        filled = other.create_space(row_bytes=ROW, max_tokens=2000, max_slots=1).create(12 * int(ROWS_PER_PAGE)).result()
        assert mgr.stats()["chunks_held"] == 16
        with pytest.raises(vtm.OutOfMemory):
            vt.shrink(30).result()  # page 0 holds row 30 and is shared: a copy needs a chunk
        assert seen[0][1] is None and seen[0][0] is not None
        assert vt.num_tokens == len(tokens) and vt.mapped_bytes == 2 * CHUNK
        assert (np.asarray(view[vt.slot, :len(tokens) * ROW]) == want).all()
        assert mgr.stats()["prefix_unpins_total"] == 0
        filled.release().result()
        vt.shrink(30).result()
        assert [c is not None for c in vt.page_chunks()[:2]] == [True, False]
        with pytest.raises(vtm.InvalidArgument, match="exceed the 30"):
            vt.shrink(31).result()
        vt.release().result()
        matched.release().result()
        mgr.check()


def test_a_recalled_client_in_the_middle_of_an_allocation_still_takes_its_own_pages_ahead(broker):
    """'owner' maps 12 of the 16 chunks, 8 of them ahead; 'asker' needs 6,
    so the broker recalls owner's pages ahead. Owner's next allocation (5
    pages) reaches the broker before its answer (forced here: its listener
    makes it first). It must still be sent to its own pages ahead, which
    serve it (review: the mark went with the notice, and it failed), and
    the asker still gets its 6 of what is left."""
    with vtm.connect(broker.address, name="owner", map_ahead_pages=2) as owner, \
            vtm.connect(broker.address, name="asker") as asker:
        space = owner.create_space(row_bytes=ROW, max_tokens=1000, max_slots=8)
        vts = [space.create(10).result() for _ in range(4)]
        assert owner.stats()["chunks_held"] == 12
        results = []
        answer = owner._give_back_pages_ahead

        def allocate_then_answer(timeout):
            if not results:
                try:
                    vts.append(space.create(int(5 * ROWS_PER_PAGE)).result())
                    results.append("ok")
                except vtm.OutOfMemory as exc:
                    results.append(str(exc))
            return answer(timeout)
        owner._give_back_pages_ahead = allocate_then_answer
        theirs = asker.create_space(row_bytes=ROW, max_tokens=2000, max_slots=1).create(int(6 * ROWS_PER_PAGE)).result()
        deadline = time.monotonic() + 10
        while not results and time.monotonic() < deadline:
            time.sleep(0.01)  # its shrink answered the recall: the asker may be served first
        assert results == ["ok"], results
        assert owner.recall_notices == 1 and owner.stats()["chunks_held"] == 4 + 5 + 6
        theirs.release().result()
        for vt in vts:
            vt.release().result()
        owner.check()


def test_a_client_that_does_not_say_it_gives_pages_ahead_back_gets_none(broker, monkeypatch):
    """A client built before RECALL notices ignores them and keeps its pages
    ahead under pressure, and every asker would wait for its answer: the
    broker grants pages ahead only to a client whose hello says it gives
    them back (gives_back_ahead). Here a hello without it: the client maps
    exactly, and a client short of memory asks it for nothing."""
    from vtm.broker import client as client_module

    def hello_of_an_older_client(cls, what, **fields):
        fields.pop("gives_back_ahead", None)
        return cls(**fields)
    monkeypatch.setattr(client_module, "_message", hello_of_an_older_client)
    older = vtm.connect(broker.address, name="older", map_ahead_pages=2)
    monkeypatch.undo()
    with older, vtm.connect(broker.address, name="asker") as asker:
        space = older.create_space(row_bytes=ROW, max_tokens=1000, max_slots=4)
        vts = [space.create(10).result() for _ in range(4)]
        assert [vt.mapped_bytes for vt in vts] == [CHUNK] * 4
        theirs = asker.create_space(row_bytes=ROW, max_tokens=2000, max_slots=1)
        with pytest.raises(vtm.OutOfMemory):
            theirs.create(13 * int(ROWS_PER_PAGE)).result()  # 13 pages, 12 free: nothing to recall
        assert older.recall_notices == 0
        assert theirs.create(12 * int(ROWS_PER_PAGE)).result().mapped_bytes == 12 * CHUNK
        for vt in vts:
            vt.release().result()


def test_a_match_past_the_limit_only_with_the_pages_ahead_gives_them_back_first(broker):
    """Under a 4-page limit, 'tight' maps one page and one ahead; a match of
    another client's 3-page prefix fits the limit only without the page
    ahead. The broker refused it outright (the limit's check of the pages a
    match maps came after the match, without the "maps pages ahead"
    refusal), so the client kept a page nobody uses and lost the match."""
    from vtm.broker import ctl

    row = CHUNK // 4  # whole pages: a match copies nothing
    tokens = list(range(12))  # 3 pages
    assert ctl.main(["--address", broker.address, "set-quota", "tight", "--limit", str(4 * CHUNK)]) == 0
    with vtm.connect(broker.address, name="writer") as writer, \
            vtm.connect(broker.address, name="tight", map_ahead_pages=1) as tight:
        recorded = writer.create_space(row_bytes=row, max_tokens=64, max_slots=1, namespace="ns")
        vt = recorded.create(len(tokens)).result()
        recorded.prefix_record(vt, tokens, release=True).result()
        space = tight.create_space(row_bytes=row, max_tokens=64, max_slots=2, namespace="ns")
        own = space.create(1).result()
        assert own.mapped_bytes == 2 * CHUNK  # its page and one ahead
        match = space.prefix_match(tokens + [99]).result()
        assert match.num_tokens == len(tokens) and match.vtensor.mapped_bytes == 3 * CHUNK
        assert own.mapped_bytes == CHUNK
        match.vtensor.release().result()
        own.release().result()
        tight.check()


def test_a_client_that_closed_the_space_of_its_pages_ahead_is_not_recalled(broker):
    """'owner' maps 12 of the 16 chunks, 8 of them ahead, then closes the
    space: the pool and its count get every chunk back, and it maps no page
    ahead any more, as after a release of its last vTensor. The broker kept
    counting it as mapping pages ahead (CloseSpace did not say it gave them
    back), so a client short of memory sent it a recall notice and waited
    for the answer of a client that held nothing."""
    with vtm.connect(broker.address, name="owner", map_ahead_pages=2) as owner, \
            vtm.connect(broker.address, name="asker") as asker:
        space = owner.create_space(row_bytes=ROW, max_tokens=1000, max_slots=4)
        for _ in range(4):
            space.create(10).result()
        assert owner.stats()["chunks_held"] == 12
        space.close()
        assert owner.stats()["chunks_held"] == 0
        assert {c["name"]: c["mapped_bytes"] for c in owner.stats()["clients"]} == {"owner": 0, "asker": 0}
        owner.check()
        theirs = asker.create_space(row_bytes=ROW, max_tokens=2000, max_slots=1)
        with pytest.raises(vtm.OutOfMemory, match="pool capacity exhausted"):
            theirs.create(17 * int(ROWS_PER_PAGE)).result()  # 17 pages, 16 free: nothing to recall
        assert owner.recall_notices == 0
