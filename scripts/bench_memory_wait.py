"""A request on a shared pool while another user holds the memory it needs.

An in-process vtm pool of 16 chunks of 64 KiB is given to a FlexInfer engine
(`manager=`), so the engine shares it; another space on the same pool takes
all 16 and gives them back after `--hold` seconds. The engine's request
(8 prompt tokens and 600 new ones, greedy, on a 1-layer 64-wide random
model: 608 rows of 256 bytes, 3 chunks) cannot map a page before then.

Two engines on the same pool, in the same invocation, each `--repeats`
times:
- `memory_wait_s=0`: the behaviour before the memory wait, the baseline.
  Alone in its engine and out of memory, the request fails at once with
  vtm.OutOfMemory.
- `memory_wait_s=30` (the default): the request goes back to the queue and
  is tried again every 50 ms until the memory comes back.

Reported per engine: requests that finished, the median time from the
release to the request's first token (how soon a waiting request notices),
and the process CPU time per second of waiting (the engine sleeps between
tries: a spin would take a whole core, 1.0).

Usage: python scripts/bench_memory_wait.py [--hold 1.0] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from bench_gpu import build_model_folder
from machine import cpu_model

import vtm
from flexinfer import LLM, SamplingParams

SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-5,
             rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
CHUNK = 64 << 10
CHUNKS = 16
HELD = CHUNKS
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
NEW_TOKENS = 600


def one_request(llm: LLM, other: vtm.Space, hold_s: float) -> dict:
    """The request while `other` holds HELD chunks for hold_s seconds."""
    held = other.create(HELD).result()
    released = {}

    def release() -> None:
        released["cpu"] = time.process_time()
        released["at"] = time.perf_counter()
        held.release().result()
    timer = threading.Timer(hold_s, release)
    cpu_start, start = time.process_time(), time.perf_counter()
    timer.start()
    first = {}

    def deliver(event) -> None:
        if event is not None and "at" not in first:
            first["at"] = time.perf_counter()
    out = llm.submit(PROMPT, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
                     deliver=deliver).result()
    timer.join()
    ok = out.outputs[0].error is None
    waited = released["at"] - start
    return {"finished": ok,
            "release_to_first_token_ms": (first["at"] - released["at"]) * 1e3 if ok else None,
            "cpu_per_wait_s": (released["cpu"] - cpu_start) / waited if ok else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold", type=float, default=1.0, help="seconds the other user holds the memory")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    results = {"cpu": cpu_model(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "hold_s": args.hold, "repeats": args.repeats, "engines": {}}
    with tempfile.TemporaryDirectory() as tmp:
        build_model_folder(Path(tmp), SHAPE)
        manager = vtm.Manager(backend="host", capacity_bytes=CHUNKS * CHUNK, chunk_bytes=CHUNK, granularity=CHUNK)
        other = manager.create_space(row_bytes=CHUNK, max_tokens=CHUNKS, max_slots=1, name="other")
        for wait_s in (0.0, 30.0):
            with LLM(tmp, manager=manager, memory_wait_s=wait_s, threads=1, enable_prefix_caching=False) as llm:
                runs = [one_request(llm, other, args.hold) for _ in range(args.repeats)]
            done = [r for r in runs if r["finished"]]
            summary = {"finished": f"{len(done)}/{len(runs)}",
                       "release_to_first_token_ms": statistics.median(r["release_to_first_token_ms"] for r in done)
                       if done else None,
                       "cpu_per_wait_s": statistics.median(r["cpu_per_wait_s"] for r in done) if done else None}
            results["engines"][f"memory_wait_s={wait_s:g}"] = summary
        other.close()
        manager.close()
    print(f"CPU: {results['cpu']}; the other user holds {HELD} of {CHUNKS} chunks for {args.hold:g} s; "
          f"{args.repeats} requests per engine")
    print(f"{'engine':<20} {'finished':>9} {'release -> 1st token ms':>24} {'CPU s per s waiting':>20}")
    for name, s in results["engines"].items():
        latency = "-" if s["release_to_first_token_ms"] is None else f"{s['release_to_first_token_ms']:.1f}"
        cpu = "-" if s["cpu_per_wait_s"] is None else f"{s['cpu_per_wait_s']:.3f}"
        print(f"{name:<20} {s['finished']:>9} {latency:>24} {cpu:>20}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
