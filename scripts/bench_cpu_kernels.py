"""FlexInfer's CPU kernels against torch's equivalents, op by op, in one process.

Each row times one kernel call on hot caches (median of --calls calls, one
thread) beside the torch ops it replaces, and reports their ratio:
  greedy_pick      torch.argmax over the logits      vs _kernels.greedy_pick
  silu_mul         F.silu(gate) * up                 vs cpu_layer_ops.silu_mul
  rms_norm         F.rms_norm                        vs cpu_layer_ops.rms_norm
  decode attention per-request SDPA                  vs cpu_attention.Plan.run
The shapes are SmolLM2-135M's (vocabulary 49,152, hidden 576, intermediate
1,536, 9 heads of 64 over 3 KV heads). The kernels run the vector width the
CPU's features pick (16 lanes with AVX-512, 8 elsewhere; cpu_vec.h), printed
with the CPU model. To compare two builds, run the script with each
on PYTHONPATH, alternately.

Usage: python scripts/bench_cpu_kernels.py [--calls 200] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_model, median_per_call_s  # noqa: E402

from flexinfer import _kernels  # noqa: E402
from flexinfer.kernels import cpu_attention, cpu_layer_ops  # noqa: E402


def median_us(fn, calls: int) -> float:
    return median_per_call_s(fn, repeats=calls, warmup=max(3, calls // 20)) * 1e6


def rows(calls: int):
    torch.manual_seed(0)
    for batch, vocab in ((1, 49152), (32, 49152), (256, 512)):
        logits = torch.randn(batch, vocab)
        out = torch.empty(batch, dtype=torch.long)
        yield (f"greedy_pick {batch}x{vocab}", median_us(lambda: logits.argmax(dim=-1), calls),
               median_us(lambda: _kernels.greedy_pick(logits.data_ptr(), batch, vocab, vocab, 1, out.data_ptr()),
                         calls))
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        gate_up = torch.randn(32, 2 * 1536).to(dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        yield (f"silu_mul 32x1536 {name}", median_us(lambda: F.silu(gate) * up, calls),
               median_us(lambda: cpu_layer_ops.silu_mul(gate_up, threads=1), calls))
        x, weight = torch.randn(32, 576).to(dtype), torch.randn(576).to(dtype)
        yield (f"rms_norm 32x576 {name}", median_us(lambda: F.rms_norm(x, (576,), weight, 1e-5), calls),
               median_us(lambda: cpu_layer_ops.rms_norm(x, weight, 1e-5, threads=1), calls))
        for batch, context in ((8, 128), (8, 1024)):
            k = torch.randn(batch, context, 3, 64).to(dtype)
            v = torch.randn_like(k)
            q = torch.randn(batch, 9, 64).to(dtype)
            out = torch.empty_like(q)
            plan = cpu_attention.Plan(torch.arange(batch, dtype=torch.int32),
                                      torch.full((batch,), context, dtype=torch.int32), threads=1)

            def sdpa():
                for b in range(batch):
                    kb = k[b].transpose(0, 1).repeat_interleave(3, dim=0)
                    vb = v[b].transpose(0, 1).repeat_interleave(3, dim=0)
                    F.scaled_dot_product_attention(q[b].unsqueeze(1), kb, vb)
            yield (f"decode attention b{batch} ctx{context} {name}", median_us(sdpa, max(5, calls // 10)),
                   median_us(lambda: plan.run(q, k, v, out), max(5, calls // 10)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"CPU: {cpu_model()}, 1 thread, {_kernels.vector_lanes()}-lane kernels, torch {torch.__version__}")
    print(f"{'op':38s} {'torch us':>10s} {'kernel us':>10s} {'torch/kernel':>13s}")
    results = []
    for name, torch_us, kernel_us in rows(args.calls):
        print(f"{name:38s} {torch_us:10.1f} {kernel_us:10.1f} {torch_us / kernel_us:12.2f}x", flush=True)
        results.append({"op": name, "torch_us": torch_us, "kernel_us": kernel_us})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_model(), "vector_lanes": _kernels.vector_lanes(), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
