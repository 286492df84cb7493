"""Preemption by recompute against preemption by swap (issue 21, item 2), in
one process, on a pool too small for the batch.

`--requests` prompts of `--prompt` tokens are submitted together, each to
generate `--max-tokens` greedy tokens, on a device pool that holds `--pool`
requests' KV at their full length: the scheduler admits more than fit and
preempts the latest ones as the running ones grow. With
`preemption="recompute"` (prefix caching off, so nothing else keeps the KV)
a readmitted request computes its prompt and its output so far again; with
`preemption="swap"` its KV was recorded (in one operation with its release)
and kept, spilled to vtm's host tier when the pool needed the chunks, and
its readmission copies it back. Both engines run the same requests on the
same weights (the defaults admit about twice the requests the pool holds at
their full length, so the running ones outgrow it); reported per engine: the wall time and the output tokens per
second, the latency from submission to the last token (p50, p99), the
preemptions, and the tokens swapped out and back in; then the ratios. The
greedy outputs must be equal on the host backend (float32).

On the host backend a swap-in is a memory copy and a recompute is a prefill
of the request so far, so the more a preempted request had computed, the
more swap saves.

Usage: python scripts/bench_swap.py [--quick] [--json PATH] [--model smollm2|random|FOLDER]
           [--requests 8] [--prompt 256] [--max-tokens 256] [--pool 2] [--backend host|cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from flexinfer import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tier import CHUNK, model_path, pct  # noqa: E402
from machine import cpu_model  # noqa: E402


def request_chunks(args, row_bytes: list[int]) -> int:
    """The chunks one request's KV takes at its full length, one space per group."""
    return sum(-(-(args.prompt + args.max_tokens) * row // CHUNK) + 1 for row in row_bytes)


def prompts(args, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [[1] + torch.randint(3, vocab, (args.prompt - 1,), generator=g).tolist() for _ in range(args.requests)]


def run(args, path: str, per_request: int, vocab: int, preemption: str) -> dict:
    llm = LLM(path, dtype=args.dtype, backend=args.backend, max_num_seqs=args.requests, max_model_len=8192,
              enable_prefix_caching=False, preemption=preemption,
              kv_capacity_bytes=args.pool * per_request * CHUNK,
              host_tier_bytes=2 * args.requests * per_request * CHUNK if preemption == "swap" else 0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    try:
        llm.generate([[1, 5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = [o.outputs[0] for o in llm.generate(prompts(args, vocab), params, use_tqdm=False)]
        elapsed = time.perf_counter() - start
        stats = llm.stats()
    finally:
        llm.close()
    failed = [o for o in outputs if o.finish_reason != "length"]
    if failed:
        sys.exit(f"{preemption}: {len(failed)} requests ended early: {failed[0].finish_reason} {failed[0].error or ''}")
    latencies = [o.metrics.finish_s - o.metrics.arrival_s for o in outputs]
    vtm_stats = stats["vtm"]
    return dict(preemption=preemption, elapsed_s=elapsed,
                output_tokens_per_s=sum(len(o.token_ids) for o in outputs) / elapsed,
                e2e_p50_s=statistics.median(latencies), e2e_p99_s=pct(latencies, 99),
                preemptions=stats["preemptions"], swap_out_tokens=stats["swap_out_tokens"],
                swap_in_tokens=stats["swap_in_tokens"], spills=vtm_stats["spills_total"],
                restores=vtm_stats["restores_total"], outputs=[o.token_ids for o in outputs])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--backend", default="host", choices=["host", "cuda"])
    ap.add_argument("--dtype", default=None, help="default: float32 on host, bfloat16 on cuda")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256, help="tokens of each prompt")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--pool", type=int, default=2, help="requests the device pool holds at their full length")
    ap.add_argument("--quick", action="store_true", help="6 requests of 128 + 16 tokens, a pool of 2")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.requests, args.prompt, args.max_tokens, args.pool = 6, 128, 16, 2
    args.dtype = args.dtype or ("float32" if args.backend == "host" else "bfloat16")
    print(f"CPU: {cpu_model()}" + (f", GPU: {torch.cuda.get_device_name()}" if args.backend == "cuda" else ""))
    with tempfile.TemporaryDirectory(prefix="bench-swap-") as tmp:
        path = model_path(args.model, Path(tmp), "llama", 0)
        with LLM(path, dtype=args.dtype, backend=args.backend, kv_capacity_bytes=64 << 20) as probe:
            row_bytes = [space.row_bytes for space in probe.kv_cache.spaces]
            vocab = probe.config.vocab_size
        per_request = request_chunks(args, row_bytes)
        print(f"{args.requests} requests of {args.prompt} + {args.max_tokens} tokens at once, a pool of "
              f"{args.pool} requests ({args.pool * per_request} chunks), prefix caching off, "
              f"{args.backend} {args.dtype}")
        recompute = run(args, path, per_request, vocab, "recompute")
        swap = run(args, path, per_request, vocab, "swap")
    pairs = list(zip(recompute.pop("outputs"), swap.pop("outputs")))
    equal = sum(a == b for a, b in pairs)
    print(f"{'':<10} {'wall s':>8} {'out tok/s':>10} {'e2e p50 s':>10} {'e2e p99 s':>10} {'preempted':>10} "
          f"{'swapped out/in tokens':>22}")
    for r in (recompute, swap):
        print(f"{r['preemption']:<10} {r['elapsed_s']:>8.2f} {r['output_tokens_per_s']:>10.1f} "
              f"{r['e2e_p50_s']:>10.2f} {r['e2e_p99_s']:>10.2f} {r['preemptions']:>10} "
              f"{r['swap_out_tokens']:>10} / {r['swap_in_tokens']:<10}")
    ratios = dict(wall=recompute["elapsed_s"] / swap["elapsed_s"],
                  e2e_p50=recompute["e2e_p50_s"] / swap["e2e_p50_s"],
                  e2e_p99=recompute["e2e_p99_s"] / swap["e2e_p99_s"])
    print(f"swap: {ratios['wall']:.2f}x faster in all, e2e latency {ratios['e2e_p50']:.2f}x better at p50, "
          f"{ratios['e2e_p99']:.2f}x at p99; greedy outputs "
          f"{'equal' if equal == len(pairs) else f'equal in {equal} of {len(pairs)}'}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(cpu=cpu_model(), args=vars(args), recompute=recompute, swap=swap,
                                                    ratios=ratios, equal_outputs=equal, outputs=len(pairs)),
                                              indent=2))
    if equal != len(pairs) and args.backend == "host":
        sys.exit("the greedy outputs differ between recompute and swap")


if __name__ == "__main__":
    main()
