"""The Python API of docs/api.md: geometry, bytes, errors, policies, lifetime."""

import gc

import numpy as np
import pytest

import vtm
from vtm_testing import (CHUNK, HOST_CHUNK, SCALE, SENTINEL, RowIO, host_only, assert_pool_consistent, assert_same_state,
                      chunk_for, cuda_available, new_manager, poll, snapshot)


def run(fn):
    """Errors may surface at submission or from result(): accept both."""
    r = fn()
    return r.result(timeout=60) if hasattr(r, "result") and hasattr(r, "done") else r


def pages_for(n_tokens, row, chunk):
    return -(-n_tokens * row // chunk)


# --------------------------------------------------------------------------
# geometry and bytes, on every backend


def test_error_hierarchy():
    for cls in (vtm.OutOfMemory, vtm.InvalidArgument, vtm.NotFound, vtm.FailedPrecondition,
                vtm.BackendError, vtm.Unavailable, vtm.InternalError):
        assert issubclass(cls, vtm.Error)
    assert issubclass(vtm.InvalidArgument, ValueError)
    assert issubclass(vtm.NotFound, LookupError)
    assert issubclass(vtm.Error, Exception)


@pytest.mark.parametrize("max_slots, max_tokens", [(10 ** 6, 1), (5000, 200), (50_000, 1), (10 ** 8, 100)])
def test_a_space_whose_page_table_exceeds_the_pools_budget_is_refused(make_manager, max_slots, max_tokens):
    """A space's page table is allocated whole: max_slots=10**8 of a
    4-chunk pool used to take every byte of the machine (FlexInfer's
    max_num_seqs=10**8) instead of an InvalidArgument. vtm.limits says the
    same as create_space, for callers that check first."""
    mgr = make_manager(chunks=4)
    row = CHUNK // 64  # 64 rows a page
    entries = vtm.limits.page_table_entries(row, max_tokens, max_slots, mgr.chunk_bytes)
    budget = vtm.limits.page_table_budget(mgr.capacity_bytes, mgr.chunk_bytes)
    assert budget == 1 << 20  # the floor: a small pool still has virtual memory well beyond it
    fits = entries <= budget and max_slots * vtm.limits.slot_bytes(row, max_tokens, mgr.chunk_bytes) <= vtm.MAX_SPACE_BYTES
    assert fits == (max_slots < 10 ** 6)
    if fits:
        sp = mgr.create_space(row_bytes=row, max_tokens=max_tokens, max_slots=max_slots)
        assert sp.max_slots == max_slots
        sp.close()
    else:
        with pytest.raises(vtm.InvalidArgument, match="page table|address space"):
            mgr.create_space(row_bytes=row, max_tokens=max_tokens, max_slots=max_slots)
        assert mgr.stats()["spaces"] == {}


def test_geometry(backend, make_manager):
    chunk = chunk_for(backend)
    mgr = make_manager(backend, chunks=16)
    assert mgr.backend == backend
    assert mgr.chunk_bytes == chunk
    assert mgr.capacity_bytes == 16 * chunk
    assert chunk % mgr.granularity == 0
    if backend == "host":
        assert mgr.granularity == HOST_CHUNK
    row = chunk // 20 + 7  # rows straddle pages
    sp = mgr.create_space(row_bytes=row, max_tokens=100, max_slots=3)
    assert sp.row_bytes == row and sp.max_tokens == 100 and sp.max_slots == 3
    assert sp.slot_bytes == -(-100 * row // chunk) * chunk
    assert sp.pages_per_slot == sp.slot_bytes // chunk
    assert sp.free_slots == 3
    assert sp.name.startswith("space")
    assert isinstance(sp.base_address, int) and sp.base_address != 0
    sp2 = mgr.create_space(row_bytes=row, max_tokens=10, max_slots=1, name="mine")
    assert sp2.name == "mine" and sp2.name != sp.name
    vts = [sp.create(0).result() for _ in range(3)]
    assert sorted(vt.slot for vt in vts) == [0, 1, 2]
    for vt in vts:
        assert vt.address == sp.base_address + vt.slot * sp.slot_bytes
        assert vt.space.name == sp.name
        assert vt.num_tokens == 0 and vt.mapped_bytes == 0 and not vt.released
        assert vt.page_chunks() == [None] * sp.pages_per_slot
    assert sp.free_slots == 0
    assert len({vt.id for vt in vts}) == 3
    d = {vt: i for i, vt in enumerate(vts)}  # hashable
    assert d[vts[1]] == 1
    st = mgr.stats()
    for key in ("backend", "chunk_bytes", "capacity_bytes", "chunks_created", "chunks_free",
                "chunks_held", "chunks_mapped", "chunks_cached", "chunks_in_tree", "tree_nodes",
                "tree_tokens", "evictions_total", "cow_copies_total", "slot_reuses_total",
                "prealloc_chunks_total", "chunks_released_total", "spaces", "ops"):
        assert key in st, key
    assert st["backend"] == backend and st["chunk_bytes"] == chunk
    assert set(st["spaces"]) == {sp.name, sp2.name}
    for key in ("namespace", "row_bytes", "slot_bytes", "max_slots", "slots_free", "vtensors",
                "used_tokens", "used_bytes", "mapped_bytes", "cached_bytes"):
        assert key in st["spaces"][sp.name], key
    assert st["spaces"][sp.name]["vtensors"] == 3 and st["spaces"][sp.name]["slots_free"] == 0


def test_rows_roundtrip(backend, make_manager):
    chunk = chunk_for(backend)
    mgr = make_manager(backend, chunks=32)
    row = chunk // 20 + 7
    sp = mgr.create_space(row_bytes=row, max_tokens=100, max_slots=4)
    io = RowIO(sp, backend)
    a_toks, b_toks = [1] * 100, [2] * 100
    a = sp.create(30).result()
    b = sp.create(45).result()
    io.write(a, a_toks, 0, 30)
    io.write(b, b_toks, 0, 45)
    for vt, n in ((a, 30), (b, 45)):
        pages = vt.page_chunks()
        need = pages_for(n, row, chunk)
        assert all(p is not None for p in pages[:need])
        assert all(p is None for p in pages[need:])
        assert vt.mapped_bytes == need * chunk
    ids = [p for vt in (a, b) for p in vt.page_chunks() if p is not None]
    assert len(ids) == len(set(ids)), "two pages share a chunk without prefix sharing"
    a.extend(77).result()
    assert a.num_tokens == 77
    io.write(a, a_toks, 30, 77)
    a.extend(10).result()  # no-op
    assert a.num_tokens == 77
    io.verify(a, a_toks)
    io.verify(b, b_toks)
    st = assert_pool_consistent(mgr)
    used = st["spaces"][sp.name]
    assert used["used_tokens"] == 77 + 45
    assert used["used_bytes"] == (77 + 45) * row
    assert st["chunks_mapped"] == pages_for(77, row, chunk) + pages_for(45, row, chunk)


def test_prefix_sharing_bytes(backend, make_manager):
    chunk = chunk_for(backend)
    mgr = make_manager(backend, chunks=64)
    row = chunk // 20 + 7
    sp = mgr.create_space(row_bytes=row, max_tokens=100, max_slots=6)
    io = RowIO(sp, backend)
    A = [(3 * i) % 11 for i in range(100)]
    rec = sp.create(70).result()
    io.write(rec, A, 0, 70)
    assert sp.prefix_record(rec, A[:50]).result() == 50
    st = mgr.stats()
    assert st["chunks_in_tree"] == pages_for(50, row, chunk)
    copies = st["cow_copies_total"]
    L = 45  # ends inside a page
    assert (L * row) % chunk != 0
    m = sp.prefix_match(A[:L] + [SENTINEL]).result()
    assert m.num_tokens == L
    vt = m.vtensor
    io.verify(vt, A, 0, L)
    full = (L * row) // chunk
    rp, mp = rec.page_chunks(), vt.page_chunks()
    assert mp[:full] == rp[:full], "pages fully below the match must map the recorded chunks"
    assert mp[full] is not None and mp[full] != rp[full], "the partial page must be a private copy"
    assert mgr.stats()["cow_copies_total"] == copies + 1
    # the matched vTensor writes its own continuation; nobody else sees it
    own = A[:L] + [99] * 40
    vt.extend(len(own)).result()
    io.write(vt, own, L, len(own))
    io.verify(vt, own)
    io.verify(rec, A[:70])
    m2 = sp.prefix_match(A[:50] + [SENTINEL]).result()
    assert m2.num_tokens == 50
    io.verify(m2.vtensor, A, 0, 50)
    for v in (vt, m2.vtensor, rec):
        v.release().result()
    sp.clear_prefixes()
    mgr.trim()
    st = assert_pool_consistent(mgr)
    assert st["chunks_created"] == 0


# --------------------------------------------------------------------------
# torch views


@pytest.mark.torch_cuda
def test_torch_view_shape_and_zero_copy(make_manager):
    torch = pytest.importorskip("torch")
    mgr = make_manager(chunks=16)
    sp = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=100, max_slots=3)
    t8 = sp.tensor(torch.uint8)
    device = t8.device
    assert device.type == ("cuda" if mgr.backend == "cuda" else "cpu")
    assert isinstance(t8, torch.Tensor)
    assert t8.dtype == torch.uint8 and tuple(t8.shape) == (3, sp.slot_bytes)
    assert t8.data_ptr() == sp.base_address
    t16 = sp.tensor(torch.float16)
    assert t16.dtype == torch.float16 and tuple(t16.shape) == (3, sp.slot_bytes // 2)
    assert t16.data_ptr() == sp.base_address
    vt = sp.create(10).result()
    s = vt.slot
    t8[s, :3000] = torch.arange(3000, dtype=torch.int64, device=device).remainder(251).to(torch.uint8)
    t16[s, 1500:1600] = 1.5
    if device.type == "cuda":
        torch.cuda.synchronize()
    # Both views are the same memory: the uint8 view sees the float16 writes.
    got = t8[s, :3200].cpu()
    assert torch.equal(got[:3000], torch.arange(3000).remainder(251).to(torch.uint8))
    assert torch.all(got[3000:3200].view(torch.float16) == 1.5)
    vt.release().result()


@host_only
def test_numpy_views_share_the_torch_views_memory(make_manager):
    torch = pytest.importorskip("torch")
    mgr = make_manager(chunks=16)
    sp = mgr.create_space(row_bytes=3000, max_tokens=100, max_slots=3)
    t8 = sp.tensor(torch.uint8)
    n8 = sp.tensor(np.uint8)
    assert isinstance(n8, np.ndarray) and n8.shape == (3, sp.slot_bytes) and n8.dtype == np.uint8
    assert n8.__array_interface__["data"][0] == sp.base_address
    nf = sp.tensor("float32")
    assert nf.shape == (3, sp.slot_bytes // 4) and nf.dtype == np.float32
    vt = sp.create(10).result()
    s = vt.slot
    t8[s, :3000] = torch.arange(3000, dtype=torch.int64).remainder(251).to(torch.uint8)
    assert np.array_equal(n8[s, :3000], (np.arange(3000) % 251).astype(np.uint8))
    nf[s, 750:800] = 2.5
    assert torch.all(t8[s, 3000:3200].view(torch.float32) == 2.5)
    vt.release().result()


# --------------------------------------------------------------------------
# errors: typed, and nothing changes


@pytest.fixture
def small(make_manager):
    mgr = make_manager(chunks=8, slot_cache_bytes=0)
    sp = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=60, max_slots=3)  # 3 pages per slot
    io = RowIO(sp)
    vt = sp.create(30).result()
    io.write(vt, [5] * 30, 0, 30)
    live = {vt: [5] * 30}
    return mgr, sp, io, vt, live


def test_bad_sizes(small):
    mgr, sp, io, vt, live = small
    ios = {sp.name: io}
    before = snapshot(mgr, [sp], live, ios)
    for fn in (lambda: sp.create(61), lambda: sp.create(-1), lambda: vt.extend(61),
               lambda: vt.extend(-5), lambda: mgr.step({vt: 61}), lambda: mgr.step({vt: -1})):
        with pytest.raises(vtm.InvalidArgument):
            run(fn)
        assert_same_state(before, snapshot(mgr, [sp], live, ios), allow_reclaim=False)
    for kw in (dict(row_bytes=0, max_tokens=10, max_slots=1),
               dict(row_bytes=-3, max_tokens=10, max_slots=1),
               dict(row_bytes=100, max_tokens=0, max_slots=1),
               dict(row_bytes=100, max_tokens=10, max_slots=0)):
        with pytest.raises(vtm.InvalidArgument):
            mgr.create_space(**kw)
    with pytest.raises(vtm.InvalidArgument):
        mgr.create_space(row_bytes=100, max_tokens=10, max_slots=1, name=sp.name)
    assert set(mgr.stats()["spaces"]) == {sp.name}
    mgr.check()


def test_vtensor_of_another_space(small):
    mgr, sp, io, vt, live = small
    other = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=60, max_slots=2)
    ios = {sp.name: io}
    before = snapshot(mgr, [sp, other], live, ios)
    with pytest.raises(vtm.FailedPrecondition):
        run(lambda: other.prefix_record(vt, [5] * 10))
    assert_same_state(before, snapshot(mgr, [sp, other], live, ios), allow_reclaim=False)
    # even when the two spaces share a namespace
    s1 = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=60, max_slots=1, namespace="ns")
    s2 = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=60, max_slots=1, namespace="ns")
    w = s1.create(5).result()
    RowIO(s1).write(w, [1] * 5, 0, 5)
    with pytest.raises(vtm.FailedPrecondition):
        run(lambda: s2.prefix_record(w, [1] * 5))
    assert s1.prefix_nodes() == [] and s2.prefix_nodes() == []
    assert s1.prefix_record(w, [1] * 5).result() == 5


