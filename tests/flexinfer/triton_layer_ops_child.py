"""The Triton layer ops (src/flexinfer/kernels/triton_layer_ops.py) against
the torch code they replace, rounded as transformers rounds it, and a tiny
model's forward with the ops (the residual added by the norms) against the
same model on torch ops; for each dtype.

Run as a script (by test_triton_layer_ops.py), it runs them in Triton's
interpreter on CPU tensors, in a process of its own: TRITON_INTERPRET must be
set before triton is imported, and never in the pytest process. Imported
(test_gpu.py), `run_checks("cuda")` runs them on the GPU. Either way the
result is {dtype: {check: {"max_err", "scale", "bitwise", "differing"}}}.
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":
    # Before triton is imported: it decides at decoration time whether kernels are interpreted.
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import vtm  # noqa: E402
from flexinfer.attention import SdpaAttention  # noqa: E402
from flexinfer.errors import InvalidArgument  # noqa: E402
from flexinfer.kernels import triton_layer_ops as ops  # noqa: E402
from flexinfer.kv_cache import KVCache  # noqa: E402
from flexinfer.model.config import ModelConfig  # noqa: E402
from flexinfer.model.llama import ForwardBatch, LlamaModel  # noqa: E402

EPS = 1e-5
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    return {"max_err": (got.double() - want.double()).abs().max().item() if got.numel() else 0.0,
            "scale": want.double().abs().max().item() if want.numel() else 0.0,
            "bitwise": bool(torch.equal(bits(got), bits(want))),
            "differing": (bits(got) != bits(want)).double().mean().item() if got.numel() else 0.0}


def rows(tokens, dim, dtype, seed, device="cpu"):
    """[tokens, dim] values whose rows are a slice of wider rows."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, dim + 5, generator=gen).to(device=device, dtype=dtype)[:, :dim]


def hf_rms_norm(x, weight):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def tiny_config(layers=2, kv_heads=2, head_dim=16, hidden=48):
    return ModelConfig(architecture="llama", vocab_size=40, hidden_size=hidden, intermediate_size=72,
                       num_hidden_layers=layers, num_attention_heads=2 * kv_heads, num_key_value_heads=kv_heads,
                       head_dim=head_dim, rms_norm_eps=EPS, rope_theta=1e4, rope_scaling=None,
                       max_position_embeddings=64, tie_word_embeddings=True, attention_bias=False, bos_token_id=1,
                       eos_token_ids=(2,))


def tiny_weights(config) -> dict[str, torch.Tensor]:
    """Random float32 weights of a tiny_config model (its QKV biases too where
    the config has them); norms near 1."""
    gen = torch.Generator().manual_seed(0)
    h, inter = config.hidden_size, config.intermediate_size
    q, k = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (k, h),
                       p + "self_attn.v_proj.weight": (k, h), p + "self_attn.o_proj.weight": (h, q)})
        if config.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (k,),
                           p + "self_attn.v_proj.bias": (k,)})
        shapes.update({p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    return {n: torch.randn(s, generator=gen) * 0.3 + (1.0 if n.endswith("norm.weight") else 0.0)
            for n, s in shapes.items()}


def manager_pool(device: str) -> dict:
    """vtm.Manager's arguments for the checks' pool on `device`."""
    return dict(backend="host", capacity_bytes=1 << 24, chunk_bytes=4096, granularity=4096) if device == "cpu" \
        else dict(backend="cuda", capacity_bytes=64 << 20)


def rope_rows(positions: torch.Tensor, dim: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, dim] of `positions` (base 1e4) as LlamaModel._rope
    makes them: sin's first half negated."""
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)).float()
    freqs = positions.cpu().float()[:, None] * inv_freq[None, :]
    cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1).to(device=device, dtype=dtype)
    sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1).to(device=device, dtype=dtype)
    return cos, sin


def check_norms(dtype, out, device):
    x, residual = rows(5, 40, dtype, 1, device), rows(5, 40, dtype, 2, device)
    weight = (torch.rand(40, generator=torch.Generator().manual_seed(3)) + 0.5).to(device=device, dtype=dtype)
    out["rms_norm"] = compare(ops.rms_norm(x, weight, EPS), hf_rms_norm(x, weight))
    normed, summed = ops.add_rms_norm(x, residual, weight, EPS)
    out["add_rms_norm_sum"] = compare(summed, residual + x)
    out["add_rms_norm"] = compare(normed, hf_rms_norm(residual + x, weight))
    empty = ops.rms_norm(x[:0], weight, EPS)
    out["rms_norm_no_rows"] = {"max_err": 0.0, "bitwise": empty.shape == (0, 40)}


def check_silu(dtype, out, device):
    gate_up = rows(4, 2 * 1100, dtype, 4, device) * 3  # two programs per row
    gate, up = gate_up.chunk(2, dim=-1)
    out["silu_mul"] = compare(ops.silu_mul(gate_up), F.silu(gate) * up)


