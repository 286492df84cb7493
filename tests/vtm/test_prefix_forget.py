"""space.prefix_forget(tokens): one record taken back. The nodes only that
record needed leave the tree with their chunks and host-tier blocks; what
another record ends at, what hangs below, or what a live vTensor locks stays.
Checked by the bytes (vtm_testing.RowIO patterns), by the pool's and the
tier's counts coming back, and by Manager.check() after every step."""

from __future__ import annotations

import numpy as np
import pytest

import vtm
from broker_testing import broker  # noqa: F401 (a fixture)
from vtm_testing import (SENTINEL, RowIO, assert_pool_consistent, assert_same_state, chunk_for, fill_pool,
                         snapshot)

CHUNKS = 8


def setup(make_manager, backend, tier_chunks=0, window_tokens=0, chunks=CHUNKS):
    chunk = chunk_for(backend)
    # No slot cache: every chunk a released vTensor held is the tree's or free.
    mgr = make_manager(backend, chunks=chunks, host_tier_bytes=tier_chunks * chunk, slot_cache_bytes=0)
    sp = mgr.create_space(row_bytes=chunk // 20 + 7, max_tokens=200, max_slots=8,  # rows straddle pages
                          window_tokens=window_tokens)
    return mgr, sp, RowIO(sp, backend)


def record(sp, io, tokens, low=0):
    """A vTensor of `tokens` (their patterns written; pages below row `low`
    unmapped), recorded whole, released."""
    vt = sp.create(len(tokens)).result()
    io.write(vt, tokens, 0, len(tokens))
    if low:
        vt.extend(len(tokens), low=low).result()
    sp.prefix_record(vt, tokens).result()
    vt.release().result()


def matches(sp, io, tokens):
    """How far a match of `tokens` reaches, its rows checked against the patterns."""
    m = sp.prefix_match(tokens + [SENTINEL]).result()
    if m.vtensor is not None:
        io.verify(m.vtensor, tokens, m.vtensor.low, m.num_tokens, what="match:")
        m.vtensor.release().result()
    return m.num_tokens


def test_forget_gives_every_chunk_of_the_record_back(backend, make_manager):
    mgr, sp, io = setup(make_manager, backend)
    free_before = mgr.stats()["chunks_free"]
    tokens = list(range(100, 160))
    record(sp, io, tokens)
    assert matches(sp, io, tokens) == len(tokens)  # the recorded bytes, before they are forgotten
    assert mgr.stats()["chunks_in_tree"] > 0
    assert sp.prefix_forget(tokens).result() == len(tokens)
    st = assert_pool_consistent(mgr)
    assert sp.prefix_nodes() == []
    assert (st["chunks_in_tree"], st["tree_nodes"], st["tree_tokens"]) == (0, 0, 0)
    assert st["chunks_held"] == 0 and st["chunks_free"] >= free_before
    assert matches(sp, io, tokens) == 0
    assert sp.prefix_forget(tokens).result() == 0  # once only


def test_forget_keeps_what_other_records_need(backend, make_manager):
    """A sibling's branch, a record ending inside the forgotten path and a
    second record of the same path keep their nodes and bytes."""
    mgr, sp, io = setup(make_manager, backend, chunks=32)  # room for every record: nothing evicted
    common = list(range(40))
    a, b = common + list(range(500, 530)), common + list(range(700, 725))
    short = a[:50]  # a record that a's path goes on past
    for tokens in (a, b, short):
        record(sp, io, tokens)
    assert sp.prefix_forget(a).result() == len(a) - len(short)
    assert_pool_consistent(mgr)
    assert matches(sp, io, b) == len(b) and matches(sp, io, short) == len(short)
    assert matches(sp, io, a) == len(short)
    assert sp.prefix_forget(short).result() == len(short) - len(common)  # the common part is b's too
    assert matches(sp, io, b) == len(b)
    record(sp, io, b)  # b twice: one forget leaves the other record
    assert sp.prefix_forget(b).result() == 0
    assert matches(sp, io, b) == len(b)
    assert sp.prefix_forget(b).result() == len(b)
    st = assert_pool_consistent(mgr)
    assert sp.prefix_nodes() == [] and st["chunks_held"] == 0


def test_forget_leaves_the_path_a_live_vtensor_locks(backend, make_manager):
    mgr, sp, io = setup(make_manager, backend)
    tokens = list(range(60))
    record(sp, io, tokens)
    m = sp.prefix_match(tokens + [SENTINEL]).result()
    assert sp.prefix_forget(tokens).result() == 0
    assert_pool_consistent(mgr)
    nodes = sp.prefix_nodes()
    assert nodes and all(n["locks"] == 1 for n in nodes)
    io.verify(m.vtensor, tokens, 0, len(tokens), what="locked:")
    m.vtensor.release().result()
    # The record was taken back; the nodes it left go with a later forget of the path.
    assert sp.prefix_forget(tokens).result() == len(tokens)
    st = assert_pool_consistent(mgr)
    assert sp.prefix_nodes() == [] and st["chunks_held"] == 0


