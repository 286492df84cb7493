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