def test_release_twice(small):
    mgr, sp, io, vt, live = small
    vt.release().result()
    assert vt.released
    st = mgr.stats()
    with pytest.raises(vtm.FailedPrecondition):
        run(lambda: vt.release())
    with pytest.raises(vtm.FailedPrecondition):
        run(lambda: vt.extend(40))
    with pytest.raises(vtm.FailedPrecondition):
        run(lambda: sp.prefix_record(vt, [5] * 3))
    st2 = mgr.stats()
    for k in ("chunks_created", "chunks_free", "chunks_held", "chunks_mapped", "tree_nodes"):
        assert st2[k] == st[k], k
    assert st2["spaces"][sp.name]["slots_free"] == 3
    mgr.check()


def test_failed_future_exception(small):
    mgr, sp, io, vt, live = small
    try:
        fut = vt.extend(1000)
    except vtm.InvalidArgument:
        pytest.skip("argument errors are raised at submission")
    exc = fut.exception(timeout=30)
    assert isinstance(exc, vtm.InvalidArgument)
    assert fut.done()
    with pytest.raises(vtm.InvalidArgument):
        fut.result()
    ok = vt.extend(31)
    assert ok.exception(timeout=30) is None and ok.result() is None
    io.write(vt, [5] * 31, 30, 31)
    st = mgr.stats()
    errs = sum(v["errors"] for v in st["ops"].values())
    assert errs >= 1
    for name, v in st["ops"].items():
        assert {"count", "errors", "mean_us", "max_us"} <= set(v), name
        assert v["count"] >= v["errors"] and v["max_us"] >= v["mean_us"] >= 0
    assert sum(v["count"] for v in st["ops"].values()) >= 3


