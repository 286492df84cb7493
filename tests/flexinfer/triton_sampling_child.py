"""BatchSampler with its Triton draw (src/flexinfer/kernels/triton_sampling.py)
against BatchSampler on torch ops, its reference: the same rows, bans and
per-row uniforms (every row seeded, so both samplers draw at the same
uniforms), compared token for token.

Run as a script (by test_triton_sampling.py), it runs the checks in Triton's
interpreter on CPU tensors, in a process of its own: TRITON_INTERPRET must be
set before triton is imported, and never in the pytest process. Imported
(test_triton_sampling.py's GPU test), `run_checks("cuda", vocab, batch)` runs
them on the GPU. Either way the result is {case: {"rows", "differing",
"first_differences"}}.
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":
    # Before triton is imported: it decides at decoration time whether kernels are interpreted.
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from flexinfer.sampling import NON_FINITE, BatchSampler, SamplingParams  # noqa: E402

BELOW_ONE = 1.0 - 2.0 ** -53


def _params(vocab: int) -> list[SamplingParams]:
    """Every filter the sampler takes, at its edges: top_k of 1, of the
    vocabulary less one, beyond it; top_p rounding to 0 in float32, small,
    large; both; temperature alone; greedy rows between them."""
    greedy = SamplingParams(temperature=0.0)
    return [
        SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.3, top_k=5), SamplingParams(temperature=0.7, top_k=vocab - 1),
        SamplingParams(temperature=1.0, top_k=vocab + 10), greedy, SamplingParams(temperature=1.0, top_p=1e-50),
        SamplingParams(temperature=0.9, top_p=0.1), SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=2.0, top_p=0.999), SamplingParams(temperature=0.9, top_k=40, top_p=0.6),
        SamplingParams(temperature=1.1, top_k=3, top_p=0.95), greedy, SamplingParams(temperature=5.0, top_p=0.5),
    ]


def _compare(sampler_args, logits, banned, steps, uniforms=None) -> dict:
    params, seeds = sampler_args
    got_all, want_all = [], []
    kernel = BatchSampler(params, seeds, None, logits.device, kernel=True)
    torch_ops = BatchSampler(params, seeds, None, logits.device, kernel=False)
    if uniforms is not None:
        for sampler in (kernel, torch_ops):
            sampler._uniforms = lambda step, device, u=uniforms: u.to(device)
    for _ in range(steps):
        got_all.append(kernel(logits, banned)[0].cpu())
        want_all.append(torch_ops(logits, banned)[0].cpu())
    got, want = torch.stack(got_all), torch.stack(want_all)
    where = (got != want).nonzero().tolist()
    return {"rows": got.numel(), "differing": len(where),
            "first_differences": [(s, r, int(got[s, r]), int(want[s, r])) for s, r in where[:5]],
            "draws": len({int(t) for t in got.flatten()})}


def run_checks(device: str, vocab: int = 1100, repeat: int = 1, steps: int = 2) -> dict:
    """The cases; `repeat` copies of the parameter list make a batch."""
    torch.manual_seed(0)
    params = _params(vocab) * repeat
    seeds = list(range(100, 100 + len(params)))
    batch = len(params)
    results = {}
    # Logits of a model: a few likely tokens above a long tail, and a flatter row.
    logits = torch.randn(batch, vocab) * torch.linspace(1.0, 8.0, batch)[:, None]
    results["random"] = _compare((params, seeds), logits.to(device), None, steps)
    # Ties at the k-th value, -inf (banned before) tokens, bans given to the sampler, rows that cannot be
    # sampled. Top-k only: with ties at top-p's bar the kernel keeps them all, the sort those it puts first.
    top_k_only = [SamplingParams(temperature=p.temperature, top_k=p.top_k) if p.top_p < 1 else p for p in params]
    tied = torch.randn(batch, vocab).round()
    tied[:, ::7] = float("-inf")
    banned = [[0, 1, vocab - 1] if i % 3 == 0 else None for i in range(batch)]
    tied[1] = float("nan")
    tied[2] = float("-inf")
    results["ties_bans_non_finite"] = _compare((top_k_only, seeds), tied.to(device), banned, steps)
    # Top-p's bar among ties: [2, 1, 1, 1] (the rest -inf) at top_p just past the first two tokens' mass
    # keeps all three tied tokens, and every u draws one of the four.
    row = torch.full((vocab,), float("-inf"))
    row[:4] = torch.tensor([2.0, 1.0, 1.0, 1.0])
    probs = torch.softmax(row.double(), -1)
    nucleus = SamplingParams(temperature=1.0, top_p=float(probs[:2].sum()) + 1e-3)
    grid = torch.arange(64, dtype=torch.float64) / 64
    kernel = BatchSampler([nucleus] * 64, list(range(64)), None, torch.device(device), kernel=True)
    kernel._uniforms = lambda step, device: grid.to(device)
    drawn = kernel(row.expand(64, -1).contiguous().to(device))[0].cpu()
    results["top_p_keeps_ties_at_its_bar"] = {"rows": 64, "differing": int((drawn > 3).sum()),
                                              "first_differences": sorted(set(drawn.tolist()))}
    # The uniform's extremes over rows whose ends have probability 0.
    ends = torch.randn(batch, vocab)
    ends[:, :3] = float("-inf")
    ends[:, -5:] = float("-inf")
    for name, u in (("u_zero", 0.0), ("u_below_one", BELOW_ONE), ("u_one", 1.0)):
        results[name] = _compare((params, seeds), ends.to(device), None, 1,
                                 torch.full((batch,), u, dtype=torch.float64))
    # A sampled row never draws NON_FINITE, the rows that cannot be sampled always do.
    tokens = BatchSampler(params, seeds, None, torch.device(device), kernel=True)(tied.to(device), banned)[0].cpu()
    results["non_finite_rows"] = {"rows": 2, "differing": int((tokens[1:3] != NON_FINITE).sum()),
                                  "first_differences": tokens[:3].tolist()}
    return results


if __name__ == "__main__":
    print(json.dumps(run_checks(sys.argv[1] if len(sys.argv) > 1 else "cpu")))
