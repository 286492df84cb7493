"""The greedy choice: the first maximum of each row, NON_FINITE for a row with
a NaN or +inf or nothing finite, on the CPU kernel and torch's path alike.
BatchSampler, the device's path for sampled rows, against the distribution
sample() (the reference) draws from."""

from __future__ import annotations

import pytest
import torch

from flexinfer import InvalidArgument, sampling
from flexinfer.sampling import (NON_FINITE, BatchSampler, SamplingParams, _draw, _inverse_cdf, _nucleus, greedy_choice,
                                sample, seeded_uniforms)


def _reference(rows: torch.Tensor) -> list[int]:
    out = []
    for row in rows.double():
        finite = not torch.isnan(row).any() and not torch.isposinf(row).any() and torch.isfinite(row).any()
        out.append(int(torch.argmax(row)) if finite else NON_FINITE)  # argmax: the first maximum
    return out


@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 100, 49152])
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_greedy_choice_is_the_first_maximum(vocab, rows):
    gen = torch.Generator().manual_seed(vocab * 100 + rows)
    logits = torch.randn(rows, vocab, generator=gen)
    assert greedy_choice(logits) == _reference(logits) == logits.argmax(dim=-1).tolist()


def test_ties_and_non_finite_rows():
    logits = torch.zeros(7, 40)
    logits[0, 5] = logits[0, 37] = 2.0  # a tie across lanes: the first wins
    logits[1, 21] = logits[1, 3] = 1.0
    logits[2, 9] = float("nan")
    logits[3, 33] = float("inf")
    logits[4] = float("-inf")
    logits[5] = float("-inf")
    logits[5, 38] = -1.0  # only the tail holds a finite value
    logits[6, 39] = float("nan")  # NaN in the tail past the last 16 lanes
    want = [5, 3, NON_FINITE, NON_FINITE, NON_FINITE, 38, NON_FINITE]
    assert greedy_choice(logits) == _reference(logits) == want
    # torch's path (any tensor the kernel does not take) agrees.
    assert greedy_choice(logits.double()) == want


def test_strided_rows():
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(9, 300, generator=gen)
    rows = wide[::2, 10:250]
    assert rows.stride(-1) == 1 and rows.stride(0) == 600
    assert greedy_choice(rows) == _reference(rows)


def test_sample_bans_tokens_and_flags_non_finite_rows():
    logits = torch.zeros(3, 50)
    logits[0, 7] = 5.0
    logits[0, 8] = 4.0
    logits[1, 2] = float("nan")
    logits[2, 1] = 1.0
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, [greedy] * 3, [None] * 3, banned=[[7], None, None]) == [8, NON_FINITE, 1]
    assert logits[0, 7] == 5.0  # the caller's logits are not written


def _distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """What sample() draws a row from, written out: temperature, top-k (ties
    with the k-th kept), softmax, then the smallest sorted prefix whose mass
    reaches top_p."""
    row = logits.double() / p.temperature
    if p.top_k:
        row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
    probs = torch.softmax(row, dim=-1)
    ordered, order = probs.sort(descending=True)
    ordered = ordered.masked_fill(ordered.cumsum(-1) - ordered >= p.top_p, 0.0)
    probs = torch.zeros_like(probs).scatter_(0, order, ordered)
    return probs / probs.sum()


def _batch_sampler(params, seeds=None, seed=0, drawn=None):
    shared = torch.Generator().manual_seed(seed)
    return BatchSampler(params, seeds or [None] * len(params), shared, torch.device("cpu"), drawn)


@pytest.mark.parametrize("p", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=7, top_p=0.6),
], ids=["temperature", "top_k", "top_p", "top_k+top_p"])
def test_the_batch_sampler_draws_what_sample_draws_from(p):
    """20,000 rows of the same logits: each token's frequency is within
    4.5 standard deviations of its probability, and a token outside top-k
    or top-p is never drawn. The reference's own draws agree too."""
    torch.manual_seed(1)
    logits = torch.randn(12) * 2
    expected = _distribution(logits, p)
    n = 20000
    tokens, feed = _batch_sampler([p] * n)(logits.expand(n, -1).contiguous())
    assert torch.equal(tokens, feed)
    freq = torch.bincount(tokens, minlength=12).double() / n
    bound = 4.5 * (expected * (1 - expected) / n).sqrt() + 1e-9
    assert ((freq - expected).abs() <= bound).all(), (freq, expected)
    assert (freq[expected == 0] == 0).all()
    drawn = sample(logits.expand(2000, -1).contiguous(), [p] * 2000, [torch.Generator().manual_seed(i) for i in range(2000)])
    reference = torch.bincount(torch.tensor(drawn), minlength=12).double() / 2000
    assert ((reference - expected).abs() <= 4.5 * (expected * (1 - expected) / 2000).sqrt() + 1e-9).all()
    assert (reference[expected == 0] == 0).all()


