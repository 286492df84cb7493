"""Colocation through the vtm broker (vtmd), against the in-process baselines.

Three parts, each a comparison within one run (docs/design.md §7):

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
3. Cross-process prefix reuse: instance B answers a conversation instance A
   served, mapping A's recorded prefix through the broker, against B
   recomputing it (prefix caching off). Target: TTFT >= 3x better.

    python scripts/bench_colocation.py [--quick] [--json PATH] [--model smollm2] [--parts rpc,burst,prefix]

Run with the installed package, from a directory other than the repository
root. Smoke test only on a shared machine; the real numbers come from an idle
one (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import subprocess
import sys
import tempfile
import time

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

def time_steps(mgr, repeats, batch, row, grow):
    space = mgr.create_space(row_bytes=row, max_tokens=8192, max_slots=batch, name=f"bench{grow}")
    vts = [space.create(1).result() for _ in range(batch)]
    n = 1
    samples = []
    for i in range(repeats + 10):
        n += 1 if grow else 0
        t0 = time.perf_counter()
        mgr.step({vt: n for vt in vts}).result()
        if i >= 10:  # warm-up: imports, first pages
            samples.append((time.perf_counter() - t0) * 1e6)
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
        over_grpc = vtm.connect(address, name="bench-rpc-grpc", fast_path=False)
        for grow, label in ((False, "step, no mapping"), (True, "step, +1 token each")):
            base = time_steps(local, args.repeats, 32, 46080, grow)
            over = time_steps(remote, args.repeats, 32, 46080, grow)
            grpc_only = time_steps(over_grpc, args.repeats, 32, 46080, grow)
            rows.append({"case": label, "batch": 32, "in_process_p50_us": pct(base, 50),
                         "in_process_p99_us": pct(base, 99), "broker_p50_us": pct(over, 50),
                         "broker_p99_us": pct(over, 99), "ratio_p50": pct(over, 50) / pct(base, 50),
                         "grpc_p50_us": pct(grpc_only, 50), "grpc_p99_us": pct(grpc_only, 99),
                         "grpc_over_broker_p50": pct(grpc_only, 50) / pct(over, 50), "target_p50_us": 300})
        over_grpc.close()
        remote.close()
        local.close()
    finally:
        stop_broker(proc)
    print(f"\n1. batched step over 32 vTensors ({args.backend}, {args.repeats} repeats; "
          f"broker = the step socket, gRPC = the same client over gRPC only)")
    print(f"{'case':<22} {'in-proc p50':>12} {'p99':>9} {'broker p50':>11} {'p99':>9} {'ratio':>7} "
          f"{'gRPC p50':>10} {'p99':>9} {'gRPC/broker':>12}")
    for r in rows:
        print(f"{r['case']:<22} {r['in_process_p50_us']:>10.1f}us {r['in_process_p99_us']:>7.1f}us "
              f"{r['broker_p50_us']:>9.1f}us {r['broker_p99_us']:>7.1f}us {r['ratio_p50']:>6.1f}x "
              f"{r['grpc_p50_us']:>8.1f}us {r['grpc_p99_us']:>7.1f}us {r['grpc_over_broker_p50']:>11.1f}x")
    return rows


# ----------------------------------------------------------------------------- 2 and 3: engines

def engine_worker(conn, model, manager_address, capacity_bytes, backend, max_model_len, prefix_caching):
    """One FlexInfer instance in its own process, driven over a pipe."""
    import vtm
    from flexinfer import LLM, SamplingParams

    manager = vtm.connect(manager_address, name=f"engine-{os.getpid()}") if manager_address else None
    llm = LLM(model, manager=manager, kv_capacity_bytes=capacity_bytes, backend=backend, max_num_seqs=16,
              max_model_len=max_model_len, enable_prefix_caching=prefix_caching)
    # Warm-up (kernel setup, first imports of chunks), then its tree entry goes.
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
    llm.kv_cache.clear_prefixes()
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
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
    def __init__(self, n, model, addresses, capacity_bytes, backend, max_model_len, prefix_caching=True):
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for i in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=engine_worker, args=(child, model, addresses[i], capacity_bytes, backend,
                                                        max_model_len, prefix_caching), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            assert c.recv() == "ready"

    def run(self, i, prompts, max_tokens):
        self.conns[i].send((prompts, max_tokens))
        return self.conns[i].recv()

    def close(self):
        for c in self.conns:
            c.send(None)
        for p in self.procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def bursts(engines, rounds, burst, prompt_len, max_tokens, seed):
    import random

    rng = random.Random(seed)
    ttft, wall, tokens, preempt, errors = [], 0.0, 0, 0, 0
    for r in range(rounds):
        prompts = [[rng.randrange(100, 40000) for _ in range(prompt_len)] for _ in range(burst)]
        out = engines.run(r % 2, prompts, max_tokens)
        ttft += [t for t in out["ttft_s"] if t is not None]
        wall += out["wall_s"]
        tokens += out["tokens"]
        preempt += out["preemptions"]
        errors += len(out["errors"])
    return {"ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p99_ms": pct(ttft, 99) * 1e3, "tokens_per_s": tokens / wall,
            "preemptions": preempt, "failed_requests": errors}


def part_burst(args, folder):
    # A burst needs about 70% of the memory: it fits in the shared pool, not in a half.
    row = 46080  # SmolLM2 float32
    need = args.burst * (args.prompt_len + args.max_tokens) * row
    capacity = int(need / 0.7) // (2 * MiB) * (2 * MiB)
    proc, address = start_broker(folder, capacity, 2 * MiB, args.backend)
    try:
        shared = Engines(2, args.model, [address, address], capacity, args.backend, args.prompt_len + args.max_tokens)
        try:
            broker_row = bursts(shared, args.rounds, args.burst, args.prompt_len, args.max_tokens, 1)
        finally:
            shared.close()
    finally:
        stop_broker(proc)
    split = Engines(2, args.model, [None, None], capacity // 2 // (2 * MiB) * (2 * MiB), args.backend,
                    args.prompt_len + args.max_tokens)
    try:
        static_row = bursts(split, args.rounds, args.burst, args.prompt_len, args.max_tokens, 1)
    finally:
        split.close()
    rows = [dict(setup="broker (shared pool)", capacity_bytes=capacity, **broker_row),
            dict(setup="static 50/50 split", capacity_bytes=capacity, **static_row)]
    print(f"\n2. bursty alternating load: 2 instances, {args.rounds} bursts of {args.burst} x "
          f"({args.prompt_len} + {args.max_tokens}) tokens, {capacity / MiB:.0f} MiB in all")
    print(f"{'setup':<22} {'TTFT p50':>10} {'TTFT p99':>10} {'tok/s':>8} {'preempt':>8} {'failed':>7}")
    for r in rows:
        print(f"{r['setup']:<22} {r['ttft_p50_ms']:>8.0f}ms {r['ttft_p99_ms']:>8.0f}ms {r['tokens_per_s']:>8.1f} "
              f"{r['preemptions']:>8} {r['failed_requests']:>7}")
    print(f"p99 TTFT static / broker: {static_row['ttft_p99_ms'] / broker_row['ttft_p99_ms']:.2f}x (target >= 2x)")
    return rows


def part_prefix(args, folder):
    import random

    rng = random.Random(7)
    conversation = [rng.randrange(100, 40000) for _ in range(args.prefix_len)]
    follow_up = conversation + [rng.randrange(100, 40000) for _ in range(16)]
    capacity = 512 * MiB
    proc, address = start_broker(folder, capacity, 2 * MiB, args.backend)
    try:
        pair = Engines(2, args.model, [address, address], capacity, args.backend, args.prefix_len + 64)
        try:
            pair.run(0, [conversation], 8)  # A serves the conversation and records it
            reuse = pair.run(1, [follow_up], 8)  # B maps A's prefix
        finally:
            pair.close()
    finally:
        stop_broker(proc)
    alone = Engines(1, args.model, [None], capacity, args.backend, args.prefix_len + 64, prefix_caching=False)
    try:
        recompute = alone.run(0, [follow_up], 8)
    finally:
        alone.close()
    row = {"prefix_tokens": args.prefix_len, "reuse_ttft_ms": reuse["ttft_s"][0] * 1e3,
           "reuse_hit_tokens": reuse["prefix_hits"][0], "recompute_ttft_ms": recompute["ttft_s"][0] * 1e3,
           "speedup": recompute["ttft_s"][0] / reuse["ttft_s"][0], "target": 3.0}
    print(f"\n3. cross-process prefix reuse ({args.prefix_len}-token conversation + 16 new tokens)")
    print(f"B maps A's prefix: TTFT {row['reuse_ttft_ms']:.0f} ms ({row['reuse_hit_tokens']} tokens mapped); "
          f"B recomputes: {row['recompute_ttft_ms']:.0f} ms; speedup {row['speedup']:.2f}x (target >= 3x)")
    return [row]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="a smoke test: few repeats, small bursts")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--backend", default="host", choices=["host", "cuda"])
    parser.add_argument("--parts", default="rpc,burst,prefix")
    args = parser.parse_args()
    q = args.quick
    args.repeats = 50 if q else 1000
    args.rounds, args.burst, args.prompt_len, args.max_tokens = (2, 2, 32, 4) if q else (8, 8, 256, 64)
    args.prefix_len = 64 if q else 1024
    parts = set(args.parts.split(","))
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "machine": platform.processor()
              or platform.machine(), "cpu_count": os.cpu_count(), "quick": q, "backend": args.backend}
    with tempfile.TemporaryDirectory() as folder:
        if "rpc" in parts:
            result["rpc_step"] = part_rpc(args, folder)
        if "burst" in parts:
            result["bursty"] = part_burst(args, folder)
        if "prefix" in parts:
            result["prefix_reuse"] = part_prefix(args, folder)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
