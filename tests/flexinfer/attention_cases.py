"""K/V laid out as FlexInfer's KVCache lays it out, and per-request torch SDPA
over the same views: the reference every batched attention kernel is checked
against. Shared by test_triton_attention.py (CUDA, in process) and
triton_interpreter_child.py (Triton's interpreter, in a child process).

Layout (src/flexinfer/kv_cache.py): a flat [max_slots, slot_elems] tensor whose slot
holds, per token, one row of [layer, k|v, kv_head, head_dim]; a layer's K and V
are strided views [max_slots, max_tokens, kv_heads, head_dim]. The reference
reads only rows [0, seq_len) of a request's slot, through those same views.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


def _heads_view(x: torch.Tensor, slot: int, length: int) -> torch.Tensor:
    """x[slot, :length] as [1, kv_heads, length, head_dim], float32."""
    return x[slot, :length].permute(1, 0, 2).unsqueeze(0).float()


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: list[int], seq_lens: list[int],
                scale: float | None = None) -> torch.Tensor:
    """float32 [B, H, D]; zeros for an idle request (seq_len 0)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, (slot, length) in enumerate(zip(slots, seq_lens)):
        if length:
            o = F.scaled_dot_product_attention(q[b:b + 1, :, None].float(), _heads_view(k, slot, length),
                                               _heads_view(v, slot, length), scale=scale, enable_gqa=True)
            out[b] = o[0, :, 0]
    return out


def sdpa_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: list[int], slots: list[int],
                 seq_lens: list[int], scale: float | None = None) -> torch.Tensor:
    """float32 [T, H, D]: request b's queries sit at the last n_b of its seq_len
    positions, each attending keys up to its own position (causal aligned to the end)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, (slot, length) in enumerate(zip(slots, seq_lens)):
        first, last = cu_seqlens_q[b], cu_seqlens_q[b + 1]
        n = last - first
        if n == 0:
            continue
        q_pos = torch.arange(length - n, length, device=q.device)[:, None]
        mask = torch.arange(length, device=q.device)[None, :] <= q_pos
        qi = q[first:last].transpose(0, 1).unsqueeze(0).float()
        o = F.scaled_dot_product_attention(qi, _heads_view(k, slot, length), _heads_view(v, slot, length),
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        out[first:last] = o[0].transpose(0, 1)
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
    """One kernel call over a NaN-poisoned cache and its SDPA reference.

    The cache is an ordinary tensor holding NaN wherever the call must not read
    (past each length, the spare slot, the other layer), so a value that leaks
    in shows; requests sit in slots in reverse order, and a slot's stride is not
    a whole number of rows (as in a vtm space, whose slots round up to chunks)."""

    kind: str  # "decode" | "prefill"
    dtype: torch.dtype
    shape: str
    seq_lens: tuple[int, ...]
    new_lens: tuple[int, ...] = ()  # prefill only
    max_tokens: int = 256
    scale: float | None = None
    give_out: bool = False  # pass `out` (NaN-filled) and check it is the result
    give_max_q_len: bool = True
    seed: int = 0

    def run(self, module, device) -> dict:
        """{"error": scaled error vs SDPA, "splits": decode splits per request}."""
        heads, kv_heads, head_dim = SHAPES[self.shape]
        row = row_elems(LAYERS, kv_heads, head_dim)
        flat = torch.full((len(self.seq_lens) + 1, self.max_tokens * row + 24), float("nan"), dtype=self.dtype,
                          device=device)
        rows, k, v = kv_views(flat, self.max_tokens, LAYERS, kv_heads, head_dim, LAYER)
        slots = [len(self.seq_lens) - i for i in range(len(self.seq_lens))]
        gen = torch.Generator().manual_seed(self.seed)
        for slot, n in zip(slots, self.seq_lens):
            fill_rows(rows, slot, 0, n, gen)
        lens = list(self.seq_lens)

        def i32(values):
            return torch.tensor(values, dtype=torch.int32, device=device)

        batch = len(lens) if self.kind == "decode" else sum(self.new_lens)
        q = torch.randn(batch, heads, head_dim, generator=gen).to(device=device, dtype=self.dtype)
        out = torch.full_like(q, float("nan")) if self.give_out else None
        if self.kind == "decode":
            got = module.decode_attention(q, k, v, i32(slots), i32(lens), out=out, scale=self.scale)
            ref = sdpa_decode(q, k, v, slots, lens, scale=self.scale)
            if not all(torch.all(got[b] == 0) for b, n in enumerate(lens) if n == 0):
                raise AssertionError("an idle row is not zero")
            splits = module._num_splits(len(lens), kv_heads, self.max_tokens, 64, q.device)
        else:
            cu = cu_seqlens(list(self.new_lens))
            got = module.prefill_attention(q, k, v, i32(cu), i32(slots), i32(lens), out=out, scale=self.scale,
                                           max_q_len=max(self.new_lens) if self.give_max_q_len else None)
            ref = sdpa_prefill(q, k, v, cu, slots, lens, scale=self.scale)
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
    return cases


CASES = _cases()
SPLIT_CASES = ("decode-split-batch1", "decode-split-one-short")
