"""Whether a CUDA model's decode steps run its layers as the fused Triton
kernels (kernels/triton_linear.py) or as cuBLAS's GEMMs and the separate
layer ops, decided by timing both on the model's own first layer at load.

Why time rather than assume: the fused kernels save ~6 launches a layer
and read each weight once, but a hand-written GEMV can lose to cuBLAS's
where the shapes are large or the card differs; `linear="auto"` must never
make a model slower than it was. Timed as CUDA graph replays, as the engine
runs decode steps, so launch overheads count as they will; attention is
left out (both ways run the same attention kernels). Medians of interleaved
rounds, as linear.measure_kinds times the CPU kernels.

A graph's layers read their weights from copies of layer 0's, as many as a
decode step has distinct layers up to twice the device's L2 cache in bytes:
one layer replayed from L2 (SmolLM2's is 7 MB, an H200's L2 50 MB) would time
GEMVs against the cache's bandwidth, where a step of its 30 layers (212 MB)
streams them from HBM.
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.nn.functional as F

# Layers per graph at least (one launch's overhead spread over them), timed rounds per kind.
_LAYERS_PER_GRAPH = 8
# A graph's distinct weights reach this many times the L2 cache where the model's layers do.
_L2_MULTIPLE = 2
_ROUNDS = 7
# Choices already measured in this process, by shapes and dtype: two engines
# of one model (a benchmark and its baseline) run the same kernels.
_measured: dict[tuple, dict[int, str]] = {}


def measure_fused_layer(model, weights: dict[str, torch.Tensor], buckets: list[int]) -> dict[int, str]:
    """Per row bucket, "triton" where one layer's fused kernels replay faster
    than its separate ones, else "torch". `weights`: the model's loaded
    weights (layer 0's are read, not taken)."""
    c, device, dtype = model.config, model.device, model.dtype
    key = (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
           c.attention_bias, c.num_hidden_layers, dtype, str(device), tuple(buckets))
    if key not in _measured:
        _measured[key] = _measure(model, weights, buckets)
    return dict(_measured[key])


def _measure(model, weights: dict[str, torch.Tensor], buckets: list[int]) -> dict[int, str]:
    c, device, dtype = model.config, model.device, model.dtype
    p = "model.layers.0."

    def w(name: str) -> torch.Tensor:
        return weights[p + name].to(device=device, dtype=dtype).contiguous()

    qkv = torch.cat([w(f"self_attn.{n}_proj.weight") for n in "qkv"]).contiguous()
    bias = (torch.cat([w(f"self_attn.{n}_proj.bias") for n in "qkv"]).contiguous()
            if c.attention_bias else None)
    first = dict(qkv=qkv, bias=bias, o=w("self_attn.o_proj.weight"), down=w("mlp.down_proj.weight"),
                 gate_up=torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]).contiguous(),
                 input_norm=w("input_layernorm.weight"), post_norm=w("post_attention_layernorm.weight"))
    layer_bytes = sum(t.numel() * t.element_size() for t in first.values() if t is not None)
    copies = max(1, min(c.num_hidden_layers, math.ceil(_L2_MULTIPLE * _l2_bytes(device) / layer_bytes)))
    layers = [first] + [{n: None if t is None else t.clone() for n, t in first.items()} for _ in range(copies - 1)]
    graph_layers = [layers[i % copies] for i in range(max(_LAYERS_PER_GRAPH, copies))]
    heads, kv_heads, dim, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    ops, fused = model.layer_ops, model.triton_linear
    choice = {}
    for rows in buckets:
        gen = torch.Generator(device=device).manual_seed(rows)
        hidden = torch.randn(rows, c.hidden_size, generator=gen, device=device).to(dtype)
        attn = torch.randn(rows, heads * dim, generator=gen, device=device).to(dtype)
        cos = torch.randn(rows, dim, generator=gen, device=device).to(dtype)
        sin = torch.randn(rows, dim, generator=gen, device=device).to(dtype)
        kv = torch.zeros(1, rows, 2, kv_heads, dim, dtype=dtype, device=device)
        slots = torch.zeros(rows, dtype=torch.long, device=device)
        positions = torch.arange(rows, device=device)

        def separate(layer):
            x, h = ops.add_rms_norm(hidden, hidden, layer["input_norm"], eps)
            q = F.linear(x, layer["qkv"], layer["bias"]).view(rows, heads + 2 * kv_heads, dim)
            ops.rotary_kv_write(q, heads, cos, sin, kv, slots, positions)
            x, h = ops.add_rms_norm(F.linear(attn, layer["o"]), h, layer["post_norm"], eps)
            return F.linear(ops.silu_mul(F.linear(x, layer["gate_up"])), layer["down"])

        def fused_layer(layer):
            fused.norm_qkv_rotary_kv_write(hidden, layer["input_norm"], eps, layer["qkv"], layer["bias"], heads, cos,
                                           sin, kv, slots, positions)
            h = fused.linear(attn, layer["o"], residual=hidden)
            return fused.linear(fused.norm_gate_up_silu(h, layer["post_norm"], eps, layer["gate_up"]), layer["down"],
                                residual=h)

        def graph_of(body) -> torch.cuda.CUDAGraph:
            return _capture(lambda: [body(layer) for layer in graph_layers])

        graphs = {"torch": graph_of(separate), "triton": graph_of(fused_layer)}
        times = {kind: [] for kind in graphs}
        for _ in range(_ROUNDS):
            for kind, graph in graphs.items():
                times[kind].append(_replay_seconds(graph))
        medians = {kind: statistics.median(t) for kind, t in times.items()}
        choice[rows] = "triton" if medians["triton"] < medians["torch"] else "torch"
    return choice


def _l2_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size


def _capture(body) -> torch.cuda.CUDAGraph:
    """`body` as one graph (compiled and warmed up first, off the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        body()
    graph.replay()  # the first replay uploads the graph
    torch.cuda.synchronize()
    return graph


def _replay_seconds(graph: torch.cuda.CUDAGraph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0
