"""The fused Triton decode kernels (src/flexinfer/kernels/triton_linear.py)
against the torch code they replace, rounded as transformers rounds it, and
a tiny model's forward through them against the same model on the separate
Triton layer ops and cuBLAS/F.linear; for each dtype.

Run as a script (by test_triton_linear.py), it runs them in Triton's
interpreter on CPU tensors, in a process of its own (TRITON_INTERPRET must be
set before triton is imported). Imported (test_gpu.py), `run_checks("cuda")`
runs them on the GPU. The result is {dtype: {check: {"max_err", "scale",
"bitwise", "differing"}}}, as triton_layer_ops_child.py's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import vtm  # noqa: E402
from flexinfer.attention import SdpaAttention  # noqa: E402
from flexinfer.errors import InvalidArgument  # noqa: E402
from flexinfer.kernels import triton_layer_ops, triton_linear as ops  # noqa: E402
from flexinfer.kv_cache import KVCache  # noqa: E402
from flexinfer.model.llama import ForwardBatch, LlamaModel  # noqa: E402
from triton_layer_ops_child import (DTYPES, EPS, bits, compare, hf_rms_norm, manager_pool, rope_rows,  # noqa: E402
                                    rows, tiny_config, tiny_weights)


def reference_linear(x, weight, bias=None, residual=None):
    """x @ weight.T (+ bias) accumulated in float32 and rounded once, then + residual rounded."""
    y = x.double() @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    y = y.to(x.dtype)
    return y if residual is None else (residual.float() + y.float()).to(x.dtype)


def check_linear(dtype, out, device):
    gen = torch.Generator().manual_seed(11)
    for n_rows in (1, 3, 5, 7, ops.MAX_ROWS):
        # 700 inputs: the K loop runs several blocks with a tail; 70 outputs: five programs with a tail.
        x = rows(n_rows, 700, dtype, n_rows, device)
        weight = (torch.randn(70, 700, generator=gen) * 0.05).to(device=device, dtype=dtype)
        bias = torch.randn(70, generator=gen).to(device=device, dtype=dtype)
        residual = rows(n_rows, 70, dtype, 100 + n_rows, device)
        out[f"linear_{n_rows}_rows"] = compare(ops.linear(x, weight), reference_linear(x, weight))
        out[f"linear_bias_residual_{n_rows}_rows"] = compare(ops.linear(x, weight, bias, residual),
                                                             reference_linear(x, weight, bias, residual))


def check_gate_up(dtype, out, device):
    gen = torch.Generator().manual_seed(12)
    for n_rows in (1, 5):
        x = rows(n_rows, 300, dtype, 20 + n_rows, device)
        norm = (torch.rand(300, generator=gen) + 0.5).to(device=device, dtype=dtype)
        weight = (torch.randn(2 * 90, 300, generator=gen) * 0.1).to(device=device, dtype=dtype)
        gate, up = reference_linear(hf_rms_norm(x, norm), weight).chunk(2, dim=-1)
        out[f"norm_gate_up_silu_{n_rows}_rows"] = compare(ops.norm_gate_up_silu(x, norm, EPS, weight),
                                                          F.silu(gate) * up)


def check_qkv(dtype, out, manager, device, head_dim=24):
    config = tiny_config(layers=2, kv_heads=2, head_dim=head_dim)
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    n_rows, max_slots, max_tokens, hidden = 7, 3, 16, 40
    kv = KVCache(manager, config, dtype, max_tokens=max_tokens, max_slots=max_slots)
    vts = [vt for _ in range(max_slots) for vt in kv.create(max_tokens)]
    try:
        gen = torch.Generator().manual_seed(13)
        flat = torch.randperm(max_slots * max_tokens, generator=gen)[:n_rows]
        slots, positions = (flat // max_tokens).to(device), (flat % max_tokens).to(device)
        cos, sin = rope_rows(positions, dim, dtype, device)
        x = rows(n_rows, hidden, dtype, 14, device)
        norm = (torch.rand(hidden, generator=gen) + 0.5).to(device=device, dtype=dtype)
        weight = (torch.randn((heads + 2 * kv_heads) * dim, hidden, generator=gen) * 0.2).to(device=device,
                                                                                             dtype=dtype)
        bias = torch.randn((heads + 2 * kv_heads) * dim, generator=gen).to(device=device, dtype=dtype)
        layer = kv.kv[1]
        layer.copy_(torch.randn(layer.shape, generator=gen).to(dtype))
        before = layer.clone()

        for name, b in (("", None), ("_bias", bias)):
            want_qkv = reference_linear(hf_rms_norm(x, norm), weight, b).view(n_rows, heads + 2 * kv_heads, dim)
            LlamaModel._rotate_(want_qkv[:, :heads + kv_heads], cos[:, None], sin[:, None])
            want_kv = before.clone()
            want_kv.index_put_((slots, positions), want_qkv[:, heads:].view(n_rows, 2, kv_heads, dim))
            layer.copy_(before)
            got_qkv = ops.norm_qkv_rotary_kv_write(x, norm, EPS, weight, b, heads, cos, sin, layer, slots, positions)
            out[f"norm_qkv_rotary{name}"] = compare(got_qkv, want_qkv)
            out[f"norm_qkv_kv_write{name}"] = compare(layer, want_kv)

        # A (slot, position) outside the view is skipped; the others are written.
        layer.copy_(before)
        bad_slots, bad_positions = slots.clone(), positions.clone()
        bad_slots[0], bad_positions[1], bad_slots[2] = max_slots, max_tokens, -1
        ops.norm_qkv_rotary_kv_write(x, norm, EPS, weight, None, heads, cos, sin, layer, bad_slots, bad_positions)
        want_qkv = reference_linear(hf_rms_norm(x, norm), weight).view(n_rows, heads + 2 * kv_heads, dim)
        LlamaModel._rotate_(want_qkv[:, :heads + kv_heads], cos[:, None], sin[:, None])
        skipped = before.clone()
        skipped.index_put_((slots[3:], positions[3:]), want_qkv[3:, heads:].view(n_rows - 3, 2, kv_heads, dim))
        out["norm_qkv_outside_is_skipped"] = compare(layer, skipped)

        # Bad arguments are refused before anything runs.
        refused = 0
        many = rows(ops.MAX_ROWS + 1, hidden, dtype, 15, device)
        for call in (lambda: ops.norm_qkv_rotary_kv_write(x, norm, EPS, weight, None, heads + 1, cos, sin, layer,
                                                          slots, positions),
                     lambda: ops.norm_qkv_rotary_kv_write(x, norm, EPS, weight, None, heads, cos, sin, layer,
                                                          slots.int(), positions),
                     lambda: ops.norm_qkv_rotary_kv_write(x, norm, EPS, weight, None, heads, cos[:1], sin, layer,
                                                          slots, positions),
                     lambda: ops.linear(many, weight),
                     lambda: ops.linear(x, weight.T.contiguous().T),
                     lambda: ops.linear(x, weight, residual=x[:, :3]),
                     lambda: ops.norm_gate_up_silu(x, norm, EPS, weight[:-1]),
                     lambda: ops.norm_gate_up_silu(x, norm[:-1], EPS, weight)):
            layer.copy_(before)
            try:
                call()
            except InvalidArgument:
                refused += 1 if torch.equal(bits(layer), bits(before)) else 0
        out["bad_arguments_refused"] = {"max_err": 0.0, "bitwise": refused == 8}
    finally:
        kv.release(vts)
        kv.close()


# (head_dim, heads, kv_heads, rows, bias): the head sizes of current models,
# grouped-query ratios 1 to 4, rows padded to a block of 2, 4 or 8.
QKV_SHAPES = ((64, 8, 2, 5, True), (80, 4, 4, 8, False), (96, 6, 2, 3, True), (128, 4, 1, 1, True),
              (256, 2, 1, 7, False))


def check_qkv_shapes(dtype, out, device):
    """norm_qkv_rotary_kv_write at QKV_SHAPES (K 36: one K block with a tail),
    into a plain cache tensor, each row at its own (slot, position)."""
    gen = torch.Generator().manual_seed(16)
    hidden, max_slots, max_tokens = 36, 3, 4
    for dim, heads, kv_heads, n_rows, has_bias in QKV_SHAPES:
        flat = torch.randperm(max_slots * max_tokens, generator=gen)[:n_rows]
        slots, positions = (flat // max_tokens).to(device), (flat % max_tokens).to(device)
        cos, sin = rope_rows(positions, dim, dtype, device)
        x = rows(n_rows, hidden, dtype, 17 + dim, device)
        norm = (torch.rand(hidden, generator=gen) + 0.5).to(device=device, dtype=dtype)
        n = (heads + 2 * kv_heads) * dim
        weight = (torch.randn(n, hidden, generator=gen) * 0.2).to(device=device, dtype=dtype)
        bias = torch.randn(n, generator=gen).to(device=device, dtype=dtype) if has_bias else None
        kv = torch.randn(max_slots, max_tokens, 2, kv_heads, dim, generator=gen).to(device=device, dtype=dtype)
        want_qkv = reference_linear(hf_rms_norm(x, norm), weight, bias).view(n_rows, heads + 2 * kv_heads, dim)
        LlamaModel._rotate_(want_qkv[:, :heads + kv_heads], cos[:, None], sin[:, None])
        want_kv = kv.clone()
        want_kv.index_put_((slots, positions), want_qkv[:, heads:].view(n_rows, 2, kv_heads, dim))
        got_qkv = ops.norm_qkv_rotary_kv_write(x, norm, EPS, weight, bias, heads, cos, sin, kv, slots, positions)
        name = f"norm_qkv_head_dim_{dim}_{heads}_{kv_heads}_heads_{n_rows}_rows{'_bias' if has_bias else ''}"
        out[name] = compare(got_qkv, want_qkv)
        out[name + "_kv_write"] = compare(kv, want_kv)


def check_forward(dtype, out, manager, device):
    """A 2-layer model (with a QKV bias) on the fused kernels against the same
    weights on the separate Triton layer ops and F.linear: a ragged prefill
    (which the fused kernels do not run), then decode steps of 1 and 3 rows."""
    config = dataclasses.replace(tiny_config(layers=2, kv_heads=2, head_dim=16, hidden=48), attention_bias=True)
    weights = tiny_weights(config)
    # The o and down weights as transposed views (a checkpoint may hold them
    # so): F.linear reads any strides, the fused kernels dense rows.
    for n in weights:
        if n.endswith(("o_proj.weight", "down_proj.weight")):
            weights[n] = weights[n].T.contiguous().T
    model = LlamaModel(config, weights, dtype, device, linear="torch")
    model.layer_ops, model.norm_adds_residual, model.decoder = triton_layer_ops, True, None
    model.triton_linear = ops
    results = []
    for fused in (True, False):
        model.fused_kinds = {1: "triton", 8: "triton"} if fused else {}
        kv = KVCache(manager, config, dtype, max_tokens=32, max_slots=3)
        vts = [vt for _ in range(3) for vt in kv.create(20)]
        try:
            ids = torch.randint(0, 40, (24,), generator=torch.Generator().manual_seed(1)).to(device)
            slots = [vt.slot for vt in vts]
            logits = [model.forward(ids, ForwardBatch.build(slots, [0, 0, 0], [7, 12, 5], torch.device(device)), kv,
                                    SdpaAttention())]
            logits.append(model.forward(ids[:3], ForwardBatch.build(slots, [7, 12, 5], [1, 1, 1],
                                                                    torch.device(device)), kv, SdpaAttention()))
            logits.append(model.forward(ids[3:4], ForwardBatch.build(slots[:1], [8], [1], torch.device(device)), kv,
                                        SdpaAttention()))
            cached = [v[vt.slot, :n].clone() for v in kv.kv for vt, n in zip(vts, [9, 13, 6])]
        finally:
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize(device)
            kv.release(vts)
            kv.close()
        results.append((logits, cached))
    (fused_logits, fused_kv), (separate_logits, separate_kv) = results
    out["forward_prefill_logits"] = compare(fused_logits[0], separate_logits[0])
    out["forward_decode_3_rows_logits"] = compare(fused_logits[1], separate_logits[1])
    out["forward_decode_1_row_logits"] = compare(fused_logits[2], separate_logits[2])
    out["forward_kv"] = compare(torch.cat([t.flatten() for t in fused_kv]),
                                torch.cat([t.flatten() for t in separate_kv]))


# In the interpreter (~1.5 s a call here) the head shapes run in float32
# alone and the model in float32 and bfloat16: where a shape's rows, heads or
# rotary halves are indexed does not depend on the dtype, and check_qkv
# covers each dtype's rounding. On a device everything runs in every dtype.
INTERPRETED_SHAPE_DTYPES = ("float32",)
INTERPRETED_FORWARD_DTYPES = ("float32", "bfloat16")


def run_checks(device: str) -> dict:
    results = {}
    interpreted = device == "cpu"
    with vtm.Manager(**manager_pool(device)) as manager:
        for name, dtype in DTYPES.items():
            out = results[name] = {}
            check_linear(dtype, out, device)
            check_gate_up(dtype, out, device)
            check_qkv(dtype, out, manager, device)
            if not interpreted or name in INTERPRETED_SHAPE_DTYPES:
                check_qkv_shapes(dtype, out, device)
            if not interpreted or name in INTERPRETED_FORWARD_DTYPES:
                check_forward(dtype, out, manager, device)
        # The kernels split their columns finely for these small shapes (4
        # a program): once more, with the device asking for few programs, at
        # 16 a program (a head_dim whose half 16 divides).
        target = ops._target_programs
        ops._target_programs = lambda device: 1
        try:
            for name, dtype in DTYPES.items():
                wide = {}
                check_linear(dtype, wide, device)
                check_gate_up(dtype, wide, device)
                check_qkv(dtype, wide, manager, device, head_dim=32)
                results[name].update({f"{check}_wide": r for check, r in wide.items()})
        finally:
            ops._target_programs = target
        manager.check()
    return results


def main() -> None:
    print(json.dumps(run_checks("cpu")))


if __name__ == "__main__":
    sys.exit(main())
