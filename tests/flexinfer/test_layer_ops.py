"""The decoder's small pieces against their references: the in-place rotary
embedding against transformers' (bit for bit, so `linear="torch"` reproduces
the reference forward exactly), and the one-op K/V views attention builds
against plain slicing, in every layer of every layer group."""

from __future__ import annotations

import pytest
import torch

import vtm
from flexinfer.attention import _rows
from flexinfer.kv_cache import KVCache
from flexinfer.model.config import ModelConfig
from flexinfer.model.llama import LlamaModel

modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_equals_transformers_bit_for_bit(dtype):
    tokens, heads, kv_heads, dim = 7, 4, 2, 16
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    freqs = torch.arange(tokens, dtype=torch.float32)[:, None] * (1e4 ** (-torch.arange(0, dim, 2) / dim))
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q_hf, k_hf = modeling_llama.apply_rotary_pos_emb(
        qkv[:, :heads].transpose(0, 1)[None], qkv[:, heads:heads + kv_heads].transpose(0, 1)[None],
        cos[None], sin[None])
    signed_sin = torch.cat([-sin[:, : dim // 2], sin[:, dim // 2:]], dim=-1)
    ours = qkv.clone()
    LlamaModel._rotate_(ours[:, : heads + kv_heads], cos[:, None, :], signed_sin[:, None, :])
    assert torch.equal(ours[:, :heads], q_hf[0].transpose(0, 1))
    assert torch.equal(ours[:, heads:heads + kv_heads], k_hf[0].transpose(0, 1))
    assert torch.equal(ours[:, heads + kv_heads:], qkv[:, heads + kv_heads:])  # V untouched


@pytest.mark.parametrize("layer_groups", [1, 2])
def test_rows_is_the_sliced_view(layer_groups):
    """Views only (no byte is read, so nothing needs to be mapped)."""
    config = ModelConfig(architecture="llama", vocab_size=32, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None, max_position_embeddings=64,
                         tie_word_embeddings=True, attention_bias=False, bos_token_id=1, eos_token_ids=(2,))
    with vtm.Manager(backend="host", capacity_bytes=1 << 22, chunk_bytes=4096, granularity=4096) as manager:
        kv = KVCache(manager, config, torch.float32, max_tokens=64, max_slots=3, layer_groups=layer_groups)
        for layer in range(config.num_hidden_layers):
            for heads in (kv.k_heads[layer], kv.v_heads[layer]):
                for slot in range(3):
                    for first, end in ((0, 1), (0, 17), (0, 64), (9, 17), (63, 64), (17, 17)):
                        got, want = _rows(heads, slot, first, end), heads[slot:slot + 1, :, first:end]
                        assert (got.data_ptr(), got.shape, got.stride()) == (want.data_ptr(), want.shape,
                                                                             want.stride())
        kv.close()
