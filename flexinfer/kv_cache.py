"""A model instance's KV cache on vtm: one space, strided per-layer views.

Token-major layout (DESIGN.md §4): a slot holds, for each token, one row of
[layer, k|v, kv_head, head_dim] for every layer, so one request's KV for all
layers is contiguous and costs at most one partially used chunk. Per-layer K
and V are strided views of the space's single DLPack tensor; new rows are
written in place and attention reads past rows through views, so no past KV
is ever copied.
"""

from __future__ import annotations

import torch

import vtm
from flexinfer.model.config import ModelConfig


class KVCache:
    def __init__(self, manager: vtm.Manager, config: ModelConfig, dtype: torch.dtype, max_tokens: int,
                 max_slots: int, namespace: str | None = None, name: str | None = None):
        itemsize = torch.empty((), dtype=dtype).element_size()
        layers, heads, dim = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        self.row_bytes = config.kv_row_bytes(itemsize)
        self.max_tokens = max_tokens
        self.max_slots = max_slots
        self.manager = manager
        self.space = manager.create_space(row_bytes=self.row_bytes, max_tokens=max_tokens, max_slots=max_slots,
                                          namespace=namespace, name=name)
        flat = self.space.tensor(dtype)  # [max_slots, slot_bytes // itemsize]
        row_elems = self.row_bytes // itemsize
        rows = flat[:, : max_tokens * row_elems].view(max_slots, max_tokens, layers, 2, heads, dim)
        self.device = rows.device
        # [slot, token, kv_head, head_dim] per layer; token stride = one row.
        self.k = [rows[:, :, layer, 0] for layer in range(layers)]
        self.v = [rows[:, :, layer, 1] for layer in range(layers)]

    def write(self, layer: int, batch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' K/V ([T, kv_heads, head_dim]) at their slots and positions."""
        self.k[layer].index_put_((batch.slot_index, batch.positions), k)
        self.v[layer].index_put_((batch.slot_index, batch.positions), v)

    def keys(self, layer: int, slot: int, length: int) -> torch.Tensor:
        return self.k[layer][slot, :length]

    def values(self, layer: int, slot: int, length: int) -> torch.Tensor:
        return self.v[layer][slot, :length]

    def tokens_per_chunk(self) -> float:
        return self.manager.chunk_bytes / self.row_bytes

    def close(self) -> None:
        self.k = self.v = []
        self.space.close()