def test_bad_manager_arguments():
    with pytest.raises(vtm.InvalidArgument):
        vtm.Manager(backend="tpu", capacity_bytes=1 << 20, chunk_bytes=HOST_CHUNK,
                    granularity=HOST_CHUNK)
    with pytest.raises(vtm.InvalidArgument):
        vtm.Manager(backend="host", capacity_bytes=3 * HOST_CHUNK + 1, chunk_bytes=HOST_CHUNK,
                    granularity=HOST_CHUNK)
    with pytest.raises(vtm.InvalidArgument):
        vtm.Manager(backend="host", capacity_bytes=4 * 96 * 1024, chunk_bytes=96 * 1024,
                    granularity=HOST_CHUNK)
    with pytest.raises(vtm.InvalidArgument):
        vtm.Manager(backend="host", capacity_bytes=0, chunk_bytes=HOST_CHUNK,
                    granularity=HOST_CHUNK)


def test_cuda_unavailable_without_driver():
    if cuda_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(vtm.Unavailable):
        vtm.Manager(backend="cuda", capacity_bytes=8 << 20, chunk_bytes=2 << 20)


def test_auto_backend():
    mgr = vtm.Manager(backend="auto", capacity_bytes=8 << 20, chunk_bytes=2 << 20)
    try:
        assert mgr.backend == ("cuda" if cuda_available() else "host")
    finally:
        mgr.close()


