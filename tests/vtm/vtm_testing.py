"""Helpers for the vtm tests (tests/vtm/conftest.py holds their fixtures and
hooks); tests/flexinfer imports some of them too.

The tests are written from docs/api.md and docs/design.md §3 and §4, not from
the implementation. Byte checks write a deterministic pattern into every row a
vTensor gains: the bytes of row ``t`` depend only on the token prefix
``tokens[:t+1]`` (and the row size), so two vTensors holding the same prefix
hold identical rows, which is exactly what prefix sharing must preserve.

One switch picks the backend every vtm test runs against: ``pytest
--vtm-backend cuda`` (default ``host``). Geometry follows the backend: CHUNK is
64 KiB on the host and the driver's granularity (2 MiB) on CUDA, and SCALE =
CHUNK // 64 KiB multiplies the row sizes the tests were written with, so every
test keeps its page structure (rows straddling pages, pages per slot). Byte
checks go through torch views on the backend's device. Without a driver,
``--vtm-backend cuda`` skips every vtm test (tests/flexinfer is not affected).
Under the fake driver (fake_cuda_testing.py), where device pointers are host
addresses and torch has no CUDA, they read and write the rows by address.

Safety rule for every helper here: only rows ``< vt.num_tokens`` of a live
vTensor are ever touched through a view, and before touching them we check
``vt.page_chunks()`` says the pages are mapped (an unmapped page faults the
whole test process on purpose).
"""

import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import time

import numpy as np
import pytest

import fake_cuda_testing
import vtm

KiB = 1024
MiB = 1024 * KiB
HOST_CHUNK = 64 * KiB
CUDA_CHUNK = 2 * MiB
SENTINEL = 10**6  # a token id never used in recorded sequences
# `make test-sanitize`: its runtime is preloaded into this process and its
# children. There freed memory waits in a quarantine before reuse (RSS
# grows by design), and every path costs a few times more: tests that repeat
# a path many times to find a rare state repeat it fewer times there, since
# that lane looks for memory errors on each path, not for the rare state.
UNDER_ASAN = "libasan" in os.environ.get("LD_PRELOAD", "")

# The backend under test and its geometry; tests/vtm/conftest.py sets them
# (use_backend) before any vtm test module is imported (they read them at import).
BACKEND = "host"
CHUNK = HOST_CHUNK
SCALE = 1


def use_backend(backend, chunk_bytes=None):
    """The backend under test (--vtm-backend) and its chunk size (--vtm-chunk-bytes)."""
    global BACKEND, CHUNK, SCALE
    BACKEND = backend
    CHUNK = HOST_CHUNK
    if BACKEND == "cuda":
        CHUNK = CUDA_CHUNK
        if cuda_available():
            CHUNK = max(CUDA_CHUNK, vtm.RawBackend.open("cuda").granularity)
    CHUNK = chunk_bytes or CHUNK
    if CHUNK <= 0 or CHUNK % HOST_CHUNK != 0:
        raise pytest.UsageError(f"--vtm-chunk-bytes {CHUNK} is not a positive multiple of {HOST_CHUNK}")
    SCALE = CHUNK // HOST_CHUNK


# For tests of host memory itself (numpy views, ctypes, page-fault counts):
# skipped with this reason under another backend.
host_only = pytest.mark.host_only


def cuda_available():
    fn = getattr(vtm, "cuda_available", None)
    if fn is None:
        return False
    try:
        return bool(fn())
    except Exception:
        return False


# --------------------------------------------------------------------------
# managers


def chunk_for(backend):
    return CHUNK if backend == BACKEND else (CUDA_CHUNK if backend == "cuda" else HOST_CHUNK)


