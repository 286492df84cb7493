"""Decode steps' projections on CUDA as Triton GEMV kernels, each fused with
the work around it (`linear="triton"`). CPU tensors under TRITON_INTERPRET=1.

Why: at batch 1 a decode step of a small model is bound by its number of
kernels, not by its bytes. An H200 replayed SmolLM2-135M's step graph in
936 µs, 14.6x the 64 µs its 270 MB of weights take to stream (bench_gpu.py,
2026-11-30), over ~10 kernels a layer: cuBLAS's four GEMMs took 3.7 µs each
(444 µs a step) for ~1.7 µs of bytes a layer, and the norms, rotary
embedding, SiLU and residual adds around them 1.5-2 µs each. Here a layer
runs four kernels around attention:

  norm_qkv_rotary_kv_write   RMSNorm -> QKV projection -> rotary q and k ->
                             K/V into the cache
  attention                  (not here: kernels/triton_attention.py)
  linear + residual          the o projection, the residual add in its epilogue
  norm_gate_up_silu          RMSNorm -> gate and up projections -> SiLU(gate) * up
  linear + residual          the down projection, the residual add in its epilogue

A GEMV reads each weight once per call whatever the row count, so one
program computes a block of output columns for every row (up to MAX_ROWS,
the decode batches these kernels are for); each program recomputes its
rows' norm (a row is a few KB, read from L2) instead of a kernel writing the
normed rows for the next one. More rows are a GEMM's work: cuBLAS's.

Rounding is the separate kernels' (triton_layer_ops), which is
transformers' Llama's op by op: the norm normalises in float32, rounds, then
weighs (rounded again); a projection accumulates in float32 and rounds once
(plus its bias, in float32, before that rounding); the rotary embedding
rounds x*cos, rotate_half(x)*sin and their sum; SiLU rounds before the
multiply by up; a residual sum is rounded from the two rounded terms. Only
the order of the float32 sums differs from cuBLAS's (and the norm's from the
norm kernel's), so results may differ in the last bits, as two cuBLAS
algorithms do.

Invariants: as triton_layer_ops, no call syncs with the host or allocates
after its launch arguments are computed (CUDA graphs capture them), and the
K/V write skips (slot, position) pairs outside the cache view.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from flexinfer.errors import InvalidArgument

# The most rows a call takes: decode batches up to here read each weight once
# for all of them; more rows are a GEMM, cuBLAS's.
MAX_ROWS = 8
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Output columns per program, a power of two among these: the widest that
# still gives the device _target_programs() programs. A GEMV of one row is
# bound by how many loads are in flight, so a small model's projections are
# split finely (SmolLM2's gate_up on an H200 with 132 SMs: 384 programs of 4
# columns, not 96 of 16); each program rereads its rows from L2, a few KB.
_COLUMN_CHOICES = (16, 8, 4)
# Elements of one program's [rows, columns, k] product per step of its K
# loop: the K block shrinks as the rows and columns grow, so the product's
# registers do not.
_PRODUCT = 8192


@triton.jit
def _row_rstd(x_ptr, x_stride, n_rows, k_size, eps, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of each row, [ROWS] float32 (0 past n_rows)."""
    rows = tl.arange(0, ROWS)
    squares = tl.zeros([ROWS], dtype=tl.float32)
    for k0 in range(0, k_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask = (rows[:, None] < n_rows) & (ks[None, :] < k_size)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_stride + ks[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        squares += tl.sum(x * x, axis=1)
    return tl.rsqrt(squares / k_size + eps)


@triton.jit
def _rows_times_columns(x_ptr, x_stride, n_rows, k_size, rstd, norm_ptr, w_ptr, cols, n_cols,
                        NORM: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[ROWS, BLOCK_N] float32: each row of x [n_rows, k_size] (first normed
    by `rstd` and weighed by the norm's weight, each rounded, if NORM) times
    the rows `cols` of the contiguous weight [n_cols, k_size]."""
    dtype = x_ptr.dtype.element_ty
    rows = tl.arange(0, ROWS)
    row_mask = rows[:, None] < n_rows
    col_mask = cols[:, None] < n_cols
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_size
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_stride + ks[None, :], mask=row_mask & k_mask[None, :],
                    other=0.0)
        if NORM:
            normed = (x.to(tl.float32) * rstd[:, None]).to(dtype)
            weight = tl.load(norm_ptr + ks, mask=k_mask, other=0.0)
            x = (weight.to(tl.float32)[None, :] * normed.to(tl.float32)).to(dtype)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * k_size + ks[None, :], mask=col_mask & k_mask[None, :],
                    other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _linear_kernel(x_ptr, x_stride, n_rows, k_size, w_ptr, n_cols, b_ptr, res_ptr, res_stride, out_ptr, out_stride,
                   HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    no_rstd = tl.zeros([ROWS], dtype=tl.float32)
    acc = _rows_times_columns(x_ptr, x_stride, n_rows, k_size, no_rstd, w_ptr, w_ptr, cols, n_cols,
                              NORM=False, ROWS=ROWS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    y = acc.to(dtype)
    rows = tl.arange(0, ROWS)[:, None].to(tl.int64)
    mask = (rows < n_rows) & (cols[None, :] < n_cols)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows * res_stride + cols[None, :], mask=mask, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(dtype)
    tl.store(out_ptr + rows * out_stride + cols[None, :], y, mask=mask)


@triton.jit
def _norm_gate_up_silu_kernel(x_ptr, x_stride, n_rows, k_size, norm_ptr, eps, w_ptr, inter, out_ptr, out_stride,
                              ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Program j: columns j*BLOCK_N.. of the gate rows [0, inter) and the same of the up rows [inter, 2 inter).
    dtype = out_ptr.dtype.element_ty
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rstd = _row_rstd(x_ptr, x_stride, n_rows, k_size, eps, ROWS=ROWS, BLOCK_K=BLOCK_K)
    gate = _rows_times_columns(x_ptr, x_stride, n_rows, k_size, rstd, norm_ptr, w_ptr, cols, inter,
                               NORM=True, ROWS=ROWS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    up = _rows_times_columns(x_ptr, x_stride, n_rows, k_size, rstd, norm_ptr, w_ptr, cols + inter, 2 * inter,
                             NORM=True, ROWS=ROWS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    gate = gate.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    y = (silu.to(tl.float32) * up.to(dtype).to(tl.float32)).to(dtype)
    rows = tl.arange(0, ROWS)[:, None].to(tl.int64)
    tl.store(out_ptr + rows * out_stride + cols[None, :], y, mask=(rows < n_rows) & (cols[None, :] < inter))


@triton.jit
def _norm_qkv_rotary_kv_write_kernel(x_ptr, x_stride, n_rows, k_size, norm_ptr, eps, w_ptr, b_ptr, out_ptr,
                                     out_stride, cos_ptr, cos_stride, sin_ptr, sin_stride, kv_ptr, kv_s0, kv_s1,
                                     kv_s2, kv_s3, slot_ptr, pos_ptr, max_slots, max_tokens, heads, kv_heads,
                                     HAS_BIAS: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
                                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Program (h, part): columns part*BLOCK_N.. of head h's first half and the
    # same of its second half, the pairs the rotary embedding mixes.
    dtype = out_ptr.dtype.element_ty
    h = tl.program_id(0)
    half = HEAD_DIM // 2
    d = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    low_cols = h * HEAD_DIM + d
    n_cols = (heads + 2 * kv_heads) * HEAD_DIM
    rstd = _row_rstd(x_ptr, x_stride, n_rows, k_size, eps, ROWS=ROWS, BLOCK_K=BLOCK_K)
    low = _rows_times_columns(x_ptr, x_stride, n_rows, k_size, rstd, norm_ptr, w_ptr, low_cols, n_cols,
                              NORM=True, ROWS=ROWS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    high = _rows_times_columns(x_ptr, x_stride, n_rows, k_size, rstd, norm_ptr, w_ptr, low_cols + half, n_cols,
                               NORM=True, ROWS=ROWS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    if HAS_BIAS:
        low += tl.load(b_ptr + low_cols).to(tl.float32)[None, :]
        high += tl.load(b_ptr + low_cols + half).to(tl.float32)[None, :]
    low = low.to(dtype)
    high = high.to(dtype)
    rows = tl.arange(0, ROWS)[:, None]
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)
    # x*cos + rotate_half(x)*sin with rotate_half(x) = [-x2, x1]: the halves
    # swapped, times the signs folded into sin's first half.
    cos_low = tl.load(cos_ptr + rows64 * cos_stride + d[None, :], mask=row_mask, other=0.0).to(tl.float32)
    cos_high = tl.load(cos_ptr + rows64 * cos_stride + half + d[None, :], mask=row_mask, other=0.0).to(tl.float32)
    sin_low = tl.load(sin_ptr + rows64 * sin_stride + d[None, :], mask=row_mask, other=0.0).to(tl.float32)
    sin_high = tl.load(sin_ptr + rows64 * sin_stride + half + d[None, :], mask=row_mask, other=0.0).to(tl.float32)
    low32, high32 = low.to(tl.float32), high.to(tl.float32)
    rotated_low = ((low32 * cos_low).to(dtype).to(tl.float32) + (high32 * sin_low).to(dtype).to(tl.float32)).to(dtype)
    rotated_high = ((high32 * cos_high).to(dtype).to(tl.float32)
                    + (low32 * sin_high).to(dtype).to(tl.float32)).to(dtype)
    # Per-element conditions (a scalar condition in a store's mask is not portable).
    head = tl.full([ROWS, BLOCK_N], 0, tl.int32) + h
    rotated = head < heads + kv_heads
    low = tl.where(rotated, rotated_low, low)
    high = tl.where(rotated, rotated_high, high)
    out = out_ptr + rows64 * out_stride + h * HEAD_DIM + d[None, :]
    tl.store(out, low, mask=row_mask)
    tl.store(out + half, high, mask=row_mask)
    # K and V heads go to the cache row of (slot, position).
    slot = tl.load(slot_ptr + rows64, mask=row_mask, other=-1)
    pos = tl.load(pos_ptr + rows64, mask=row_mask, other=-1)
    inside = row_mask & (slot >= 0) & (slot < max_slots) & (pos >= 0) & (pos < max_tokens) & (head >= heads)
    kv_index = tl.maximum(h - heads, 0)
    which = kv_index // kv_heads  # 0: K, 1: V
    row = kv_ptr + slot * kv_s0 + pos * kv_s1 + which * kv_s2 + (kv_index % kv_heads) * kv_s3 + d[None, :]
    tl.store(row, low, mask=inside)
    tl.store(row + half, high, mask=inside)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, K] (R <= MAX_ROWS; rows may be strided, K contiguous) times the
    contiguous weight [N, K], plus bias [N], plus residual [R, N]: a new [R, N] tensor."""
    rows, k = _check_rows(x, "linear's x")
    n = _check_weight(weight, x, k)
    if bias is not None:
        _check_vector(bias, x, n, "the bias")
    if residual is not None and (residual.dtype is not x.dtype or residual.shape != (rows, n)
                                 or residual.stride(1) != 1 or residual.device != x.device):
        raise InvalidArgument(f"the residual must be an [{rows}, {n}] tensor of x's dtype and device, "
                              "its last dimension contiguous")
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows and n:
        columns = _columns(lambda c: triton.cdiv(n, c), x.device)
        block_rows, block_k = _blocks(rows, columns, k)
        _linear_kernel[(triton.cdiv(n, columns),)](
            x, x.stride(0), rows, k, weight, n, bias if bias is not None else weight,
            residual if residual is not None else out, residual.stride(0) if residual is not None else 0,
            out, out.stride(0), HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, ROWS=block_rows,
            BLOCK_N=columns, BLOCK_K=block_k)
    return out


def norm_gate_up_silu(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of rms_norm(x) times weight [2I, K] = [gate rows | up
    rows] (contiguous), for x [R, K] (R <= MAX_ROWS): a new [R, I] tensor."""
    rows, k = _check_rows(x, "norm_gate_up_silu's x")
    _check_vector(norm_weight, x, k, "the norm's weight")
    n = _check_weight(weight, x, k)
    if n % 2:
        raise InvalidArgument(f"the gate_up weight has {n} rows, not gate's and up's 2 x I")
    inter = n // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows and inter:
        columns = _columns(lambda c: triton.cdiv(inter, c), x.device)
        block_rows, block_k = _blocks(rows, columns, k)
        _norm_gate_up_silu_kernel[(triton.cdiv(inter, columns),)](
            x, x.stride(0), rows, k, norm_weight, eps, weight, inter, out, out.stride(0), ROWS=block_rows,
            BLOCK_N=columns, BLOCK_K=block_k)
    return out


def norm_qkv_rotary_kv_write(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                             bias: torch.Tensor | None, heads: int, cos: torch.Tensor, sin: torch.Tensor,
                             kv: torch.Tensor, slot_index: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """qkv [R, heads + 2 kv_heads, head_dim], a new tensor: rms_norm(x) for x
    [R, K] (R <= MAX_ROWS) times the contiguous weight [(heads + 2 kv_heads)
    head_dim, K] (plus bias), its q and k heads rotated as
    triton_layer_ops.rotary_kv_write rotates them (cos and sin [R, head_dim]),
    and each row's k and v heads written into the cache view kv [slots,
    tokens, 2, kv_heads, head_dim] at (slot_index[r], positions[r]); a pair
    outside the view is not written (checked on the device)."""
    rows, k = _check_rows(x, "norm_qkv_rotary_kv_write's x")
    _check_vector(norm_weight, x, k, "the norm's weight")
    n = _check_weight(weight, x, k)
    if bias is not None:
        _check_vector(bias, x, n, "the bias")
    if kv.dim() != 5 or kv.shape[2] != 2 or kv.dtype is not x.dtype or kv.device != x.device or kv.stride(4) != 1:
        raise InvalidArgument("kv must be a [slots, tokens, 2, kv_heads, head_dim] view of x's dtype and device, "
                              "head_dim contiguous")
    max_slots, max_tokens, _, kv_heads, head_dim = kv.shape
    if head_dim % 2 or n != (heads + 2 * kv_heads) * head_dim:
        raise InvalidArgument(f"the weight has {n} rows; the cache wants ({heads} + 2 x {kv_heads}) heads of "
                              f"{head_dim} (an even size)")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype is not x.dtype or t.shape != (rows, head_dim) or t.stride(1) != 1 or t.device != x.device:
            raise InvalidArgument(f"{name} must be an [{rows}, {head_dim}] tensor of x's dtype and device, "
                                  "head_dim contiguous")
    for name, t in (("slot_index", slot_index), ("positions", positions)):
        if t.dtype is not torch.int64 or t.shape != (rows,) or t.device != x.device:
            raise InvalidArgument(f"{name} must be an [{rows}] int64 tensor on x's device")
    out = torch.empty((rows, heads + 2 * kv_heads, head_dim), dtype=x.dtype, device=x.device)
    if rows:
        half = head_dim // 2
        # A power of two that divides the half (head_dim 80: 8 at most).
        columns = _columns(lambda c: (heads + 2 * kv_heads) * half // c if half % c == 0 else 0, x.device)
        while half % columns:
            columns //= 2
        block_rows, block_k = _blocks(rows, columns, k)
        _norm_qkv_rotary_kv_write_kernel[(heads + 2 * kv_heads, half // columns)](
            x, x.stride(0), rows, k, norm_weight, eps, weight, bias if bias is not None else weight, out,
            out.stride(0), cos, cos.stride(0), sin, sin.stride(0), kv, *kv.stride()[:4], slot_index.contiguous(),
            positions.contiguous(), max_slots, max_tokens, heads, kv_heads, HAS_BIAS=bias is not None,
            HEAD_DIM=head_dim, ROWS=block_rows, BLOCK_N=columns, BLOCK_K=block_k)
    return out


@functools.lru_cache(maxsize=None)
def _target_programs(device: torch.device) -> int:
    """Programs a call should have to keep the device's memory busy: two per
    SM on CUDA; on the CPU (the interpreter) a small GPU's count."""
    if device.type != "cuda":
        return 64
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _columns(programs_of, device: torch.device) -> int:
    """The widest of _COLUMN_CHOICES for which `programs_of(columns)` reaches
    the device's target (else the narrowest)."""
    target = _target_programs(device)
    return next((c for c in _COLUMN_CHOICES if programs_of(c) >= target), _COLUMN_CHOICES[-1])


def _blocks(rows: int, columns: int, k: int) -> tuple[int, int]:
    """The rows a program's block holds (a power of two >= rows) and its K block."""
    block_rows = triton.next_power_of_2(rows)
    return block_rows, max(16, min(triton.next_power_of_2(k), _PRODUCT // (block_rows * columns)))


def _check_rows(x: torch.Tensor, what: str) -> tuple[int, int]:
    if x.dtype not in _DTYPES:
        raise InvalidArgument(f"{what} must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() != 2 or x.stride(1) != 1:
        raise InvalidArgument(f"{what} must be [R, K] with K contiguous")
    if x.shape[0] > MAX_ROWS:
        raise InvalidArgument(f"{what} has {x.shape[0]} rows; these kernels take at most {MAX_ROWS}")
    return x.shape


def _check_weight(weight: torch.Tensor, x: torch.Tensor, k: int) -> int:
    if weight.dtype is not x.dtype or weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous() \
            or weight.device != x.device:
        raise InvalidArgument(f"the weight must be a contiguous [N, {k}] tensor of x's dtype and device")
    return weight.shape[0]


def _check_vector(t: torch.Tensor, x: torch.Tensor, size: int, what: str) -> None:
    if t.dtype is not x.dtype or t.shape != (size,) or t.stride(0) != 1 or t.device != x.device:
        raise InvalidArgument(f"{what} must be a contiguous [{size}] tensor of x's dtype and device")
