"""The CPU layer ops (src/flexinfer/kernels/cpu_layer_ops.py) against the torch code
they replace and transformers' rounding order: RMSNorm and the rotary embedding
bit for bit, SiLU*up to float32's last bits (its exp is not torch's); the K/V
write by the bytes of a real vtm cache; bad arguments change nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vtm
from flexinfer import InvalidArgument
from flexinfer.attention import SdpaAttention
from flexinfer.kernels import cpu_layer_ops
from flexinfer.kv_cache import KVCache
from flexinfer.model.config import ModelConfig
from flexinfer.model.llama import ForwardBatch, LlamaModel

modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")

DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-5


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so that equality is bitwise (NaN, -0.0)."""
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def rows(tokens: int, dim: int, dtype, seed: int, strided: bool, scale: float = 1.0) -> torch.Tensor:
    """[tokens, dim] values; with `strided`, rows are a slice of wider rows."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(tokens, dim + (7 if strided else 0), generator=gen) * scale
    x = wide.to(dtype)[:, :dim]
    assert tokens == 1 or x.is_contiguous() != strided
    return x


def hf_order_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's steps, with the variance summed in float64 and rounded
    once to float32 (as the kernel does; transformers sums in float32)."""
    xf = x.float()
    var = (xf.double().square().sum(-1, keepdim=True) / x.shape[-1]).float()
    return weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)


# ----------------------------------------------------------------------------- rms_norm

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 33])
@pytest.mark.parametrize("dim", [576, 64, 37, 5])
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm_is_transformers_order_bit_for_bit(dtype, tokens, dim, strided):
    x = rows(tokens, dim, dtype, seed=dim + tokens, strided=strided, scale=3.0)
    weight = rows(1, dim, dtype, seed=7, strided=False)[0]
    out = cpu_layer_ops.rms_norm(x, weight, EPS)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(bits(out), bits(hf_order_rms_norm(x, weight, EPS)))
    # transformers itself sums the squares in float32: the variance may differ in its last bits.
    hf = modeling_llama.LlamaRMSNorm(dim, eps=EPS).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(weight)
        want = hf(x)
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=2e-6, atol=1e-6)
        torch.testing.assert_close(out, F.rms_norm(x, (dim,), weight, EPS), rtol=2e-6, atol=1e-6)
    else:
        assert (out != want).float().mean() < 1e-3
        torch.testing.assert_close(out, want, rtol=8e-3, atol=0)  # one bfloat16 step at most


def test_bfloat16_rms_norm_rounds_before_the_weight():
    """transformers rounds the normalised row to bfloat16, then multiplies by the
    weight; F.rms_norm rounds once. The two differ, and the kernel is the former."""
    x = rows(33, 576, torch.bfloat16, seed=3, strided=False)
    weight = rows(1, 576, torch.bfloat16, seed=4, strided=False)[0]
    out = cpu_layer_ops.rms_norm(x, weight, EPS)
    assert torch.equal(out, hf_order_rms_norm(x, weight, EPS))
    assert not torch.equal(out, F.rms_norm(x, (576,), weight, EPS))


def test_rms_norm_of_huge_and_zero_rows():
    """x^2 overflowing float32 gives transformers an infinite variance and zeros;
    a zero row gives zeros (eps keeps the inverse finite)."""
    x = torch.tensor([[3e19, -3e19, 1.0], [0.0, 0.0, 0.0], [1e-30, 2e-30, 0.0]])
    weight = torch.tensor([1.0, 2.0, 3.0])
    out = cpu_layer_ops.rms_norm(x, weight, EPS)
    assert torch.equal(bits(out), bits(hf_order_rms_norm(x, weight, EPS)))
    assert torch.equal(out[:2], torch.zeros(2, 3))


# ----------------------------------------------------------------------------- silu_mul

