"""Memory and speed of sliding-window layers on vtm's window spaces (issue 19).

A Gemma-3-shaped model (5 sliding layers to 1 full, window 1024; random
weights, built with transformers) against its all-global twin: the same
weights, every layer full attention. Both serve the same requests in this
process, alternating, repeated; medians:

1. Memory: chunks mapped in the requests' vTensors while they grow to
   `--context` tokens, sampled every step: at the peak (a prompt's chunked
   prefill), and while the whole batch decodes at the full context. The
   window spaces map each request's last W tokens (plus the step being
   computed) in the sliding layers; the twin maps everything.
2. Decode throughput at that context (the batch over the median time of a
   step in which every request decodes) and prefill throughput (prompt
   tokens over the prefill pass, one prompt's chunks at a time).
3. Greedy tokens of the windowed model against transformers (SDPA attention,
   float32) on the same weights and prompt.

Greedy equality is checked in float32 only (transformers on the CPU): in
bfloat16 the tokens of two implementations may part at a near-tie.

Usage: python scripts/bench_models.py [--quick] [--json PATH] [--context 8192] [--batch 2]
           [--backend host|cuda] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import vtm
from flexinfer import LLM, SamplingParams
from machine import cpu_model

CHUNK = 2 << 20


def build(folder: Path, layers: int, window: int, context: int, seed: int = 0):
    """The Gemma-3-shaped model in `folder`/windowed and its twin in `folder`/global; the HF model."""
    import transformers

    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    config = transformers.Gemma3TextConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=1, head_dim=128, query_pre_attn_scalar=128, sliding_window=window, layer_types=types,
        max_position_embeddings=context + 512, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.05)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(config).eval()
    windowed, twin = folder / "windowed", folder / "global"
    model.save_pretrained(windowed)
    shutil.copytree(windowed, twin)
    twin_config = json.loads((twin / "config.json").read_text())
    twin_config["layer_types"] = ["full_attention"] * layers
    (twin / "config.json").write_text(json.dumps(twin_config))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=_word_tokenizer(2048))
    for path in (windowed, twin):
        tokenizer.save_pretrained(path)
    return model, windowed, twin


def _word_tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def run(folder: Path, prompts: list[list[int]], new_tokens: int, max_batch_tokens: int, capacity: int,
        backend: str, dtype: str) -> dict:
    """One engine, two passes. Prefill: the prompts with one new token each
    (the scheduler computes one prompt's chunks at a time), which records
    them in the prefix cache. Decode: the same prompts with `new_tokens`
    each, admitted together by prefix hits, so every decode step holds the
    whole batch at the full context. Each step samples the chunks mapped in
    live vTensors (`chunks_mapped - chunks_cached`: vtm's slot cache and the
    prefix tree's unmapped pages are not the requests' KV), outside the
    timed part of the step."""
    manager = vtm.Manager(backend=backend, capacity_bytes=capacity, chunk_bytes=CHUNK, workers=2)
    batch = len(prompts)
    live, decode_live, decode_step_s = [], [], []
    previous = None  # (the last step's end, its schedule() seconds, whether it was a full decode step)
    with LLM(str(folder), manager=manager, dtype=dtype, max_model_len=max(map(len, prompts)) + new_tokens,
             max_batch_tokens=max_batch_tokens, max_num_seqs=batch) as llm:
        scheduler = llm.engine.scheduler
        schedule = scheduler.schedule

        def watched():
            nonlocal previous
            start = time.perf_counter()
            if previous is not None and previous[2]:
                decode_step_s.append(start - previous[0] + previous[1])
            plan = schedule()
            scheduled = time.perf_counter()
            full_decode = len(plan) == batch and all(n == 1 for _, n in plan)
            stats = manager.stats()
            mapped = stats["chunks_mapped"] - stats["chunks_cached"]
            live.append(mapped)
            if full_decode:
                decode_live.append(mapped)
            previous = (time.perf_counter(), scheduled - start, full_decode)
            return plan

        # Warm up (kernels, thread pools) on a short request, then the two passes.
        llm.generate([prompts[0][:64]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
        llm.engine.kv_cache.clear_prefixes()
        scheduler.schedule = watched
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=False)
        prefill_s = time.perf_counter() - start
        previous = None
        outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
        previous = None
    manager.close()
    hits = [o.metrics.prefix_hit_tokens for o in outs]
    if hits != [len(p) - 1 for p in prompts]:
        raise RuntimeError(f"the decode pass did not map the recorded prompts (hits {hits}): it would time prefill")
    return {"prefill_tok_s": sum(map(len, prompts)) / prefill_s,
            "decode_tok_s": batch / statistics.median(decode_step_s),
            "peak_chunks": max(live), "decode_chunks": max(decode_live),
            "tokens": [o.token_ids for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=8192, help="prompt tokens per request (default 8192)")
    parser.add_argument("--batch", type=int, default=2, help="requests served together (default 2)")
    parser.add_argument("--new-tokens", type=int, default=32, help="decode steps (default 32)")
    parser.add_argument("--layers", type=int, default=24, help="layers, every 6th full (default 24)")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--max-batch-tokens", type=int, default=128,
                        help="tokens a step computes: the prefill chunk, which a window space holds beside its "
                             "window while the chunk computes (default 128)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", default="host", choices=["host", "cuda"], help="vtm backend (default host)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quick", action="store_true", help="2K context, 1 repeat: a smoke test")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        args.context, args.window, args.repeats, args.new_tokens = 2048, 256, 1, 8
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 2048) for _ in range(args.context)] for _ in range(args.batch)]
    twin_bytes = args.batch * (args.context + args.new_tokens) * args.layers * 2 * 128 * 4  # float32 K and V
    capacity = (2 * twin_bytes // CHUNK + 64) * CHUNK
    with tempfile.TemporaryDirectory() as tmp:
        hf, windowed, twin = build(Path(tmp), args.layers, args.window, args.context + args.new_tokens)
        runs = {"windowed": [], "global": []}
        for _ in range(args.repeats):
            for name, folder in (("windowed", windowed), ("global", twin)):
                runs[name].append(run(folder, prompts, args.new_tokens, args.max_batch_tokens, capacity,
                                      args.backend, args.dtype))
        expected = None
        if args.dtype == "float32":
            with torch.no_grad():
                expected = hf.generate(torch.tensor(prompts[:1]), max_new_tokens=args.new_tokens, do_sample=False,
                                       attention_mask=torch.ones(1, args.context, dtype=torch.long),
                                       pad_token_id=0, eos_token_id=[])[0, args.context:].tolist()
    result = {"cpu": cpu_model(), "backend": args.backend, "dtype": args.dtype,
              "device": torch.cuda.get_device_name() if args.backend == "cuda" else None, "context": args.context, "batch": args.batch, "layers": args.layers,
              "window": args.window, "chunk_bytes": CHUNK, "max_batch_tokens": args.max_batch_tokens,
              "greedy_equal_to_transformers": None if expected is None else runs["windowed"][0]["tokens"][0] == expected}
    for name, samples in runs.items():
        result[name] = {key: statistics.median(s[key] for s in samples)
                        for key in ("prefill_tok_s", "decode_tok_s", "peak_chunks", "decode_chunks")}
    w, g = result["windowed"], result["global"]
    result["ratios"] = {"peak_chunks": w["peak_chunks"] / g["peak_chunks"],
                        "decode_chunks": w["decode_chunks"] / g["decode_chunks"],
                        "decode_tok_s": w["decode_tok_s"] / g["decode_tok_s"],
                        "prefill_tok_s": w["prefill_tok_s"] / g["prefill_tok_s"]}
    where = result["device"] or f"CPU: {result['cpu']}"
    print(f"{where} ({args.backend}, {args.dtype}); {args.layers} layers (every 6th full), window {args.window}, "
          f"{args.batch} x {args.context} tokens, {CHUNK >> 20} MiB chunks, medians of {args.repeats}")
    print(f"{'':>10} {'peak chunks':>12} {'at context':>11} {'decode tok/s':>13} {'prefill tok/s':>14}")
    for name in ("windowed", "global"):
        r = result[name]
        print(f"{name:>10} {r['peak_chunks']:>12.0f} {r['decode_chunks']:>11.0f} {r['decode_tok_s']:>13.1f} "
              f"{r['prefill_tok_s']:>14.1f}")
    ratio = result["ratios"]
    print(f"{'ratio':>10} {ratio['peak_chunks']:>12.3f} {ratio['decode_chunks']:>11.3f} {ratio['decode_tok_s']:>13.2f} "
          f"{ratio['prefill_tok_s']:>14.2f}")
    print(f"greedy tokens equal to transformers: {result['greedy_equal_to_transformers']}"
          + (" (checked in float32 only)" if expected is None else ""))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
