"""vtm's CUDA backend (src/vtm/csrc/backend_cuda.cc) on a CPU, against the
fake CUDA driver of tests/vtm/fake_cuda/ (what it models and enforces: the
header of fake_libcuda.c; building and controlling it: fake_cuda_testing.py).

vtm loads libcuda.so.1 once per process, so the ordinary run builds the fake
once a session and starts child pytests with it on LD_LIBRARY_PATH:
  * SUITE, the vtm tests that run on any backend, with `--vtm-backend cuda`:
    every byte they check went through backend_cuda.cc's maps, copies and
    host tier, every driver call was checked against the driver's rules (a
    test that broke one fails: tests/vtm/conftest.py), and what the run
    leaves alive is reported at its end;
  * this file, whose other tests run only there: backend_cuda.cc's own logic
    (the chunks' copy views, import reference counts, the host tier's copies,
    seal's zero chunk) seen through the fake's counters, fault injection and
    leak accounting, and the fake's own rules.
"""

import contextlib
import ctypes
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fake_cuda_testing
import vtm
import vtm_testing
from vtm_testing import SENTINEL, RowIO, assert_pool_consistent, assert_same_state, fill_pool, snapshot

VTM_TESTS = Path(__file__).resolve().parent
REPO = VTM_TESTS.parent.parent
G = 2 << 20  # the fake's granularity, and so the CUDA backend's chunk

# The vtm tests run on the fake's cuda backend. Their byte checks read device
# memory by address (RowIO); tests that view it as torch CUDA tensors are
# skipped there (marker torch_cuda), as are host_only ones.
SUITE = ["test_api.py", "test_backend.py", "test_host_tier.py", "test_faults.py", "test_prefix_forget.py",
         "test_window.py", "test_property.py"]
# Under `make test-sanitize` (the children inherit its preloaded runtime, and
# import its build of vtm) all but the property tests, which repeat the same
# paths many times over and would double that lane's time.
SANITIZER_SUITE = [f for f in SUITE if f != "test_property.py"]
# Left alive by nothing at the end of a run: a manager gives all of it back at
# close. (Reservations, streams and context references live as long as a
# backend, which a Python VTensor of a closed manager keeps; and a fault test
# leaks a reservation on purpose.)
FREED_AT_CLOSE = ("handles", "allocations", "mappings", "host_allocations", "memfds", "events", "queued")

under_fake = pytest.mark.skipif(not fake_cuda_testing.active(),
                                reason="runs under the fake CUDA driver, in the child test_fake_cuda.py starts")


# ---------------------------------------------------------------------------
# the ordinary run: build the fake and start the children


@pytest.fixture(scope="session")
def fake_lib(tmp_path_factory):
    """The folder of the fake libcuda.so.1, compiled once a session."""
    if fake_cuda_testing.active():
        pytest.skip("this process already runs under the fake driver")
    if vtm_testing.BACKEND != "host":
        pytest.skip("a --vtm-backend cuda run tests the real driver; the host run tests the fake")
    if not vtm.cuda_available():
        try:
            vtm.RawBackend.open("cuda")
        except vtm.Unavailable as e:
            if "without cuda.h" in str(e):
                pytest.skip("vtm was built without cuda.h: it has no CUDA backend to test")
    return fake_cuda_testing.build(tmp_path_factory.mktemp("fake_cuda"))


def run_child(lib_dir, tmp_path, files, timeout=600):
    """pytest --vtm-backend cuda over `files` against the fake; its output and end-of-run report."""
    report = tmp_path / "fake_cuda_report.json"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "--vtm-backend", "cuda",
           *[str(VTM_TESTS / f) if f.endswith(".py") else f for f in files]]
    done = subprocess.run(cmd, cwd=REPO, env=fake_cuda_testing.child_env(lib_dir, VTM_FAKE_CUDA_REPORT=report),
                          capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(cmd)} failed under the fake driver:\n{output[-12000:]}"
    return output, json.loads(report.read_text())


def test_the_vtm_suite_passes_on_the_cuda_backend_against_the_fake_driver(fake_lib, tmp_path):
    files = SANITIZER_SUITE if vtm_testing.UNDER_ASAN else SUITE
    output, report = run_child(fake_lib, tmp_path, files)
    assert " passed" in output and report["calls"]["cuMemMap"] > 0, output[-3000:]
    # The host tier's batched copies, both ways, ran through the driver.
    assert report["calls"]["cuMemcpyDtoHAsync"] > 0 and report["calls"]["cuMemcpyHtoDAsync"] > 0, report
    assert report["violations"] == 0, report
    left = {k: report["live"][k] for k in FREED_AT_CLOSE}
    assert left == dict.fromkeys(FREED_AT_CLOSE, 0), report


def test_the_cuda_backends_own_logic_against_the_fake_driver(fake_lib, tmp_path):
    output, report = run_child(fake_lib, tmp_path, [Path(__file__).name, "-k", "not against_the_fake_driver"])
    assert " skipped" not in output, output[-3000:]  # every test of this file ran there
    assert report["violations"] == 0, report


# ---------------------------------------------------------------------------
# under the fake: helpers


@pytest.fixture
def fake():
    """The fake driver; faults set by the test are cleared after it, and it
    must leave nothing more alive in the driver than it found."""
    driver = fake_cuda_testing.driver()
    gc.collect()
    driver.mark()
    yield driver
    driver.clear_faults()
    gc.collect()
    # Growth only: what an earlier failed test left may be freed during this one.
    assert {k: n for k, n in driver.grown().items() if n > 0} == {}, "left alive in the driver"


CALLS = ("cuMemMap", "cuMemUnmap", "cuMemSetAccess", "cuMemAddressReserve", "cuMemAddressFree", "cuMemCreate",
         "cuMemRelease", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuMemcpyDtoDAsync", "cuMemsetD8Async",
         "cuMemHostAlloc", "cuMemFreeHost", "cuMemImportFromShareableHandle")


def calls(fake):
    return {name: fake.calls(name) for name in CALLS}


def made(fake, before):
    """The calls made since `before` (a calls() reading), those not made left out."""
    now = calls(fake)
    return {name: now[name] - before[name] for name in CALLS if now[name] > before[name]}


