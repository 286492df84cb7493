"""The CPU attention kernel (C++, src/flexinfer/csrc/attention_cpu.cc): checks the
arguments torch-side and hands raw pointers to the extension.

Both entry points read K and V in place through per-layer views
`[max_slots, max_tokens, kv_heads, head_dim]` of a vtm space. Request b owns
slot `slots[b]` and its first `seq_lens[b]` tokens; no load ever reaches past
them, since the pages beyond are unmapped.

Every call takes a layer's attention variant: `scale` (None: head_dim ** -0.5),
`window` (a query at position p sees keys max(0, p - window + 1) .. p; 0: no
window; no load reaches below the window, whose pages may be unmapped too) and
`softcap` (scores become softcap * tanh(score / softcap) before the mask; 0:
none). The kernel checks them (scale > 0, window >= 0, softcap >= 0, all
finite) with the other arguments, before it reads anything.
"""

from __future__ import annotations

import torch

from flexinfer import _kernels
from flexinfer.errors import InvalidArgument
from flexinfer.kernels import DTYPE_CODES as _DTYPE_CODES



class Plan:
    """A forward pass's batch, checked once, for one kernel call per layer.

    The engine runs the same slots, lengths and offsets through every layer;
    building them into a plan leaves each layer's call with nothing but
    pointers to pass (the per-call checks of `decode_attention` cost more than
    the kernel itself on short contexts). The kernel still checks every slot
    and length against the view's bounds before it reads.
    """

    def __init__(self, slots, seq_lens, cu_seqlens_q=None, threads=None):
        _check_vectors(slots, seq_lens)
        if cu_seqlens_q is not None:
            _check_offsets(cu_seqlens_q, slots)
        self._keep = (slots.contiguous(), seq_lens.contiguous(),
                      None if cu_seqlens_q is None else cu_seqlens_q.contiguous())
        self._slots, self._lens = self._keep[0].data_ptr(), self._keep[1].data_ptr()
        self._cu = 0 if cu_seqlens_q is None else self._keep[2].data_ptr()
        self._batch = slots.shape[0]
        self._threads = torch.get_num_threads() if threads is None else threads

    def run(self, q, k, v, out, scale=None, window=0, softcap=0.0):
        """out[...] = attention of q over k, v (per-layer views sharing one geometry),
        with this layer's scale, window and softcap (see the module's docstring)."""
        tokens, heads, head_dim = q.shape
        max_slots, max_tokens, kv_heads, _ = k.shape
        try:
            _kernels.attention(
                q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
                k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2), max_slots, max_tokens,
                self._slots, self._lens, self._cu, self._batch, tokens, heads, kv_heads, head_dim,
                _DTYPE_CODES[q.dtype], head_dim ** -0.5 if scale is None else scale, window, softcap,
                self._threads)
        except (TypeError, ValueError) as exc:  # the binding's conversions, the kernel's checks
            raise InvalidArgument(str(exc)) from None
        return out


def decode_attention(q, k, v, slots, seq_lens, out=None, scale=None, threads=None, *, window=0, softcap=0.0):
    """One query per request: q [B, heads, head_dim] at position seq_lens[b] - 1.
    A request with seq_lens[b] == 0 is idle: it reads nothing and gets zeros."""
    return _run(q, k, v, slots, seq_lens, None, out, scale, threads, window, softcap)


def prefill_attention(q, k, v, cu_seqlens_q, slots, seq_lens, out=None, scale=None, max_q_len=None, threads=None,
                      *, window=0, softcap=0.0):
    """q [T, heads, head_dim]: request b's queries are q[cu[b]:cu[b+1]], the last
    tokens of its seq_lens[b] cached ones, attending causally (aligned to the end).
    `max_q_len` sizes the Triton kernel's grid; the CPU kernel reads the offsets."""
    _check_offsets(cu_seqlens_q, slots)
    return _run(q, k, v, slots, seq_lens, cu_seqlens_q.contiguous(), out, scale, threads, window, softcap)


def _run(q, k, v, slots, seq_lens, cu_q, out, scale, threads, window, softcap):
    dtype = q.dtype
    if dtype not in _DTYPE_CODES:
        raise InvalidArgument(f"unsupported dtype {dtype}")
    if q.dim() != 3 or k.dim() != 4 or k.shape != v.shape or k.stride() != v.stride():
        raise InvalidArgument("q must be [T, heads, head_dim]; k and v the same [slots, tokens, kv_heads, head_dim] view")
    if k.dtype != dtype or v.dtype != dtype:
        raise InvalidArgument("q, k and v must have one dtype")
    if any(t.device.type != "cpu" for t in (q, k, v)):
        raise InvalidArgument("the CPU kernel takes CPU tensors")
    _check_vectors(slots, seq_lens)
    max_slots, max_tokens, kv_heads, head_dim = k.shape
    tokens, heads, q_dim = q.shape
    if q_dim != head_dim or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise InvalidArgument("head_dim must match and be contiguous in q, k and v")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != dtype or out.stride(-1) != 1:
        raise InvalidArgument("out must match q's shape and dtype")
    slots = slots.contiguous()
    seq_lens = seq_lens.contiguous()
    try:
        _kernels.attention(
            q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
            k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2), max_slots, max_tokens,
            slots.data_ptr(), seq_lens.data_ptr(), 0 if cu_q is None else cu_q.data_ptr(),
            slots.shape[0], tokens, heads, kv_heads, head_dim, _DTYPE_CODES[dtype],
            head_dim ** -0.5 if scale is None else scale, window, softcap,
            torch.get_num_threads() if threads is None else threads)
    except (TypeError, ValueError) as exc:  # the binding's conversions; the kernel's own checks
        raise InvalidArgument(str(exc)) from None
    return out


def _check_vectors(slots, seq_lens):
    for name, t in (("slots", slots), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != slots.shape[0] or t.device.type != "cpu":
            raise InvalidArgument(f"{name} must be a 1-D int32 CPU tensor with one entry per request")


def _check_offsets(cu_seqlens_q, slots):
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.device.type != "cpu" or cu_seqlens_q.dim() != 1:
        raise InvalidArgument("cu_seqlens_q must be a 1-D int32 CPU tensor")
    if cu_seqlens_q.shape[0] != slots.shape[0] + 1:
        raise InvalidArgument("cu_seqlens_q needs one more entry than slots")