def test_the_batch_samplers_greedy_rows_bans_and_non_finite_rows():
    """Greedy rows take their first maximum, bans applied, as sample()'s do;
    a banned id is never drawn; a row with a NaN, a +inf or nothing finite
    is NON_FINITE, and feeds 0 to the next step."""
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=5.0)
    params = [greedy, greedy, hot, hot, greedy, hot, hot]
    logits = torch.zeros(7, 6)
    logits[0] = torch.tensor([1.0, 3.0, 3.0, 0.0, 0.0, 0.0])  # a tie: the first maximum
    logits[1] = torch.tensor([0.0, 9.0, 2.0, 5.0, 0.0, 0.0])  # its maximum banned
    logits[2, 4] = 1.0  # sampled, token 4 banned
    logits[3, 2] = float("nan")
    logits[4, 1] = float("inf")
    logits[5] = float("-inf")
    logits[6, 0] = float("inf")
    banned = [None, [1], [4], None, None, None, None]
    sampler = _batch_sampler(params)
    reference = sample(logits.clone(), params, [torch.Generator().manual_seed(0)] * 7, banned)
    for _ in range(50):
        tokens, feed = sampler(logits, banned)
        assert tokens[:2].tolist() == reference[:2] == [1, 3]
        assert tokens[2] != 4
        assert tokens[3:].tolist() == reference[3:] == [NON_FINITE] * 4
        assert feed[3:].tolist() == [0] * 4 and torch.equal(feed[:3], tokens[:3])


def _first_over(probs: torch.Tensor, u: float) -> int:
    """The token the inverse CDF gives at u, in float64 (the reference for a seeded row)."""
    return int(torch.searchsorted(probs.double().cumsum(-1), torch.tensor([u * float(probs.sum())],
                                                                          dtype=torch.float64), right=True))


def test_a_seeded_row_draws_the_same_tokens_whatever_else_is_in_the_batch():
    """A seeded row's d-th token is the inverse CDF at its seed's d-th
    uniform (seeded_uniforms), whatever the batch: the same tokens at
    another row of a bigger batch, beside other seeded and unseeded rows
    and another shared generator, and in a batch it joins after drawing
    some tokens elsewhere (drawn), while unseeded rows come from the
    shared generator."""
    torch.manual_seed(2)
    row = torch.randn(50)
    p = SamplingParams(temperature=1.0, seed=5)
    steps = 20
    expected = [_first_over(torch.softmax(row.double(), -1), u) for u in seeded_uniforms(5, steps)]
    assert len(set(expected)) > 3
    for at, size, shared_seed, neighbour_seeds in ((0, 1, 0, ()), (0, 3, 0, (None, 6)), (2, 5, 1, (5, None, 1, 2)),
                                                   (7, 128, 3, range(127))):
        seeds = list(neighbour_seeds) + [None] * (size - 1 - len(neighbour_seeds))
        seeds.insert(at, 5)
        params = [SamplingParams(temperature=1.0, seed=s) for s in seeds]
        sampler = _batch_sampler(params, seeds, seed=shared_seed)
        logits = torch.randn(size, 50)
        logits[at] = row
        assert [int(sampler(logits)[0][at]) for _ in range(steps)] == expected, (at, size)
    # A row that drew 8 tokens in another batch continues its stream here, at step 0 or a later one.
    joined = _batch_sampler([SamplingParams(), p], [None, 5], drawn=[0, 8])
    assert [int(joined(torch.stack([row, row]))[0][1]) for _ in range(steps - 8)] == expected[8:]
    assert int(joined(torch.stack([row, row]), step=3)[0][1]) == expected[11]
    # Unseeded rows draw from the shared generator: another seed of it, other tokens.
    unseeded = [[_batch_sampler([SamplingParams()] * 4, seed=g)(torch.stack([row] * 4))[0].tolist()
                 for _ in range(5)] for g in (0, 1)]
    assert unseeded[0] != unseeded[1]


