"""The load-time timing of the fused Triton decode kernels
(src/flexinfer/model/fused_layer_timing.py) without a GPU: the kernels and
the CUDA graph are replaced by stand-ins that record which weights a timed
graph reads."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from flexinfer.model import fused_layer_timing


def test_a_timed_graph_reads_distinct_weights_past_the_l2_cache_as_a_decode_step_does(monkeypatch):
    """One layer's weights replayed from L2 would time the kernels against the
    cache; a step of many layers streams its weights from memory. With an L2
    of 3 layers' bytes and a model of 20 layers, a graph reads 6 distinct
    copies (twice the L2) on either side, the same ones."""
    hidden, inter, heads, kv_heads, dim = 16, 32, 2, 1, 8
    config = types.SimpleNamespace(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, head_dim=dim, attention_bias=True,
                                   num_hidden_layers=20, rms_norm_eps=1e-5)
    p = "model.layers.0."
    q, kv = heads * dim, kv_heads * dim
    shapes = {"self_attn.q_proj.weight": (q, hidden), "self_attn.k_proj.weight": (kv, hidden),
              "self_attn.v_proj.weight": (kv, hidden), "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
              "self_attn.v_proj.bias": (kv,), "self_attn.o_proj.weight": (hidden, q),
              "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
              "mlp.down_proj.weight": (hidden, inter), "input_layernorm.weight": (hidden,),
              "post_attention_layernorm.weight": (hidden,)}
    weights = {p + name: torch.randn(shape) for name, shape in shapes.items()}
    layer_bytes = 4 * sum(torch.Size(s).numel() for s in shapes.values())

    read: dict[str, set[int]] = {"torch": set(), "triton": set()}
    side = ["torch"]

    def reads(weight):
        read[side[0]].add(weight.data_ptr())

    def fake_linear(x, weight, bias=None):
        reads(weight)
        return torch.zeros(x.shape[0], weight.shape[0])

    separate_ops = types.SimpleNamespace(
        add_rms_norm=lambda x, residual, weight, eps: (x.clone(), x.clone()),
        rotary_kv_write=lambda *args: None,
        silu_mul=lambda gate_up: gate_up[:, : gate_up.shape[1] // 2].clone())

    def fused_linear(x, weight, bias=None, residual=None):
        reads(weight)
        return torch.zeros(x.shape[0], weight.shape[0])

    def fused_qkv(x, norm, eps, weight, bias, heads, cos, sin, kv, slots, positions):
        reads(weight)
        return torch.zeros(x.shape[0], weight.shape[0] // dim, dim)

    def fused_gate_up(x, norm, eps, weight):
        reads(weight)
        return torch.zeros(x.shape[0], weight.shape[0] // 2)

    fused_ops = types.SimpleNamespace(linear=fused_linear, norm_qkv_rotary_kv_write=fused_qkv,
                                      norm_gate_up_silu=fused_gate_up)
    model = types.SimpleNamespace(config=config, device=torch.device("cpu"), dtype=torch.float32,
                                  layer_ops=separate_ops, triton_linear=fused_ops)

    def capture(body):
        body()
        kind = side[0]
        side[0] = "triton"
        return kind

    monkeypatch.setattr(F, "linear", fake_linear)
    monkeypatch.setattr(fused_layer_timing, "_l2_bytes", lambda device: 3 * layer_bytes, raising=False)
    monkeypatch.setattr(fused_layer_timing, "_capture", capture)
    monkeypatch.setattr(fused_layer_timing, "_replay_seconds", lambda graph: {"torch": 2.0, "triton": 1.0}[graph])
    assert fused_layer_timing._measure(model, weights, [1]) == {1: "triton"}
    # Four projection weights a layer (qkv, o, gate_up, down), six copies of each.
    assert len(read["torch"]) == len(read["triton"]) == 4 * 6
    assert read["torch"] == read["triton"]
