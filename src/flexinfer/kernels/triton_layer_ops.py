"""The layer ops on CUDA as Triton kernels: RMSNorm with the residual add
before it, SiLU(gate)*up, and the rotary embedding fused with the K/V cache
write. The CUDA twin of cpu_layer_ops (same calls, same rounding); CPU tensors
under TRITON_INTERPRET=1.

Why: a decode step of a small model is bound by how many kernels it runs, not
by their work. bench_gpu.py measured, on an H100 with SmolLM2-135M's shape,
1.73 ms of GPU time per decode step (CUDA graph replay) at batch 1 and the same
at batch 32, ~19x the time to read the weights once: ~18 kernels per layer, a
few µs each, most of them elementwise torch ops (a norm, a residual add, a
cat, three multiplies and an add for the rotary embedding, an index_put for
the K/V write, SiLU and a multiply). These three kernels do that work in 3
launches per layer plus one norm: the residual add of the attention and MLP
outputs is made by the norm that follows it (`add_rms_norm`).

Rounding is transformers' Llama's, op by op, as cpu_layer_ops does: the
residual sum is rounded to the model's dtype before the norm reads it; the
norm normalises in float32, rounds, then weighs (rounded again); the rotary
embedding rounds x*cos, rotate_half(x)*sin and their sum; SiLU rounds before
the multiply by up.

Invariants: no kernel here syncs with the host or allocates after its
launch arguments are computed, so every call can be captured in a CUDA graph;
the K/V write stores only to (slot, position) pairs inside the cache view
(a pair outside it, which the host cannot check inside a graph, is skipped).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flexinfer.errors import InvalidArgument

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Columns per program of silu_mul (a row of the MLP's intermediate size is split over several).
_SILU_BLOCK = 1024


@triton.jit
def _add_rms_norm_kernel(x_ptr, x_stride, res_ptr, res_stride, w_ptr, out_ptr, out_stride, sum_ptr, sum_stride,
                         dim, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(sum_ptr + row * sum_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / dim
    normed = (xf * tl.rsqrt(variance + eps)).to(dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * out_stride + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(dtype), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, gate_up_stride, out_ptr, out_stride, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * gate_up_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * gate_up_stride + inter + cols, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    tl.store(out_ptr + row * out_stride + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(dtype), mask=mask)


@triton.jit
def _rotary_kv_write_kernel(qkv_ptr, qkv_s0, qkv_s1, cos_ptr, cos_s0, sin_ptr, sin_s0, kv_ptr, kv_s0, kv_s1, kv_s2,
                            kv_s3, slot_ptr, pos_ptr, max_slots, max_tokens, heads, kv_heads,
                            HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    # Program (t, h): head h of token t's [q heads | k heads | v heads].
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    mask = d < HEAD_DIM
    dtype = qkv_ptr.dtype.element_ty
    head = qkv_ptr + t * qkv_s0 + h * qkv_s1
    x = tl.load(head + d, mask=mask, other=0.0)
    # x*cos + rotate_half(x)*sin, where rotate_half(x) = [-x2, x1] is the
    # halves swapped times the signs folded into sin's first half.
    half = HEAD_DIM // 2
    swapped = tl.load(head + tl.where(d < half, d + half, d - half), mask=mask, other=0.0)
    cos = tl.load(cos_ptr + t * cos_s0 + d, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + t * sin_s0 + d, mask=mask, other=0.0)
    a = (x.to(tl.float32) * cos.to(tl.float32)).to(dtype)
    b = (swapped.to(tl.float32) * sin.to(tl.float32)).to(dtype)
    # Per-element masks (a scalar condition in a store's mask is not portable).
    h_of = tl.full([BLOCK], 0, tl.int32) + h
    rotated = h_of < heads + kv_heads
    x = tl.where(rotated, (a.to(tl.float32) + b.to(tl.float32)).to(dtype), x)
    tl.store(head + d, x, mask=mask & rotated)
    # K and V heads go to the cache row of (slot, position).
    slot = tl.load(slot_ptr + t)
    pos = tl.load(pos_ptr + t)
    slot_of = tl.full([BLOCK], 0, tl.int64) + slot
    pos_of = tl.full([BLOCK], 0, tl.int64) + pos
    inside = (slot_of >= 0) & (slot_of < max_slots) & (pos_of >= 0) & (pos_of < max_tokens)
    kv_index = tl.maximum(h - heads, 0)
    which = kv_index // kv_heads  # 0: K, 1: V
    row = kv_ptr + slot * kv_s0 + pos * kv_s1 + which * kv_s2 + (kv_index % kv_heads) * kv_s3
    tl.store(row + d, x, mask=mask & (h_of >= heads) & inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, D] (rows may be strided, D contiguous) -> a new [T, D] tensor:
    weight * rounded(x * rsqrt(mean(x^2) + eps))."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x), both new [T, D] tensors: the
    residual stream's add and the norm that reads it, in one kernel."""
    return _norm(x, residual, weight, eps)


