"""Radix-tree behaviour of prefix_record / prefix_match (the cases SGLang and vLLM test).

docs/api.md: prefix_record returns the number of tokens newly added; prefix_match
returns the longest recorded prefix capped at len(query)-1, as a new vTensor whose
full pages map the recorded chunks and whose partial last page is a private copy.
docs/design.md §3: per node the tree keeps the chunks of pages that begin inside the
node plus its own version of the page straddling its start (siblings diverge
inside a page); eviction removes only unlocked leaves, LRU first.
"""

import numpy as np
import pytest

import vtm
from vtm_testing import (CHUNK, SCALE, SENTINEL, RowIO, assert_pool_consistent, leaf_paths,
                      new_manager, node_paths, snapshot, assert_same_state)


def written_vt(space, io, tokens):
    vt = space.create(len(tokens)).result()
    assert vt.num_tokens == len(tokens)
    io.write(vt, tokens, 0, len(tokens))
    return vt


def record(space, io, tokens, release=True):
    vt = written_vt(space, io, tokens)
    added = space.prefix_record(vt, list(tokens)).result()
    if release:
        vt.release().result()
        return added, None
    return added, vt


def match(space, io, query, expect):
    m = space.prefix_match(list(query)).result()
    assert m.num_tokens == expect, f"match of {list(query)} returned {m.num_tokens}, expected {expect}"
    if expect == 0:
        assert m.vtensor is None
        return None
    vt = m.vtensor
    assert vt is not None
    assert vt.num_tokens == expect
    assert vt.space.name == space.name
    assert vt.mapped_bytes >= expect * space.row_bytes
    io.verify(vt, query, 0, expect, what=f"match of {list(query)}:")
    return vt


def shape(space):
    return {(nd["start"], nd["end"], tuple(nd["tokens"])) for nd in space.prefix_nodes()}


# row_bytes 20000 * SCALE against pages of 64 KiB * SCALE: 3.28 rows per page, so most split
# offsets fall inside a page and rows straddle page boundaries.
ROW = 20000 * SCALE
N = 12


@pytest.mark.parametrize("k", list(range(0, N + 1)))
def test_split_at_every_offset(make_manager, k):
    mgr = make_manager(chunks=128)
    space = mgr.create_space(row_bytes=ROW, max_tokens=32, max_slots=6)
    io = RowIO(space)
    A = list(range(1, N + 1))
    if k < N:
        B = A[:k] + [100 + i for i in range(N - k)]
    else:
        B = A + [100, 101, 102]
    NB = len(B)

    assert record(space, io, A)[0] == N
    assert shape(space) == {(0, N, tuple(A))}
    added, _ = record(space, io, B)
    assert added == NB - k

    if k == 0:
        want = {(0, N, tuple(A)), (0, NB, tuple(B))}
    elif k < N:
        want = {(0, k, tuple(A[:k])), (k, N, tuple(A[k:])), (k, NB, tuple(B[k:]))}
    else:
        want = {(0, N, tuple(A)), (N, NB, tuple(B[N:]))}
    assert shape(space) == want
    assert leaf_paths(space.prefix_nodes()) == ({tuple(A), tuple(B)} if k < N else {tuple(B)})
    st = assert_pool_consistent(mgr)
    assert st["tree_nodes"] == len(want)
    assert st["tree_tokens"] == sum(e - s for s, e, _ in want)

    # recording again adds nothing and changes nothing
    assert record(space, io, A)[0] == 0
    assert record(space, io, B)[0] == 0
    assert shape(space) == want

    # matches end on node boundaries: no split, exact lengths, exact bytes
    vts = [match(space, io, A + [SENTINEL], N),
           match(space, io, B + [SENTINEL], NB)]
    if k > 0:
        vts.append(match(space, io, A[:k] + [SENTINEL], k))
    assert shape(space) == want
    # every node is on the path of some live match: all locked
    for path, nd in node_paths(space.prefix_nodes()):
        assert nd["locks"] > 0, nd
    for vt in vts:
        vt.release().result()
    for nd in space.prefix_nodes():
        assert nd["locks"] == 0, nd
    # matched vTensors wrote nothing shared: matching again still gives exact bytes
    for q, n in ((A + [SENTINEL], N), (B + [SENTINEL], NB)):
        match(space, io, q, n).release().result()
    assert_pool_consistent(mgr)


