"""A LlamaModel's decoder layers as one C++ call per forward pass
(src/flexinfer/csrc/decoder_cpu.h): the same kernels the model's Python loop
calls, in the same order, so the output is bit for bit the loop's, without
~9 Python calls per layer.

Applies on the CPU, in float32 or bfloat16, where the pass's projections run
the `packed` kernel and attention is the batched kernel. The weight table is
built once; the cache table once per KV cache.
"""

from __future__ import annotations

import weakref

import torch

from flexinfer import _kernels
from flexinfer.errors import InvalidArgument
from flexinfer.kernels import FLOAT32_BFLOAT16_CODES as _DTYPE_CODES

_PROJECTIONS = ("qkv", "o", "gate_up", "down")


class CpuDecoder:
    """The layers of `model` (a LlamaModel whose projections all hold a packed weight)."""

    def __init__(self, model):
        c = model.config
        self._dtype = model.dtype
        self._code = _DTYPE_CODES[model.dtype]
        rows = []
        for layer in model.layers:
            packed = {name: layer[name].weights["packed"].data for name in _PROJECTIONS}
            bias = layer["qkv"].bias
            for t in (layer["input_norm"], layer["post_norm"], bias):
                if t is not None and (t.dtype is not model.dtype or not t.is_contiguous()):
                    raise InvalidArgument("the decoder's norms and biases must be contiguous tensors of the model's dtype")
            rows.append([layer["input_norm"].data_ptr(), packed["qkv"].data_ptr(),
                         0 if bias is None else bias.data_ptr(), packed["o"].data_ptr(),
                         layer["post_norm"].data_ptr(), packed["gate_up"].data_ptr(), packed["down"].data_ptr()])
        # The model keeps these tensors (and the decoder no reference to the
        # model, which holds the decoder).
        self._weights = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 7)
        self._shape = (len(rows), c.hidden_size, c.intermediate_size, c.num_attention_heads,
                       c.num_key_value_heads, c.head_dim, c.rms_norm_eps, c.head_dim ** -0.5)
        # The last cache's table, and that cache (weakly: the decoder must not
        # keep a cache alive). An open cache's views never change; a closed
        # one has none, which `run` checks on every call.
        self._cache = None
        self._cache_table = None

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch, kv_cache) -> None:
        """Every layer over hidden [T, hidden_size] (dense, the embeddings) in
        place, writing each layer's new K/V into `kv_cache`. A bad slot, length
        or position, or a cache of another geometry, raises InvalidArgument and
        changes nothing."""
        layers, hidden_size, inter, heads, kv_heads, head_dim, eps, scale = self._shape
        tokens = hidden.shape[0]
        if hidden.shape != (tokens, hidden_size) or hidden.dtype is not self._dtype or not hidden.is_contiguous():
            raise InvalidArgument("hidden must be a dense [T, hidden_size] tensor of the model's dtype")
        for name, t in (("cos", cos), ("sin", sin)):
            if t.shape != (tokens, head_dim) or t.dtype is not hidden.dtype or not t.is_contiguous():
                raise InvalidArgument(f"{name} must be a dense [T, head_dim] tensor of the model's dtype")
        if self._cache is None or self._cache() is not kv_cache or len(kv_cache.kv) != layers:
            self._cache_table = self._table(kv_cache)
            self._cache = weakref.ref(kv_cache)
        # Per-group vectors (held until the call returns: it reads them by address).
        slot_index = [t.contiguous() for t in batch.slot_index]
        slots = [t.contiguous() for t in batch.slot_vector]
        groups = kv_cache.groups
        if len(slot_index) != groups or len(slots) != groups:
            raise InvalidArgument(f"the batch has slots for {len(slots)} layer groups, the cache {groups}")
        positions, seq_lens = batch.positions.contiguous(), batch.seq_lens.contiguous()
        for t in (*slot_index, positions):
            if t.dtype is not torch.int64 or t.shape != (tokens,):
                raise InvalidArgument("slot indices and positions must be [T] int64 tensors")
        cu_q = None if batch.is_decode else batch.cu_seqlens_q.contiguous()
        requests = seq_lens.shape[0]
        for t, length in [(s, requests) for s in slots] + [(seq_lens, requests), (cu_q, requests + 1)]:
            if t is not None and (t.dtype is not torch.int32 or t.shape != (length,)):
                raise InvalidArgument("slots, lengths and query offsets must be int32 vectors, one per request")
        try:
            _kernels.decoder_layers(
                layers, hidden_size, inter, heads, kv_heads, head_dim, eps, scale, self._code,
                self._weights.data_ptr(), self._cache_table.data_ptr(), groups, kv_cache.max_slots,
                kv_cache.max_tokens, tokens, requests, hidden.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                positions.data_ptr(), [t.data_ptr() for t in slot_index], [t.data_ptr() for t in slots],
                seq_lens.data_ptr(),
                0 if cu_q is None else cu_q.data_ptr(), torch.get_num_threads())
        except ValueError as exc:  # the kernels' checks (slots, lengths, positions), made before any write
            raise InvalidArgument(str(exc)) from None

    def _table(self, kv_cache) -> torch.Tensor:
        """[layers][6]: each layer's view address, its slot, token, k|v and
        head strides, and its layer group; the cache checked against the model."""
        layers, _, _, _, kv_heads, head_dim = self._shape[:6]
        if len(kv_cache.kv) != layers:
            raise InvalidArgument(f"the cache has {len(kv_cache.kv)} layers (a closed cache has none), "
                                  f"the model {layers}")
        rows = []
        for layer, view in enumerate(kv_cache.kv):
            if (view.shape != (kv_cache.max_slots, kv_cache.max_tokens, 2, kv_heads, head_dim)
                    or view.stride(4) != 1 or view.device.type != "cpu" or view.dtype is not self._dtype
                    or not 0 <= kv_cache.group_of[layer] < kv_cache.groups):
                raise InvalidArgument(f"layer {layer}'s cache view is {tuple(view.shape)} {view.dtype} on "
                                      f"{view.device}; the model needs [slots, tokens, 2, {kv_heads}, {head_dim}] "
                                      f"{self._dtype} on the CPU")
            rows.append([view.data_ptr(), *view.stride()[:4], kv_cache.group_of[layer]])
        return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 6)