def check_rotary(dtype, out, manager, device):
    config = tiny_config(layers=2, kv_heads=2, head_dim=24)
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    tokens, max_slots, max_tokens = 9, 3, 16
    kv = KVCache(manager, config, dtype, max_tokens=max_tokens, max_slots=max_slots)
    vts = [vt for _ in range(max_slots) for vt in kv.create(max_tokens)]
    try:
        gen = torch.Generator().manual_seed(5)
        flat = torch.randperm(max_slots * max_tokens, generator=gen)[:tokens]
        slots, positions = flat // max_tokens, flat % max_tokens
        cos, sin = rope_rows(positions, dim, dtype, device)
        qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen).to(device=device, dtype=dtype)
        slots, positions = slots.to(device), positions.to(device)
        layer = kv.kv[1]
        layer.copy_(torch.randn(layer.shape, generator=gen).to(dtype))
        before = layer.clone()

        want_qkv, want_kv = qkv.clone(), layer.clone()
        LlamaModel._rotate_(want_qkv[:, :heads + kv_heads], cos[:, None], sin[:, None])
        want_kv.index_put_((slots, positions), want_qkv[:, heads:].view(tokens, 2, kv_heads, dim))
        got_qkv = qkv.clone()
        ops.rotary_kv_write(got_qkv, heads, cos, sin, layer, slots, positions)
        out["rotary_qkv"] = compare(got_qkv, want_qkv)
        out["rotary_kv_write"] = compare(layer, want_kv)

        # A (slot, position) outside the view is skipped; the others are written.
        layer.copy_(before)
        bad_slots, bad_positions = slots.clone(), positions.clone()
        bad_slots[0], bad_positions[1] = max_slots, max_tokens
        bad_slots[2] = -1
        ops.rotary_kv_write(qkv.clone(), heads, cos, sin, layer, bad_slots, bad_positions)
        skipped = want_kv.clone()
        for t in range(3):
            skipped[slots[t], positions[t]] = before[slots[t], positions[t]]
        out["rotary_outside_is_skipped"] = compare(layer, skipped)

        # Bad arguments are refused before anything runs.
        refused = 0
        for call in (lambda: ops.rotary_kv_write(qkv.clone(), heads + 1, cos, sin, layer, slots, positions),
                     lambda: ops.rotary_kv_write(qkv.clone(), heads, cos, sin, layer, slots.int(), positions),
                     lambda: ops.rotary_kv_write(qkv.clone(), heads, cos[:1], sin, layer, slots, positions),
                     lambda: ops.rms_norm(rows(2, 8, dtype, 6, device), torch.ones(7, dtype=dtype, device=device), EPS),
                     lambda: ops.silu_mul(torch.ones(2, 7, dtype=dtype, device=device)),
                     lambda: ops.rms_norm(rows(2, 8, torch.float64, 6, device),
                                          torch.ones(8, dtype=torch.float64, device=device), EPS)):
            layer.copy_(before)
            try:
                call()
            except InvalidArgument:
                refused += 1 if torch.equal(bits(layer), bits(before)) else 0
        out["bad_arguments_refused"] = {"max_err": 0.0, "bitwise": refused == 6}
    finally:
        kv.release(vts)
        kv.close()


def check_forward(dtype, out, manager, device):
    """A 2-layer model on the Triton ops (the residual added by the norms)
    against the same weights on torch ops: a ragged prefill, then a decode step."""
    config = tiny_config(layers=2, kv_heads=2, head_dim=16, hidden=48)
    model = LlamaModel(config, tiny_weights(config), dtype, device, linear="torch")
    results = []
    for fused in (True, False):
        model.layer_ops = ops if fused else None
        model.norm_adds_residual = fused
        model.decoder = None
        kv = KVCache(manager, config, dtype, max_tokens=32, max_slots=2)
        vts = [vt for _ in range(2) for vt in kv.create(20)]
        try:
            ids = torch.randint(0, 40, (19,), generator=torch.Generator().manual_seed(1)).to(device)
            slots = [vt.slot for vt in vts]
            prefill = model.forward(ids, ForwardBatch.build(slots, [0, 0], [7, 12], torch.device(device)), kv,
                                    SdpaAttention())
            decode = model.forward(ids[:2], ForwardBatch.build(slots, [7, 12], [1, 1], torch.device(device)), kv,
                                   SdpaAttention())
            cached = [v[vt.slot, :n].clone() for v in kv.kv for vt, n in zip(vts, [8, 13])]
        finally:
            # vtm's contract: the kernels that use a vTensor have completed
            # before it is released (its pages are unmapped).
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize(device)
            kv.release(vts)
            kv.close()
        results.append((prefill, decode, cached))
    (fp, fd, fk), (tp, td, tk) = results
    out["forward_prefill_logits"] = compare(fp, tp)
    out["forward_decode_logits"] = compare(fd, td)
    out["forward_kv"] = compare(torch.cat([t.flatten() for t in fk]), torch.cat([t.flatten() for t in tk]))


def run_checks(device: str) -> dict:
    results = {}
    with vtm.Manager(**manager_pool(device)) as manager:
        for name, dtype in DTYPES.items():
            out = results[name] = {}
            check_norms(dtype, out, device)
            check_silu(dtype, out, device)
            check_rotary(dtype, out, manager, device)
            check_forward(dtype, out, manager, device)
        manager.check()
    return results


def main() -> None:
    print(json.dumps(run_checks("cpu")))


if __name__ == "__main__":
    sys.exit(main())