def test_diverge_inside_page_keeps_both_versions(make_manager):
    """Siblings that diverge inside a page keep their own version of that page."""
    mgr = make_manager(chunks=128)
    row = 3000 * SCALE  # 21.8 rows per page
    space = mgr.create_space(row_bytes=row, max_tokens=64, max_slots=8)
    io = RowIO(space)
    base = [7] * 10
    seqs = [base + [c] * 30 for c in range(4)]
    for s in seqs:
        record(space, io, s)
    vts = [match(space, io, s + [SENTINEL], len(s)) for s in seqs]
    # each matched vTensor continues writing its own rows past the match
    for s, vt in zip(seqs, vts):
        tail = s + [9] * 8
        vt.extend(len(tail)).result()
        io.write(vt, tail, len(s), len(tail))
    for s, vt in zip(seqs, vts):
        io.verify(vt, s + [9] * 8)
    for vt in vts:
        vt.release().result()
    for s in seqs:
        match(space, io, s + [SENTINEL], len(s)).release().result()
    assert_pool_consistent(mgr)


def test_partial_match_locks_only_matched_part(make_manager):
    mgr = make_manager(chunks=64)
    space = mgr.create_space(row_bytes=ROW, max_tokens=32, max_slots=4)
    io = RowIO(space)
    A = list(range(1, 13))
    record(space, io, A)
    assert shape(space) == {(0, 12, tuple(A))}
    vt = match(space, io, A[:7] + [SENTINEL], 7)
    nodes = space.prefix_nodes()
    assert {(nd["start"], nd["end"]) for nd in nodes} == {(0, 7), (7, 12)}, nodes
    for nd in nodes:
        if nd["end"] <= 7:
            assert nd["locks"] > 0, nd
        else:
            assert nd["locks"] == 0, nd
    # the unlocked tail is droppable, the locked head is not
    assert space.clear_prefixes() == 1
    assert shape(space) == {(0, 7, tuple(A[:7]))}
    vt.release().result()
    for nd in space.prefix_nodes():
        assert nd["locks"] == 0, nd
    assert space.clear_prefixes() == 1
    assert space.prefix_nodes() == []
    mgr.trim()
    st = assert_pool_consistent(mgr)
    assert st["chunks_created"] == 0


def test_match_caps_at_len_minus_one(make_manager):
    mgr = make_manager(chunks=64)
    space = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=64, max_slots=4)
    io = RowIO(space)
    A = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    record(space, io, A)
    match(space, io, A, 9).release().result()
    match(space, io, A[:5], 4).release().result()
    match(space, io, A[:2], 1).release().result()
    assert space.prefix_match(A[:1]).result().vtensor is None
    assert space.prefix_match(A[:1]).result().num_tokens == 0
    match(space, io, A + [11, 12], 10).release().result()


def test_match_unknown_prefix(make_manager):
    mgr = make_manager(chunks=64)
    space = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=64, max_slots=4)
    io = RowIO(space)
    m = space.prefix_match([5, 6, 7]).result()
    assert m.vtensor is None and m.num_tokens == 0
    record(space, io, [1, 2, 3])
    before = snapshot(mgr, [space], {})
    m = space.prefix_match([5, 6, 7]).result()
    assert m.vtensor is None and m.num_tokens == 0
    assert_same_state(before, snapshot(mgr, [space], {}), allow_reclaim=False)


