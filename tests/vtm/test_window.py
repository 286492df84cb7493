"""A vTensor's low mark (docs/api.md, "The low mark"): extend(n, low=L) and
step({vt: (n, L)}) unmap every page wholly below row L, keep the bytes of
rows [L, n), and return the chunks to the pool or leave them to whoever else
holds them (the prefix tree, another vTensor).

Geometry: rows of 3000 B (times SCALE) against 64 KiB pages (times SCALE),
so rows straddle pages: page p holds bytes [p*C, (p+1)*C) of a slot, and the
pages wholly below row L are those before page L*R // C.
"""

import signal
import subprocess
import sys

import pytest

import vtm
from vtm_testing import (SCALE, SENTINEL, RowIO, assert_pool_consistent, assert_same_state, host_only,
                         new_manager, snapshot)

ROW = 3000 * SCALE
MAXT = 200  # 10 pages a slot
A = [(5 * i) % 11 + 1 for i in range(MAXT)]
B = [(3 * i) % 7 + 20 for i in range(MAXT)]


def low_page(low):
    """The first page a vTensor with this low mark keeps."""
    return low * 3000 // (64 * 1024)


@pytest.fixture
def mgr():
    m = new_manager(chunks=64, prealloc_chunks=0, slot_cache_bytes=0)
    yield m
    m.close()


@pytest.fixture
def space(mgr):
    return mgr.create_space(row_bytes=ROW, max_tokens=MAXT, max_slots=4)


def test_low_mark_unmaps_whole_pages_below_it_and_keeps_the_rows_above(mgr, space):
    io = RowIO(space)
    vt = space.create(120).result()  # pages 0-5
    io.write(vt, A, 0, 120)
    assert vt.low == 0
    created = mgr.stats()["chunks_created"]
    before = vt.page_chunks()
    vt.extend(150, low=50).result()  # pages 0-1 lie wholly below row 50; page 2 holds rows 43-65
    assert low_page(50) == 2
    assert (vt.num_tokens, vt.low) == (150, 50)
    pages = vt.page_chunks()
    assert pages[:2] == [None, None]
    assert pages[2:6] == before[2:6], "the kept pages stay where they were"
    assert pages[6] in before[:2], "a page unmapped below the mark serves the page the extend maps"
    assert vt.mapped_bytes == 5 * mgr.chunk_bytes
    io.verify(vt, A, 50, 120)  # the bytes above the mark are untouched
    io.write(vt, A, 120, 150)
    io.verify(vt, A)  # default: [low, num_tokens)
    st = assert_pool_consistent(mgr)
    assert st["chunks_created"] == created, "the moved chunk saved a new one"
    assert st["chunks_free"] == 1 and st["chunks_held"] == 5
    assert st["spaces"][space.name]["used_tokens"] == 100  # rows [50, 150)
    # A plain extend keeps the mark; repeating it is allowed.
    vt.extend(160).result()
    vt.extend(160, low=50).result()
    assert (vt.num_tokens, vt.low) == (160, 50)
    vt.release().result()
    mgr.trim()
    assert mgr.stats()["chunks_created"] == 0


def test_low_mark_without_growth_frees_the_pages(mgr, space):
    io = RowIO(space)
    vt = space.create(100).result()  # pages 0-4
    io.write(vt, A, 0, 100)
    vt.extend(100, low=100).result()  # every page wholly below row 100: pages 0-3 (page 4 holds row 99's tail)
    assert vt.low == 100 and vt.page_chunks()[:4] == [None] * 4 and vt.page_chunks()[4] is not None
    st = assert_pool_consistent(mgr)
    assert st["chunks_free"] == 4 and st["chunks_held"] == 1
    assert st["spaces"][space.name]["used_tokens"] == 0
    vt.extend(130).result()
    io.write(vt, A, 100, 130)
    io.verify(vt, A)
    vt.release().result()


