"""Fault injection: every backend call an operation makes may fail, and the
operation must then fail with a typed error and leave the state as it was.

docs/api.md, Errors: "A failed operation leaves every vTensor, the tree and the
pool accounting as they were; only caches (free chunks, pages of released
slots) may have been reclaimed on the way." docs/design.md §3: "a failed operation
(out of memory, an injected fault, a bad argument) leaves all state exactly as before it".
"""

import pytest

import vtm
from vtm_testing import (CHUNK, SCALE, SENTINEL, RowIO, assert_pool_consistent, assert_same_state, new_manager,
                      snapshot)

BACKEND_OPS = ["reserve", "free_reservation", "create_chunk", "release_chunk", "map",
               "set_access", "unmap", "export_fd", "import_fd", "copy", "seal"]
# Releasing device memory cannot be rolled back; a failure there may be absorbed
# (the operation then succeeds) instead of surfacing. Everything else must fail.
MAY_ABSORB = {"release_chunk", "free_reservation", "seal"}

ROW = 3000 * SCALE  # rows straddle pages (64 KiB on the host)
MAXT = 120      # 360000 B -> 6 pages per slot
A = [(7 * i) % 13 + 1 for i in range(200)]  # the recorded conversation
OWN = [20 + (i % 5) for i in range(200)]  # tokens the matched vTensor continues with


