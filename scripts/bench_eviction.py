"""An allocation that must evict a cached prefix, against the size of the prefix tree.

A serving engine with prefix caching keeps its pool full of recorded
prefixes: from then on every new page is taken from the least recently used
one. Here a pool holds N one-page prefixes and three live vTensors, and each
timed request creates a one-page vTensor (evicting one prefix), records it as
a new prefix and releases it, so the tree keeps N nodes. The baseline, in the
same manager and at the same N, is the same create served from a free chunk
(a live vTensor released first). Medians, in µs, and their ratio per N:
a cost that grows with N is a walk over the tree. With --tier, the manager
has a host tier of N chunks too, filled first: each evicting create then
spills a prefix to the host and the tier drops its oldest, and the tree
holds 2N nodes.

With --shape chain the N prefixes are one conversation recorded at every
turn, one page a turn: a path N nodes deep. Half of it is evicted before the
timed creates (other requests hold the chunks), so each timed create takes
the deepest node left; with --tier it spills a node whose descendants, N/2
or more, are all on the host already. Repeats are capped at N/2 - 1.

    python scripts/bench_eviction.py [--sizes 100,1000,16000] [--repeats 300] [--tier] [--shape flat|chain]
                                     [--json PATH]

Run it with the installed package (e.g. .venv/bin/python scripts/bench_eviction.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from machine import cpu_model

CHUNK = 64 << 10  # host backend pages of 64 KiB: 16,000 prefixes take 1 GiB


def timed_us(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def record_chain(space, nodes: int) -> None:
    """One vTensor growing a page a turn, recorded at every turn."""
    vt = space.create(1).result()
    tokens = []
    for i in range(nodes):
        tokens.append(i)
        if i:
            vt.extend(i + 1).result()
        space.prefix_record(vt, tokens).result()
    vt.release().result()


def measure(nodes: int, repeats: int, tier: bool, chain: bool = False) -> dict:
    import vtm

    held = 3  # live vTensors of 2 pages: the pool is full with them and the prefixes
    mgr = vtm.Manager(backend="host", capacity_bytes=(nodes + 2 * held) * CHUNK, chunk_bytes=CHUNK,
                      granularity=CHUNK, slot_cache_bytes=0, host_tier_bytes=nodes * CHUNK if tier else 0)
    try:
        space = mgr.create_space(row_bytes=CHUNK, max_tokens=nodes + 4, max_slots=held + 2)
        pressure = []
        if chain:
            repeats = min(repeats, nodes // 2 - 1)
            record_chain(space, nodes)
            pressure.append(space.create(nodes // 2).result())  # evicts (spills) the deeper half
        else:
            for i in range(2 * nodes if tier else nodes):
                vt = space.create(1).result()
                space.prefix_record(vt, [i]).result()
                vt.release().result()
        live = [space.create(2).result() for _ in range(held)]
        evicting, free = [], []
        for r in range(repeats):
            vt = None

            def create():
                nonlocal vt
                vt = space.create(1).result()
            evicting.append(timed_us(create))
            space.prefix_record(vt, [3 * nodes + r]).result()  # the tree keeps its size
            vt.release().result()
            live[0].release().result()  # two free chunks
            free.append(timed_us(create))
            vt.release().result()
            live[0] = space.create(2).result()  # the pool is full again
        stats = mgr.stats()
        for vt in live + pressure:
            vt.release().result()
        mgr.check()
    finally:
        mgr.close()
    evict_p50, free_p50 = statistics.median(evicting), statistics.median(free)
    return {"tree_nodes": stats["tree_nodes"], "host_tier_nodes": stats["host_tier_nodes"],
            "evicting_p50_us": evict_p50, "free_chunk_p50_us": free_p50, "ratio": evict_p50 / free_p50,
            "evictions": stats["evictions_total"], "spills": stats["spills_total"], "repeats": repeats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100,1000,16000", help="prefix tree sizes (nodes), comma-separated")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--tier", action="store_true", help="a host tier of N chunks, full: evictions spill")
    parser.add_argument("--shape", choices=["flat", "chain"], default="flat",
                        help="N one-page prefixes side by side (flat), or one path N pages deep (chain)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    chain = args.shape == "chain"
    if chain and min(sizes) < 4:
        parser.error("--shape chain needs paths of at least 4 nodes (half of one is evicted, then N/2 - 1 timed)")
    what = " (spills it)" if args.tier and chain else " (spills it, the tier drops one)" if args.tier else ""
    where = "of one path N pages deep, half evicted" if chain else "of N side by side"
    print(f"A one-page create that evicts a cached prefix {where}{what}, against one served from a free "
          f"chunk (host backend, {CHUNK >> 10} KiB chunks, medians of up to {args.repeats}); CPU: {cpu_model()}")
    print(f"{'N':>6} {'tree nodes':>10} {'evicting µs':>12} {'free chunk µs':>14} {'ratio':>7}")
    rows = []
    for n in sizes:
        row = measure(n, args.repeats, args.tier, chain)
        rows.append(row)
        print(f"{n:>6} {row['tree_nodes']:>10} {row['evicting_p50_us']:>12.1f} {row['free_chunk_p50_us']:>14.1f} "
              f"{row['ratio']:>6.2f}x", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"machine": cpu_model(), "tier": args.tier, "shape": args.shape, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
