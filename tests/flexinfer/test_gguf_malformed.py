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
from flexinfer.tokenizer import Tokenizer  # noqa: E402
from gguf_testing import byte_level_metadata, write_tiny_llama  # noqa: E402


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


# ----------------------------------------------------------------------------- tokenizer metadata

def _byte_level(**changes):
    metadata = {**byte_level_metadata("smollm", ["ĠĠ"], ["Ġ Ġ"]), "tokenizer.ggml.eos_token_id": 256}
    return {**metadata, **{f"tokenizer.ggml.{k}": v for k, v in changes.items()}}


def _sentencepiece(**changes):
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "▁", "a", "▁a"],
                "tokenizer.ggml.scores": [0.0, -1.0, -2.0, -3.0], "tokenizer.ggml.token_type": [2, 1, 1, 1],
                "tokenizer.ggml.unknown_token_id": 0}
    return {**metadata, **{f"tokenizer.ggml.{k}": v for k, v in changes.items()}}


@pytest.mark.parametrize("metadata, message", [
    (_byte_level(bos_token_id=10**6, add_bos_token=True), "bos_token_id is 1000000, not one of the 257"),  # IndexError
    (_byte_level(bos_token_id=-1, add_bos_token=True), "bos_token_id is -1, not one"),  # silently the last token
    (_byte_level(eos_token_id=10**6), "eos_token_id is 1000000, not one"),  # the model would never stop
    (_byte_level(eot_token_id=True), "eot_token_id is True, not one"),
    (_sentencepiece(unknown_token_id=4), "unknown_token_id is 4, not one of the 4"),  # IndexError
    (_byte_level(merges=[1, 2]), r"tokenizer.ggml.merges\[0\] is 1, not of the array's type"),  # AttributeError
    (_byte_level(merges=["zz qq"]), "merges entry 'zz qq' is not two tokens of the vocabulary"),  # bare Exception
    # A Rust panic (pyo3_runtime.PanicException, a BaseException):
    (_byte_level(merges=["Ġ Ġ"], tokens=byte_level_metadata("smollm", [], [])["tokenizer.ggml.tokens"],
                 token_type=[1] * 256, eos_token_id=255), "merges entry 'Ġ Ġ' is not two tokens of the vocabulary"),
    (_byte_level(tokens=[[t] for t in _byte_level()["tokenizer.ggml.tokens"]]),
     r"tokenizer.ggml.tokens\[0\] is \['Ā'\], not of the array's type"),  # TypeError
    (_byte_level(tokens="abc"), "tokenizer.ggml.tokens must be an array, got 'abc'"),
    (_byte_level(token_type=["1"] * 257), r"token_type\[0\] is '1', not of the array's type"),
    (_sentencepiece(scores=["x"] * 4), r"tokenizer.ggml.scores\[0\] is 'x', not of the array's type"),  # TypeError
])
def test_tokenizer_metadata_is_checked(metadata, message):
    with pytest.raises(ModelLoadError, match=f"t.gguf: .*{message}"):
        Tokenizer.from_gguf_metadata(metadata, "t.gguf")


def test_a_panic_of_the_tokenizers_library_is_a_load_error(monkeypatch):
    """Whatever the checks miss and makes the Rust library panic is still the
    file's fault: a ModelLoadError, not a BaseException past every handler."""
    from flexinfer import tokenizer

    PanicException = type("PanicException", (BaseException,), {})  # pyo3_runtime's is not importable

    def panics(*args, **kwargs):
        raise PanicException("range end index 4 out of range for slice of length 2")

    monkeypatch.setattr(tokenizer.models, "BPE", panics)
    with pytest.raises(ModelLoadError, match="t.gguf: malformed tokenizer: range end index 4"):
        Tokenizer.from_gguf_metadata(_byte_level(), "t.gguf")