class Scenario:
    """A manager with live vTensors, shared pages and a prefix tree, before `op` runs.

    vt1: 80 tokens of A (4 pages); A[:50] recorded from it (pages 0-1 full, page 2 partial).
    vt2: matched A[:50] (pages 0-1 shared with vt1 and the tree, page 2 a private copy),
         then extended to 55 tokens with its own continuation.
    """

    def __init__(self, op):
        self.op = op
        cache_pages = {"create_reuse": 32, "release_cached": 32, "trim": 3}.get(op, 0)
        self.mgr = new_manager(chunks=64, faults=True, prealloc_chunks=0, slot_cache_bytes=cache_pages * CHUNK)
        self.sp = self.mgr.create_space(row_bytes=ROW, max_tokens=MAXT, max_slots=6)
        self.io = RowIO(self.sp)
        self.live = {}
        vt1 = self.sp.create(80).result()
        self.io.write(vt1, A, 0, 80)
        self.live[vt1] = A[:80]
        assert self.sp.prefix_record(vt1, A[:50]).result() == 50
        m = self.sp.prefix_match(A[:50] + [SENTINEL]).result()
        assert m.num_tokens == 50
        vt2 = m.vtensor
        t2 = A[:50] + OWN[:5]
        vt2.extend(55).result()
        self.io.write(vt2, t2, 50, 55)
        self.live[vt2] = t2
        self.vt1, self.vt2 = vt1, vt2
        if op == "create_reuse":
            vt3 = self.sp.create(40).result()  # 2 pages, kept mapped after release
            vt3.release().result()
            assert self.mgr.stats()["chunks_cached"] == 2
        if op == "trim":
            # Trim both unmaps cached pages (a call that can fail, and must
            # then change nothing) and releases free chunks (which cannot).
            vt3 = self.sp.create(60).result()  # 3 private pages: stay mapped in the cache
            vt4 = self.sp.create(40).result()  # 2 more: over the cache budget, so freed
            vt3.release().result()
            vt4.release().result()
            st = self.mgr.stats()
            assert st["chunks_cached"] == 3 and st["chunks_free"] >= 2, st
        assert_pool_consistent(self.mgr)

    def snap(self):
        return snapshot(self.mgr, [self.sp], self.live, {self.sp.name: self.io})

    def run(self):
        """Run the operation; returns a function that checks its success."""
        op, sp, io = self.op, self.sp, self.io
        if op in ("create", "create_reuse"):
            n = 70 if op == "create" else 90
            slots_before = sp.free_slots
            st0 = self.mgr.stats()
            reuses, cached = st0["slot_reuses_total"], st0["chunks_cached"]
            vt = sp.create(n).result()

            def ok():
                assert vt.num_tokens == n and sp.free_slots == slots_before - 1
                toks = [1] * n
                io.write(vt, toks, 0, n)
                io.verify(vt, toks)
                if op == "create_reuse" and cached:
                    assert self.mgr.stats()["slot_reuses_total"] == reuses + 1
                self.live[vt] = toks
            return ok
        if op == "extend":
            self.vt1.extend(MAXT).result()

            def ok():
                assert self.vt1.num_tokens == MAXT
                io.write(self.vt1, A, 80, MAXT)
                self.live[self.vt1] = A[:MAXT]
            return ok
        if op == "step":
            self.mgr.step({self.vt1: 110, self.vt2: 90}).result()

            def ok():
                assert self.vt1.num_tokens == 110 and self.vt2.num_tokens == 90
                io.write(self.vt1, A, 80, 110)
                t2 = A[:50] + OWN[:40]
                io.write(self.vt2, t2, 55, 90)
                self.live[self.vt1] = A[:110]
                self.live[self.vt2] = t2
            return ok
        if op == "extend_low":
            # Pages 0-1 are shared with vt2 and the tree (they lose a
            # reference), page 2 is private: it moves to page 4, the one
            # extend maps. Page 3 keeps rows 70-79.
            self.vt1.extend(100, low=70).result()

            def ok():
                assert (self.vt1.num_tokens, self.vt1.low) == (100, 70)
                assert self.vt1.page_chunks()[:3] == [None] * 3
                io.write(self.vt1, A, 80, 100)
                self.live[self.vt1] = A[:100]
            return ok
        if op == "step_low":
            # vt1 drops pages 0-2 as above and grows into pages 4-5 (one
            # recycled, one new); vt2 (matched) drops its shared page 0.
            self.mgr.step({self.vt1: (110, 70), self.vt2: (60, 30)}).result()

            def ok():
                assert (self.vt1.num_tokens, self.vt1.low, self.vt2.num_tokens, self.vt2.low) == (110, 70, 60, 30)
                assert self.vt2.page_chunks()[0] is None and self.vt2.page_chunks()[1] is not None
                io.write(self.vt1, A, 80, 110)
                t2 = A[:50] + OWN[:10]
                io.write(self.vt2, t2, 55, 60)
                self.live[self.vt1] = A[:110]
                self.live[self.vt2] = t2
            return ok
        if op == "prefix_record":
            added = sp.prefix_record(self.vt1, A[:60]).result()

            def ok():
                assert added == 10
                m = sp.prefix_match(A[:60] + [SENTINEL]).result()
                assert m.num_tokens == 60
                io.verify(m.vtensor, A, 0, 60)
                self.live[m.vtensor] = A[:60]
            return ok
        if op == "prefix_record_release":
            # The record's new node takes pages 2-3 (page 3 partial, as it
            # is: the vTensor goes with the record), then the release unmaps
            # every page of vt1 but the private page 3 is shared too now.
            added = sp.prefix_record(self.vt1, A[:70], release=True).result()

            def ok():
                assert added == 20 and self.vt1.released
                del self.live[self.vt1]
                m = sp.prefix_match(A[:70] + [SENTINEL]).result()
                assert m.num_tokens == 70
                io.verify(m.vtensor, A, 0, 70)
                self.live[m.vtensor] = A[:70]
            return ok
        if op == "prefix_match":
            # 40 rows = 120000 B: page 0 shared, page 1 partial -> copied
            copies = self.mgr.stats()["cow_copies_total"]
            m = sp.prefix_match(A[:40] + [SENTINEL]).result()

            def ok():
                assert m.num_tokens == 40
                io.verify(m.vtensor, A, 0, 40)
                assert self.mgr.stats()["cow_copies_total"] == copies + 1
                pages = m.vtensor.page_chunks()
                assert pages[0] == self.vt1.page_chunks()[0], "full page must be shared"
                assert pages[1] is not None and pages[1] != self.vt1.page_chunks()[1], \
                    "partial page must be a private copy"
                self.live[m.vtensor] = A[:40]
            return ok
        if op == "shrink":
            # vt1 keeps 45 rows (135000 B: pages 0-2) and gives back page 3;
            # vt2 keeps 30 (90000 B): page 1 holds its end and is shared with
            # vt1 and the tree, so it gets a private copy; page 2 goes.
            copies = self.mgr.stats()["cow_copies_total"]
            self.mgr.shrink({self.vt1: 45, self.vt2: 30}).result()

            def ok():
                assert (self.vt1.num_tokens, self.vt2.num_tokens) == (45, 30)
                p1, p2 = self.vt1.page_chunks(), self.vt2.page_chunks()
                assert p1[3] is None and p2[2:] == [None] * (len(p2) - 2)
                assert p2[0] == p1[0] and p2[1] not in (None, p1[1]), "the shared end page must be copied"
                assert self.mgr.stats()["cow_copies_total"] == copies + 1
                t1, t2 = A[:45] + OWN[:15], A[:30] + OWN[:10]
                self.mgr.step({self.vt1: 60, self.vt2: 40}).result()
                io.write(self.vt1, t1, 45, 60)
                io.write(self.vt2, t2, 30, 40)
                self.live[self.vt1], self.live[self.vt2] = t1, t2
                # the rows written past the new ends reached nobody else's pages
                m = self.sp.prefix_match(A[:50] + [SENTINEL]).result()
                assert m.num_tokens == 50
                io.verify(m.vtensor, A, 0, 50)
                self.live[m.vtensor] = A[:50]
            return ok
        if op in ("release", "release_cached"):
            cached = self.mgr.stats()["chunks_cached"]
            self.vt1.release().result()

            def ok():
                assert self.vt1.released
                if op == "release_cached":
                    # pages 0-1 are shared with the tree and are unmapped; page 2 (where the
                    # recorded prefix ends: the tree took a copy of it) and page 3 are private
                    # and stay mapped
                    assert self.mgr.stats()["chunks_cached"] == cached + 2
                del self.live[self.vt1]
                # the tree still serves A[:50] with the right bytes
                m = sp.prefix_match(A[:50] + [SENTINEL]).result()
                assert m.num_tokens == 50
                io.verify(m.vtensor, A, 0, 50)
                self.live[m.vtensor] = A[:50]
            return ok
        if op == "trim":
            st = self.mgr.stats()
            got = self.mgr.trim()

            def ok():
                assert got == (st["chunks_free"] + st["chunks_cached"]) * self.mgr.chunk_bytes
                after = self.mgr.stats()
                assert after["chunks_free"] == 0 and after["chunks_cached"] == 0
            return ok
        raise AssertionError(op)

    def check_ok(self, ok):
        ok()
        self.snap()  # verifies bytes of every live vTensor
        assert_pool_consistent(self.mgr)

    def close(self):
        self.mgr.faults.clear()
        self.mgr.close()