def test_out_of_slots(small):
    mgr, sp, io, vt, live = small
    b = sp.create(0).result()
    c = sp.create(0).result()
    live.update({b: [], c: []})
    ios = {sp.name: io}
    before = snapshot(mgr, [sp], live, ios)
    with pytest.raises(vtm.OutOfMemory) as ei:
        run(lambda: sp.create(1))
    assert "slot" in str(ei.value).lower()
    assert_same_state(before, snapshot(mgr, [sp], live, ios), allow_reclaim=False)
    slot = vt.slot
    vt.release().result()
    d = sp.create(3).result()
    assert d.slot == slot


def test_out_of_capacity_changes_nothing(make_manager):
    mgr = make_manager(chunks=4, slot_cache_bytes=0)
    sp = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=120, max_slots=3)
    io = RowIO(sp)
    a = sp.create(60).result()  # 3 pages
    live = {a: [1] * 60}
    io.write(a, live[a], 0, 60)
    ios = {sp.name: io}
    before = snapshot(mgr, [sp], live, ios)
    with pytest.raises(vtm.OutOfMemory) as ei:
        run(lambda: sp.create(60))
    assert "capacity" in str(ei.value).lower()
    assert_same_state(before, snapshot(mgr, [sp], live, ios))
    with pytest.raises(vtm.OutOfMemory):
        run(lambda: a.extend(120))
    assert_same_state(before, snapshot(mgr, [sp], live, ios))
    b = sp.create(20).result()  # exactly the last chunk
    assert b.num_tokens == 20
    a.release().result()
    c = sp.create(60).result()  # room again
    assert c.num_tokens == 60
    assert mgr.stats()["chunks_created"] <= 4