def test_record_more_than_num_tokens_raises(make_manager):
    mgr = make_manager(chunks=64)
    space = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=64, max_slots=4)
    io = RowIO(space)
    record(space, io, [1, 2, 3, 4])
    vt = written_vt(space, io, [1, 2, 3, 4, 5, 6])
    live = {vt: [1, 2, 3, 4, 5, 6]}
    before = snapshot(mgr, [space], live, {space.name: io})
    with pytest.raises(vtm.InvalidArgument):
        space.prefix_record(vt, [1, 2, 3, 4, 5, 6, 7]).result()
    assert_same_state(before, snapshot(mgr, [space], live, {space.name: io}), allow_reclaim=False)
    assert space.prefix_record(vt, [1, 2, 3, 4, 5, 6]).result() == 2
    vt.release().result()
    assert_pool_consistent(mgr)


def test_record_return_values(make_manager):
    mgr = make_manager(chunks=64)
    space = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=64, max_slots=4)
    io = RowIO(space)
    A = list(range(20))
    vt = written_vt(space, io, A)
    assert space.prefix_record(vt, A[:5]).result() == 5
    assert space.prefix_record(vt, A[:5]).result() == 0
    assert space.prefix_record(vt, A[:3]).result() == 0
    assert space.prefix_record(vt, A[:12]).result() == 7
    assert space.prefix_record(vt, A).result() == 8
    assert leaf_paths(space.prefix_nodes()) == {tuple(A)}
    vt.release().result()
    match(space, io, A + [SENTINEL], 20).release().result()
    match(space, io, A[:8] + [SENTINEL], 8).release().result()


# --------------------------------------------------------------------------
# eviction order


EV_ROW = 4096 * SCALE  # 16 rows per chunk: a 32-token sequence is exactly 2 chunks
EV_LEN = 32


def ev_setup(make_manager, n_seqs):
    mgr = make_manager(chunks=64, slot_cache_bytes=0)
    space = mgr.create_space(row_bytes=EV_ROW, max_tokens=64, max_slots=8)
    io = RowIO(space)
    seqs = [[1000 * (i + 1) + j for j in range(EV_LEN)] for i in range(n_seqs)]
    for s in seqs:
        record(space, io, s)
    mgr.trim()
    st = assert_pool_consistent(mgr)
    assert st["chunks_free"] == 0
    assert st["chunks_created"] == 2 * n_seqs, st
    assert st["chunks_in_tree"] == 2 * n_seqs, st
    return mgr, space, io, seqs


def touch(space, io, s, keep=False):
    vt = match(space, io, s + [SENTINEL], len(s))
    if keep:
        return vt
    vt.release().result()
    return None


def remaining(space):
    return leaf_paths(space.prefix_nodes())


def test_eviction_lru_order(make_manager):
    mgr, space, io, (A, B, C) = ev_setup(make_manager, 3)
    CH = mgr.chunk_bytes
    for s in (C, A, B):  # LRU order now: C, A, B
        touch(space, io, s)
    mgr.trim()
    ev0 = mgr.stats()["evictions_total"]
    got = mgr.trim(bytes=2 * CH)
    assert got >= 2 * CH
    assert remaining(space) == {tuple(A), tuple(B)}
    st = assert_pool_consistent(mgr)
    assert st["chunks_created"] == 4 and st["evictions_total"] > ev0
    got = mgr.trim(bytes=2 * CH)
    assert got >= 2 * CH
    assert remaining(space) == {tuple(B)}
    # the survivor's bytes are intact
    touch(space, io, B)
    got = mgr.trim(bytes=2 * CH)
    assert got >= 2 * CH
    assert remaining(space) == set()
    st = assert_pool_consistent(mgr)
    assert st["chunks_created"] == 0


def test_eviction_order_follows_record_order(make_manager):
    mgr, space, io, (A, B, C) = ev_setup(make_manager, 3)
    CH = mgr.chunk_bytes
    mgr.trim(bytes=2 * CH)
    assert remaining(space) == {tuple(B), tuple(C)}
    touch(space, io, B)  # now C is the least recently used
    mgr.trim(bytes=2 * CH)
    assert remaining(space) == {tuple(B)}


