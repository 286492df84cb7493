"""Regression tests for bugs a review of the manager found (each failed before its fix)."""

import threading

import pytest

import vtm
from vtm_testing import BACKEND, CHUNK as C, SCALE, new_manager


def manager(capacity_chunks, **kw):
    """A manager of `capacity_chunks` chunks on the backend under test."""
    return new_manager(chunks=capacity_chunks, **kw)


def test_match_is_capped_at_the_spaces_max_tokens_in_a_shared_namespace():
    # A longer space of the same namespace recorded 50 tokens; the short space's
    # slots hold one page. The match used to index past the slot's page table.
    mgr = manager(64)
    big = mgr.create_space(row_bytes=4096 * SCALE, max_tokens=100, max_slots=2, namespace="m", name="big")
    small = mgr.create_space(row_bytes=4096 * SCALE, max_tokens=10, max_slots=4, namespace="m", name="small")
    vt = big.create(50).result()
    tokens = list(range(50))
    big.prefix_record(vt, tokens).result()
    m = small.prefix_match(tokens + [999]).result()
    assert m.num_tokens == 10 and m.vtensor.num_tokens == 10
    assert len(m.vtensor.page_chunks()) == 1
    mgr.check()
    others = [small.create(10).result() for _ in range(3)]  # the other slots are intact
    assert sorted(o.slot for o in others) == [1, 2, 3]
    mgr.check()
    mgr.close()


def test_a_failed_unmap_while_reclaiming_a_cached_slot_keeps_the_accounting():
    mgr = manager(4, slot_cache_bytes=4 * C, faults=True)
    s = mgr.create_space(row_bytes=C // 4, max_tokens=16, max_slots=1, name="s")
    t = mgr.create_space(row_bytes=C // 4, max_tokens=16, max_slots=1, name="t")
    v0 = s.create(9).result()
    s.prefix_record(v0, list(range(8))).result()
    v0.release().result()
    v1 = s.create(4).result()
    v1.release().result()  # the slot caches pages {0, 2}: two runs to unmap
    before = mgr.stats()
    mgr.faults.fail_nth("unmap", 2)
    with pytest.raises(vtm.BackendError):
        t.create(8).result()  # needs the cached slot's chunks
    mgr.check()
    after = mgr.stats()
    for key in ("chunks_created", "chunks_free", "chunks_held", "chunks_cached", "chunks_in_tree"):
        assert after[key] == before[key], key
    mgr.close()


def test_a_match_never_evicts_the_prefix_it_is_matching():
    mgr = manager(4, slot_cache_bytes=0, max_free_chunks=0)
    s = mgr.create_space(row_bytes=C // 4, max_tokens=16, max_slots=2, name="s")
    a, b = [1, 2, 3, 4, 5, 6], [9] * 8
    for seq in (a, b):
        vt = s.create(len(seq)).result()
        s.prefix_record(vt, seq).result()
        vt.release().result()
    m = s.prefix_match(a + [7]).result()  # the pool is full: the copy evicts b, the newer one
    assert m.num_tokens == 6
    assert [n["tokens"] for n in s.prefix_nodes()] == [a]
    assert mgr.stats()["evictions_total"] == 1
    mgr.check()
    m.vtensor.release().result()
    assert s.prefix_match(a + [7]).result().num_tokens == 6
    mgr.close()


def test_a_capacity_out_of_memory_in_match_changes_nothing():
    mgr = manager(3, slot_cache_bytes=4 * C)
    s = mgr.create_space(row_bytes=C // 4, max_tokens=16, max_slots=1, name="s")
    a = [1, 2, 3, 4, 5, 6]
    vt = s.create(len(a)).result()
    s.prefix_record(vt, a).result()
    vt.release().result()  # its private last page stays cached in the only slot
    before = mgr.stats()
    with pytest.raises(vtm.OutOfMemory):
        s.prefix_match(a + [7]).result()
    after = mgr.stats()
    assert len(s.prefix_nodes()) == 1 and after["evictions_total"] == 0
    for key in ("chunks_created", "chunks_free", "chunks_cached", "chunks_in_tree"):
        assert after[key] == before[key], key
    mgr.check()
    mgr.close()


def test_concurrent_close_is_safe():
    for _ in range(20):
        mgr = manager(16, workers=4, prealloc_chunks=2)
        sp = mgr.create_space(row_bytes=4096 * SCALE, max_tokens=64, max_slots=4)
        sp.create(20).result()
        threads = [threading.Thread(target=mgr.close) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads)


def test_trim_is_not_undone_by_the_refill():
    chunk = max(C, 2 << 20)
    mgr = vtm.Manager(backend=BACKEND, capacity_bytes=32 * chunk, chunk_bytes=chunk, prealloc_chunks=8)
    sp = mgr.create_space(row_bytes=46080, max_tokens=512, max_slots=2)
    for _ in range(5):
        vt = sp.create(100).result()
        vt.release().result()
        mgr.trim()
        # The refill waits for the next operation; nothing is created behind trim's back.
        assert mgr.stats()["chunks_created"] == 0
    sp.create(1).result()  # an operation re-arms the refill
    mgr.check()
    mgr.close()
