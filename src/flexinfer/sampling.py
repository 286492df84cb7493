"""Sampling parameters and the per-step token choice."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numpy as np
import torch

from flexinfer.errors import InvalidArgument
from flexinfer.kernels import triton_available

# sample() gives this for a row whose logits are not all finite (NaN or inf):
# no token can be chosen from it, and the engine fails that request alone.
NON_FINITE = -1
# Temperatures below this sample greedily (as vLLM does).
GREEDY_BELOW = 1e-5
# Stop strings are matched against the output as it grows (each step scans
# only the new text plus the last MAX_STOP_LENGTH - 1 characters before it),
# so their number and length bound the work of every step. OpenAI allows 4.
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
# Every step before min_tokens bans a sequence's stop token ids (and the
# samplers walk them), so their number bounds the work of those steps too.
MAX_STOP_TOKEN_IDS = 1024
# Samples of one request: each is a sequence with its own state from
# submission (~1 KB of host memory), so an unbounded n ran the host out of
# memory (n=10**8: ~100 GB) instead of failing. The server takes OpenAI's 128.
MAX_N = 4096
# torch.Generator.manual_seed takes any int in this range; sample i of a
# request is seeded with seed + i.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
# top_k beyond any vocabulary keeps every token; the bound keeps it in the
# device sampler's int64 tensor (BatchSampler), which cannot hold 10**30.
TOP_K_MAX = (1 << 31) - 1
# BatchSampler draws with the Triton kernel from this many rows, with torch
# ops below it. A kernel program reads its row 36-68 times in turn, so its
# time hardly grows with the batch, while the torch ops' (a sort of the
# vocabulary) does: on an H200 at SmolLM2's vocabulary, a sampled step
# spent 620 / 648 µs outside the decode graph at batch 1 / 128 with the
# kernel and 366 / 1,464 µs with torch ops (bench_gpu.py part 4,
# 2026-11-30); the lines through those points cross near 31 rows.
DRAW_KERNEL_FROM_ROWS = 32
# Top-p first sorts only the tokens at least this fraction as likely as the most likely one (_nucleus).
NUCLEUS_CANDIDATES = 1e-4


@dataclass
class SamplingParams:
    """How one request samples. Checked when built: a wrong type or value
    raises flexinfer.InvalidArgument."""

    max_tokens: int = 64
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW): greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    min_tokens: int = 0  # no end-of-sequence or stop token before this many tokens

    def __post_init__(self):
        # Kept as Python numbers: numpy's pass the checks, but failed in the
        # engine (torch's manual_seed takes no numpy int; a uint8 max_tokens
        # overflowed in the KV budget's sums).
        for name in ("max_tokens", "top_k", "n", "min_tokens"):
            setattr(self, name, _require_int(name, getattr(self, name)))
        for name in ("temperature", "top_p"):
            setattr(self, name, _require_finite(name, getattr(self, name)))
        if self.seed is not None:
            self.seed = _require_int("seed", self.seed)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgument(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        given = self.stop  # quoted as given: stop="" was said to be ['']
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidArgument(f"stop must be a non-empty str or a list of non-empty str, got {given!r}")
        self.stop = list(self.stop)
        for s in self.stop:
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as exc:  # a lone surrogate: no output text can hold it
                raise InvalidArgument(f"stop string {s!r} is not valid Unicode text ({exc.reason})") from None
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in self.stop):
            longest = max(map(len, self.stop), default=0)
            raise InvalidArgument(f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} "
                                  f"characters each, got {len(self.stop)} (the longest {longest} characters)")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise InvalidArgument(f"stop_token_ids must be a list of int, got {self.stop_token_ids!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgument(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, "
                                  f"got {len(self.stop_token_ids)}")
        # In order, each once.
        self.stop_token_ids = list(dict.fromkeys(_require_int("a stop token id", t) for t in self.stop_token_ids))
        if self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise InvalidArgument(f"temperature must be >= 0, got {self.temperature}")
        if not 0 <= self.top_k <= TOP_K_MAX:
            raise InvalidArgument(f"top_k must be in [0, {TOP_K_MAX}] (0: off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        if self.n < 1:
            raise InvalidArgument(f"n must be >= 1, got {self.n}")
        if self.n > MAX_N:
            raise InvalidArgument(f"n takes at most {MAX_N} samples of one request, got {self.n}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidArgument(f"min_tokens must be in [0, max_tokens ({self.max_tokens})], got {self.min_tokens}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX - (self.n - 1):
            raise InvalidArgument(f"seed must be in [-2**63, 2**64 - n] (sample i is seeded with seed + i), "
                                  f"got {self.seed}")

    @property
    def greedy(self) -> bool:
        # Below this, sampling is greedy in all but name, and dividing the
        # logits by the temperature could overflow them.
        return self.temperature < GREEDY_BELOW


def _require_int(name: str, value) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise InvalidArgument(f"{name} must be an int, got {value!r}")
    return int(value)


def _require_finite(name: str, value) -> float:
    number = math.nan
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int past float's range: not finite (it raised from math.isfinite)
            number = math.inf
    if not math.isfinite(number):
        raise InvalidArgument(f"{name} must be a finite number, got {value!r}")
    return number


def greedy_choice(rows: torch.Tensor) -> list[int]:
    """Per row of logits, the index of its first maximum; NON_FINITE where
    the row holds a NaN or +inf or nothing finite. One pass over the logits
    and one transfer for the choice and the check."""
    return greedy_tokens(rows)[0].tolist()


def greedy_tokens(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """greedy_choice as tensors where the logits are, queued without waiting
    for them: (the choice, NON_FINITE included; the choice as the next
    step's input ids, where NON_FINITE reads 0, so that a row failing on the
    host never feeds the device an id outside the vocabulary). The second is
    None on the CPU: there it would cost a pass of its own, and only a step
    launched before this one is read needs it (clamp the choice then)."""
    if rows.device.type == "cpu" and rows.dtype == torch.float32 and rows.dim() == 2 and rows.stride(-1) == 1:
        # torch's max over the vocabulary runs under 1 GB/s on the CPU (see
        # src/flexinfer/csrc/sampling_cpu.h). Imported here: the compiled
        # extension must not load with `import flexinfer`.
        from flexinfer import _kernels

        out = torch.empty(rows.shape[0], dtype=torch.long)
        _kernels.greedy_pick(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), torch.get_num_threads(),
                             out.data_ptr())
        return out, None
    # A row's max is NaN when any logit is NaN, +inf when any is +inf; its
    # index is a valid id either way.
    best, chosen = rows.max(dim=-1)
    return torch.where(torch.isfinite(best), chosen, NON_FINITE), chosen


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           banned: list[list[int] | None] | None = None) -> list[int | Exception]:
    """One token per row of logits [B, vocab] (float32); NON_FINITE for a row
    with a NaN or +inf logit (-inf is a token that cannot be chosen; a row of
    nothing but -inf is non-finite too). `banned[i]`: token ids row i may not
    choose (stop tokens before min_tokens). A row that cannot be sampled gets
    the exception instead of a token, and the other rows are sampled as if it
    were not there (each row draws from its own generator only)."""
    vocab = logits.shape[-1]
    tokens: list[int | Exception] = [0] * len(params)
    banned = list(banned or [None] * len(params))
    for i, ids in enumerate(banned):
        if ids and not all(0 <= t < vocab for t in ids):
            tokens[i] = InvalidArgument(f"a banned token id is outside the vocabulary (0 to {vocab - 1})")
    greedy_rows = [i for i, p in enumerate(params) if p.greedy and not isinstance(tokens[i], Exception)]
    if greedy_rows:
        rows = logits[greedy_rows] if len(greedy_rows) < len(params) else logits
        if any(banned[i] for i in greedy_rows):
            rows = rows.clone()
            for r, i in enumerate(greedy_rows):
                if banned[i]:
                    rows[r, banned[i]] = float("-inf")
        for i, t in zip(greedy_rows, greedy_choice(rows)):
            tokens[i] = t
    for i, p in enumerate(params):
        if p.greedy or isinstance(tokens[i], Exception):
            continue
        try:
            tokens[i] = _sampled(logits[i], p, generators[i], banned[i])
        except Exception as exc:  # noqa: BLE001 - this row's failure, reported for it alone
            tokens[i] = exc
    return tokens


def warm_draw_kernel(device: torch.device, vocab: int) -> bool:
    """Compiles the draw kernel (both variants: with and without top-k and
    top-p) for rows of `vocab` logits on `device` now, by drawing from one
    row of each: Triton compiles a kernel on its first launch, which took
    seconds, and an engine would otherwise pay that in the first step that
    samples DRAW_KERNEL_FROM_ROWS rows, a busy moment of a server. Whether
    it compiled (a CUDA device with triton)."""
    if device.type != "cuda" or not triton_available():
        return False
    from flexinfer.kernels import triton_sampling

    row = torch.zeros(1, vocab, dtype=torch.float32, device=device)
    uniforms = torch.zeros(1, dtype=torch.float64, device=device)
    triton_sampling.draw(row, None, None, uniforms)
    triton_sampling.draw(row, torch.zeros(1, dtype=torch.long, device=device),
                         torch.ones(1, dtype=torch.float32, device=device), uniforms)
    return True


class BatchSampler:
    """sample() for a whole batch where its logits are, queued without
    waiting for them: the device path of a GPU engine, whose steps would
    otherwise wait for the device to bring every sampled row to the host.
    sample() is the reference it is tested against: the same temperature,
    bans, top-k (ties with the k-th value kept) and top-p (the smallest
    prefix of the sorted probabilities whose mass reaches top_p), then a
    draw by the inverse of each row's cumulative probabilities at one
    uniform per row (_inverse_cdf), every row at once. Greedy rows take
    their first maximum, bans applied, as sample() does. NON_FINITE as
    sample()'s: a greedy row judged after its bans, a sampled one before
    them; a sampled row whose bans leave nothing, which sample() fails with
    an error, is NON_FINITE here (the request fails either way). On CUDA,
    from DRAW_KERNEL_FROM_ROWS rows, top-k, top-p and the draw run as one
    Triton kernel (kernels/triton_sampling.py), whose reference is the torch
    path here (`kernel` chooses; top-p's ties are its one difference).

    Built once per batch of sequences: `params` per row, `seeds` per row
    (None: the row's uniform comes from `shared`, one generator on the
    logits' device for every unseeded row, one launch for all of them; an
    int: the row's uniform for its d-th token is seeded_uniforms(seed, d),
    whatever else is in the batch and wherever the row lies in it), and
    `drawn` per row: the tokens it had drawn before the sampler's first
    step (0 if not given).

    Why one uniform per row, and a counter-based one for seeded rows: a
    seeded row used to draw a vocabulary of exponentials from its own
    torch.Generator every step (the exponential race), one launch per
    seeded row per step (on the CPU, 49,152 draws a row). The inverse CDF
    needs one uniform a row; a seeded row's is a hash of (seed, draw
    index) computed for all seeded rows at once on the host (numpy, a few
    microseconds whatever their number) and sent with one pinned,
    non-blocking copy: no launch per row, no generator state to carry from
    batch to batch, and a step that is computed again (one that failed)
    draws the same uniform again. Seeded outputs differ from those of
    versions before this sampler (which raced exponentials)."""

    def __init__(self, params: list[SamplingParams], seeds: list[int | None], shared: torch.Generator,
                 device: torch.device, drawn: list[int] | None = None, kernel: bool | None = None):
        self.device = device
        # The draw as one Triton kernel (kernels/triton_sampling.py) or as
        # torch ops, its reference; None: the kernel on CUDA where triton is
        # and the batch has DRAW_KERNEL_FROM_ROWS rows.
        if kernel is None:
            kernel = device.type == "cuda" and len(params) >= DRAW_KERNEL_FROM_ROWS and triton_available()
        self._draw_kernel = None
        if kernel:
            from flexinfer.kernels import triton_sampling

            self._draw_kernel = triton_sampling.draw
        self.shared = shared
        self.rows = len(params)
        seeded = [i for i, s in enumerate(seeds) if s is not None]
        self.calls = 0
        # _inverse_cdf's float64 sums, kept from step to step: on a CPU a
        # fresh [B, vocab] float64 buffer is above glibc's mmap threshold
        # at batch 128 and faults its pages in every step (~30 ms).
        self.cumulative: torch.Tensor | None = None
        if seeded:
            self.seeded_rows = self._on_device(seeded, torch.long)
            self.keys = _seed_keys([seeds[i] for i in seeded])
            self.drawn = np.array([drawn[i] if drawn else 0 for i in seeded], dtype=np.uint64)
        self.all_seeded = len(seeded) == len(params)
        self.seeded = seeded
        self.temperature = self._on_device([1.0 if p.greedy else p.temperature for p in params], torch.float32)[:, None]
        self.greedy = [i for i, p in enumerate(params) if p.greedy]
        if self.greedy:
            self.greedy_rows = self._on_device(self.greedy, torch.long)
            self.greedy_mask = self._on_device([p.greedy for p in params], torch.bool)
        self.filters = any(p.top_k > 0 or p.top_p < 1.0 for p in params if not p.greedy)
        if self.filters:
            # Clamped, not trusted: SamplingParams is a plain dataclass, and
            # a top_k set after its check must not fail the other rows.
            # Every other per-row value is a float, which float32 rounds
            # and never refuses.
            self.top_k = self._on_device([min(p.top_k, TOP_K_MAX) for p in params], torch.long)
            self.top_p = self._on_device([p.top_p for p in params], torch.float32)

    def __call__(self, logits: torch.Tensor, banned: list[list[int] | None] | None = None,
                 step: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the tokens, NON_FINITE for a row with a NaN or +inf logit or
        nothing finite; the tokens as the next step's input ids, where
        NON_FINITE reads 0). `banned[i]`: ids row i may not choose; one
        outside the vocabulary, which no row can choose, is left out.
        `step`: the sampler's step the call samples, counted from 0 (a
        seeded row draws its drawn[i] + step-th uniform); None: the
        number of calls before this one."""
        if step is None:
            step = self.calls
        self.calls += 1
        vocab = logits.shape[-1]
        finite = torch.isfinite(logits.max(dim=-1).values)
        row = logits.float() / self.temperature
        flat = [(i, t) for i, ids in enumerate(banned or ()) if ids for t in ids if 0 <= t < vocab]
        if flat:
            index = self._on_device(flat, torch.long)
            # The value a device tensor: `row[i, j] = float` copies a host
            # scalar to the device, which waits for the queued steps.
            row.index_put_((index[:, 0], index[:, 1]), torch.full((), float("-inf"), device=row.device))
            after = torch.isfinite(row.max(dim=-1).values)
            finite = after & (finite | self.greedy_mask) if self.greedy else after & finite
        greedy = row.index_select(0, self.greedy_rows).argmax(dim=-1) if self.greedy else None
        uniforms = self._uniforms(step, row.device)
        if self._draw_kernel is not None:
            chosen = self._draw_kernel(row, self.top_k if self.filters else None,
                                       self.top_p if self.filters else None, uniforms)
        else:
            if self.filters:
                row = self._filtered(row, vocab)
            probs = torch.softmax(row, dim=-1)
            if self.cumulative is None or self.cumulative.shape != probs.shape:
                self.cumulative = torch.empty(probs.shape, dtype=torch.float64, device=probs.device)
            chosen = _inverse_cdf(probs, uniforms, self.cumulative)
        if greedy is not None:
            chosen.index_copy_(0, self.greedy_rows, greedy)
        return torch.where(finite, chosen, NON_FINITE), torch.where(finite, chosen, 0)

    def _uniforms(self, step: int, device: torch.device) -> torch.Tensor:
        """One uniform in [0, 1) per row (float64): the shared generator's
        for unseeded rows (one launch), seeded_uniforms' for seeded ones
        (one copy)."""
        if self.seeded:
            seeded = self._on_device(_uniforms_at(self.keys, self.drawn + np.uint64(step)), torch.float64)
            if self.all_seeded:  # seeded_rows is every row, in order
                return seeded
        u = torch.rand(self.rows, dtype=torch.float64, generator=self.shared, device=device)
        if self.seeded:
            u.index_copy_(0, self.seeded_rows, seeded)
        return u

    def _filtered(self, row: torch.Tensor, vocab: int) -> torch.Tensor:
        """`row` with -inf outside each row's top-k, then outside its top-p."""
        ordered, order = row.sort(dim=-1, descending=True)
        k = torch.where(self.top_k > 0, self.top_k.clamp(max=vocab), vocab)
        ordered = ordered.masked_fill(ordered < ordered.gather(1, (k - 1)[:, None]), float("-inf"))
        probs = torch.softmax(ordered, dim=-1)
        # Rows with top_p = 1 keep their tail: a float32 sum reaches 1 before it ends.
        drop = (probs.cumsum(-1) - probs >= self.top_p[:, None]) & (self.top_p < 1.0)[:, None]
        drop[:, 0] = False  # the prefix is never empty, even where top_p rounds to 0 in float32
        ordered = ordered.masked_fill(drop, float("-inf"))
        return torch.empty_like(row).scatter_(1, order, ordered)

    def _on_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """`values` on the device without waiting for it: a copy from
        pageable memory would wait for the queued steps."""
        host = torch.tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)


