"""BatchSampler's draw on CUDA as one Triton kernel: top-k, top-p and the
inverse-CDF draw of every sampled row, a program per row. The CUDA twin of
BatchSampler's torch path (sampling.py), which is its reference; CPU tensors
under TRITON_INTERPRET=1.

Why: the torch path sorts the whole vocabulary of every row for top-k and
top-p and runs ~20 kernels a step (softmaxes, a sort, a scatter, float64
cumulative sums and maxima, a search). bench_gpu.py measured it on an H200
at 367 µs a step at batch 1 and 1,479 µs at batch 128, outside the decode
graph's ~1 ms: sampled decoding kept the GPU busy 42 % of a step where
greedy decoding kept it 97 %.

Measured on the H200 (bench_gpu.py part 4, 2026-11-30, temperature 0.8,
top_p 0.95): at batch 128 the step takes 1,707 µs with the kernel against
2,527 with torch ops (1.48x; the GPU busy 62 % of it, from 42 %), at batch
1 it takes 1,515 against 1,436 (0.95x). A program then read its row 36
times in turn for top-p (68 with top-k too), ~620 µs whatever the batch:
the passes, one after another, not the bytes, set the time. So each search
pass now tries _BARS bars at once and narrows the range to a 17th, not a
half: 8 passes where there were 32 (12 reads of the row for top-p, 20 with
top-k too). Not yet measured on a GPU; sampling.DRAW_KERNEL_FROM_ROWS still
keeps small batches on the torch ops, as that run measured.

How, without a sort: a row's k-th largest logit is the largest value whose
count of values at or above it is at least k, found by searching the
values' 32-bit keys (a float's bits, reordered so that integer order is the
floats' order), _BARS keys tried a pass; top-p's bar likewise, over the
bits of the probabilities (non-negative floats, whose bits are ordered):
the smallest bar whose mass strictly above it is below top_p.

Semantics are the torch path's: the temperature and bans are applied by the
caller; ties with the k-th value are kept; top-p keeps the smallest sorted
prefix whose mass reaches top_p, always the most likely token, and the
tokens tied with the last one it keeps (the torch path keeps those of them
its sort puts first); the draw is the first token of positive weight whose
float64 cumulative weight exceeds u * total, and never a token of weight 0.
Masses are float32 sums in another order than the sort's cumulative sum, so
a row whose prefix mass lies within float32 rounding of top_p, or whose
target within float64 rounding of a boundary, may keep or draw the token
beside the torch path's.

Invariants: no host sync and no allocation after the output, so a call can
be captured in a CUDA graph; the token written is an index into the row
whatever the row holds (a row of NaN or nothing finite gives some index,
which the caller marks NON_FINITE).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns a program reads at a time.
_BLOCK = 1024
# Bars a search pass tries at once: the pass narrows the range between two
# to a 17th of it (a [_BARS, _BLOCK] comparison a block, one reduction).
_BARS = 16
# Passes that narrow a 32-bit key range (at most 2^32 + 1 wide) to one key,
# each keeping the widest of the 17 parts, rounded: 8.
_SEARCH_PASSES = 8


@triton.jit
def _key(x):
    """float32 -> int32 whose signed order is the floats' order."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _bars(lo, hi, BARS: tl.constexpr):
    """BARS bars in [lo, hi) (int64), non-decreasing, that split it into
    BARS + 1 parts of near-equal widths."""
    j = tl.arange(0, BARS).to(tl.int64) + 1
    return lo + (hi - lo) * j // (BARS + 1)


@triton.jit
def _top_k_weight(x, m, kth):
    """exp(x - m) for the logits within top-k (keys at or above kth), else 0."""
    return tl.where(_key(x).to(tl.int64) >= kth, tl.exp(x - m), 0.0)


@triton.jit
def _at_or_above(w, bar):
    """The weights whose bits are at or above top-p's bar, else 0."""
    return tl.where(w.to(tl.int32, bitcast=True).to(tl.int64) >= bar, w, 0.0)