def test_step_atomicity(make_manager):
    mgr = make_manager(chunks=6, slot_cache_bytes=0, prealloc_chunks=0)
    sp = mgr.create_space(row_bytes=4096 * SCALE, max_tokens=64, max_slots=4)  # 16 rows per page
    io = RowIO(sp)
    a = sp.create(16).result()
    b = sp.create(16).result()
    live = {a: [1] * 64, b: [2] * 64}
    io.write(a, live[a], 0, 16)
    io.write(b, live[b], 0, 16)
    ios = {sp.name: io}
    view = {vt: t[:16] for vt, t in live.items()}
    before = snapshot(mgr, [sp], view, ios)
    with pytest.raises(vtm.OutOfMemory):
        run(lambda: mgr.step({a: 64, b: 64}))  # needs 6 more chunks, 4 left
    assert_same_state(before, snapshot(mgr, [sp], view, ios))
    with pytest.raises(vtm.InvalidArgument):
        run(lambda: mgr.step({a: 32, b: 65}))
    assert_same_state(before, snapshot(mgr, [sp], view, ios))
    c = sp.create(0).result()
    c.release().result()
    with pytest.raises(vtm.FailedPrecondition):
        run(lambda: mgr.step({a: 32, c: 16}))
    assert_same_state(before, snapshot(mgr, [sp], view, ios))
    mgr.step({a: 48, b: 48}).result()  # exactly 4 more
    assert a.num_tokens == 48 and b.num_tokens == 48
    io.write(a, live[a], 16, 48)
    io.write(b, live[b], 16, 48)
    io.verify(a, live[a][:48])
    io.verify(b, live[b][:48])
    assert_pool_consistent(mgr)


# --------------------------------------------------------------------------
# policies: deferred reclamation, eager allocation, lazy release


def test_deferred_reclamation_reuses_slot(make_manager):
    mgr = make_manager(chunks=32, slot_cache_bytes=16 * CHUNK, prealloc_chunks=0)
    sp = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=60, max_slots=4)
    vt = sp.create(60).result()  # 3 pages
    slot, pages = vt.slot, vt.page_chunks()
    vt.release().result()
    st = mgr.stats()
    assert st["chunks_cached"] == 3 and st["chunks_created"] == 3
    assert st["spaces"][sp.name]["cached_bytes"] == 3 * CHUNK
    assert sp.free_slots == 4
    reuses = st["slot_reuses_total"]
    vt2 = sp.create(50).result()
    st = mgr.stats()
    assert vt2.slot == slot
    assert st["slot_reuses_total"] == reuses + 1
    assert st["chunks_created"] == 3, "a reused slot needs no new chunk"
    assert vt2.page_chunks()[:3] == pages[:3]
    assert st["chunks_cached"] == 0
    io = RowIO(sp)
    io.write(vt2, [4] * 50, 0, 50)
    io.verify(vt2, [4] * 50)
    assert_pool_consistent(mgr)


def test_deferred_reclamation_best_fit(make_manager):
    mgr = make_manager(chunks=64, slot_cache_bytes=32 * CHUNK, prealloc_chunks=0)
    sp = mgr.create_space(row_bytes=CHUNK // 4, max_tokens=28, max_slots=8)  # 4 rows/page
    vts = {p: sp.create(4 * p).result() for p in (1, 4, 6)}
    slots = {p: vt.slot for p, vt in vts.items()}
    pages = {p: vt.page_chunks() for p, vt in vts.items()}
    for vt in vts.values():
        vt.release().result()
    st = mgr.stats()
    assert st["chunks_cached"] == 11 and st["chunks_created"] == 11
    r0 = st["slot_reuses_total"]
    got = {}
    for need, want in ((3, 4), (5, 6), (1, 1)):
        vt = sp.create(4 * need).result()
        assert vt.slot == slots[want], f"a {need}-page request should reuse the {want}-page slot"
        assert vt.page_chunks()[:need] == pages[want][:need]
        got[need] = vt
    st = mgr.stats()
    assert st["slot_reuses_total"] == r0 + 3
    assert st["chunks_created"] == 11
    assert_pool_consistent(mgr)


def test_eager_allocation(make_manager):
    mgr = make_manager(chunks=32, prealloc_chunks=4, slot_cache_bytes=0)
    sp = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=60, max_slots=4)
    vt = sp.create(60).result()  # 3 pages
    assert poll(lambda: mgr.stats()["chunks_free"] == 4), mgr.stats()
    st = mgr.stats()
    assert st["prealloc_chunks_total"] >= 4
    assert st["chunks_created"] == st["chunks_held"] + 4
    created = st["chunks_created"]
    vt2 = sp.create(40).result()  # 2 pages: taken from the preallocated ones
    assert poll(lambda: mgr.stats()["chunks_free"] == 4), mgr.stats()
    st = mgr.stats()
    assert st["chunks_created"] == created + 2
    assert st["chunks_held"] == 5
    vt.release().result()
    vt2.release().result()
    assert_pool_consistent(mgr)