def new_manager(backend=None, chunks=64, **kw):
    """A small manager on the backend under test: capacity `chunks` chunks of CHUNK bytes."""
    backend = backend or BACKEND
    chunk = kw.pop("chunk_bytes", chunk_for(backend))
    if backend == "host":
        kw.setdefault("granularity", min(HOST_CHUNK, chunk))
    return vtm.Manager(backend=backend, capacity_bytes=chunks * chunk,
                       chunk_bytes=chunk, **kw)


# --------------------------------------------------------------------------
# byte patterns


@functools.lru_cache(maxsize=1 << 15)
def row_pattern(prefix, row_bytes):
    """Bytes of the row at position len(prefix)-1 whose token prefix is `prefix`."""
    prefix = tuple(int(t) for t in prefix)
    digest = hashlib.blake2b(repr((prefix, len(prefix) - 1, row_bytes)).encode(),
                             digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    arr = np.frombuffer(rng.bytes(row_bytes), dtype=np.uint8)
    return arr  # frombuffer of bytes is read-only: a cached pattern cannot be mutated


def rows_pattern(tokens, start, end, row_bytes):
    """Concatenated patterns of rows [start, end) of a vTensor holding `tokens`."""
    tokens = tuple(tokens)
    if end <= start:
        return np.zeros(0, dtype=np.uint8)
    return np.concatenate([row_pattern(tokens[:t + 1], row_bytes) for t in range(start, end)])


def random_tokens(rng, n, vocab):
    return [int(x) for x in rng.integers(0, vocab, n)] if n else []


class RowIO:
    """Reads and writes token rows of one space through a zero-copy view.

    host: a numpy uint8 view; cuda: a torch.uint8 CUDA view (copies go through the CPU),
    or under the fake driver the space's memory by address. The backend is the space's own unless named."""

    def __init__(self, space, backend=None):
        self.space = space
        if backend is None:
            backend = "cuda" if space._device[0] == 2 else "host"
        self.backend = backend
        self.rb = space.row_bytes
        self.slot_bytes = space.slot_bytes
        self.page = space.slot_bytes // space.pages_per_slot
        self.base = None  # the space's address, when rows are read by address (the fake driver)
        self.torch = None
        if backend == "host":
            self.view = space.tensor(np.uint8)
        elif fake_cuda_testing.active():
            self.view = None
            self.base = space.base_address
        else:
            import torch
            self.torch = torch
            self.view = space.tensor(torch.uint8)

    def require_mapped(self, vt, start, end):
        """Fails the test (instead of faulting the process) if rows [start,end) are not mapped."""
        if end <= start:
            return
        assert not vt.released, "touching rows of a released vTensor"
        assert end <= vt.num_tokens, f"row {end - 1} >= num_tokens {vt.num_tokens}"
        pages = vt.page_chunks()
        assert len(pages) == self.space.pages_per_slot
        first = (start * self.rb) // self.page
        last = (end * self.rb - 1) // self.page
        missing = [p for p in range(first, last + 1) if pages[p] is None]
        assert not missing, f"vTensor {vt.id}: rows [{start},{end}) need pages {missing} which are unmapped"

    def write(self, vt, tokens, start, end):
        """Write the patterns of rows [start, end) of `vt`, whose tokens are `tokens`."""
        if end <= start:
            return
        self.require_mapped(vt, start, end)
        data = rows_pattern(tokens, start, end, self.rb)
        a, b = start * self.rb, end * self.rb
        if self.base is not None:
            fake_cuda_testing.write_device(self.base + vt.slot * self.slot_bytes + a, data)
        elif self.torch is None:
            self.view[vt.slot, a:b] = data
        else:
            self.view[vt.slot, a:b].copy_(self.torch.from_numpy(data.copy()).to(self.view.device))
            self.torch.cuda.synchronize()

    def read(self, vt, start, end):
        self.require_mapped(vt, start, end)
        a, b = start * self.rb, end * self.rb
        if self.base is not None:
            return fake_cuda_testing.read_device(self.base + vt.slot * self.slot_bytes + a, b - a)
        if self.torch is None:
            return np.array(self.view[vt.slot, a:b], copy=True)
        self.torch.cuda.synchronize()
        return self.view[vt.slot, a:b].cpu().numpy()

    def verify(self, vt, tokens, start=None, end=None, what=""):
        """Assert rows [start, end) of `vt` hold the patterns of `tokens`
        (default: every row it holds, [vt.low, vt.num_tokens))."""
        start = vt.low if start is None else start
        end = vt.num_tokens if end is None else end
        if end <= start:
            return
        got = self.read(vt, start, end)
        want = rows_pattern(tokens, start, end, self.rb)
        if not np.array_equal(got, want):
            bad = [t for t in range(start, end)
                   if not np.array_equal(got[(t - start) * self.rb:(t - start + 1) * self.rb],
                                         want[(t - start) * self.rb:(t - start + 1) * self.rb])]
            raise AssertionError(f"{what} vTensor {vt.id} (slot {vt.slot}): rows {bad} differ "
                                 f"from the pattern of their token prefix (tokens {list(tokens)[:end]})")


# --------------------------------------------------------------------------
# tree helpers


def node_paths(nodes):
    """For the depth-first list of prefix_nodes(), the full token path of every node.

    Returns a list of (path tuple, node dict) in the given order, reconstructing
    parents from start offsets (a child starts where its parent ends)."""
    out = []
    stack = []  # (end, path)
    for nd in nodes:
        assert nd["end"] - nd["start"] == len(nd["tokens"]), nd
        assert nd["end"] > nd["start"], f"empty node {nd}"
        while stack and stack[-1][0] != nd["start"]:
            stack.pop()
        if nd["start"] == 0:
            stack = []
            parent = ()
        else:
            assert stack, f"node {nd} has no parent ending at {nd['start']} before it (not depth first?)"
            parent = stack[-1][1]
        path = parent + tuple(int(t) for t in nd["tokens"])
        out.append((path, nd))
        stack.append((nd["end"], path))
    return out


def leaf_paths(nodes):
    """The set of root-to-leaf token sequences of the tree."""
    paths = [p for p, _ in node_paths(nodes)]
    pset = set(paths)
    return {p for p in pset if not any(q != p and q[:len(p)] == p for q in pset)}


def lcp(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def best_lcp(query, seqs):
    return max((lcp(query, s) for s in seqs), default=0)


# --------------------------------------------------------------------------
# state snapshots (fault tests, atomicity tests)

POOL_KEYS = ("chunks_created", "chunks_free", "chunks_held", "chunks_mapped",
             "chunks_cached", "chunks_in_tree", "tree_nodes", "tree_tokens")
SPACE_KEYS = ("slots_free", "vtensors", "used_tokens", "used_bytes", "mapped_bytes", "cached_bytes")


def snapshot(mgr, spaces, live, ios=None):
    """spaces: list of Space; live: dict vt -> tokens; ios: dict space name -> RowIO."""
    st = mgr.stats()
    snap = {
        "pool": {k: st[k] for k in POOL_KEYS},
        "spaces": {name: {k: d[k] for k in SPACE_KEYS} for name, d in st["spaces"].items()},
        "vts": {vt.id: (vt.num_tokens, vt.low, vt.released, tuple(vt.page_chunks()), vt.slot)
                for vt in live},
        "trees": {sp.name: sp.prefix_nodes() for sp in spaces},
        "free_slots": {sp.name: sp.free_slots for sp in spaces},
    }
    if ios is not None:
        for vt, toks in live.items():
            ios[vt.space.name].verify(vt, toks, what="snapshot:")
    return snap


def assert_same_state(before, after, allow_reclaim=True):
    """The state after a failed operation equals the state before it.

    docs/api.md: "A failed operation leaves every vTensor, the tree and the pool
    accounting as they were; only caches (free chunks, pages of released slots)
    may have been reclaimed on the way." So chunks_free / chunks_cached may only
    go down (and chunks_created with them); nothing may grow."""
    assert after["vts"] == before["vts"], "a vTensor changed"
    assert after["trees"] == before["trees"], "the prefix tree changed"
    assert after["free_slots"] == before["free_slots"], "free slots changed"
    b, a = before["pool"], after["pool"]
    for k in ("chunks_in_tree", "tree_nodes", "tree_tokens"):
        assert a[k] == b[k], f"{k}: {b[k]} -> {a[k]}"
    reclaimed_free = b["chunks_free"] - a["chunks_free"]
    reclaimed_cached = b["chunks_cached"] - a["chunks_cached"]
    if not allow_reclaim:
        assert reclaimed_free == 0 and reclaimed_cached == 0, f"pool changed: {b} -> {a}"
    assert reclaimed_free >= 0, f"chunks_free grew {b['chunks_free']} -> {a['chunks_free']}"
    assert reclaimed_cached >= 0, f"chunks_cached grew {b['chunks_cached']} -> {a['chunks_cached']}"
    assert a["chunks_held"] == b["chunks_held"] - reclaimed_cached, f"chunks_held: {b} -> {a}"
    assert a["chunks_mapped"] == b["chunks_mapped"] - reclaimed_cached, f"chunks_mapped: {b} -> {a}"
    assert a["chunks_created"] == b["chunks_created"] - reclaimed_free - reclaimed_cached, \
        f"chunks_created: {b} -> {a}"
    for name, bs in before["spaces"].items():
        as_ = after["spaces"][name]
        for k in ("slots_free", "vtensors", "used_tokens", "used_bytes"):
            assert as_[k] == bs[k], f"space {name} {k}: {bs[k]} -> {as_[k]}"
        if reclaimed_cached == 0:
            assert as_["mapped_bytes"] == bs["mapped_bytes"], f"space {name} mapped_bytes changed"
            assert as_["cached_bytes"] == bs["cached_bytes"], f"space {name} cached_bytes changed"
        else:
            assert as_["mapped_bytes"] <= bs["mapped_bytes"]
            assert as_["cached_bytes"] <= bs["cached_bytes"]


def fill_pool(sp):
    """vTensors holding every chunk of the pool (evicting or spilling the tree), then released."""
    held, per = [], sp.max_tokens
    while True:
        try:
            held.append(sp.create(per).result())
        except vtm.OutOfMemory:
            if per == 1:
                break
            per = max(1, per // 2)
    for vt in held:
        vt.release().result()


def assert_pool_consistent(mgr):
    st = mgr.stats()
    assert st["chunks_held"] == st["chunks_created"] - st["chunks_free"], st
    assert st["chunks_created"] * st["chunk_bytes"] <= st["capacity_bytes"], st
    mgr.check()
    return st


def poll(pred, timeout=10.0, interval=0.005):
    """Wait until pred() is true (generous timeout; for background work only)."""
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


# --------------------------------------------------------------------------
# C++ harnesses over the prefix tree, built from the sources (no module hook)

TREE_SOURCES = ["prefix_tree.cc", "pool.cc", "host_tier.cc", "error.cc", "backend_host.cc"]


def run_tree_harness(name, tmp_path):
    """Builds tests/vtm/<name>.cc with the tree's sources and runs it (skips
    without a C++ compiler); returns the finished process, its output in stdout."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        pytest.skip("no C++ compiler")
    root = pathlib.Path(__file__).resolve().parents[2]
    csrc = root / "src" / "vtm" / "csrc"
    binary = tmp_path / name
    subprocess.run([compiler, "-std=c++17", "-O1", "-g", f"-I{csrc}", str(root / "tests" / "vtm" / f"{name}.cc"),
                    *(str(csrc / s) for s in TREE_SOURCES), "-o", str(binary), "-lpthread"], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # not under the sanitizers' runtime
    return subprocess.run([str(binary)], capture_output=True, text=True, timeout=120, env=env)
