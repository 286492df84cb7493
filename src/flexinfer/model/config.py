"""The shape and hyper-parameters of a Llama-family decoder.

Invariant: a ModelConfig describes a model the forward pass can run as is: every
architecture listed in SUPPORTED_ARCHITECTURES is a Llama block (RMSNorm, GQA
attention with RoPE, SwiGLU MLP) and differs from Llama only in what the fields
below say (q/k/v biases, tied embeddings, rope parameters). Anything else (a
sliding window that matters, partial rotary, another activation) is refused when
the config is built, never silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from flexinfer.errors import ModelLoadError

# Hugging Face `model_type` values whose checkpoints are plain Llama blocks.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
# rope_scaling kinds the forward pass implements; "default" is stored as None.
SUPPORTED_ROPE_TYPES = ("linear", "llama3")
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

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelLoadError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                                 f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type")
            if kind not in SUPPORTED_ROPE_TYPES:
                raise ModelLoadError(f"unsupported rope scaling type {kind!r} "
                                     f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
            missing = [k for k in _REQUIRED_ROPE_KEYS[kind] if k not in self.rope_scaling]
            if missing:
                raise ModelLoadError(f"rope scaling {kind!r} lacks {', '.join(missing)}")

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json (llama, mistral, qwen2 and SmolLM2, which is llama).

        Accepts both the transformers 4 layout (`rope_theta` + `rope_scaling`) and the
        transformers 5 one (`rope_parameters` holding both)."""
        architecture = d.get("model_type")
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {architecture!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
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
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"config has a malformed value: {exc}") from None

        activation = d.get("hidden_act", "silu")
        if activation != "silu":
            raise ModelLoadError(f"unsupported hidden_act {activation!r} (only silu)")
        if d.get("mlp_bias"):
            raise ModelLoadError("unsupported mlp_bias=true")
        if d.get("use_sliding_window"):
            raise ModelLoadError("unsupported use_sliding_window=true")
        window = d.get("sliding_window") if architecture == "mistral" else None
        if window is not None and window < max_positions:
            # Within the window sliding-window attention equals full attention, so the
            # model stays exact if sequences never grow past it.
            max_positions = int(window)

        rope_theta, rope_scaling = _hf_rope(d)
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
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=token_id_tuple(d.get("eos_token_id")),
        )

    def kv_row_bytes(self, dtype_bytes: int, layers: int | None = None) -> int:
        """Bytes of K and V for one token across `layers` layers (all layers by default)."""
        layers = self.num_hidden_layers if layers is None else layers
        return layers * 2 * self.num_key_value_heads * self.head_dim * dtype_bytes


def token_id_tuple(value: int | list[int] | tuple[int, ...] | None) -> tuple[int, ...]:
    """Normalise Hugging Face's `eos_token_id` (absent, an int or a list) to a tuple."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _hf_rope(d: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = dict(d.get("rope_parameters") or {})
    params.update(d.get("rope_scaling") or {})
    rope_theta = float(d.get("rope_theta", params.get("rope_theta", 10000.0)))
    # Older configs name the kind "type"; normalise to "rope_type".
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return rope_theta, None
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type", "rope_type")}
    scaling["rope_type"] = kind
    return rope_theta, scaling
