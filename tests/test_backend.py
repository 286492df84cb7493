"""The backend contract (vtm/csrc/backend.h), checked on the raw backends.

The host backend is the reference: it must reject exactly what the CUDA
driver rejects, so a manager bug that would fail on a GPU fails on a laptop
first. Tests run on every backend present; byte checks use ctypes on the host.
"""

import ctypes
import os

import pytest

import vtm
from vtm_testing import cuda_available

G = 64 * 1024  # host granularity used here


@pytest.fixture(params=["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def raw(request):
    if request.param == "cuda":
        if not cuda_available():
            pytest.skip("no CUDA driver")
        return vtm.RawBackend.open("cuda")
    return vtm.RawBackend.open("host", granularity=G)


def test_granularity_and_alignment(raw):
    g = raw.granularity
    va = raw.reserve(4 * g)
    try:
        assert va % g == 0
        with pytest.raises(vtm.InvalidArgument):
            raw.reserve(g + 1)
        with pytest.raises(vtm.InvalidArgument):
            raw.create_chunk(g // 2)
        c = raw.create_chunk(g)
        try:
            with pytest.raises(vtm.InvalidArgument):
                raw.map(va + g // 2, g, c)  # offset not a multiple of the granularity
            with pytest.raises(vtm.InvalidArgument):
                raw.map(va + 4 * g, g, c)  # outside the reservation
        finally:
            raw.release_chunk(c)
    finally:
        raw.free_reservation(va, 4 * g)


def test_no_double_map_and_whole_unmaps(raw):
    g = raw.granularity
    va = raw.reserve(4 * g)
    a, b = raw.create_chunk(g), raw.create_chunk(g)
    try:
        raw.map(va, g, a)
        with pytest.raises(vtm.InvalidArgument):
            raw.map(va, g, b)  # already mapped
        raw.map(va + g, g, b)
        raw.set_access(va, 2 * g)  # one call over a run of adjacent mappings
        with pytest.raises(vtm.InvalidArgument):
            raw.set_access(va, 3 * g)  # the third page is not mapped
        with pytest.raises(vtm.InvalidArgument):
            raw.unmap(va + g, 2 * g)  # not whole earlier mappings
        with pytest.raises(vtm.InvalidArgument):
            raw.free_reservation(va, 4 * g)  # still mapped inside
        raw.unmap(va, 2 * g)  # two whole mappings at once
        with pytest.raises(vtm.InvalidArgument):
            raw.unmap(va, g)  # nothing mapped any more
        raw.map(va, g, b)  # the range is reusable
        raw.unmap(va, g)
    finally:
        raw.release_chunk(a)
        raw.release_chunk(b)
        raw.free_reservation(va, 4 * g)


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