@pytest.mark.parametrize("p, banned", [
    (SamplingParams(temperature=0.7, seed=1), None),
    (SamplingParams(temperature=1.3, top_k=5, seed=1), [3]),
    (SamplingParams(temperature=1.0, top_p=0.8, seed=1), [0, 11]),
    (SamplingParams(temperature=0.9, top_k=7, top_p=0.6, seed=1), None),
], ids=["temperature", "top_k+banned", "top_p+banned", "top_k+top_p"])
def test_seeded_rows_draw_what_sample_draws_from(p, banned):
    """20,000 rows of the same logits, each with a seed of its own, at their
    tenth token: each token's frequency is within 4.5 standard deviations of
    its probability (temperature, top-k, top-p, bans), and a token that is
    banned or outside top-k or top-p is never drawn. One seed's 20,000
    draws are as uniform too."""
    torch.manual_seed(1)
    logits = torch.randn(12) * 2
    masked = logits.clone()
    if banned:
        masked[banned] = float("-inf")
    expected = _distribution(masked, p)
    n = 20000
    sampler = _batch_sampler([p] * n, list(range(n)), drawn=[9] * n)
    tokens, feed = sampler(logits.expand(n, -1).contiguous(), [banned] * n if banned else None)
    assert torch.equal(tokens, feed)
    freq = torch.bincount(tokens, minlength=12).double() / n
    bound = 4.5 * (expected * (1 - expected) / n).sqrt() + 1e-9
    assert ((freq - expected).abs() <= bound).all(), (freq, expected)
    assert (freq[expected == 0] == 0).all()
    u = torch.tensor(seeded_uniforms(p.seed, n), dtype=torch.float64)
    assert ((u >= 0) & (u < 1)).all()
    counts = torch.histc(u, bins=20, min=0, max=1)
    assert ((counts - n / 20).abs() <= 4.5 * (n / 20 * (1 - 1 / 20)) ** 0.5).all(), counts


def test_a_token_of_probability_zero_is_never_chosen_whatever_the_uniform():
    """The inverse CDF at the uniform's extremes (0, and just below 1, and
    1 itself, which u * total can round to) and at the boundaries between
    tokens never lands on a token of probability 0: not at either end of
    the row, nor between two tokens."""
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0],
                          [0.0, 0.0, 1e-30, 0.0, 3.0],
                          [2.0, 0.0, 0.0, 0.0, 0.0],
                          [0.0, 0.0, 0.0, 0.0, 1.0]])
    below_one = 1.0 - 2.0**-53
    for u, want in ((0.0, [1, 2, 0, 4]), (below_one, [3, 4, 0, 4]), (1.0, [3, 4, 0, 4]), (0.25, [3, 4, 0, 4])):
        chosen = _inverse_cdf(probs, torch.full((4,), u, dtype=torch.float64))
        assert chosen.tolist() == want, u
    # Through the sampler: bans and filters at both ends of the row, the uniform at its extremes.
    logits = torch.tensor([[9.0, 1.0, 2.0, 0.5, 8.0]] * 3)
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0, top_k=2, seed=2),
              SamplingParams(temperature=50.0, top_p=0.3, seed=3)]
    sampler = _batch_sampler(params, [1, 2, 3])
    # Allowed: 1 to 3 (0 and 4 banned); 2 and 4 (the top 2, 0 banned); 0 and 4 (the top-p prefix).
    for u, want in ((0.0, [1, 2, 0]), (below_one, [3, 4, 4])):
        sampler._uniforms = lambda step, device, u=u: torch.full((3,), u, dtype=torch.float64)
        assert sampler(logits, [[0, 4], [0], None])[0].tolist() == want, u


