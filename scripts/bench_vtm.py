"""Benchmark of vtm: per-operation latency, the raw backend floor, and how much
mapping the executor hides behind compute.

Three parts, run on the host backend and, where a CUDA driver exists, on CUDA:

1. Per-operation latency of the manager (create, extend, a batched step over
   256 vTensors, prefix_record, prefix_match, release), measured from the caller
   (submit + result()) and from the worker (mgr.stats()["ops"], the mean over
   the same repetitions). Variants show what the policies save: "cold"
   (slot_cache_bytes=0) against "warm" (deferred reclamation: a released slot
   keeps its pages), chunks created on demand against an eager pool
   (prealloc_chunks=64) and against the lazy-release free list.
2. The raw backend floor: one chunk's map + set_access through
   vtm.RawBackend, timed in the same run; every manager row says how many
   floors it costs. Also, per chunk, 8 and 32 adjacent chunks' access set by
   one set_access over the run against one call per chunk (the manager makes
   one call per run of adjacent pages: in create, step and prefix_match).
   And the host tier's batched copies of 32 chunks (a restore, a spill), into
   chunks never copied before and into the same chunks again (on CUDA a
   chunk's first copy makes its copy view, a mapping of its own).
3. A simulated decode loop (B requests, N steps, one token per request per
   step, a fixed GIL-releasing CPU workload as "compute"): synchronous
   mgr.step(...).result() before compute, against FlexInfer's asynchronous
   pre-extend (submit the next step's mgr.step, compute, then wait), against
   compute alone.

Every comparison is a ratio of medians within one run (docs/design.md §7).

    python scripts/bench_vtm.py [--quick] [--json PATH] [--backend host|cuda|all]

Run it with the installed package (e.g. `make bench`).
"""

from __future__ import annotations

import os

# One BLAS thread: the decode loop's "compute" must occupy one core, leaving
# the other to the vtm worker, as a GPU kernel would leave the CPU. Set before
# numpy is imported.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import vtm  # noqa: E402

CHUNK = 2 << 20  # physical chunk = page, as CUDA's granularity on current GPUs
ROW = 46080  # SmolLM2-135M KV row: 30 layers x (K + V) x 3 KV heads x 64 dims x 4 bytes (float32)
MAX_TOKENS = 8192  # 8192 x 46080 B = exactly 180 pages per slot
PREALLOC = 64
STEP_BATCH = 256
PREFIX_TOKENS = 4100  # 90 whole pages + a partial one (4096 tokens would be exactly 90 pages: no copy)