def test_locked_leaf_is_never_evicted(make_manager):
    mgr, space, io, (A, B, C) = ev_setup(make_manager, 3)
    CH = mgr.chunk_bytes
    held = touch(space, io, A, keep=True)  # A: oldest access, but locked
    touch(space, io, B)
    touch(space, io, C)
    mgr.trim()
    assert mgr.trim(bytes=2 * CH) >= 2 * CH
    assert remaining(space) == {tuple(A), tuple(C)}
    assert mgr.trim(bytes=2 * CH) >= 2 * CH
    assert remaining(space) == {tuple(A)}
    # nothing unlocked is left: trim returns what it could (nothing) and keeps A
    assert mgr.trim(bytes=2 * CH) == 0
    assert remaining(space) == {tuple(A)}
    io.verify(held, A)
    st = assert_pool_consistent(mgr)
    assert st["chunks_created"] == 2
    held.release().result()
    assert mgr.trim(bytes=2 * CH) >= 2 * CH
    assert remaining(space) == set()
    assert assert_pool_consistent(mgr)["chunks_created"] == 0


def test_trim_everything_keeps_locked(make_manager):
    mgr, space, io, (A, B, C) = ev_setup(make_manager, 3)
    held = touch(space, io, B, keep=True)
    got = mgr.trim(bytes=mgr.capacity_bytes)
    assert got == 4 * mgr.chunk_bytes
    assert remaining(space) == {tuple(B)}
    io.verify(held, B)
    held.release().result()


# --------------------------------------------------------------------------
# namespaces


def test_namespaces(make_manager):
    mgr = make_manager(chunks=128)
    s1 = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=64, max_slots=4, namespace="m")
    s2 = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=64, max_slots=4, namespace="m")
    s3 = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=64, max_slots=4, namespace="other")
    s4 = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=64, max_slots=4)
    s5 = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=64, max_slots=4)
    assert s1.namespace == s2.namespace == "m"
    assert s3.namespace == "other"
    io = {s.name: RowIO(s) for s in (s1, s2, s3, s4, s5)}
    A = list(range(1, 40))
    B = list(range(50, 80))
    record(s1, io[s1.name], A)
    record(s4, io[s4.name], B)
    assert s1.prefix_nodes() == s2.prefix_nodes()
    assert s3.prefix_nodes() == [] and s5.prefix_nodes() == []
    # space 2 sees space 1's record and reads the bytes written in space 1
    vt = match(s2, io[s2.name], A + [SENTINEL], len(A))
    # and space 2 writes its own continuation without disturbing space 1's view
    tail = A + [3] * 10
    vt.extend(len(tail)).result()
    io[s2.name].write(vt, tail, len(A), len(tail))
    io[s2.name].verify(vt, tail)
    vt.release().result()
    match(s1, io[s1.name], A + [SENTINEL], len(A)).release().result()
    for s in (s3, s4, s5):
        match(s, io[s.name], A + [SENTINEL], 0)
    for s in (s1, s2, s3, s5):
        match(s, io[s.name], B + [SENTINEL], 0)
    match(s4, io[s4.name], B + [SENTINEL], len(B)).release().result()
    # a record made through space 2 is visible in space 1
    C = [9] * 20
    record(s2, io[s2.name], C)
    match(s1, io[s1.name], C + [SENTINEL], 20).release().result()
    assert_pool_consistent(mgr)


def test_namespace_requires_equal_row_bytes(make_manager):
    mgr = make_manager(chunks=16)
    mgr.create_space(row_bytes=3000 * SCALE, max_tokens=64, max_slots=2, namespace="m")
    with pytest.raises(vtm.InvalidArgument):
        mgr.create_space(row_bytes=3000 * SCALE + 1, max_tokens=64, max_slots=2, namespace="m")


# --------------------------------------------------------------------------
# clear_prefixes