@pytest.mark.parametrize("tokens", [1, 3, 33])
@pytest.mark.parametrize("inter", [1536, 64, 37, 5])
@pytest.mark.parametrize("strided", [False, True])
def test_float32_silu_mul_matches_torch(tokens, inter, strided):
    gate_up = rows(tokens, 2 * inter, torch.float32, seed=inter + tokens, strided=strided, scale=4.0)
    out = cpu_layer_ops.silu_mul(gate_up)
    assert out.shape == (tokens, inter) and out.is_contiguous()
    gate, up = gate_up.chunk(2, dim=-1)
    # The kernel's exp is not torch's: the last bit or two of float32 may differ.
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=4e-7, atol=0)


def test_float32_silu_over_the_whole_range():
    """exp(-g) from underflow to overflow, subnormal results, infinities and NaN."""
    g = torch.tensor([-200.0, -104.0, -100.0, -88.7, -88.5, -87.5, -87.0, -20.0, -1e-3, -0.0, 0.0, 1e-3, 20.0,
                      87.5, 88.5, 89.0, 100.0, 103.5, 200.0, float("inf"), float("-inf"), float("nan")])
    gate_up = torch.cat([g, torch.ones_like(g)])[None]
    out = cpu_layer_ops.silu_mul(gate_up)[0]
    want = F.silu(g)
    torch.testing.assert_close(out, want, rtol=4e-7, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(out[~want.isnan()]), torch.signbit(want[~want.isnan()]))


@pytest.mark.parametrize("strided", [False, True])
def test_bfloat16_silu_mul_rounds_as_transformers(strided):
    """transformers rounds silu(gate) to bfloat16, then the product. The kernel's
    float32 silu may differ from torch's in its last bit, which flips a bfloat16
    rounding only when it lies on a rounding boundary (about one element in a
    million); rounding once instead would differ in a good share of elements."""
    gate_up = rows(64, 2 * 1536, torch.bfloat16, seed=5, strided=strided, scale=4.0)
    gate, up = gate_up.chunk(2, dim=-1)
    out = cpu_layer_ops.silu_mul(gate_up)
    want = F.silu(gate) * up  # bfloat16 ops: silu rounded, then the product
    mismatched = (out != want).float().mean().item()
    assert mismatched <= 1e-4, mismatched
    torch.testing.assert_close(out, want, rtol=8e-3, atol=0)
    rounded_once = (F.silu(gate.float()) * up.float()).to(torch.bfloat16)
    assert (out != rounded_once).float().mean().item() > 0.01


# ----------------------------------------------------------------------------- rotary + K/V write

def tiny_config(kv_heads: int, head_dim: int, layers: int = 3) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=32, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=layers, num_attention_heads=2 * kv_heads, num_key_value_heads=kv_heads,
                       head_dim=head_dim, rms_norm_eps=EPS, rope_theta=1e4, rope_scaling=None,
                       max_position_embeddings=64, tie_word_embeddings=True, attention_bias=False, bos_token_id=1,
                       eos_token_ids=(2,))


def rope_tables(positions: torch.Tensor, head_dim: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, head_dim] as LlamaModel._rope makes them (sin's first half negated)."""
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)).float()
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1)
    sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1)
    return cos.to(dtype), sin.to(dtype)


class Cache:
    """A real vtm KV cache with every slot's every token mapped and filled with
    random values, so that any write can be compared byte for byte."""

    def __init__(self, manager, config, dtype, max_tokens, max_slots, layer_groups):
        self.kv = KVCache(manager, config, dtype, max_tokens=max_tokens, max_slots=max_slots,
                          layer_groups=layer_groups)
        self.vts = [vt for _ in range(max_slots) for vt in self.kv.create(max_tokens)]
        gen = torch.Generator().manual_seed(99)
        for layer_view in self.kv.kv:
            layer_view.copy_(torch.randn(layer_view.shape, generator=gen).to(dtype))

    def snapshot(self) -> list[torch.Tensor]:
        return [bits(v).clone() for v in self.kv.kv]

    def close(self):
        self.kv.release(self.vts)
        self.kv.close()


