"""Where a decode step's time goes: cProfile over FlexInfer generate on SmolLM2.

Runs `generate` once to warm up, then once under cProfile, and groups the
profile into the step's parts (linear kernels, attention, norms, rotary and the
K/V write, sampling, the scheduler with vtm futures, the rest), in ms per
decode step. Compare `--attention kernel` (the batched kernel) with
`--attention sdpa` (per-request calls) in the same invocation with `--compare`.

Usage: python scripts/profile_step.py [--batch 8] [--new-tokens 64] [--dtype float32] [--compare] [--json PATH]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats

from flexinfer import LLM, SamplingParams

# Python functions (file, name) whose cumulative time makes up each part of a
# step; none of them calls another's, so the parts add up.
PARTS = {
    # Where a CPU model runs every layer as one C++ call (kernels/cpu_decoder.py),
    # the layers' projections, norms, rotary and attention are all in this part,
    # and "linear" is the LM head alone.
    "layers, one call": (("cpu_decoder.py", "run"),),
    "linear": (("model/linear.py", "__call__"),),
    "attention": (("flexinfer/attention.py", "forward"), ("flexinfer/attention.py", "prepare")),
    "norms": (("llama.py", "_rms_norm"),),
    "silu * up": (("llama.py", "_gated_mlp_activation"),),
    "rotary + KV write": (("llama.py", "_rope"), ("llama.py", "_rotary_kv_write")),
    "batch vectors": (("llama.py", "build"),),
    "sampling": (("sampling.py", "sample"),),
    "scheduler + vtm": (("scheduler.py", "schedule"),),
}


def profile(llm: LLM, batch: int, new_tokens: int) -> dict:
    prompts = [[1 + (i * 131 + j * 7) % 2000 for j in range(32)] for i in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    llm.kv_cache.clear_prefixes()
    # Steps run on the engine's thread, and cProfile profiles the thread that
    # enables it: profile inside each step.
    prof = cProfile.Profile()
    step = llm.engine.step

    def profiled_step():
        prof.enable()
        try:
            return step()
        finally:
            prof.disable()

    llm.engine.step = profiled_step
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        del llm.engine.step
    stats = pstats.Stats(prof)
    total = sum(v[3] for (f, _, fn), v in stats.stats.items() if f.endswith("engine.py") and fn == "step")
    parts = {name: 0.0 for name in PARTS}
    for (filename, _, func), (_, _, _, cumtime, _) in stats.stats.items():
        for name, keys in PARTS.items():
            if any(filename.endswith(f) and func == fn for f, fn in keys):
                parts[name] += cumtime
    parts["rest"] = total - sum(parts.values())
    steps = new_tokens  # one prefill step plus new_tokens - 1 decode steps
    return {name: seconds / steps * 1000 for name, seconds in parts.items()} | {"total": total / steps * 1000}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--attention", default="kernel")
    ap.add_argument("--compare", action="store_true", help="also profile attention='sdpa'")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    kinds = [args.attention] + (["sdpa"] if args.compare else [])
    results = {}
    for kind in kinds:
        with LLM("smollm2", dtype=args.dtype, attention=kind, threads=2) as llm:
            results[kind] = profile(llm, args.batch, args.new_tokens)
    print(f"ms per step, batch {args.batch}, {args.dtype}, {args.new_tokens} steps (cProfile adds overhead)")
    print(f"{'part':>18} " + " ".join(f"{k:>10}" for k in kinds))
    for part in list(PARTS) + ["rest", "total"]:
        print(f"{part:>18} " + " ".join(f"{results[k][part]:>10.2f}" for k in kinds))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), ms_per_step=results), f, indent=2)


if __name__ == "__main__":
    main()