def test_a_token_of_probability_zero_is_never_chosen_where_the_scan_rounds_there(monkeypatch):
    """A GPU's cumsum adds in tree order, so at a token of probability 0 the
    sum may come out an ulp above the one before it: the interval of that
    token is then not empty, and a target on its lower end chose it. Here a
    scan that rounds so (and one whose sums fall back an ulp after it)."""
    sequential = torch.Tensor.cumsum

    def tree_order(self, dim):
        sums = sequential(self, dim)
        sums[:, 1] = torch.nextafter(sums[:, 1], torch.full_like(sums[:, 1], 2.0))  # token 1: probability 0
        sums[1, 2] = torch.nextafter(sums[1, 2], torch.zeros_like(sums[1, 2]))
        return self.copy_(sums)
    monkeypatch.setattr(torch.Tensor, "cumsum_", tree_order)
    probs = torch.tensor([[0.25, 0.0, 0.75], [0.5, 0.0, 0.0]])
    # u * total lands on token 0's upper end: the first sum above it is token 2's (row 0), and row 1 has
    # nothing after token 0 (its target is kept below the total).
    chosen = _inverse_cdf(probs, torch.tensor([0.25, 1.0], dtype=torch.float64))
    assert chosen.tolist() == [2, 0]


def test_a_step_samples_seeded_rows_with_the_same_ops_whatever_their_number():
    """One seeded row or 64: the sampler runs the same torch ops (it drew a
    vocabulary of exponentials per seeded row, one launch each)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    counted = []
    for seeded in (1, 64):
        params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(seeded)] + [SamplingParams()] * 2
        sampler = _batch_sampler(params, list(range(seeded)) + [None] * 2)
        logits = torch.randn(seeded + 2, 1000)
        with Ops() as ops:
            sampler(logits)
        counted.append(sorted(ops.ops))
    assert counted[0] == counted[1], [len(c) for c in counted]


def _full_sort_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    ordered, order = probs.sort(descending=True)
    kept = ordered.masked_fill(ordered.cumsum(-1) - ordered >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(0, order, kept)


@pytest.mark.parametrize("row, top_p, candidates_hold_it", [
    ("peaked", 0.95, True), ("peaked", 0.999, False), ("one-token", 0.5, True),
    ("flat", 0.95, True), ("heavy-tail", 0.9, False),
])
def test_top_p_keeps_the_smallest_sorted_prefix_that_reaches_it(row, top_p, candidates_hold_it):
    """_nucleus sorts only the tokens within a factor NUCLEUS_CANDIDATES of
    the most likely one when their mass reaches top_p, else the whole
    vocabulary: the prefix it keeps is the full sort's either way."""
    vocab = 49152
    g = torch.Generator().manual_seed(7)
    if row == "peaked":
        probs = torch.softmax(torch.randn(vocab, generator=g) * 7.5, -1)
    elif row == "one-token":
        probs = torch.full((vocab,), 1e-9)
        probs[123] = 1.0
    elif row == "flat":
        probs = torch.softmax(torch.randn(vocab, generator=g), -1)
    else:  # half the mass on one token, half spread below the candidates' bar
        probs = torch.full((vocab,), 0.5 / vocab * 0.99)
        probs[5] = 0.5
    probs /= probs.sum()
    among = probs[probs >= probs.max() * sampling.NUCLEUS_CANDIDATES]
    assert (float(among.sort(descending=True).values.cumsum(-1)[-1]) >= top_p) == candidates_hold_it
    kept = _nucleus(probs, top_p)
    assert torch.equal(kept, _full_sort_nucleus(probs, top_p))
    assert 0 < int((kept > 0).sum()) < vocab


def test_the_inverse_cdf_draw_follows_the_probabilities_and_never_draws_a_zero():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    g = torch.Generator().manual_seed(3)
    draws = torch.tensor([_draw(probs, g) for _ in range(20000)])
    freq = torch.bincount(draws, minlength=6).double() / 20000
    assert (freq[probs == 0] == 0).all()
    assert (freq - probs.double()).abs().max() < 0.015, freq
    assert _draw(torch.tensor([0.0, 0.0, 1.0, 0.0]), g) == 2


def test_rows_without_top_p_keep_their_tail_in_a_batch_with_filters():
    """A batch with one top-k row filters every row: a row with top_p = 1
    must still keep every token (a float32 sum of its probabilities reaches
    1 before the end of its sorted row; found by review)."""
    torch.manual_seed(4)
    logits = torch.randn(2, 49152) * 4
    sampler = _batch_sampler([SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=50)])
    filtered = sampler._filtered(logits.clone(), 49152)
    assert torch.isfinite(filtered[0]).all()
    assert int(torch.isfinite(filtered[1]).sum()) == 50