def _norm(x, residual, weight, eps):
    _check(x, "rms_norm's x")
    if x.dim() != 2 or x.stride(1) != 1:
        raise InvalidArgument("rms_norm takes x [T, D] with D contiguous")
    if weight.dtype is not x.dtype or weight.shape != x.shape[1:] or weight.stride(0) != 1 or weight.device != x.device:
        raise InvalidArgument("rms_norm's weight must be a contiguous [D] tensor of x's dtype and device")
    if residual is not None and (residual.dtype is not x.dtype or residual.shape != x.shape
                                 or residual.stride(1) != 1 or residual.device != x.device):
        raise InvalidArgument("the residual must be a [T, D] tensor of x's dtype and device, D contiguous")
    rows, dim = x.shape
    out = torch.empty((rows, dim), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None else out
    if rows:
        _add_rms_norm_kernel[(rows,)](x, x.stride(0), residual if residual is not None else x,
                                      residual.stride(0) if residual is not None else 0, weight, out, out.stride(0),
                                      summed, summed.stride(0), dim, eps, HAS_RESIDUAL=residual is not None,
                                      BLOCK=triton.next_power_of_2(dim))
    return out, summed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate first; rows may be strided) -> a new [T, I] tensor silu(gate) * up."""
    _check(gate_up, "silu_mul's gate_up")
    if gate_up.dim() != 2 or gate_up.stride(1) != 1 or gate_up.shape[1] % 2 != 0:
        raise InvalidArgument("silu_mul takes gate_up [T, 2I] with its last dimension contiguous")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows and inter:
        _silu_mul_kernel[(rows, triton.cdiv(inter, _SILU_BLOCK))](gate_up, gate_up.stride(0), out, out.stride(0),
                                                                  inter, BLOCK=_SILU_BLOCK)
    return out


def rotary_kv_write(qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                    slot_index: torch.Tensor, positions: torch.Tensor) -> None:
    """Rotates the q and k heads of qkv [T, heads + 2 * kv_heads, head_dim] in
    place (x*cos + rotate_half(x)*sin; cos and sin [T, head_dim], sin's first
    half negated as `LlamaModel._rope` makes it), then writes each token's k
    and v heads into the layer's cache view kv [slots, tokens, 2, kv_heads,
    head_dim] at (slot_index[t], positions[t]); a pair outside the view is not
    written (checked on the device: no sync, so that it can run in a graph)."""
    _check(qkv, "rotary_kv_write's qkv")
    if qkv.dim() != 3 or kv.dim() != 5 or kv.shape[2] != 2:
        raise InvalidArgument("rotary_kv_write takes qkv [T, heads + 2 kv_heads, head_dim] "
                              "and kv [slots, tokens, 2, kv_heads, head_dim]")
    tokens, rows, head_dim = qkv.shape
    max_slots, max_tokens, _, kv_heads, kv_dim = kv.shape
    if rows != heads + 2 * kv_heads or kv_dim != head_dim or head_dim % 2:
        raise InvalidArgument(f"qkv has {rows} heads of {head_dim}; the cache wants {heads} + 2 x {kv_heads} "
                              f"heads of {kv_dim} (an even size)")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype is not qkv.dtype or t.shape != (tokens, head_dim) or t.stride(1) != 1 or t.device != qkv.device:
            raise InvalidArgument(f"{name} must be a [T, head_dim] tensor of qkv's dtype and device, "
                                  "head_dim contiguous")
    if kv.dtype is not qkv.dtype or kv.device != qkv.device or qkv.stride(2) != 1 or kv.stride(4) != 1:
        raise InvalidArgument("qkv and kv must share a dtype and device, head_dim contiguous")
    for name, t in (("slot_index", slot_index), ("positions", positions)):
        if t.dtype is not torch.int64 or t.shape != (tokens,) or t.device != qkv.device:
            raise InvalidArgument(f"{name} must be a [T] int64 tensor on qkv's device")
    if tokens:
        _rotary_kv_write_kernel[(tokens, rows)](
            qkv, qkv.stride(0), qkv.stride(1), cos, cos.stride(0), sin, sin.stride(0), kv, *kv.stride()[:4],
            slot_index.contiguous(), positions.contiguous(), max_slots, max_tokens, heads, kv_heads,
            HEAD_DIM=head_dim, BLOCK=triton.next_power_of_2(head_dim))


def _check(t: torch.Tensor, what: str) -> None:
    if t.dtype not in _DTYPES:
        raise InvalidArgument(f"{what} must be float32, bfloat16 or float16, got {t.dtype}")