OPS = ["create", "create_reuse", "extend", "step", "extend_low", "step_low", "prefix_record",
       "prefix_record_release", "prefix_match", "shrink", "release", "release_cached", "trim"]


def calls(mgr):
    return {b: mgr.faults.calls(b) for b in BACKEND_OPS}


def discover(op):
    sc = Scenario(op)
    try:
        c0 = calls(sc.mgr)
        ok = sc.run()
        c1 = calls(sc.mgr)  # the operation's own calls, not the verifier's
        sc.check_ok(ok)
    finally:
        sc.close()
    return {b: c1[b] - c0[b] for b in BACKEND_OPS if c1[b] > c0[b]}


@pytest.mark.parametrize("op", OPS)
def test_fault_at_every_backend_call(op):
    used = discover(op)
    assert set(used) - MAY_ABSORB, f"{op} makes no backend call whose failure it must report: {used}"
    if op in ("create", "extend", "step"):
        assert used.get("map", 0) >= 2, f"{op} maps at least two pages: {used}"
    if op in ("extend_low", "step_low"):
        assert used.get("unmap", 0) >= 1 and used.get("map", 0) >= 1, f"{op} unmaps and maps: {used}"
    if op in ("prefix_match", "shrink"):
        assert used.get("copy", 0) >= 1, f"a partial last page must be copied: {used}"
    if op == "shrink":
        assert used.get("unmap", 0) >= 2, f"shrink unmaps what it gives back: {used}"
    checked = 0
    for bop, n_calls in sorted(used.items()):
        for k in range(1, n_calls + 1):
            sc = Scenario(op)
            try:
                before = sc.snap()
                sc.mgr.faults.fail_nth(bop, k)
                try:
                    ok = sc.run()
                except vtm.BackendError as e:
                    assert str(e), "BackendError must carry the backend's message"
                    sc.mgr.faults.clear()
                    assert_same_state(before, sc.snap())
                    assert_pool_consistent(sc.mgr)
                    # the same operation succeeds once the fault is gone
                    sc.check_ok(sc.run())
                    checked += 1
                    continue
                if bop not in MAY_ABSORB:
                    pytest.fail(f"{op}: call {k} of {bop} failed, yet the operation succeeded")
                sc.mgr.faults.clear()
                sc.check_ok(ok)
            finally:
                sc.close()
    assert checked > 0


