"""A short walkthrough of vtm: a space, requests created and extended, one
prefix recorded and matched (with its bytes checked), stats before and after.

Run it with `make demo`.
"""

from __future__ import annotations

import numpy as np

import vtm

ROW_BYTES = 46080  # SmolLM2-135M: 30 layers x (K + V) x 3 KV heads x 64 dims x 2 bytes
CHUNK = 2 << 20


def show(title: str, stats: dict) -> None:
    keys = ("chunks_created", "chunks_free", "chunks_held", "chunks_mapped", "chunks_in_tree", "chunks_cached",
            "tree_nodes", "tree_tokens", "cow_copies_total", "slot_reuses_total")
    print(f"\n== {title}")
    print("   " + "  ".join(f"{k}={stats[k]}" for k in keys))
    for name, sp in stats["spaces"].items():
        print(f"   space {name}: {sp['vtensors']} vTensors, {sp['used_tokens']} tokens = {sp['used_bytes']} B used "
              f"in {sp['mapped_bytes']} B mapped, {sp['cached_bytes']} B cached in released slots")


def row_pattern(token_prefix_hash: int, position: int) -> np.ndarray:
    return np.random.default_rng([token_prefix_hash & 0xFFFFFFFF, position]).integers(0, 256, ROW_BYTES, np.uint8)


def main() -> None:
    backend = "cuda" if vtm.cuda_available() else "host"
    with vtm.Manager(backend="host", capacity_bytes=256 << 20, chunk_bytes=CHUNK, prealloc_chunks=4) as mgr:
        print(f"vtm demo: host backend (a CUDA driver is {'present' if backend == 'cuda' else 'absent'} here), "
              f"capacity {mgr.capacity_bytes >> 20} MiB in {mgr.chunk_bytes >> 20} MiB chunks")
        space = mgr.create_space(row_bytes=ROW_BYTES, max_tokens=4096, max_slots=16, namespace="smollm2")
        print(f"space: {space.max_slots} slots of {space.slot_bytes >> 20} MiB reserved, nothing mapped yet")
        kv = space.tensor(np.uint8)
        show("empty", mgr.stats())

        prompt = list(range(1000, 1300))  # a 300-token "conversation"
        vt = space.create(100).result()
        print(f"\ncreate(100): slot {vt.slot}, {vt.mapped_bytes >> 20} MiB mapped at {vt.address:#x}")
        vt.extend(300).result()
        print(f"extend(300): {vt.num_tokens} tokens, {vt.mapped_bytes >> 20} MiB mapped")
        others = [space.create(n).result() for n in (17, 64, 700)]
        mgr.step({o: o.num_tokens + 1 for o in others}).result()
        print(f"step over {len(others)} vTensors: sizes {[o.num_tokens for o in others]}")

        # Write each token's KV row through the tensor view, then share it.
        for t in range(len(prompt)):
            kv[vt.slot, t * ROW_BYTES:(t + 1) * ROW_BYTES] = row_pattern(hash(tuple(prompt[: t + 1])), t)
        added = space.prefix_record(vt, prompt).result()
        print(f"\nprefix_record: {added} tokens recorded in the tree")
        show("after create / extend / record", mgr.stats())

        turn2 = prompt + list(range(5000, 5040))  # the next turn extends the conversation
        match = space.prefix_match(turn2).result()
        m = match.vtensor
        same = sum(a == b for a, b in zip(vt.page_chunks(), m.page_chunks()) if a is not None)
        ok = all(
            np.array_equal(kv[m.slot, t * ROW_BYTES:(t + 1) * ROW_BYTES], row_pattern(hash(tuple(turn2[: t + 1])), t))
            for t in range(match.num_tokens)
        )
        print(f"\nprefix_match(turn 2, {len(turn2)} tokens): reused {match.num_tokens} tokens in slot {m.slot}; "
              f"{same} pages map the same chunks, the partial last page is a private copy; bytes identical: {ok}")
        m.extend(len(turn2)).result()

        for v in [vt, m, *others]:
            v.release().result()
        show("after release (private pages stay mapped for reuse, the tree keeps the prefix)", mgr.stats())
        dropped = space.clear_prefixes()
        freed = mgr.trim()
        show(f"after clear_prefixes ({dropped} nodes) and trim ({freed >> 20} MiB back to the device)", mgr.stats())
        mgr.check()
        ops = mgr.stats()["ops"]
        print("\nop latency on the worker (mean us): " +
              ", ".join(f"{k} {v['mean_us']:.0f}" for k, v in sorted(ops.items())))
        del kv


if __name__ == "__main__":
    main()
