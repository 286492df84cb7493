"""The shape and hyper-parameters of a decoder-only transformer.

Invariant: a ModelConfig describes a model the forward pass can run as is: every
architecture listed in SUPPORTED_ARCHITECTURES is a pre-norm decoder block
(RMSNorm, GQA attention with RoPE, a gated MLP) and differs from Llama only in
what the fields below say: q/k/v biases, q/k norms (Qwen3, Gemma 3), Gemma's
(1 + w) norms around attention and the MLP, the MLP's activation, scaled
embeddings, soft-capped attention and final logits, an attention scale, and
per-layer types (full or sliding-window attention, each with its own RoPE).
Anything else a config asks for (partial rotary, an unknown rope scaling, a
multimodal tower) is refused when the config is built, never silently ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from flexinfer.errors import ModelLoadError

# Hugging Face `model_type` values the forward pass runs.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
# Layer types (Hugging Face's `layer_types` values).
FULL, SLIDING = "full_attention", "sliding_attention"
# MLP activations: SwiGLU's and GeGLU's (tanh-approximated GELU).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_GEMMA = ("gemma2", "gemma3_text")
# rope_scaling kinds the forward pass implements; "default" is stored as None.
SUPPORTED_ROPE_TYPES = ("linear", "llama3")
# Per-layer lists are sized by a config's layer count before any weight is
# read, so a count past this is refused as malformed (the deepest model we
# know, Llama 3.1 405B, has 126 layers). A GGUF file's count must also match
# the layers its tensors hold (loader.py).
MAX_LAYERS = 1024
# The longest context a model may declare. RoPE tables are sized by it before
# any weight is read (the engine's max_model_len is the model's unless a
# smaller one is asked for), and positions are rotated in float32, which holds
# every integer only up to 2**24. The longest context any released model
# declares, Llama 4 Scout's 10M tokens, is below it.
MAX_POSITIONS = 2**24
# Every size a config gives lies in 1..its bound here, so that a malformed
# config.json or GGUF header is one clear error rather than an allocation
# sized by it (RoPE tables, the KV cache plan) or arithmetic far past any
# real model's. Each bound is at least four times the largest we know of:
# Gemma 3's 262144-token vocabulary, Llama 3.1 405B's hidden size 16384 and
# 128 heads, Nemotron-4 340B's intermediate size 73728, Gemma's head_dim 256.
MAX_SIZES = {
    "vocab_size": 2**21, "hidden_size": 2**16, "intermediate_size": 2**18, "num_hidden_layers": MAX_LAYERS,
    "num_attention_heads": 2**10, "num_key_value_heads": 2**10, "head_dim": 2**10,
    "max_position_embeddings": MAX_POSITIONS,
}
_REQUIRED_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # Hugging Face's format: {"rope_type": "linear" | "llama3", "factor": ..., ...}; None = plain RoPE.
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Per layer, FULL or SLIDING; () means every layer is FULL.
    layer_types: tuple[str, ...] = ()
    # How many keys a sliding layer's query attends to, itself included
    # (keys at positions p - sliding_window + 1 .. p); None without sliding layers.
    sliding_window: int | None = None
    qk_norm: bool = False  # an RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    # Gemma's norms: they weigh by (1 + w) in float32 and round once, and four of
    # them sandwich attention and the MLP (pre- and post-norm around each).
    gemma_norms: bool = False
    hidden_act: str = "silu"  # the gated MLP's activation (ACTIVATIONS)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # the same on the logits
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (default: head_dim's)
    rope_local_theta: float | None = None  # sliding layers' RoPE base, without scaling (Gemma 3)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        for name, bound in MAX_SIZES.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= bound:
                raise ModelLoadError(f"{name} must be an integer in 1..{bound}, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                                 f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ModelLoadError(f"layer_types lists {len(self.layer_types)} layers, "
                                     f"num_hidden_layers is {self.num_hidden_layers}")
            unknown = sorted(set(self.layer_types) - {FULL, SLIDING})
            if unknown:
                raise ModelLoadError(f"unsupported layer type(s) {', '.join(map(repr, unknown))} "
                                     f"(supported: {FULL}, {SLIDING})")
        if SLIDING in self.layer_types and not (isinstance(self.sliding_window, int) and self.sliding_window > 0):
            raise ModelLoadError(f"sliding layers need a positive sliding_window, got {self.sliding_window!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"unsupported hidden_act {self.hidden_act!r} (supported: {', '.join(ACTIVATIONS)})")
        for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
                     "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ModelLoadError(f"{name} must be a positive number or absent, got {value!r}")
        # An infinite base rotates nothing (no position information), a zero or
        # negative one (or factor) rotates by NaN; a NaN or negative epsilon
        # turns every norm's output into NaN.
        if not _positive_finite(self.rope_theta):
            raise ModelLoadError(f"rope_theta must be a positive finite number, got {self.rope_theta!r}")
        if not (_is_number(self.rms_norm_eps) and 0 <= self.rms_norm_eps < math.inf):
            raise ModelLoadError(f"rms_norm_eps must be a finite number >= 0, got {self.rms_norm_eps!r}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type")
            if kind not in SUPPORTED_ROPE_TYPES:
                raise ModelLoadError(f"unsupported rope scaling type {kind!r} "
                                     f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
            missing = [k for k in _REQUIRED_ROPE_KEYS[kind] if k not in self.rope_scaling]
            if missing:
                raise ModelLoadError(f"rope scaling {kind!r} lacks {', '.join(missing)}")
            if not _positive_finite(self.rope_scaling["factor"]):
                raise ModelLoadError(f"rope scaling factor must be a positive finite number, "
                                     f"got {self.rope_scaling['factor']!r}")

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json (llama, mistral, qwen2 and SmolLM2, which is llama).

        Accepts both the transformers 4 layout (`rope_theta` + `rope_scaling`) and the
        transformers 5 one (`rope_parameters` holding both)."""
        architecture = d.get("model_type")
        if architecture not in SUPPORTED_ARCHITECTURES:
            hint = (" (a multimodal checkpoint: FlexInfer runs Gemma 3's text model, model_type gemma3_text)"
                    if architecture == "gemma3" else "")
            raise ModelLoadError(f"unsupported architecture {architecture!r}{hint} "
                                 f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        try:
            hidden_size = int(d["hidden_size"])
            num_heads = int(d["num_attention_heads"])
            num_kv_heads = int(d.get("num_key_value_heads") or num_heads)
            head_dim = int(d.get("head_dim") or hidden_size // num_heads)
            max_positions = int(d["max_position_embeddings"])
            vocab_size = int(d["vocab_size"])
            intermediate_size = int(d["intermediate_size"])
            num_layers = int(d["num_hidden_layers"])
            rms_norm_eps = float(d.get("rms_norm_eps", 1e-6))
        except KeyError as exc:
            raise ModelLoadError(f"config lacks required key {exc.args[0]!r}") from None
        except (TypeError, ValueError, ArithmeticError) as exc:  # ArithmeticError: int(Infinity)
            raise ModelLoadError(f"config has a malformed value: {exc}") from None

        if not 0 < num_layers <= MAX_LAYERS:
            raise ModelLoadError(f"num_hidden_layers must be in 1..{MAX_LAYERS}, got {num_layers}")
        if d.get("mlp_bias"):
            raise ModelLoadError("unsupported mlp_bias=true")
        if d.get("use_bidirectional_attention"):
            raise ModelLoadError("unsupported use_bidirectional_attention=true (an encoder, not a decoder)")
        gemma = architecture in _GEMMA
        activation = d.get("hidden_activation") or d.get("hidden_act") or "silu"
        layer_types, window = _hf_layer_types(d, architecture, num_layers, max_positions)
        rope_theta, rope_scaling, rope_local_theta = _hf_rope(d, architecture)
        # Qwen2 always has q/k/v biases and its config does not say so.
        attention_bias = True if architecture == "qwen2" else bool(d.get("attention_bias", False))
        return cls(
            architecture=architecture,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            # Gemma's configs leave it out: their embeddings are tied.
            tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
            attention_bias=attention_bias,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=token_id_tuple(d.get("eos_token_id")),
            layer_types=layer_types,
            sliding_window=window,
            qk_norm=architecture in ("qwen3", "gemma3_text"),
            gemma_norms=gemma,
            hidden_act=activation,
            scale_embeddings=gemma,
            attn_logit_softcapping=absent_or_float(d.get("attn_logit_softcapping")) if gemma else None,
            final_logit_softcapping=absent_or_float(d.get("final_logit_softcapping")) if gemma else None,
            query_pre_attn_scalar=absent_or_float(d.get("query_pre_attn_scalar")) if gemma else None,
            rope_local_theta=rope_local_theta,
        )

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else FULL

    def window(self, layer: int) -> int:
        """The keys `layer`'s queries attend to, 0 for all of them."""
        return self.sliding_window if self.layer_type(layer) == SLIDING else 0

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def kv_row_bytes(self, dtype_bytes: int, layers: int | None = None) -> int:
        """Bytes of K and V for one token across `layers` layers (all layers by default)."""
        layers = self.num_hidden_layers if layers is None else layers
        return layers * 2 * self.num_key_value_heads * self.head_dim * dtype_bytes


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive_finite(value: Any) -> bool:
    return _is_number(value) and 0 < value < math.inf  # False for NaN too


def token_id_tuple(value: int | list[int] | tuple[int, ...] | None) -> tuple[int, ...]:
    """Normalise Hugging Face's `eos_token_id` (absent, an int or a list) to a tuple."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def absent_or_float(value: Any) -> float | None:
    """A cap or scale a config may leave out: None, or 0, which llama.cpp's
    files write for "none", is absent (ModelConfig checks the rest)."""
    return float(value) if value else None


def _hf_layer_types(d: Mapping[str, Any], architecture: str, num_layers: int,
                    max_positions: int) -> tuple[tuple[str, ...], int | None]:
    """Each layer's type and the sliding window, as transformers derives them:
    from `layer_types` where the config lists them (transformers 5 writes
    them), else from each architecture's own rule. A window that holds every
    position the model can see makes a layer full: they compute the same."""
    window = d.get("sliding_window")
    if architecture in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
        window = None  # their configs carry a window they do not use unless told
    listed = d.get("layer_types")
    if listed is not None:
        types = tuple(listed)
    elif window is None:
        types = (FULL,) * num_layers
    elif architecture in ("mistral", "phi3"):
        types = (SLIDING,) * num_layers
    elif architecture in ("qwen2", "qwen3"):
        first = int(d.get("max_window_layers", num_layers))
        types = tuple(SLIDING if i >= first else FULL for i in range(num_layers))
    elif architecture == "gemma2":
        types = tuple(SLIDING if i % 2 == 0 else FULL for i in range(num_layers))
    else:  # gemma3_text: every `pattern`-th layer is full
        pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
        types = tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
    if SLIDING in types and window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise ModelLoadError(f"sliding_window must be a positive integer, got {window!r}")
        if window >= max_positions:
            types = tuple(FULL if t == SLIDING else t for t in types)
    if len(types) == num_layers and set(types) <= {FULL}:
        return (), None
    return types, window  # checked by ModelConfig


def _hf_rope(d: Mapping[str, Any], architecture: str) -> tuple[float, dict[str, Any] | None, float | None]:
    """(rope_theta, rope_scaling, the sliding layers' own theta or None).

    transformers 4 writes `rope_theta` + `rope_scaling` (+ Gemma 3's
    `rope_local_base_freq`); transformers 5 writes `rope_parameters`, keyed by
    layer type where the types differ (Gemma 3)."""
    params = dict(d.get("rope_parameters") or {})
    local_theta = None
    if FULL in params or SLIDING in params:
        local = dict(params.get(SLIDING) or {})
        params = dict(params.get(FULL) or {})
        if local:
            if local.get("rope_type", local.get("type", "default")) != "default":
                raise ModelLoadError(f"unsupported rope scaling on sliding layers: {local!r}")
            local_theta = float(local.get("rope_theta", 10000.0))
    elif architecture == "gemma3_text":
        local_theta = float(d.get("rope_local_base_freq", 10000.0))
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ModelLoadError(f"unsupported partial rotary embedding (partial_rotary_factor={partial})")
    params.update(d.get("rope_scaling") or {})
    rope_theta = float(d.get("rope_theta", params.get("rope_theta", 10000.0)))
    # Older configs name the kind "type"; normalise to "rope_type".
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return rope_theta, None, local_theta
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type", "rope_type", "partial_rotary_factor")}
    scaling["rope_type"] = kind
    return rope_theta, scaling, local_theta
