"""Triton attention over a vtm space's per-layer K/V views (CUDA; CPU under TRITON_INTERPRET=1).

One call per layer serves the whole batch. K and V are the strided views
`[max_slots, max_tokens, kv_heads, head_dim]` of KVCache (head_dim contiguous);
request b reads slot `slots[b]`, tokens `[0, seq_lens[b])`. The callers keep
the first byte of each view mapped (the engine's sink vTensor in slot 0):
Triton's launcher checks every tensor argument's data_ptr() with
cuPointerGetAttribute, which may refuse an address with nothing mapped.

Invariants every kernel here keeps:
- every load of K/V is masked by its request's own length: pages past
  `seq_lens[b]` are unmapped (a stray read faults on the host backend and reads
  garbage on CUDA), so nothing is loaded first and masked afterwards;
- a request with `seq_lens[b] == 0` (CUDA-graph padding) reads nothing, not even
  its query or slot, and gets zeros;
- launch grids and workspaces depend only on shapes and python ints: no host
  sync, so both calls can be captured in a CUDA graph and replayed after the
  lengths change in place and vtm maps new pages under the same addresses;
- softmax runs online in float32, in base 2 (the scale is folded with log2(e)).

Each call takes its layer's variant: `scale` (None: head_dim ** -0.5),
`window` (a query at position p sees keys max(0, p - window + 1) .. p; 0: no
window) and `softcap` (a score s = scale * q.k becomes softcap * tanh(s /
softcap) before the mask; 0: none). No load reaches below a window: its key
loops start at the window's first key (a decode split covers only the window,
a prefill block starts at its first query's window), since the pages that slid
out of a window may be unmapped. Whether there is a cap and a window are
constexprs (SOFTCAP, WINDOWED), so that a plain layer runs the code it ran
before; the window's size is a run-time argument.

decode_attention splits each request's context over NUM_SPLITS programs
(flash-decoding) so that a small batch with a long context still fills the GPU,
then a second kernel merges the partial results; a batch large enough to fill
the GPU alone takes one split and one kernel. prefill_attention computes causal
attention for chunks of new queries that continue a cached prefix: query j of a
chunk of n sits at position seq_len - n + j.

Matrix products take 16-bit operands as they are (float32 accumulation) and
float32 ones at full precision (no TF32); in the interpreter every operand is
converted to float32 first, because its bfloat16 tl.dot is wrong (triton 3.9).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from flexinfer.errors import InvalidArgument
from flexinfer.kernels import check_variant

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOG2E = 1.4426950408889634
# A finite "minus infinity" for running maxima: exp2(score - running max) must
# be 0, never NaN, while a program has seen no valid key yet.
_NEG_BIG = tl.constexpr(-1.0e30)
_MAX_SPLITS = 64


@triton.jit
def _scores_log2(qk, qk_scale, softcap_log2, SOFTCAP: tl.constexpr):
    """Scores in the log2 domain from the raw products q.k (see _variant_args).
    Without a cap: qk * qk_scale, qk_scale = scale * log2(e). With one, the tanh
    takes x = qk * qk_scale, qk_scale = scale / softcap, in natural units, and
    only its result moves to base 2 (times softcap_log2 = softcap * log2(e)).
    tanh(x) = 1 - 2 / (e^(2x) + 1) is exact at both ends (e^(2x) overflowing to
    inf gives 1, underflowing to 0 gives -1) and needs no libdevice call, which
    the interpreter lacks; near 0 it keeps only an absolute error of about 1e-7
    (e^(2x) rounds near 1), which a cap of 50 would turn into ~5e-6 of a score,
    so there the odd Taylor series to x^11 is used (first omitted term < 2e-9
    for |x| < 0.3)."""
    if SOFTCAP:
        x = qk * qk_scale
        far = 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # e^(2x) = 2^(2 log2(e) x)
        x2 = x * x
        p = -1382.0 / 155925
        p = p * x2 + 62.0 / 2835
        p = p * x2 - 17.0 / 315
        p = p * x2 + 2.0 / 15
        p = p * x2 - 1.0 / 3
        near = x + x * x2 * p
        return tl.where(tl.abs(x) < 0.3, near, far) * softcap_log2
    else:
        return qk * qk_scale


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, lens_ptr, out_ptr, acc_ptr, m_ptr, l_ptr, qk_scale,
                         softcap_log2, window,
                         stride_qb, stride_qh, stride_ks, stride_kt, stride_kh, stride_vs, stride_vt, stride_vh,
                         stride_ob, stride_oh, num_heads, head_dim, group,
                         DOT_F32: tl.constexpr, SOFTCAP: tl.constexpr, WINDOWED: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    """Program (b, kv_head, split): the `group` query heads of one kv head (rows
    of a BLOCK_G >= 16 tile, so that the scores are one tl.dot and K/V are read
    once per group) over one split of request b's context: of its last `window`
    keys when window > 0, which is all the query sees. With one split it
    writes the output itself (zeros for an idle row). Otherwise it writes its
    unnormalised output, running max (log2 domain) and sum to acc [B, H, S, D],
    m and l [B, H, S] for _decode_merge_kernel; an empty split writes acc 0,
    l 0, m _NEG_BIG, so that the merge reads only written values.
    DOT_F32: as in _prefill_kernel."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    context_lo = 0
    if WINDOWED:
        context_lo = tl.maximum(seq_len - window, 0)
    # Splits are whole multiples of BLOCK_N from the context's first key;
    # trailing ones may be empty.
    per_split = tl.cdiv(tl.cdiv(seq_len - context_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = context_lo + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    active = lo < hi

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * group + offs_g
    g_mask = offs_g < group
    d_mask = offs_d < head_dim
    # An empty split reads no query: its group bound drops to 0 (a block & a
    # scalar mask loses its boolean type in the interpreter).
    q_mask = (offs_g < tl.where(active, group, 0))[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    slot = tl.load(slots_ptr + b, mask=active, other=0).to(tl.int64)
    k_base = k_ptr + slot * stride_ks + kvh * stride_kh
    v_base = v_ptr + slot * stride_vs + kvh * stride_vh

    m_i = tl.full([BLOCK_G], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        kv_mask = n_mask[:, None] & d_mask[None, :]
        rows = offs_n.to(tl.int64)[:, None]
        k = tl.load(k_base + rows * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(n_mask[None, :], _scores_log2(s, qk_scale, softcap_log2, SOFTCAP), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + rows * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        # Workspaces are contiguous: [B, H, S, BLOCK_D] and [B, H, S].
        row = (b.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        tl.store(acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_mask[:, None])
        tl.store(m_ptr + row, m_i, mask=g_mask)
        tl.store(l_ptr + row, l_i, mask=g_mask)


@triton.jit
def _decode_merge_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, stride_ob, stride_oh, num_heads, head_dim,
                         NUM_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (b, h): out[b, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s;
    zeros where nothing was attended (an idle row)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    row = (b.to(tl.int64) * num_heads + h) * NUM_SPLITS + offs_s
    m = tl.load(m_ptr + row)
    l_s = tl.load(l_ptr + row)
    acc = tl.load(acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :])
    w = tl.exp2(m - tl.max(m, axis=0))
    denom = tl.sum(w * l_s, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
             o.to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, cu_ptr, slots_ptr, lens_ptr, out_ptr, qk_scale, softcap_log2, window,
                    stride_qt, stride_qh, stride_ks, stride_kt, stride_kh, stride_vs, stride_vt, stride_vh,
                    stride_ot, stride_oh, head_dim, group,
                    DOT_F32: tl.constexpr, SOFTCAP: tl.constexpr, WINDOWED: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (query block, b, h): BLOCK_M of request b's new queries for query
    head h, against keys [0, last query position] of kv head h // group; with a
    window, from the block's first query's window start (the lowest of the
    block's), each query masked to its own window.
    DOT_F32: the matrix products take float32 operands at full precision (float32
    models, and the interpreter, whose bfloat16 tl.dot is wrong)."""
    mblk = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(cu_ptr + b)
    n_new = tl.load(cu_ptr + b + 1) - q_start
    if mblk * BLOCK_M >= n_new:
        return
    seq_len = tl.load(lens_ptr + b)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    kvh = h // group
    first_pos = seq_len - n_new

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < n_new
    d_mask = offs_d < head_dim
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    q_pos = first_pos + offs_m
    k_base = k_ptr + slot * stride_ks + kvh * stride_kh
    v_base = v_ptr + slot * stride_vs + kvh * stride_vh

    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys up to this block's last query position (causal), never past seq_len,
    # and from its first query's window start (no load below it).
    hi = tl.minimum(seq_len, first_pos + (mblk + 1) * BLOCK_M)
    lo = 0
    if WINDOWED:
        lo = tl.maximum(first_pos + mblk * BLOCK_M - window + 1, 0)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        kv_mask = n_mask[:, None] & d_mask[None, :]
        rows = offs_n.to(tl.int64)[:, None]
        k = tl.load(k_base + rows * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = _scores_log2(s, qk_scale, softcap_log2, SOFTCAP)
        visible = offs_n[None, :] <= q_pos[:, None]
        if WINDOWED:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(n_mask[None, :] & visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + rows * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _interpreted() -> bool:
    """Whether these kernels were decorated under TRITON_INTERPRET=1 (triton
    decides when the module is imported, not when a kernel runs)."""
    return not isinstance(_prefill_kernel, triton.runtime.JITFunction)


def _dot_f32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or _interpreted()


# Tiles: (query rows, keys a step, head_dim, warps) of a program. tl.dot needs
# every side >= 16. The sizes are the largest that compile for sm_90 without
# register spills (cuobjdump's resource usage; test_triton_attention.py checks
# SmolLM2's): float32 operands at full precision take about twice the registers.


def _decode_tiles(dtype: torch.dtype, group: int, head_dim: int) -> tuple[int, int, int, int]:
    block_d = max(16, triton.next_power_of_2(head_dim))
    f32 = dtype == torch.float32
    block_rows = max(16, triton.next_power_of_2(group))
    keys = (1024 if f32 and block_d <= 64 else 512 if f32 else 1024 if block_d <= 128 else 512) // block_rows
    return block_rows, max(16, min(64, keys)), block_d, 8 if f32 and block_d > 128 else 4


def _prefill_tiles(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int, int]:
    block_d = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:
        return 32, 32 if block_d <= 128 else 16, block_d, 4 if block_d <= 64 else 8
    if block_d <= 128:
        return 64, 64, block_d, 4 if block_d <= 64 else 8
    return 32, 32, block_d, 8


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits keep the merge path exercised
    return torch.cuda.get_device_properties(device).multi_processor_count


def _num_splits(batch: int, kv_heads: int, max_tokens: int, block_n: int, device: torch.device) -> int:
    """Splits per request: enough programs for about two waves over the GPU, no
    more than the cache's blocks, a power of two (the merge loads them as one block)."""
    want = math.ceil(2 * _multiprocessors(device) / max(1, batch * kv_heads))
    limit = min(_MAX_SPLITS, triton.next_power_of_2(math.ceil(max_tokens / block_n)))
    return max(1, min(triton.next_power_of_2(want), limit))


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
           batch: int, out: torch.Tensor | None, what: str) -> tuple[int, int, int]:
    """Shapes, dtypes and devices only (values would need a device sync).
    Returns (heads, kv_heads, head_dim)."""
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        raise InvalidArgument(f"{what}: q must be 3-D and k, v 4-D of one shape, got q {tuple(q.shape)}, "
                              f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[2]
    if k.shape[3] != head_dim or kv_heads == 0 or heads % kv_heads:
        raise InvalidArgument(f"{what}: q {tuple(q.shape)} does not fit k {tuple(k.shape)} "
                              f"(head_dim must match and heads be a multiple of kv_heads)")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise InvalidArgument(f"{what}: q, k, v must share one dtype of {_DTYPES}, got {q.dtype}, {k.dtype}, "
                              f"{v.dtype}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise InvalidArgument(f"{what}: head_dim must be contiguous in q, k and v")
    for name, t in (("slots", slots), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32 or t.shape != (batch,):
            raise InvalidArgument(f"{what}: {name} must be int32 of shape ({batch},), got {t.dtype} "
                                  f"{tuple(t.shape)}")
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
            raise InvalidArgument(f"{what}: out must be {q.dtype} {tuple(q.shape)} with contiguous head_dim, "
                                  f"got {out.dtype} {tuple(out.shape)}")
    tensors = [q, k, v, slots, seq_lens] + ([] if out is None else [out])
    if any(t.device != q.device for t in tensors):
        raise InvalidArgument(f"{what}: every tensor must be on {q.device}")
    if q.device.type != "cuda" and not _interpreted():
        raise InvalidArgument(f"{what}: the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 at import)")
    return heads, kv_heads, head_dim


def _variant_args(scale, window: int, softcap: float, head_dim: int, max_tokens: int) -> tuple[float, float, int]:
    """The kernels' (qk_scale, softcap_log2, window) for a checked variant (see
    _scores_log2). A window of at least max_tokens hides no key: it becomes 0,
    the unwindowed code (and never overflows the kernels' int32 positions)."""
    scale = head_dim ** -0.5 if scale is None else scale
    if softcap:
        qk_scale, softcap_log2 = scale / softcap, softcap * _LOG2E
    else:
        qk_scale, softcap_log2 = scale * _LOG2E, 0.0
    return qk_scale, softcap_log2, 0 if window >= max_tokens else window


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                     seq_lens: torch.Tensor, out: torch.Tensor | None = None,
                     scale: float | None = None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """One new query per request: q [B, H, D] attends tokens [0, seq_lens[b]) of
    slot slots[b] in k, v [S, T, KVH, D] (the last `window` of them when window
    > 0). Returns out [B, H, D] (q's dtype)."""
    scale, window, softcap = check_variant(scale, window, softcap)
    batch = q.shape[0] if q.dim() == 3 else -1
    heads, kv_heads, head_dim = _check(q, k, v, slots, seq_lens, batch, out, "decode_attention")
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    group = heads // kv_heads
    block_g, block_n, block_d, warps = _decode_tiles(q.dtype, group, head_dim)
    qk_scale, softcap_log2, window = _variant_args(scale, window, softcap, head_dim, k.shape[1])
    # Splits cover what a query sees: the window, when there is one.
    splits = _num_splits(batch, kv_heads, window or k.shape[1], block_n, q.device)
    if splits == 1:
        acc = m = l_sum = out  # not touched: the split kernel writes `out` itself
    else:
        acc = torch.empty((batch, heads, splits, block_d), dtype=torch.float32, device=q.device)
        m = torch.empty((batch, heads, splits), dtype=torch.float32, device=q.device)
        l_sum = torch.empty_like(m)
    _decode_split_kernel[(batch, kv_heads, splits)](
        q, k, v, slots, seq_lens, out, acc, m, l_sum, qk_scale, softcap_log2, window,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), heads, head_dim, group, DOT_F32=_dot_f32(q.dtype), SOFTCAP=softcap > 0,
        WINDOWED=window > 0, NUM_SPLITS=splits, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=warps)
    if splits > 1:
        _decode_merge_kernel[(batch, heads)](acc, m, l_sum, out, out.stride(0), out.stride(1), heads, head_dim,
                                             NUM_SPLITS=splits, BLOCK_D=block_d, num_warps=4)
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      slots: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor | None = None,
                      scale: float | None = None, max_q_len: int | None = None, window: int = 0,
                      softcap: float = 0.0) -> torch.Tensor:
    """New queries of several requests, concatenated: q [T, H, D], request b's
    are rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1, its new K/V already written
    at the last n_b of its seq_lens[b] positions; causal aligned to the end (and
    each query limited to its last `window` keys when window > 0).
    max_q_len (the longest n_b) sizes the grid; without it, T does."""
    scale, window, softcap = check_variant(scale, window, softcap)
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1 or cu_seqlens_q.dtype != torch.int32:
        raise InvalidArgument(f"prefill_attention: cu_seqlens_q must be int32 of shape [B+1], got "
                              f"{cu_seqlens_q.dtype} {tuple(cu_seqlens_q.shape)}")
    if cu_seqlens_q.device != q.device:
        raise InvalidArgument(f"prefill_attention: cu_seqlens_q must be on {q.device}")
    batch = cu_seqlens_q.shape[0] - 1
    heads, kv_heads, head_dim = _check(q, k, v, slots, seq_lens, batch, out, "prefill_attention")
    if out is None:
        out = torch.empty_like(q)
    rows = q.shape[0]
    max_q_len = rows if max_q_len is None else min(int(max_q_len), rows)
    if batch == 0 or max_q_len <= 0:
        return out
    block_m, block_n, block_d, warps = _prefill_tiles(q.dtype, head_dim)
    qk_scale, softcap_log2, window = _variant_args(scale, window, softcap, head_dim, k.shape[1])
    _prefill_kernel[(triton.cdiv(max_q_len, block_m), batch, heads)](
        q, k, v, cu_seqlens_q, slots, seq_lens, out, qk_scale, softcap_log2, window,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), head_dim, heads // kv_heads, DOT_F32=_dot_f32(q.dtype), SOFTCAP=softcap > 0,
        WINDOWED=window > 0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps)
    return out