def test_clear_prefixes_keeps_locked(make_manager):
    mgr = make_manager(chunks=64)
    space = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=64, max_slots=8)
    io = RowIO(space)
    A, B, C = [1] * 30, [2] * 30, [3] * 30
    for s in (A, B, C):
        record(space, io, s)
    assert mgr.stats()["tree_nodes"] == 3
    held = match(space, io, A + [SENTINEL], 30)
    assert space.clear_prefixes() == 2
    assert remaining(space) == {tuple(A)}
    match(space, io, B + [SENTINEL], 0)
    match(space, io, C + [SENTINEL], 0)
    io.verify(held, A)
    st = assert_pool_consistent(mgr)
    assert st["tree_nodes"] == 1
    held.release().result()
    assert space.clear_prefixes() == 1
    assert space.prefix_nodes() == []
    assert space.clear_prefixes() == 0
    mgr.trim()
    st = assert_pool_consistent(mgr)
    assert st["chunks_created"] == 0 and st["tree_nodes"] == 0 and st["chunks_in_tree"] == 0


# --------------------------------------------------------------------------
# docs/design.md §3: "a page that a vTensor shares with another vTensor or the tree is
# never written by it: the first page a request writes into is always private
# (copied if it held shared bytes)".


def tree_chunks(space):
    return {c for nd in space.prefix_nodes() for c in nd["pages"] if c is not None}


def other_chunks(vts, me):
    return {c for vt in vts if vt is not me for c in vt.page_chunks() if c is not None}


@pytest.mark.parametrize("recorded", [25, 30])
def test_recorder_writes_only_private_pages(make_manager, recorded):
    """After recording a prefix whose last page is partial, the recorder's next
    rows go to a page the tree does not hold."""
    mgr = make_manager(chunks=64)
    row = 3000 * SCALE  # 25 rows = 75000 B * SCALE: page 0 full, page 1 partial
    space = mgr.create_space(row_bytes=row, max_tokens=60, max_slots=4)
    io = RowIO(space)
    t = list(range(60))
    a = written_vt(space, io, t[:30])
    space.prefix_record(a, t[:recorded]).result()
    a.extend(40).result()
    frontier = (30 * row) // mgr.chunk_bytes
    page = a.page_chunks()[frontier]
    assert page is not None
    assert page not in tree_chunks(space), \
        f"the recorder's next rows (page {frontier}, chunk {page}) would be written into a chunk the tree holds"
    io.write(a, t, 30, 40)
    io.verify(a, t[:40])
    vt = match(space, io, t[:recorded] + [SENTINEL], recorded)
    io.verify(a, t[:40])
    vt.release().result()
    a.release().result()
    assert_pool_consistent(mgr)