@pytest.fixture
def manager():
    with vtm.Manager(backend="host", capacity_bytes=1 << 24, chunk_bytes=4096, granularity=4096) as m:
        yield m
        m.check()


def random_batch(tokens: int, max_slots: int, max_tokens: int, seed: int):
    """A ForwardBatch-like set of vectors: distinct (slot, position) pairs in random order."""
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randperm(max_slots * max_tokens, generator=gen)[:tokens]
    if not (flat % max_tokens == max_tokens - 1).any():
        flat[0] = max_tokens - 1  # slot 0's last row: the view's bounds are reached
    return flat // max_tokens, flat % max_tokens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 33])
@pytest.mark.parametrize("kv_heads,head_dim", [(3, 64), (2, 40), (1, 6)])
@pytest.mark.parametrize("layer_groups", [1, 2])
def test_rotary_kv_write_equals_the_torch_path(manager, dtype, tokens, kv_heads, head_dim, layer_groups):
    config = tiny_config(kv_heads, head_dim)
    heads = config.num_attention_heads
    cache = Cache(manager, config, dtype, max_tokens=16, max_slots=3, layer_groups=layer_groups)
    slot_vectors, positions = random_batch(tokens, 3, 16, seed=tokens + head_dim)
    batch = type("Batch", (), {})()  # only the two vectors the cache reads
    batch.slot_index, batch.positions = [slot_vectors] * layer_groups, positions
    cos, sin = rope_tables(positions, head_dim, dtype)
    gen = torch.Generator().manual_seed(tokens)
    # qkv as the model has it: a strided view of a wider projection output.
    wide = torch.randn(tokens, heads + 2 * kv_heads + 1, head_dim, generator=gen).to(dtype)
    qkv = wide[:, 1:]
    layer = 1
    # The torch path, on copies.
    want_qkv = qkv.clone()
    LlamaModel._rotate_(want_qkv[:, : heads + kv_heads], cos[:, None], sin[:, None])
    want_cache = [v.clone() for v in cache.kv.kv]
    want_cache[layer].index_put_((slot_vectors, positions), want_qkv[:, heads:].reshape(tokens, 2, kv_heads,
                                                                                          head_dim))
    cpu_layer_ops.rotary_kv_write(qkv, heads, cos, sin, cache.kv.kv[layer], cache.kv.slot_index(layer, batch),
                                  positions)
    assert torch.equal(bits(qkv), bits(want_qkv))
    for got, want in zip(cache.kv.kv, want_cache):  # every layer: only the written rows changed
        assert torch.equal(bits(got), bits(want))
    cache.close()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_equals_transformers_bit_for_bit(dtype):
    """Against apply_rotary_pos_emb itself, with its own (unsigned) sin."""
    tokens, heads, kv_heads, dim = 9, 4, 2, 40
    positions = torch.arange(100, 100 + tokens)
    cos, signed_sin = rope_tables(positions, dim, dtype)
    sin = torch.cat([-signed_sin[:, : dim // 2], signed_sin[:, dim // 2:]], dim=-1)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    q_hf, k_hf = modeling_llama.apply_rotary_pos_emb(
        qkv[:, :heads].transpose(0, 1)[None], qkv[:, heads:heads + kv_heads].transpose(0, 1)[None],
        cos[None], sin[None])
    kv = torch.zeros(1, tokens, 2, kv_heads, dim, dtype=dtype)
    ours = qkv.clone()
    cpu_layer_ops.rotary_kv_write(ours, heads, cos, signed_sin, kv, torch.zeros(tokens, dtype=torch.long),
                                  torch.arange(tokens))
    assert torch.equal(bits(ours[:, :heads]), bits(q_hf[0].transpose(0, 1)))
    assert torch.equal(bits(ours[:, heads:heads + kv_heads]), bits(k_hf[0].transpose(0, 1)))
    assert torch.equal(bits(kv[0, :, 0]), bits(k_hf[0].transpose(0, 1)))
    assert torch.equal(bits(kv[0, :, 1]), bits(qkv[:, heads + kv_heads:]))


@pytest.mark.parametrize("bad", ["slot", "negative slot", "position", "negative position"])
def test_a_bad_destination_raises_and_changes_nothing(manager, bad):
    config = tiny_config(2, 8)
    heads, tokens = config.num_attention_heads, 5
    cache = Cache(manager, config, torch.float32, max_tokens=16, max_slots=3, layer_groups=1)
    slots, positions = random_batch(tokens, 3, 16, seed=1)
    # The bad one last: nothing before it may have been written either.
    value = {"slot": 3, "negative slot": -1, "position": 16, "negative position": -1}[bad]
    (slots if "slot" in bad else positions)[-1] = value
    cos, sin = rope_tables(positions.clamp(min=0), 8, torch.float32)
    qkv = torch.randn(tokens, heads + 4, 8)
    before_qkv, before_cache = qkv.clone(), cache.snapshot()
    word = "slot" if "slot" in bad else "position"
    with pytest.raises(InvalidArgument, match=f"{word} {value} of token {tokens - 1} is outside"):
        cpu_layer_ops.rotary_kv_write(qkv, heads, cos, sin, cache.kv.kv[0], slots, positions)
    assert torch.equal(bits(qkv), bits(before_qkv))
    for got, want in zip(cache.snapshot(), before_cache):
        assert torch.equal(got, want)
    cache.close()


def test_bad_shapes_and_dtypes_are_refused():
    x = torch.randn(3, 8)
    with pytest.raises(InvalidArgument, match="float32 or bfloat16"):
        cpu_layer_ops.rms_norm(x.half(), torch.ones(8).half(), EPS)
    with pytest.raises(InvalidArgument, match="weight"):
        cpu_layer_ops.rms_norm(x, torch.ones(7), EPS)
    with pytest.raises(InvalidArgument, match="weight"):
        cpu_layer_ops.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), EPS)
    with pytest.raises(InvalidArgument, match="D contiguous"):
        cpu_layer_ops.rms_norm(x.t(), torch.ones(3), EPS)
    with pytest.raises(InvalidArgument, match="eps"):
        cpu_layer_ops.rms_norm(x, torch.ones(8), -1.0)
    with pytest.raises(InvalidArgument, match="2I"):
        cpu_layer_ops.silu_mul(torch.randn(3, 7))
    tokens, heads, kv_heads, dim = 2, 2, 1, 8
    qkv, kv = torch.randn(tokens, heads + 2 * kv_heads, dim), torch.zeros(2, 4, 2, kv_heads, dim)
    cos, sin = rope_tables(torch.arange(tokens), dim, torch.float32)
    index = torch.zeros(tokens, dtype=torch.long)
    with pytest.raises(InvalidArgument, match="heads"):
        cpu_layer_ops.rotary_kv_write(qkv, heads + 1, cos, sin, kv, index, index)
    with pytest.raises(InvalidArgument, match="int64"):
        cpu_layer_ops.rotary_kv_write(qkv, heads, cos, sin, kv, index.int(), index)
    with pytest.raises(InvalidArgument, match="sin"):
        cpu_layer_ops.rotary_kv_write(qkv, heads, cos, sin[:1], kv, index, index)
    with pytest.raises(InvalidArgument, match="dtype"):
        cpu_layer_ops.rotary_kv_write(qkv, heads, cos, sin, kv.bfloat16(), index, index)
    odd = torch.randn(tokens, heads + 2 * kv_heads, 7)
    with pytest.raises(InvalidArgument, match="even head_dim"):
        cpu_layer_ops.rotary_kv_write(odd, heads, cos[:, :7], sin[:, :7], torch.zeros(2, 4, 2, kv_heads, 7),
                                      index, index)
    assert torch.equal(kv, torch.zeros_like(kv))


