"""The host's share of a decode step: FlexInfer on a model whose forward pass is nearly free.

A random Llama of 1 layer, hidden 64 (4 heads, 2 KV heads, vocabulary 512),
saved as a Hugging Face folder with a word-level tokenizer (bench_gpu.py's),
decodes at batch 1, 8, 32, 128 and 256 through `LLM.generate` (greedy, EOS
ignored, 8-token prompts, 128 new tokens). Beside the forward pass, what a
step costs is then Python: scheduling, the batch vectors, sampling, stop
checks, outputs.

Per decode step, three times (µs): `step`, the engine's step() call alone,
`loop`, from one decode step's start to the next one's (the step plus the
engine loop's dispatch and inbox), and `forward`, the model's forward pass
within the step (at large batches its attention over the KV is real work: 256
sequences of ~70 tokens read ~5 MB of KV a step); `rest µs/seq` is the step
less the forward pass, per sequence, taken step by step (the median of each
step's difference: the forward pass's own noise, ±5 % at batch 256, would
swamp a difference of medians). Only steps in which every sequence of the
batch decodes count (no prompt tokens, nobody waiting); each run's median,
then the median over `--repeats` runs. `threads=1` by default: the forward
pass has nothing to split, and the thread tuner's probes would only add noise.

Against a baseline (another commit's code): copy that build's installed
`flexinfer` and `vtm` packages (site-packages) to a folder DIR, then alternate
`PYTHONPATH=DIR python scripts/bench_overhead.py` with a plain run, several
rounds, and compare `rest µs/seq` (the forward pass moves with the machine's
memory traffic). docs/benchmarks.md has a table made so.

`--overlap on` runs the engine with overlap (off by default on a CPU, where
a step computes while it is launched): what its bookkeeping costs the host.

Usage: python scripts/bench_overhead.py [--batches 1,8,32,128,256] [--new-tokens 128] [--repeats 5]
           [--threads 1] [--overlap default|on|off] [--profile] [--json PATH]
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

from bench_gpu import build_model_folder, make_prompts
from machine import cpu_model

from flexinfer import LLM, SamplingParams

SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-5,
             rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
PROMPT_TOKENS = 8


def timed_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams,
                   profile: cProfile.Profile | None = None) -> tuple[float, float, float, float]:
    """Median µs of step(), of the loop iteration, of the model's forward
    pass, and of the step less its forward pass, over the decode steps of
    one generate; with `profile`, those steps run under it."""
    engine = llm.engine
    step, forward = engine.step, engine.model.forward
    steps, starts, forwards, rests = [], [], [], []
    decoding = False
    forward_s = 0.0  # the forward pass of the step being timed

    def timed_forward(*args, **kwargs):
        nonlocal forward_s
        start = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            if decoding:
                forward_s = time.perf_counter() - start
                forwards.append(forward_s)

    def timed_step():
        nonlocal decoding, forward_s
        s = engine.scheduler
        # Outside the timed region: whether this step is a pure decode step of the whole batch.
        decoding = decode = (not s.waiting and len(s.running) == len(prompts)
                  and all(q.num_cached == q.num_tokens - 1 for q in s.running))
        if decode and profile is not None:
            profile.enable()
        forward_s = 0.0
        start = time.perf_counter()
        try:
            return step()
        finally:
            if profile is not None:
                profile.disable()
            if decode:
                steps.append(time.perf_counter() - start)
                rests.append(steps[-1] - forward_s)
                starts.append(start)
            else:
                starts.append(None)

    # The engine loop's thread calls engine.step: time it there.
    engine.step, engine.model.forward = timed_step, timed_forward
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        del engine.step, engine.model.forward
    loops = [b - a for a, b in zip(starts, starts[1:]) if a is not None and b is not None]
    return tuple(statistics.median(x) * 1e6 for x in (steps, loops, forwards, rests))


def _profile(llm: LLM, prompts: list[list[int]], params: SamplingParams, top: int = 30) -> str:
    llm.kv_cache.clear_prefixes()
    prof = cProfile.Profile()
    timed_generate(llm, prompts, params, prof)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32,128,256")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", default="1", help="an int, or 'auto' (the engine's thread tuner)")
    ap.add_argument("--overlap", default="default", choices=["default", "on", "off"],
                    help="the engine's overlap (default: its own default, off on a CPU)")
    ap.add_argument("--profile", action="store_true",
                    help="also print each batch's decode steps under cProfile (top functions by own time)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    threads = args.threads if args.threads == "auto" else int(args.threads)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    results, profiles = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        build_model_folder(Path(tmp), SHAPE)
        options = {} if args.overlap == "default" else {"overlap": args.overlap == "on"}
        with LLM(tmp, dtype="float32", threads=threads, max_num_seqs=max(batches),
                 max_batch_tokens=max(batches) * PROMPT_TOKENS, kv_capacity_bytes=1 << 30, **options) as llm:
            for batch in batches:
                prompts = make_prompts(batch, PROMPT_TOKENS, SHAPE["vocab_size"])
                timed_generate(llm, prompts, params)  # warm-up
                runs = []
                for _ in range(args.repeats):
                    llm.kv_cache.clear_prefixes()
                    runs.append(timed_generate(llm, prompts, params))
                step_us = statistics.median(r[0] for r in runs)
                loop_us = statistics.median(r[1] for r in runs)
                forward_us = statistics.median(r[2] for r in runs)
                rest_us = statistics.median(r[3] for r in runs)
                results[batch] = {"step_us": step_us, "loop_us": loop_us, "forward_us": forward_us,
                                  "rest_us": rest_us, "host_us_per_seq": rest_us / batch}
                if args.profile:
                    profiles[batch] = _profile(llm, prompts, params)
    print(f"FlexInfer decode step, 1-layer hidden-64 Llama (host overhead), threads={args.threads}, "
          f"{args.new_tokens} new tokens, median of {args.repeats} runs")
    print(f"CPU: {cpu_model()}")
    print(f"{'batch':>6} {'step µs':>9} {'loop µs':>9} {'forward µs':>11} {'rest µs':>9} {'rest µs/seq':>12}")
    for batch, r in results.items():
        print(f"{batch:>6} {r['step_us']:>9.1f} {r['loop_us']:>9.1f} {r['forward_us']:>11.1f} "
              f"{r['rest_us']:>9.1f} {r['host_us_per_seq']:>12.2f}")
    for batch, text in profiles.items():
        print(f"\n--- cProfile, batch {batch}, decode steps only (cProfile inflates Python's share)")
        print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "cpu": cpu_model(), "date": datetime.date.today().isoformat(),
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