def test_matched_vtensor_writes_only_private_pages(make_manager):
    mgr = make_manager(chunks=64)
    row = 3000 * SCALE
    space = mgr.create_space(row_bytes=row, max_tokens=60, max_slots=4)
    io = RowIO(space)
    t = list(range(60))
    record(space, io, t[:50])
    vts = []
    for L in (10, 22, 44):  # partial last page: 0, 1, 2
        vt = match(space, io, t[:L] + [SENTINEL], L)
        vt.extend(L + 5).result()
        page = vt.page_chunks()[(L * row) // mgr.chunk_bytes]
        assert page not in tree_chunks(space)
        assert page not in other_chunks([v for v, _ in vts], vt)
        own = t[:L] + [100 + L] * 5
        io.write(vt, own, L, L + 5)
        vts.append((vt, own))
    for vt, own in vts:
        io.verify(vt, own)
    for vt, _ in vts:
        vt.release().result()
    match(space, io, t[:50] + [SENTINEL], 50).release().result()


def test_reused_slot_holds_no_shared_page(make_manager):
    """Deferred reclamation keeps private pages only: a slot reused after its
    vTensor recorded a prefix never writes into a tree chunk."""
    mgr = make_manager(chunks=64, slot_cache_bytes=32 * CHUNK)
    row = 3000 * SCALE
    space = mgr.create_space(row_bytes=row, max_tokens=60, max_slots=1)
    io = RowIO(space)
    t = list(range(60))
    a = written_vt(space, io, t[:55])  # 3 pages
    space.prefix_record(a, t[:50]).result()
    a.release().result()
    b = space.create(55).result()
    shared = tree_chunks(space)
    assert not (set(c for c in b.page_chunks() if c is not None) & shared), \
        f"reused slot maps tree chunks {b.page_chunks()} / {shared}"
    other = [9] * 55
    io.write(b, other, 0, 55)
    b.release().result()
    match(space, io, t[:50] + [SENTINEL], 50).release().result()


@pytest.mark.parametrize("window", [0, 12], ids=["whole", "window"])
def test_a_record_that_releases_its_vtensor_needs_no_free_chunk(make_manager, window):
    """prefix_record(..., release=True): the vTensor goes with the record,
    so the partial page it would have written next joins the tree without a
    copy. With every chunk of the pool held, a plain record fails (no chunk
    for the copy); this one records, releases, and the prefix matches byte
    for byte. What a preempted request's record needs: the pool is full
    when a request is preempted."""
    mgr = make_manager(chunks=8)
    row = 3000 * SCALE  # 25 rows: page 0 full, page 1 partial
    space = mgr.create_space(row_bytes=row, max_tokens=60, max_slots=8, window_tokens=window)
    io = RowIO(space)
    t = list(range(40))
    a = written_vt(space, io, t[:25])
    held = []
    while True:
        try:
            held.append(space.create(1).result())
        except vtm.OutOfMemory:
            break
    with pytest.raises(vtm.OutOfMemory):
        space.prefix_record(a, t[:25]).result()
    copies = mgr.stats()["cow_copies_total"]
    assert space.prefix_record(a, t[:25], release=True).result() == 25
    assert a.released and mgr.stats()["cow_copies_total"] == copies
    assert_pool_consistent(mgr)
    for vt in held:
        vt.release().result()
    m = space.prefix_match(t[:25] + [SENTINEL]).result()
    assert m.num_tokens == 25
    io.verify(m.vtensor, t, m.vtensor.low, 25)
    m.vtensor.release().result()
    assert_pool_consistent(mgr)


def test_a_releasing_record_caches_the_pages_the_tree_does_not_take():
    """prefix_record(..., release=True) of a prefix the tree holds already
    (from another vTensor's pages) keeps the vTensor's private pages in the
    slot cache, as a record then a release does. Review: the first all-or-
    nothing version held every page of the record through the release, so
    they counted as shared and were freed instead."""
    row = CHUNK // 20  # 20 rows a page: 60 rows fill 3 pages
    t = list(range(1, 61))

    def cached_after(release_in_record: bool) -> tuple[int, int]:
        mgr = new_manager(chunks=64, prealloc_chunks=0, slot_cache_bytes=32 * CHUNK)
        space = mgr.create_space(row_bytes=row, max_tokens=120, max_slots=6)
        assert space.prefix_record(space.create(60).result(), t, release=True).result() == 60
        vt = space.create(60).result()  # the same prefix, computed on its own pages
        if release_in_record:
            assert space.prefix_record(vt, t, release=True).result() == 0
        else:
            assert space.prefix_record(vt, t).result() == 0
            vt.release().result()
        assert_pool_consistent(mgr)
        stats = mgr.stats()
        mgr.close()
        return stats["chunks_cached"], stats["chunks_free"]

    assert cached_after(True) == cached_after(False) == (3, 0)


def test_a_releasing_record_of_nothing_still_releases(make_manager):
    mgr = make_manager(chunks=8)
    space = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=60, max_slots=4)
    vt = space.create(10).result()
    assert space.prefix_record(vt, [], release=True).result() == 0
    assert vt.released and not space.prefix_nodes()
    assert_pool_consistent(mgr)