# ----------------------------------------------------------------------------- threads

@pytest.mark.parametrize("dtype", DTYPES)
def test_threads_split_rows_without_changing_a_bit(manager, dtype):
    """Large calls run on several threads (rows split between them): the same bits as one."""
    x = rows(300, 576, dtype, seed=1, strided=True)
    weight = rows(1, 576, dtype, seed=2, strided=False)[0]
    assert torch.equal(bits(cpu_layer_ops.rms_norm(x, weight, EPS, threads=2)),
                       bits(cpu_layer_ops.rms_norm(x, weight, EPS, threads=1)))
    gate_up = rows(64, 2 * 1536, dtype, seed=3, strided=False, scale=4.0)
    assert torch.equal(bits(cpu_layer_ops.silu_mul(gate_up, threads=2)),
                       bits(cpu_layer_ops.silu_mul(gate_up, threads=1)))
    config = tiny_config(3, 64)
    heads, tokens = config.num_attention_heads, 120
    results = []
    for threads in (1, 2):
        cache = Cache(manager, config, dtype, max_tokens=64, max_slots=3, layer_groups=1)
        slots, positions = random_batch(tokens, 3, 64, seed=4)
        cos, sin = rope_tables(positions, 64, dtype)
        qkv = rows(tokens, (heads + 2 * 3) * 64, dtype, seed=5, strided=False).view(tokens, -1, 64)
        cpu_layer_ops.rotary_kv_write(qkv, heads, cos, sin, cache.kv.kv[2], slots, positions, threads=threads)
        results.append((bits(qkv), cache.snapshot()))
        cache.close()
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- in the model

