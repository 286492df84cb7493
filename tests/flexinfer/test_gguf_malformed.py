"""Malformed GGUF files: each fails fast with a ModelLoadError that names the
offending key or tensor, never with another exception, a hang, memory without
bound, or a model that loads wrong. The cases come from fuzzing the loader;
each file is the tiny valid Llama of gguf_testing.py with one thing changed."""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from flexinfer.errors import ModelLoadError  # noqa: E402
from flexinfer.model.config import ModelConfig  # noqa: E402
from flexinfer.model.loader import load_config, load_model, load_tokenizer  # noqa: E402
from gguf_testing import write_tiny_llama  # noqa: E402


def _every_loader(path, match: str) -> None:
    """load_config, load_tokenizer and load_model each refuse the file."""
    for load in (load_config, load_tokenizer, lambda p: load_model(p, torch.float32)):
        with pytest.raises(ModelLoadError, match=match):
            load(str(path))


def test_the_tiny_file_loads(tmp_path):
    loaded = load_model(str(write_tiny_llama(tmp_path / "tiny.gguf")), torch.float32)
    assert loaded.config.num_hidden_layers == 2 and loaded.tokenizer.eos_token_ids == (256,)


# ----------------------------------------------------------------------------- hyper-parameters

_HF_BASE = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 512}


@pytest.mark.parametrize("extra, message", [
    ({"rope_theta": float("inf")}, "rope_theta must be a positive finite number, got inf"),  # no position information
    ({"rope_theta": 0.0}, "rope_theta must be a positive finite number, got 0.0"),
    ({"rope_theta": -1.0}, "rope_theta must be a positive finite number, got -1.0"),
    ({"rope_theta": float("nan")}, "rope_theta must be a positive finite number, got nan"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0.0}}, "rope scaling factor must be a positive finite"),
    ({"rope_scaling": {"rope_type": "linear", "factor": float("nan")}}, "rope scaling factor must be a positive"),
    ({"rms_norm_eps": -1e-6}, r"rms_norm_eps must be a finite number >= 0, got -1e-06"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number >= 0, got nan"),
    ({"rms_norm_eps": float("inf")}, "rms_norm_eps must be a finite number >= 0, got inf"),
])
def test_rope_and_norm_floats_must_be_finite(extra, message):
    """They loaded, and the model computed nothing sensible (or NaN)."""
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf_dict({**_HF_BASE, **extra})
    assert ModelConfig.from_hf_dict({**_HF_BASE, "rms_norm_eps": 0.0}).rms_norm_eps == 0.0


def test_a_gguf_rope_base_must_be_finite(tmp_path):
    path = write_tiny_llama(tmp_path / "rope.gguf", {"llama.rope.freq_base": float("inf")})
    _every_loader(path, f"{path}: rope_theta must be a positive finite number, got inf")
