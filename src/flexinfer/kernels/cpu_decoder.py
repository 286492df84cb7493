"""A LlamaModel's forward pass as one C++ call (src/flexinfer/csrc/decoder_cpu.h):
the same kernels the model's Python code calls, in the same order, so the
output is bit for bit that code's, without ~9 Python calls per layer.

Two calls: `run`, the layers over embeddings the model made, and `forward`,
the whole pass (ids in, logits out: the embedding, RoPE's rows, the final
norm and the LM head as well), which a decode step takes when the LM head
runs the `packed` kernel too. At one token of a small model the pass's fixed
costs are what it costs, and `forward` pays them once.

Applies on the CPU, in float32 or bfloat16, where the pass's projections run
the `packed` kernel and attention is the batched kernel. What belongs to the
model is converted once; the cache table once per KV cache.
"""

from __future__ import annotations

import weakref

import torch

from flexinfer import _kernels
from flexinfer.errors import InvalidArgument
from flexinfer.kernels import FLOAT32_BFLOAT16_CODES as _DTYPE_CODES
from flexinfer.model.config import FULL

_PROJECTIONS = ("qkv", "o", "gate_up", "down")


class CpuDecoder:
    """The forward pass of `model` (a LlamaModel whose projections all hold a
    packed weight). It holds every tensor of the model the C++ side reads,
    and no reference to the model, which holds the decoder."""

    def __init__(self, model):
        c = model.config
        self._dtype = model.dtype
        code = _DTYPE_CODES[model.dtype]
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
        weights = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 7)  # read once, by the constructor
        cos, sin = model.rope_tables[FULL]
        # The LM head's packed weight, where the whole pass can run (None: the
        # layers' call only): the ends' tensors must be as the C++ side reads them.
        self._head = model.lm_head.weights.get("packed") if model.lm_head.bias is None else None
        if not all(t.dtype is model.dtype and t.is_contiguous() and t.device.type == "cpu" and t.shape[-1] == width
                   for t, width in ((model.embed, c.hidden_size), (model.norm, c.hidden_size), (cos, c.head_dim),
                                    (sin, c.head_dim))):
            self._head = None
        self.vocab = 0 if self._head is None else self._head.out_features
        # Every tensor whose address the C++ side keeps, kept alive as long
        # as it is (the model could drop or replace its own).
        self._kept = (model.embed, model.norm, cos, sin, self._head,
                      [(layer["input_norm"], layer["post_norm"], layer["qkv"].bias,
                        *(layer[name].weights["packed"] for name in _PROJECTIONS)) for layer in model.layers])
        self._shape = (len(rows), c.num_key_value_heads, c.head_dim)
        self._decoder = _kernels.Decoder(
            len(rows), c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.rms_norm_eps, c.head_dim ** -0.5, code, weights.data_ptr(), model.embed.data_ptr(),
            model.embed.shape[0], cos.data_ptr(), sin.data_ptr(), cos.shape[0], model.norm.data_ptr(),
            0 if self._head is None else self._head.data.data_ptr(), self.vocab)
        self._hidden_size = c.hidden_size
        # The last cache's table, and that cache (weakly: the decoder must not
        # keep a cache alive). An open cache's views never change; a closed
        # one has none, which every call checks.
        self._cache = None
        self._cache_table = None

    @property
    def runs_whole_pass(self) -> bool:
        """Whether `forward` can run: the LM head holds a packed weight and no
        bias, and the embeddings, final norm and RoPE tables are dense tensors
        of the model's dtype."""
        return self._head is not None

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch, kv_cache) -> None:
        """Every layer over hidden [T, hidden_size] (dense, the embeddings) in
        place, writing each layer's new K/V into `kv_cache`. A bad slot, length
        or position, or a cache of another geometry, raises InvalidArgument and
        changes nothing."""
        tokens = hidden.shape[0]
        if hidden.shape != (tokens, self._hidden_size) or hidden.dtype is not self._dtype or not hidden.is_contiguous():
            raise InvalidArgument("hidden must be a dense [T, hidden_size] tensor of the model's dtype")
        head_dim = self._shape[2]
        for name, t in (("cos", cos), ("sin", sin)):
            if t.shape != (tokens, head_dim) or t.dtype is not hidden.dtype or not t.is_contiguous():
                raise InvalidArgument(f"{name} must be a dense [T, head_dim] tensor of the model's dtype")
        held, pass_args = self._pass(batch, kv_cache, tokens)
        try:
            self._decoder.layers(*pass_args[:6], hidden.data_ptr(), cos.data_ptr(), sin.data_ptr(), *pass_args[6:])
        except ValueError as exc:  # the kernels' checks (slots, lengths, positions), made before any write
            raise InvalidArgument(str(exc)) from None

    def forward(self, input_ids: torch.Tensor, batch, kv_cache) -> torch.Tensor:
        """The whole pass: float32 logits [B, vocab] for the last new token of
        each sequence, as the model's own forward returns them. A bad id,
        slot, length or position raises InvalidArgument and changes nothing."""
        if self._head is None:
            raise InvalidArgument("this model's pass cannot run whole (see runs_whole_pass)")
        tokens = input_ids.shape[0]
        if input_ids.dtype is not torch.int64 or input_ids.shape != (tokens,) or not input_ids.is_cpu:
            raise InvalidArgument("input ids must be a [T] int64 CPU tensor")
        input_ids = input_ids.contiguous()
        last_index = batch.last_index.contiguous()
        requests = last_index.shape[0]
        if last_index.dtype is not torch.int64 or last_index.shape != (requests,) or not last_index.is_cpu:
            raise InvalidArgument("the last-token index must be a [B] int64 CPU tensor")
        held, pass_args = self._pass(batch, kv_cache, tokens)
        if requests != pass_args[5]:
            raise InvalidArgument(f"the batch has {pass_args[5]} lengths and {requests} last tokens")
        logits = torch.empty(requests, self.vocab, dtype=torch.float32)  # what the call writes, whatever the default
        try:
            self._decoder.forward(*pass_args[:6], input_ids.data_ptr(), *pass_args[6:-1], last_index.data_ptr(),
                                  logits.data_ptr(), pass_args[-1])
        except ValueError as exc:  # the checks (ids, slots, lengths, positions), made before any write
            raise InvalidArgument(str(exc)) from None
        return logits

    def _pass(self, batch, kv_cache, tokens: int) -> tuple:
        """What the call must hold until it returns (the cache's table and the
        batch's vectors: it reads them by address), and its arguments from the
        cache table to the thread count, each vector checked."""
        layers, kv_heads, head_dim = self._shape
        if self._cache is None or self._cache() is not kv_cache or len(kv_cache.kv) != layers:
            self._cache_table = self._table(kv_cache)
            self._cache = weakref.ref(kv_cache)
        table = self._cache_table
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
        held = (table, slot_index, slots, positions, seq_lens, cu_q)
        return held, (table.data_ptr(), groups, kv_cache.max_slots, kv_cache.max_tokens, tokens, requests,
                                positions.data_ptr(), [t.data_ptr() for t in slot_index],
                                [t.data_ptr() for t in slots], seq_lens.data_ptr(),
                                0 if cu_q is None else cu_q.data_ptr(), torch.get_num_threads())

    def _table(self, kv_cache) -> torch.Tensor:
        """[layers][6]: each layer's view address, its slot, token, k|v and
        head strides, and its layer group; the cache checked against the model."""
        layers, kv_heads, head_dim = self._shape
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
