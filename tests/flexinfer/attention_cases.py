"""K/V laid out as FlexInfer's KVCache lays it out, and a per-request float64
reference over the same views: what every batched attention kernel is checked
against. Shared by test_triton_attention.py (CUDA, in process),
triton_interpreter_child.py (Triton's interpreter, in a child process) and
test_cpu_attention.py (the C++ kernel).

Layout (src/flexinfer/kv_cache.py): a flat [max_slots, slot_elems] tensor whose slot
holds, per token, one row of [layer, k|v, kv_head, head_dim]; a layer's K and V
are strided views [max_slots, max_tokens, kv_heads, head_dim]. The reference
reads only rows [window start of the request's first query, seq_len) of a
request's slot, through those same views.
"""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass

import torch


def row_elems(layers: int, kv_heads: int, head_dim: int) -> int:
    return layers * 2 * kv_heads * head_dim


def kv_views(flat: torch.Tensor, max_tokens: int, layers: int, kv_heads: int, head_dim: int, layer: int):
    """(rows [S, T, layers, 2, KVH, D], k, v [S, T, KVH, D] of `layer`) over `flat` [S, >= T * row]."""
    slots = flat.shape[0]
    rows = flat[:, : max_tokens * row_elems(layers, kv_heads, head_dim)].view(
        slots, max_tokens, layers, 2, kv_heads, head_dim)
    return rows, rows[:, :, layer, 0], rows[:, :, layer, 1]


def fill_rows(rows: torch.Tensor, slot: int, start: int, end: int, generator: torch.Generator) -> None:
    """Random K/V (every layer) for tokens [start, end) of `slot`."""
    if end > start:
        shape = (end - start,) + tuple(rows.shape[2:])
        data = torch.randn(shape, generator=generator, dtype=torch.float32)
        rows[slot, start:end] = data.to(device=rows.device, dtype=rows.dtype)