def test_lazy_release_and_trim(make_manager):
    mgr = make_manager(chunks=32, slot_cache_bytes=0, prealloc_chunks=0)
    sp = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=60, max_slots=4)
    vt = sp.create(60).result()
    vt.release().result()
    st = mgr.stats()
    assert st["chunks_free"] == 3 and st["chunks_created"] == 3 and st["chunks_held"] == 0
    r0 = st["chunks_released_total"]
    # a new vTensor takes free chunks before creating any
    vt = sp.create(40).result()
    assert mgr.stats()["chunks_created"] == 3
    vt.release().result()
    got = mgr.trim()
    assert got == 3 * CHUNK
    st = mgr.stats()
    assert st["chunks_created"] == 0 and st["chunks_free"] == 0
    assert st["chunks_released_total"] == r0 + 3
    assert mgr.trim() == 0


def test_trim_returns_cached_pages(make_manager):
    mgr = make_manager(chunks=32, slot_cache_bytes=16 * CHUNK, prealloc_chunks=0)
    sp = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=60, max_slots=4)
    keep = sp.create(20).result()  # 1 page, live
    vt = sp.create(60).result()
    vt.release().result()
    assert mgr.stats()["chunks_cached"] == 3
    got = mgr.trim()
    assert got == 3 * CHUNK
    st = mgr.stats()
    assert st["chunks_cached"] == 0 and st["chunks_created"] == 1
    assert st["spaces"][sp.name]["cached_bytes"] == 0
    assert keep.page_chunks()[0] is not None


def test_max_free_chunks_watermark(make_manager):
    mgr = make_manager(chunks=32, slot_cache_bytes=0, max_free_chunks=2)
    sp = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=150, max_slots=4)
    vt = sp.create(130).result()  # 6 pages
    vt.release().result()
    assert poll(lambda: mgr.stats()["chunks_free"] <= 2), mgr.stats()
    st = mgr.stats()
    assert st["chunks_free"] == 2 and st["chunks_created"] == 2
    assert st["chunks_released_total"] >= 4
    assert_pool_consistent(mgr)


def test_slot_cache_default_is_quarter_capacity(make_manager):
    mgr = make_manager(chunks=16, prealloc_chunks=0)  # cache: 4 chunks
    sp = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=140, max_slots=4)
    a = sp.create(130).result()  # 6 pages
    a.release().result()
    st = mgr.stats()
    assert st["chunks_cached"] <= 4
    assert st["spaces"][sp.name]["cached_bytes"] <= 4 * CHUNK
    assert_pool_consistent(mgr)


# --------------------------------------------------------------------------
# lifetime


@pytest.mark.torch_cuda
def test_view_outlives_manager():
    """A view that outlives its memory reads zeros (docs/api.md, Views after close):
    a Jupyter user printing a tensor after a clean close must not lose the kernel."""
    torch = pytest.importorskip("torch")
    mgr = new_manager(chunks=8)
    sp = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=60, max_slots=2)
    view = sp.tensor(torch.uint8)
    vt = sp.create(10).result()
    slot = vt.slot
    view[slot, :3000] = 7
    assert int(view[slot, :3000].sum()) == 7 * 3000
    if view.device.type == "cuda":
        torch.cuda.synchronize()
    mgr.close()
    with pytest.raises(vtm.FailedPrecondition):
        run(lambda: sp.create(1))
    with pytest.raises(vtm.FailedPrecondition):
        run(lambda: vt.extend(20))
    with pytest.raises(vtm.FailedPrecondition):
        run(lambda: mgr.trim())
    assert tuple(view.shape) == (2, sp.slot_bytes)
    # Checked before touching the view: an unsealed range would fault.
    assert mgr.stats()["reservation_free_failures_total"] == 0
    # The pages written before, and the slot never mapped, read zeros now.
    assert int(view.sum()) == 0
    assert int(view[1 - slot, -4096:].sum()) == 0
    del view
    gc.collect()
    del vt, sp, mgr
    gc.collect()


