"""The host tier (Manager(host_tier_bytes=N)): prefix-tree nodes the device
pool evicts keep their bytes in host memory and stay matchable; a match
copies them back. Checked by the bytes: every row a vTensor holds is the
pattern of its token prefix (vtm_testing.RowIO), so a restore of stale or
misplaced bytes fails the test; and by Manager.check() after every step."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

import vtm
from broker_testing import broker, spawn  # noqa: F401 (fixtures)
from vtm_testing import (SENTINEL, RowIO, assert_pool_consistent, assert_same_state, chunk_for, fill_pool,
                         snapshot)

CHUNKS = 8  # a small device pool, so that a few vTensors evict the tree


def setup(make_manager, backend, tier_chunks, window_tokens=0, **kw):
    chunk = chunk_for(backend)
    mgr = make_manager(backend, chunks=CHUNKS, host_tier_bytes=tier_chunks * chunk, **kw)
    row = chunk // 20 + 7  # rows straddle pages
    sp = mgr.create_space(row_bytes=row, max_tokens=200, max_slots=8, window_tokens=window_tokens)
    return mgr, sp, RowIO(sp, backend)


def record_any(sp, io, tokens):
    """record(), or in a window space record_window() with holes below row 20."""
    if sp.window_tokens:
        record_window(sp, io, tokens, low=20)
    else:
        record(sp, io, tokens)


def record(sp, io, tokens):
    """A vTensor holding `tokens` (their patterns written), recorded whole,
    released, also when the record fails (one that must copy a page into a
    node on the host may run out of memory: the vTensor must not keep its
    chunks for the rest of the test)."""
    vt = sp.create(len(tokens)).result()
    try:
        io.write(vt, tokens, 0, len(tokens))
        sp.prefix_record(vt, tokens).result()
    finally:
        vt.release().result()


def window_setup(make_manager, backend, tier_chunks=16, window=30, tier_account=0):
    chunk = chunk_for(backend)
    mgr = make_manager(backend, chunks=CHUNKS, host_tier_bytes=tier_chunks * chunk)
    sp = mgr.create_space(row_bytes=chunk // 20 + 7, max_tokens=200, max_slots=8, window_tokens=window,
                          tier_account=tier_account)
    return mgr, sp, RowIO(sp, backend)


def record_window(sp, io, tokens, low):
    """A vTensor of `tokens` that unmapped its pages below row `low` (a
    sliding window slid past them), recorded with those holes, released."""
    vt = sp.create(len(tokens)).result()
    io.write(vt, tokens, 0, len(tokens))
    vt.extend(len(tokens), low=low).result()
    sp.prefix_record(vt, tokens).result()
    vt.release().result()


WINDOWS = pytest.mark.parametrize("window", [0, 30], ids=["whole", "window"])


def match(sp, tokens):
    return sp.prefix_match(list(tokens) + [SENTINEL]).result()


def on_host(sp):
    return [n for n in sp.prefix_nodes() if n["on_host"]]


def assert_matches_whole(sp, io, tokens):
    """A match of all of `tokens`, its rows checked byte for byte, released."""
    m = match(sp, tokens)
    assert m.num_tokens == len(tokens)
    io.verify(m.vtensor, tokens)
    m.vtensor.release().result()


def test_an_evicted_prefix_comes_back_from_the_host_tier_byte_for_byte(backend, make_manager):
    mgr, sp, io = setup(make_manager, backend, tier_chunks=16)
    A = [(7 * i + 3) % 101 for i in range(60)]
    record(sp, io, A)
    fill_pool(sp)
    st = assert_pool_consistent(mgr)
    assert st["spills_total"] >= 1 and st["chunks_in_tree"] == 0 and on_host(sp)
    assert st["host_tier_used_bytes"] == st["spilled_bytes_total"] > 0
    assert st["spill_copy_seconds_total"] > 0 and st["restore_seconds_total"] == 0
    m = match(sp, A)
    assert m.num_tokens == m.restored_tokens == len(A)
    io.verify(m.vtensor, A)
    st = assert_pool_consistent(mgr)
    assert st["restores_total"] == 1 and st["restored_bytes_total"] == st["spilled_bytes_total"]
    assert 0 < st["restore_copy_seconds_total"] <= st["restore_seconds_total"]
    assert not on_host(sp) and st["host_tier_used_bytes"] == 0
    m.vtensor.release().result()
    again = match(sp, A)  # from the device now
    assert again.num_tokens == len(A) and again.restored_tokens == 0
    again.vtensor.release().result()
    assert_pool_consistent(mgr)


def test_backend_costs_take_a_spill_and_a_restore_apart_by_operation(backend, make_manager):
    """mgr.backend_costs() charges every backend call to its operation: a
    slow restore is taken apart into its copies, its allocations and its
    mappings. A batched copy is one call, however many chunks it moves."""
    mgr, sp, io = setup(make_manager, backend, tier_chunks=16, faults=True)
    A = [(7 * i + 3) % 101 for i in range(60)]
    record(sp, io, A)
    fill_pool(sp)
    spilled = mgr.backend_costs()
    st = mgr.stats()
    assert st["spills_total"] >= 1 and spilled["copy_to_host"]["calls"] == st["spills_total"]
    assert spilled["alloc_host"]["calls"] == mgr.faults.calls("alloc_host") > 0
    assert spilled["copy_from_host"] == {"calls": 0, "seconds": 0.0}
    mgr.faults.delay("copy_from_host", 0.02)  # charged once per chunk copied
    assert_matches_whole(sp, io, A)
    restored = mgr.backend_costs()
    st = mgr.stats()
    assert restored["copy_from_host"]["calls"] == st["restores_total"] == 1
    assert 0.02 <= restored["copy_from_host"]["seconds"] <= st["restore_copy_seconds_total"]
    assert restored["wait_copies"]["calls"] == 1  # its copies are started, then waited for once
    assert restored["map"]["calls"] > spilled["map"]["calls"]  # the restored pages mapped into the match


def test_without_a_tier_the_same_eviction_loses_the_prefix(backend, make_manager):
    """The control: the test above would pass without a tier only if eviction kept the prefix."""
    mgr, sp, io = setup(make_manager, backend, tier_chunks=0)
    A = [(7 * i + 3) % 101 for i in range(60)]
    record(sp, io, A)
    fill_pool(sp)
    assert match(sp, A).num_tokens == 0
    st = assert_pool_consistent(mgr)
    assert st["spills_total"] == 0 and st["host_tier_capacity_bytes"] == 0


def test_a_full_tier_drops_its_least_recently_used_prefix(backend, make_manager):
    chunk = chunk_for(backend)
    pages = -(-40 * (chunk // 20 + 7) // chunk)  # of each 40-token prefix
    mgr, sp, io = setup(make_manager, backend, tier_chunks=2 * pages)  # room for two of the three
    prefixes = [[100 * k + i for i in range(40)] for k in range(3)]
    for tokens in prefixes:
        record(sp, io, tokens)
    fill_pool(sp)
    st = assert_pool_consistent(mgr)
    assert st["host_tier_drops_total"] >= 1 and st["host_tier_used_bytes"] <= 2 * pages * chunk
    oldest, *newer = prefixes
    assert match(sp, oldest).num_tokens == 0
    for tokens in newer:
        m = match(sp, tokens)
        assert m.num_tokens == len(tokens)
        io.verify(m.vtensor, tokens)
        m.vtensor.release().result()
        fill_pool(sp)  # back to the host, for the next one's room
    assert_pool_consistent(mgr)


def test_a_node_on_the_host_splits_and_both_halves_come_back(backend, make_manager):
    mgr, sp, io = setup(make_manager, backend, tier_chunks=16)
    A = [(5 * i + 1) % 97 for i in range(60)]
    B = A[:33] + [500 + i for i in range(20)]  # diverges inside A's node, mid-page
    record(sp, io, A)
    fill_pool(sp)
    assert on_host(sp)
    # Splits the node on the host at 33; the upper half takes the recorder's
    # chunks, the lower one keeps its blocks (the straddling page's too).
    record(sp, io, B)
    assert_pool_consistent(mgr)
    nodes = {(n["start"], n["end"]): n["on_host"] for n in sp.prefix_nodes()}
    assert nodes == {(0, 33): False, (33, 60): True, (33, 53): False}, nodes
    for tokens in (A, B):
        m = match(sp, tokens)
        assert m.num_tokens == len(tokens)
        io.verify(m.vtensor, tokens)
        m.vtensor.release().result()
        assert_pool_consistent(mgr)
    fill_pool(sp)
    for tokens in (B, A):
        m = match(sp, tokens)
        io.verify(m.vtensor, tokens)
        m.vtensor.release().result()
    assert_pool_consistent(mgr)


def wait_for(condition, seconds=10.0):
    """Polls `condition` (the refill thread works in the background) until it holds or time runs out."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_eager_allocation_allocates_host_blocks_ahead_of_the_spills_that_take_them(backend, make_manager):
    """With prealloc_chunks, the refill thread also keeps host blocks
    allocated ahead of need: as many free as the pool has chunks (what
    spilling a full pool takes), within the tier. On CUDA a block is ~1 ms
    of page-locking, which a spill used to pay per chunk on the critical
    path of the admission that made it. Here the tier is the pool's size:
    every block is allocated before anything spills, and no spill allocates."""
    chunk = chunk_for(backend)
    mgr, sp, io = setup(make_manager, backend, tier_chunks=CHUNKS, prealloc_chunks=2, faults=True)
    assert wait_for(lambda: mgr.stats()["host_tier_allocated_bytes"] == CHUNKS * chunk)
    st = mgr.stats()
    assert st["host_tier_prealloc_blocks_total"] == CHUNKS == mgr.faults.calls("alloc_host")
    assert st["host_tier_used_bytes"] == 0
    A = [(7 * i + 3) % 101 for i in range(60)]
    record(sp, io, A)
    fill_pool(sp)
    st = assert_pool_consistent(mgr)
    assert st["spills_total"] >= 1 and st["host_tier_used_bytes"] == st["spilled_bytes_total"] > 0
    assert mgr.faults.calls("alloc_host") == CHUNKS and st["host_tier_allocated_bytes"] == CHUNKS * chunk
    assert_matches_whole(sp, io, A)
    assert_pool_consistent(mgr)


def test_without_eager_allocation_the_tier_allocates_only_what_spills_take(backend, make_manager):
    chunk = chunk_for(backend)
    mgr, sp, io = setup(make_manager, backend, tier_chunks=CHUNKS, faults=True)  # prealloc_chunks=0
    A = [(7 * i + 3) % 101 for i in range(60)]
    record(sp, io, A)
    assert mgr.stats()["host_tier_allocated_bytes"] == 0 and mgr.faults.calls("alloc_host") == 0
    fill_pool(sp)
    st = assert_pool_consistent(mgr)
    assert st["host_tier_allocated_bytes"] == st["host_tier_used_bytes"] == st["spilled_bytes_total"] > 0
    assert st["host_tier_prealloc_blocks_total"] == 0
    assert mgr.faults.calls("alloc_host") * chunk == st["host_tier_allocated_bytes"]


@pytest.mark.parametrize("bad_alloc", [False, True])
def test_a_failed_host_block_allocation_ahead_of_need_waits_for_the_next_commit(backend, make_manager, bad_alloc):
    """The refill thread's allocation fails (the host out of page-locked
    memory): nothing changes, spills go on with the free blocks (or allocate
    their own), and the thread tries again once an operation commits."""
    chunk = chunk_for(backend)
    mgr, sp, io = setup(make_manager, backend, tier_chunks=2 * CHUNKS, prealloc_chunks=2, faults=True)
    assert wait_for(lambda: mgr.stats()["host_tier_allocated_bytes"] == CHUNKS * chunk)  # CHUNKS free
    mgr.faults.fail_nth("alloc_host", 1, bad_alloc=bad_alloc)
    A = [(7 * i + 3) % 101 for i in range(60)]
    record(sp, io, A)
    fill_pool(sp)  # spills A into free blocks; the refill's next allocation fails, a later commit's goes on
    st = assert_pool_consistent(mgr)
    assert st["spills_total"] >= 1 and st["spill_failures_total"] == 0 and on_host(sp)
    used = st["host_tier_used_bytes"] // chunk
    assert 0 < used < CHUNKS
    assert wait_for(lambda: mgr.faults.calls("alloc_host") > CHUNKS)  # the failed one, at least
    record(sp, io, [5, 6, 7])  # an operation commits (from the free chunks fill_pool left): the refill goes on
    # The free blocks topped up again (to CHUNKS), with one failed call on the way.
    assert wait_for(lambda: mgr.stats()["host_tier_allocated_bytes"] == (CHUNKS + used) * chunk)
    assert mgr.faults.calls("alloc_host") == CHUNKS + used + 1
    assert_matches_whole(sp, io, A)
    assert_pool_consistent(mgr)