@triton.jit
def _draw_kernel(x_ptr, x_stride, top_k_ptr, top_p_ptr, u_ptr, out_ptr, vocab,
                 FILTER: tl.constexpr, BARS: tl.constexpr, SEARCH_PASSES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * x_stride
    cols = tl.arange(0, BLOCK)

    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    for start in range(0, vocab, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf"))
        m = tl.maximum(m, tl.max(x, axis=0))

    # Keys at or above kth are within top-k (every finite value without it).
    kth = _key(tl.full([BLOCK], float("-inf"), tl.float32)).to(tl.int64)
    kth = tl.min(kth, axis=0)
    # The weights' bits at or above bar are within top-p (every weight without it).
    bar = tl.min(tl.zeros([BLOCK], tl.int64), axis=0)
    if FILTER:
        k = tl.load(top_k_ptr + row)
        if (k > 0) & (k < vocab):
            # Invariant: at least k keys >= lo, fewer than k keys >= hi. Both lie
            # in int32's range, and the bars between them too.
            lo = kth
            hi = _key(tl.zeros([BLOCK], tl.float32) + m).to(tl.int64)
            hi = tl.max(hi, axis=0) + 1
            for _ in range(SEARCH_PASSES):
                bars = _bars(lo, hi, BARS)
                counts = tl.zeros([BARS], tl.int64)
                for start in range(0, vocab, BLOCK):
                    x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf"))
                    inside = (_key(x)[None, :] >= bars.to(tl.int32)[:, None]) & (start + cols < vocab)[None, :]
                    counts += tl.sum(inside.to(tl.int32), axis=1).to(tl.int64)
                at_least_k = counts >= k
                lo = tl.max(tl.where(at_least_k, bars, lo), axis=0)
                hi = tl.min(tl.where(at_least_k, hi, bars), axis=0)
            kth = lo
        top_p = tl.load(top_p_ptr + row)
        if top_p < 1.0:
            z = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
            for start in range(0, vocab, BLOCK):
                x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf"))
                z += tl.sum(_top_k_weight(x, m, kth), axis=0)
            reach = top_p * z
            # Invariant: the mass of the weights above lo reaches top_p, that above hi does not
            # (the largest weight, exp(0) = 1, has nothing above it). Both in int32's range.
            lo = bar - 1
            hi = tl.max(tl.full([BLOCK], 1.0, tl.float32).to(tl.int32, bitcast=True).to(tl.int64), axis=0)
            for _ in range(SEARCH_PASSES):
                bars = _bars(lo, hi, BARS)
                above = tl.zeros([BARS], tl.float32)
                for start in range(0, vocab, BLOCK):
                    x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf"))
                    w = _top_k_weight(x, m, kth)
                    over = w.to(tl.int32, bitcast=True)[None, :] > bars.to(tl.int32)[:, None]
                    above += tl.sum(tl.where(over, w[None, :], 0.0), axis=1)
                short = above < reach
                lo = tl.max(tl.where(short, lo, bars), axis=0)
                hi = tl.min(tl.where(short, bars, hi), axis=0)
            bar = hi

    total = tl.sum(tl.zeros([BLOCK], tl.float64), axis=0)
    for start in range(0, vocab, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf"))
        w = _at_or_above(_top_k_weight(x, m, kth), bar)
        total += tl.sum(w.to(tl.float64), axis=0)
    target = tl.load(u_ptr + row) * total

    running = tl.sum(tl.zeros([BLOCK], tl.float64), axis=0)
    chosen = tl.max(tl.full([BLOCK], -1, tl.int64), axis=0)
    last = chosen
    for start in range(0, vocab, BLOCK):
        index = start + cols
        x = tl.load(base + index, mask=index < vocab, other=float("-inf"))
        w = _at_or_above(_top_k_weight(x, m, kth), bar)
        w64 = w.to(tl.float64)
        sums = running + tl.cumsum(w64, axis=0)
        # Weight > 0: a token of weight 0 has an empty interval, whatever the scan's rounding.
        over = (sums > target) & (w > 0.0)
        first = tl.min(tl.where(over, index.to(tl.int64), vocab), axis=0)
        chosen = tl.where((chosen < 0) & (first < vocab), first, chosen)
        last = tl.maximum(last, tl.max(tl.where(w > 0.0, index.to(tl.int64), -1), axis=0))
        running += tl.sum(w64, axis=0)
    # None over the target (u * total rounded to the total): the last token that can be chosen.
    chosen = tl.where(chosen < 0, last, chosen)
    tl.store(out_ptr + row, tl.maximum(chosen, 0))


def draw(rows: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
         uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of `rows` [B, vocab] (float32 logits, temperature
    and bans applied): within the row's top-k (int64 per row, 0: off) and
    top-p (float32 per row, 1: off), drawn by the inverse CDF at uniforms[i]
    (float64 in [0, 1)). `top_k` and `top_p` together or neither."""
    if rows.dtype != torch.float32 or rows.dim() != 2 or rows.stride(-1) != 1:
        raise ValueError(f"rows must be [B, vocab] float32 with unit column stride, got {rows.dtype} "
                         f"{tuple(rows.shape)} strides {rows.stride()}")
    if (top_k is None) != (top_p is None):
        raise ValueError("top_k and top_p are given together or not at all")
    batch, vocab = rows.shape
    out = torch.empty(batch, dtype=torch.long, device=rows.device)
    if batch == 0:
        return out
    filtered = top_k is not None
    _draw_kernel[(batch,)](rows, rows.stride(0), top_k if filtered else out, top_p if filtered else rows,
                           uniforms, out, vocab, FILTER=filtered, BARS=_BARS, SEARCH_PASSES=_SEARCH_PASSES,
                           BLOCK=_BLOCK)
    return out
