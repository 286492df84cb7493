"""Decode attention for one layer over a vtm space: the batched CPU kernel
(one call for the whole batch) against per-request SDPA (the previous path,
one call per request), same views, same run.

The cache is a real KVCache on the host backend with SmolLM2-135M's geometry
(30 layers, 3 KV heads of 64, 9 query heads), token-major, every request at
the same context length. Times are medians of `--repeats` rounds of
`--calls` calls each (wall time per call, in microseconds), per batch size and
context, with the ratio SDPA / kernel.

Usage: python scripts/bench_attention.py [--dtype float32|bfloat16] [--batches 1,8,32]
           [--contexts 128,512,2048] [--threads N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch

import vtm
from flexinfer.attention import KernelAttention, SdpaAttention
from flexinfer.kv_cache import KVCache
from flexinfer.model.config import ModelConfig
from flexinfer.model.llama import ForwardBatch
from machine import cpu_model, median_per_call_s

SMOLLM2 = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="128,512,2048")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    config = ModelConfig.from_hf_dict(SMOLLM2)
    row_bytes = config.kv_row_bytes(torch.empty((), dtype=dtype).element_size())
    max_tokens = max(contexts) + 1
    chunk = 2 << 20
    per_request = -(-max_tokens * row_bytes // chunk) * chunk
    mgr = vtm.Manager(backend="host", capacity_bytes=max(batches) * per_request + 32 * chunk, chunk_bytes=chunk)
    cache = KVCache(mgr, config, dtype, max_tokens, max(batches))
    vts = [cache.create()[0] for _ in range(max(batches))]
    for vt in vts:
        vt.extend(max(contexts)).result()
    layer = 15
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads, {args.dtype}, SmolLM2 geometry, layer {layer} "
          f"of a token-major cache on vtm host memory")
    print(f"{'batch':>5} {'context':>7} {'kernel us':>10} {'SDPA us':>10} {'SDPA/kernel':>12}")
    rows = []
    kernel, sdpa = KernelAttention(torch.device("cpu")), SdpaAttention()
    for batch in batches:
        for context in contexts:
            fb = ForwardBatch.build([vt.slot for vt in vts[:batch]], [context - 1] * batch, [1] * batch, "cpu")
            q = torch.randn(batch, config.num_attention_heads, config.head_dim).to(dtype)
            kernel.prepare(fb, cache)
            sdpa.prepare(fb, cache)
            ours = median_per_call_s(lambda: kernel.forward(layer, q, fb, cache), args.repeats, args.calls) * 1e6
            theirs = median_per_call_s(lambda: sdpa.forward(layer, q, fb, cache), args.repeats, args.calls) * 1e6
            rows.append(dict(batch=batch, context=context, kernel_us=ours, sdpa_us=theirs, ratio=theirs / ours))
            print(f"{batch:>5} {context:>7} {ours:>10.1f} {theirs:>10.1f} {theirs / ours:>11.2f}x", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(cpu=cpu_model(), threads=torch.get_num_threads(), dtype=args.dtype, rows=rows), f, indent=2)
    cache.release(vts)
    cache.close()
    mgr.close()


if __name__ == "__main__":
    main()