def test_step_takes_a_low_mark_per_entry(mgr, space):
    io = RowIO(space)
    a, b = space.create(80).result(), space.create(80).result()
    io.write(a, A, 0, 80)
    io.write(b, B, 0, 80)
    mgr.step({a: 100, b: (100, 60)}).result()
    assert (a.num_tokens, a.low, b.num_tokens, b.low) == (100, 0, 100, 60)
    assert a.page_chunks()[0] is not None and b.page_chunks()[:2] == [None, None]
    io.verify(a, A, 0, 80)
    io.verify(b, B, 60, 80)
    assert_pool_consistent(mgr)


def test_bad_low_marks_are_refused_and_change_nothing(mgr, space):
    io = RowIO(space)
    a, b = space.create(100).result(), space.create(50).result()
    io.write(a, A, 0, 100)
    io.write(b, B, 0, 50)
    a.extend(100, low=60).result()
    live = {a: A[:100], b: B[:50]}
    before = snapshot(mgr, [space], live, {space.name: io})
    bad = [
        lambda: a.extend(120, low=59),  # below the current mark: those bytes are gone
        lambda: a.extend(0, low=59),
        lambda: a.extend(120, low=121),  # past the rows asked for
        lambda: b.extend(40, low=45),  # past the rows asked for, though within the vTensor's
        lambda: a.extend(120, low=-1),
        lambda: mgr.step({b: 80, a: (120, 10)}),  # all or nothing: b does not grow either
        lambda: mgr.step({b: (80, 90)}),
        lambda: mgr.step({b: (80,)}),
        lambda: mgr.step({b: (80, 10, 20)}),
        lambda: mgr.step({b: (80, -1)}),
    ]
    for call in bad:
        with pytest.raises(vtm.InvalidArgument):
            call().result()
        assert_same_state(before, snapshot(mgr, [space], live, {space.name: io}), allow_reclaim=False)
    assert_pool_consistent(mgr)


def test_pages_the_tree_holds_stay_in_the_tree(mgr, space):
    io = RowIO(space)
    vt = space.create(100).result()
    io.write(vt, A, 0, 100)
    assert space.prefix_record(vt, A[:70]).result() == 70  # pages 0-2 whole, page 3 a copy
    tree_pages = {c for nd in space.prefix_nodes() for c in nd["pages"]}
    vt.extend(130, low=100).result()  # unmaps pages 0-3
    assert vt.page_chunks()[:4] == [None] * 4
    st = assert_pool_consistent(mgr)
    assert st["chunks_in_tree"] == len(tree_pages) == 4 and st["chunks_free"] == 0
    # The tree still serves the prefix, byte for byte.
    m = space.prefix_match(A[:70] + [SENTINEL]).result()
    assert (m.num_tokens, m.vtensor.low) == (70, 0)
    io.verify(m.vtensor, A, 0, 70)
    # A space that records whole prefixes cannot take rows the vTensor gave up.
    live = {vt: A[:130], m.vtensor: A[:70]}
    io.write(vt, A, 100, 130)
    before = snapshot(mgr, [space], live, {space.name: io})
    with pytest.raises(vtm.FailedPrecondition, match="low mark"):
        space.prefix_record(vt, A[:120]).result()
    assert_same_state(before, snapshot(mgr, [space], live, {space.name: io}), allow_reclaim=False)
    for v in live:
        v.release().result()
    space.clear_prefixes()
    mgr.trim()
    assert mgr.stats()["chunks_created"] == 0
    mgr.check()


def test_a_matched_vtensor_may_drop_shared_pages(mgr, space):
    io = RowIO(space)
    rec = space.create(100).result()
    io.write(rec, A, 0, 100)
    space.prefix_record(rec, A[:100]).result()
    rec.release().result()
    m = space.prefix_match(A[:100] + [SENTINEL]).result().vtensor
    assert m.low == 0
    own = A[:100] + B[:40]
    m.extend(140, low=90).result()
    io.write(m, own, 100, 140)
    io.verify(m, own)
    st = assert_pool_consistent(mgr)
    assert st["chunks_in_tree"] == 5  # the unmapped shared pages are the tree's alone now
    m.release().result()
    assert mgr.stats()["chunks_held"] == st["chunks_in_tree"]


