"""The elementwise parts of a SmolLM2 decode step: torch ops against the fused CPU layer ops.

Per call, at each batch size (rows = tokens in the step), in float32 and bfloat16:
  rms_norm         F.rms_norm                                  vs cpu_layer_ops.rms_norm
  silu_mul         chunk + F.silu(gate) * up                   vs cpu_layer_ops.silu_mul
  rotary_kv_write  LlamaModel._rotate_ + KVCache.write         vs cpu_layer_ops.rotary_kv_write
The K/V write goes into a real vtm KV cache (host backend, every slot mapped),
one request per slot at scattered positions. Times are medians over repeats of a
burst of calls, Python wrappers included (they are part of what a step pays).
The step estimate weighs each op by its calls per SmolLM2 step: 61 norms
(2 per layer + the final one), 30 SiLU*up, 30 rotary + K/V writes.

Both sides use torch's thread count (--threads sets it); on a machine shared with
other processes, two-thread OpenMP regions stall when a thread is descheduled, so
use --threads 1 there.

Usage: python scripts/bench_layer_ops.py [--rows 1,32] [--dtypes float32,bfloat16] [--threads N] [--repeats 7]
                                         [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

import vtm
from flexinfer.kernels import cpu_layer_ops
from flexinfer.kv_cache import KVCache
from flexinfer.model.config import ModelConfig
from flexinfer.model.llama import LlamaModel
from machine import cpu_model, median_per_call_s

# SmolLM2-135M: hidden 576, intermediate 1536, 9 query + 3 KV heads of 64, 30 layers.
CONFIG = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                     rms_norm_eps=1e-5, rope_theta=1e5, rope_scaling=None, max_position_embeddings=8192,
                     tie_word_embeddings=True, attention_bias=False, bos_token_id=1, eos_token_ids=(2,))
CALLS_PER_STEP = {"rms_norm": 61, "silu_mul": 30, "rotary_kv_write": 30}
MAX_TOKENS = 64
CALLS_PER_SAMPLE = 50


class Batch:
    """The two vectors KVCache.write reads from a ForwardBatch."""

    def __init__(self, slots: torch.Tensor, positions: torch.Tensor):
        self.slot_index, self.positions = [slots], positions


def bench_dtype(dtype, rows: int, manager, repeats: int) -> list[dict]:
    c = CONFIG
    gen = torch.Generator().manual_seed(rows)
    eps = c.rms_norm_eps
    x = torch.randn(rows, c.hidden_size, generator=gen).to(dtype)
    weight = torch.randn(c.hidden_size, generator=gen).to(dtype)
    gate_up = torch.randn(rows, 2 * c.intermediate_size, generator=gen).to(dtype)
    heads, kv_heads, dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    qkv = torch.randn(rows, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    kv = KVCache(manager, c, dtype, max_tokens=MAX_TOKENS, max_slots=rows)
    vts = [vt for _ in range(rows) for vt in kv.create(MAX_TOKENS)]
    slots = torch.tensor([vt.slot for vt in vts], dtype=torch.long)
    positions = torch.randint(0, MAX_TOKENS, (rows,), generator=gen)
    batch = Batch(slots, positions)
    freqs = positions.float()[:, None] * torch.rand(dim // 2, generator=gen)[None, :]
    cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1).to(dtype)
    sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1).to(dtype)
    layer = 15

    def torch_silu():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def torch_rotary():
        LlamaModel._rotate_(qkv[:, : heads + kv_heads], cos[:, None], sin[:, None])
        kv.write(layer, batch, qkv[:, heads:].view(rows, 2, kv_heads, dim))

    cases = {
        "rms_norm": (lambda: F.rms_norm(x, (c.hidden_size,), weight, eps),
                     lambda: cpu_layer_ops.rms_norm(x, weight, eps)),
        "silu_mul": (torch_silu, lambda: cpu_layer_ops.silu_mul(gate_up)),
        "rotary_kv_write": (torch_rotary,
                            lambda: cpu_layer_ops.rotary_kv_write(qkv, heads, cos, sin, kv.kv[layer],
                                                                  kv.slot_index(layer, batch), positions)),
    }
    results = []
    with torch.inference_mode():
        for op, (baseline, fused) in cases.items():
            t_torch, t_fused = (median_per_call_s(f, repeats, CALLS_PER_SAMPLE, warmup=3) * 1e6 for f in (baseline, fused))
            results.append(dict(op=op, dtype=str(dtype).replace("torch.", ""), rows=rows, torch_us=t_torch,
                                fused_us=t_fused, ratio=t_fused / t_torch))
    kv.release(vts)
    kv.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,32")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"{cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    results, steps = [], []
    with vtm.Manager(backend="host", capacity_bytes=1 << 30, chunk_bytes=2 << 20) as manager:
        print(f"{'op':<16} {'dtype':<9} {'rows':>4} {'torch us':>9} {'fused us':>9} {'ratio':>6}")
        for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
            for rows in [int(r) for r in args.rows.split(",")]:
                part = bench_dtype(dtype, rows, manager, args.repeats)
                for r in part:
                    print(f"{r['op']:<16} {r['dtype']:<9} {r['rows']:>4} {r['torch_us']:9.1f} {r['fused_us']:9.1f} "
                          f"{r['ratio']:6.2f}")
                step = dict(dtype=part[0]["dtype"], rows=rows,
                            torch_ms=sum(r["torch_us"] * CALLS_PER_STEP[r["op"]] for r in part) / 1e3,
                            fused_ms=sum(r["fused_us"] * CALLS_PER_STEP[r["op"]] for r in part) / 1e3)
                steps.append(step)
                results.extend(part)
    print("per SmolLM2 decode step (61 norms, 30 SiLU*up, 30 rotary + K/V writes):")
    for s in steps:
        print(f"  {s['dtype']:<9} rows {s['rows']:>3}: torch {s['torch_ms']:6.2f} ms, fused {s['fused_ms']:6.2f} ms "
              f"({s['fused_ms'] / s['torch_ms']:.2f}x)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(cpu=cpu_model(), torch=torch.__version__, threads=torch.get_num_threads(),
                           ops=results, steps=steps), f, indent=2)


if __name__ == "__main__":
    main()