@pytest.mark.parametrize("op", ["create", "create_reuse", "extend", "step", "step_low", "prefix_match", "shrink"])
def test_device_oom_on_create_chunk(op):
    sc = Scenario(op)
    try:
        before = sc.snap()
        reclaimable = before["pool"]["chunks_free"] + before["pool"]["chunks_cached"]
        sc.mgr.faults.fail_nth("create_chunk", 1, oom=True)
        try:
            ok = sc.run()
        except vtm.OutOfMemory:
            sc.mgr.faults.clear()
            assert_same_state(before, sc.snap())
            sc.check_ok(sc.run())
            return
        # succeeding is acceptable only if caches could be reclaimed to retry
        assert reclaimable > 0, f"{op}: device OOM on create_chunk was not reported"
        sc.mgr.faults.clear()
        sc.check_ok(ok)
    finally:
        sc.close()


@pytest.mark.parametrize("op", OPS)
def test_fault_after_success_is_harmless(op):
    """A failure armed for a call the operation never makes stays pending and
    does not disturb it; clear() cancels it."""
    sc = Scenario(op)
    try:
        sc.mgr.faults.fail_nth("create_chunk", 1000)
        sc.check_ok(sc.run())
        sc.mgr.faults.clear()
    finally:
        sc.close()


def test_calls_counts():
    mgr = new_manager(chunks=16, faults=True, prealloc_chunks=0)
    try:
        assert mgr.faults is not None
        c0 = mgr.faults.calls("create_chunk")
        sp = mgr.create_space(row_bytes=ROW, max_tokens=MAXT, max_slots=2)
        vt = sp.create(50).result()  # 150000 B -> 3 pages
        assert mgr.faults.calls("create_chunk") - c0 == 3
        assert mgr.faults.calls("map") >= 1
        vt.release().result()
        with pytest.raises(vtm.InvalidArgument):
            mgr.faults.fail_nth("no_such_op", 1)
    finally:
        mgr.close()
    plain = new_manager(chunks=4)
    try:
        assert plain.faults is None
    finally:
        plain.close()


def test_physical_limit_below_capacity():
    mgr = new_manager(chunks=32, faults=True, prealloc_chunks=0, slot_cache_bytes=0)
    CH = mgr.chunk_bytes
    try:
        sp = mgr.create_space(row_bytes=ROW, max_tokens=MAXT, max_slots=6)
        io = RowIO(sp)
        mgr.faults.set_physical_limit(4 * CH)
        live = {}
        a = sp.create(40).result()  # 2 pages
        b = sp.create(40).result()  # 2 pages
        for vt, c in ((a, 1), (b, 2)):
            live[vt] = [c] * 40
            io.write(vt, live[vt], 0, 40)
        before = snapshot(mgr, [sp], live, {sp.name: io})
        with pytest.raises(vtm.OutOfMemory):
            sp.create(10).result()
        assert_same_state(before, snapshot(mgr, [sp], live, {sp.name: io}))
        with pytest.raises(vtm.OutOfMemory):
            a.extend(60).result()
        assert_same_state(before, snapshot(mgr, [sp], live, {sp.name: io}))
        with pytest.raises(vtm.OutOfMemory):
            mgr.step({a: 40, b: 60}).result()
        assert_same_state(before, snapshot(mgr, [sp], live, {sp.name: io}))
        # releasing makes room again
        a.release().result()
        del live[a]
        c = sp.create(40).result()
        live[c] = [3] * 40
        io.write(c, live[c], 0, 40)
        st = assert_pool_consistent(mgr)
        assert st["chunks_created"] <= 4
        with pytest.raises(vtm.OutOfMemory):
            c.extend(80).result()
        # lifting the cap: the pool capacity is the only limit again
        mgr.faults.set_physical_limit(None)
        c.extend(80).result()
        live[c] = [3] * 80
        io.write(c, live[c], 40, 80)
        snapshot(mgr, [sp], live, {sp.name: io})
        assert_pool_consistent(mgr)
        for vt in live:
            vt.release().result()
        mgr.trim()
        assert mgr.stats()["chunks_created"] == 0
    finally:
        mgr.close()
