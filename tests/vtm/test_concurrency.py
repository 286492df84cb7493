"""Concurrency: several Python threads drive one manager at once.

docs/api.md: operations on one vTensor execute in submission order; Future.result
waits without holding the GIL and raises TimeoutError when the timeout passes first.
"""

import collections
import threading
import time

import numpy as np
import pytest

import vtm
from vtm_testing import SCALE, SENTINEL, RowIO, assert_pool_consistent, new_manager

ROW = 3000 * SCALE
MAXT = 64
N_THREADS = 4
OPS_PER_THREAD = 400
BASES = [[b] * 6 + [(b + i) % 4 for i in range(14)] for b in range(3)]  # 20 tokens each


def worker(tid, mgr, spaces, ios, errors, leftovers, kinds):
    rng = np.random.default_rng(1000 + tid)
    live = {}  # vt -> (space index, tokens)
    try:
        for _ in range(OPS_PER_THREAD):
            r = rng.random()
            mine = sorted(live, key=lambda v: v.id)
            if r < 0.2 or not mine:
                if len(live) >= 6:
                    continue
                si = int(rng.integers(0, len(spaces)))
                if rng.random() < 0.5:
                    base = BASES[int(rng.integers(0, len(BASES)))]
                    toks = base[:int(rng.integers(0, 21))]
                else:
                    toks = []
                toks = toks + [int(x) for x in rng.integers(0, 4, int(rng.integers(0, 20)))]
                vt = spaces[si].create(len(toks)).result()
                assert vt.num_tokens == len(toks)
                ios[si].write(vt, toks, 0, len(toks))
                live[vt] = (si, toks)
                kinds['create'] += 1
            elif r < 0.4:
                vt = mine[int(rng.integers(0, len(mine)))]
                si, toks = live[vt]
                n = min(MAXT, len(toks) + int(rng.integers(0, 12)))
                vt.extend(n).result()
                assert vt.num_tokens == n
                new = toks + [int(x) for x in rng.integers(0, 4, n - len(toks))]
                ios[si].write(vt, new, len(toks), n)
                live[vt] = (si, new)
                kinds['extend'] += 1
            elif r < 0.5:
                pick = [mine[i] for i in sorted(set(rng.integers(0, len(mine), 3).tolist()))]
                req = {vt: min(MAXT, len(live[vt][1]) + int(rng.integers(0, 8))) for vt in pick}
                mgr.step(req).result()
                for vt, n in req.items():
                    si, toks = live[vt]
                    assert vt.num_tokens == n
                    new = toks + [int(x) for x in rng.integers(0, 4, n - len(toks))]
                    ios[si].write(vt, new, len(toks), n)
                    live[vt] = (si, new)
                kinds['step'] += 1
            elif r < 0.65:
                vt = mine[int(rng.integers(0, len(mine)))]
                si, toks = live[vt]
                if toks:
                    k = int(rng.integers(1, len(toks) + 1))
                    got = spaces[si].prefix_record(vt, toks[:k]).result()
                    assert 0 <= got <= k
                    kinds['record'] += 1
            elif r < 0.85:
                if len(live) >= 6:
                    continue
                si = int(rng.integers(0, len(spaces)))
                base = BASES[int(rng.integers(0, len(BASES)))]
                q = base + [int(x) for x in rng.integers(0, 4, int(rng.integers(0, 10)))]
                m = spaces[si].prefix_match(q).result()
                # the bases were recorded before the threads started and nothing evicts
                assert m.num_tokens >= min(len(base), len(q) - 1), (q, m.num_tokens)
                assert m.num_tokens <= len(q) - 1
                vt = m.vtensor
                assert vt.num_tokens == m.num_tokens
                ios[si].verify(vt, q, 0, m.num_tokens, what=f"thread {tid} match:")
                live[vt] = (si, list(q[:m.num_tokens]))
                kinds['match'] += 1
            else:
                vt = mine[int(rng.integers(0, len(mine)))]
                vt.release().result()
                assert vt.released
                del live[vt]
                kinds['release'] += 1
            # my own rows never change under me
            if rng.random() < 0.3:
                for vt, (si, toks) in live.items():
                    ios[si].verify(vt, toks, what=f"thread {tid}:")
    except BaseException as e:  # noqa: BLE001 - reported by the main thread
        errors.append((tid, e))
    leftovers.append(live)


def run_threads(threads, errors):
    """Starts and joins `threads`; raises the first error a thread put in `errors` as (tid, exception)."""
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    if errors:
        raise errors[0][1]