def test_the_batch_sampler_judges_finiteness_around_bans_as_sample_does():
    """A greedy row is judged after its bans, a sampled one before them (and
    one whose bans leave nothing fails too: sample() raises for it); an id
    outside the vocabulary bans nothing (found by review)."""
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
    nan_banned = torch.tensor([float("nan"), 1.0, 0.5, 0.0])
    all_banned = torch.tensor([1.0, 2.0, float("-inf"), float("-inf")])
    logits = torch.stack([nan_banned, nan_banned, all_banned, all_banned, torch.tensor([0.0, 0.0, 9.0, 0.0])])
    params = [greedy, hot, greedy, hot, greedy]
    banned = [[0], [0], [0, 1], [0, 1], [2, 4096]]
    tokens, _ = _batch_sampler(params)(logits, banned)
    reference = sample(logits.clone(), params, [torch.Generator().manual_seed(0)] * 5, [list(b) for b in banned[:4]] + [[2]])
    assert tokens.tolist()[:3] == reference[:3] == [1, NON_FINITE, NON_FINITE]
    assert tokens[3] == NON_FINITE and isinstance(reference[3], Exception)
    # With top-p too, the reference's error says why.
    nothing_left = sample(all_banned[None].clone(), [SamplingParams(top_p=0.9)], [None], [[0, 1]])[0]
    assert isinstance(nothing_left, InvalidArgument) and "no token can be sampled" in str(nothing_left)
    assert tokens[4] == reference[4] == 0  # the id outside the vocabulary is left out


def test_top_k_is_bounded_so_the_device_sampler_can_hold_it():
    """top_k goes into a tensor of int64 on the device path: a value torch cannot hold must be refused
    when the request is checked, not raise while a batch is sampled."""
    SamplingParams(top_k=sampling.TOP_K_MAX)
    for top_k in (sampling.TOP_K_MAX + 1, 1 << 63, 10**30):
        with pytest.raises(InvalidArgument, match=r"^top_k must be in \[0, 2147483647\]"):
            SamplingParams(top_k=top_k)


@pytest.mark.parametrize("stop, shown", [("", "''"), (["", "x"], "['', 'x']"), (5, "5")])
def test_a_bad_stop_is_quoted_as_given(stop, shown):
    """stop="" was quoted as [''], a list the caller never wrote."""
    with pytest.raises(InvalidArgument) as refused:
        SamplingParams(stop=stop)
    assert str(refused.value) == f"stop must be a non-empty str or a list of non-empty str, got {shown}"


def test_one_rows_top_k_never_fails_the_batch_sampler():
    """A top_k beyond int64 set after the check (SamplingParams is a plain dataclass) is read as "all
    tokens": the batch is sampled, its other rows as usual."""
    wide = SamplingParams(temperature=1.0, top_k=5)
    wide.top_k = 10**30
    logits = torch.randn(2, 30)
    tokens, _ = _batch_sampler([wide, SamplingParams(temperature=0.0, top_k=3)])(logits)
    assert 0 <= int(tokens[0]) < 30 and int(tokens[1]) == int(logits[1].argmax())


@pytest.mark.parametrize("top_p", [1e-50, 1e-45, 1e-9])
def test_a_tiny_top_p_keeps_the_most_likely_token(top_p):
    """The smallest prefix whose mass reaches top_p is never empty. A top_p that float32 rounds to 0
    (1e-50) masked every token: sample() failed the row ("bans leave no token"), the batch sampler
    chose token 0."""
    torch.manual_seed(4)
    logits = torch.randn(3, 50)
    logits[:, 0] = -5.0  # token 0 is never the answer
    params = [SamplingParams(temperature=1.0, top_p=top_p)] * 3
    argmax = logits.argmax(dim=-1).tolist()
    assert sample(logits.clone(), params, [torch.Generator().manual_seed(i) for i in range(3)]) == argmax
    tokens, _ = _batch_sampler(params)(logits)
    assert tokens.tolist() == argmax


def test_the_draw_kernel_is_warmed_only_where_it_runs():
    """warm_draw_kernel compiles the Triton draw on CUDA only: elsewhere the
    sampler draws with torch ops, and there is nothing to compile."""
    from flexinfer.sampling import warm_draw_kernel

    assert warm_draw_kernel(torch.device("cpu"), 128) is False
