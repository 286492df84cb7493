"""The prefix index's bound (docs/api.md, "The prefix index's bound").

A caller may record the same pages under ever new tokens: each record then
adds a node but no chunk, so the pool's eviction never bounds the tree, and
before the bound a process (or vtmd, for all its clients) grew by each
record's tokens without end. These tests record one vTensor's rows under
twice the budget's worth of distinct sequences and check that the index
stays within its budget, dropping the least recently used prefixes that no
live vTensor locks, and that Manager.check() agrees with its counts.
"""

from vtm_testing import CHUNK, SENTINEL

INDEX_FLOOR = 64 << 20  # Manager::kMinIndexBytes
TOKEN_BYTES = 4


def distinct(i: int, n: int) -> list[int]:
    """The i-th of sequences that share no first token: each a leaf of the root."""
    return list(range(i * n, (i + 1) * n))


def junk_vtensor(mgr, tokens: int):
    space = mgr.create_space(row_bytes=8, max_tokens=tokens, max_slots=4, namespace="junk")
    return space, space.create(tokens).result()


def test_records_of_new_tokens_over_the_same_pages_stay_within_the_budget(make_manager):
    mgr = make_manager(chunks=64)
    st = mgr.stats()
    assert st["index_budget_bytes"] == max(INDEX_FLOOR, st["capacity_bytes"] // 8)
    n = min(1 << 18, 32 * st["chunk_bytes"] // 8)
    space, vt = junk_vtensor(mgr, n)
    records = 2 * st["index_budget_bytes"] // (n * TOKEN_BYTES)
    for i in range(records):
        assert space.prefix_record(vt, distinct(i, n)).result() == n
    st = mgr.stats()
    # The record's own path may keep it above by one record; no more.
    assert st["index_bytes"] <= st["index_budget_bytes"] + n * TOKEN_BYTES + 4096
    assert st["tree_tokens"] * TOKEN_BYTES <= st["index_budget_bytes"] + n * TOKEN_BYTES
    assert st["index_drops_total"] >= records // 2 - 1
    assert st["chunks_in_tree"] == n * 8 // st["chunk_bytes"]  # the same pages all along
    # Least recently used first: the first records went, the last stays.
    assert space.prefix_match(distinct(0, n) + [SENTINEL]).result().vtensor is None
    last = space.prefix_match(distinct(records - 1, n) + [SENTINEL]).result()
    assert last.num_tokens == n
    last.vtensor.release().result()
    mgr.check()


def test_locked_paths_stay_and_the_host_tier_goes_first(make_manager):
    mgr = make_manager(chunks=64, host_tier_bytes=64 * CHUNK)
    row = CHUNK // 4
    kept = mgr.create_space(row_bytes=row, max_tokens=64 * 4, max_slots=4, namespace="kept")
    # A prefix a live vTensor records (its lock), one a live match locks, and
    # one that spills to the host tier: only the last may go.
    recorder = kept.create(8).result()
    kept.prefix_record(recorder, [1] * 8).result()
    matched_vt = kept.create(8).result()
    kept.prefix_record(matched_vt, [2] * 8, release=True).result()
    match = kept.prefix_match([2] * 8 + [SENTINEL]).result()
    assert match.num_tokens == 8
    spilled = kept.create(8).result()
    kept.prefix_record(spilled, [3] * 8, release=True).result()
    filler = kept.create(4 * 59).result()  # 59 pages of the 58 free: the unlocked prefix spills
    assert [nd["on_host"] for nd in kept.prefix_nodes() if nd["tokens"][0] == 3] == [True]
    filler.release().result()
    used_on_host = mgr.stats()["host_tier_used_bytes"]
    assert used_on_host > 0

    n = 1 << 18
    space, vt = junk_vtensor(mgr, n)
    st = mgr.stats()
    for i in range(2 * st["index_budget_bytes"] // (n * TOKEN_BYTES)):
        space.prefix_record(vt, distinct(i + 10, n)).result()
    st = mgr.stats()
    assert st["index_drops_total"] > 0
    assert st["host_tier_used_bytes"] == 0, "the host tier's prefix is the first to go"
    assert kept.prefix_match([1] * 8 + [SENTINEL]).result().num_tokens == 8
    assert kept.prefix_match([2] * 8 + [SENTINEL]).result().num_tokens == 8
    assert kept.prefix_match([3] * 8 + [SENTINEL]).result().vtensor is None
    mgr.check()
    match.vtensor.release().result()
    recorder.release().result()
    mgr.check()