class Managers:
    """cuda managers closed at teardown, or when the test asks (close_all), so
    that it can look at what closing them left in the driver."""

    def __init__(self):
        self._made = []

    def __call__(self, chunks, **kw):
        mgr = vtm.Manager(backend="cuda", capacity_bytes=chunks * G, chunk_bytes=G, **kw)
        self._made.append(mgr)
        return mgr

    def close_all(self):
        """Closes them and forgets them: with the test's own references gone,
        their backends go too."""
        for mgr in self._made:
            mgr.close()
        self._made.clear()
        gc.collect()


@pytest.fixture
def managers(fake):
    made = Managers()
    yield made
    made.close_all()


def tier_manager(managers, chunks=8, tier_chunks=16, **kw):
    """A cuda manager of `chunks` device chunks with a host tier, and one space
    whose rows straddle pages (the shape of test_host_tier.py)."""
    mgr = managers(chunks, host_tier_bytes=tier_chunks * G, **kw)
    sp = mgr.create_space(row_bytes=G // 20 + 7, max_tokens=200, max_slots=8)
    return mgr, sp, RowIO(sp)


def record(sp, io, tokens):
    vt = sp.create(len(tokens)).result()
    io.write(vt, tokens, 0, len(tokens))
    sp.prefix_record(vt, tokens).result()
    vt.release().result()


def match(sp, tokens):
    return sp.prefix_match(list(tokens) + [SENTINEL]).result()


def spilled(sp, io, tokens):
    """`tokens` recorded, then spilled to the host tier by a pool filled past it."""
    record(sp, io, tokens)
    fill_pool(sp)
    nodes = sp.prefix_nodes()
    assert nodes and all(n["on_host"] for n in nodes), nodes


A = [(7 * i + 3) % 101 for i in range(60)]  # 60 rows of G/20+7 bytes: 4 chunks


# ---------------------------------------------------------------------------
# under the fake: backend_cuda.cc


@under_fake
def test_vtm_runs_its_cuda_backend_on_the_fake(fake):
    assert vtm.cuda_available()
    assert fake.calls("cuInit") == 1  # one driver per process, loaded once
    raw = vtm.RawBackend.open("cuda")
    assert (raw.name, raw.granularity) == ("cuda", G)
    assert fake.grown("context_refs") == 1 and fake.grown("streams") == 1  # its copy stream
    del raw


def restore_and_spill(sp, io, tokens):
    """`tokens`, on the host, restored by a match whose bytes are checked, then spilled again."""
    m = match(sp, tokens)
    assert (m.num_tokens, m.restored_tokens) == (len(tokens), len(tokens))
    io.verify(m.vtensor, tokens)
    m.vtensor.release().result()
    fill_pool(sp)


@under_fake
def test_a_chunks_copies_map_it_once_and_its_copy_view_goes_with_it(fake, managers):
    """backend_cuda.cc: a chunk's copies go through its copy view, a mapping of
    its own made on its first copy (CopyView). Once every chunk of the pool has
    been copied, a spill and a restore reserve and map nothing for their copies
    (the restore's cuMemMap calls are the match's pages only), and a chunk
    released takes its view with it: nothing keeps its memory alive."""
    mgr, sp, io = tier_manager(managers)
    spilled(sp, io, A)
    for _ in range(3):  # every chunk of the pool of 8 copied by now
        restore_and_spill(sp, io, A)
    before = calls(fake)
    restore_and_spill(sp, io, A)
    copied = made(fake, before)
    assert copied["cuMemcpyHtoDAsync"] == 4 and copied["cuMemcpyDtoHAsync"] >= 4
    assert "cuMemAddressReserve" not in copied and "cuMemAddressFree" not in copied, copied
    views = mgr.stats()["chunks_held"]
    assert views > 0
    before = calls(fake)
    assert mgr.trim() > 0  # the free chunks go back to the device, and their views first
    released = made(fake, before)
    # Each chunk's view unmapped and its range freed (more unmaps: the pages released slots kept mapped).
    assert released["cuMemRelease"] == released["cuMemAddressFree"] <= released["cuMemUnmap"], released
    del sp, io, mgr
    managers.close_all()
    assert {k: fake.grown(k) for k in ("mappings", "allocations", "handles")} == \
        {"mappings": 0, "allocations": 0, "handles": 0}


@under_fake
@pytest.mark.parametrize("entry", ["cuMemAddressReserve", "cuMemMap", "cuMemSetAccess"])
def test_a_copy_view_that_cannot_be_made_fails_the_copy_and_leaves_nothing_behind(fake, managers, entry):
    """MakeCopyView: a driver call that fails while a chunk's first copy makes
    its view fails that copy (the spill evicts the prefix, as without a tier),
    and what the view had taken is given back: after close, no reservation or
    mapping is left. The next spill makes the views again and works."""
    fake.mark()
    mgr, sp, io = tier_manager(managers)
    record(sp, io, A)  # 4 chunks, never copied: trim's spill makes their views first
    fake.fail(entry, 1)
    assert mgr.trim(4 * G) > 0
    assert fake.injected(entry) == 1
    assert sp.prefix_nodes() == [] and mgr.stats()["spills_total"] == 0
    assert_pool_consistent(mgr)
    record(sp, io, A)
    assert mgr.trim(4 * G) > 0
    assert mgr.stats()["spills_total"] == 1 and all(n["on_host"] for n in sp.prefix_nodes())
    restore_and_spill(sp, io, A)
    assert_pool_consistent(mgr)
    del sp, io, mgr
    managers.close_all()
    assert {k: fake.grown(k) for k in ("reservations", "mappings", "allocations", "handles")} == \
        {"reservations": 0, "mappings": 0, "allocations": 0, "handles": 0}


@under_fake
def test_an_allocation_imported_twice_is_released_twice_and_freed_once(fake):
    """The driver may hand back the handle this process already holds for an
    allocation it imports again; it wants one cuMemRelease per import.
    backend_cuda.cc counts them (Remember): the handle is freed at the last
    release, exactly once, and a release past that never reaches the driver."""
    raw = vtm.RawBackend.open("cuda")
    created = raw.create_chunk(G)
    fd = raw.export_fd(created)
    raw.release_chunk(created)  # as if another process had made it: only the fd holds it now
    assert fake.grown("handles") == 0
    try:
        before = calls(fake)
        first = raw.import_fd(fd, G)
        second = raw.import_fd(fd, G)
        assert first == second, "the fake hands back the handle this process holds"
        assert fake.grown("handles") == 1 and made(fake, before) == {"cuMemImportFromShareableHandle": 2}
        # Importing it as another size is refused, and the import it took is given back.
        with pytest.raises(vtm.InvalidArgument, match="already held"):
            raw.import_fd(fd, 2 * G)
        assert fake.calls("cuMemRelease") - before["cuMemRelease"] == 1
        raw.release_chunk(first)
        assert fake.grown("handles") == 1, "the second import's reference keeps the handle"
        va = raw.reserve(G)
        raw.map(va, G, second)  # still a live chunk
        raw.set_access(va, G)
        raw.unmap(va, G)
        raw.free_reservation(va, G)
        raw.release_chunk(second)
        assert fake.grown("handles") == 0 and fake.grown("allocations") == 0
        raw.release_chunk(second)  # no longer ours: not sent to the driver
        assert fake.calls("cuMemRelease") - before["cuMemRelease"] == 3
    finally:
        os.close(fd)
    del raw


@under_fake
def test_imports_that_the_driver_names_apart_are_released_apart(fake):
    """The other behaviour the driver's reference allows: a new handle per import."""
    fake.set_option("import_same_handle", 0)
    try:
        raw = vtm.RawBackend.open("cuda")
        created = raw.create_chunk(G)
        fd = raw.export_fd(created)
        first, second = raw.import_fd(fd, G), raw.import_fd(fd, G)
        assert len({created, first, second}) == 3 and fake.grown("handles") == 3
        assert fake.grown("allocations") == 1, "three handles of one allocation"
        for chunk in (first, created, second):
            raw.release_chunk(chunk)
        assert fake.grown("handles") == fake.grown("allocations") == 0
        os.close(fd)
        del raw
    finally:
        fake.set_option("import_same_handle", 1)


@under_fake
def test_a_spill_and_a_restore_leave_nothing_alive_after_close(fake, managers):
    before = calls(fake)
    mgr, sp, io = tier_manager(managers)
    spilled(sp, io, A)
    m = match(sp, A)
    assert m.restored_tokens == len(A)
    io.verify(m.vtensor, A)
    m.vtensor.release().result()
    used = made(fake, before)
    assert used["cuMemHostAlloc"] >= 4 and used["cuMemcpyDtoHAsync"] == used["cuMemcpyHtoDAsync"] == 4, used
    assert fake.grown("host_allocations") > 0
    del m, sp, io, mgr
    managers.close_all()
    assert fake.grown() == {}  # also no context or stream left
    used = made(fake, before)
    assert used["cuMemFreeHost"] == used["cuMemHostAlloc"], used
    assert used["cuMemAddressFree"] == used["cuMemAddressReserve"], used
    assert used["cuMemRelease"] == used["cuMemCreate"], used


@under_fake
def test_a_restore_copies_each_chunk_back_byte_for_byte(fake, managers):
    """The host tier through backend_cuda.cc: a spill copies each chunk out
    (cuMemcpyDtoHAsync), a restore into new chunks (cuMemcpyHtoDAsync), whose
    first and last pages the fake poisons: a short or misplaced copy shows."""
    mgr, sp, io = tier_manager(managers)
    B = [(5 * i + 1) % 97 for i in range(60)]
    before = calls(fake)
    record(sp, io, A)
    record(sp, io, B)
    fill_pool(sp)
    spill = made(fake, before)
    assert spill["cuMemcpyDtoHAsync"] >= 8, spill
    for tokens in (B, A):
        before = calls(fake)
        m = match(sp, tokens)
        assert (m.num_tokens, m.restored_tokens) == (len(tokens), len(tokens))
        io.verify(m.vtensor, tokens)
        restore = made(fake, before)
        assert restore["cuMemcpyHtoDAsync"] == 4, restore  # one per chunk the match maps
        assert restore["cuMemMap"] >= 4 and restore.get("cuMemCreate", 0) <= 4, restore
        m.vtensor.release().result()
    assert_pool_consistent(mgr)


@under_fake
def test_a_restores_copies_are_still_queued_while_its_match_maps_its_pages(fake, managers):
    """Manager::DoMatch: a restore's copies are started (cuMemcpyHtoDAsync on
    the copy stream, an event after them), the match maps its pages into its
    slot while they are queued, and waits once, before it completes: every
    cuMemMap and cuMemSetAccess of the match finds the copies not yet run. They
    were made one after the other (a synchronize, then the mappings)."""
    mgr, sp, io = tier_manager(managers)
    spilled(sp, io, A)
    for _ in range(3):  # every chunk has its copy view: the restore's cuMemMap calls are the match's pages only
        restore_and_spill(sp, io, A)
    before = calls(fake)
    behind = {entry: fake.calls_behind(entry) for entry in ("cuMemMap", "cuMemSetAccess")}
    m = match(sp, A)
    assert (m.num_tokens, m.restored_tokens) == (len(A), len(A))
    assert fake.grown("queued") == 0, "the match completed before its copies ran"
    restore = made(fake, before)
    assert restore["cuMemcpyHtoDAsync"] == 4 and restore["cuMemMap"] == 4, restore  # 3 shared pages, 1 copied
    assert {entry: fake.calls_behind(entry) - n for entry, n in behind.items()} == \
        {"cuMemMap": 4, "cuMemSetAccess": restore["cuMemSetAccess"]}
    io.verify(m.vtensor, A)
    m.vtensor.release().result()
    assert_pool_consistent(mgr)


# The driver calls of a restore's copies: their start (an event, the copies,
# its record) and their wait (cuEventSynchronize). The first event of a
# match is its fence's, recorded when it is submitted.
RESTORE_CALLS = [("cuEventCreate", 2), ("cuMemcpyHtoDAsync", 1), ("cuMemcpyHtoDAsync", 2), ("cuMemcpyHtoDAsync", 4),
                 ("cuEventRecord", 2), ("cuEventSynchronize", 1)]


@under_fake
@pytest.mark.parametrize("entry, nth", RESTORE_CALLS)
def test_a_restore_whose_copies_fail_to_start_or_to_finish_changes_nothing(fake, managers, entry, nth):
    """A failure of any driver call of a restore's copies, at their start or
    at their wait, fails the match with the driver's error, once no copy is
    queued any more, and leaves the manager as it was: the prefix on the host,
    its chunks and the slot's mappings given back. The prefix is restorable
    afterwards, byte for byte."""
    mgr, sp, io = tier_manager(managers)
    keep = [(3 * i + 5) % 89 for i in range(20)]
    held = sp.create(len(keep)).result()
    io.write(held, keep, 0, len(keep))
    spilled(sp, io, A)
    live = {held: keep}
    before = snapshot(mgr, [sp], live, ios={sp.name: io})
    injected = fake.injected(entry)
    fake.fail(entry, nth)
    with pytest.raises(vtm.BackendError, match=entry):
        match(sp, A)
    assert fake.injected(entry) - injected == 1
    assert fake.grown("queued") == 0, "a copy was still queued when its failure was reported"
    assert_same_state(before, snapshot(mgr, [sp], live, ios={sp.name: io}))
    mgr.check()
    assert all(n["on_host"] for n in sp.prefix_nodes()) and mgr.stats()["restores_total"] == 0
    m = match(sp, A)
    assert m.restored_tokens == len(A)
    io.verify(m.vtensor, A)
    io.verify(held, keep)
    m.vtensor.release().result()
    held.release().result()
    assert_pool_consistent(mgr)


@under_fake
@pytest.mark.parametrize("wait_fails", [False, True], ids=["copies_done", "wait_fails"])
def test_a_match_that_fails_while_its_restores_copies_run_waits_for_them(fake, managers, wait_fails):
    """The match's mapping fails (cuMemMap) with the restore's copies queued:
    they are waited for before the failure is reported. Done, the restore
    stands (a step of its own, as when no slot is free); their wait failing
    too, nothing changes and the prefix stays on the host. Either way the
    prefix matches afterwards, byte for byte."""
    mgr, sp, io = tier_manager(managers)
    spilled(sp, io, A)
    for _ in range(3):  # copy views made: the first cuMemMap of the next restore is the match's
        restore_and_spill(sp, io, A)
    before = snapshot(mgr, [sp], {}, ios={sp.name: io})
    restores = mgr.stats()["restores_total"]
    fake.fail("cuMemMap", 1)
    if wait_fails:
        fake.fail("cuEventSynchronize", 1)
    with pytest.raises(vtm.BackendError, match="cuMemMap"):
        match(sp, A)
    assert fake.grown("queued") == 0, "a copy was still queued when the failure was reported"
    mgr.check()
    if wait_fails:
        assert_same_state(before, snapshot(mgr, [sp], {}, ios={sp.name: io}))
        assert all(n["on_host"] for n in sp.prefix_nodes()) and mgr.stats()["restores_total"] == restores
    else:
        assert not any(n["on_host"] for n in sp.prefix_nodes()) and mgr.stats()["restores_total"] == restores + 1
    fake.clear_faults()
    m = match(sp, A)
    assert m.num_tokens == len(A) and m.restored_tokens == (len(A) if wait_fails else 0)
    io.verify(m.vtensor, A)
    m.vtensor.release().result()
    assert_pool_consistent(mgr)


@under_fake
def test_a_failed_host_allocation_evicts_the_prefix_instead_of_spilling_it(fake, managers):
    """cuMemHostAlloc out of memory (alloc_host's OutOfMemory): the tier takes nothing."""
    mgr, sp, io = tier_manager(managers)
    record(sp, io, A)
    injected = fake.injected("cuMemHostAlloc")
    fake.fail("cuMemHostAlloc", 1, -1, "CUDA_ERROR_OUT_OF_MEMORY")
    fill_pool(sp)
    assert fake.injected("cuMemHostAlloc") > injected
    assert not any(n["on_host"] for n in sp.prefix_nodes()) and mgr.stats()["spills_total"] == 0
    fake.clear_faults()
    assert match(sp, A).num_tokens == 0
    assert_pool_consistent(mgr)


@under_fake
def test_a_closed_spaces_range_a_view_holds_reads_the_zero_chunk(fake, managers):
    """seal(): a closed space's range that a view still holds maps one zeroed
    granule, read-only, at every granule (the fake poisons new memory, so an
    unzeroed chunk shows), until the view lets the range go."""
    mgr = managers(8)
    sp = mgr.create_space(row_bytes=G // 4, max_tokens=12, max_slots=2)
    base, size = sp.base_address, 2 * sp.slot_bytes
    capsule = sp._dlpack(1, 8, [2, sp.slot_bytes], False)  # what a tensor view holds
    vt = sp.create(12).result()
    fake_cuda_testing.write_device(base + vt.slot * sp.slot_bytes, bytes(range(256)) * 16)
    before = calls(fake)
    sp.close()
    got = fake_cuda_testing.read_device(base, size)
    assert not got.any(), f"a sealed range reads zeros, not {sorted(set(got.tolist()))}"
    sealed = made(fake, before)
    assert sealed["cuMemsetD8Async"] == 1 and sealed["cuMemCreate"] == 1, sealed
    assert sealed["cuMemMap"] >= size // G, sealed
    before = calls(fake)
    del capsule
    gc.collect()
    assert made(fake, before) == {"cuMemUnmap": 1, "cuMemAddressFree": 1}


@under_fake
def test_a_copy_on_write_of_a_page_goes_through_the_driver(fake, managers):
    """A match ending inside a page copies it (Backend::copy: cuMemcpyDtoDAsync
    between the two chunks' copy views)."""
    mgr = managers(16)
    sp = mgr.create_space(row_bytes=G // 8, max_tokens=40, max_slots=4)
    io = RowIO(sp)
    tokens = list(range(40))
    record(sp, io, tokens)
    before = calls(fake)
    m = sp.prefix_match(tokens[:21] + [SENTINEL]).result()
    assert m.num_tokens == 21
    assert made(fake, before)["cuMemcpyDtoDAsync"] == 1
    io.verify(m.vtensor, tokens[:21])
    m.vtensor.release().result()


@under_fake
def test_a_copy_on_write_whose_wait_fails_still_finishes_before_its_chunk_can_go(fake, managers):
    """Backend::copy: when cuStreamSynchronize fails, the copy may still be
    queued, reading and writing the two chunks' copy views; it must finish
    before the failure is reported, or the chunk freed on that failure
    unmaps its view under the copy (a use after free on a GPU)."""
    mgr = managers(16)
    sp = mgr.create_space(row_bytes=G // 8, max_tokens=40, max_slots=4)
    io = RowIO(sp)
    tokens = list(range(40))
    record(sp, io, tokens)
    fake.fail("cuStreamSynchronize", 1)
    with pytest.raises(vtm.BackendError, match="cuStreamSynchronize"):
        sp.prefix_match(tokens[:21] + [SENTINEL]).result()
    assert fake.injected("cuStreamSynchronize") == 1
    assert fake.grown("queued") == 0, "the copy is still queued after its failure was reported"
    mgr.trim()  # the chunk the copy wrote goes back to the device, and its view with it
    mgr.check()
    m = sp.prefix_match(tokens[:21] + [SENTINEL]).result()
    assert m.num_tokens == 21
    io.verify(m.vtensor, tokens[:21])
    m.vtensor.release().result()


# Driver calls a spill and restore cycle makes (cycle() below), each failed
# in turn at its first calls. Not swept: the calls of destructors, whose
# failure vtm can only ignore (cuMemRelease, cuMemAddressFree, cuMemFreeHost,
# cuStreamDestroy, cuEventDestroy), and the context switches every method
# makes, which lose a chunk when a release makes them (documented).
SWEPT = ("cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemAddressReserve", "cuMemcpyDtoHAsync",
         "cuMemcpyHtoDAsync", "cuMemcpyDtoDAsync", "cuMemHostAlloc", "cuStreamSynchronize", "cuStreamWaitEvent",
         "cuEventCreate", "cuEventRecord", "cuEventSynchronize")
B = [(5 * i + 1) % 97 for i in range(60)]


def cycle(errors):
    """Records A and B, spills them, matches both and a part of A that ends
    inside a page (a copy-on-write): each operation may fail (its error is
    appended to `errors`). The manager and its space."""
    def attempt(operation):
        try:
            return operation()
        except vtm.Error as e:
            errors.append(f"{type(e).__name__}: {e}")
            return None

    mgr = vtm.Manager(backend="cuda", capacity_bytes=8 * G, chunk_bytes=G, host_tier_bytes=16 * G)
    sp = attempt(lambda: mgr.create_space(row_bytes=G // 20 + 7, max_tokens=200, max_slots=8))
    if sp is None:  # its reservation failed: the rest of the cycle runs without the fault
        fake_cuda_testing.driver().clear_faults()
        sp = mgr.create_space(row_bytes=G // 20 + 7, max_tokens=200, max_slots=8)
    io = RowIO(sp)
    for tokens in (A, B):
        vt = attempt(lambda: sp.create(len(tokens)).result())
        if vt is not None:
            io.write(vt, tokens, 0, len(tokens))
            attempt(lambda: sp.prefix_record(vt, tokens).result())
            attempt(lambda: vt.release().result())
    attempt(lambda: fill_pool(sp))
    for tokens in (A, B, A[:30] + [1]):
        m = attempt(lambda: match(sp, tokens))
        if m is not None and m.vtensor is not None:
            io.verify(m.vtensor, tokens, 0, m.num_tokens)
            attempt(lambda: m.vtensor.release().result())
    return mgr, sp, io


@under_fake
@pytest.mark.parametrize("entry", SWEPT)
def test_a_driver_failure_in_a_spill_and_restore_cycle_fails_at_most_its_operation(fake, entry):
    """Whichever of its first calls fails, an operation either succeeds or
    raises vtm's error; the manager stays consistent, every prefix it still
    holds matches byte for byte, no driver rule is broken, and closing gives
    everything back but what a mapping the driver would not unmap keeps
    (cuMemUnmap: a copy view's, dropped at its chunk's release)."""
    for nth in range(1, 7):
        ranges = {what: fake.ranges(what) for what in ("mappings", "reservations")}
        fake.mark()
        violations = fake.violations()
        fake.fail(entry, nth)
        errors = []
        mgr, sp, io = cycle(errors)
        fake.clear_faults()
        where = f"{entry} failing at its call {nth} (errors: {errors})"
        mgr.check()
        for tokens in (A, B):
            m = match(sp, tokens)
            if m.vtensor is not None:
                io.verify(m.vtensor, tokens, 0, m.num_tokens, what=where)
                m.vtensor.release().result()
        mgr.check()
        mgr.close()
        del mgr, sp, io, m  # a Match keeps its manager's backend
        gc.collect()
        assert fake.violations() == violations, f"{where}: {fake.last_violation()}"
        left = {k: n for k, n in fake.grown().items() if n > 0}
        if entry == "cuMemUnmap":
            abandoned = ("reservations", "mappings", "allocations", "memfds", "device_bytes")
            left = {k: n for k, n in left.items() if k not in abandoned}
            _free_abandoned_ranges(fake, ranges)
        assert left == {}, where


@under_fake
def test_a_fence_that_outlives_its_backend_never_destroys_an_event_of_a_later_context():
    """A Fence is a Python object (RawBackend.record_fence, a broker client's
    mapper) and may outlive its backend. The driver resets a primary context
    at its last release, destroying its events; a new retain gives a new
    context, whose event handles may reuse the old values. (Not the `fake`
    fixture: the context's reset is this test's subject, not a leak.)"""
    fake = fake_cuda_testing.driver()
    raw = vtm.RawBackend.open("cuda")
    fence = raw.record_fence()
    del raw
    gc.collect()  # the backend, and the context's last reference
    later = vtm.RawBackend.open("cuda")
    later_fence = later.record_fence()
    with fake.violations_expected() as seen:
        del fence
        gc.collect()
        later_fence.wait()
    del later_fence, later
    gc.collect()
    assert not seen, seen[0]


# ---------------------------------------------------------------------------
# under the fake: the fake's own rules, through its entry points


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", AllocFlags)]


class AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


PINNED = POSIX_FD = DEVICE = READ = 1
READWRITE = 3
SUCCESS, INVALID_VALUE, INVALID_CONTEXT, ILLEGAL_ADDRESS, NOT_PERMITTED = 0, 1, 201, 700, 800
NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING


class Driver:
    """The fake's entry points through ctypes, with the primary context
    current on this thread while it is open."""

    def __init__(self, lib):
        self.lib = lib
        u64, size = ctypes.c_ulonglong, ctypes.c_size_t
        lib.cuMemAddressReserve.argtypes = [ctypes.POINTER(u64), size, size, u64, u64]
        lib.cuMemAddressFree.argtypes = [u64, size]
        lib.cuMemCreate.argtypes = [ctypes.POINTER(u64), size, ctypes.POINTER(Prop), u64]
        lib.cuMemRelease.argtypes = [u64]
        lib.cuMemMap.argtypes = [u64, size, size, u64, u64]
        lib.cuMemUnmap.argtypes = [u64, size]
        lib.cuMemSetAccess.argtypes = [u64, size, ctypes.POINTER(AccessDesc), size]
        lib.cuMemExportToShareableHandle.argtypes = [ctypes.c_void_p, u64, ctypes.c_int, u64]
        lib.cuMemImportFromShareableHandle.argtypes = [ctypes.POINTER(u64), ctypes.c_void_p, ctypes.c_int]
        lib.cuMemcpyDtoHAsync_v2.argtypes = [ctypes.c_void_p, u64, size, ctypes.c_void_p]
        lib.cuMemcpyHtoDAsync_v2.argtypes = [u64, ctypes.c_void_p, size, ctypes.c_void_p]
        lib.cuMemcpyDtoDAsync_v2.argtypes = [u64, u64, size, ctypes.c_void_p]
        lib.cuMemsetD8Async.argtypes = [u64, ctypes.c_ubyte, size, ctypes.c_void_p]
        lib.cuMemFreeHost.argtypes = [ctypes.c_void_p]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        lib.cuStreamDestroy_v2.argtypes = [ctypes.c_void_p]
        lib.cuStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        lib.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cuEventSynchronize.argtypes = [ctypes.c_void_p]
        lib.cuEventDestroy_v2.argtypes = [ctypes.c_void_p]
        self.prop = Prop(PINNED, POSIX_FD, Location(DEVICE, 0))

    def __enter__(self):
        context = ctypes.c_void_p()
        assert self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), 0) == SUCCESS
        assert self.lib.cuCtxSetCurrent(context) == SUCCESS
        return self

    def __exit__(self, *exc):
        self.lib.cuCtxSetCurrent(None)
        self.lib.cuDevicePrimaryCtxRelease_v2(0)

    def reserve(self, size):
        va = ctypes.c_ulonglong()
        assert self.lib.cuMemAddressReserve(ctypes.byref(va), size, 0, 0, 0) == SUCCESS
        return va.value

    def create(self, size=G):
        handle = ctypes.c_ulonglong()
        result = self.lib.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(self.prop), 0)
        return result, handle.value

    def set_access(self, va, size, flags=READWRITE):
        desc = AccessDesc(Location(DEVICE, 0), flags)
        return self.lib.cuMemSetAccess(va, size, ctypes.byref(desc), 1)

    def read(self, va, size):
        """Copies device memory out on the legacy stream and waits for it: (the copy's result, the bytes)."""
        out = ctypes.create_string_buffer(size)
        result = self.lib.cuMemcpyDtoHAsync_v2(out, va, size, None)
        assert self.lib.cuStreamSynchronize(None) == SUCCESS
        return result, out.raw

    def stream(self, flags=NON_BLOCKING):
        stream = ctypes.c_void_p()
        assert self.lib.cuStreamCreate(ctypes.byref(stream), flags) == SUCCESS
        return stream

    def event(self):
        event = ctypes.c_void_p()
        assert self.lib.cuEventCreate(ctypes.byref(event), 0) == SUCCESS
        return event

    def host(self, size):
        p = ctypes.c_void_p()
        assert self.lib.cuMemHostAlloc(ctypes.byref(p), size, 0) == SUCCESS
        return p

    @contextlib.contextmanager
    def mapped(self, chunks):
        """`chunks` allocations of G mapped read-write one after the other: the base address."""
        va = self.reserve(chunks * G)
        handles = [self.create()[1] for _ in range(chunks)]
        for i, handle in enumerate(handles):
            assert self.lib.cuMemMap(va + i * G, G, 0, handle, 0) == SUCCESS
        assert self.set_access(va, chunks * G) == SUCCESS
        try:
            yield va
        finally:
            assert self.lib.cuMemUnmap(va, chunks * G) == SUCCESS
            assert self.lib.cuMemAddressFree(va, chunks * G) == SUCCESS
            for handle in handles:
                assert self.lib.cuMemRelease(handle) == SUCCESS


def _free_abandoned_ranges(fake, before):
    """Unmaps what abandoned ranges (copy views) still map and frees the ranges,
    through the driver: only the test that made them leaves them behind.
    `before`: fake.ranges() of both kinds when the test began; every other
    range is abandoned (with no manager or backend alive)."""
    with Driver(fake.lib) as driver:
        for va, size in set(fake.ranges("mappings")) - set(before["mappings"]):
            assert driver.lib.cuMemUnmap(va, size) == SUCCESS
        for va, size in set(fake.ranges("reservations")) - set(before["reservations"]):
            assert driver.lib.cuMemAddressFree(va, size) == SUCCESS


@under_fake
def test_the_fake_refuses_what_the_driver_refuses(fake):
    """The rules vtm is held to, each broken once: the call fails with the
    driver's code, does nothing, and is counted as a violation."""
    with Driver(fake.lib) as d:
        lib = d.lib
        va = d.reserve(4 * G)
        result, handle = d.create()
        assert result == SUCCESS
        with fake.violations_expected() as seen:
            assert d.create(G + 4096)[0] == INVALID_VALUE
        assert "multiple" in seen[0]
        with fake.violations_expected() as seen:
            assert lib.cuMemMap(va + 4096, G, 0, handle, 0) == INVALID_VALUE  # not aligned
            assert lib.cuMemMap(va + 4 * G, G, 0, handle, 0) == INVALID_VALUE  # past the reservation
            assert lib.cuMemMap(va + 3 * G, 2 * G, 0, handle, 0) == INVALID_VALUE  # not the allocation's size
        assert "the allocation is" in seen[0]
        assert lib.cuMemMap(va, G, 0, handle, 0) == SUCCESS
        assert lib.cuMemMap(va + G, G, 0, handle, 0) == SUCCESS  # a handle maps anywhere, many times
        with fake.violations_expected() as seen:
            assert lib.cuMemMap(va, G, 0, handle, 0) == INVALID_VALUE  # over a mapping
            # Mapped without access, as the driver maps: a copy from it is an illegal address.
            assert d.read(va, 64)[0] == ILLEGAL_ADDRESS
            assert d.set_access(va, 3 * G) == INVALID_VALUE  # over a hole
            assert lib.cuMemUnmap(va, G // 2) == INVALID_VALUE  # part of a mapping
            assert lib.cuMemAddressFree(va, 2 * G) == INVALID_VALUE  # not a whole reservation
            assert lib.cuMemAddressFree(va, 4 * G) == INVALID_VALUE  # still maps
        assert "still maps" in seen[0]
        assert d.set_access(va, 2 * G, READ) == SUCCESS
        with fake.violations_expected() as seen:
            assert lib.cuMemsetD8Async(va, 7, 64, None) == ILLEGAL_ADDRESS  # read-only
        assert "read-write" in seen[0]
        assert d.set_access(va, 2 * G) == SUCCESS
        assert lib.cuMemsetD8Async(va, 7, 64, None) == SUCCESS
        result, data = d.read(va + G, 64)  # the same memory, at its second mapping
        assert result == SUCCESS and data == b"\x07" * 64
        # Released while mapped: the handle is gone, its memory lives on.
        assert lib.cuMemRelease(handle) == SUCCESS
        assert (fake.grown("handles"), fake.grown("allocations")) == (0, 1)
        assert d.read(va, 64) == (SUCCESS, b"\x07" * 64)
        with fake.violations_expected():
            assert lib.cuMemRelease(handle) == INVALID_VALUE
            assert lib.cuMemMap(va + 2 * G, G, 0, handle, 0) == INVALID_VALUE
        assert lib.cuMemUnmap(va, 2 * G) == SUCCESS  # two whole mappings at once
        assert fake.grown("allocations") == 0
        with fake.violations_expected():
            assert d.read(va, 64)[0] == ILLEGAL_ADDRESS
        assert lib.cuMemAddressFree(va, 4 * G) == SUCCESS
    # With no context current, even a valid call is refused.
    with fake.violations_expected() as seen:
        assert d.create()[0] == INVALID_CONTEXT
    assert "no current context" in seen[0]


@under_fake
def test_the_fake_shares_allocations_by_fd_and_refuses_other_fds(fake):
    with Driver(fake.lib) as d:
        lib = d.lib
        _, handle = d.create()
        fd = ctypes.c_int(-1)
        assert lib.cuMemExportToShareableHandle(ctypes.byref(fd), handle, POSIX_FD, 0) == SUCCESS
        assert fake.grown("memfds") == 2  # the driver's and the caller's
        same = ctypes.c_ulonglong()
        assert lib.cuMemImportFromShareableHandle(ctypes.byref(same), fd.value, POSIX_FD) == SUCCESS
        assert same.value == handle
        for _ in range(2):
            assert lib.cuMemRelease(handle) == SUCCESS
        # Only the caller's fd holds the memory now; an import makes a new handle of it.
        assert fake.grown("allocations") == 0
        again = ctypes.c_ulonglong()
        assert lib.cuMemImportFromShareableHandle(ctypes.byref(again), fd.value, POSIX_FD) == SUCCESS
        assert again.value not in (0, handle) and fake.grown("allocations") == 1
        assert lib.cuMemRelease(again.value) == SUCCESS
        os.close(fd.value)
        other = os.memfd_create("not_the_driver")
        os.ftruncate(other, G)
        with fake.violations_expected() as seen:
            assert lib.cuMemImportFromShareableHandle(ctypes.byref(again), other, POSIX_FD) == INVALID_VALUE
        os.close(other)
        assert "not an exported allocation" in seen[0]


@under_fake
def test_the_fakes_injected_faults_count_calls_from_now(fake):
    violations = fake.violations()
    with Driver(fake.lib) as d:
        va = d.reserve(G)
        before, injected = fake.calls("cuMemCreate"), fake.injected("cuMemCreate")
        fake.fail("cuMemCreate", 2, 2, "CUDA_ERROR_OUT_OF_MEMORY")
        results = [d.create() for _ in range(4)]
        assert [r for r, _ in results] == [SUCCESS, 2, 2, SUCCESS]
        assert (fake.calls("cuMemCreate") - before, fake.injected("cuMemCreate") - injected) == (4, 2)
        for result, handle in results:
            if result == SUCCESS:
                assert d.lib.cuMemRelease(handle) == SUCCESS
        assert d.lib.cuMemAddressFree(va, G) == SUCCESS
    assert fake.violations() == violations, "an injected failure is not a broken rule"


# ---------------------------------------------------------------------------
# under the fake: the fake's queues (streams run their work only when forced)


@under_fake
def test_a_copy_is_not_seen_before_its_stream_is_synchronized(fake):
    """Queued work runs when a synchronization forces it, and reads its
    source then: a host buffer reused before that is what the copy takes."""
    with Driver(fake.lib) as d, d.mapped(1) as va:
        lib, s = d.lib, d.stream()
        fake_cuda_testing.write_device(va, b"\x01" * 64)
        src = ctypes.create_string_buffer(b"\x05" * 64, 64)
        assert lib.cuMemcpyHtoDAsync_v2(va, src, 64, s) == SUCCESS
        out = ctypes.create_string_buffer(64)
        assert lib.cuMemcpyDtoHAsync_v2(out, va, 64, s) == SUCCESS
        assert fake.grown("queued") == 2
        assert bytes(fake_cuda_testing.read_device(va, 64)) == b"\x01" * 64 and out.raw == bytes(64)
        ctypes.memset(src, 9, 64)  # reused while the copy from it is queued
        assert lib.cuStreamSynchronize(s) == SUCCESS
        assert fake.grown("queued") == 0
        assert bytes(fake_cuda_testing.read_device(va, 64)) == b"\x09" * 64 and out.raw == b"\x09" * 64
        assert lib.cuStreamDestroy_v2(s) == SUCCESS


@under_fake
def test_an_event_orders_one_streams_work_after_anothers(fake):
    """cuStreamWaitEvent: the waiting stream's later work runs after the
    work the event captured, which synchronizing the waiting stream forces;
    a stream that waits for nothing is ordered after nothing."""
    with Driver(fake.lib) as d, d.mapped(2) as va:
        lib = d.lib
        writer, reader, other = d.stream(), d.stream(), d.stream()
        written = d.event()
        fake_cuda_testing.write_device(va, b"\x01" * 64)
        assert lib.cuMemsetD8Async(va, 7, 64, writer) == SUCCESS
        assert lib.cuEventRecord(written, writer) == SUCCESS
        assert lib.cuMemsetD8Async(va, 8, 64, writer) == SUCCESS  # after the record: not waited for
        assert lib.cuMemcpyDtoDAsync_v2(va + G + 64, va, 64, other) == SUCCESS
        assert lib.cuStreamSynchronize(other) == SUCCESS
        assert bytes(fake_cuda_testing.read_device(va + G + 64, 64)) == b"\x01" * 64, "not ordered"
        assert lib.cuStreamWaitEvent(reader, written, 0) == SUCCESS
        assert lib.cuMemcpyDtoDAsync_v2(va + G, va, 64, reader) == SUCCESS
        assert lib.cuEventDestroy_v2(written) == SUCCESS  # the wait keeps what the event captured
        assert lib.cuStreamSynchronize(reader) == SUCCESS
        assert bytes(fake_cuda_testing.read_device(va + G, 64)) == b"\x07" * 64
        assert fake.grown("queued") == 1  # the writer's second memset
        assert lib.cuStreamSynchronize(writer) == SUCCESS
        assert bytes(fake_cuda_testing.read_device(va, 64)) == b"\x08" * 64
        for s in (writer, reader, other):
            assert lib.cuStreamDestroy_v2(s) == SUCCESS


@under_fake
def test_the_legacy_stream_waits_for_blocking_streams_only(fake):
    """The driver's legacy default stream (NULL) first waits for every
    blocking stream; a CU_STREAM_NON_BLOCKING stream does not take part."""
    with Driver(fake.lib) as d, d.mapped(1) as va:
        lib = d.lib
        blocking, non_blocking = d.stream(0), d.stream(NON_BLOCKING)
        fake_cuda_testing.write_device(va, b"\x01" * 128)
        assert lib.cuMemsetD8Async(va, 3, 64, blocking) == SUCCESS
        assert lib.cuMemsetD8Async(va + 64, 4, 64, non_blocking) == SUCCESS
        result, data = d.read(va, 128)  # on the legacy stream
        assert result == SUCCESS and data == b"\x03" * 64 + b"\x01" * 64
        assert lib.cuStreamSynchronize(non_blocking) == SUCCESS
        for s in (blocking, non_blocking):
            assert lib.cuStreamDestroy_v2(s) == SUCCESS


@under_fake
def test_the_fake_refuses_to_release_memory_that_queued_work_uses(fake):
    """Unmapping device memory, lowering its access, or freeing page-locked
    host memory under a copy that has not run is a use after free on a GPU:
    refused, and counted, until the stream is synchronized."""
    with Driver(fake.lib) as d, d.mapped(1) as va:
        lib, s = d.lib, d.stream()
        host = d.host(4096)
        assert lib.cuMemcpyDtoHAsync_v2(host, va, 64, s) == SUCCESS
        with fake.violations_expected() as seen:
            assert lib.cuMemFreeHost(host) == NOT_PERMITTED
            assert lib.cuMemUnmap(va, G) == NOT_PERMITTED
            assert d.set_access(va, G, 0) == NOT_PERMITTED
        assert "used by a cuMemcpyDtoHAsync queued on stream" in seen[0]
        assert d.set_access(va, G, READ) == SUCCESS  # the copy only reads it
        assert lib.cuStreamSynchronize(s) == SUCCESS
        assert lib.cuMemFreeHost(host) == SUCCESS
        assert d.set_access(va, G) == SUCCESS
        assert lib.cuStreamDestroy_v2(s) == SUCCESS


@under_fake
def test_a_destroyed_streams_work_still_runs_when_forced(fake):
    """cuStreamDestroy returns at once; the stream's work is still to run,
    and holds its memory, until an event recorded on it forces it."""
    with Driver(fake.lib) as d, d.mapped(1) as va:
        lib, s, done = d.lib, d.stream(), d.event()
        fake_cuda_testing.write_device(va, b"\x01" * 64)
        assert lib.cuMemsetD8Async(va, 6, 64, s) == SUCCESS
        assert lib.cuEventRecord(done, s) == SUCCESS
        assert lib.cuStreamDestroy_v2(s) == SUCCESS
        assert fake.grown("streams") == 0 and fake.grown("queued") == 1
        with fake.violations_expected() as seen:
            assert lib.cuMemUnmap(va, G) == NOT_PERMITTED
            assert lib.cuStreamSynchronize(s) == 400  # CUDA_ERROR_INVALID_HANDLE: the handle is gone
        assert "is not a live stream" in seen[0]
        assert bytes(fake_cuda_testing.read_device(va, 64)) == b"\x01" * 64
        assert lib.cuEventSynchronize(done) == SUCCESS
        assert bytes(fake_cuda_testing.read_device(va, 64)) == b"\x06" * 64 and fake.grown("queued") == 0
        assert lib.cuEventDestroy_v2(done) == SUCCESS


@under_fake
def test_the_fakes_eager_option_runs_work_as_it_is_queued(fake):
    fake.set_option("eager", 1)
    try:
        with Driver(fake.lib) as d, d.mapped(1) as va:
            s = d.stream()
            assert d.lib.cuMemsetD8Async(va, 2, 64, s) == SUCCESS
            assert bytes(fake_cuda_testing.read_device(va, 64)) == b"\x02" * 64 and fake.grown("queued") == 0
            assert d.lib.cuStreamDestroy_v2(s) == SUCCESS
    finally:
        fake.set_option("eager", 0)