@pytest.mark.parametrize("tier", [0, 4], ids=["no-tier", "tier"])
@pytest.mark.parametrize("window", [0, 12], ids=["whole", "window"])
def test_a_match_never_runs_out_of_memory_that_only_its_own_lock_holds(make_manager, window, tier):
    """A matched vTensor locks its path, and the path keeps chunks the
    vTensor does not map: the page its copy-on-write replaced at the match's
    end, and in a window space the pages below its low mark. With every
    other chunk held, growing it used to fail with OutOfMemory, so a request
    running alone failed in a pool it fits in. Now the lock gives way: the
    path is evicted (spilled, with a tier), or a window path gives up the
    pages no vTensor maps, and the growth maps, the vTensor's bytes intact,
    and its record locks the path again."""
    mgr = make_manager(chunks=8, host_tier_bytes=tier * CHUNK)
    row = 3000 * SCALE  # 21.8 rows a page: 25 rows are page 0 full, page 1 partial
    space = mgr.create_space(row_bytes=row, max_tokens=120, max_slots=8, window_tokens=window)
    io = RowIO(space)
    t = list(range(100))
    record(space, io, t[:25])
    m = space.prefix_match(t[:26]).result()
    vt = m.vtensor
    assert m.num_tokens == 25
    if window:  # the low mark passes page 0, which the path keeps
        vt.extend(50, low=50 - window).result()
        io.write(vt, t, 25, 50)
    mgr.trim()  # no free or cached chunk left to take first
    held = [space.create(1).result() for _ in range(8 - mgr.stats()["chunks_held"])]
    assert mgr.stats()["chunks_held"] == 8 and mgr.stats()["prefix_unpins_total"] == 0
    pinned = [nd for nd in space.prefix_nodes() if nd["locks"]]
    assert pinned and all(c is not None for nd in pinned for c in nd["pages"])
    grown = 80 if window else 50
    vt.extend(grown, low=vt.low).result()  # a new page, and none given back
    io.write(vt, t, 50 if window else 25, grown)
    st = assert_pool_consistent(mgr)
    # A window path gives up its page below the low mark and stays locked
    # (DropLockedWindowPages), else the lock goes.
    holes = [c is None for nd in space.prefix_nodes() if nd["locks"] for c in nd["pages"]]
    assert (window and any(holes)) or (st["prefix_unpins_total"] >= 1 and
                                       all(nd["locks"] == 0 for nd in space.prefix_nodes()))
    io.verify(vt, t, vt.low, grown)
    for h in held:
        h.release().result()
    space.prefix_record(vt, t[:grown]).result()
    assert any(nd["locks"] for nd in space.prefix_nodes())
    vt.release().result()
    assert_pool_consistent(mgr)


def test_an_allocation_that_unpinning_cannot_satisfy_changes_nothing(make_manager):
    """The device runs out below the pool's capacity (a physical limit), and
    unpinning the match's path would free 1 chunk of the 2 the extend needs.
    A failed operation changes nothing but caches: it must not unpin (an
    earlier version unpinned the path, evicted its leaf, and failed)."""
    mgr = make_manager(chunks=8, faults=True, prealloc_chunks=0, slot_cache_bytes=0)
    row = CHUNK // 16  # 16 rows a page: node [0, 16) is page 0 exactly
    space = mgr.create_space(row_bytes=row, max_tokens=120, max_slots=8)
    io = RowIO(space)
    t = list(range(100))
    _, recorder = record(space, io, t[:16], release=False)  # maps page 0 itself: nothing to unpin there
    record(space, io, t[:25])
    vt = space.prefix_match(t[:26]).result().vtensor
    assert vt.num_tokens == 25
    nodes = space.prefix_nodes()
    assert {(nd["start"], nd["end"]): nd["locks"] for nd in nodes} == {(0, 16): 2, (16, 25): 1}
    mgr.trim()
    mgr.faults.set_physical_limit(mgr.stats()["chunks_held"] * mgr.chunk_bytes)
    with pytest.raises(vtm.OutOfMemory, match="device out of memory"):
        vt.extend(60).result()  # 2 more pages; unpinning frees 1 (the page its copy replaced)
    assert space.prefix_nodes() == nodes and mgr.stats()["prefix_unpins_total"] == 0
    vt.extend(41).result()  # 1 more page: the unpinned leaf's
    assert mgr.stats()["prefix_unpins_total"] == 1
    assert {(nd["start"], nd["end"]): nd["locks"] for nd in space.prefix_nodes()} == {(0, 16): 1}
    io.write(vt, t, 25, 41)
    io.verify(vt, t, 0, 41)
    mgr.faults.set_physical_limit(None)
    assert_pool_consistent(mgr)
    vt.release().result()
    recorder.release().result()
    assert_pool_consistent(mgr)


