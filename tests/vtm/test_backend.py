"""The backend contract (src/vtm/csrc/backend.h): the conformance suite.

vtm enforces the contract itself (src/vtm/csrc/backend_checked.h) before any call
reaches a memory API, so every backend answers a forbidden call the same way:
the same error class and the same message (addresses aside), and the call
changes nothing. Each test runs on every backend (`raw` is parametrized over
host and cuda; cuda skips without a driver) with geometry taken from the
backend's own granularity. Byte checks through ctypes are host-only tests.
"""

import ctypes
import os
import re

import pytest

import vtm
from vtm_testing import cuda_available, host_only, new_manager

G = 64 * 1024  # host granularity used here


@pytest.fixture(params=["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def raw(request):
    if request.param == "cuda":
        if not cuda_available():
            pytest.skip("no CUDA driver")
        return vtm.RawBackend.open("cuda")
    return vtm.RawBackend.open("host", granularity=G)


def shape_of(message):
    """An error message with its backend-specific parts (addresses, sizes) abstracted."""
    return re.sub(r"\d+", "N", re.sub(r"0x[0-9a-f]+", "ADDR", message))


# What each forbidden call must answer, the same on every backend.
EXPECTED = {}


def rejects(raw, what, fn, pattern):
    """`fn` raises InvalidArgument whose message matches `pattern`; remembers its shape."""
    with pytest.raises(vtm.InvalidArgument) as info:
        fn()
    message = str(info.value)
    assert re.search(pattern, message), f"{what}: {message!r} does not match {pattern!r}"
    EXPECTED.setdefault(what, {})[raw.name] = shape_of(message)
    shapes = set(EXPECTED[what].values())
    assert len(shapes) == 1, f"{what}: backends answer differently: {EXPECTED[what]}"


class Layout:
    """A reservation of `pages` granules and `n` chunks of one granule, all freed at the end."""

    def __init__(self, raw, pages=4, n=2):
        self.raw, self.g = raw, raw.granularity
        self.bytes = pages * self.g
        self.va = raw.reserve(self.bytes)
        self.chunks = [raw.create_chunk(self.g) for _ in range(n)]
        self.mapped = []  # (va, bytes) runs still mapped

    def map(self, page, chunk):
        self.raw.map(self.va + page * self.g, self.g, self.chunks[chunk])
        self.mapped.append((self.va + page * self.g, self.g))

    def close(self):
        for va, size in self.mapped:
            try:
                self.raw.unmap(va, size)
            except vtm.InvalidArgument:
                pass  # already unmapped by the test
        for c in self.chunks:
            self.raw.release_chunk(c)
        self.raw.free_reservation(self.va, self.bytes)


@pytest.fixture
def lay(raw):
    layout = Layout(raw)
    yield layout
    layout.close()


def test_sizes_are_granularity_multiples(raw, lay):
    g = raw.granularity
    rejects(raw, "reserve size", lambda: raw.reserve(g + 1), r"^reserve: .* not a positive multiple of the granularity")
    rejects(raw, "reserve zero", lambda: raw.reserve(0), r"^reserve: 0 bytes")
    rejects(raw, "chunk size", lambda: raw.create_chunk(g // 2), r"^create_chunk: .* granularity")
    rejects(raw, "map size", lambda: raw.map(lay.va, g // 2, lay.chunks[0]), r"^map: .* granularity")
    rejects(raw, "map whole chunk", lambda: raw.map(lay.va, 2 * g, lay.chunks[0]), r"^map: .* \(only whole chunks")
    assert lay.va % g == 0


def test_ranges_lie_inside_one_reservation(raw, lay):
    g = raw.granularity
    c = lay.chunks[0]
    rejects(raw, "map unaligned", lambda: raw.map(lay.va + g // 2, g, c), r"^map: address .* not a non-null multiple")
    # Just past the end: on an H200 the driver crashed the process on this call.
    rejects(raw, "map past the end", lambda: raw.map(lay.va + 4 * g, g, c), r"^map: range .* not inside a reservation")
    rejects(raw, "map across the end", lambda: raw.map(lay.va + 3 * g, 2 * g, c), r"^map: .*")
    rejects(raw, "map below", lambda: raw.map(lay.va - g, g, c), r"^map: range .* not inside a reservation")
    rejects(raw, "map at null", lambda: raw.map(0, g, c), r"^map: address 0x0 ")
    rejects(raw, "set_access outside", lambda: raw.set_access(lay.va + 4 * g, g), r"^set_access: range .* not inside")
    rejects(raw, "unmap outside", lambda: raw.unmap(lay.va + 8 * g, g), r"^unmap: range .* not inside")
    # Nothing changed: the whole reservation still maps.
    lay.map(0, 0)
    lay.map(3, 1)
    raw.set_access(lay.va, g)
    raw.set_access(lay.va + 3 * g, g)


def test_no_double_map_and_whole_unmaps(raw, lay):
    g = raw.granularity
    va, (a, b) = lay.va, lay.chunks
    lay.map(0, 0)
    rejects(raw, "double map", lambda: raw.map(va, g, b), r"^map: range .* overlaps the mapping at")
    lay.map(1, 1)
    raw.set_access(va, 2 * g)  # one call over a run of adjacent mappings
    rejects(raw, "set_access past mappings", lambda: raw.set_access(va, 3 * g), r"^set_access: .* is not the start of a mapping")
    rejects(raw, "set_access of nothing", lambda: raw.set_access(va + 2 * g, g), r"^set_access: .* is not the start")
    rejects(raw, "unmap partly unmapped", lambda: raw.unmap(va + g, 2 * g), r"^unmap: .* is not the start of a mapping")
    rejects(raw, "free while mapped", lambda: raw.free_reservation(va, 4 * g), r"^free_reservation: .* still holds a mapping")
    raw.unmap(va, 2 * g)  # two whole mappings at once
    lay.mapped.clear()
    rejects(raw, "unmap of nothing", lambda: raw.unmap(va, g), r"^unmap: .* is not the start of a mapping")
    lay.map(0, 1)  # the range is reusable
    raw.set_access(va, g)


def test_costs_count_the_calls_that_reach_the_backend_and_their_time(raw, lay):
    """RawBackend.costs() (and Manager.backend_costs()): calls and seconds per
    operation, charged around the wrapped backend's call. A call the contract
    refuses never reaches the device, so it costs nothing; one the device
    fails still cost what it took."""
    g = raw.granularity
    before = raw.costs()
    assert before["map"] == {"calls": 0, "seconds": 0.0} and before["create_chunk"]["calls"] == 2
    lay.map(0, 0)
    raw.set_access(lay.va, g)
    with pytest.raises(vtm.InvalidArgument):
        raw.map(lay.va, g, lay.chunks[1])  # a double map: refused by the checks
    after = raw.costs()
    assert set(after) == set(before)
    assert after["map"]["calls"] == 1 and after["set_access"]["calls"] == 1
    assert after["map"]["seconds"] > 0 and after["set_access"]["seconds"] > 0
    assert after["unmap"] == before["unmap"] and after["reserve"]["calls"] == 1


def test_host_copies_move_bytes_only_within_live_host_allocations(raw, lay):
    """copy_to_host_many / copy_from_host_many (the host tier's copies) round
    trip a chunk's bytes through memory alloc_host gave. A host range outside
    every live allocation (a stray pointer, one freed, one running past its
    allocation's end) is refused before anything is copied."""
    g = raw.granularity
    a, b = raw.alloc_host(g), raw.alloc_host(g)
    try:
        pattern = bytes((i * 7 + 3) % 251 for i in range(g))
        ctypes.memmove(a, pattern, g)
        ctypes.memset(b, 0, g)
        raw.copy_from_host_many([lay.chunks[0]], [a], g)
        raw.copy_to_host_many([b], [lay.chunks[0]], g)
        assert ctypes.string_at(b, g) == pattern
        stray = ctypes.create_string_buffer(g)
        rejects(raw, "host copy to stray memory", lambda: raw.copy_to_host_many([ctypes.addressof(stray)],
                                                                                 [lay.chunks[0]], g),
                r"^copy_to_host_many: host memory .* is not inside one live allocation of alloc_host")
        assert stray.raw == bytes(g)
        rejects(raw, "host copy past its allocation", lambda: raw.copy_from_host_many([lay.chunks[1]],
                                                                                       [b + 4096], g),
                r"^copy_from_host_many: host memory .* is not inside one live allocation")
        raw.free_host(b, g)
        rejects(raw, "host copy from freed memory", lambda: raw.copy_from_host_many([lay.chunks[1]], [b], g),
                r"^copy_from_host_many: host memory .* is not inside one live allocation")
        raw.free_host(b, g)  # freed already: ignored, as a released chunk's second release is
        raw.free_host(ctypes.addressof(stray), g)  # never alloc_host's: ignored, not freed
        assert raw.costs()["free_host"]["calls"] == 1
    finally:
        raw.free_host(a, g)
        raw.free_host(b, g)


def test_started_copies_keep_their_chunks_and_host_memory_until_waited_for(raw, lay):
    """start_copy_from_host_many (a restore's copies, which run while its
    match maps the pages): until wait(), nothing copies into or out of their
    chunks (refused: the match's copy of its last page waits for the restore
    first), and a release of such a chunk, or a free of the host memory they
    read, waits for them before it goes ahead (under the fake driver, one that
    did not would unmap or free memory that queued copies use). After wait()
    the bytes are there; the wait is charged to wait_copies."""
    g = raw.granularity
    a, b = raw.alloc_host(g), raw.alloc_host(g)
    try:
        pattern = bytes((i * 11 + 5) % 253 for i in range(g))
        ctypes.memmove(a, pattern, g)
        started = raw.start_copy_from_host_many([lay.chunks[0]], [a], g)
        rejects(raw, "copy out of a chunk being copied into", lambda: raw.copy(lay.chunks[1], lay.chunks[0], g),
                r"^copy: chunk .* is being copied into by copies not yet waited for$")
        rejects(raw, "copy into a chunk being copied into", lambda: raw.copy(lay.chunks[0], lay.chunks[1], g),
                r"^copy: chunk .* is being copied into by copies not yet waited for$")
        rejects(raw, "host copy of a chunk being copied into",
                lambda: raw.copy_to_host_many([b], [lay.chunks[0]], g),
                r"^copy_to_host_many: chunk .* is being copied into by copies not yet waited for$")
        rejects(raw, "second start into a chunk being copied into",
                lambda: raw.start_copy_from_host_many([lay.chunks[0]], [b], g),
                r"^start_copy_from_host_many: chunk .* is being copied into by copies not yet waited for$")
        rejects(raw, "start into one chunk twice",
                lambda: raw.start_copy_from_host_many([lay.chunks[1], lay.chunks[1]], [a, b], g),
                r"^start_copy_from_host_many: chunk .* is copied into twice$")
        assert raw.costs()["wait_copies"]["calls"] == 0
        started.wait()
        assert raw.costs()["wait_copies"]["calls"] == 1
        raw.copy_to_host_many([b], [lay.chunks[0]], g)
        assert ctypes.string_at(b, g) == pattern

        chunk = raw.create_chunk(g)
        started = raw.start_copy_from_host_many([chunk], [a], g)
        raw.release_chunk(chunk)  # waits for the copy first
        assert raw.costs()["wait_copies"]["calls"] == 2
        started.wait()  # done already: returns at once
        chunk = raw.create_chunk(g)
        started = raw.start_copy_from_host_many([chunk], [a], g)
        raw.free_host(a, g)  # waits for the copy reading it first
        assert raw.costs()["wait_copies"]["calls"] == 3
        raw.release_chunk(chunk)
        started.wait()
        assert raw.costs()["wait_copies"]["calls"] == 3
    finally:
        raw.free_host(a, g)
        raw.free_host(b, g)


def test_unmap_covers_whole_mappings_only(raw):
    g = raw.granularity
    lay = Layout(raw, pages=4, n=1)
    big = raw.create_chunk(2 * g)
    try:
        raw.map(lay.va, 2 * g, big)
        rejects(raw, "unmap half a mapping", lambda: raw.unmap(lay.va, g), r"^unmap: range .* ends inside the mapping")
        rejects(raw, "unmap from inside", lambda: raw.unmap(lay.va + g, g), r"^unmap: .* is not the start")
        rejects(raw, "set_access half", lambda: raw.set_access(lay.va, g), r"^set_access: range .* ends inside")
        raw.set_access(lay.va, 2 * g)
        raw.unmap(lay.va, 2 * g)
    finally:
        raw.release_chunk(big)
        lay.close()


def test_reservations_are_freed_whole(raw):
    g = raw.granularity
    va = raw.reserve(4 * g)
    rejects(raw, "free part", lambda: raw.free_reservation(va, 2 * g), r"^free_reservation: no reservation is exactly")
    rejects(raw, "free inside", lambda: raw.free_reservation(va + g, g), r"^free_reservation: no reservation is exactly")
    rejects(raw, "free unknown", lambda: raw.free_reservation(va + 64 * g, g), r"^free_reservation: no reservation")
    raw.free_reservation(va, 4 * g)
    rejects(raw, "free twice", lambda: raw.free_reservation(va, 4 * g), r"^free_reservation: no reservation")


def test_unknown_chunks_are_rejected(raw, lay):
    g = raw.granularity
    gone = raw.create_chunk(g)
    raw.release_chunk(gone)
    unknown = max(lay.chunks) + (1 << 40)
    for name, handle in (("released", gone), ("never created", unknown)):
        if handle in lay.chunks:
            continue  # the driver reused the value
        rejects(raw, f"map {name} chunk", lambda: raw.map(lay.va, g, handle), r"^map: chunk .* is not a live chunk")
        rejects(raw, f"export {name} chunk", lambda: raw.export_fd(handle), r"^export_fd: chunk .* not a live chunk")
        rejects(raw, f"copy {name} chunk", lambda: raw.copy(lay.chunks[0], handle, 16), r"^copy: chunk .* not a live")
    raw.release_chunk(unknown)  # never throws, and does not reach the driver
    rejects(raw, "copy zero", lambda: raw.copy(lay.chunks[0], lay.chunks[1], 0), r"^copy: 0 bytes")
    rejects(raw, "copy too much", lambda: raw.copy(lay.chunks[0], lay.chunks[1], g + 1), r"^copy: .* exceed a chunk")
    rejects(raw, "import bad fd", lambda: raw.import_fd(-1, g), r"^import_fd: fd -1 is not")
    rejects(raw, "import size", lambda: raw.import_fd(0, g + 1), r"^import_fd: .* granularity")


def test_sealed_reservations_take_no_mappings(raw):
    g = raw.granularity
    va = raw.reserve(4 * g)
    c = raw.create_chunk(g)
    try:
        raw.map(va, g, c)
        rejects(raw, "seal while mapped", lambda: raw.seal(va, 4 * g), r"^seal: the reservation still holds a mapping")
        raw.unmap(va, g)
        rejects(raw, "seal part", lambda: raw.seal(va, 2 * g), r"^seal: no reservation is exactly")
        raw.seal(va, 4 * g)
        rejects(raw, "seal twice", lambda: raw.seal(va, 4 * g), r"^seal: the reservation .* is sealed already")
        rejects(raw, "map sealed", lambda: raw.map(va, g, c), r"^map: range .* is inside a sealed reservation")
        rejects(raw, "set_access sealed", lambda: raw.set_access(va, g), r"^set_access: range .* sealed")
        rejects(raw, "unmap sealed", lambda: raw.unmap(va, g), r"^unmap: range .* sealed")
    finally:
        raw.release_chunk(c)
        raw.free_reservation(va, 4 * g)  # a sealed reservation is freed like any other
    rejects(raw, "seal freed", lambda: raw.seal(va, 4 * g), r"^seal: no reservation is exactly")


@host_only
def test_host_sealed_reservation_reads_zeros_and_faults_on_write(tmp_path):
    raw = vtm.RawBackend.open("host", granularity=G)
    va = raw.reserve(2 * G)
    c = raw.create_chunk(G)
    try:
        raw.map(va, G, c)
        raw.set_access(va, G)
        ctypes.memset(va, 0x77, G)  # what the page held before
        raw.unmap(va, G)
        raw.seal(va, 2 * G)
        assert ctypes.string_at(va, G) == bytes(G), "a sealed range reads zeros"
        assert ctypes.string_at(va + 2 * G - 16, 16) == bytes(16)
    finally:
        raw.release_chunk(c)
        raw.free_reservation(va, 2 * G)
    # A write faults: in a child, which must die of SIGSEGV.
    code = (
        "import ctypes, vtm\n"
        f"raw = vtm.RawBackend.open('host', granularity={G})\n"
        f"va = raw.reserve({G}); raw.seal(va, {G})\n"
        "print('sealed', flush=True)\n"
        "ctypes.memset(va, 1, 1)\n"
        "print('wrote')\n"
    )
    import signal
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    # SIGSEGV; under `make test-sanitize`, AddressSanitizer reports it and aborts.
    assert out.returncode in (-signal.SIGSEGV, -signal.SIGABRT), out
    assert "sealed" in out.stdout and "wrote" not in out.stdout, out


def test_export_import_round_trip(raw, lay):
    g = raw.granularity
    fd = raw.export_fd(lay.chunks[0])
    try:
        imported = raw.import_fd(fd, g)
    finally:
        os.close(fd)
    try:
        raw.map(lay.va, g, imported)
        raw.set_access(lay.va, g)
        raw.unmap(lay.va, g)
    finally:
        raw.release_chunk(imported)


@host_only
def test_host_bytes_copy_export_import():
    raw = vtm.RawBackend.open("host", granularity=G)
    va = raw.reserve(3 * G)
    a, b = raw.create_chunk(G), raw.create_chunk(G)
    imported = None
    try:
        raw.map(va, G, a)
        raw.set_access(va, G)
        ctypes.memmove(va, b"vtm!" * (G // 4), G)
        raw.copy(b, a, 1000)  # only the first 1000 bytes
        raw.map(va + G, G, b)
        raw.set_access(va + G, G)
        assert ctypes.string_at(va + G, 1000) == (b"vtm!" * 250)
        assert ctypes.string_at(va + G + 1000, 4) == b"\0\0\0\0"

        fd = raw.export_fd(a)  # another process would receive this fd
        try:
            imported = raw.import_fd(fd, G)
        finally:
            os.close(fd)
        raw.map(va + 2 * G, G, imported)
        raw.set_access(va + 2 * G, G)
        assert ctypes.string_at(va + 2 * G, 8) == b"vtm!vtm!"
        ctypes.memmove(va + 2 * G, b"XY", 2)  # the same physical memory
        assert ctypes.string_at(va, 2) == b"XY"
        raw.unmap(va, 3 * G)
    finally:
        for c in (a, b, imported):
            if c is not None:
                raw.release_chunk(c)
        raw.free_reservation(va, 3 * G)


@host_only
def test_host_import_checks_the_fd_size():
    raw = vtm.RawBackend.open("host", granularity=G)
    c = raw.create_chunk(G)
    fd = raw.export_fd(c)
    try:
        with pytest.raises(vtm.InvalidArgument, match="holds"):
            raw.import_fd(fd, 2 * G)
    finally:
        os.close(fd)
        raw.release_chunk(c)


def test_host_granularity_must_be_page_multiple():
    with pytest.raises(vtm.InvalidArgument):
        vtm.RawBackend.open("host", granularity=1000)


def test_cuda_unavailable_without_driver():
    if cuda_available():
        pytest.skip("a driver is present")
    with pytest.raises(vtm.Unavailable, match="libcuda"):
        vtm.RawBackend.open("cuda")
    with pytest.raises(vtm.Unavailable):
        vtm.Manager(backend="cuda", capacity_bytes=2 << 20)
    assert vtm.Manager(backend="auto", capacity_bytes=2 << 20).backend == "host"


def test_a_failed_free_of_a_reservation_is_counted(backend):
    """A space's reservation is freed when its last owner drops it; a failure
    there cannot raise (it happens in a destructor) but must not vanish."""
    mgr = new_manager(backend, chunks=8, faults=True)
    try:
        sp = mgr.create_space(row_bytes=mgr.chunk_bytes // 4, max_tokens=8, max_slots=2)
        sp.create(8).result()
        assert mgr.stats()["reservation_free_failures_total"] == 0
        mgr.faults.fail_nth("free_reservation", 1)
        sp.close()
        assert mgr.stats()["reservation_free_failures_total"] == 1
        other = mgr.create_space(row_bytes=mgr.chunk_bytes // 4, max_tokens=8, max_slots=2)
        other.close()  # the next free works
        assert mgr.stats()["reservation_free_failures_total"] == 1
        mgr.check()
    finally:
        mgr.close()


@host_only
def test_host_set_access_populates_writable_page_tables():
    """Kernels must never take page faults on mapped KV: set_access populates
    the page tables on the worker, on the first mapping of a chunk and on every
    later one (where vtm uses the cheaper read-populate). Without population,
    writing the chunk's 512 pages takes 512 faults; the bound leaves room for
    faults on other memory (AddressSanitizer's shadow alone takes 64 here)."""
    import resource

    g = 2 << 20
    raw = vtm.RawBackend.open("host", granularity=g)
    va = raw.reserve(g)
    chunk = raw.create_chunk(g)
    mapped = False
    try:
        for _ in range(2):  # first mapping of the chunk, then a remapping
            raw.map(va, g, chunk)
            mapped = True
            raw.set_access(va, g)
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            for offset in range(0, g, 4096):
                ctypes.memset(va + offset, 0x5A, 1)
            faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
            assert faults < 128, f"{faults} page faults writing 512 populated pages"
            assert ctypes.string_at(va + g - 4096, 1) == b"\x5a"
            raw.unmap(va, g)
            mapped = False
    finally:
        if mapped:
            raw.unmap(va, g)
        raw.release_chunk(chunk)
        raw.free_reservation(va, g)
