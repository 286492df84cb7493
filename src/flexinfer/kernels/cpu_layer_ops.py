"""The CPU layer ops (C++, src/flexinfer/csrc/layer_ops_cpu.cc): RMSNorm, SiLU(gate)*up,
and the rotary embedding fused with the K/V cache write, each one loop instead of
several torch ops. They round as transformers' Llama does (see layer_ops_cpu.h).

These wrappers check dtypes, shapes and devices torch-side and pass raw pointers;
the kernel itself checks every slot and position before it writes.
"""

from __future__ import annotations

import torch

from flexinfer import _kernels
from flexinfer.errors import InvalidArgument
from flexinfer.kernels import FLOAT32_BFLOAT16_CODES as _DTYPE_CODES



def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, threads: int | None = None) -> torch.Tensor:
    """x [T, D] (rows may be strided, D contiguous) -> a new [T, D] tensor:
    x * rsqrt(mean(x^2) + eps) * weight."""
    code = _code(x)
    if x.dim() != 2 or x.stride(1) != 1:
        raise InvalidArgument("rms_norm takes x [T, D] with D contiguous")
    if weight.dtype is not x.dtype or weight.shape != x.shape[1:] or weight.stride(0) != 1 or not weight.is_cpu:
        raise InvalidArgument("rms_norm's weight must be a contiguous [D] CPU tensor of x's dtype")
    out = torch.empty_like(x)  # row-major like x (x is dense, or a slice and out contiguous)
    try:
        _kernels.rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0), x.shape[0],
                          x.shape[1], eps, code, torch.get_num_threads() if threads is None else threads)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    return out


def silu_mul(gate_up: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """gate_up [T, 2I] (gate first; rows may be strided) -> a new [T, I] tensor silu(gate) * up."""
    code = _code(gate_up)
    if gate_up.dim() != 2 or gate_up.stride(1) != 1 or gate_up.shape[1] % 2 != 0:
        raise InvalidArgument("silu_mul takes gate_up [T, 2I] with its last dimension contiguous")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype)
    try:
        _kernels.silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), inter, rows, inter, code,
                          torch.get_num_threads() if threads is None else threads)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    return out


def rotary_kv_write(qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                    slot_index: torch.Tensor, positions: torch.Tensor, threads: int | None = None) -> None:
    """Rotates q and k heads of qkv [T, heads + 2 * kv_heads, head_dim] in place
    (x*cos + rotate_half(x)*sin; cos and sin [T, head_dim], sin's first half
    negated as `LlamaModel._rope` makes it), then writes each token's k and v
    heads into the layer's cache view kv [slots, tokens, 2, kv_heads, head_dim]
    at (slot_index[t], positions[t]). A slot or position outside the view
    raises InvalidArgument and changes nothing."""
    code = _code(qkv)
    if qkv.dim() != 3 or kv.dim() != 5 or kv.shape[2] != 2:
        raise InvalidArgument("rotary_kv_write takes qkv [T, heads + 2 kv_heads, head_dim] "
                              "and kv [slots, tokens, 2, kv_heads, head_dim]")
    tokens, rows, head_dim = qkv.shape
    max_slots, max_tokens, _, kv_heads, kv_dim = kv.shape
    if rows != heads + 2 * kv_heads or kv_dim != head_dim:
        raise InvalidArgument(f"qkv has {rows} heads of {head_dim}; the cache wants {heads} + 2 x {kv_heads} "
                              f"heads of {kv_dim}")
    table = (tokens, head_dim)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype is not qkv.dtype or t.shape != table or t.stride(1) != 1 or not t.is_cpu:
            raise InvalidArgument(f"{name} must be a [T, head_dim] CPU tensor of qkv's dtype, head_dim contiguous")
    q_strides, kv_strides = qkv.stride(), kv.stride()
    if kv.dtype is not qkv.dtype or not kv.is_cpu or q_strides[2] != 1 or kv_strides[4] != 1:
        raise InvalidArgument("qkv and kv must share a dtype and the CPU, head_dim contiguous")
    for name, t in (("slot_index", slot_index), ("positions", positions)):
        if t.dtype is not torch.int64 or t.shape != (tokens,) or not t.is_cpu:
            raise InvalidArgument(f"{name} must be a [T] int64 CPU tensor")
    slot_index, positions = slot_index.contiguous(), positions.contiguous()
    try:
        _kernels.rotary_kv_write(qkv.data_ptr(), q_strides[0], q_strides[1], cos.data_ptr(), cos.stride(0),
                                 sin.data_ptr(), sin.stride(0), kv.data_ptr(), kv_strides[0], kv_strides[1],
                                 kv_strides[2], kv_strides[3], max_slots, max_tokens, slot_index.data_ptr(),
                                 positions.data_ptr(), tokens, heads, kv_heads, head_dim, code,
                                 torch.get_num_threads() if threads is None else threads)
    except ValueError as exc:  # the kernel's own checks (head_dim, slots, positions)
        raise InvalidArgument(str(exc)) from None


def _code(t: torch.Tensor) -> int:
    code = _DTYPE_CODES.get(t.dtype)
    if code is None or not t.is_cpu:
        raise InvalidArgument(f"the CPU layer ops take float32 or bfloat16 CPU tensors, got {t.dtype} on {t.device}")
    return code