def test_a_prefix_that_several_matches_lock_does_not_give_way(make_manager):
    """The system prompt's node keeps its own version of its last page,
    which no request maps (each maps its own branch's). Freeing that one
    chunk for one request would evict the prefix under all of them: the
    allocation fails instead (the caller preempts one), nothing unpinned."""
    mgr = make_manager(chunks=12, slot_cache_bytes=0, prealloc_chunks=0)
    space = mgr.create_space(row_bytes=CHUNK // 16, max_tokens=120, max_slots=8)  # 16 rows a page
    io = RowIO(space)
    system = list(range(1000, 1024))  # page 0, and page 1 partial
    turns = [system + [100 * i + j for j in range(24)] for i in range(3)]  # pages 0-2 exactly
    record(space, io, system)
    for t in turns:
        record(space, io, t)
    vts = [space.prefix_match(t + [SENTINEL]).result().vtensor for t in turns]
    assert [vt.num_tokens for vt in vts] == [48] * 3
    mgr.trim()
    held = [space.create(1).result() for _ in range(12 - mgr.stats()["chunks_held"])]
    nodes = space.prefix_nodes()
    assert sorted((nd["start"], nd["end"], nd["locks"]) for nd in nodes) == [(0, 24, 3)] + [(24, 48, 1)] * 3
    with pytest.raises(vtm.OutOfMemory):
        vts[0].extend(49).result()
    assert space.prefix_nodes() == nodes and mgr.stats()["prefix_unpins_total"] == 0
    held.pop().release().result()
    vts[0].extend(49).result()
    for vt in held + vts:
        vt.release().result()
    assert_pool_consistent(mgr)


def test_an_operation_that_fails_after_unpinning_locks_what_is_left_of_the_path(make_manager):
    """The extend unpins the match's path and evicts its leaf, then its map
    fails: the evicted leaf was the cache's, but the lock comes back on the
    rest of the path (it was left unlocked, and evictable)."""
    mgr = make_manager(chunks=8, faults=True, prealloc_chunks=0, slot_cache_bytes=0)
    space = mgr.create_space(row_bytes=CHUNK // 16, max_tokens=120, max_slots=8)
    io = RowIO(space)
    t = list(range(100))
    record(space, io, t[:16])  # page 0 exactly
    record(space, io, t[:25])  # and a leaf holding its copy of page 1
    vt = space.prefix_match(t[:26]).result().vtensor
    assert {(nd["start"], nd["end"]): nd["locks"] for nd in space.prefix_nodes()} == {(0, 16): 1, (16, 25): 1}
    mgr.trim()
    held = [space.create(1).result() for _ in range(8 - mgr.stats()["chunks_held"])]
    mgr.faults.fail_nth("map", 1)
    with pytest.raises(vtm.BackendError):
        vt.extend(41).result()
    assert mgr.stats()["prefix_unpins_total"] == 1
    assert {(nd["start"], nd["end"]): nd["locks"] for nd in space.prefix_nodes()} == {(0, 16): 1}
    assert vt.num_tokens == 25
    io.verify(vt, t, 0, 25)
    assert_pool_consistent(mgr)
    vt.extend(41).result()  # the leaf's chunk is free now
    io.write(vt, t, 25, 41)
    io.verify(vt, t, 0, 41)
    for h in held + [vt]:
        h.release().result()
    assert all(nd["locks"] == 0 for nd in space.prefix_nodes())
    assert_pool_consistent(mgr)