@pytest.mark.torch_cuda
def test_view_outlives_its_closed_space(make_manager):
    torch = pytest.importorskip("torch")
    mgr = make_manager(chunks=16)
    sp = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=60, max_slots=2)
    other = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=60, max_slots=2)
    view, kept = sp.tensor(torch.uint8), other.tensor(torch.uint8)
    a, b = sp.create(60).result(), other.create(60).result()
    slot = a.slot
    view[slot, :1000] = 3
    kept[b.slot, :1000] = 5
    if view.device.type == "cuda":
        # The writes finish before close unmaps their pages: a kernel still
        # writing there would take an illegal-address error, sticky for the
        # whole process (every later CUDA test in this file would fail).
        torch.cuda.synchronize()
    sp.close()
    assert a.released
    st = assert_pool_consistent(mgr)
    assert st["reservation_free_failures_total"] == 0  # before touching the view: it is sealed
    assert int(view[slot].sum()) == 0, "a closed space's view reads zeros"
    assert int(kept[b.slot, :1000].sum()) == 5 * 1000, "other spaces are untouched"
    c = other.create(60).result()  # the chunks the closed space returned are reused
    kept[c.slot, :10] = 1
    if kept.device.type == "cuda":
        torch.cuda.synchronize()  # before the teardown closes the manager under the write
    del view
    gc.collect()


@host_only
def test_a_write_through_a_closed_view_faults(tmp_path):
    """Reads of a closed space's view return zeros; a write is a bug, and faults."""
    code = """
import vtm, torch
mgr = vtm.Manager(backend="host", capacity_bytes=1 << 20, chunk_bytes=1 << 16, granularity=1 << 16)
sp = mgr.create_space(row_bytes=1024, max_tokens=64, max_slots=2)
view = sp.tensor(torch.uint8)
sp.create(64).result()
mgr.close()
print("read", int(view.sum()), flush=True)
view[0, 0] = 1
print("wrote")
"""
    import signal
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    # SIGSEGV; under `make test-sanitize`, AddressSanitizer reports it and aborts.
    assert out.returncode in (-signal.SIGSEGV, -signal.SIGABRT), out
    assert "read 0" in out.stdout and "wrote" not in out.stdout, out


def test_context_manager():
    with new_manager(chunks=8) as mgr:
        sp = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=60, max_slots=2)
        vt = sp.create(30).result()
        io = RowIO(sp)
        io.write(vt, [1] * 30, 0, 30)
        io.verify(vt, [1] * 30)
        pending = [vt.extend(n) for n in range(31, 61)]
        del io
    # close() waited for the queued operations
    assert all(f.done() for f in pending)
    for f in pending:
        assert f.result() is None
    with pytest.raises(vtm.FailedPrecondition):
        run(lambda: sp.create(1))


def test_space_close_releases_its_vtensors(make_manager):
    mgr = make_manager(chunks=32, prealloc_chunks=0)
    sp = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=60, max_slots=4)
    other = mgr.create_space(row_bytes=3000 * SCALE, max_tokens=60, max_slots=4)
    keep = other.create(40).result()
    a = sp.create(60).result()
    b = sp.create(20).result()
    b2 = sp.create(60).result()
    b2.release().result()  # cached pages
    sp.close()
    assert a.released and b.released
    mgr.trim()
    st = assert_pool_consistent(mgr)
    assert st["chunks_created"] == 2 and st["chunks_held"] == 2
    assert not keep.released and keep.page_chunks()[1] is not None


# --------------------------------------------------------------------------
# ordering against the kernels that wrote the bytes (docs/design.md §5)


def _busy_then_fill(torch, rows, value):
    """Queues ~0.3 s of GPU spinning, then a fill of `rows`, on the current
    stream, and returns at once: a copy that does not wait for this stream
    reads the rows before the fill reaches them."""
    torch.cuda._sleep(500_000_000)
    rows.fill_(value)


