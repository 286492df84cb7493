"""The decoder of every supported family (Llama and SmolLM2, Mistral, Qwen2/3,
Phi-3, Gemma 2/3) in plain PyTorch.

One forward pass runs a flattened batch: the new tokens of every scheduled
sequence, concatenated. Projections, norms and the MLP run once over all of
them; each layer writes its new K/V rows in place into the vTensor cache and
asks the attention backend to attend over the cached rows, which it reads as
strided views (no past KV is ever copied). Q/K/V and gate/up weights are
fused into one matrix each so a layer costs few, large matmuls, and every
projection runs through `Linear`, which prepares its weight once for the
fastest kernel on the device (see linear.py). On the CPU in float32 and bfloat16
the norms, SiLU(gate)*up and the rotary embedding with the K/V write run as
fused C++ loops (kernels/cpu_layer_ops.py), rounded as transformers rounds them;
on CUDA as Triton kernels of the same rounding (kernels/triton_layer_ops.py),
where each residual add is made by the norm that follows it: a small model's
GPU step is bound by its number of kernels. Decode steps of up to 8 rows can
run each layer as four kernels, the projections fused with those ops
(kernels/triton_linear.py; `linear="triton"`, or "auto" where it times
faster at load). Elsewhere they are torch ops. On
the CPU, when a pass's projections run the `packed` kernel and attention is
the batched kernel, all its layers run as one C++ call
(kernels/cpu_decoder.py) that makes the loop's kernel calls in the loop's
order: the same bits without ~9 Python calls per layer. Where the LM head
runs `packed` too (decode steps), that call runs the whole pass, ids in,
logits out.

The families differ from Llama only in what ModelConfig says, and each
difference is one branch in the loop, rounded as transformers rounds it: q/k
norms before RoPE, Gemma's (1 + w) norms before and after attention and the
MLP, GeGLU, scaled embeddings, soft-capped logits, and per-layer attention
(a sliding window, a scale, a soft cap, the layer type's own RoPE table).
Models with any of them run the loop (the one-call decoder is Llama's).
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flexinfer.errors import InvalidArgument
from flexinfer.kernels import triton_available
from flexinfer.model.config import FULL, SLIDING, ModelConfig
from flexinfer.model.fused_layer_timing import measure_fused_layer
from flexinfer.model.linear import ROW_BUCKETS, Linear, bucket_of, measure_kinds, resolve_linear_kind


def long_tensor(values: list[int]) -> torch.Tensor:
    """torch.tensor(values, dtype=torch.long) on the CPU, ~3.5x faster: torch
    converts a list element by element (~50 ns each), array packs it in C
    (a decode step's vectors are ~5 ints per sequence)."""
    if not values:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(array("q", values), dtype=torch.long)


@dataclass
class ForwardBatch:
    """The tokens of one forward pass and where their KV lives.

    Sequence i contributes `new_lens[i]` tokens at positions
    `starts[i] .. starts[i] + new_lens[i] - 1` of its vTensors (the first
    `starts[i]` rows are already cached). `slots[g][i]` is the slot of its
    vTensor in layer group g (one group unless the cache has several).
    The batched attention kernels take the same facts as int32 vectors.
    """

    slots: list[list[int]]
    starts: list[int]
    new_lens: list[int]
    slot_index: list[torch.Tensor]  # per group: [T] the slot of each token
    positions: torch.Tensor  # [T] the position of each token
    last_index: torch.Tensor  # [B] index in the flat batch of each sequence's last token
    slot_vector: list[torch.Tensor]  # per group: [B] int32 slots
    seq_lens: torch.Tensor  # [B] int32: starts + new_lens
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: offsets of each sequence's tokens in the flat batch
    max_q_len: int

    @staticmethod
    def build(slots, starts: list[int], new_lens: list[int], device: torch.device) -> "ForwardBatch":
        """`slots`: per sequence, its slot (an int) or its slot in each layer
        group (a tuple). Packing costs ~30 ns per int, about 120 µs a decode
        step at batch 256, and on CUDA a copy: a step that continues a decode
        batch takes advanced() instead."""
        per_seq = slots if all(type(s) is tuple for s in slots) else [
            (s,) if isinstance(s, int) else tuple(s) for s in slots]
        groups = [list(column) for column in zip(*per_seq)] if per_seq else [[]]
        b = len(new_lens)
        # Every vector in one host buffer, then one copy to the device (a
        # step must not pay a transfer per vector on CUDA), and the int32
        # ones converted in one call. From pinned memory: a copy from
        # pageable memory would wait for the steps queued before it.
        packed = array("q")
        if new_lens.count(1) == b:  # a decode step: one token per sequence, nothing to expand
            t = b
            for group in groups:
                packed.extend(group)  # slot_index
            packed.extend(starts)  # positions
            packed.extend(range(b))  # last_index
            for group in groups:
                packed.extend(group)  # slot_vector
            packed.extend([s + 1 for s in starts])  # seq_lens
            packed.extend(range(b + 1))  # cu_seqlens_q
        else:
            offsets = [0]
            for n in new_lens:
                offsets.append(offsets[-1] + n)
            t = offsets[-1]
            for group in groups:
                packed.extend([slot for slot, n in zip(group, new_lens) for _ in range(n)])
            packed.extend([p for start, n in zip(starts, new_lens) for p in range(start, start + n)])
            packed.extend([o - 1 for o in offsets[1:]])
            for group in groups:
                packed.extend(group)
            packed.extend([s + n for s, n in zip(starts, new_lens)])
            packed.extend(offsets)
        packed = torch.frombuffer(packed, dtype=torch.long) if packed else torch.empty(0, dtype=torch.long)
        device = torch.device(device)
        packed = packed.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else packed.to(device)
        g = len(groups)
        slot_index = [packed[i * t:(i + 1) * t] for i in range(g)]
        at = g * t
        positions_t, last_index = packed[at:at + t], packed[at + t:at + t + b]
        ints = packed[at + t + b:].int()
        slot_vector = [ints[i * b:(i + 1) * b] for i in range(g)]
        at = g * b
        return ForwardBatch(groups, starts, new_lens, slot_index, positions_t, last_index, slot_vector,
                            ints[at:at + b], ints[at + b:], max(new_lens, default=0))

    def advanced(self, starts: list[int]) -> "ForwardBatch":
        """This decode batch one row further, its vectors advanced on the
        device: the same sequences in the same slots, each at `starts` = its
        start here + 1, which the caller vouches for (the engine knows it of
        a decode step that continues the one before, whose tokens it feeds)."""
        return ForwardBatch(self.slots, starts, self.new_lens, self.slot_index, self.positions + 1,
                            self.last_index, self.slot_vector, self.seq_lens + 1, self.cu_seqlens_q, 1)

    @property
    def is_decode(self) -> bool:
        return self.new_lens.count(1) == len(self.new_lens)  # every sequence computes one token


def rope_inv_freq(config: ModelConfig, layer_type: str = FULL) -> torch.Tensor:
    """Inverse frequencies of `layer_type`'s layers: the config's base with
    its rope scaling (default, linear, llama3), or Gemma 3's local base."""
    dim = config.head_dim
    local = layer_type == SLIDING and config.rope_local_theta is not None
    theta = config.rope_local_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = {} if local else (config.rope_scaling or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = torch.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    elif kind not in ("default",):
        raise InvalidArgument(f"unsupported rope scaling type {kind!r}")
    return inv_freq.float()


class LlamaModel:
    """Weights and the forward pass. Not an nn.Module: inference only.

    With `consume_weights`, each tensor is popped from `weights` as it is
    converted, so the loaded copy is freed layer by layer instead of coexisting
    with the converted (fused, reordered) one until loading ends.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu", linear: str = "auto", consume_weights: bool = False,
                 max_positions: int | None = None):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        c = config
        self.q_size = c.num_attention_heads * c.head_dim

        take = weights.pop if consume_weights else weights.__getitem__

        def w(name: str) -> torch.Tensor:
            # Dense: the fused decode kernels (kernels/triton_linear.py) read a
            # weight's rows and a norm's values so, where F.linear takes any strides.
            return take(name).to(device=self.device, dtype=dtype).contiguous()

        def gemma_norm(name: str) -> torch.Tensor:
            # Gemma weighs by (1 + w), in float32 from the weight in the model's dtype.
            return 1.0 + w(name).float()

        # The fused CPU layer ops where they apply (None: torch ops). Imported
        # here, as attention.py imports its kernels: only a CPU model loads the
        # compiled extension. Gemma's norms round differently: torch ops.
        self.layer_ops = None
        if self.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and not c.gemma_norms:
            from flexinfer.kernels import cpu_layer_ops

            self.layer_ops = cpu_layer_ops
        elif self.device.type == "cuda" and not c.gemma_norms and triton_available():
            from flexinfer.kernels import triton_layer_ops

            self.layer_ops = triton_layer_ops
        # Where the residual add is made: on CUDA by the norm that follows it
        # (triton_layer_ops.add_rms_norm, one kernel for both); on CPU by the
        # projection that produces it (oneDNN adds it as the matmul writes).
        self.norm_adds_residual = self.layer_ops is not None and hasattr(self.layer_ops, "add_rms_norm")
        # On CUDA, decode steps of few rows may run each layer as four Triton
        # kernels around attention (kernels/triton_linear.py): per row bucket
        # up to its MAX_ROWS, "triton" where they do. `linear="triton"` picks
        # them, "auto" times them against cuBLAS and the separate ops; the
        # projections' own kernel stays F.linear.
        self.triton_linear = None
        self.fused_kinds: dict[int, str] = {}
        if self.device.type == "cuda":
            self.fused_kinds = self._choose_fused_kinds(linear, weights)
            linear = "torch"
        # "auto" on CPU: time the kernels on this model's first layer (see
        # linear.py); `packed` wins ties where it lets the layers run in one
        # C++ call.
        self.linear_kind = resolve_linear_kind(linear, self.device, dtype)
        if self.linear_kind == "auto":
            p = "model.layers.0."
            sample = [torch.cat([weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
                      weights[p + "self_attn.o_proj.weight"],
                      torch.cat([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]]),
                      weights[p + "mlp.down_proj.weight"]]
            self.linear_kind = measure_kinds([t.to(dtype=dtype).contiguous() for t in sample],
                                             prefer="packed" if self._plain_llama else None)

        def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
            return Linear(weight, bias, self.linear_kind)

        self.embed = w("model.embed_tokens.weight")
        # Gemma scales the embeddings by sqrt(hidden_size) rounded to the model's dtype.
        self.embed_scale = (torch.tensor(c.hidden_size ** 0.5, dtype=dtype, device=self.device)
                            if c.scale_embeddings else None)
        norm = gemma_norm if c.gemma_norms else w
        self.layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([w(p + "self_attn.q_proj.weight"), w(p + "self_attn.k_proj.weight"),
                             w(p + "self_attn.v_proj.weight")]).contiguous()
            qkv_bias = None
            if c.attention_bias:
                qkv_bias = torch.cat([w(p + "self_attn.q_proj.bias"), w(p + "self_attn.k_proj.bias"),
                                      w(p + "self_attn.v_proj.bias")]).contiguous()
            layer = dict(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=linear(qkv, qkv_bias),
                o=linear(w(p + "self_attn.o_proj.weight")),
                # Llama's norm before the MLP; Gemma's after attention.
                post_norm=norm(p + "post_attention_layernorm.weight"),
                gate_up=linear(torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])),
                down=linear(w(p + "mlp.down_proj.weight")),
            )
            if c.qk_norm:
                layer.update(q_norm=norm(p + "self_attn.q_norm.weight"), k_norm=norm(p + "self_attn.k_norm.weight"))
            if c.gemma_norms:
                layer.update(pre_mlp_norm=norm(p + "pre_feedforward_layernorm.weight"),
                             post_mlp_norm=norm(p + "post_feedforward_layernorm.weight"))
            self.layers.append(layer)
        self.norm = norm("model.norm.weight")
        self.lm_head = linear(self.embed if c.tie_word_embeddings else w("lm_head.weight"))
        # Layer types: one RoPE table for each that has its own (Gemma 3's local base).
        self.layer_types = [c.layer_type(i) for i in range(c.num_hidden_layers)]
        # Each type's cos and sin of every position a pass may hold (the
        # engine's max_model_len; by default the model's own limit), made once:
        # a pass then gathers its rows (two kernels a type, where computing
        # them took nine), and a token's values do not depend on its batch.
        # They hold 2 x positions x head_dim values a type: SmolLM2 at 8K in
        # bfloat16 2 MiB, Llama 3.1 at 128K in float32 128 MiB (a smaller
        # max_model_len makes them smaller).
        positions = max_positions or c.max_position_embeddings
        self.rope_tables = {t: self._rope_table(positions, rope_inv_freq(c, t).to(self.device))
                            for t in dict.fromkeys(self.layer_types)}
        # Each layer's attention: its scale, window and soft cap.
        self.attention_args = [dict(scale=c.attention_scale, window=c.window(i),
                                    softcap=c.attn_logit_softcapping or 0.0) for i in range(c.num_hidden_layers)]
        # Where the projections run the packed kernel, all layers of a pass
        # in one C++ call (kernels/cpu_decoder.py); None: the loop below.
        self.decoder = None
        if self.layer_ops is not None and self._plain_llama and "packed" in self.layers[0]["qkv"].weights:
            from flexinfer.kernels.cpu_decoder import CpuDecoder

            self.decoder = CpuDecoder(self)

    @property
    def _fusable(self) -> bool:
        """Whether the layers are what the fused decode kernels compute: a
        Llama block on the Triton layer ops (a QKV bias allowed)."""
        c = self.config
        return self.norm_adds_residual and not c.qk_norm and not c.gemma_norms and c.hidden_act == "silu"

    def _choose_fused_kinds(self, linear: str, weights: dict[str, torch.Tensor]) -> dict[int, str]:
        """The row buckets whose decode steps run the fused kernels (see __init__)."""
        if linear not in ("auto", "triton"):
            return {}
        if not self._fusable:
            if linear == "triton":
                raise InvalidArgument("linear='triton' runs Llama-shaped layers on the Triton layer ops (no q/k "
                                      "norms, no Gemma norms, SiLU); this model's are not")
            return {}
        from flexinfer.kernels import triton_linear

        self.triton_linear = triton_linear
        buckets = [b for b in ROW_BUCKETS if b <= triton_linear.MAX_ROWS]
        if linear == "triton":
            return {b: "triton" for b in buckets}
        return measure_fused_layer(self, weights, buckets)

    @property
    def _plain_llama(self) -> bool:
        """Whether every layer is a Llama block, which the one-call decoder runs."""
        c = self.config
        return (self.layer_ops is not None and not c.qk_norm and not c.gemma_norms and c.hidden_act == "silu"
                and not c.layer_types and c.attn_logit_softcapping is None and c.query_pre_attn_scalar is None
                and c.final_logit_softcapping is None and not c.scale_embeddings)

    def _rope_values(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, head_dim] of each position, in float32 rounded to
        the model's dtype as transformers rounds them; sin's first half negated."""
        freqs = positions.float()[:, None] * inv_freq[None, :]
        half_cos, half_sin = freqs.cos(), freqs.sin()
        cos = torch.cat([half_cos, half_cos], dim=-1)
        sin = torch.cat([-half_sin, half_sin], dim=-1)
        return cos.to(self.dtype), sin.to(self.dtype)

    def _rope_table(self, positions: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`_rope_values` of positions 0 .. positions - 1, made 64K positions
        at a time: their float32 intermediates are several times the table."""
        size = (positions, self.config.head_dim)
        cos = torch.empty(size, dtype=self.dtype, device=self.device)
        sin = torch.empty(size, dtype=self.dtype, device=self.device)
        for start in range(0, positions, 1 << 16):
            end = min(positions, start + (1 << 16))
            cos[start:end], sin[start:end] = self._rope_values(torch.arange(start, end, device=self.device), inv_freq)
        return cos, sin

    def _rope(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer type, cos and sin [T, head_dim] of each token's position
        (`_rope_values`, gathered from the tables)."""
        return {t: (cos.index_select(0, positions), sin.index_select(0, positions))
                for t, (cos, sin) in self.rope_tables.items()}

    @staticmethod
    def _rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotary embedding in place: x*cos + rotate_half(x)*sin, where
        rotate_half(x) = [-x2, x1] is [x2, x1] times the signs `_rope` folded into sin."""
        half = x.shape[-1] // 2
        swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
        # Rounded as transformers' x*cos + rotate_half(x)*sin (addcmul_ would fuse and round differently).
        x.mul_(cos).add_(swapped.mul_(sin))

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.config.gemma_norms:
            return self._rounded_norm(x, weight)
        if self.layer_ops is not None:
            return self.layer_ops.rms_norm(x, weight, self.config.rms_norm_eps)
        return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)

    def _rounded_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over x's last dimension (any strides: the q/k norms take a
        slice of qkv) in torch ops, rounded as transformers rounds it: Llama's
        normalises in float32, rounds, then weighs; Gemma's weighs in float32
        (weight holds 1 + w) and rounds once."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        if self.config.gemma_norms:
            return (normed * weight).to(x.dtype)
        return weight * normed.to(x.dtype)

    def _gated_mlp_activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up of gate_up [T, 2I] = [gate | up]: SwiGLU or GeGLU."""
        if self.config.hidden_act == "gelu_pytorch_tanh":
            gate, up = gate_up.chunk(2, dim=-1)
            return F.gelu(gate, approximate="tanh") * up
        if self.layer_ops is not None:
            return self.layer_ops.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _rotary_kv_write(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch,
                         kv_cache) -> None:
        """Rotates q and k of qkv [T, q heads | k heads | v heads, head_dim] in
        place with `_rope`'s tables, then stores K and V (one adjacent block) in
        the layer's cache."""
        heads, kv_heads = self.config.num_attention_heads, self.config.num_key_value_heads
        if self.layer_ops is not None:
            self.layer_ops.rotary_kv_write(qkv, heads, cos, sin, kv_cache.kv[layer], kv_cache.slot_index(layer, batch),
                                           batch.positions)
            return
        self._rotate_(qkv[:, : heads + kv_heads], cos[:, None], sin[:, None])
        kv_cache.write(layer, batch, qkv[:, heads:].view(qkv.shape[0], 2, kv_heads, qkv.shape[2]))

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv_cache, attention) -> torch.Tensor:
        """Logits [B, vocab] for the last new token of each sequence (float32)."""
        if self._runs_whole_pass(input_ids, batch, attention):
            # One C++ call makes no tensor but its output: no inference mode
            # to enter (~2 µs of a one-token pass's ~20).
            return self.decoder.forward(input_ids, batch, kv_cache)
        return self._forward(input_ids, batch, kv_cache, attention)

    @torch.inference_mode()
    def _forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv_cache, attention) -> torch.Tensor:
        c = self.config
        t = input_ids.shape[0]
        hidden = F.embedding(input_ids, self.embed)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        rope = self._rope(batch.positions)
        if self._runs_decoder(t, attention):
            self.decoder.run(hidden, *rope[FULL], batch, kv_cache)
            return self._logits(hidden, batch)
        attention.prepare(batch, kv_cache)
        if self.fused_kinds.get(bucket_of(t)) == "triton":  # its buckets hold up to MAX_ROWS rows
            return self._logits(self._fused_layers(hidden, rope, batch, kv_cache, attention), batch)
        heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
        delta = None  # the MLP's output, still to be added to hidden (norm_adds_residual)
        for i, layer in enumerate(self.layers):
            if delta is None:
                x = self._rms_norm(hidden, layer["input_norm"])
            else:
                x, hidden = self.layer_ops.add_rms_norm(delta, hidden, layer["input_norm"], c.rms_norm_eps)
            qkv = layer["qkv"](x).view(t, heads + 2 * kv_heads, c.head_dim)
            if c.qk_norm:
                qkv[:, :heads] = self._rounded_norm(qkv[:, :heads], layer["q_norm"])
                qkv[:, heads:heads + kv_heads] = self._rounded_norm(qkv[:, heads:heads + kv_heads], layer["k_norm"])
            self._rotary_kv_write(i, qkv, *rope[self.layer_types[i]], batch, kv_cache)
            attn = attention.forward(i, qkv[:, :heads], batch, kv_cache, **self.attention_args[i])
            if c.gemma_norms:
                hidden = hidden + self._rms_norm(layer["o"](attn.reshape(t, self.q_size)), layer["post_norm"])
                x = self._rms_norm(hidden, layer["pre_mlp_norm"])
                mlp = layer["down"](self._gated_mlp_activation(layer["gate_up"](x)))
                hidden = hidden + self._rms_norm(mlp, layer["post_mlp_norm"])
                continue
            if self.norm_adds_residual:
                x, hidden = self.layer_ops.add_rms_norm(layer["o"](attn.reshape(t, self.q_size)), hidden,
                                                        layer["post_norm"], c.rms_norm_eps)
                delta = layer["down"](self._gated_mlp_activation(layer["gate_up"](x)))
                continue
            hidden = layer["o"](attn.reshape(t, self.q_size), residual=hidden)
            x = self._rms_norm(hidden, layer["post_norm"])
            hidden = layer["down"](self._gated_mlp_activation(layer["gate_up"](x)), residual=hidden)
        return self._logits(hidden, batch, delta)

    def _fused_layers(self, hidden: torch.Tensor, rope, batch: ForwardBatch, kv_cache, attention) -> torch.Tensor:
        """Every layer as four Triton kernels around attention
        (kernels/triton_linear.py), the residual added by the o and down
        projections: the hidden rows after the last layer."""
        c, ops = self.config, self.triton_linear
        t, heads, eps = hidden.shape[0], c.num_attention_heads, c.rms_norm_eps
        for i, layer in enumerate(self.layers):
            proj = layer["qkv"]
            qkv = ops.norm_qkv_rotary_kv_write(hidden, layer["input_norm"], eps, proj.weights["torch"], proj.bias,
                                               heads, *rope[self.layer_types[i]], kv_cache.kv[i],
                                               kv_cache.slot_index(i, batch), batch.positions)
            attn = attention.forward(i, qkv[:, :heads], batch, kv_cache, **self.attention_args[i])
            hidden = ops.linear(attn.reshape(t, self.q_size), layer["o"].weights["torch"], residual=hidden)
            act = ops.norm_gate_up_silu(hidden, layer["post_norm"], eps, layer["gate_up"].weights["torch"])
            hidden = ops.linear(act, layer["down"].weights["torch"], residual=hidden)
        return hidden

    def _runs_decoder(self, tokens: int, attention) -> bool:
        """Whether this pass runs as one C++ call: the projections' kernel for
        its row count is `packed` and attention the batched CPU kernel (the
        decoder calls both itself)."""
        return (self.decoder is not None and attention.name == "kernel"
                and self.layers[0]["qkv"].kind_for(tokens) == "packed")

    def _runs_whole_pass(self, input_ids: torch.Tensor, batch: ForwardBatch, attention) -> bool:
        """Whether this pass runs whole as one C++ call, ids in, logits out:
        its layers do (_runs_decoder) and so does the LM head at the batch's
        row count."""
        return (self.decoder is not None and self.decoder.runs_whole_pass and input_ids.dtype is torch.int64
                and self._runs_decoder(input_ids.shape[0], attention)
                and self.lm_head.kind_for(batch.last_index.shape[0]) == "packed")

    def _logits(self, hidden: torch.Tensor, batch: ForwardBatch, delta: torch.Tensor | None = None) -> torch.Tensor:
        """`delta`: the last layer's output, not yet added to `hidden` (norm_adds_residual)."""
        if batch.max_q_len != 1 or hidden.shape[0] != batch.last_index.shape[0]:
            hidden = hidden.index_select(0, batch.last_index)
            if delta is not None:
                delta = delta.index_select(0, batch.last_index)
        # Else every sequence has one token, its own row: nothing to gather (decode steps).
        if delta is None:
            last = self._rms_norm(hidden, self.norm)
        else:
            last = self.layer_ops.add_rms_norm(delta, hidden, self.norm, self.config.rms_norm_eps)[0]
        logits = self.lm_head(last)
        cap = self.config.final_logit_softcapping
        if cap is not None:  # in the model's dtype, as transformers caps them
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