def pages_for(tokens: int) -> int:
    return -(-tokens * ROW // CHUNK)


def tokens_for_pages(pages: int) -> int:
    """The most tokens that fit in `pages` pages (so pages_for() of it == pages)."""
    return pages * CHUNK // ROW


PAGE_TOKENS = tokens_for_pages(1)  # 45 tokens: "a fresh request of one page"


@dataclass
class Settings:
    op_reps: int = 200  # create / extend / release repetitions per variant
    nogap_reps: int = 100
    floor_reps: int = 400
    chunk_reps: int = 100  # raw create_chunk / release_chunk
    gap_ms: float = 2.0  # idle time between timed ops (what a decode step leaves)
    round_size: int = 25  # creates / extends per round before release (+ trim)
    step_fresh_rounds: int = 5  # two timed steps each
    step_recycled_rounds: int = 10  # one step + one 256-extend baseline each
    record_reps: int = 100
    match_reps: int = 30
    decode_batch: int = 32
    decode_steps: int = 200
    decode_reps: int = 5
    compute_ms: float = 2.0
    warmup: int = 5

    @classmethod
    def quick(cls) -> "Settings":
        return cls(op_reps=40, nogap_reps=30, floor_reps=80, chunk_reps=20, round_size=20,
                   step_fresh_rounds=1, step_recycled_rounds=2, record_reps=20, match_reps=6, decode_steps=100,
                   decode_reps=1, warmup=2)


# ---------------------------------------------------------------------------
# Measurement helpers


def now_ns() -> int:
    return time.perf_counter_ns()


def timed(submit):
    """(microseconds from submission to result, result) of one operation."""
    t0 = now_ns()
    value = submit().result()
    return (now_ns() - t0) / 1e3, value


def summarize(samples: list[float]) -> dict:
    a = np.asarray(samples, dtype=float)
    return {
        "n": int(a.size),
        "median_us": float(np.median(a)),
        "p99_us": float(np.percentile(a, 99)),
        "mean_us": float(a.mean()),
        "min_us": float(a.min()),
        "max_us": float(a.max()),
    }


class OpWatch:
    """Worker-side means over a window, from the cumulative mgr.stats()["ops"]."""

    def __init__(self, mgr):
        self.mgr = mgr
        self.before = self._snap()

    def _snap(self):
        stats = self.mgr.stats()
        ops = {k: (v["count"], v["mean_us"] * v["count"], v["errors"]) for k, v in stats["ops"].items()}
        counters = {k: stats[k] for k in ("slot_reuses_total", "cow_copies_total", "prealloc_chunks_total",
                                          "chunks_released_total")}
        return ops, counters

    def delta(self) -> dict:
        (ops1, c1), (ops0, c0) = self._snap(), self.before
        out = {"ops": {}, "counters": {k: c1[k] - c0[k] for k in c1}}
        for op, (n1, tot1, e1) in ops1.items():
            n0, tot0, e0 = ops0.get(op, (0, 0.0, 0))
            if n1 > n0:
                out["ops"][op] = {"count": n1 - n0, "mean_us": (tot1 - tot0) / (n1 - n0), "errors": e1 - e0}
        self.before = (ops1, c1)
        return out


class Accum:
    """Sums OpWatch deltas over several windows (timed sections only)."""

    def __init__(self):
        self.d = {"ops": {}, "counters": {}}

    def add(self, delta: dict) -> None:
        for op, v in delta["ops"].items():
            a = self.d["ops"].setdefault(op, {"count": 0, "mean_us": 0.0, "errors": 0})
            total = a["mean_us"] * a["count"] + v["mean_us"] * v["count"]
            a["count"] += v["count"]
            a["errors"] += v["errors"]
            a["mean_us"] = total / a["count"]
        for k, v in delta["counters"].items():
            self.d["counters"][k] = self.d["counters"].get(k, 0) + v


def gap(settings: Settings) -> None:
    if settings.gap_ms > 0:
        time.sleep(settings.gap_ms / 1e3)


def manager(backend: str, capacity: int, **kw):
    if backend == "host":
        kw.setdefault("granularity", CHUNK)
    return vtm.Manager(backend=backend, capacity_bytes=capacity, chunk_bytes=CHUNK, **kw)


def wait_free(mgr, want: int, timeout_s: float = 10.0) -> None:
    """Waits until the eager pool holds `want` free chunks (the refill runs on a worker)."""
    end = time.monotonic() + timeout_s
    while mgr.stats()["chunks_free"] < want:
        if time.monotonic() > end:
            raise RuntimeError(f"prealloc refill did not reach {want} free chunks in {timeout_s} s")
        time.sleep(0.002)


def finish(mgr, label: str, problems: list[str]) -> None:
    """Everything released: the manager must hold no chunk and pass check()."""
    try:
        mgr.check()
    except vtm.Error as e:  # an invariant broke: report it, keep benchmarking
        problems.append(f"{label}: check() failed: {e}")
    st = mgr.stats()
    if st["chunks_held"] != st["chunks_cached"] or st["chunks_mapped"] != st["chunks_cached"]:
        problems.append(f"{label}: after releasing everything chunks_held={st['chunks_held']}, "
                        f"chunks_mapped={st['chunks_mapped']}, chunks_cached={st['chunks_cached']}")


@dataclass
class Row:
    name: str
    op: str  # the worker-side op name
    samples: list[float]
    baseline: str | None = None  # name of the row this one is compared with
    notes: str = ""
    worker: dict | None = None  # {"count", "mean_us", "errors"} over the same window
    counters: dict = field(default_factory=dict)
    per: int = 1  # pages (or vTensors) the op covers, for the per-page column
    also: str | None = None  # a second row to compare with, in the notes

    def stats(self) -> dict:
        return summarize(self.samples)


# ---------------------------------------------------------------------------
# 2. The raw backend floor


def bench_floor(backend: str, s: Settings) -> dict:
    raw = vtm.RawBackend.open(backend, granularity=CHUNK if backend == "host" else 0)
    n = 8
    va = raw.reserve(n * CHUNK)
    chunks: list[int] = []
    res = {"map": [], "set_access": [], "map_set_access": [], "unmap": [], "create_chunk": [],
           "map_set_access_new": [], "release_chunk": []}
    mapped = None
    try:
        chunks = [raw.create_chunk(CHUNK) for _ in range(n)]
        gc.disable()
        for i in range(s.floor_reps + s.warmup):
            addr, chunk = va + (i % n) * CHUNK, chunks[i % n]
            t0 = now_ns()
            raw.map(addr, CHUNK, chunk)
            mapped = addr
            t1 = now_ns()
            raw.set_access(addr, CHUNK)
            t2 = now_ns()
            raw.unmap(addr, CHUNK)
            mapped = None
            t3 = now_ns()
            if i >= s.warmup:
                res["map"].append((t1 - t0) / 1e3)
                res["set_access"].append((t2 - t1) / 1e3)
                res["map_set_access"].append((t2 - t0) / 1e3)
                res["unmap"].append((t3 - t2) / 1e3)
        for i in range(s.chunk_reps + s.warmup):
            t0 = now_ns()
            h = raw.create_chunk(CHUNK)
            t1 = now_ns()
            raw.map(va, CHUNK, h)
            mapped = va
            raw.set_access(va, CHUNK)
            t2 = now_ns()
            raw.unmap(va, CHUNK)
            mapped = None
            t3 = now_ns()
            raw.release_chunk(h)
            t4 = now_ns()
            if i >= s.warmup:
                res["create_chunk"].append((t1 - t0) / 1e3)
                res["map_set_access_new"].append((t2 - t1) / 1e3)
                res["release_chunk"].append((t4 - t3) / 1e3)
    finally:
        gc.enable()
        if mapped is not None:
            raw.unmap(mapped, CHUNK)
        for c in chunks:
            raw.release_chunk(c)
        raw.free_reservation(va, n * CHUNK)
    for run in RUN_LENGTHS:
        res.update(bench_access_runs(raw, run, s))
    res.update(bench_host_copies(raw, s))
    return res


# Chunks a batched host-tier copy moves in the benchmark (a restore of a
# 1,400-token SmolLM2 prefix in float32; 64 MiB).
HOST_COPY_CHUNKS = 32


def bench_host_copies(raw, s: Settings) -> dict:
    """Per chunk, µs: the host tier's batched copies of HOST_COPY_CHUNKS chunks
    (copy_from_host_many: a restore; copy_to_host_many: a spill) through host
    memory from alloc_host (CUDA: page-locked). "cold": chunks never copied
    before (on CUDA each gets its copy view, a mapping of its own, on its first
    copy); "warm": the same chunks again, which map nothing. Cold and warm
    alternate, so drift hits both."""
    n = HOST_COPY_CHUNKS
    blocks = [raw.alloc_host(CHUNK) for _ in range(n)]
    out = {"host_copy_in_cold": [], "host_copy_in_warm": [], "host_copy_out_warm": []}
    reps = max(4, s.floor_reps // 16)
    try:
        warm = [raw.create_chunk(CHUNK) for _ in range(n)]
        try:
            gc.disable()
            for i in range(reps + s.warmup):
                fresh = [raw.create_chunk(CHUNK) for _ in range(n)]
                try:
                    t0 = now_ns()
                    raw.copy_from_host_many(fresh, blocks, CHUNK)
                    t1 = now_ns()
                finally:
                    for c in fresh:
                        raw.release_chunk(c)
                t2 = now_ns()
                raw.copy_from_host_many(warm, blocks, CHUNK)
                t3 = now_ns()
                raw.copy_to_host_many(blocks, warm, CHUNK)
                t4 = now_ns()
                if i >= s.warmup:
                    out["host_copy_in_cold"].append((t1 - t0) / 1e3 / n)
                    out["host_copy_in_warm"].append((t3 - t2) / 1e3 / n)
                    out["host_copy_out_warm"].append((t4 - t3) / 1e3 / n)
        finally:
            gc.enable()
            for c in warm:
                raw.release_chunk(c)
    finally:
        for b in blocks:
            raw.free_host(b, CHUNK)
    return out


# Runs of adjacent chunks whose access is set in one call or one call per chunk.
RUN_LENGTHS = (8, 32)


def bench_access_runs(raw, run: int, s: Settings) -> dict:
    """Per chunk, µs: `run` adjacent chunks mapped, then their access set by
    one set_access over the run against one set_access per chunk (issue 20,
    item 4: the manager sets access once per run of adjacent pages; this is
    what that saves). The two alternate, so drift hits both."""
    va = raw.reserve(run * CHUNK)
    chunks: list[int] = []
    out = {f"set_access_run{run}": [], f"set_access_each{run}": [], f"map_each{run}": []}
    mapped = False
    reps = max(8, s.floor_reps // run * 2)
    try:
        chunks = [raw.create_chunk(CHUNK) for _ in range(run)]
        gc.disable()
        for i in range(reps + s.warmup):
            t0 = now_ns()
            for k, chunk in enumerate(chunks):
                raw.map(va + k * CHUNK, CHUNK, chunk)
            mapped = True
            t1 = now_ns()
            one_call = i % 2 == 0
            if one_call:
                raw.set_access(va, run * CHUNK)
            else:
                for k in range(run):
                    raw.set_access(va + k * CHUNK, CHUNK)
            t2 = now_ns()
            raw.unmap(va, run * CHUNK)
            mapped = False
            if i >= s.warmup:
                out[f"map_each{run}"].append((t1 - t0) / 1e3 / run)
                out[f"set_access_run{run}" if one_call else f"set_access_each{run}"].append((t2 - t1) / 1e3 / run)
    finally:
        gc.enable()
        if mapped:
            raw.unmap(va, run * CHUNK)
        for c in chunks:
            raw.release_chunk(c)
        raw.free_reservation(va, run * CHUNK)
    return out


# ---------------------------------------------------------------------------
# 1. Manager operations


def bench_create_release(backend: str, s: Settings, cache, problems) -> tuple[Row, Row]:
    """create(one page) then release, alternately, on a pool whose free list
    already holds chunks: cold (slot_cache_bytes=0: release unmaps, create maps
    a recycled chunk) or warm (default cache: the released slot keeps its page
    and the next create takes it back without a backend call)."""
    label = "warm" if cache is None else "cold"
    with manager(backend, 256 << 20, slot_cache_bytes=cache) as mgr:
        space = mgr.create_space(ROW, MAX_TOKENS, 8)
        for _ in range(s.warmup):
            space.create(PAGE_TOKENS).result().release().result()
        watch = OpWatch(mgr)
        creates, releases = [], []
        gc.disable()
        try:
            for _ in range(s.op_reps):
                t, vt = timed(lambda: space.create(PAGE_TOKENS))
                creates.append(t)
                gap(s)
                t, _ = timed(vt.release)
                releases.append(t)
                gap(s)
        finally:
            gc.enable()
        d = watch.delta()
        finish(mgr, f"create/release {label}", problems)
    reuse = d["counters"]["slot_reuses_total"]
    if label == "cold":
        c = Row("create 1 page, cold, recycled chunk", "create", creates, "create 1 page, cold, fresh chunk",
                "slot_cache=0; chunk from the lazy-release free list: map + set_access only",
                d["ops"].get("create"), d["counters"])
        r = Row("release 1 page, cold", "release", releases, None,
                "slot_cache=0: unmap; the chunk goes to the free list (not the device)",
                d["ops"].get("release"), d["counters"])
    else:
        c = Row("create 1 page, warm (slot reuse)", "create", creates, "create 1 page, cold, fresh chunk",
                f"default slot cache: released slot still mapped, no backend call ({reuse}/{s.op_reps} reuses)",
                d["ops"].get("create"), d["counters"], also="create 1 page, cold, recycled chunk")
        r = Row("release 1 page, warm", "release", releases, "release 1 page, cold",
                "default slot cache: the page stays mapped for the next create",
                d["ops"].get("release"), d["counters"])
    return c, r


def bench_create_fresh(backend: str, s: Settings, prealloc: int, workers: int, use_gap: bool, reps: int,
                       problems) -> Row:
    """create(one page) where the pool has no recycled chunk: rounds of
    round_size creates (no release in between), then release all + trim, so
    each create needs a chunk the pool does not have yet. With prealloc the
    eager pool is refilled in the background (on a worker) between ops."""
    cap = (s.round_size + PREALLOC + 8) * CHUNK
    samples: list[float] = []
    acc = Accum()
    with manager(backend, cap, slot_cache_bytes=0, prealloc_chunks=prealloc, workers=workers) as mgr:
        space = mgr.create_space(ROW, MAX_TOKENS, s.round_size)
        rounds = 1 + -(-reps // s.round_size)  # the first is a warm-up
        gc.disable()
        try:
            for r in range(rounds):
                mgr.trim()
                if prealloc:  # an op triggers the refill; wait until the eager pool is full
                    space.create(PAGE_TOKENS).result().release().result()
                    wait_free(mgr, prealloc)
                watch = OpWatch(mgr)
                vts = []
                for _ in range(s.round_size):
                    t, vt = timed(lambda: space.create(PAGE_TOKENS))
                    vts.append(vt)
                    if r > 0:
                        samples.append(t)
                    if use_gap:
                        gap(s)
                if r > 0:
                    acc.add(watch.delta())
                for f in [vt.release() for vt in vts]:
                    f.result()
        finally:
            gc.enable()
        d = acc.d
        mgr.trim()
        finish(mgr, f"create fresh prealloc={prealloc} workers={workers}", problems)
    if prealloc == 0:
        return Row("create 1 page, cold, fresh chunk", "create", samples, None,
                   "prealloc=0, pool trimmed: create_chunk (commit memory) + map + set_access",
                   d["ops"].get("create"), d["counters"])
    name = f"create 1 page, prealloc={prealloc}"
    note = "eager pool refilled between ops: map + set_access only"
    if workers > 1:
        name += f", workers={workers}"
    if not use_gap:
        name += ", back-to-back"
        note = "no idle time between ops: the refill thread creates chunks while the workers map"
    return Row(name, "create", samples, "create 1 page, cold, fresh chunk", note,
               d["ops"].get("create"), d["counters"], also="create 1 page, cold, recycled chunk")


def bench_extend(backend: str, s: Settings, mode: str, problems) -> Row:
    """extend a vTensor by exactly one page per op. mode: "fresh" (prealloc 0,
    pool trimmed each round), "prealloc" (eager pool of 64), "recycled"
    (chunks from the free list)."""
    prealloc = PREALLOC if mode == "prealloc" else 0
    cap = (s.round_size + 1 + PREALLOC + 8) * CHUNK
    samples: list[float] = []
    acc = Accum()
    with manager(backend, cap, slot_cache_bytes=0, prealloc_chunks=prealloc) as mgr:
        space = mgr.create_space(ROW, MAX_TOKENS, 2)
        rounds = 1 + -(-s.op_reps // s.round_size)  # the first is a warm-up (and fills the free list)
        gc.disable()
        try:
            for r in range(rounds):
                if mode != "recycled":
                    mgr.trim()
                if mode == "prealloc":
                    space.create(PAGE_TOKENS).result().release().result()
                    wait_free(mgr, prealloc)
                vt = space.create(PAGE_TOKENS).result()
                watch = OpWatch(mgr)
                for p in range(2, s.round_size + 2):
                    n = tokens_for_pages(p)
                    t, _ = timed(lambda: vt.extend(n))
                    if r > 0:
                        samples.append(t)
                    gap(s)
                if r > 0:
                    acc.add(watch.delta())
                vt.release().result()
        finally:
            gc.enable()
        d = acc.d
        mgr.trim()
        finish(mgr, f"extend {mode}", problems)
    base = "extend +1 page, cold, fresh chunk"
    if mode == "fresh":
        return Row(base, "extend", samples, None, "prealloc=0, pool trimmed: create_chunk + map + set_access",
                   d["ops"].get("extend"), d["counters"])
    if mode == "prealloc":
        return Row(f"extend +1 page, prealloc={PREALLOC}", "extend", samples, base,
                   "eager pool refilled between ops: map + set_access only", d["ops"].get("extend"), d["counters"],
                   also="extend +1 page, recycled chunk")
    return Row("extend +1 page, recycled chunk", "extend", samples, base,
               "chunk from the lazy-release free list", d["ops"].get("extend"), d["counters"])


def bench_step(backend: str, s: Settings, problems) -> list[Row]:
    """mgr.step over 256 vTensors, each growing by one page (256 pages per op).
    A round creates 256 one-page vTensors, grows them twice by one page, and
    releases them (768 chunks, 1.5 GiB at most). Fresh rounds trim the pool
    first, so every page of a step runs create_chunk; recycled rounds take the
    chunks the fresh rounds left in the free list and alternate the step with
    its baseline: the same growth as 256 sequential vt.extend(...).result()."""
    cap = (STEP_BATCH * 3 + 8) * CHUNK
    fresh, recycled, seq = [], [], []
    acc_fresh, acc_rec = Accum(), Accum()
    with manager(backend, cap, slot_cache_bytes=0) as mgr:
        space = mgr.create_space(ROW, MAX_TOKENS, STEP_BATCH)

        def run_round(kind: str, record: bool) -> None:
            futs = [space.create(PAGE_TOKENS) for _ in range(STEP_BATCH)]
            vts = [f.result() for f in futs]
            if kind == "fresh":
                mgr.trim()
            watch = OpWatch(mgr)
            times: list[tuple[list, float]] = []
            for i in range(2):
                n = tokens_for_pages(i + 2)
                if kind == "fresh" or i == 0:
                    t, _ = timed(lambda: mgr.step({vt: n for vt in vts}))
                    times.append((fresh if kind == "fresh" else recycled, t))
                else:
                    t0 = now_ns()
                    for vt in vts:
                        vt.extend(n).result()
                    times.append((seq, (now_ns() - t0) / 1e3))
                gap(s)
            d = watch.delta()
            if record:
                (acc_fresh if kind == "fresh" else acc_rec).add(d)
                for dest, t in times:
                    dest.append(t)
            for f in [vt.release() for vt in vts]:
                f.result()

        gc.disable()
        try:
            run_round("fresh", False)  # warm-up: the process's first touch of this memory
            for _ in range(s.step_fresh_rounds):
                run_round("fresh", True)
            run_round("recycled", False)
            for _ in range(s.step_recycled_rounds):
                run_round("recycled", True)
        finally:
            gc.enable()
        mgr.trim()
        finish(mgr, "step", problems)
    d_fresh, d_rec = acc_fresh.d, acc_rec.d
    seq_row = Row(f"{STEP_BATCH} x extend(+1 page).result(), recycled", "extend", seq, None,
                  "baseline for the batched step: one op per vTensor, each waited", d_rec["ops"].get("extend"),
                  d_rec["counters"], per=STEP_BATCH)
    rec_row = Row(f"step {STEP_BATCH} vTensors +1 page, recycled", "step", recycled, seq_row.name,
                  f"{STEP_BATCH} pages per op from the free list", d_rec["ops"].get("step"), d_rec["counters"],
                  per=STEP_BATCH)
    fresh_row = Row(f"step {STEP_BATCH} vTensors +1 page, fresh chunks", "step", fresh, rec_row.name,
                    f"pool trimmed: {STEP_BATCH} create_chunk per op", d_fresh["ops"].get("step"),
                    d_fresh["counters"], per=STEP_BATCH)
    return [seq_row, rec_row, fresh_row]


def bench_prefix(backend: str, s: Settings, problems) -> list[Row]:
    """prefix_record of a new 4100-token sequence (the tree takes 91 chunk
    references) and prefix_match of a 4100-token recorded prefix (90 shared
    pages + a copy-on-write of the partial one), against create(4100)
    (91 private pages from the free list), each followed by its release."""
    p_pages = pages_for(PREFIX_TOKENS)
    n_records = s.record_reps + s.warmup
    cap = (4 * p_pages + n_records + 16) * CHUNK
    rec_t, match_t, match_rel_t, create_t, create_rel_t = [], [], [], [], []
    with manager(backend, cap, slot_cache_bytes=0) as mgr:
        space = mgr.create_space(ROW, MAX_TOKENS, 8)
        holder = space.create(PREFIX_TOKENS).result()
        # Each record gives the tree a copy of the holder's partial last page
        # (the page the recorder writes next): put one free chunk per record
        # in the pool, as a running engine's free list would have.
        space.create(tokens_for_pages(n_records)).result().release().result()
        gc.disable()
        try:
            for i in range(n_records):
                if i == s.warmup:
                    w = OpWatch(mgr)
                tokens = [1_000_000 + i] + list(range(1, PREFIX_TOKENS))  # a new branch each time
                t, added = timed(lambda: space.prefix_record(holder, tokens))
                if added != PREFIX_TOKENS:
                    problems.append(f"prefix_record added {added} tokens, expected {PREFIX_TOKENS}")
                if i >= s.warmup:
                    rec_t.append(t)
            d_rec = w.delta()
            space.clear_prefixes()  # all but the branch the holder locks
            seq = list(range(10, 10 + PREFIX_TOKENS))
            space.prefix_record(holder, seq).result()
            query = seq + [7]
            # Fill the free list for the create baseline, then alternate.
            space.create(PREFIX_TOKENS).result().release().result()
            w = OpWatch(mgr)
            acc_match, acc_create = Accum(), Accum()
            for i in range(s.match_reps + s.warmup):
                t, m = timed(lambda: space.prefix_match(query))
                if m.num_tokens != PREFIX_TOKENS or m.vtensor is None:
                    problems.append(f"prefix_match matched {m.num_tokens} tokens, expected {PREFIX_TOKENS}")
                t2, _ = timed(m.vtensor.release)
                del m
                gap(s)
                dm = w.delta()
                t3, vt = timed(lambda: space.create(PREFIX_TOKENS))
                t4, _ = timed(vt.release)
                del vt
                gap(s)
                dc = w.delta()
                if i >= s.warmup:
                    match_t.append(t)
                    match_rel_t.append(t2)
                    create_t.append(t3)
                    create_rel_t.append(t4)
                    acc_match.add(dm)
                    acc_create.add(dc)
        finally:
            gc.enable()
        d_match, d_create = acc_match.d, acc_create.d
        holder.release().result()
        space.clear_prefixes()
        mgr.trim()
        finish(mgr, "prefix", problems)
    cows = d_match["counters"].get("cow_copies_total", 0)
    create_row = Row(f"create {PREFIX_TOKENS} tokens ({p_pages} pages), recycled", "create", create_t, None,
                     "baseline for prefix_match: the same pages, private, from the free list",
                     d_create["ops"].get("create"), d_create["counters"], per=p_pages)
    match_row = Row(f"prefix_match {PREFIX_TOKENS}-token prefix", "prefix_match", match_t, create_row.name,
                    f"{p_pages - 1} shared pages + 1 copy-on-write ({cows}/{len(match_t)} copies)",
                    d_match["ops"].get("prefix_match"), d_match["counters"], per=p_pages)
    create_rel = Row(f"release {PREFIX_TOKENS}-token private vTensor", "release", create_rel_t, None,
                     f"slot_cache=0: unmap {p_pages} pages (one run)", d_create["ops"].get("release"),
                     d_create["counters"], per=p_pages)
    match_rel = Row(f"release matched {PREFIX_TOKENS}-token vTensor", "release", match_rel_t, create_rel.name,
                    "shared pages unmapped, tree keeps its references", d_match["ops"].get("release"),
                    d_match["counters"], per=p_pages)
    record_row = Row(f"prefix_record new {PREFIX_TOKENS}-token sequence", "prefix_record", rec_t, None,
                     f"tree refs {p_pages - 1} chunks + copies the partial page the recorder writes next "
                     f"({d_rec['counters'].get('cow_copies_total', 0)}/{len(rec_t)} copies, into a free-list chunk)",
                     d_rec["ops"].get("prefix_record"), d_rec["counters"])
    return [record_row, create_row, match_row, create_rel, match_rel]


# ---------------------------------------------------------------------------
# 3. Executor overlap: a simulated decode loop


class Compute:
    """A fixed CPU workload that releases the GIL (single-threaded numpy
    matmuls), calibrated to about `ms` milliseconds."""

    def __init__(self, ms: float):
        self.a = np.random.default_rng(0).random((192, 192), dtype=np.float32)
        self.b = self.a.T.copy()
        one = []
        for _ in range(50):
            t0 = now_ns()
            self.a @ self.b
            one.append(now_ns() - t0)
        self.reps = max(1, round(ms * 1e6 / float(np.median(one))))
        runs = []
        for _ in range(20):
            t0 = now_ns()
            self()
            runs.append(now_ns() - t0)
        self.measured_us = float(np.median(runs)) / 1e3

    def __call__(self) -> None:
        a, b = self.a, self.b
        for _ in range(self.reps):
            a @ b


def bench_decode(backend: str, s: Settings, compute: Compute, pool: str, problems) -> dict:
    """B requests decode N steps; each step every request needs one more
    token. Start lengths are staggered so page crossings spread over the steps
    (a page holds ~45.5 rows of 46080 B). pool: "fresh" (prealloc 0, pool
    trimmed before each run: every crossing creates a chunk) or "recycled"
    (chunks from the free list)."""
    B, N = s.decode_batch, s.decode_steps
    starts = [64 + (i * CHUNK // ROW) // B for i in range(B)]
    crossings = [sum(1 for L in starts if pages_for(L + t + 1) > pages_for(L + t)) for t in range(N)]
    pages_total = sum(crossings)
    steps_mapping = sum(1 for c in crossings if c)
    cap = (B * (pages_for(max(starts) + N + 1) + 1) + 8) * CHUNK
    runs: dict[str, list[dict]] = {"compute": [], "sync": [], "async": []}
    with manager(backend, cap, slot_cache_bytes=0) as mgr:
        space = mgr.create_space(ROW, MAX_TOKENS, B)

        def one(mode: str) -> dict:
            vts = [space.create(L).result() for L in starts]
            if pool == "fresh":
                mgr.trim()
            plan = [{vt: L + t + 1 for vt, L in zip(vts, starts)} for t in range(N)]
            watch = OpWatch(mgr)
            stall = 0
            gc.disable()
            try:
                t0 = now_ns()
                if mode == "compute":
                    for t in range(N):
                        compute()
                elif mode == "sync":
                    for t in range(N):
                        w0 = now_ns()
                        mgr.step(plan[t]).result()
                        stall += now_ns() - w0
                        compute()
                else:  # FlexInfer Algorithm 1: pre-extend the next step during this step's compute
                    fut = mgr.step(plan[0])
                    for t in range(N):
                        w0 = now_ns()
                        fut.result()
                        stall += now_ns() - w0
                        fut = mgr.step(plan[t + 1]) if t + 1 < N else None
                        compute()
                wall = now_ns() - t0
            finally:
                gc.enable()
            d = watch.delta()
            for f in [vt.release() for vt in vts]:
                f.result()
            step = d["ops"].get("step", {"count": 0, "mean_us": 0.0})
            return {"wall_ms": wall / 1e6, "stall_ms": stall / 1e6,
                    "worker_step_ms": step["count"] * step["mean_us"] / 1e3, "steps": step["count"]}

        one("sync")  # warm-up: fills the free list, warms page tables and caches
        for _ in range(s.decode_reps):
            for mode in ("compute", "sync", "async"):
                runs[mode].append(one(mode))
        mgr.trim()
        finish(mgr, f"decode {pool}", problems)
    med = {m: float(np.median([r["wall_ms"] for r in rs])) for m, rs in runs.items()}
    exposed = med["sync"] - med["compute"]
    hidden = (med["sync"] - med["async"]) / exposed if exposed > 0 else float("nan")
    return {
        "pool": pool,
        "batch": B,
        "steps": N,
        "start_tokens": starts,
        "pages_mapped": pages_total,
        "steps_with_mapping": steps_mapping,
        "compute_us_per_step": compute.measured_us,
        "runs": runs,
        "median_wall_ms": med,
        "async_over_sync": med["async"] / med["sync"],
        "sync_over_compute": med["sync"] / med["compute"],
        "async_over_compute": med["async"] / med["compute"],
        "hidden_fraction": hidden,
        "median_worker_step_ms": {m: float(np.median([r["worker_step_ms"] for r in rs])) for m, rs in runs.items()},
        "median_stall_ms": {m: float(np.median([r["stall_ms"] for r in rs])) for m, rs in runs.items()},
    }


# ---------------------------------------------------------------------------
# Driver


def run_backend(backend: str, s: Settings, compute: Compute, log) -> dict:
    problems: list[str] = []
    load: dict[str, float | None] = {}  # CPUs other processes kept busy, per section

    def section(name, fn):
        log(f"[{backend}] {name} ...")
        c0, t0 = cpu_snapshot(), time.monotonic()
        out = fn()
        load[name] = other_load(c0, cpu_snapshot(), time.monotonic() - t0)
        return out

    floor = section("backend floor", lambda: bench_floor(backend, s))
    floor_us = float(np.median(floor["map_set_access"]))
    rows: list[Row] = []

    def creates():
        fresh = bench_create_fresh(backend, s, 0, 1, True, s.op_reps, problems)
        cold_c, cold_r = bench_create_release(backend, s, 0, problems)
        warm_c, warm_r = bench_create_release(backend, s, None, problems)
        return [fresh, cold_c, warm_c,
                bench_create_fresh(backend, s, PREALLOC, 1, True, s.op_reps, problems),
                bench_create_fresh(backend, s, PREALLOC, 1, False, s.nogap_reps, problems),
                bench_create_fresh(backend, s, PREALLOC, 2, False, s.nogap_reps, problems),
                cold_r, warm_r]

    rows += section("create / release", creates)
    rows += section("extend", lambda: [bench_extend(backend, s, mode, problems)
                                       for mode in ("fresh", "prealloc", "recycled")])
    rows += section(f"step over {STEP_BATCH} vTensors", lambda: bench_step(backend, s, problems))
    rows += section("prefix_record / prefix_match", lambda: bench_prefix(backend, s, problems))
    decode = section("decode loop", lambda: {pool: bench_decode(backend, s, compute, pool, problems)
                                             for pool in ("fresh", "recycled")})

    by_name = {r.name: r for r in rows}
    out_rows = []
    for r in rows:
        st = r.stats()
        base = by_name.get(r.baseline) if r.baseline else None
        ratio = st["median_us"] / base.stats()["median_us"] if base else None
        also = by_name.get(r.also) if r.also else None
        notes = r.notes
        ratio_also = None
        if also:
            ratio_also = st["median_us"] / also.stats()["median_us"]
            notes += f"; {ratio_also:.2f}x '{r.also}'"
        if r.per > 1:
            notes += f"; {st['median_us'] / r.per:.0f} us per page"
        out_rows.append({
            "name": r.name, "op": r.op, **st, "baseline": r.baseline, "ratio": ratio,
            "x_floor": st["median_us"] / floor_us, "per": r.per, "median_us_per_unit": st["median_us"] / r.per,
            "also": r.also, "ratio_also": ratio_also,
            "worker": r.worker, "counters": r.counters, "notes": notes, "samples_us": r.samples,
        })
    return {
        "backend": backend,
        "floor_us": floor_us,
        "floor": {k: {**summarize(v), "x_floor": float(np.median(v)) / floor_us, "samples_us": v}
                  for k, v in floor.items()},
        "rows": out_rows,
        "decode": decode,
        "other_load_cpus": load,
        "problems": problems,
    }


FLOOR_ROWS = (
    ("map_set_access", "map + set_access (the floor)"),
    ("map", "  map"),
    ("set_access", "  set_access"),
    ("unmap", "unmap"),
    ("create_chunk", "create_chunk"),
    ("map_set_access_new", "map + set_access, new chunk"),
    ("release_chunk", "release_chunk"),
) + tuple(row for run in RUN_LENGTHS for row in (
    (f"map_each{run}", f"map, {run} adjacent chunks, per chunk"),
    (f"set_access_each{run}", "  set_access per chunk, per chunk"),
    (f"set_access_run{run}", f"  set_access over the {run}, per chunk"),
)) + (
    ("host_copy_in_cold", f"restore copy, {HOST_COPY_CHUNKS} new chunks, per chunk"),
    ("host_copy_in_warm", "  the same chunks again, per chunk"),
    ("host_copy_out_warm", f"spill copy, {HOST_COPY_CHUNKS} chunks, per chunk"),
)


def cpu_snapshot():
    """(busy seconds of all CPUs, this process's CPU seconds), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    t = os.times()
    return (sum(fields) - idle) / hz, t.user + t.system


def other_load(before, after, wall_s: float) -> float | None:
    """CPUs' worth of work other processes did during the run (0 on a quiet machine)."""
    if before is None or after is None or wall_s <= 0:
        return None
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / wall_s


def fmt(x, spec=".0f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def print_report(res: dict, out=sys.stdout) -> None:
    p = lambda *a: print(*a, file=out)  # noqa: E731
    be = res["backend"]
    p(f"\n== {be}: backend floor (RawBackend, one {CHUNK >> 20} MiB chunk)")
    p(f"{'op':<40} {'median us':>10} {'p99 us':>10} {'x floor':>8}")
    for k, label in FLOOR_ROWS:
        f = res["floor"][k]
        p(f"{label:<40} {f['median_us']:>10.1f} {f['p99_us']:>10.1f} {f['x_floor']:>8.2f}")
    for run in RUN_LENGTHS:
        each, one = res["floor"][f"set_access_each{run}"], res["floor"][f"set_access_run{run}"]
        p(f"   set_access over {run} adjacent chunks in one call: {one['median_us'] / each['median_us']:.2f}x "
          "the cost of one call per chunk")
    cold, warm = res["floor"]["host_copy_in_cold"], res["floor"]["host_copy_in_warm"]
    spill = res["floor"]["host_copy_out_warm"]
    p(f"   host-tier copies: a restore's moves {CHUNK / warm['median_us'] / 1e3:.2f} GB/s once its chunks were "
      f"copied before, {CHUNK / cold['median_us'] / 1e3:.2f} GB/s into new chunks "
      f"({cold['median_us'] / warm['median_us']:.2f}x the time); a spill's {CHUNK / spill['median_us'] / 1e3:.2f} GB/s")
    p(f"\n== {be}: manager operations (caller: submit + result(); worker: stats()['ops'] mean over the same reps)")
    p(f"{'op':<52} {'median us':>10} {'p99 us':>10} {'ratio':>7} {'x floor':>8} {'worker us':>10}  notes")
    for r in res["rows"]:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "base"
        worker = fmt(r["worker"]["mean_us"], ".1f") if r["worker"] else "-"
        p(f"{r['name']:<52} {r['median_us']:>10.1f} {r['p99_us']:>10.1f} {ratio:>7} {r['x_floor']:>8.2f} "
          f"{worker:>10}  {r['notes']}")
    p("   ratio: median / median of the row named as its baseline (JSON 'baseline'); x floor: median / map+set_access")
    for pool, d in res["decode"].items():
        p(f"\n== {be}: decode loop, {d['batch']} requests x {d['steps']} steps, compute "
          f"{d['compute_us_per_step']:.0f} us/step, {pool} chunks: {d['pages_mapped']} pages mapped, "
          f"on {d['steps_with_mapping']}/{d['steps']} steps")
        p(f"{'mode':<40} {'wall ms':>9} {'us/step':>9} {'x compute':>10} {'stall ms':>9} {'worker ms':>10}")
        labels = {"compute": "compute only (baseline)", "sync": "sync: step().result(), then compute",
                  "async": "async: pre-extend next step, compute, wait"}
        for m in ("compute", "sync", "async"):
            w = d["median_wall_ms"][m]
            p(f"{labels[m]:<40} {w:>9.1f} {w * 1e3 / d['steps']:>9.1f} {w / d['median_wall_ms']['compute']:>10.3f} "
              f"{d['median_stall_ms'][m]:>9.2f} {d['median_worker_step_ms'][m]:>10.2f}")
        p(f"   async / sync = {d['async_over_sync']:.3f}; mapping time hidden = (sync - async) / (sync - compute) "
          f"= {fmt(d['hidden_fraction'] * 100, '.0f')}%")
    busy = {k: v for k, v in res["other_load_cpus"].items() if v is not None and v > 0.2}
    if busy:
        p(f"\n!! {be}: other processes were busy during: " +
          ", ".join(f"{k} ({v:.2f} CPUs)" for k, v in busy.items()) + "; those timings include contention")
    if res["problems"]:
        p(f"\n!! {be}: problems found")
        for msg in res["problems"]:
            p(f"   - {msg}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (~10 s)")
    ap.add_argument("--json", metavar="PATH", help="write every raw number here (parent dirs are created)")
    ap.add_argument("--backend", choices=("host", "cuda", "all"), default="all",
                    help="all: host, plus cuda when a driver with a device exists (default)")
    ap.add_argument("--compute-ms", type=float, help="decode loop compute per step (default 2)")
    ap.add_argument("--decode-steps", type=int)
    ap.add_argument("--decode-batch", type=int)
    ap.add_argument("--gap-ms", type=float, help="idle time between timed ops (default 2)")
    args = ap.parse_args(argv)
    s = Settings.quick() if args.quick else Settings()
    for name in ("compute_ms", "decode_steps", "decode_batch", "gap_ms"):
        if getattr(args, name) is not None:
            setattr(s, name, getattr(args, name))

    if args.backend == "cuda" and not vtm.cuda_available():
        print("no CUDA driver with a device here", file=sys.stderr)
        return 2
    backends = ["host"] if args.backend == "host" else ["cuda"] if args.backend == "cuda" else (
        ["host", "cuda"] if vtm.cuda_available() else ["host"])

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    started = time.monotonic()
    cpu0 = cpu_snapshot()
    meta = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "machine": platform.machine(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cuda_available": vtm.cuda_available(),
        "chunk_bytes": CHUNK,
        "row_bytes": ROW,
        "max_tokens": MAX_TOKENS,
        "quick": args.quick,
        "loadavg_start": os.getloadavg(),
    }
    print(f"vtm benchmark {meta['date_utc']}: {meta['cpus']} CPUs, kernel {meta['kernel']}, "
          f"backends {', '.join(backends)}; chunk {CHUNK >> 20} MiB, row {ROW} B ({CHUNK / ROW:.1f} rows/page), "
          f"max_tokens {MAX_TOKENS}; {'quick' if args.quick else 'default'} settings")
    compute = Compute(s.compute_ms)
    results = {}
    for be in backends:
        results[be] = run_backend(be, s, compute, log)
        print_report(results[be])
    elapsed = time.monotonic() - started
    meta["other_load_cpus"] = other_load(cpu0, cpu_snapshot(), elapsed)
    meta["loadavg_end"] = os.getloadavg()
    print(f"\n(total {elapsed:.1f} s; other processes kept {fmt(meta['other_load_cpus'], '.2f')} of "
          f"{os.cpu_count()} CPUs busy during the run)")
    if meta["other_load_cpus"] is not None and meta["other_load_cpus"] > 0.2:
        print("!! the machine was not quiet: timings include contention from other processes")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"meta": {**meta, "elapsed_s": elapsed}, "settings": asdict(s),
                                    "results": results}, indent=1))
        print(f"JSON written to {path}")
    return 1 if any(r["problems"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
