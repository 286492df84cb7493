"""Malformed GGUF files: each fails fast with a ModelLoadError that names the
offending key or tensor, never with another exception, a hang, memory without
bound, or a model that loads wrong. The cases come from fuzzing the loader;
each file is the tiny valid Llama of gguf_testing.py with one thing changed."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from flexinfer.errors import ModelLoadError  # noqa: E402
from flexinfer.model.config import ModelConfig  # noqa: E402
from flexinfer.model.loader import load_config, load_model, load_tokenizer  # noqa: E402
from flexinfer.tokenizer import Tokenizer  # noqa: E402
from gguf_testing import (byte_level_metadata, set_tensor_offset, set_tensor_type, tiny_llama_tensors,  # noqa: E402
                          write_tiny_llama)

# GGUF value types, as the file stores them (gguf.GGUFValueType).
UINT8, UINT32, ARRAY = 0, 4, 9


def _every_loader(path, match: str, model_first: bool = False) -> None:
    """load_config, load_tokenizer and load_model each refuse the file (load_model
    first where its defect was its own, and the others' could hide it)."""
    loads = [load_config, load_tokenizer, lambda p: load_model(p, torch.float32)]
    for load in loads[-1:] + loads[:-1] if model_first else loads:
        with pytest.raises(ModelLoadError, match=match):
            load(str(path))


def _rewrite(path, old: bytes, new: bytes) -> None:
    data = path.read_bytes()
    assert data.count(old) == 1
    path.write_bytes(data.replace(old, new))


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def test_the_tiny_file_loads(tmp_path):
    loaded = load_model(str(write_tiny_llama(tmp_path / "tiny.gguf")), torch.float32)
    assert loaded.config.num_hidden_layers == 2 and loaded.tokenizer.eos_token_ids == (256,)


# ----------------------------------------------------------------------------- counts and structure

@pytest.mark.parametrize("window", [None, 16])
def test_block_count_must_count_the_layers_in_the_tensors(tmp_path, window):
    """Lists per layer were sized by the declared count before anything read
    it: 2**62 layers over two layers' tensors was a MemoryError (with a
    window) or a loop of 2**62 steps."""
    path = write_tiny_llama(tmp_path / "layers.gguf", {"llama.block_count": 2**62,
                                                       "llama.attention.sliding_window": window})
    _every_loader(path, f"{path}: llama.block_count is {2**62}, but the tensors hold 2 layers")


@pytest.mark.parametrize("count", [2**40, 2**63])
def test_an_array_count_past_the_end_of_the_file_is_refused_before_gguf_reads_it(tmp_path, monkeypatch, count):
    """np.frombuffer raised OverflowError at 2**63; gguf's reader, given the
    file unchecked, looped 2**40 times growing memory."""
    path = write_tiny_llama(tmp_path / "count.gguf", {"test.array": [1, 2, 3]})
    _rewrite(path, _key("test.array") + struct.pack("<IIQ", ARRAY, UINT32, 3),
             _key("test.array") + struct.pack("<IIQ", ARRAY, UINT32, count))

    def reader_of_unchecked_files(*args, **kwargs):
        raise AssertionError("gguf's reader was given a file the loader had not checked")

    monkeypatch.setattr(gguf, "GGUFReader", reader_of_unchecked_files)
    _every_loader(path, f"{path}: .*test.array: an array of {count} items runs past the end of the file",
                  model_first=True)


def test_arrays_nested_50000_deep_are_refused(tmp_path):
    """The header parser recursed once per level: a RecursionError."""
    path = write_tiny_llama(tmp_path / "nested.gguf", {"test.nested": b"x"})
    nested = struct.pack("<IQ", ARRAY, 1) * 50_000 + struct.pack("<IQ", UINT8, 0)
    _rewrite(path, _key("test.nested") + struct.pack("<I", 8) + _key("x"),
             _key("test.nested") + struct.pack("<I", ARRAY) + nested)
    _every_loader(path, f"{path}: .*test.nested: arrays nested more than 8 deep")


def test_keys_appear_once_and_the_alignment_is_a_power_of_two(tmp_path):
    """gguf's reader refused these and the header parser did not, so a
    config or tokenizer loaded from a file whose weights could not."""
    path = write_tiny_llama(tmp_path / "twice.gguf", {"test.first": 1, "test.other": 1})
    _rewrite(path, _key("test.other"), _key("test.first"))
    _every_loader(path, f"{path}: .*metadata key test.first appears twice")
    for alignment in (0, 48):
        path = write_tiny_llama(tmp_path / f"align{alignment}.gguf", {"general.alignment": 32})
        _rewrite(path, _key("general.alignment") + struct.pack("<II", UINT32, 32),
                 _key("general.alignment") + struct.pack("<II", UINT32, alignment))
        _every_loader(path, f"{path}: .*general.alignment must be a power of two, got {alignment}")


def test_a_string_that_is_not_utf8_is_a_load_error(tmp_path):
    """load_model let gguf's reader decode it: a UnicodeDecodeError."""
    path = write_tiny_llama(tmp_path / "latin1.gguf", {"general.name": b"caf\xe9"})
    _every_loader(path, f"{path}: .*general.name: 'utf-8' codec can't decode byte 0xe9", model_first=True)


# ----------------------------------------------------------------------------- hyper-parameters

@pytest.mark.parametrize("key, value, message", [
    ("llama.attention.head_count", 0, "llama.attention.head_count must be positive, got 0"),  # ZeroDivisionError
    ("llama.embedding_length", float("inf"), "llama.embedding_length must be an integer, got inf"),  # OverflowError
    ("llama.attention.head_count", float("nan"), "llama.attention.head_count must be an integer, got nan"),
])
def test_header_values_that_break_arithmetic(tmp_path, key, value, message):
    path = write_tiny_llama(tmp_path / "value.gguf", {key: value})
    _every_loader(path, f"{path}: {message}")


@pytest.mark.parametrize("key, value, kind", [
    ("llama.context_length", "64", "an integer"),  # int("64")
    ("llama.embedding_length", 16.5, "an integer"),  # truncated to 16
    ("llama.attention.head_count", True, "an integer"),
    ("llama.attention.sliding_window", 16.0, "an integer"),
    ("tokenizer.ggml.eos_token_id", "256", "an integer"),
    ("llama.rope.freq_base", "10000", "a number"),  # float("10000")
    ("llama.attention.layer_norm_rms_epsilon", True, "a number"),  # 1.0
])
def test_header_values_of_another_type_are_refused_not_converted(tmp_path, key, value, kind):
    """int() and float() read them: a file written wrong loaded as if written right."""
    path = write_tiny_llama(tmp_path / "type.gguf", {key: value})
    _every_loader(path, f"{path}: {key} must be {kind}, got {value!r}")


def test_a_float_may_be_written_as_an_integer(tmp_path):
    path = write_tiny_llama(tmp_path / "float.gguf", {"llama.rope.freq_base": 10000})
    assert load_config(str(path)).rope_theta == 10000.0


@pytest.mark.parametrize("length", [2**24 + 1, 2**62])
def test_a_gguf_context_length_is_bounded(tmp_path, length):
    """2**62 loaded; the engine then sized RoPE tables by it (its max_model_len by default)."""
    path = write_tiny_llama(tmp_path / "context.gguf", {"llama.context_length": length})
    _every_loader(path, f"{path}: llama.context_length must be in 1..16777216, got {length}")


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


@pytest.mark.parametrize("layers", [0, -1, 2**31, 10**18])
def test_a_hugging_face_layer_count_is_bounded_before_lists_are_sized_by_it(layers):
    """Review: a config.json declaring 2**31 layers built per-layer tuples of
    that length (16 GB) before any weight was read."""
    with pytest.raises(ModelLoadError, match="num_hidden_layers must be in 1..1024"):
        ModelConfig.from_hf_dict({**_HF_BASE, "num_hidden_layers": layers, "sliding_window": 64,
                                  "model_type": "gemma2"})


def test_a_gguf_rope_base_must_be_finite(tmp_path):
    path = write_tiny_llama(tmp_path / "rope.gguf", {"llama.rope.freq_base": float("inf")})
    _every_loader(path, f"{path}: rope_theta must be a positive finite number, got inf")


def test_more_tokens_than_embedding_rows_are_refused(tmp_path):
    """The tokenizer could produce ids the embedding has no row for."""
    metadata = byte_level_metadata("smollm", ["ĠĠ", "extra"], ["Ġ Ġ"])
    path = write_tiny_llama(tmp_path / "tokens.gguf", {**metadata, "llama.vocab_size": 257})
    _every_loader(path, f"{path}: tokenizer.ggml.tokens lists 258 tokens, more than llama.vocab_size 257")


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
    # A NaN score ranked its merges wherever the sort left them:
    (_sentencepiece(scores=[0.0, -1.0, float("nan"), -3.0]), r"tokenizer.ggml.scores\[2\] is nan, not a finite"),
    (_sentencepiece(scores=[0.0, -1.0, -2.0, float("-inf")]), r"tokenizer.ggml.scores\[3\] is -inf, not a finite"),
    # Text encoded to the later id alone:
    (_sentencepiece(tokens=["<unk>", "▁", "a", "a"]), "tokenizer.ggml.tokens lists 'a' twice, as ids 2 and 3"),
    (_byte_level(tokens=_byte_level()["tokenizer.ggml.tokens"] + ["ĠĠ"], token_type=[1] * 258),
     "tokenizer.ggml.tokens lists 'ĠĠ' twice, as ids 256 and 257"),
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


# ----------------------------------------------------------------------------- tensors

@pytest.mark.parametrize("name, shape, message", [
    ("blk.0", (4,), "unexpected tensor blk.0 for a llama model"),  # ValueError: not enough values to unpack
    ("blk.1.attn_q.bias", (16,), "unexpected tensor blk.1.attn_q.bias"),  # KeyError: only in layer 1
    ("blk.00.attn_q.weight", (16, 16), "unexpected tensor blk.00.attn_q.weight"),  # KeyError
    ("blk.٠.attn_q.weight", (16, 16), "unexpected tensor blk.٠.attn_q.weight"),  # an Arabic-Indic zero
    ("blk.0.attn_q.weight", (15, 16), r"tensor blk.0.attn_q.weight has shape \(15, 16\), the config implies "
                                      r"\(16, 16\)"),  # ValueError: cannot reshape (unpermuting whole heads)
])
def test_tensor_names_and_shapes_are_checked_before_use(tmp_path, name, shape, message):
    path = write_tiny_llama(tmp_path / "tensor.gguf", tensors={name: np.zeros(shape, np.float32)})
    with pytest.raises(ModelLoadError, match=f"{path}: {message}"):
        load_model(str(path), torch.float32)


@pytest.mark.parametrize("name, offset, message", [
    ("token_embd.weight", 2**64 - 1, "data offset 18446744073709551615 is not a multiple of the alignment"),
    ("output_norm.weight", 4, "output_norm.weight's data offset 4 is not a multiple of the alignment 32"),
    ("output_norm.weight", 0, r"tensors output_norm.weight and token_embd.weight share bytes \d+ to \d+"),
    ("output_norm.weight", 2**40, r"output_norm.weight's data \(bytes .*\) runs past the end of the file"),
])
def test_tensor_data_lies_inside_the_file_aligned_and_apart(tmp_path, name, offset, message):
    """gguf's reader added offsets in uint64 (2**64 - 1 wrapped around into
    the header) and took misaligned and overlapping data as it found it: the
    model loaded garbage."""
    path = write_tiny_llama(tmp_path / "offsets.gguf")
    set_tensor_offset(path, name, offset)
    with pytest.raises(ModelLoadError, match=f"{path}: .*{message}"):
        load_model(str(path), torch.float32)


def test_quantized_rows_must_be_whole_blocks(tmp_path):
    """A Q8_0 tensor holds blocks of 32 values: rows of 16 cannot be read as
    such. The loader reads each tensor's bytes itself (no gguf.GGUFReader):
    it says so, naming the tensor."""
    path = write_tiny_llama(tmp_path / "blocks.gguf")
    set_tensor_type(path, "blk.0.attn_q.weight", gguf.GGMLQuantizationType.Q8_0)
    with pytest.raises(ModelLoadError, match=f"{path}: tensor blk.0.attn_q.weight's rows of 16 values are not "
                                             "whole blocks of 32"):
        load_model(str(path), torch.float32)


def test_a_gguf_file_is_loaded_without_gguf_reader(tmp_path, monkeypatch):
    """gguf.GGUFReader parsed the header a second time after the loader's own
    parse, building a numpy view of every metadata value: 4 s of SmolLM2's
    load (7.7 s), one view per vocabulary token and more. The loader now
    takes each tensor's bytes where its own parse of the header says; the
    same weights (test_loader.py compares SmolLM2's with transformers')."""
    def no_reader(*args, **kwargs):
        raise AssertionError("gguf.GGUFReader parsed the file")

    path = write_tiny_llama(tmp_path / "tiny.gguf")
    written = tiny_llama_tensors()
    monkeypatch.setattr(gguf, "GGUFReader", no_reader)
    loaded = load_model(str(path), torch.float32)
    assert len(loaded.weights) == len(written)
    np.testing.assert_array_equal(loaded.weights["model.embed_tokens.weight"].numpy(), written["token_embd.weight"])
    np.testing.assert_array_equal(loaded.weights["model.layers.1.mlp.down_proj.weight"].numpy(),
                                  written["blk.1.ffn_down.weight"])


@pytest.mark.parametrize("value, dtype", [(float("nan"), torch.float32), (float("-inf"), torch.float32),
                                          (float("nan"), torch.bfloat16), (1e38, torch.float16)])
def test_weights_that_are_not_finite_are_refused(tmp_path, value, dtype):
    """They loaded, and every request whose tokens met them failed with NaN
    logits. 1e38 is finite in the file's float32, infinite in float16."""
    weight = np.ones((16, 16), np.float32)
    weight[3, 5] = value
    path = write_tiny_llama(tmp_path / "weights.gguf", tensors={"blk.1.attn_output.weight": weight})
    with pytest.raises(ModelLoadError, match=f"{path}: tensor model.layers.1.self_attn.o_proj.weight holds 1 NaN "
                                             f"or infinite value\\(s\\) in {dtype}"):
        load_model(str(path), dtype)