@pytest.mark.parametrize("dtype", DTYPES)
def test_model_forward_uses_the_fused_ops_and_matches_the_torch_ops(manager, dtype):
    """The same forward with the fused ops on and off: float32 logits agree to the
    variance's last bits; the K/V cache written by both is compared too."""
    config = tiny_config(2, 16, layers=2)
    gen = torch.Generator().manual_seed(0)
    names = {"model.embed_tokens.weight": (32, 32), "model.norm.weight": (32,)}
    for i in range(2):
        p = f"model.layers.{i}."
        names.update({p + "self_attn.q_proj.weight": (64, 32), p + "self_attn.k_proj.weight": (32, 32),
                      p + "self_attn.v_proj.weight": (32, 32), p + "self_attn.o_proj.weight": (32, 64),
                      p + "mlp.gate_proj.weight": (64, 32), p + "mlp.up_proj.weight": (64, 32),
                      p + "mlp.down_proj.weight": (32, 64), p + "input_layernorm.weight": (32,),
                      p + "post_attention_layernorm.weight": (32,)})
    weights = {n: torch.randn(shape, generator=gen) * 0.3 for n, shape in names.items()}
    model = LlamaModel(config, weights, dtype, linear="torch")
    assert model.layer_ops is cpu_layer_ops

    outs = []
    for ops in (cpu_layer_ops, None):
        model.layer_ops = ops
        kv = KVCache(manager, config, dtype, max_tokens=32, max_slots=2)
        vts = [vt for _ in range(2) for vt in kv.create(20)]
        batch = ForwardBatch.build([vt.slot for vt in vts], [0, 0], [7, 12], torch.device("cpu"))
        logits = model.forward(torch.randint(0, 32, (19,), generator=torch.Generator().manual_seed(1)), batch,
                               kv, SdpaAttention())
        outs.append((logits, [v[vt.slot, :n].clone() for v in kv.kv for vt, n in zip(vts, [7, 12])]))
        kv.release(vts)
        kv.close()
    (fused_logits, fused_kv), (torch_logits, torch_kv) = outs
    if dtype == torch.float32:
        torch.testing.assert_close(fused_logits, torch_logits, rtol=1e-5, atol=1e-5)
        for a, b in zip(fused_kv, torch_kv):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    else:  # F.rms_norm rounds bfloat16 once, transformers (and the kernel) twice
        torch.testing.assert_close(fused_logits, torch_logits, rtol=0.1, atol=0.1)
