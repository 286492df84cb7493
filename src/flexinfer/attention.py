"""Attention backends behind one small interface.

`prepare(batch, kv_cache)` runs once per forward pass; `forward(layer, q,
batch, kv_cache)` returns the attention output [T, heads, head_dim] for the
flattened batch's queries q [T, heads, head_dim], reading K/V straight from
the cache views.

- `kernel`: one call per layer for the whole batch over the whole-space
  per-layer views, with a slot vector and a length vector (plus query offsets
  for prefill chunks): the C++ kernel on CPU (src/flexinfer/csrc/attention_cpu.cc),
  Triton kernels on CUDA. The default.
- `sdpa`: torch's scaled_dot_product_attention on each sequence's views (CPU
  and CUDA), one call per sequence and layer. The reference the kernels are
  tested against.
- `flash_attn`: flash_attn_with_kvcache over the whole-space views, with
  cache_seqlens and cache_batch_idx (CUDA only, when the package exists).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexinfer.errors import InvalidArgument


class SdpaAttention:
    name = "sdpa"

    def prepare(self, batch, kv_cache) -> None:
        # `_rows` does not clamp like slicing would: refuse lengths past the slot.
        if max(start + n for start, n in zip(batch.starts, batch.new_lens)) > kv_cache.max_tokens:
            raise InvalidArgument(f"a sequence is longer than the cache's {kv_cache.max_tokens} tokens")
        # A chunk that continues a cached prefix needs an explicit causal
        # mask aligned to the end (SDPA's is_causal aligns to the start).
        self._masks = []
        for start, n in zip(batch.starts, batch.new_lens):
            if start > 0 and n > 1:
                device = kv_cache.device
                q_pos = torch.arange(start, start + n, device=device)[:, None]
                k_pos = torch.arange(start + n, device=device)[None, :]
                self._masks.append(k_pos <= q_pos)
            else:
                self._masks.append(None)

    def forward(self, layer: int, q: torch.Tensor, batch, kv_cache) -> torch.Tensor:
        k_heads, v_heads = kv_cache.k_heads[layer], kv_cache.v_heads[layer]
        slots = batch.slots[kv_cache.group_of[layer]]
        if batch.is_decode:
            q_heads = q.unsqueeze(2)  # [B, heads, 1, head_dim]
            outs = [F.scaled_dot_product_attention(q_heads[i:i + 1], _rows(k_heads, slot, start + 1),
                                                   _rows(v_heads, slot, start + 1), enable_gqa=True)
                    for i, (slot, start) in enumerate(zip(slots, batch.starts))]
            return torch.cat(outs).squeeze(2)
        out = torch.empty_like(q)
        offset = 0
        for slot, start, n, mask in zip(slots, batch.starts, batch.new_lens, self._masks):
            length = start + n
            qi = q[offset:offset + n].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qi, _rows(k_heads, slot, length), _rows(v_heads, slot, length),
                                               attn_mask=mask, is_causal=(mask is None and n > 1), enable_gqa=True)
            out[offset:offset + n] = o[0].transpose(0, 1)
            offset += n
        return out


def _rows(heads_view: torch.Tensor, slot: int, length: int) -> torch.Tensor:
    """heads_view[slot:slot + 1, :, :length] ([1, kv_head, token, head_dim]) as
    one as_strided call, cheaper than the indexing (decode makes one per request,
    layer and K/V). Unlike slicing it does not clamp: the caller keeps
    slot < max_slots and length <= max_tokens (`prepare` checks the lengths)."""
    _, kv_heads, _, head_dim = heads_view.shape
    slot_stride = heads_view.stride(0)
    return heads_view.as_strided((1, kv_heads, length, head_dim), heads_view.stride(),
                                 heads_view.storage_offset() + slot * slot_stride)


class KernelAttention:
    """The batched kernels: C++ on CPU, Triton on CUDA (same interface)."""

    name = "kernel"

    def __init__(self, device: torch.device):
        self._cpu = device.type != "cuda"
        if self._cpu:
            from flexinfer.kernels import cpu_attention as kernels
        else:
            from flexinfer.kernels import triton_attention as kernels
        self._kernels = kernels

    def prepare(self, batch, kv_cache) -> None:
        self._out = None
        if self._cpu:  # slots, lengths and offsets checked once for all layers
            cu = None if batch.is_decode else batch.cu_seqlens_q
            self._plans = [self._kernels.Plan(slots, batch.seq_lens, cu) for slots in batch.slot_vector]

    def forward(self, layer: int, q: torch.Tensor, batch, kv_cache) -> torch.Tensor:
        k, v = kv_cache.k[layer], kv_cache.v[layer]
        group = kv_cache.group_of[layer]
        if self._out is None:  # one output buffer serves every layer of the pass
            self._out = torch.empty_like(q)
        if self._cpu:
            return self._plans[group].run(q, k, v, self._out)
        slots = batch.slot_vector[group]
        if batch.is_decode:
            return self._kernels.decode_attention(q, k, v, slots, batch.seq_lens, out=self._out)
        return self._kernels.prefill_attention(q, k, v, batch.cu_seqlens_q, slots, batch.seq_lens, out=self._out,
                                               max_q_len=batch.max_q_len)


class FlashAttention:
    """flash_attn_with_kvcache over the space's full views (CUDA only)."""

    name = "flash_attn"

    def __init__(self):
        from flash_attn import flash_attn_with_kvcache  # noqa: F401  (fails early when missing)

        self._fn = flash_attn_with_kvcache

    def prepare(self, batch, kv_cache) -> None:
        device = kv_cache.device
        self._slots = [torch.tensor(group, dtype=torch.int32, device=device) for group in batch.slots]
        self._cache_seqlens = torch.tensor(batch.starts, dtype=torch.int32, device=device)

    def forward(self, layer: int, q: torch.Tensor, batch, kv_cache) -> torch.Tensor:
        # The new rows were already written by KVCache.write, so the kernel
        # sees cache_seqlens = start + n and is told not to append.
        k_cache, v_cache = kv_cache.k[layer], kv_cache.v[layer]
        slots = self._slots[kv_cache.group_of[layer]]
        out = torch.empty_like(q)
        offset = 0
        if batch.is_decode:
            o = self._fn(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=self._cache_seqlens + 1,
                         cache_batch_idx=slots, causal=True)
            return o.squeeze(1)
        for i, (start, n) in enumerate(zip(batch.starts, batch.new_lens)):
            lens = torch.tensor([start + n], dtype=torch.int32, device=q.device)
            o = self._fn(q[offset:offset + n].unsqueeze(0), k_cache, v_cache, cache_seqlens=lens,
                         cache_batch_idx=slots[i:i + 1], causal=True)
            out[offset:offset + n] = o[0]
            offset += n
        return out


ATTENTION_BACKENDS = ("auto", "kernel", "sdpa", "flash_attn")


def make_attention(name: str, device: torch.device):
    """`auto`: the batched kernels (on CUDA, flash_attn when triton is missing but
    flash_attn is installed; sdpa when neither is)."""
    if name == "auto":
        try:
            return KernelAttention(device)
        except ImportError:
            if device.type != "cuda":
                raise
        try:
            return FlashAttention()
        except ImportError:
            return SdpaAttention()
    if name == "kernel":
        return KernelAttention(device)
    if name == "sdpa":
        return SdpaAttention()
    if name == "flash_attn":
        if device.type != "cuda":
            raise InvalidArgument("the flash_attn backend needs a CUDA device")
        return FlashAttention()
    raise InvalidArgument(f"unknown attention backend {name!r} (expected one of {ATTENTION_BACKENDS})")