# -- spilling ahead of need (spill_ahead_bytes) --------------------------------------


def spill_ahead_setup(make_manager, backend, ahead_chunks, **kw):
    chunk = chunk_for(backend)
    return setup(make_manager, backend, tier_chunks=16, spill_ahead_bytes=ahead_chunks * chunk, **kw)


def fill_with_prefixes(sp, io, count=2, length=40):
    """`count` prefixes recorded and released, each its own stem: the tree holds most of the pool, and
    without spilling ahead nothing spills."""
    prefixes = [[1000 * k + i for i in range(length)] for k in range(count)]
    for tokens in prefixes:
        record(sp, io, tokens)
    return prefixes


def room(st):
    """Chunks an allocation takes without a copy: free, not created yet, or cached by a released slot."""
    return st["chunks_free"] + CHUNKS - st["chunks_created"] + st["chunks_cached"]


def test_spilling_ahead_keeps_room_free_and_every_prefix_comes_back_byte_for_byte(backend, make_manager):
    """With spill_ahead_bytes, the least recently used prefixes go to the
    host tier in the background until that much of the pool is free: an
    allocation then finds its chunks without copying on its critical path."""
    chunk = chunk_for(backend)
    mgr, sp, io = spill_ahead_setup(make_manager, backend, ahead_chunks=4)
    prefixes = fill_with_prefixes(sp, io)
    assert wait_for(lambda: room(mgr.stats()) >= 4)
    st = assert_pool_consistent(mgr)
    assert st["spills_total"] == st["spills_ahead_total"] >= 1 and st["spill_failures_total"] == 0
    assert st["host_tier_used_bytes"] == st["spilled_bytes_total"] > 0
    spilled = {n["tokens"][0] for n in on_host(sp)}
    assert spilled and prefixes[-1][0] not in spilled  # the least recently used went, the latest stays
    vt = sp.create(4 * chunk // sp.row_bytes).result()  # four chunks' rows: the room is there
    st = mgr.stats()  # one reading: a spill ahead may land between two
    assert st["spills_total"] == st["spills_ahead_total"]  # none spilled on demand
    vt.release().result()
    for tokens in prefixes:
        assert_matches_whole(sp, io, tokens)
    assert_pool_consistent(mgr)


def test_without_spilling_ahead_the_same_prefixes_stay_on_the_device(backend, make_manager):
    mgr, sp, io = setup(make_manager, backend, tier_chunks=16, prealloc_chunks=1)
    fill_with_prefixes(sp, io)
    time.sleep(0.05)
    st = assert_pool_consistent(mgr)
    assert st["spills_total"] == 0 and not on_host(sp)


def held_spill_ahead(make_manager, backend, seconds=0.5):
    """A pool full of prefixes, whose spill ahead (of the oldest) copies for `seconds`."""
    mgr, sp, io = spill_ahead_setup(make_manager, backend, ahead_chunks=4, faults=True)
    mgr.faults.delay("copy_to_host", seconds)
    prefixes = fill_with_prefixes(sp, io)
    assert wait_for(lambda: mgr.faults.calls("copy_to_host") >= 1)
    return mgr, sp, io, prefixes


def test_a_match_of_the_prefix_a_spill_ahead_copies_reads_it_from_the_device(backend, make_manager):
    """The node stays matchable while its bytes are copied: the match maps
    its chunks at once, and the spill ahead, finding it locked, gives up."""
    mgr, sp, io, prefixes = held_spill_ahead(make_manager, backend, seconds=1.0)
    [node] = [n for n in sp.prefix_nodes() if n["tokens"][0] == prefixes[0][0]]
    m = match(sp, prefixes[0])
    # The copy (a second a page) was still going when the match returned: it did not wait for it.
    assert mgr.faults.calls("copy_to_host") < len(node["pages"])
    assert m.num_tokens == len(prefixes[0]) and m.restored_tokens == 0
    io.verify(m.vtensor, prefixes[0])
    assert wait_for(lambda: mgr.stats()["spills_ahead_abandoned_total"] >= 1)
    mgr.faults.delay("copy_to_host", 0)
    io.verify(m.vtensor, prefixes[0])
    m.vtensor.release().result()
    st = assert_pool_consistent(mgr)
    assert st["spill_failures_total"] == 0
    for tokens in prefixes:
        assert_matches_whole(sp, io, tokens)
    assert_pool_consistent(mgr)


def test_clear_prefixes_during_a_spill_ahead_drops_the_prefix_it_copies(backend, make_manager):
    """clear_prefixes() keeps the nodes live vTensors lock, and a spill ahead
    locks the node it copies (and its path): that prefix stayed in the tree,
    moved to the host once the copy ended, and a later match restored what
    the caller had cleared. Now clear_prefixes() waits for the spill ahead."""
    mgr, sp, io, prefixes = held_spill_ahead(make_manager, backend, seconds=0.2)
    sp.clear_prefixes()
    assert sp.prefix_nodes() == []
    mgr.faults.delay("copy_to_host", 0)
    for tokens in prefixes:
        m = match(sp, tokens)
        assert m.num_tokens == 0
        if m.vtensor is not None:
            m.vtensor.release().result()
    st = assert_pool_consistent(mgr)
    assert st["host_tier_used_bytes"] == 0


def test_a_limit_lowered_during_a_spill_ahead_holds_once_it_is_done(backend, make_manager):
    """A spill ahead's blocks count in its account while no node holds them
    yet, and its node reached the host without a look at the limit: a
    limit lowered during the copy could drop nothing, and the account stayed
    above it with no node locked. Now the limit waits for the spill ahead."""
    chunk = chunk_for(backend)
    mgr = make_manager(backend, chunks=CHUNKS, host_tier_bytes=16 * chunk, spill_ahead_bytes=4 * chunk, faults=True)
    sp = mgr.create_space(row_bytes=chunk // 20 + 7, max_tokens=200, max_slots=8, tier_account=1)
    io = RowIO(sp, backend)
    mgr.faults.delay("copy_to_host", 0.2)
    fill_with_prefixes(sp, io)
    assert wait_for(lambda: mgr.faults.calls("copy_to_host") >= 1)
    mgr.set_host_tier_limit(1, chunk)
    mgr.faults.delay("copy_to_host", 0)
    st = assert_pool_consistent(mgr)
    assert st["host_tier_accounts"][1]["used_bytes"] <= chunk, st


def test_an_allocation_during_a_spill_ahead_waits_for_it_and_never_fails_for_want_of_its_chunks(
        backend, make_manager):
    """The node in flight is locked, so its chunks are not counted as
    evictable until the copy ends: an allocation that needs them waits for
    the spill ahead rather than failing, or spilling it a second time."""
    chunk = chunk_for(backend)
    mgr, sp, io, prefixes = held_spill_ahead(make_manager, backend)
    st = mgr.stats()
    everything = CHUNKS * chunk // sp.row_bytes - 1
    vt = sp.create(everything).result()  # the whole pool: every prefix goes, the one in flight included
    mgr.faults.delay("copy_to_host", 0)
    st = assert_pool_consistent(mgr)
    assert st["spill_failures_total"] == 0 and st["spills_ahead_total"] >= 1
    vt.release().result()
    for tokens in prefixes:
        assert_matches_whole(sp, io, tokens)
    assert_pool_consistent(mgr)


def test_a_space_closed_during_a_spill_ahead_waits_for_it(backend, make_manager):
    mgr, sp, io, prefixes = held_spill_ahead(make_manager, backend, seconds=0.3)
    sp.close()
    st = assert_pool_consistent(mgr)
    assert st["host_tier_used_bytes"] == 0 and st["chunks_in_tree"] == 0 and st["tree_nodes"] == 0


@pytest.mark.parametrize("bad_alloc", [False, True])
def test_a_failed_spill_ahead_loses_nothing(backend, make_manager, bad_alloc):
    """A copy ahead of need that fails leaves the prefix on the device and
    gives its blocks back; the thread tries again once an operation commits
    (here the release that follows the record)."""
    mgr, sp, io = spill_ahead_setup(make_manager, backend, ahead_chunks=4, faults=True)
    mgr.faults.fail_nth("copy_to_host", 1, bad_alloc=bad_alloc)
    prefixes = fill_with_prefixes(sp, io)
    assert wait_for(lambda: mgr.stats()["spill_failures_total"] == 1)
    assert_pool_consistent(mgr)  # waits for a spill ahead in flight (the thread may have gone on already)
    assert_matches_whole(sp, io, prefixes[-1])  # an operation commits: the thread goes on
    assert wait_for(lambda: room(mgr.stats()) >= 4)
    st = assert_pool_consistent(mgr)
    assert st["spills_total"] == st["spills_ahead_total"] >= 1
    assert st["host_tier_used_bytes"] == st["spilled_bytes_total"]
    for tokens in prefixes:
        assert_matches_whole(sp, io, tokens)
    assert_pool_consistent(mgr)


def test_bad_spill_ahead_sizes_are_refused(backend):
    chunk = chunk_for(backend)
    with pytest.raises(vtm.InvalidArgument, match="host_tier_bytes too"):
        vtm.Manager(backend=backend, capacity_bytes=CHUNKS * chunk, chunk_bytes=chunk, spill_ahead_bytes=chunk)
    with pytest.raises(vtm.InvalidArgument, match="spill_ahead_bytes .* not a multiple"):
        vtm.Manager(backend=backend, capacity_bytes=CHUNKS * chunk, chunk_bytes=chunk, host_tier_bytes=chunk,
                    spill_ahead_bytes=chunk + 1)
    with pytest.raises(vtm.InvalidArgument, match="spill_ahead_bytes must be >= 0"):
        vtm.Manager(backend=backend, capacity_bytes=CHUNKS * chunk, chunk_bytes=chunk, host_tier_bytes=chunk,
                    spill_ahead_bytes=-chunk)


@WINDOWS
@pytest.mark.parametrize("op, nth, bad_alloc", [("copy_to_host", 1, False), ("copy_to_host", 2, False),
                                                ("alloc_host", 1, False), ("copy_to_host", 2, True),
                                                ("alloc_host", 2, True)],
                         ids=["first_copy", "second_copy", "alloc_host", "second_copy_bad_alloc",
                              "second_alloc_host_bad_alloc"])
def test_a_failed_spill_evicts_the_prefix_as_without_a_tier(backend, make_manager, op, nth, bad_alloc, window):
    """The second copy fails midway through the node's batch of copies (on
    CUDA, after the batched path made the first). A std::bad_alloc (the host
    out of memory inside the batch, or growing the tier's free list) is a
    failed spill too: the blocks taken before it are given back, not leaked."""
    mgr, sp, io = setup(make_manager, backend, tier_chunks=16, window_tokens=window, faults=True)
    A = [(3 * i) % 89 for i in range(60)]
    record_any(sp, io, A)
    [node] = sp.prefix_nodes()
    assert sum(p is not None for p in node["pages"]) >= 2
    mgr.faults.fail_nth(op, nth, bad_alloc=bad_alloc)
    fill_pool(sp)
    st = assert_pool_consistent(mgr)
    assert st["spill_failures_total"] == 1 and not on_host(sp) and st["host_tier_used_bytes"] == 0
    assert match(sp, A).num_tokens == 0


@WINDOWS
@pytest.mark.parametrize("how", ["copy_fails", "bad_alloc", "oom"])
@pytest.mark.parametrize("end", [60, 55], ids=["at_its_end", "inside_it"])
def test_a_failed_restore_changes_nothing_and_the_prefix_stays_on_the_host(backend, make_manager, how, window, end):
    """A match of A[:end] that cannot restore the node on the host: a copy
    fails (with the backend's error, or the host out of memory inside it:
    std::bad_alloc), or no device memory is left. A match ending inside the
    node used to leave it split there (two nodes sharing a block) after
    failing; after a std::bad_alloc, until that was caught too."""
    oom = how == "oom"
    mgr, sp, io = setup(make_manager, backend, tier_chunks=16, window_tokens=window, faults=True)
    A = [(11 * i + 2) % 83 for i in range(60)]
    record_any(sp, io, A)
    fill_pool(sp)
    held = {}
    if oom:  # live vTensors hold the whole pool: no room for the restored pages
        while True:
            try:
                held[sp.create(1).result()] = [0]
            except vtm.OutOfMemory:
                break
    else:
        mgr.faults.fail_nth("copy_from_host", 1, bad_alloc=how == "bad_alloc")
    before = snapshot(mgr, [sp], held)
    if oom:  # a miss, as without a tier (the prefix would have been evicted), not an error
        assert match(sp, A[:end]).num_tokens == 0
    else:
        with pytest.raises(MemoryError if how == "bad_alloc" else vtm.BackendError):
            match(sp, A[:end])
    assert_same_state(before, snapshot(mgr, [sp], held))
    assert [(n["start"], n["end"]) for n in on_host(sp)] == [(0, 60)] and mgr.stats()["restores_total"] == 0
    assert_pool_consistent(mgr)
    mgr.faults.clear()
    for vt in held:
        vt.release().result()
    m = match(sp, A)
    assert m.num_tokens == len(A) and m.restored_tokens == len(A)
    io.verify(m.vtensor, A, m.vtensor.low, len(A))


@WINDOWS
@pytest.mark.parametrize("end", [60, 55], ids=["at_its_end", "inside_it"])
def test_a_restore_whose_copies_fail_at_their_wait_changes_nothing(backend, make_manager, window, end):
    """A restore's copies are started, the match maps its pages meanwhile,
    and then waits for them: a wait that fails (the backend's wait_copies)
    fails the match and leaves the manager as if it had not restored: the
    node still on the host and unsplit, its chunks and the slot's mappings
    given back, the counts unchanged. Until the wait, no node is marked
    device-resident."""
    mgr, sp, io = setup(make_manager, backend, tier_chunks=16, window_tokens=window, faults=True)
    A = [(11 * i + 2) % 83 for i in range(60)]
    record_any(sp, io, A)
    fill_pool(sp)
    before = snapshot(mgr, [sp], {})
    mgr.faults.fail_nth("wait_copies", 1)
    with pytest.raises(vtm.BackendError, match="injected fault in wait_copies"):
        match(sp, A[:end])
    assert_same_state(before, snapshot(mgr, [sp], {}))
    assert [(n["start"], n["end"]) for n in on_host(sp)] == [(0, 60)] and mgr.stats()["restores_total"] == 0
    assert_pool_consistent(mgr)
    m = match(sp, A)
    assert m.num_tokens == len(A) and m.restored_tokens == len(A)
    io.verify(m.vtensor, A, m.vtensor.low, len(A))
    m.vtensor.release().result()
    assert_pool_consistent(mgr)


@WINDOWS
@pytest.mark.parametrize("wait_fails", [False, True], ids=["copies_done", "wait_fails"])
def test_a_match_that_fails_while_its_restores_copies_run_waits_for_them(backend, make_manager, window, wait_fails):
    """The match's mapping of its pages (which runs under the restore's
    copies) fails: the copies are waited for first. Done, the restore stands,
    a step of its own as when no slot is free; their wait failing too, the
    match leaves everything as it was, the node on the host and unsplit."""
    mgr, sp, io = setup(make_manager, backend, tier_chunks=16, window_tokens=window, faults=True)
    A = [(11 * i + 2) % 83 for i in range(60)]
    record_any(sp, io, A)
    fill_pool(sp)
    before = snapshot(mgr, [sp], {})
    mgr.faults.fail_nth("map", 1)
    if wait_fails:
        mgr.faults.fail_nth("wait_copies", 1)
    with pytest.raises(vtm.BackendError, match="injected fault in map"):
        match(sp, A[:55])
    assert mgr.faults.calls("wait_copies") == 1
    assert_pool_consistent(mgr)
    if wait_fails:
        assert_same_state(before, snapshot(mgr, [sp], {}))
        assert [(n["start"], n["end"]) for n in on_host(sp)] == [(0, 60)] and mgr.stats()["restores_total"] == 0
    else:
        assert mgr.stats()["restores_total"] == 1
        assert any(n["end"] == 55 and not n["on_host"] for n in sp.prefix_nodes()) and (55, 60) in \
            [(n["start"], n["end"]) for n in on_host(sp)]
    mgr.faults.clear()
    m = match(sp, A)
    assert m.num_tokens == len(A)
    io.verify(m.vtensor, A, m.vtensor.low, len(A))
    m.vtensor.release().result()
    assert_pool_consistent(mgr)


def test_a_match_restores_only_the_pages_it_maps(backend, make_manager):
    """A short match into a long prefix on the host splits its node and copies
    back the part it maps, not the whole node."""
    chunk = chunk_for(backend)
    mgr, sp, io = setup(make_manager, backend, tier_chunks=16)
    A = [(13 * i + 5) % 91 for i in range(100)]  # one node of 6 pages
    record(sp, io, A)
    fill_pool(sp)
    spilled = mgr.stats()["spilled_bytes_total"]
    short = A[:20] + [777, 778]
    m = match(sp, short)
    assert m.num_tokens == m.restored_tokens == 20
    io.verify(m.vtensor, short, 0, 20)
    st = assert_pool_consistent(mgr)
    pages = -(-20 * sp.row_bytes // chunk)
    assert st["restored_bytes_total"] == pages * chunk < spilled
    assert [(n["start"], n["end"], n["on_host"]) for n in sp.prefix_nodes()] == [(0, 20, False), (20, 100, True)]
    m.vtensor.release().result()
    full = match(sp, A)  # the rest comes back too, and the bytes join up
    assert full.num_tokens == len(A) and full.restored_tokens == len(A) - 20
    io.verify(full.vtensor, A)
    assert_pool_consistent(mgr)


@WINDOWS
def test_without_room_for_the_host_part_a_match_takes_what_the_device_holds(backend, make_manager, window):
    """In a window space, what the device holds of the match's window."""
    mgr, sp, io = setup(make_manager, backend, tier_chunks=16, window_tokens=window)
    A = [(17 * i + 1) % 79 for i in range(100)]
    record(sp, io, A)
    fill_pool(sp)
    first = match(sp, A[:50] + [5])  # restores [0, 50) (its window, [21, 50)), which it keeps locked on the device
    mgr.trim()
    # Live vTensors hold every other chunk but one (the match's copy of its
    # last page): the rest of A cannot come back. (Creating until out of
    # memory would unpin the first match's path, and spill it.)
    held = [sp.create(1).result() for _ in range(CHUNKS - mgr.stats()["chunks_held"] - 1)]
    m = match(sp, A)
    assert m.num_tokens == 50 and m.restored_tokens == 0
    io.verify(m.vtensor, A, m.vtensor.low, 50)
    assert [n["on_host"] for n in sp.prefix_nodes()] == ([True, False, True] if window else [False, True])
    for vt in held + [m.vtensor, first.vtensor]:
        vt.release().result()
    assert_pool_consistent(mgr)


def test_a_restore_never_takes_what_other_matches_locks_keep(backend, make_manager):
    """Only chunks that running matches' locks keep (each path's copy of its
    last page, which its match replaced with its own) are left in the pool.
    A restore is optional, so it must not unpin them: the match of a prefix
    on the host takes what the device holds (nothing here) as before. (An
    earlier version unpinned both paths and spilled them to restore, then
    failed with OutOfMemory on the match's copy.)"""
    chunk = chunk_for(backend)
    mgr = make_manager(backend, chunks=12, host_tier_bytes=32 * chunk, prealloc_chunks=0, slot_cache_bytes=0)
    sp = mgr.create_space(row_bytes=chunk // 16, max_tokens=120, max_slots=16)
    io = RowIO(sp, backend)
    A, B, C = ([k] + list(range(100, 119)) for k in (1, 2, 3))  # 20 tokens: page 0, and page 1 partial
    for tokens in (A, B, C):
        record(sp, io, tokens)
    held = [match(sp, B + [7]).vtensor, match(sp, C + [7]).vtensor]
    mgr.trim()
    held += [sp.create(1).result() for _ in range(12 - mgr.stats()["chunks_held"] + 2)]  # spills A
    nodes = sp.prefix_nodes()
    assert [(n["tokens"][0], n["locks"], n["on_host"]) for n in nodes] == [(1, 0, True), (2, 1, False), (3, 1, False)]
    m = sp.prefix_match(A + [7]).result()
    assert m.num_tokens == 0 and m.restored_tokens == 0
    assert sp.prefix_nodes() == nodes and mgr.stats()["prefix_unpins_total"] == 0
    for vt in held:
        vt.release().result()
    assert_pool_consistent(mgr)


def test_a_match_restores_no_more_than_its_budget(backend, make_manager):
    """prefix_restore_bytes says what a match would copy back; a match with
    max_restore_bytes below that restores the longest part of the prefix
    within it (whole chunks), and with less than a chunk takes the part the
    device holds. (A budget was all or nothing: one chunk short of the
    whole, the match restored nothing and the caller computed it all.)"""
    mgr, sp, io = setup(make_manager, backend, tier_chunks=16)
    chunk = chunk_for(backend)
    A = [(5 * i + 1) % 97 for i in range(40)]
    AB = A + [200 + i for i in range(40)]
    record(sp, io, AB)
    record(sp, io, A)  # the tree: [0, 40) and [40, 80) below it
    fill_pool(sp)
    assert sp.prefix_restore_bytes(A + [SENTINEL]) > 0
    before = mgr.stats()["restored_bytes_total"]
    m = match(sp, A)  # restores the upper node only
    restored = mgr.stats()["restored_bytes_total"] - before
    assert restored > 0 and m.restored_tokens == len(A)
    m.vtensor.release().result()
    tail = sp.prefix_restore_bytes(AB + [SENTINEL])  # the lower node, still on the host
    assert tail >= 3 * chunk and tail % chunk == 0
    none = sp.prefix_match(AB + [SENTINEL], max_restore_bytes=chunk - 1).result()
    assert none.num_tokens == len(A) and none.restored_tokens == 0
    io.verify(none.vtensor, A)
    none.vtensor.release().result()
    assert sp.prefix_restore_bytes(AB + [SENTINEL]) == tail  # nothing came back
    before = mgr.stats()["restored_bytes_total"]
    part = sp.prefix_match(AB + [SENTINEL], max_restore_bytes=tail - 1).result()
    assert len(A) < part.num_tokens < len(AB) and part.num_tokens == len(A) + part.restored_tokens
    assert mgr.stats()["restored_bytes_total"] - before == tail - chunk
    io.verify(part.vtensor, AB[:part.num_tokens])
    part.vtensor.release().result()
    rest = sp.prefix_restore_bytes(AB + [SENTINEL])
    assert 0 < rest < tail  # what the budget left on the host (with its own copy of the page it starts in)
    before = mgr.stats()["restored_bytes_total"]
    full = sp.prefix_match(AB + [SENTINEL], max_restore_bytes=rest).result()
    assert full.num_tokens == len(AB)
    assert mgr.stats()["restored_bytes_total"] - before == rest
    io.verify(full.vtensor, AB)
    full.vtensor.release().result()
    assert sp.prefix_restore_bytes(AB + [SENTINEL]) == 0
    with pytest.raises(vtm.InvalidArgument, match="max_restore_bytes"):
        sp.prefix_match(AB, max_restore_bytes=-1)
    assert_pool_consistent(mgr)


def test_restore_bytes_of_a_match_that_ends_inside_a_node_count_its_upper_half(backend, make_manager):
    mgr, sp, io = setup(make_manager, backend, tier_chunks=16)
    tokens = [(3 * i + 2) % 89 for i in range(100)]
    record(sp, io, tokens)
    fill_pool(sp)
    for n in (10, 61, 99):
        predicted = sp.prefix_restore_bytes(tokens[:n] + [SENTINEL])
        before = mgr.stats()["restored_bytes_total"]
        m = match(sp, tokens[:n])
        assert m.num_tokens == n and mgr.stats()["restored_bytes_total"] - before == predicted > 0
        m.vtensor.release().result()
        fill_pool(sp)
    assert_pool_consistent(mgr)


def test_a_record_through_nodes_on_the_host_gives_them_the_recorders_chunks(backend, make_manager):
    """A request that computed a prefix the tree keeps on the host (its match
    found no room to restore it, say) and records it: the nodes take the
    recorder's chunks, which hold the same bytes, and give their blocks back.
    They used to stay on the host, locked by the recorder."""
    mgr, sp, io = setup(make_manager, backend, tier_chunks=16)
    A = [(11 * i + 4) % 103 for i in range(60)]
    record(sp, io, A)
    fill_pool(sp)
    assert on_host(sp) and mgr.stats()["host_tier_used_bytes"] > 0
    record(sp, io, A + [500 + i for i in range(20)])  # computed again, not matched
    st = assert_pool_consistent(mgr)
    assert not on_host(sp) and st["host_tier_used_bytes"] == 0 and st["restores_total"] == 0, st
    m = match(sp, A)
    assert m.num_tokens == len(A) and m.restored_tokens == 0
    io.verify(m.vtensor, A)
    m.vtensor.release().result()
    assert_pool_consistent(mgr)


def test_a_record_ending_inside_a_node_on_the_host_leaves_the_page_it_writes_on_the_host(backend, make_manager):
    mgr, sp, io = setup(make_manager, backend, tier_chunks=16)
    chunk = chunk_for(backend)
    row = chunk // 20 + 7
    A = [(13 * i + 6) % 107 for i in range(60)]
    record(sp, io, A)
    fill_pool(sp)
    n = next(k for k in range(30, 60) if k * row % chunk)  # ends mid-page
    vt = sp.create(n).result()
    io.write(vt, A[:n], 0, n)
    sp.prefix_record(vt, A[:n]).result()  # the recorder keeps writing that page
    nodes = {(node["start"], node["end"]): node["on_host"] for node in sp.prefix_nodes()}
    assert nodes[(0, n)] is True and nodes[(n, len(A))] is True, nodes
    vt.extend(n + 5).result()
    io.write(vt, A[:n] + [777] * 5, n, n + 5)  # rows the tree must not see
    assert_pool_consistent(mgr)
    vt.release().result()
    m = match(sp, A)
    assert m.num_tokens == len(A) and m.restored_tokens == len(A)
    io.verify(m.vtensor, A)
    m.vtensor.release().result()
    assert_pool_consistent(mgr)


def test_a_node_too_big_for_the_tier_is_evicted_without_emptying_it(backend, make_manager):
    mgr, sp, io = setup(make_manager, backend, tier_chunks=2)
    small = [[900 + k, 901 + k] for k in range(2)]  # one page each
    for tokens in small:
        record(sp, io, tokens)
    fill_pool(sp)
    assert mgr.stats()["host_tier_used_bytes"] == 2 * chunk_for(backend)
    record(sp, io, list(range(100)))  # 5+ pages: more than the whole tier
    fill_pool(sp)
    st = assert_pool_consistent(mgr)
    assert st["spill_failures_total"] == 1 and st["host_tier_drops_total"] == 0
    assert [n["on_host"] for n in sp.prefix_nodes()] == [True, True]  # the two small ones, kept


def test_clear_prefixes_and_close_give_the_host_memory_back(backend, make_manager):
    mgr, sp, io = setup(make_manager, backend, tier_chunks=16)
    record(sp, io, list(range(60)))
    fill_pool(sp)
    assert mgr.stats()["host_tier_used_bytes"] > 0
    sp.clear_prefixes()
    st = assert_pool_consistent(mgr)
    assert st["host_tier_used_bytes"] == 0 and st["host_tier_nodes"] == 0
    record(sp, io, list(range(60)))
    fill_pool(sp)
    mgr.close()  # with nodes on the host


def test_a_window_prefix_spills_with_its_holes_and_comes_back_byte_for_byte(backend, make_manager):
    """A window space's prefix (holes below its window) goes to the host tier
    with the pages it holds only, and a match of it restores them: the rows
    under its window are the recorded bytes. Without a tier it is lost."""
    chunk = chunk_for(backend)
    mgr, sp, io = window_setup(make_manager, backend)
    row = sp.row_bytes
    A = [(7 * i + 3) % 101 for i in range(100)]
    record_window(sp, io, A, low=70)
    held = -(-100 * row // chunk) - 70 * row // chunk  # pages from the one holding row 70 on
    fill_pool(sp)
    st = assert_pool_consistent(mgr)
    assert st["spills_total"] == 1 and st["host_tier_used_bytes"] == held * chunk, st
    assert [n["on_host"] for n in sp.prefix_nodes()] == [True]
    # prefix_nodes tells the pages the host holds from the holes: every page is None on the host.
    pages = -(-100 * row // chunk)
    assert sp.prefix_nodes()[0]["host_pages"] == [p >= 70 * row // chunk for p in range(pages)]
    m = match(sp, A)
    first = (100 - 30 + 1) * row // chunk  # the page holding the window's first row
    assert m.num_tokens == len(A) and m.restored_tokens == len(A)
    assert m.vtensor.low == -(-first * chunk // row)
    io.verify(m.vtensor, A, m.vtensor.low, len(A))
    st = assert_pool_consistent(mgr)
    # The node was split at the window's first row: the half above it stays
    # on the host with its one page that is no hole, the page that row
    # shares with the row above; the half below is on the device.
    assert st["restored_bytes_total"] == held * chunk and st["host_tier_used_bytes"] == chunk, st
    upper, lower = sp.prefix_nodes()
    assert (upper["end"], upper["on_host"], sum(upper["host_pages"])) == (71, True, 1)
    assert lower["host_pages"] == []  # on the device, where pages says it
    m.vtensor.release().result()

    without = make_manager(backend, chunks=CHUNKS)
    sp = without.create_space(row_bytes=row, max_tokens=200, max_slots=8, window_tokens=30)
    io = RowIO(sp, backend)
    record_window(sp, io, A, low=70)
    fill_pool(sp)
    assert assert_pool_consistent(without)["tree_nodes"] == 0 and match(sp, A).num_tokens == 0


def test_a_window_record_through_a_node_on_the_host_adopts_it_only_where_it_holds_the_nodes_pages(
        backend, make_manager):
    """A record through a window tree's node on the host gives the node its
    chunks only if it holds every page the host does: a recorder that slid
    past some of them leaves the node on the host, as matchable as before."""
    mgr, sp, io = window_setup(make_manager, backend)
    A = [(23 * i + 9) % 89 for i in range(60)]
    record_window(sp, io, A, low=0)  # every page of A
    fill_pool(sp)
    assert [n["on_host"] for n in sp.prefix_nodes()] == [True]
    record_window(sp, io, A + [400 + i for i in range(40)], low=70)  # holds none of A's pages
    st = assert_pool_consistent(mgr)
    assert [(n["start"], n["end"], n["on_host"]) for n in sp.prefix_nodes()] == [(0, 60, True), (60, 100, False)]
    assert st["restores_total"] == 0 and st["host_tier_used_bytes"] > 0
    m = match(sp, A)  # still there: restored
    assert m.num_tokens == len(A) and m.restored_tokens == len(A)
    io.verify(m.vtensor, A, m.vtensor.low, len(A))
    m.vtensor.release().result()
    fill_pool(sp)
    record_window(sp, io, A + [600 + i for i in range(10)], low=0)  # holds them all: adopted
    st = assert_pool_consistent(mgr)
    assert not sp.prefix_nodes()[0]["on_host"] and st["restores_total"] == 1, st
    m = match(sp, A)
    assert m.num_tokens == len(A) and m.restored_tokens == 0
    io.verify(m.vtensor, A, m.vtensor.low, len(A))
    m.vtensor.release().result()
    assert_pool_consistent(mgr)


def test_a_window_record_ending_in_a_page_a_node_on_the_host_keeps_still_fills_that_nodes_holes(
        backend, make_manager):
    """The recorder writes on in the page its record ends in, and a node on
    the host keeps that page: the tree takes a copy of it, so the record can
    still adopt the node, and the pages the node lacked (below an earlier
    recorder's low mark) join the tree. Without the copy the node stayed on
    the host with its holes, and a shorter match found nothing."""
    mgr, sp, io = window_setup(make_manager, backend)
    row = sp.row_bytes
    A = [(29 * i + 8) % 83 for i in range(60)]
    assert 60 * row % chunk_for(backend)  # the record ends inside a page
    record_window(sp, io, A, low=50)  # holds the pages from row 50's on
    fill_pool(sp)
    assert match(sp, A[:40]).num_tokens == 0  # its window is in the holes
    record_window(sp, io, A, low=0)  # computed again, every page held
    st = assert_pool_consistent(mgr)
    assert [n["on_host"] for n in sp.prefix_nodes()] == [False] and st["host_tier_used_bytes"] == 0, st
    m = match(sp, A[:40])
    assert m.num_tokens == 40 and m.restored_tokens == 0
    io.verify(m.vtensor, A, m.vtensor.low, 40)
    m.vtensor.release().result()
    assert_pool_consistent(mgr)


def test_a_window_match_restores_only_the_nodes_its_window_needs(backend, make_manager):
    """A node on the host whose pages all lie below the match's window stays
    there: the match neither copies nor counts it, and without any budget
    it still maps the window the device holds. (The match restored every
    node of the path on the host, and without room or budget cut itself
    at the highest of them: to nothing.)"""
    mgr, sp, io = window_setup(make_manager, backend)
    A = [(23 * i + 9) % 89 for i in range(60)]
    B = A + [400 + i for i in range(40)]
    record_window(sp, io, A, low=0)
    fill_pool(sp)
    record_window(sp, io, B, low=70)  # leaves [0, 60) on the host, above [60, 100) on the device
    assert [(n["start"], n["end"], n["on_host"]) for n in sp.prefix_nodes()] == [(0, 60, True), (60, 100, False)]
    assert sp.prefix_restore_bytes(B + [SENTINEL]) == 0
    for budget in (0, None):
        m = sp.prefix_match(B + [SENTINEL], max_restore_bytes=budget).result()
        assert m.num_tokens == len(B) and m.restored_tokens == 0
        io.verify(m.vtensor, B, m.vtensor.low, len(B))
        m.vtensor.release().result()
    st = assert_pool_consistent(mgr)
    assert st["restores_total"] == 0 and sp.prefix_nodes()[0]["on_host"], st


def test_a_window_match_restores_a_node_only_from_its_windows_first_row(backend, make_manager):
    """A node on the host that the match's window begins inside is split at
    the window's first row, and only the lower half (the pages the window
    needs) comes back. It used to come back whole: pages the match never
    maps, which its lock then kept on the device for as long as it lived,
    so that a request could find no room beside its own match."""
    chunk = chunk_for(backend)
    mgr, sp, io = window_setup(make_manager, backend, window=30)
    A = [(7 * i + 3) % 101 for i in range(100)]
    record_window(sp, io, A, low=0)  # recorded whole: pages 0-5
    fill_pool(sp)
    assert [(n["start"], n["end"], n["on_host"]) for n in sp.prefix_nodes()] == [(0, 100, True)]
    window_pages = 6 - sp.row_bytes * 71 // chunk  # rows 71-99: pages 3-5
    assert sp.prefix_restore_bytes(A + [SENTINEL]) == window_pages * chunk
    m = match(sp, A)
    assert m.num_tokens == m.restored_tokens == len(A)
    io.verify(m.vtensor, A, m.vtensor.low, len(A))
    assert [(n["start"], n["end"], n["on_host"]) for n in sp.prefix_nodes()] == [(0, 71, True), (71, 100, False)]
    st = assert_pool_consistent(mgr)
    assert st["restored_bytes_total"] == window_pages * chunk and st["chunks_in_tree"] == window_pages, st
    # The pool holds the match's window and room for the rest.
    fill_pool(sp)
    io.verify(m.vtensor, A, m.vtensor.low, len(A))
    m.vtensor.release().result()
    assert_pool_consistent(mgr)


def test_a_short_window_record_into_a_node_on_the_host_adopts_the_upper_half_it_splits_off(backend, make_manager):
    """A record ending inside a node on the host splits it and adopts the
    upper half, which the record holds though it holds none of the lower
    half's pages: the copy of the page it writes next is taken for the half,
    not refused for the whole node (found by the stateful test)."""
    mgr, sp, io = window_setup(make_manager, backend)
    A = [(31 * i + 5) % 71 for i in range(100)]
    record_window(sp, io, A, low=70)  # the last three pages only
    fill_pool(sp)
    record_window(sp, io, A[:10], low=0)  # ends inside page 0, a hole of the node on the host
    st = assert_pool_consistent(mgr)
    assert [(n["start"], n["end"], n["on_host"]) for n in sp.prefix_nodes()] == [(0, 10, False), (10, 100, True)]
    m = match(sp, A[:10])
    assert m.num_tokens == 10 and m.restored_tokens == 0
    io.verify(m.vtensor, A, 0, 10)
    m.vtensor.release().result()
    assert_pool_consistent(mgr)


def test_a_window_record_that_cannot_adopt_a_node_on_the_host_takes_no_copy(backend, make_manager):
    """A recorder that slid past some of the pages a node on the host keeps
    cannot adopt it: the page it writes next is then nobody's to copy, and
    on a full pool the record still succeeds."""
    mgr, sp, io = window_setup(make_manager, backend)
    A = [(29 * i + 8) % 83 for i in range(60)]
    record_window(sp, io, A, low=0)
    fill_pool(sp)
    vt = sp.create(60).result()
    io.write(vt, A, 0, 60)
    vt.extend(60, low=50).result()  # holds the last two pages of A's four
    held = []
    while True:
        try:
            held.append(sp.create(1).result())
        except vtm.OutOfMemory:
            break
    copies = mgr.stats()["cow_copies_total"]
    assert sp.prefix_record(vt, A).result() == 0
    st = assert_pool_consistent(mgr)
    assert st["cow_copies_total"] == copies and sp.prefix_nodes()[0]["on_host"], st
    for v in held + [vt]:
        v.release().result()
    assert_pool_consistent(mgr)


def window_node_on_the_host_above_one_on_the_device(make_manager, backend):
    """Tier account 1's window prefix A (rows 0-60) spilled, then B = A + 40
    tokens recorded by a vTensor that slid past A's pages: it cannot adopt
    A's node, which stays on the host above B's node on the device."""
    mgr, sp, io = window_setup(make_manager, backend, tier_account=1)
    A = [(23 * i + 9) % 89 for i in range(60)]
    B = A + [400 + i for i in range(40)]
    record_window(sp, io, A, low=0)
    fill_pool(sp)
    record_window(sp, io, B, low=70)
    assert [(n["start"], n["end"], n["on_host"]) for n in sp.prefix_nodes()] == [(0, 60, True), (60, 100, False)]
    return mgr, sp, io, A, B


def test_a_lowered_limit_drops_a_window_node_on_the_host_above_nodes_on_the_device(backend, make_manager):
    """A window tree's node on the host that a record could not adopt sits
    above that record's node on the device: never a leaf, it kept its
    account above a lowered limit, and the full tier could not take its
    blocks back. It now gives them up and stays in the tree as holes; the
    prefix below it still serves its window."""
    chunk = chunk_for(backend)
    mgr, sp, io, A, B = window_node_on_the_host_above_one_on_the_device(make_manager, backend)
    mgr.set_host_tier_limit(1, chunk)
    st = assert_pool_consistent(mgr)
    assert st["host_tier_accounts"][1]["used_bytes"] == 0 and st["host_tier_limit_drops_total"] == 1, st
    assert [(n["start"], n["end"], n["on_host"], set(n["pages"])) for n in sp.prefix_nodes()][0] == (0, 60, False, {None})
    m = match(sp, B)
    assert m.num_tokens == len(B) and m.restored_tokens == 0
    io.verify(m.vtensor, B, m.vtensor.low, len(B))
    m.vtensor.release().result()
    assert match(sp, A[:40]).num_tokens == 0  # its window was on the host
    assert_pool_consistent(mgr)


def test_a_window_node_on_the_host_that_a_live_match_locks_is_not_dropped(backend, make_manager):
    """The same node, while a match of the prefix through it lives: the path
    is locked, and a match restoring a locked path may wait for memory
    without the manager's lock and read the blocks after. A lowered limit
    leaves it until the match is released, and then takes it at once: the
    account used to stay above its limit until the limit next changed."""
    chunk = chunk_for(backend)
    mgr, sp, io, A, B = window_node_on_the_host_above_one_on_the_device(make_manager, backend)
    live = match(sp, B)
    assert live.num_tokens == len(B) and sp.prefix_nodes()[0]["on_host"] and sp.prefix_nodes()[0]["locks"] == 1
    mgr.set_host_tier_limit(1, chunk)
    st = assert_pool_consistent(mgr)
    assert sp.prefix_nodes()[0]["on_host"] and st["host_tier_accounts"][1]["used_bytes"] > chunk, st
    live.vtensor.release().result()
    st = assert_pool_consistent(mgr)
    assert not sp.prefix_nodes()[0]["on_host"] and st["host_tier_accounts"][1]["used_bytes"] == 0, st


def test_bad_host_tier_sizes_are_refused(backend):
    chunk = chunk_for(backend)
    with pytest.raises(vtm.InvalidArgument, match="host_tier_bytes"):
        vtm.Manager(backend=backend, capacity_bytes=4 * chunk, chunk_bytes=chunk, host_tier_bytes=chunk + 1,
                    **({"granularity": min(chunk, 64 << 10)} if backend == "host" else {}))
    with pytest.raises(vtm.InvalidArgument, match="host_tier_bytes"):
        vtm.Manager(backend=backend, capacity_bytes=4 * chunk, chunk_bytes=chunk, host_tier_bytes=-chunk)


def test_an_account_at_its_limit_drops_its_own_prefixes_and_not_another_accounts(backend, make_manager):
    """Two tenants share a tier with room for two prefixes. Without limits,
    tenant A's second spill would drop tenant B's prefix (the least recently
    used); with A limited to one prefix's pages, A's spill drops A's own."""
    chunk = chunk_for(backend)
    row = chunk // 20 + 7
    pages = -(-40 * row // chunk)
    mgr = make_manager(backend, chunks=CHUNKS, host_tier_bytes=2 * pages * chunk)
    a = mgr.create_space(row_bytes=row, max_tokens=200, max_slots=8, tier_account=1)
    b = mgr.create_space(row_bytes=row, max_tokens=200, max_slots=8, tier_account=2)
    io_a, io_b = RowIO(a, backend), RowIO(b, backend)
    mgr.set_host_tier_limit(1, pages * chunk)
    b0, a0, a1 = ([100 * k + i for i in range(40)] for k in range(3))
    record(b, io_b, b0)  # the least recently used of the three
    record(a, io_a, a0)
    record(a, io_a, a1)
    fill_pool(a)
    st = assert_pool_consistent(mgr)
    assert st["host_tier_limit_drops_total"] == 1 and st["host_tier_drops_total"] == 1, st
    assert st["host_tier_accounts"] == {1: {"used_bytes": pages * chunk, "limit_bytes": pages * chunk},
                                        2: {"used_bytes": pages * chunk, "limit_bytes": None}}
    assert match(a, a0).num_tokens == 0
    for space, io, tokens in ((a, io_a, a1), (b, io_b, b0)):
        m = match(space, tokens)
        assert m.num_tokens == m.restored_tokens == len(tokens)
        io.verify(m.vtensor, tokens)
        m.vtensor.release().result()
    assert_pool_consistent(mgr)


@WINDOWS
def test_matches_that_split_anothers_prefix_on_the_host_cost_its_account_nothing(backend, make_manager, window):
    """Tenant A only reads tenant B's prefix: matches of shorter and shorter
    prefixes of it, each ending inside a page, each restored then spilled
    again. Each match splits B's node on the host, the halves sharing the
    block of the page between them, and restores the upper half; its spill
    used to take a block of its own for that page, charged to B, so that at
    B's limit (its prefix's pages and one spare) the second read dropped B's
    own tail. The half now shares its child's block again. (In a window
    space the reads stay above the holes, below row 20.)"""
    chunk = chunk_for(backend)
    row = chunk // 20 + 7  # ~20 rows a page
    tokens = [7000 + i for i in range(80)]
    pages = -(-len(tokens) * row // chunk)
    # Room for the whole path once the reads have cut it in six nodes, each
    # restoring its own version of the page it starts in.
    mgr = make_manager(backend, chunks=2 * CHUNKS, host_tier_bytes=4 * pages * chunk)
    a, b = (mgr.create_space(row_bytes=row, max_tokens=200, max_slots=8, namespace="ns", name=name,
                             window_tokens=window, tier_account=account) for name, account in (("a", 1), ("b", 2)))
    mgr.set_host_tier_limit(2, (pages + 1) * chunk)
    io_b = RowIO(b, backend)
    record_any(b, io_b, tokens)
    fill_pool(a)
    for end in (75, 70, 65, 55, 52):  # each inside a page
        m = match(a, tokens[:end])
        assert m.num_tokens == end and m.restored_tokens > 0
        m.vtensor.release().result()
        fill_pool(a)
        st = assert_pool_consistent(mgr)
        assert st["host_tier_accounts"][2]["used_bytes"] <= pages * chunk, (end, st)
        assert st["host_tier_limit_drops_total"] == 0, (end, st)
    assert_matches_whole(b, io_b, tokens)
    assert_pool_consistent(mgr)


def test_a_lowered_limit_still_moves_a_node_whose_child_could_lend_it_a_block(backend, make_manager):
    """Account 1 records two turns (a stem, then the stem and more: a node
    and its child, both 1's), account 2 extends the second; all spill. The
    stem must not share its child's block of the page between them: the
    child has 2's prefix below it, and a lowered limit of 1's moves such a
    node to 2, which it cannot with a shared block. It dropped it, and 2's
    prefix with it, when the first version of the sharing allowed it."""
    chunk = chunk_for(backend)
    row = chunk // 20 + 7
    mgr = make_manager(backend, chunks=2 * CHUNKS, host_tier_bytes=4 * CHUNKS * chunk)
    one, two = (mgr.create_space(row_bytes=row, max_tokens=200, max_slots=8, namespace="ns", name=f"s{a}",
                                 tier_account=a) for a in (1, 2))
    io_one, io_two = RowIO(one, backend), RowIO(two, backend)
    stem = [(13 * i + 4) % 97 for i in range(50)]  # row 50 is inside a page
    turn = stem + [300 + i for i in range(30)]
    longer = turn + [600 + i for i in range(40)]
    record(one, io_one, stem)
    record(one, io_one, turn)
    record(two, io_two, longer)
    fill_pool(two)
    assert all(n["on_host"] for n in one.prefix_nodes())
    mgr.set_host_tier_limit(1, chunk - 1)
    st = assert_pool_consistent(mgr)
    assert st["host_tier_limit_drops_total"] == 0 and st["host_tier_accounts"][1]["used_bytes"] == 0, st
    m = match(two, longer)
    assert m.num_tokens == m.restored_tokens == len(longer)
    io_two.verify(m.vtensor, longer)
    m.vtensor.release().result()
    assert_pool_consistent(mgr)


def test_a_node_its_account_has_no_room_for_is_charged_to_the_accounts_below_it(backend, make_manager):
    """Account 2 recorded two stems and is limited to one; account 1 extended
    both stems. Evicting the second stem would drop account 1's prefix below
    it, so the stem's spill is charged to account 1, which has room (it used
    to be evicted with account 1's prefix, a miss caused by another
    account's limit)."""
    chunk = chunk_for(backend)
    row = chunk // 20 + 7
    mgr = make_manager(backend, chunks=16, host_tier_bytes=32 * chunk)
    one = mgr.create_space(row_bytes=row, max_tokens=200, max_slots=8, namespace="ns", name="one", tier_account=1)
    two = mgr.create_space(row_bytes=row, max_tokens=200, max_slots=8, namespace="ns", name="two", tier_account=2)
    io_one, io_two = RowIO(one, backend), RowIO(two, backend)
    stem_pages = -(-40 * row // chunk)
    mgr.set_host_tier_limit(2, stem_pages * chunk + chunk)  # one stem and a bit
    mgr.set_host_tier_limit(1, 16 * chunk)
    stems = [[100 + i for i in range(40)], [300 + i for i in range(40)]]
    longer = [stems[0] + list(range(40)), stems[1] + [500 + i for i in range(40)]]
    for stem, tokens in zip(stems, longer):
        record(two, io_two, stem)
        record(one, io_one, tokens)
    fill_pool(one)
    st = assert_pool_consistent(mgr)
    assert st["spill_failures_total"] == 0, st
    assert st["host_tier_accounts"][2]["used_bytes"] <= stem_pages * chunk + chunk
    for tokens in longer:
        assert_matches_whole(one, io_one, tokens)
    assert_pool_consistent(mgr)


def test_a_lowered_limit_drops_that_accounts_prefixes_at_once(backend, make_manager):
    chunk = chunk_for(backend)
    row = chunk // 20 + 7
    pages = -(-40 * row // chunk)
    mgr = make_manager(backend, chunks=CHUNKS, host_tier_bytes=16 * chunk)
    a = mgr.create_space(row_bytes=row, max_tokens=200, max_slots=8, tier_account=7)
    io = RowIO(a, backend)
    a0, a1 = ([100 * k + i for i in range(40)] for k in range(2))
    record(a, io, a0)
    record(a, io, a1)
    fill_pool(a)
    assert assert_pool_consistent(mgr)["host_tier_accounts"][7] == {"used_bytes": 2 * pages * chunk,
                                                                     "limit_bytes": None}
    mgr.set_host_tier_limit(7, pages * chunk + chunk // 2)  # rounded down to whole chunks
    st = assert_pool_consistent(mgr)
    assert st["host_tier_accounts"][7] == {"used_bytes": pages * chunk, "limit_bytes": pages * chunk}
    assert st["host_tier_limit_drops_total"] == 1
    assert match(a, a0).num_tokens == 0  # the older one went
    m = match(a, a1)
    assert m.restored_tokens == len(a1)
    io.verify(m.vtensor, a1)
    m.vtensor.release().result()
    # Under one chunk: nothing of the account stays on the host, and its
    # next spill evicts (a failed spill) instead.
    mgr.set_host_tier_limit(7, chunk - 1)
    failures = mgr.stats()["spill_failures_total"]
    fill_pool(a)
    st = assert_pool_consistent(mgr)
    assert st["host_tier_used_bytes"] == 0 and st["spill_failures_total"] == failures + 1
    assert match(a, a1).num_tokens == 0
    mgr.set_host_tier_limit(7, 0)  # no limit again
    assert 7 not in mgr.stats()["host_tier_accounts"]


@WINDOWS
@pytest.mark.parametrize("room_below", [True, False], ids=["room-below", "no-room-below"])
def test_a_lowered_limit_takes_back_an_accounts_node_with_another_accounts_prefix_below_it(
        backend, make_manager, window, room_below):
    """Account 1 recorded a stem, account 2 extended it, and both spilled.
    The stem is never a leaf, so a lowered limit for account 1 could not
    drop it: account 1 stayed above its limit for as long as account 2's
    prefix lived. Now, as a spill would, the stem goes to account 2 if it
    has room, and both prefixes stay; else the stem's bytes are dropped: in
    a whole-prefix tree with account 2's prefix (no match reaches it without
    the stem), in a window tree as holes, account 2's prefix still serving
    its window."""
    chunk = chunk_for(backend)
    row = chunk // 20 + 7
    mgr = make_manager(backend, chunks=16, host_tier_bytes=32 * chunk)
    one, two = (mgr.create_space(row_bytes=row, max_tokens=200, max_slots=8, namespace="ns", name=f"s{a}",
                                 window_tokens=window, tier_account=a) for a in (1, 2))
    io_one, io_two = RowIO(one, backend), RowIO(two, backend)
    stem = [(13 * i + 4) % 97 for i in range(40)]
    longer = stem + [600 + i for i in range(40)]
    record(one, io_one, stem)
    record(two, io_two, longer)
    fill_pool(two)
    st = assert_pool_consistent(mgr)
    used = {a: st["host_tier_accounts"][a]["used_bytes"] for a in (1, 2)}
    assert used[1] > 0 and used[2] > 0, st
    if not room_below:
        mgr.set_host_tier_limit(2, used[2])  # full
    mgr.set_host_tier_limit(1, chunk - 1)  # under one chunk: nothing
    st = assert_pool_consistent(mgr)
    assert st["host_tier_accounts"].get(1, {}).get("used_bytes", 0) == 0, st
    if room_below:
        assert st["host_tier_accounts"][2]["used_bytes"] == used[1] + used[2]
        assert st["host_tier_limit_drops_total"] == 0, st
        m = match(two, longer)
        assert m.num_tokens == len(longer)
        io_two.verify(m.vtensor, longer, m.vtensor.low, len(longer))
        m.vtensor.release().result()
        m = match(one, stem)  # account 2 pays for it now; any space of the namespace matches it
        assert m.num_tokens == len(stem)
        io_one.verify(m.vtensor, stem, m.vtensor.low, len(stem))
        m.vtensor.release().result()
    else:
        assert st["host_tier_limit_drops_total"] == 1, st
        assert match(one, stem).num_tokens == 0
        m = match(two, longer)
        if window:
            assert m.num_tokens == len(longer) and m.restored_tokens == len(longer) - len(stem)
            io_two.verify(m.vtensor, longer, m.vtensor.low, len(longer))
            m.vtensor.release().result()
        else:
            assert m.num_tokens == 0 and st["host_tier_accounts"][2]["used_bytes"] == 0, st
    assert_pool_consistent(mgr)


def test_an_account_is_unused_only_when_no_space_and_no_prefix_uses_it(backend, make_manager):
    """unused_host_tier_accounts (a broker's way to bound its per-name
    accounts) names an account only when no open space records into it and
    no prefix, on the device or the host, is charged to it; never 0, each
    once; a bad number is refused. It changes nothing (limits stay)."""
    chunk = chunk_for(backend)
    mgr = make_manager(backend, chunks=CHUNKS, host_tier_bytes=4 * chunk)
    row = chunk // 20 + 7
    recorder = mgr.create_space(row_bytes=row, max_tokens=200, max_slots=8, namespace="ns", tier_account=1)
    other = mgr.create_space(row_bytes=row, max_tokens=200, max_slots=8, namespace="ns", tier_account=2)
    for account in (1, 2, 3):
        mgr.set_host_tier_limit(account, 4 * chunk)
    with pytest.raises(vtm.InvalidArgument, match="tier_account"):
        mgr.unused_host_tier_accounts([3, 1 << 32])
    assert mgr.unused_host_tier_accounts([0, 1, 2, 3, 3, 4]) == [3, 4]  # 1 and 2 have open spaces
    io = RowIO(recorder, backend)
    record(recorder, io, list(range(40)))
    recorder.close()
    assert mgr.unused_host_tier_accounts([1, 2]) == []  # 1's prefix is in the tree, on the device
    fill_pool(other)
    assert on_host(other), "the prefix spilled to the host"
    assert mgr.unused_host_tier_accounts([1]) == []  # and on the host now
    other.clear_prefixes()
    assert mgr.unused_host_tier_accounts([1, 2]) == [1]
    assert sorted(mgr.stats()["host_tier_accounts"]) == [1, 2, 3]
    mgr.check()


def test_vtmd_keeps_an_account_a_session_took_while_it_looked_for_idle_ones(backend, make_manager):
    """vtmd looks for idle accounts in a walk of the trees, not under its
    own lock. A session of an idle name that comes, records a prefix and
    goes while the walk runs has charged the account the walk found unused:
    it must stay that name's, with its limit, not be freed and given to the
    next new name (which would then carry the prefix's bytes)."""
    from vtm.broker.quota import Quota, Quotas
    from vtm.broker.service import BrokerService

    chunk = chunk_for(backend)
    mgr = make_manager(backend, chunks=CHUNKS, host_tier_bytes=8 * chunk)
    row = chunk // 20 + 7
    watcher = mgr.create_space(row_bytes=row, max_tokens=200, max_slots=8, namespace="ns")

    class Walking:
        def __init__(self, manager):
            self._manager = manager

        def __getattr__(self, name):
            return getattr(self._manager, name)

        def unused_host_tier_accounts(self, accounts):
            unused = self._manager.unused_host_tier_accounts(accounts)
            session = SimpleNamespace(name="k", lease="k-lease")
            with service._mu:
                service._sessions[session.lease] = session  # Hello
            with service._tier_account("k") as account:  # CreateSpace
                space = self._manager.create_space(row_bytes=row, max_tokens=200, max_slots=8, namespace="ns",
                                                   tier_account=account)
            record(space, RowIO(space, backend), list(range(40)))
            with service._mu:
                del service._sessions[session.lease]  # goodbye
            space.close()
            return unused

    quotas = Quotas(mgr.capacity_bytes, default=Quota(host_tier_limit_bytes=4 * chunk))
    service = BrokerService(Walking(mgr), backend, 0, "", None, quotas, max_sessions=2)
    try:
        with service._tier_account("k") as k, service._tier_account("x"):
            pass
        service._apply_tier_limit("n")  # a third name: the walk, with k's whole session in it
        assert service._tier_accounts == {"k": k, "n": service._tier_accounts["n"]}
        fill_pool(watcher)  # k's prefix spills, charged to k's account
        accounts = mgr.stats()["host_tier_accounts"]
        assert accounts[k] == {"used_bytes": 3 * chunk, "limit_bytes": 4 * chunk}, accounts
        m = service._apply_tier_limit("m")
        assert m != k and mgr.stats()["host_tier_accounts"][m]["used_bytes"] == 0
    finally:
        service.close_all()
    mgr.check()


def test_bad_tier_accounts_and_limits_are_refused(backend, make_manager):
    chunk = chunk_for(backend)
    mgr = make_manager(backend, chunks=CHUNKS, host_tier_bytes=4 * chunk)
    for account in (-1, 1 << 32):
        with pytest.raises(vtm.InvalidArgument, match="tier_account"):
            mgr.create_space(row_bytes=64, max_tokens=10, max_slots=1, tier_account=account)
        with pytest.raises(vtm.InvalidArgument, match="tier_account"):
            mgr.set_host_tier_limit(account, chunk)
    with pytest.raises(vtm.InvalidArgument, match="account 0"):
        mgr.set_host_tier_limit(0, chunk)
    with pytest.raises(vtm.InvalidArgument, match="bytes"):
        mgr.set_host_tier_limit(1, -1)
    assert mgr.stats()["host_tier_accounts"] == {}
    without = make_manager(backend, chunks=CHUNKS)
    with pytest.raises(vtm.FailedPrecondition, match="no host tier"):
        without.set_host_tier_limit(1, chunk)


def random_step(rng, sp, io, stems, live, step):
    """One random record, match (its bytes checked), release or pool fill
    on `sp`; tokens start with one of `stems`. `live`: the matched vTensors
    held (all released when the pool runs out)."""
    roll = rng.random()
    stem = stems[rng.integers(len(stems))]
    tokens = stem[:int(rng.integers(5, 25))] + [int(t) for t in rng.integers(0, 50, int(rng.integers(0, 30)))]
    try:
        if roll < 0.35:
            record(sp, io, tokens)
        elif roll < 0.75:
            m = match(sp, tokens)
            if m.num_tokens:
                io.verify(m.vtensor, tokens, 0, m.num_tokens, what=f"step {step}")
                live.append(m.vtensor)
        elif roll < 0.9 and live:
            live.pop(int(rng.integers(len(live)))).release().result()
        else:
            fill_pool(sp)
    except vtm.OutOfMemory:
        while live:
            live.pop().release().result()


@pytest.mark.parametrize("ahead", [False, True], ids=["on_demand", "spilling_ahead"])
def test_random_records_matches_and_pressure_never_return_stale_bytes(backend, make_manager, ahead):
    """A random mix of records, matches, releases and pool-filling over a
    small pool and a smaller tier: every match returns the pattern of its
    own tokens, and the invariants hold after every step. `ahead`: the
    refill thread spills ahead too, its copies slowed so that operations
    overlap them."""
    rng = np.random.default_rng(11 if ahead else 7)
    mgr, sp, io = setup(make_manager, backend, tier_chunks=6, spill_ahead_bytes=3 * chunk_for(backend) if ahead else 0,
                        faults=ahead)
    if ahead:
        mgr.faults.delay("copy_to_host", 0.002)
    stems = [[1000 * k + i for i in range(25)] for k in range(4)]
    live = []
    for step in range(120):
        random_step(rng, sp, io, stems, live, step)
        mgr.check()
    st = assert_pool_consistent(mgr)
    assert st["spills_total"] > 0 and st["restores_total"] > 0, st
    assert st["spills_ahead_total"] > 0 if ahead else st["host_tier_drops_total"] > 0, st


def test_random_work_of_two_accounts_in_one_tree_keeps_each_within_its_limit(backend, make_manager):
    """Two spaces of one namespace charged to two accounts, one of them
    limited: nodes of both accounts share paths and split each other's. Every
    match returns its own tokens' bytes, the limited account never holds more
    than its limit, and the invariants (blocks charged per account) hold."""
    rng = np.random.default_rng(11)
    chunk = chunk_for(backend)
    row = chunk // 20 + 7
    mgr = make_manager(backend, chunks=CHUNKS, host_tier_bytes=8 * chunk)
    spaces = [mgr.create_space(row_bytes=row, max_tokens=200, max_slots=8, namespace="shared", name=f"s{a}",
                               tier_account=a) for a in (1, 2)]
    ios = [RowIO(sp, backend) for sp in spaces]
    mgr.set_host_tier_limit(1, 3 * chunk)
    stems = [[1000 * k + i for i in range(25)] for k in range(3)]
    live = []
    for step in range(150):
        k = int(rng.integers(2))
        random_step(rng, spaces[k], ios[k], stems, live, step)
        mgr.check()
        used = mgr.stats()["host_tier_accounts"].get(1, {}).get("used_bytes", 0)
        assert used <= 3 * chunk, f"step {step}: account 1 holds {used} bytes"
    st = assert_pool_consistent(mgr)
    assert st["spills_total"] > 0 and st["restores_total"] > 0 and st["host_tier_limit_drops_total"] > 0, st


def test_through_vtmd_one_client_restores_what_another_recorded_and_the_broker_spilled(tmp_path, spawn, backend,
                                                                                       capsys):
    """vtmd --host-tier-bytes: the tier is the broker's. A writer process
    records a prefix and leaves; the reader fills the pool (the broker spills
    the prefix), then matches it: the broker restores it, and the reader
    maps the restored chunks and reads the writer's bytes."""
    import multiprocessing

    from broker_testing import CHUNK as BROKER_CHUNK
    from broker_testing import ROW, BrokerProcess, RowView, child_record, pattern

    ctx = multiprocessing.get_context("spawn")
    chunk, row = (BROKER_CHUNK, ROW) if backend == "host" else (2 << 20, 20000)
    b = BrokerProcess(tmp_path, capacity_chunks=16, chunk_bytes=chunk, backend=backend,
                      extra_args=["--host-tier-bytes", str(32 * chunk)])
    try:
        q, go_on, done = ctx.Queue(), ctx.Event(), ctx.Event()
        tokens = list(range(100, 400))  # 300 rows: several pages
        writer = spawn(child_record, b.address, tokens, q, go_on, done, row, backend)
        assert q.get(timeout=120)[0] == "recorded"
        with vtm.connect(b.address, name="reader") as mgr:
            # Opened before the writer leaves: a namespace's tree lives while a space of it is open.
            space = mgr.create_space(row_bytes=row, max_tokens=4096, max_slots=8, namespace="shared")
            go_on.set()
            assert q.get(timeout=30) == ("intact", True)
            done.set()
            writer.join(30)
            fill_pool(space)
            stats = mgr.stats()
            assert stats["spills_total"] >= 1 and stats["host_tier_nodes"] >= 1, stats
            on_host = [n for n in space.prefix_nodes() if n["on_host"]]
            assert on_host and all(n["host_pages"] == [True] * len(n["pages"]) for n in on_host), on_host
            match = space.prefix_match(tokens + [7]).result()
            assert match.num_tokens == match.restored_tokens == len(tokens)
            got = RowView(space, backend).read(match.vtensor.slot, 0, len(tokens) * row)
            assert (got == pattern(tokens, row)).all()
            assert mgr.stats()["restores_total"] == 1
            match.vtensor.release().result()
        from vtm.broker import ctl

        capsys.readouterr()
        assert ctl.main(["--address", b.address, "stats"]) == 0
        assert "host tier:" in capsys.readouterr().out  # vtmctl stats and top show the tier
    finally:
        b.kill()


def test_vtmd_spills_ahead_and_a_client_restores_the_bytes(tmp_path, backend):
    """vtmd --spill-ahead-bytes: the broker spills a client's recorded prefix
    in the background once its pool has less than that much free; the
    client's match restores it byte for byte. Without a tier, vtmd refuses
    the flag in one line."""
    from broker_testing import CHUNK as BROKER_CHUNK
    from broker_testing import ROW, BrokerProcess, RowView, pattern

    chunk, row = (BROKER_CHUNK, ROW) if backend == "host" else (2 << 20, 20000)
    b = BrokerProcess(tmp_path, capacity_chunks=8, chunk_bytes=chunk, backend=backend,
                      extra_args=["--host-tier-bytes", str(16 * chunk), "--spill-ahead-bytes", str(4 * chunk)])
    try:
        with vtm.connect(b.address, name="client") as mgr:
            space = mgr.create_space(row_bytes=row, max_tokens=4096, max_slots=4)
            tokens = list(range(100, 100 + 5 * chunk // row))  # five pages of eight: less than four free
            vt = space.create(len(tokens)).result()
            RowView(space, backend).write(vt.slot, 0, pattern(tokens, row))
            space.prefix_record(vt, tokens).result()
            vt.release().result()
            assert wait_for(lambda: mgr.stats()["spills_ahead_total"] >= 1)
            stats = mgr.stats()  # one reading: a spill ahead may land between two
            assert stats["spills_total"] == stats["spills_ahead_total"]
            match = space.prefix_match(tokens + [7]).result()
            assert match.num_tokens == match.restored_tokens == len(tokens)
            got = RowView(space, backend).read(match.vtensor.slot, 0, len(tokens) * row)
            assert (got == pattern(tokens, row)).all()
            match.vtensor.release().result()
    finally:
        b.kill()
    with pytest.raises(RuntimeError, match="--spill-ahead-bytes spills prefixes to the host tier: give --host-tier"):
        BrokerProcess(tmp_path / "no-tier", capacity_chunks=8, chunk_bytes=chunk, backend=backend,
                      extra_args=["--spill-ahead-bytes", str(4 * chunk)])


def _broker_prefix(backend, pages_of_tokens):
    """(chunk, row, tokens, pages) of a prefix that spans `pages_of_tokens` pages of a broker's space."""
    from broker_testing import CHUNK as BROKER_CHUNK
    from broker_testing import ROW

    chunk, row = (BROKER_CHUNK, ROW) if backend == "host" else (2 << 20, 20000)
    n = pages_of_tokens * chunk // row
    return chunk, row, n, -(-n * row // chunk)


def test_through_vtmd_a_client_names_host_tier_limit_keeps_its_spills_off_another_names_prefixes(
        tmp_path, backend, capsys):
    """vtmd's quota file limits client "a" to one prefix's pages of a tier
    with room for two. "b" recorded first (its prefix is the least recently
    used), then "a" recorded two; when the pool spills all three, a's
    second spill drops a's first, and b's prefix comes back byte for byte."""
    from broker_testing import BrokerProcess, RowView, pattern
    from vtm.broker import ctl

    chunk, row, n, pages = _broker_prefix(backend, 3)
    quota_file = tmp_path / "quotas.toml"
    quota_file.write_text(f'[clients."a"]\nhost_tier_limit_bytes = {pages * chunk}\n')
    b = BrokerProcess(tmp_path, capacity_chunks=16, chunk_bytes=chunk, backend=backend,
                      extra_args=["--host-tier-bytes", str(2 * pages * chunk), "--quota-file", str(quota_file)])
    try:
        with vtm.connect(b.address, name="a") as ma, vtm.connect(b.address, name="b") as mb:
            sa = ma.create_space(row_bytes=row, max_tokens=4096, max_slots=8, namespace="ns-a")
            sb = mb.create_space(row_bytes=row, max_tokens=4096, max_slots=8, namespace="ns-b")
            va, vb = RowView(sa, backend), RowView(sb, backend)
            b0, a0, a1 = ([10000 * k + i for i in range(n)] for k in range(1, 4))
            for space, view, tokens in ((sb, vb, b0), (sa, va, a0), (sa, va, a1)):
                vt = space.create(len(tokens)).result()
                view.write(vt.slot, 0, pattern(tokens, row))
                space.prefix_record(vt, tokens).result()
                vt.release().result()
            fill_pool(sa)
            stats = ma.stats()
            clients = {c["name"]: c for c in stats["clients"]}
            assert clients["a"]["host_tier_bytes"] == clients["a"]["host_tier_limit_bytes"] == pages * chunk
            assert clients["b"]["host_tier_bytes"] == pages * chunk and clients["b"]["host_tier_limit_bytes"] == 0
            assert stats["host_tier_limit_drops_total"] == 1, stats
            assert sa.prefix_match(a0 + [7]).result().num_tokens == 0
            for space, view, tokens in ((sa, va, a1), (sb, vb, b0)):
                m = space.prefix_match(tokens + [7]).result()
                assert m.num_tokens == m.restored_tokens == len(tokens)
                assert (view.read(m.vtensor.slot, 0, len(tokens) * row) == pattern(tokens, row)).all()
                m.vtensor.release().result()
            capsys.readouterr()
            # Fuzzing the tier: a limit was shown as given and enforced in
            # whole chunks (under one chunk: shown, and nothing kept).
            assert ctl.main(["--address", b.address, "set-quota", "z", "--host-tier-limit", str(chunk - 1)]) == 2
            assert "less than one chunk" in capsys.readouterr().err
            assert ctl.main(["--address", b.address, "set-quota", "z", "--host-tier-limit", str(3 * chunk + 5)]) == 0
            assert f"host tier limit {3 * chunk} bytes" in capsys.readouterr().out
            assert ctl.main(["--address", b.address, "set-quota", "a", "--host-tier-limit", "0"]) == 0
            assert "host tier limit 0 bytes" in capsys.readouterr().out
            assert ctl.main(["--address", b.address, "stats"]) == 0
            assert "tier MiB" in capsys.readouterr().out
            assert {c["name"]: c for c in ma.stats()["clients"]}["a"]["host_tier_limit_bytes"] == 0
            # b leaves; a space of a's keeps b's namespace, so b's prefix
            # stays, spills, and is shown under b's name (the rows used not
            # to add up to the tier's use).
            keeper = ma.create_space(row_bytes=row, max_tokens=4096, max_slots=1, namespace="ns-b")
            mb.close()
            fill_pool(sa)
            stats = ma.stats()
            assert stats["tier_names_offline"] == [{"name": "b", "host_tier_bytes": pages * chunk,
                                                    "host_tier_limit_bytes": 0}], stats
            assert stats["host_tier_used_bytes"] == sum(c["host_tier_bytes"] for c in stats["clients"]
                                                        + stats["tier_names_offline"])
            assert ctl.main(["--address", b.address, "stats"]) == 0
            assert any(line.split()[:3] == ["b", "-", "offline"] for line in capsys.readouterr().out.splitlines())
            keeper.close()
            ma.check()
    finally:
        b.kill()


def test_vtmd_forgets_the_tier_accounts_of_names_that_hold_nothing(tmp_path, backend):
    """vtmd keeps a host-tier account per client name. It used to keep each
    for its life: clients under ever new names grew the broker's memory
    without bound. Now a name no session has and no prefix is charged to is
    forgotten, and its account's number reused. A name whose prefix stays in
    the tree keeps its account through the churn, and its spilled bytes are
    charged to it, not to a name given a reused number."""
    from broker_testing import BrokerProcess

    chunk, row, n, pages = _broker_prefix(backend, 2)
    quota_file = tmp_path / "quotas.toml"
    quota_file.write_text(f"[default]\nhost_tier_limit_bytes = {4 * pages * chunk}\n")
    b = BrokerProcess(tmp_path, capacity_chunks=16, chunk_bytes=chunk, backend=backend,
                      extra_args=["--host-tier-bytes", str(8 * pages * chunk), "--quota-file", str(quota_file),
                                  "--max-sessions", "4"])
    kept = [10000 + i for i in range(n)]
    try:
        with vtm.connect(b.address, name="keeper") as keeper:
            space = keeper.create_space(row_bytes=row, max_tokens=4096, max_slots=8, namespace="ns")
            vt = space.create(n).result()
            space.prefix_record(vt, kept).result()
            vt.release().result()
            with vtm.connect(b.address, name="watcher") as watcher:
                watching = watcher.create_space(row_bytes=row, max_tokens=4096, max_slots=8, namespace="ns")
                for i in range(24):
                    with vtm.connect(b.address, name=f"passer-{i}") as passer:
                        passer.create_space(row_bytes=row, max_tokens=4096, max_slots=8, namespace=f"own-{i}")
                        # At most max(--max-sessions, twice the 3 names in use) before a walk.
                        assert passer.stats()["tier_accounts"] <= 6, i
                keeper.close()
                # The keeper's prefix outlived its session: charged to it, it spills to its account.
                with vtm.connect(b.address, name="last") as last:
                    last.create_space(row_bytes=row, max_tokens=4096, max_slots=8, namespace="own-last")
                    fill_pool(watching)
                    with vtm.connect(b.address, name="keeper") as again:
                        again.create_space(row_bytes=row, max_tokens=4096, max_slots=8, namespace="ns")
                        clients = {c["name"]: c for c in again.stats()["clients"]}
                    assert clients["keeper"]["host_tier_bytes"] == pages * chunk, clients
                    assert clients["last"]["host_tier_bytes"] == clients["watcher"]["host_tier_bytes"] == 0
                    assert clients["keeper"]["host_tier_limit_bytes"] == 4 * pages * chunk
                    m = watching.prefix_match(kept + [7]).result()
                    assert m.num_tokens == m.restored_tokens == n
                    m.vtensor.release().result()
                    watcher.check()
    finally:
        b.kill()


def test_vtmd_without_a_tier_refuses_a_host_tier_limit(broker, capsys):
    from vtm.broker import ctl

    assert ctl.main(["--address", broker.address, "set-quota", "a", "--host-tier-limit", "1MiB"]) == 2
    assert "no host tier" in capsys.readouterr().err


def test_through_vtmd_a_match_past_the_clients_limit_restores_nothing(tmp_path, backend):
    """vtmd admits a match as the pages it would restore: a client whose
    limit leaves no room for them gets OutOfMemory before any restore (it
    used to restore first and be refused after, having taken the memory)."""
    from broker_testing import BrokerProcess, RowView, pattern

    chunk, row, n, _ = _broker_prefix(backend, 3)
    quota_file = tmp_path / "quotas.toml"
    quota_file.write_text(f'[clients."a"]\nlimit_bytes = {4 * chunk}\n')
    b = BrokerProcess(tmp_path, capacity_chunks=16, chunk_bytes=chunk, backend=backend,
                      extra_args=["--host-tier-bytes", str(8 * chunk), "--quota-file", str(quota_file)])
    try:
        with vtm.connect(b.address, name="w") as mw, vtm.connect(b.address, name="a") as ma:
            sw = mw.create_space(row_bytes=row, max_tokens=4096, max_slots=8, namespace="shared")
            sa = ma.create_space(row_bytes=row, max_tokens=4096, max_slots=8, namespace="shared")
            tokens = list(range(500, 500 + n))
            vt = sw.create(n).result()
            RowView(sw, backend).write(vt.slot, 0, pattern(tokens, row))
            sw.prefix_record(vt, tokens).result()
            vt.release().result()
            held = sa.create(3 * chunk // row).result()  # 3 of a's 4 chunks
            fill_pool(sw)
            assert any(node["on_host"] for node in sa.prefix_nodes())
            with pytest.raises(vtm.OutOfMemory, match="limited"):
                sa.prefix_match(tokens + [7]).result()
            stats = ma.stats()
            assert stats["restores_total"] == 0 and stats["host_tier_nodes"] >= 1, stats
            held.release().result()
            m = sa.prefix_match(tokens + [7]).result()  # with room now
            assert m.num_tokens == m.restored_tokens == n
            assert (RowView(sa, backend).read(m.vtensor.slot, 0, n * row) == pattern(tokens, row)).all()
            m.vtensor.release().result()
            ma.check()
    finally:
        b.kill()


def test_a_window_parent_the_tier_drops_back_to_the_device_during_a_spill_is_still_spilled_in_turn(
        backend, make_manager):
    """Window tree, a tier of 4 blocks. G = A[:20] on the device (restored by
    a match), H = A[20:60] on the host (a record with a high low mark could
    not adopt it), X = B[60:100] on the device, then C, recorded last. Ticks:
    X = H < G < C. An allocation spills X; to make room, the tier drops H,
    which comes back to the device as holes, behind the walk. The walk must
    still reach H and then G, so C, the most recently used, stays on the
    device (review: the walk went on past H and spilled C)."""
    mgr, sp, io = window_setup(make_manager, backend, tier_chunks=4)
    A = [(23 * i + 9) % 89 for i in range(60)]
    B = A + [400 + i for i in range(40)]
    C = [500 + i for i in range(20)]
    record_window(sp, io, A, low=0)
    fill_pool(sp)
    record_window(sp, io, B, low=70)
    m = match(sp, A[:20])  # splits A's node at 20 and restores [0, 20)
    assert m.num_tokens == 20
    m.vtensor.release().result()
    record_window(sp, io, C, low=0)
    assert [(n["start"], n["end"], n["on_host"]) for n in sp.prefix_nodes()] == [
        (0, 20, False), (20, 60, True), (60, 100, False), (0, 20, False)]
    vt = sp.create(100).result()  # evicts: X, then one more prefix
    mgr.check()

    def node(tokens):
        return next(n for n in sp.prefix_nodes() if n["tokens"] == list(tokens))
    assert node(A[:20])["on_host"], "the least recently used prefix (A[:20]) stayed on the device"
    assert not node(C)["on_host"], "the most recently used prefix (C) spilled before an older one"
    vt.release().result()


def one_conversation_pool(make_manager, backend, sink, **kw):
    """bench_tier's shape (see the test below), three conversations after turn 1."""
    chunk = chunk_for(backend)
    row = chunk * 23040 // (2 << 20)
    history, new, reply = 800, 32, 32
    pool = -(-(history + 2 * (new + reply)) * row // chunk) + 1  # bench_tier's conversation_chunks
    mgr = make_manager(backend, chunks=pool, host_tier_bytes=8 * pool * chunk, prealloc_chunks=0,
                       slot_cache_bytes=0, **kw)
    sp = mgr.create_space(row_bytes=row, max_tokens=1024, max_slots=8)
    io = RowIO(sp, backend)
    held = [sp.create(1).result()] if sink else []
    rng = np.random.default_rng(0)
    record(sp, io, [1, 5, 6, 7])  # the warm-up
    convs = [[1] + rng.integers(3, 30000, history - 1).tolist() for _ in range(3)]
    for conv in convs:  # turn 1: the prompt recorded at its prefill's end, the reply at the turn's
        conv += rng.integers(3, 30000, reply - 1).tolist()
        vt = sp.create(history).result()
        io.write(vt, conv, 0, history)
        sp.prefix_record(vt, conv[:history]).result()
        vt.extend(len(conv)).result()
        io.write(vt, conv, history, len(conv))
        sp.prefix_record(vt, conv).result()
        vt.release().result()
    assert_pool_consistent(mgr)
    turns = [conv + [conv[-1] + 1] + rng.integers(3, 30000, new).tolist() for conv in convs]
    return SimpleNamespace(mgr=mgr, sp=sp, io=io, held=held, history=history, reply=reply, turns=turns)


@pytest.mark.parametrize("sink", [False, True], ids=["host", "cuda_sink"])
def test_a_pool_of_one_conversation_restores_the_next_turns_prefix_as_far_as_it_fits(backend, make_manager, sink):
    """bench_tier's chat on a pool the size of one conversation (its shape:
    8000-token histories, 2 MiB chunks, 23040-byte rows; here 800 tokens,
    ~91 rows a page). The tree keeps [0, 1) (a BOS the engine's warm-up
    shares), the first prompt [1, 800) and the reply [800, 831), each with
    its own copy of the page it starts in; the next turn's match restores
    those nodes and copies its partial last page. That is one chunk more than
    the pool has (the engine's CUDA sink, `sink`, takes another), while the
    turn itself fits: the match used to restore nothing (or restore it all,
    then fail on the copy of its last page, and the engine computed the
    whole prompt after all). It restores as far as fits, and the turn runs."""
    c = one_conversation_pool(make_manager, backend, sink)
    mgr, sp, io, reply = c.mgr, c.sp, c.io, c.reply
    for user, prompt in enumerate(c.turns):  # turn 2
        m = sp.prefix_match(prompt).result()
        assert m.num_tokens >= c.history and m.restored_tokens == m.num_tokens - 1, (user, m.num_tokens)
        io.verify(m.vtensor, prompt, 0, m.num_tokens)
        st = assert_pool_consistent(mgr)
        assert st["restores_total"] == user + 1
        end = len(prompt) + reply - 1  # the prompt computed from the match on, then the reply
        m.vtensor.extend(end).result()
        io.write(m.vtensor, prompt + [9] * reply, m.num_tokens, end)
        io.verify(m.vtensor, prompt + [9] * reply, 0, end)
        sp.prefix_record(m.vtensor, (prompt + [9] * reply)[:end]).result()
        m.vtensor.release().result()
        assert_pool_consistent(mgr)
    for vt in c.held:
        vt.release().result()


def test_a_match_that_restores_then_finds_no_slot_gives_back_its_last_pages_chunk(backend, make_manager):
    """The restore takes the chunk for the match's copy of its last page with
    its own (see above). The restore stands when a later step fails (here:
    every slot holds a live vTensor), but that chunk was the match's: it goes
    back. It used to keep a reference nobody held."""
    c = one_conversation_pool(make_manager, backend, sink=True)
    live = [c.sp.create(0).result() for _ in range(7)]  # with the sink, all 8 slots
    with pytest.raises(vtm.OutOfMemory, match="no free slot"):
        c.sp.prefix_match(c.turns[0]).result()
    assert c.mgr.stats()["restores_total"] == 1
    assert_pool_consistent(c.mgr)
    for vt in live + c.held:
        vt.release().result()
    c.sp.clear_prefixes()
    c.mgr.trim()
    assert c.mgr.stats()["chunks_held"] == 0


def test_the_restores_copy_chunk_may_unpin_as_a_matchs_copy_may(backend, make_manager):
    """The chunk for the match's copy of its last page comes with the
    restore, but from an allocation that may unpin (as the match's own copy
    always could): with 3 free chunks and 1 that only a live vTensor's lock
    keeps, a restore of 3 pages and that copy fits whole. Taken with the
    restore's pages, which may not unpin, it did not, and a shorter part came
    back."""
    chunk = chunk_for(backend)
    mgr = make_manager(backend, chunks=6, host_tier_bytes=32 * chunk, prealloc_chunks=0, slot_cache_bytes=0)
    sp = mgr.create_space(row_bytes=chunk // 4, max_tokens=64, max_slots=8)
    io = RowIO(sp, backend)
    C = list(range(100, 110))  # pages 0 and 1, and a partial page 2
    record(sp, io, C)
    sp.create(24).result().release().result()  # the whole pool: C spills
    assert all(n["on_host"] for n in sp.prefix_nodes())
    Q = list(range(200, 206))
    record(sp, io, Q)
    live = sp.prefix_match(Q + [1]).result().vtensor  # Q's partial page: only the tree and this lock keep it
    m = sp.prefix_match(C + [2]).result()
    assert (m.num_tokens, m.restored_tokens) == (10, 10)
    io.verify(m.vtensor, C)
    assert_pool_consistent(mgr)
    m.vtensor.release().result()
    live.release().result()
    assert_pool_consistent(mgr)


def test_a_copy_back_that_fails_for_want_of_memory_fails_the_match(backend, make_manager):
    """docs/api.md: a failed copy fails the match and changes nothing. One
    that fails with an out-of-memory code (CUDA: mapping the copy scratch
    range) was taken for a pool without room, and the match restored a
    shorter part with a second round of copies."""
    chunk = chunk_for(backend)
    mgr = make_manager(backend, chunks=16, host_tier_bytes=32 * chunk, prealloc_chunks=0, slot_cache_bytes=0,
                       faults=True)
    sp = mgr.create_space(row_bytes=chunk // 4, max_tokens=64, max_slots=8)
    io = RowIO(sp, backend)
    C = list(range(100, 110))
    record(sp, io, C)
    sp.create(64).result().release().result()  # C spills
    before = sp.prefix_nodes()
    assert all(n["on_host"] for n in before)
    mgr.faults.fail_nth("copy_from_host", 1, oom=True)
    with pytest.raises(vtm.BackendError, match="copying a prefix back from the host tier"):
        sp.prefix_match(C + [2]).result()
    assert sp.prefix_nodes() == before and mgr.stats()["restores_total"] == 0
    assert_pool_consistent(mgr)
    mgr.faults.clear()
    m = sp.prefix_match(C + [2]).result()
    assert (m.num_tokens, m.restored_tokens) == (10, 10)
    io.verify(m.vtensor, C)
    m.vtensor.release().result()
    assert_pool_consistent(mgr)


def test_a_failed_copy_of_the_part_that_fits_changes_nothing(backend, make_manager):
    """The shorter restore (the whole one has no room) whose copy fails: the
    match fails, and the tree is as before but for the unlocked nodes the
    restore's allocation spilled to make room (docs/api.md: caches reclaimed
    on the way to a failure of the memory API); the matched path stays on
    the host, unsplit."""
    c = one_conversation_pool(make_manager, backend, sink=True, faults=True)
    before = c.sp.prefix_nodes()
    c.mgr.faults.fail_nth("copy_from_host", 2)
    with pytest.raises(vtm.BackendError):
        c.sp.prefix_match(c.turns[0]).result()
    after = c.sp.prefix_nodes()
    assert len(after) == len(before)
    for b, a in zip(before, after):
        if a != b:  # spilled: the same node, its bytes on the host now
            assert not b["on_host"] and a["on_host"] and a["locks"] == b["locks"] == 0
            assert (a["start"], a["end"], a["tokens"]) == (b["start"], b["end"], b["tokens"])
    path = [n for n in after if n["tokens"] == c.turns[0][n["start"]:n["end"]]]
    assert [(n["start"], n["end"], n["on_host"]) for n in path] == [(0, 1, False), (1, 800, True), (800, 831, True)]
    assert c.mgr.stats()["restores_total"] == 0
    assert_pool_consistent(c.mgr)
    c.mgr.faults.clear()
    m = c.sp.prefix_match(c.turns[0]).result()
    assert m.num_tokens >= c.history and m.restored_tokens == m.num_tokens - 1
    c.io.verify(m.vtensor, c.turns[0], 0, m.num_tokens)
    m.vtensor.release().result()
    for vt in c.held:
        vt.release().result()
    assert_pool_consistent(c.mgr)