@host_only
def test_reading_a_row_below_the_low_mark_faults(tmp_path):
    """Pages below the mark are unmapped, not zeroed: a stray read is a loud bug."""
    code = """
import numpy as np, vtm
mgr = vtm.Manager(backend="host", capacity_bytes=1 << 22, chunk_bytes=1 << 16, granularity=1 << 16)
sp = mgr.create_space(row_bytes=3000, max_tokens=200, max_slots=1)
view = sp.tensor(np.uint8)
vt = sp.create(120).result()
view[0, :120 * 3000] = 7
vt.extend(120, low=50).result()
print("kept", int(view[0, 50 * 3000:120 * 3000].min()), flush=True)
print("read", int(view[0, 0]), flush=True)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    # SIGSEGV; under `make test-sanitize`, AddressSanitizer reports it and aborts.
    assert out.returncode in (-signal.SIGSEGV, -signal.SIGBUS, -signal.SIGABRT), out
    assert "kept 7" in out.stdout and "read" not in out.stdout, out


# ---------------------------------------------------------------------------
# window spaces: records with holes, windowed matches (docs/api.md, "Window spaces")

W = 40  # rows a window space's match needs: its last 40


@pytest.fixture
def window(mgr):
    return mgr.create_space(row_bytes=ROW, max_tokens=MAXT, max_slots=6, window_tokens=W)


def slid(space, io, tokens, low):
    """A vTensor that computed `tokens` and slid its low mark to `low`."""
    vt = space.create(len(tokens)).result()
    io.write(vt, tokens, 0, len(tokens))
    vt.extend(len(tokens), low=low).result()
    return vt


def first_row_of(page):
    return -(-page * 64 * 1024 // 3000)


def test_a_record_keeps_holes_and_a_match_maps_only_its_window(mgr, window):
    io = RowIO(window)
    vt = slid(window, io, A[:120], 80)  # pages 0-2 unmapped; 3-5 mapped
    assert window.window_tokens == W
    assert window.prefix_record(vt, A[:120]).result() == 120
    [node] = window.prefix_nodes()
    assert node["pages"][:3] == [None] * 3 and None not in node["pages"][3:]
    st = assert_pool_consistent(mgr)
    assert st["chunks_in_tree"] == 3  # holes hold nothing
    vt.release().result()
    # 120 rows: the window is rows 81-119, on pages 3-5.
    m = window.prefix_match(A[:120] + [SENTINEL]).result()
    assert m.num_tokens == 120
    assert m.vtensor.low == first_row_of(3) == 66
    assert m.vtensor.page_chunks()[:3] == [None] * 3
    assert m.vtensor.page_chunks()[3:5] == node["pages"][3:5], "whole pages are shared"
    assert m.vtensor.page_chunks()[5] not in (None, node["pages"][5]), "the partial last page is a copy"
    io.verify(m.vtensor, A, 66, 120)
    # The vTensor continues like any other, and slides on.
    own = A[:120] + B[:30]
    m.vtensor.extend(150, low=110).result()
    io.write(m.vtensor, own, 120, 150)
    io.verify(m.vtensor, own)
    # A query that leaves the recorded path at row 100 needs rows 61-99:
    # page 2 is a hole, so nothing matches (no shorter length has its window either).
    assert window.prefix_match(A[:100] + [SENTINEL]).result().num_tokens == 0
    m.vtensor.release().result()
    assert_pool_consistent(mgr)


def test_records_through_the_same_nodes_fill_holes(mgr, window):
    io = RowIO(window)
    window.prefix_record(slid(window, io, A[:120], 80), A[:120]).result()
    assert window.prefix_match(A[:60] + [SENTINEL]).result().num_tokens == 0
    # A whole record of A[:60] fills the holes of pages 0-1 and takes a copy
    # of page 2 (it writes its row 60 there next).
    whole = window.create(60).result()
    io.write(whole, A, 0, 60)
    assert window.prefix_record(whole, A[:60]).result() == 0  # no new tokens: only pages
    upper, lower = window.prefix_nodes()
    assert (upper["end"], lower["start"]) == (60, 60)
    assert None not in upper["pages"] and upper["pages"][2] != whole.page_chunks()[2]
    assert lower["pages"][0] is None, "the lower node's own version of page 2 stays a hole"
    m = window.prefix_match(A[:60] + [SENTINEL]).result()
    assert (m.num_tokens, m.vtensor.low) == (60, 0)
    io.verify(m.vtensor, A, 0, 60)
    # Past row 60 a match needs the lower node's page 2 (the upper node's
    # version holds rows 60-65 of whoever recorded it): 100 tokens shrink to 60.
    m2 = window.prefix_match(A[:100] + [SENTINEL]).result()
    assert m2.num_tokens == 60
    io.verify(m2.vtensor, A, 0, 60)
    # A third record, whole, fills that hole: now 100 rows match.
    full = window.create(120).result()
    io.write(full, A, 0, 120)
    window.prefix_record(full, A[:120]).result()
    assert None not in window.prefix_nodes()[1]["pages"]
    m3 = window.prefix_match(A[:100] + [SENTINEL]).result()
    assert (m3.num_tokens, m3.vtensor.low) == (100, first_row_of(2))
    io.verify(m3.vtensor, A, first_row_of(2), 100)
    for v in (whole, full, m.vtensor, m2.vtensor, m3.vtensor):
        v.release().result()
    assert_pool_consistent(mgr)


def test_holes_evict_and_clear_without_leaks(mgr, window):
    io = RowIO(window)
    for tokens in (A[:120], B[:120]):
        vt = slid(window, io, tokens, 80)
        window.prefix_record(vt, tokens).result()
        vt.release().result()
    st = assert_pool_consistent(mgr)
    assert st["chunks_in_tree"] == 6 and st["chunks_held"] == 6 and st["tree_nodes"] == 2
    mgr.trim()
    freed = mgr.trim(bytes=3 * mgr.chunk_bytes)  # evicts the least recently used leaf, A's
    assert freed == 3 * mgr.chunk_bytes and mgr.stats()["evictions_total"] == 1
    assert window.prefix_match(A[:120] + [SENTINEL]).result().num_tokens == 0
    m = window.prefix_match(B[:120] + [SENTINEL]).result()
    assert (m.num_tokens, m.vtensor.low) == (120, 66)
    io.verify(m.vtensor, B, 66, 120)
    m.vtensor.release().result()
    window.clear_prefixes()
    mgr.trim()
    assert mgr.stats()["chunks_created"] == 0
    mgr.check()


def test_window_arguments_that_make_no_sense_are_refused(mgr):
    mgr.create_space(row_bytes=ROW, max_tokens=MAXT, max_slots=1, namespace="shared", window_tokens=W)
    before = mgr.stats()["spaces"]
    for kwargs in ({"window_tokens": -1}, {"window_tokens": MAXT + 1},  # every row is in the window
                   {"namespace": "shared", "window_tokens": W + 1},  # a namespace has one window
                   {"namespace": "shared"}):
        with pytest.raises(vtm.InvalidArgument):
            mgr.create_space(row_bytes=ROW, max_tokens=MAXT, max_slots=1, **kwargs)
        assert mgr.stats()["spaces"] == before
    mgr.check()


BACKEND_OPS = ["create_chunk", "release_chunk", "map", "set_access", "unmap", "copy"]
WINDOW_OPS = {
    # fills pages 0-1's holes and copies page 2 into page 2's
    "record_fill": lambda sp, whole: sp.prefix_record(whole, A[:60]).result(),
    # maps pages 3-4, copies page 5
    "match": lambda sp, whole: sp.prefix_match(A[:120] + [SENTINEL]).result(),
    # a recorder that slid: a new leaf with holes (pages 2-3) and a copy of its page 5
    "record_holes": lambda sp, whole: sp.prefix_record(whole, A[:60] + B[:70]).result(),
}


def window_scenario(op):
    mgr = new_manager(chunks=64, faults=True, prealloc_chunks=0, slot_cache_bytes=0)
    sp = mgr.create_space(row_bytes=ROW, max_tokens=MAXT, max_slots=6, window_tokens=W)
    io = RowIO(sp)
    rec = slid(sp, io, A[:120], 80)
    sp.prefix_record(rec, A[:120]).result()
    tokens = A[:60] + B[:70] if op == "record_holes" else A[:60]
    whole = sp.create(len(tokens)).result()
    io.write(whole, tokens, 0, len(tokens))
    if op == "record_holes":
        whole.extend(len(tokens), low=100).result()
    return mgr, sp, io, {rec: A[:120], whole: tokens}, whole


@pytest.mark.parametrize("op", sorted(WINDOW_OPS))
def test_a_failed_window_record_or_match_changes_nothing(op):
    mgr, sp, io, live, whole = window_scenario(op)
    try:
        c0 = {b: mgr.faults.calls(b) for b in BACKEND_OPS}
        WINDOW_OPS[op](sp, whole)
        used = {b: mgr.faults.calls(b) - c0[b] for b in BACKEND_OPS if mgr.faults.calls(b) > c0[b]}
    finally:
        mgr.close()
    assert used.get("copy", 0) == 1, used
    checked = 0
    for bop, n in sorted(used.items()):
        for k in range(1, n + 1):
            mgr, sp, io, live, whole = window_scenario(op)
            try:
                before = snapshot(mgr, [sp], live, {sp.name: io})
                mgr.faults.fail_nth(bop, k)
                with pytest.raises(vtm.BackendError):
                    WINDOW_OPS[op](sp, whole)
                mgr.faults.clear()
                assert_same_state(before, snapshot(mgr, [sp], live, {sp.name: io}))
                assert_pool_consistent(mgr)
                WINDOW_OPS[op](sp, whole)  # succeeds once the fault is gone
                assert_pool_consistent(mgr)
                checked += 1
            finally:
                mgr.close()
    assert checked >= 1


def test_pages_below_every_lockers_window_are_given_up_under_pressure():
    """Review: two matches of a window path lock all of it, though each maps
    only the pages under its window. Eviction takes no locked node, and the
    last resort unpins only a path one vTensor alone locks, so the pages
    below the windows, which no vTensor maps and no limit charged, stayed
    pinned: a request the pool had room for failed (through vtmd, one
    client limited to 4 chunks kept 62 of 64). Under pressure they go now,
    as holes (a window tree has them anyway): the matches keep their bytes,
    and a match whose window lies there is shorter."""
    m = new_manager(chunks=16, prealloc_chunks=0, slot_cache_bytes=0)
    try:
        chunk = m.chunk_bytes
        win = m.create_space(row_bytes=chunk, max_tokens=16, max_slots=6, window_tokens=3)
        io = RowIO(win)
        tokens = A[:12]
        vt = win.create(12).result()  # twelve pages, a row each
        io.write(vt, tokens, 0, 12)
        win.prefix_record(vt, tokens).result()
        vt.extend(12, low=10).result()  # it slides: pages 0-9 stay in the tree alone
        vt.release().result()
        matches = [win.prefix_match(tokens + [SENTINEL]).result().vtensor for _ in range(2)]
        for match in matches:
            assert (match.num_tokens, match.low) == (12, 10)
        assert m.stats()["chunks_held"] == 12  # ten of them mapped by no one
        big = win.create(10).result()  # 10 chunks: 4 free, and the 10 no vTensor maps
        assert big.mapped_bytes == 10 * chunk
        io.write(big, B, 0, 10)
        for match in matches:
            io.verify(match, tokens, 10, 12)
        # As many as the request lacked (6 of the 10), from the path's first page on.
        assert [p is None for p in win.prefix_nodes()[0]["pages"]] == [True] * 6 + [False] * 6
        again = win.prefix_match(tokens + [SENTINEL]).result()  # its window is still there
        assert again.num_tokens == 12
        io.verify(again.vtensor, tokens, 10, 12)
        assert win.prefix_match(tokens[:5] + [SENTINEL]).result().vtensor is None  # its window went
        shorter = win.prefix_match(tokens[:9] + [SENTINEL]).result()  # its window, rows 7-8, is there
        assert shorter.num_tokens == 9
        io.verify(shorter.vtensor, tokens, 7, 9)
        for v in [again.vtensor, shorter.vtensor, big] + matches:
            v.release().result()
        m.check()
    finally:
        m.close()


def test_a_page_two_locked_nodes_share_goes_from_both_or_stays():
    """Review: the page straddling a split belongs to both halves; the drop
    took it from one half, freed nothing, and stopped there: a hole for
    nothing, and a match of the path six rows long came back five."""
    m = new_manager(chunks=16, prealloc_chunks=0, slot_cache_bytes=0)
    try:
        chunk = m.chunk_bytes
        win = m.create_space(row_bytes=chunk // 2, max_tokens=16, max_slots=6, window_tokens=3)
        io = RowIO(win)
        tokens, other = A[:12], A[:5] + B[:7]  # they part at row 5, inside page 2
        for seq in (tokens, other):
            vt = win.create(12).result()
            io.write(vt, seq, 0, 12)
            win.prefix_record(vt, seq).result()
            vt.release().result()
        matches = [win.prefix_match(tokens + [SENTINEL]).result().vtensor for _ in range(2)]
        win.clear_prefixes()  # the other branch, unlocked, goes: its path stays split at row 5
        filler = m.create_space(row_bytes=chunk, max_tokens=32, max_slots=2, namespace="filler")
        filler.create(16 - m.stats()["chunks_held"]).result()
        win.create(2).result()  # one chunk, which only the locked path's pages no one maps can give
        pages = [nd["pages"] for nd in win.prefix_nodes()]
        shared = pages[0][-1]
        assert (shared is None) == (pages[1][0] is None), f"page 2 went from one half only: {pages}"
        assert m.stats()["window_page_drops_total"] == sum(p is None for nd in pages for p in nd)
        for match in matches:
            io.verify(match, tokens, match.low, 12)
        m.check()
    finally:
        m.close()


def test_locked_window_pages_go_least_recently_used_first_over_all_namespaces():
    """Review: the drops walked each namespace's tree in turn (by name), so a
    path used a moment ago lost its pages before one idle for long."""
    m = new_manager(chunks=16, prealloc_chunks=0, slot_cache_bytes=0)
    try:
        chunk = m.chunk_bytes
        spaces = {ns: m.create_space(row_bytes=chunk, max_tokens=8, max_slots=4, window_tokens=2, namespace=ns)
                  for ns in ("old", "new")}  # "new" sorts first by name
        locked = []
        for ns in ("old", "new"):  # the path of "old" is used first: the least recently used
            space, io = spaces[ns], RowIO(spaces[ns])
            vt = space.create(6).result()
            io.write(vt, A, 0, 6)
            space.prefix_record(vt, A[:6]).result()
            vt.extend(6, low=5).result()
            vt.release().result()
            locked += [space.prefix_match(A[:6] + [SENTINEL]).result().vtensor for _ in range(2)]
        filler = m.create_space(row_bytes=chunk, max_tokens=32, max_slots=2, namespace="filler")
        filler.create(16 - m.stats()["chunks_held"]).result()
        filler.create(1).result()
        holes = {ns: sum(p is None for nd in space.prefix_nodes() for p in nd["pages"]) for ns, space in spaces.items()}
        assert holes == {"old": 1, "new": 0}, holes
        m.check()
    finally:
        m.close()