@pytest.mark.parametrize("workers", [1, 3])
def test_threads_share_a_manager(workers):
    mgr = new_manager(chunks=2048, workers=workers)
    try:
        spaces = [mgr.create_space(row_bytes=ROW, max_tokens=MAXT, max_slots=32, namespace="m")
                  for _ in range(2)]
        ios = [RowIO(s) for s in spaces]
        for b in BASES:
            vt = spaces[0].create(len(b)).result()
            ios[0].write(vt, b, 0, len(b))
            spaces[0].prefix_record(vt, b).result()
            vt.release().result()
        errors, leftovers = [], []
        kinds = collections.Counter()
        run_threads([threading.Thread(target=worker, args=(t, mgr, spaces, ios, errors, leftovers, kinds))
                     for t in range(N_THREADS)], errors)
        for k in ('create', 'extend', 'step', 'record', 'match', 'release'):
            assert kinds[k] >= 20, kinds
        mgr.check()
        st = assert_pool_consistent(mgr)
        n_live = sum(len(l) for l in leftovers)
        assert sum(d["vtensors"] for d in st["spaces"].values()) == n_live
        for live in leftovers:
            for vt, (si, toks) in live.items():
                ios[si].verify(vt, toks, what="after threads:")
        # the shared bases still match with exact bytes
        for b in BASES:
            m = spaces[1].prefix_match(b + [SENTINEL]).result()
            assert m.num_tokens >= len(b)
            ios[1].verify(m.vtensor, b, 0, len(b))
            m.vtensor.release().result()
        for live in leftovers:
            for vt in live:
                vt.release().result()
        spaces[0].clear_prefixes()
        mgr.trim()
        st = mgr.stats()
        assert st["chunks_created"] == 0 and st["chunks_held"] == 0 and st["tree_nodes"] == 0, st
        mgr.check()
    finally:
        mgr.close()


@pytest.mark.parametrize("workers", [1, 3])
def test_per_vtensor_submission_order(workers):
    mgr = new_manager(chunks=512, workers=workers)
    try:
        sp = mgr.create_space(row_bytes=ROW, max_tokens=400, max_slots=8)
        for _ in range(3):
            vt = sp.create(0).result()
            futs = [vt.extend(i) for i in range(1, 301)]
            rel = vt.release()
            samples = []
            while not rel.done():
                try:
                    n = vt.num_tokens
                except vtm.FailedPrecondition:  # released meanwhile
                    break
                if vt.released:
                    break
                samples.append(n)
            for i, f in enumerate(futs, start=1):
                assert f.result(timeout=60) is None, f"extend({i}) failed"
            assert rel.result(timeout=60) is None
            assert vt.released
            assert all(a <= b for a, b in zip(samples, samples[1:])), "num_tokens went backwards"
            assert all(f.done() for f in futs)
            with pytest.raises(vtm.FailedPrecondition):
                vt.release().result()
        st = assert_pool_consistent(mgr)
        assert st["spaces"][sp.name]["vtensors"] == 0
    finally:
        mgr.close()


def test_interleaved_vtensors_keep_their_own_order():
    """extend() on many vTensors, submitted round-robin, each ending in a release."""
    mgr = new_manager(chunks=1024, workers=3)
    try:
        sp = mgr.create_space(row_bytes=ROW, max_tokens=200, max_slots=16)
        vts = [sp.create(0).result() for _ in range(8)]
        futs = {vt: [] for vt in vts}
        for i in range(1, 101):
            for vt in vts:
                futs[vt].append(vt.extend(2 * i))
        rels = [vt.release() for vt in vts]
        for vt in vts:
            for f in futs[vt]:
                f.result(timeout=60)
        for r in rels:
            r.result(timeout=60)
        assert all(vt.released for vt in vts)
        mgr.trim()
        st = assert_pool_consistent(mgr)
        assert st["chunks_created"] == 0
    finally:
        mgr.close()


def test_result_timeout_on_pending_future():
    mgr = new_manager(chunks=1024, workers=1)
    try:
        # one row per chunk: every extend maps (and commits) a fresh page
        sp = mgr.create_space(row_bytes=mgr.chunk_bytes, max_tokens=600, max_slots=2)
        for attempt in range(5):
            vt = sp.create(0).result()
            futs = [vt.extend(i) for i in range(1, 601)]
            last = futs[-1]
            pending = not last.done()
            if pending:
                t0 = time.monotonic()
                try:
                    last.result(timeout=0.001)
                except TimeoutError:
                    assert time.monotonic() - t0 < 30
                else:
                    # finished within the millisecond: only acceptable if it is done now
                    assert last.done()
                    pending = False
            for f in futs:
                f.result(timeout=120)
            assert vt.num_tokens == 600
            vt.release().result()
            mgr.trim()
            if pending:
                break
        else:
            pytest.skip("the operations always finished before result() was called")
    finally:
        mgr.close()


@pytest.mark.parametrize("workers", [1, 3])
def test_threads_under_pressure_while_the_host_tier_spills_ahead(workers):
    """Threads record, match, release and fill a small pool whose host tier
    spills ahead of need on the refill thread, copies slowed so that the
    operations overlap them (mu_ dropped around the copy): every match reads
    its own tokens' bytes, and the invariants hold at the end."""
    from test_host_tier import random_step

    from vtm_testing import chunk_for

    chunk = chunk_for(None)
    mgr = new_manager(chunks=12, workers=workers, host_tier_bytes=8 * chunk, spill_ahead_bytes=4 * chunk,
                      faults=True)
    try:
        mgr.faults.delay("copy_to_host", 0.001)
        space = mgr.create_space(row_bytes=chunk // 20 + 7, max_tokens=200, max_slots=24)
        io = RowIO(space)
        errors = []

        def run(tid):
            rng = np.random.default_rng(2000 + tid)
            stems = [[1000 * k + i for i in range(25)] for k in range(4)]
            live = []
            try:
                for step in range(150):
                    random_step(rng, space, io, stems, live, step)
                for vt in live:
                    vt.release().result()
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append((tid, e))

        run_threads([threading.Thread(target=run, args=(t,)) for t in range(3)], errors)
        mgr.check()
        st = assert_pool_consistent(mgr)
        assert st["spills_total"] > 0, st  # the tier took part (ahead of need or on demand, as threads raced)
    finally:
        mgr.close()
