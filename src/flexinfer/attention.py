"""Attention backends behind one small interface.

`prepare(batch, kv_cache)` runs once per forward pass; `forward(layer, q,
batch, kv_cache, scale=None, window=0, softcap=0.0)` returns the attention
output [T, heads, head_dim] for the flattened batch's queries q [T, heads,
head_dim], reading K/V straight from the cache views, with the layer's
variant: `scale` (None: head_dim ** -0.5), `window` (a query at position p
sees keys max(0, p - window + 1) .. p; 0: every key up to p) and `softcap`
(scores become softcap * tanh(score / softcap) before the mask; 0: none).
`kernel` and `sdpa` read no K/V row below a window (`bounds_windows`): those pages may
be unmapped. `flash_attn` cannot bound its loads so, and refuses a window.

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
from flexinfer.kernels import check_variant


class SdpaAttention:
    name = "sdpa"
    bounds_windows = True  # reads no K/V row below a window (vtm's window spaces unmap them)

    def prepare(self, batch, kv_cache) -> None:
        # `_rows` does not clamp like slicing would: refuse lengths past the slot.
        if max(start + n for start, n in zip(batch.starts, batch.new_lens)) > kv_cache.max_tokens:
            raise InvalidArgument(f"a sequence is longer than the cache's {kv_cache.max_tokens} tokens")
        self._batch, self._device = batch, kv_cache.device
        self._keys_by_window = {}

    def _keys(self, window: int) -> list[tuple[int, torch.Tensor | None]]:
        """Per sequence of the pass: the first key its queries read (its first
        query's window start: no row below it is read) and the mask [n, keys]
        of the keys each query sees, None where SDPA's is_causal (aligned to the
        start) or no mask at all says it. Built once per pass and window (a
        model's layers share a few windows)."""
        keys = self._keys_by_window.get(window)
        if keys is None:
            keys = []
            for start, n in zip(self._batch.starts, self._batch.new_lens):
                first = max(0, start - window + 1) if window else 0
                mask = None
                # A chunk that continues a cached prefix, or sits in a window,
                # needs an explicit mask aligned to the end.
                if n > 1 and (start > 0 or window):
                    q_pos = torch.arange(start, start + n, device=self._device)[:, None]
                    k_pos = torch.arange(first, start + n, device=self._device)[None, :]
                    mask = k_pos <= q_pos
                    if window:
                        mask &= k_pos > q_pos - window
                keys.append((first, mask))
            self._keys_by_window[window] = keys
        return keys

    def forward(self, layer: int, q: torch.Tensor, batch, kv_cache, scale=None, window=0,
                softcap=0.0) -> torch.Tensor:
        scale, window, softcap = check_variant(scale, window, softcap)
        k_heads, v_heads = kv_cache.k_heads[layer], kv_cache.v_heads[layer]
        slots = batch.slots[kv_cache.group_of[layer]]
        keys = self._keys(window)
        if batch.is_decode:
            q_heads = q.unsqueeze(2)  # [B, heads, 1, head_dim]
            outs = [_attend(q_heads[i:i + 1], _rows(k_heads, slot, first, start + 1),
                            _rows(v_heads, slot, first, start + 1), None, False, scale, softcap)
                    for i, (slot, start, (first, _)) in enumerate(zip(slots, batch.starts, keys))]
            return torch.cat(outs).squeeze(2)
        out = torch.empty_like(q)
        offset = 0
        for slot, start, n, (first, mask) in zip(slots, batch.starts, batch.new_lens, keys):
            length = start + n
            qi = q[offset:offset + n].transpose(0, 1).unsqueeze(0)
            o = _attend(qi, _rows(k_heads, slot, first, length), _rows(v_heads, slot, first, length), mask,
                        mask is None and n > 1, scale, softcap)
            out[offset:offset + n] = o[0].transpose(0, 1)
            offset += n
        return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
            scale: float | None, softcap: float) -> torch.Tensor:
    """q [1, heads, n, head_dim] over k, v [1, kv_heads, keys, head_dim]; `mask`
    [n, keys] (True: seen) or `causal`, else every key. torch's SDPA has no
    logit cap: a capped layer takes the explicit path, in float32 like SDPA's
    math on 16-bit inputs."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = q.float() @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).to(q.dtype)


def _rows(heads_view: torch.Tensor, slot: int, first: int, end: int) -> torch.Tensor:
    """heads_view[slot:slot + 1, :, first:end] ([1, kv_head, token, head_dim]) as
    one as_strided call, cheaper than the indexing (decode makes one per request,
    layer and K/V). Unlike slicing it does not clamp: the caller keeps
    slot < max_slots and 0 <= first <= end <= max_tokens (`prepare` checks the lengths)."""
    _, kv_heads, _, head_dim = heads_view.shape
    return heads_view.as_strided((1, kv_heads, end - first, head_dim), heads_view.stride(),
                                 heads_view.storage_offset() + slot * heads_view.stride(0)
                                 + first * heads_view.stride(2))


class KernelAttention:
    """The batched kernels: C++ on CPU, Triton on CUDA (same interface)."""

    name = "kernel"
    bounds_windows = True

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

    def forward(self, layer: int, q: torch.Tensor, batch, kv_cache, scale=None, window=0,
                softcap=0.0) -> torch.Tensor:
        k, v = kv_cache.k[layer], kv_cache.v[layer]
        group = kv_cache.group_of[layer]
        if self._out is None:  # one output buffer serves every layer of the pass
            self._out = torch.empty_like(q)
        if self._cpu:  # the C++ kernel checks the variant
            return self._plans[group].run(q, k, v, self._out, scale, window, softcap)
        slots = batch.slot_vector[group]
        if batch.is_decode:
            return self._kernels.decode_attention(q, k, v, slots, batch.seq_lens, out=self._out, scale=scale,
                                                  window=window, softcap=softcap)
        return self._kernels.prefill_attention(q, k, v, batch.cu_seqlens_q, slots, batch.seq_lens, out=self._out,
                                               scale=scale, max_q_len=batch.max_q_len, window=window,
                                               softcap=softcap)


class FlashAttention:
    """flash_attn_with_kvcache over the space's full views (CUDA only)."""

    name = "flash_attn"
    # Its sliding window masks key blocks it has already loaded, below the
    # window too, where vtm's window spaces have unmapped the pages.
    bounds_windows = False

    def __init__(self):
        from flash_attn import flash_attn_with_kvcache  # noqa: F401  (fails early when missing)

        self._fn = flash_attn_with_kvcache

    def prepare(self, batch, kv_cache) -> None:
        # The batch's own int32 vectors, on the device already: building
        # them here from lists would copy from pageable memory, which waits
        # for the steps queued before (the engine overlaps steps).
        self._slots = batch.slot_vector

    def forward(self, layer: int, q: torch.Tensor, batch, kv_cache, scale=None, window=0,
                softcap=0.0) -> torch.Tensor:
        # The new rows were already written by KVCache.write, so the kernel
        # sees cache_seqlens = start + n and is told not to append.
        scale, window, softcap = check_variant(scale, window, softcap)
        if window:
            raise InvalidArgument("the flash_attn backend cannot bound its loads by a sliding window")
        variant = dict(softmax_scale=scale, softcap=softcap)
        k_cache, v_cache = kv_cache.k[layer], kv_cache.v[layer]
        slots = self._slots[kv_cache.group_of[layer]]
        out = torch.empty_like(q)
        offset = 0
        if batch.is_decode:
            o = self._fn(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=batch.seq_lens,
                         cache_batch_idx=slots, causal=True, **variant)
            return o.squeeze(1)
        for i, n in enumerate(batch.new_lens):
            o = self._fn(q[offset:offset + n].unsqueeze(0), k_cache, v_cache, cache_seqlens=batch.seq_lens[i:i + 1],
                         cache_batch_idx=slots[i:i + 1], causal=True, **variant)
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