# SplitMix64's increment and its finaliser's multipliers (Steele, Lea and
# Flood, "Fast splittable pseudorandom number generators", 2014).
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, a bijection of uint64 (numpy's uint64 arrays wrap, as it needs)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def _seed_keys(seeds: list[int]) -> np.ndarray:
    """Each seed (SEED_MIN to SEED_MAX) as its stream's key: the seed mixed,
    so that seeds a multiple of _GAMMA apart do not give shifted streams."""
    return _mix(np.array([s % (1 << 64) for s in seeds], dtype=np.uint64))


def _uniforms_at(keys: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """The uniform in [0, 1) of each key's draw (a multiple of 2**-53, as
    torch.rand's float64): SplitMix64's output at that counter. A pure
    function of (key, draw), so one vectorised pass serves every row."""
    with np.errstate(over="ignore"):
        bits = _mix(keys + (draws + np.uint64(1)) * _GAMMA)
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


def seeded_uniforms(seed: int, draws: int) -> list[float]:
    """The uniforms a row seeded with `seed` draws its first `draws` tokens
    at (BatchSampler): the d-th token of a seeded row is the first token
    whose cumulative probability exceeds the d-th uniform times the total,
    however the row is batched."""
    return _uniforms_at(_seed_keys([seed]).repeat(draws), np.arange(draws, dtype=np.uint64)).tolist()


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Per row of `probs` [B, vocab] (each row's sum need not be 1), the
    first token whose cumulative probability exceeds u[i] (in [0, 1)) times
    the row's total: token t with probability probs[t] / total. The sum is
    float64, so that a token's share of [0, total) is its probability to
    ~1e-16 of the total, not float32's ~6e-8 (the exponential race this
    replaced kept tokens that unlikely). A token of probability 0 adds
    nothing to the sum, so no target falls in its (empty) interval: the
    target is kept below the total (u * total can round to it), and at
    u = 0 the first token of positive probability is chosen. A row without
    any (NaN, or nothing left) gives some id in the vocabulary, which the
    caller marks NON_FINITE. `out`: a float64 tensor of probs' shape for
    the sums (torch's CPU cumsum converting float32 to float64 as it sums
    takes ~6x as long as a copy and a float64 cumsum in place)."""
    if out is None:
        out = torch.empty(probs.shape, dtype=torch.float64, device=probs.device)
    cumulative = out.copy_(probs).cumsum_(dim=-1)
    # A GPU's scan adds in tree order: at a token of probability 0 the sum
    # may still rise by an ulp, and the sums need not even be monotone. Each
    # token's sum is the running maximum of the positive tokens' sums up to
    # it, so a token of probability 0 keeps an empty interval.
    cumulative = torch.cummax(cumulative.masked_fill_(probs == 0, 0.0), dim=-1).values
    total = cumulative[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    chosen = torch.searchsorted(cumulative, target, right=True).squeeze(1)
    return chosen.clamp_(max=probs.shape[-1] - 1)


def _sampled(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None,
             banned: list[int] | None) -> int:
    if not bool(torch.isfinite(logits.max())):
        return NON_FINITE
    row = logits / p.temperature
    if banned:
        row[banned] = float("-inf")
    if p.top_k > 0:
        kth = torch.topk(row, min(p.top_k, row.shape[-1])).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        probs = _nucleus(probs, p.top_p)
    return _draw(probs, generator)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` outside the smallest prefix of the sorted probabilities whose
    mass reaches top_p (always >= 1 token) set to 0. A model's prefix lies
    among its likely tokens, mostly: sort only the candidates at least
    NUCLEUS_CANDIDATES times as likely as the most likely token. Every other
    token is less likely than each of them, so when their mass reaches
    top_p the prefix ends among them; otherwise sort the vocabulary. On a
    CPU a sort of a 49,152-token vocabulary costs ~2.7 ms, the candidates of
    a peaked row ~0.12 ms (2-core Xeon, family 6 model 207)."""
    candidates = (probs >= probs.max() * NUCLEUS_CANDIDATES).nonzero().squeeze(-1)
    ordered, order = probs.index_select(0, candidates).sort(descending=True)
    cumulative = ordered.cumsum(-1)
    if len(candidates) and cumulative[-1] >= top_p:
        at = candidates.index_select(0, order)
    else:  # a flat row: the prefix goes past the candidates (none: bans left NaN, which _draw refuses)
        ordered, at = probs.sort(descending=True)
        cumulative = ordered.cumsum(-1)
    drop = cumulative - ordered >= top_p
    drop[0] = False  # the prefix is never empty, even where top_p rounds to 0 in float32
    kept = ordered.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).index_copy_(0, at, kept)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token drawn with probability proportional to `probs`, by the
    inverse of its cumulative sum at one uniform draw: torch's multinomial
    costs ~0.9 ms a 49,152-token row on a CPU, this ~0.04 ms. Raises, as
    multinomial did, when no token can be drawn (bans left nothing: NaN)."""
    cumulative = probs.cumsum(-1)
    total = float(cumulative[-1])
    if not total > 0 or not math.isfinite(total):
        raise InvalidArgument("no token can be sampled: its bans leave no token with a probability")
    target = torch.rand(1, generator=generator, dtype=cumulative.dtype) * total
    token = int(torch.searchsorted(cumulative, target, right=True))
    if token < probs.shape[-1]:
        return token
    # The draw rounded to the total itself: the last token that can be chosen.
    return int(probs.nonzero()[-1])