def test_prefix_copies_wait_for_the_kernels_that_wrote_the_page(backend, make_manager):
    """Issue 17, finding 1: prefix_record copied the page being written, and
    prefix_match the copy-on-write page, on vtm's own stream without waiting
    for the kernels still writing them. Both now wait for the work queued on
    the caller's stream (the legacy default stream unless `stream=` names
    another) when they were submitted; a fence on an unrelated stream is the
    control that shows the race is there to be lost."""
    torch = pytest.importorskip("torch")
    if backend != "cuda" or not torch.cuda.is_available():
        pytest.skip("needs the cuda backend and a CUDA build of torch (host kernels finish before they return)")
    mgr = make_manager(chunks=32)
    row = CHUNK // 512  # page 0 holds rows 0-511, page 1 rows 512-1023
    sp = mgr.create_space(row_bytes=row, max_tokens=1024, max_slots=8)
    kv = sp.tensor(torch.uint8)
    unrelated = torch.cuda.Stream()

    def recorded_rows(first_token, fence_stream):
        """Write rows 0-999 (rows 512-999, the page being written, last and
        late), record them, match them back; the matched rows 512-999."""
        tokens = [first_token + t for t in range(1000)]
        vt = sp.create(1000).result()
        rows = kv[vt.slot, : 1000 * row].view(1000, row)
        rows.fill_(1)
        torch.cuda.synchronize()
        _busy_then_fill(torch, rows[512:1000], 7)
        sp.prefix_record(vt, tokens, **fence_stream).result()
        torch.cuda.synchronize()
        match = sp.prefix_match(tokens + [SENTINEL]).result()
        assert match.num_tokens == 1000
        got = kv[match.vtensor.slot, : 1000 * row].view(1000, row)[512:1000, :: row // 8].cpu()
        match.vtensor.release().result()
        vt.release().result()
        return got

    assert bool((recorded_rows(0, {}) == 7).all()), "prefix_record copied before the default stream's fill"
    current = {"stream": torch.cuda.current_stream()}
    assert bool((recorded_rows(10_000, current) == 7).all()), "prefix_record copied before the named stream's fill"
    stale = recorded_rows(20_000, {"stream": unrelated})
    assert bool((stale == 1).all()), "control: a fence on an idle stream should not wait for the fill"

    # prefix_match's copy-on-write: the 512 recorded rows fill page 0 exactly,
    # so the record copies nothing and shares the page still being written.
    tokens = [30_000 + t for t in range(512)]
    vt = sp.create(512).result()
    rows = kv[vt.slot, : 512 * row].view(512, row)
    rows.fill_(1)
    torch.cuda.synchronize()
    _busy_then_fill(torch, rows, 9)
    sp.prefix_record(vt, tokens).result()
    match = sp.prefix_match(tokens[:300] + [SENTINEL]).result()
    assert match.num_tokens == 300
    got = kv[match.vtensor.slot, : 300 * row].view(300, row)[:, :: row // 8].cpu()
    assert bool((got == 9).all()), "prefix_match copied before the default stream's fill"
    match.vtensor.release().result()
    vt.release().result()

    # A record that copies nothing still orders vtm's later copies after its
    # stream: a match made with another (idle) stream reads the final bytes.
    tokens = [40_000 + t for t in range(512)]
    vt = sp.create(512).result()
    rows = kv[vt.slot, : 512 * row].view(512, row)
    rows.fill_(1)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        _busy_then_fill(torch, rows, 5)
    sp.prefix_record(vt, tokens, stream=side).result()
    match = sp.prefix_match(tokens[:300] + [SENTINEL], stream=unrelated).result()
    got = kv[match.vtensor.slot, : 300 * row].view(300, row)[:, :: row // 8].cpu()
    assert bool((got == 5).all()), "prefix_match overtook the kernels still writing a page the record shared"
    match.vtensor.release().result()
    vt.release().result()
    torch.cuda.synchronize()
    mgr.check()
    del kv, rows


def test_stream_argument_is_checked(small):
    mgr, sp, io, vt, live = small
    ios = {sp.name: io}
    before = snapshot(mgr, [sp], live, ios)
    for fn in (lambda: sp.prefix_match([5] * 3, stream=-1), lambda: sp.prefix_match([5] * 3, stream="default"),
               lambda: sp.prefix_record(vt, [5] * 30, stream=-1)):
        with pytest.raises(vtm.InvalidArgument):
            run(fn)
        assert_same_state(before, snapshot(mgr, [sp], live, ios), allow_reclaim=False)
    assert sp.prefix_match([5] * 3, stream=None).result().num_tokens == 0
    mgr.check()


def test_shrink_moves_the_prefix_lock_up_to_the_rows_it_keeps():
    """A vTensor that recorded [1, 2] and then [1, 2, 3, 4] locks the node
    [2, 4); shrunk to 2 rows it holds nothing of that node, which becomes
    evictable; shrunk to 0, nothing of the tree stays locked."""
    mgr = new_manager(chunks=16)
    try:
        sp = mgr.create_space(row_bytes=mgr.chunk_bytes, max_tokens=8, max_slots=2)
        vt = sp.create(4).result()
        sp.prefix_record(vt, [1, 2]).result()
        sp.prefix_record(vt, [1, 2, 3, 4]).result()
        assert [(n["start"], n["end"], n["locks"]) for n in sp.prefix_nodes()] == [(0, 2, 1), (2, 4, 1)]
        vt.shrink(3).result()  # row 2 is still its own
        assert [n["locks"] for n in sp.prefix_nodes()] == [1, 1]
        vt.shrink(2).result()
        assert [n["locks"] for n in sp.prefix_nodes()] == [1, 0]
        assert mgr.trim(mgr.chunk_bytes) >= mgr.chunk_bytes  # the leaf [2, 4) goes
        assert [(n["start"], n["end"]) for n in sp.prefix_nodes()] == [(0, 2)]
        vt.shrink(0).result()
        assert [n["locks"] for n in sp.prefix_nodes()] == [0]
        mgr.check()
        vt.extend(3).result()
        vt.release().result()
        mgr.check()
    finally:
        mgr.close()