class GuardedRows:
    """K/V rows [slots, max_tokens, layers, k|v, kv_heads, head_dim] on anonymous
    memory where rows below a start can be made unreadable (PROT_NONE), as vtm
    unmaps the pages that slid out of a sliding window: a kernel that loads such
    a row dies with SIGSEGV (so callers run in a child process). `k` and `v`
    are LAYER's views. A row must be whole pages, so that a row is guarded
    exactly."""

    def __init__(self, slots: int, max_tokens: int, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
        self.row_bytes = row_elems(layers, kv_heads, head_dim) * dtype.itemsize
        assert self.row_bytes % mmap.PAGESIZE == 0, self.row_bytes
        self._memory = mmap.mmap(-1, slots * max_tokens * self.row_bytes)  # page-aligned
        flat = torch.frombuffer(self._memory, dtype=dtype).view(slots, -1)
        self.rows, self.k, self.v = kv_views(flat, max_tokens, layers, kv_heads, head_dim, LAYER)
        self._libc = ctypes.CDLL(None, use_errno=True)

    def guard(self, slot: int, end: int, readable: bool = False) -> None:
        """Rows [0, end) of `slot` unreadable (readable again with readable=True)."""
        if end <= 0:
            return
        prot = mmap.PROT_READ | mmap.PROT_WRITE if readable else 0  # PROT_NONE, which mmap does not name
        if self._libc.mprotect(ctypes.c_void_p(self.rows[slot].data_ptr()), ctypes.c_size_t(end * self.row_bytes),
                               prot) != 0:
            raise OSError(ctypes.get_errno(), "mprotect failed")

    def run_guarded(self, starts: list[int], call):
        """call() with rows [0, starts[slot]) of each slot unreadable, then readable again."""
        for slot, start in enumerate(starts):
            self.guard(slot, start)
        try:
            return call()
        finally:
            for slot, start in enumerate(starts):
                self.guard(slot, start, readable=True)


def window_start(pos: int, window: int) -> int:
    """The first key a query at `pos` sees."""
    return max(0, pos - window + 1) if window else 0


def reference_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: list[int], slots: list[int],
                      seq_lens: list[int], scale: float | None = None, window: int = 0,
                      softcap: float = 0.0) -> torch.Tensor:
    """float64 [T, H, D]: request b's queries sit at the last n_b of its seq_len
    positions, each attending keys up to its own position (causal aligned to the
    end), the last `window` of them when window > 0; scores scale * q.k, capped
    to softcap * tanh(score / softcap) when softcap > 0. Reads no row below the
    first query's window."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    heads, head_dim = q.shape[1], q.shape[2]
    for b, (slot, length) in enumerate(zip(slots, seq_lens)):
        begin, end = cu_seqlens_q[b], cu_seqlens_q[b + 1]
        n = end - begin
        if n == 0:
            continue
        first = window_start(length - n, window)
        group = heads // k.shape[2]
        kk = k[slot, first:length].double().permute(1, 0, 2).repeat_interleave(group, dim=0)  # [H, keys, D]
        vv = v[slot, first:length].double().permute(1, 0, 2).repeat_interleave(group, dim=0)
        scores = q[begin:end].double().transpose(0, 1) @ kk.transpose(1, 2)  # [H, n, keys]
        scores = scores * (head_dim ** -0.5 if scale is None else scale)
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(length - n, length, device=q.device)[:, None]
        k_pos = torch.arange(first, length, device=q.device)[None, :]
        seen = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        scores = scores.masked_fill(~seen, float("-inf"))
        out[begin:end] = (torch.softmax(scores, dim=-1) @ vv).transpose(0, 1)
    return out


def reference_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: list[int], seq_lens: list[int],
                     scale: float | None = None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """float64 [B, H, D], one query per request at position seq_len - 1; zeros
    for an idle request (seq_len 0)."""
    busy = [b for b, n in enumerate(seq_lens) if n]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    if busy:
        out[busy] = reference_prefill(q[busy], k, v, list(range(len(busy) + 1)), [slots[b] for b in busy],
                                      [seq_lens[b] for b in busy], scale, window, softcap)
    return out


def cu_seqlens(new_lens: list[int]) -> list[int]:
    cu = [0]
    for n in new_lens:
        cu.append(cu[-1] + n)
    return cu


# ---------------------------------------------------------------------------- the cases

SHAPES = {"smollm2": (9, 3, 64), "mha_odd_dim": (4, 4, 40), "mqa": (8, 1, 32)}  # heads, kv_heads, head_dim
LAYERS, LAYER = 2, 1  # read the second layer: its views start mid-row
# Largest |out - ref| / (1 + |ref|) allowed: float32 is exact up to rounding;
# 16-bit outputs are rounded once (bfloat16 keeps 8 bits).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
# (seq_len, new queries): a whole prompt, a chunk continuing a cached prefix, one
# token through the prefill path, a request with no new queries, a chunk longer
# than one query block, a one-token prompt.
PREFILL = [(40, 40), (150, 23), (90, 1), (30, 0), (200, 70), (1, 1)]


def scaled_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs() / (1 + ref.abs())).max().item()


@dataclass(frozen=True)
class Case:
    """One kernel call over a NaN-poisoned cache and its float64 reference.

    The cache is an ordinary tensor holding NaN wherever the call must not read
    (past each length, below each request's first window start, the spare slot,
    the other layer), so a value that leaks in shows; requests sit in slots in
    reverse order, and a slot's stride is not a whole number of rows (as in a
    vtm space, whose slots round up to chunks)."""

    kind: str  # "decode" | "prefill"
    dtype: torch.dtype
    shape: str
    seq_lens: tuple[int, ...]
    new_lens: tuple[int, ...] = ()  # prefill only
    max_tokens: int = 256
    scale: float | None = None
    window: int = 0
    softcap: float = 0.0
    give_out: bool = False  # pass `out` (NaN-filled) and check it is the result
    give_max_q_len: bool = True
    seed: int = 0

    def run(self, module, device) -> dict:
        """{"error": scaled error vs the reference, "splits": decode splits per
        request (Triton's; 0 for prefill and for modules without splits)}."""
        heads, kv_heads, head_dim = SHAPES[self.shape]
        row = row_elems(LAYERS, kv_heads, head_dim)
        flat = torch.full((len(self.seq_lens) + 1, self.max_tokens * row + 24), float("nan"), dtype=self.dtype,
                          device=device)
        rows, k, v = kv_views(flat, self.max_tokens, LAYERS, kv_heads, head_dim, LAYER)
        slots = [len(self.seq_lens) - i for i in range(len(self.seq_lens))]
        gen = torch.Generator().manual_seed(self.seed)
        lens = list(self.seq_lens)
        news = [1] * len(lens) if self.kind == "decode" else list(self.new_lens)
        for slot, n, new in zip(slots, lens, news):
            fill_rows(rows, slot, 0, n, gen)
            rows[slot, :window_start(n - new, self.window)] = float("nan")  # slid out of every query's window
        variant = dict(scale=self.scale, window=self.window, softcap=self.softcap)

        def i32(values):
            return torch.tensor(values, dtype=torch.int32, device=device)

        batch = len(lens) if self.kind == "decode" else sum(self.new_lens)
        q = torch.randn(batch, heads, head_dim, generator=gen).to(device=device, dtype=self.dtype)
        out = torch.full_like(q, float("nan")) if self.give_out else None
        if self.kind == "decode":
            got = module.decode_attention(q, k, v, i32(slots), i32(lens), out=out, **variant)
            ref = reference_decode(q, k, v, slots, lens, **variant)
            if not all(torch.all(got[b] == 0) for b, n in enumerate(lens) if n == 0):
                raise AssertionError("an idle row is not zero")
            splits = 0
            if hasattr(module, "_num_splits"):  # Triton: its splits cover the window, when one hides keys
                context = self.window if 0 < self.window < self.max_tokens else self.max_tokens
                splits = module._num_splits(len(lens), kv_heads, context, 64, q.device)
        else:
            cu = cu_seqlens(list(self.new_lens))
            got = module.prefill_attention(q, k, v, i32(cu), i32(slots), i32(lens), out=out,
                                           max_q_len=max(self.new_lens) if self.give_max_q_len else None, **variant)
            ref = reference_prefill(q, k, v, cu, slots, lens, **variant)
            splits = 0
        if out is not None and got is not out:
            raise AssertionError("the result is not the given `out`")
        if got.dtype != self.dtype or got.shape != q.shape:
            raise AssertionError(f"result {got.dtype} {tuple(got.shape)}")
        return {"error": scaled_error(got, ref), "splits": splits}


def _cases() -> dict[str, Case]:
    cases = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).split(".")[1]
        for shape in SHAPES:
            # One idle row (CUDA-graph padding), lengths of 1 and past a block.
            cases[f"decode-{name}-{shape}"] = Case("decode", dtype, shape, (1, 0, 130, 17, 64, 200), seed=1)
        for shape in ("smollm2", "mha_odd_dim"):
            cases[f"prefill-{name}-{shape}"] = Case("prefill", dtype, shape, tuple(n for n, _ in PREFILL),
                                                    tuple(m for _, m in PREFILL), seed=3)
    # Few requests: each context splits over several programs that a second
    # kernel merges; a short request's trailing splits are empty.
    cases["decode-split-batch1"] = Case("decode", torch.float32, "smollm2", (250,), scale=0.3, give_out=True, seed=2)
    cases["decode-split-one-short"] = Case("decode", torch.float32, "smollm2", (1, 190), seed=2)
    cases["prefill-out-scale-no-max"] = Case("prefill", torch.float32, "smollm2", (70, 5), (70, 2), max_tokens=128,
                                             scale=0.2, give_out=True, give_max_q_len=False, seed=4)
    cases["decode-float16"] = Case("decode", torch.float16, "smollm2", (33, 0, 100), max_tokens=128, seed=5)
    cases["prefill-float16"] = Case("prefill", torch.float16, "smollm2", (33, 0, 100), (3, 0, 7), max_tokens=128,
                                    seed=5)
    # Per-layer variants (Gemma 2/3, Mistral): windows of one key, of a few,
    # shorter and longer than a key block, longer than every sequence and as
    # long as the slot; with and without a logit cap; GQA, mixed lengths, an
    # idle row, prefill chunks that continue a cached prefix, a scale override.
    for window in (0, 1, 3, 17, 250, 1000):
        for softcap in (0.0, 5.0):
            if window == 0 and softcap == 0.0:
                continue  # the cases above
            tag = f"w{window}-cap{softcap:g}"
            scale = 0.3 if window in (3, 250) else None
            cases[f"decode-{tag}"] = Case("decode", torch.float32, "smollm2", (1, 0, 130, 17, 64, 200), scale=scale,
                                          window=window, softcap=softcap, seed=6)
            cases[f"prefill-{tag}"] = Case("prefill", torch.float32, "smollm2", tuple(n for n, _ in PREFILL),
                                           tuple(m for _, m in PREFILL), scale=scale, window=window, softcap=softcap,
                                           seed=7)
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).split(".")[1]
        cases[f"decode-{name}-w17-cap5"] = Case("decode", dtype, "smollm2", (1, 0, 130, 17, 64, 200), window=17,
                                                softcap=5.0, seed=8)
        cases[f"prefill-{name}-w17-cap5"] = Case("prefill", dtype, "smollm2", tuple(n for n, _ in PREFILL),
                                                 tuple(m for _, m in PREFILL), window=17, softcap=5.0, seed=9)
    cases["prefill-mha-odd-dim-w5-cap50"] = Case("prefill", torch.float32, "mha_odd_dim", tuple(n for n, _ in PREFILL),
                                                 tuple(m for _, m in PREFILL), window=5, softcap=50.0, seed=10)
    # A window split over several programs: the splits cover only the window.
    cases["decode-split-window"] = Case("decode", torch.float32, "smollm2", (250,), scale=0.3, window=100,
                                        softcap=5.0, give_out=True, seed=11)
    return cases


CASES = _cases()
SPLIT_CASES = ("decode-split-batch1", "decode-split-one-short", "decode-split-window")
