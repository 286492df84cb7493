"""The projections of one SmolLM2 decode step, per linear kernel, against the memory bandwidth.

A decode step multiplies a few rows by every weight matrix (QKV, O, gate/up and
down in each of the 30 layers, then the LM head), so it streams all 538 MB of
float32 weights once. This runs that sequence of 121 matmuls with random weights
of SmolLM2's shapes through `flexinfer.model.linear.Linear` for each kernel kind
(`torch` = F.linear, the baseline; `onednn` = weights reordered once; `packed` =
FlexInfer's kernel for few rows, src/flexinfer/csrc/linear_cpu.h), at several
row counts, in float32 (or --dtype bfloat16), and reports the medians, the weight bytes streamed per second, and
the ratio to the baseline. For scale, it first measures what the machine streams
(a copy and a sum of 512 MB).

Usage: python scripts/bench_linear.py [--rows 1,8,32] [--dtype float32|bfloat16] [--repeats 15] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from flexinfer.model.linear import Linear, available_kinds
from machine import cpu_model, median_per_call_s

# SmolLM2-135M: hidden 576, intermediate 1536, 9 query + 3 KV heads of 64, vocab 49152, 30 layers.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: (out, in)
LM_HEAD = (49152, 576)
LAYERS = 30


def memory_bandwidth(repeats: int) -> dict:
    src = torch.randn(128 << 20)  # 512 MB
    dst = torch.empty_like(src)
    copy = median_per_call_s(lambda: dst.copy_(src), repeats)
    total = median_per_call_s(lambda: src.sum(), repeats)
    return dict(copy_gb_s=2 * src.nbytes / copy / 1e9, sum_gb_s=src.nbytes / total / 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cpu = torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    kinds = available_kinds(cpu, dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, {cpu_model()}")
    bandwidth = memory_bandwidth(args.repeats)
    print(f"memory: copy {bandwidth['copy_gb_s']:.1f} GB/s (read + write), sum {bandwidth['sum_gb_s']:.1f} GB/s")

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=gen).to(dtype) for _ in range(LAYERS) for shape in LAYER_SHAPES]
    weights.append(torch.randn(LM_HEAD, generator=gen).to(dtype))
    weight_bytes = sum(w.nbytes for w in weights)
    print(f"{len(weights)} projections, {weight_bytes / 1e6:.0f} MB of {args.dtype} weights")
    rows = []
    for n in [int(r) for r in args.rows.split(",")]:
        inputs = {width: torch.randn(n, width, generator=gen).to(dtype) for width in (576, 1536)}
        times = {}
        for kind in kinds:
            layers = [Linear(w, None, kind) for w in weights]

            def step():
                for layer in layers:
                    layer(inputs[layer.in_features])

            times[kind] = median_per_call_s(step, args.repeats)
            del layers
        for kind in kinds:
            row = dict(rows=n, kind=kind, ms=times[kind] * 1e3, gb_s=weight_bytes / times[kind] / 1e9,
                       ratio=times[kind] / times["torch"])
            rows.append(row)
            print(f"  rows {n:>3}  {kind:<6}  {row['ms']:7.1f} ms  {row['gb_s']:5.1f} GB/s  "
                  f"{row['ratio']:.2f}x of F.linear")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(memory=bandwidth, dtype=args.dtype, weight_bytes=weight_bytes, rows=rows,
                           torch=torch.__version__, threads=torch.get_num_threads(), cpu=cpu_model()), f,
                      indent=2)


if __name__ == "__main__":
    main()