@pytest.mark.parametrize("window", [0, 30], ids=["whole", "window"])
def test_forgetting_a_spilled_record_frees_its_host_blocks(backend, make_manager, window):
    mgr, sp, io = setup(make_manager, backend, tier_chunks=16, window_tokens=window)
    kept, gone = list(range(60)), list(range(1000, 1060))
    record(sp, io, kept, low=20 if window else 0)
    record(sp, io, gone, low=20 if window else 0)
    fill_pool(sp)
    st = assert_pool_consistent(mgr)
    assert all(n["on_host"] for n in sp.prefix_nodes()) and st["host_tier_nodes"] == 2
    used = st["host_tier_used_bytes"]
    assert sp.prefix_forget(gone).result() == len(gone)
    st = assert_pool_consistent(mgr)
    assert st["host_tier_nodes"] == 1 and 0 < st["host_tier_used_bytes"] < used
    assert matches(sp, io, kept) == len(kept)  # restored, byte for byte
    assert sp.prefix_forget(kept).result() == len(kept)
    st = assert_pool_consistent(mgr)
    assert (st["host_tier_used_bytes"], st["host_tier_nodes"], st["tree_nodes"], st["chunks_held"]) == (0, 0, 0, 0)


def test_forgetting_what_the_tree_does_not_hold_changes_nothing(backend, make_manager):
    mgr, sp, io = setup(make_manager, backend)
    tokens = list(range(60))
    record(sp, io, tokens)
    before = snapshot(mgr, [sp], {})
    for other in ([], [9999], tokens[:30], tokens + [5], tokens[:-1] + [5]):
        assert sp.prefix_forget(other).result() == 0
    assert_same_state(before, snapshot(mgr, [sp], {}), allow_reclaim=False)
    fill_pool(sp)  # no tier: the record is evicted
    assert sp.prefix_nodes() == []
    assert sp.prefix_forget(tokens).result() == 0
    assert_pool_consistent(mgr)


def test_bad_arguments_are_typed_errors_that_change_nothing(backend, make_manager):
    mgr, sp, io = setup(make_manager, backend)
    tokens = list(range(60))
    record(sp, io, tokens)
    before = snapshot(mgr, [sp], {})
    for bad in ([1.5], ["12"], "abc", None):
        with pytest.raises(TypeError):
            sp.prefix_forget(bad)
    assert_same_state(before, snapshot(mgr, [sp], {}), allow_reclaim=False)
    other = mgr.create_space(row_bytes=sp.row_bytes, max_tokens=200, max_slots=1)
    other.close()
    with pytest.raises(vtm.FailedPrecondition):
        other.prefix_forget(tokens).result()
    mgr.close()
    with pytest.raises(vtm.FailedPrecondition):
        sp.prefix_forget(tokens)


def test_forget_through_vtmd(broker):  # noqa: F811 (the fixture)
    from broker_testing import ROW, RowView, pattern

    with vtm.connect(broker.address, name="forgetter") as mgr:
        sp = mgr.create_space(row_bytes=ROW, max_tokens=1000, max_slots=2)
        tokens = list(range(300))
        vt = sp.create(len(tokens)).result()
        view = sp.tensor(np.uint8)
        view[vt.slot, :len(tokens) * ROW] = pattern(tokens)
        sp.prefix_record(vt, tokens, release=True).result()
        assert mgr.stats()["chunks_in_tree"] > 0
        m = sp.prefix_match(tokens + [SENTINEL]).result()
        assert (RowView(sp, "host").read(m.vtensor.slot, 0, len(tokens) * ROW) == pattern(tokens)).all()
        assert sp.prefix_forget(tokens).result() == 0  # the match locks it
        m.vtensor.release().result()
        sp.prefix_record(sp.prefix_match(tokens + [SENTINEL]).result().vtensor, tokens, release=True).result()
        assert sp.prefix_forget(tokens).result() == len(tokens)
        assert sp.prefix_forget([1, 2]).result() == 0
        assert sp.prefix_nodes() == []
        st = mgr.stats()
        assert (st["chunks_in_tree"], st["tree_nodes"], st["chunks_held"]) == (0, 0, 0)
        for bad in ([1.5], ["12"], "abc"):
            with pytest.raises(TypeError):
                sp.prefix_forget(bad)
        with pytest.raises(vtm.InvalidArgument):
            sp.prefix_forget([2**40]).result()
        sp.close()
        with pytest.raises(vtm.FailedPrecondition):
            sp.prefix_forget(tokens)
        mgr.check()
