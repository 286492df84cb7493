"""GGUF files of every supported family against Hugging Face transformers.

Tiny random models are built with transformers' own classes, saved as a
Hugging Face folder, and written here as GGUF files the way llama.cpp's
converter (convert_hf_to_gguf.py) writes them: its tensor names, its metadata
keys, Gemma's norms stored as 1 + w, Llama's Q/K rows permuted, Phi-3's fused
projections. Three oracles, each independent of FlexInfer's loader:
transformers' GGUF reader recovers the original weights from the file (so the
writer follows the real convention); FlexInfer's GGUF route gives the config
and weights of its Hugging Face folder route; and its logits equal
transformers' on the original model. The tokenizers are checked against
transformers' GGUF tokenizer conversion on a SentencePiece vocabulary written
here.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import vtm  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # noqa: E402

from flexinfer import LLM, SamplingParams  # noqa: E402
from flexinfer.attention import KernelAttention  # noqa: E402
from flexinfer.detokenizer import IncrementalText, final_text  # noqa: E402
from flexinfer.errors import ChatTemplateError, ModelLoadError  # noqa: E402
from flexinfer.kv_cache import KVCache  # noqa: E402
from flexinfer.model.config import FULL, SLIDING  # noqa: E402
from flexinfer.model.llama import ForwardBatch, LlamaModel  # noqa: E402
from flexinfer.model.loader import load_model, load_tokenizer  # noqa: E402
from flexinfer.tokenizer import Tokenizer  # noqa: E402
from gguf_testing import byte_level_metadata  # noqa: E402
from test_families import random_model  # noqa: E402

WINDOW = 8
CHUNK = 4096
LOGITS_ATOL = 2e-4

# ----------------------------------------------------------------------------- vocabularies

# SentencePiece pieces for the test vocabulary, best first (llama.cpp merges by
# score; SentencePiece's BPE scores are minus the merge order).
_PIECES = ["▁t", "he", "▁the", "▁a", "in", "er", "▁w", "an", "on", "▁s", "re", "▁o", "▁b", "at", "en", "▁c", "ll",
           "▁f", "▁d", "ing", "▁m", "▁h", "or", "▁in", "▁an", "▁of", "▁to", "es", "▁wor", "▁world", "ld", "▁hello",
           "el", "lo", "▁he", "▁hel", "▁fox", "▁qu", "ick", "▁quick", "▁br", "own", "▁brown", "ox", "▁▁", "▁▁▁",
           "12", "123", "é", "ca", "fé", "▁ca", "▁café", "日本", "語"]
_CHARS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\"-:;()") + ["▁"]
SPM_TEXTS = [
    "hello world", "Hello World!", "the quick brown fox", "  leading spaces", "trailing spaces   ",
    "café 日本語 🦙", "in the world of 12345, a fox.", "tabs\tand\nnewlines\n\nend", "<s> inside", "x</s>y",
    "", "a", " ", "unknown ✓ char",
]


def _spm_metadata(vocab_size: int, add_space_prefix: bool | None) -> dict:
    """tokenizer.ggml.* of a SentencePiece vocabulary ("llama" model) as
    llama.cpp's _set_vocab_sentencepiece writes it: <unk>, <s>, </s>, the 256
    byte tokens <0xNN>, then pieces scored by their order; padded to
    `vocab_size` with unused tokens."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces = _CHARS + _PIECES
    tokens += pieces
    types += [1] * len(pieces)
    tokens += [f"<unused{i}>" for i in range(vocab_size - len(tokens))]
    types += [5] * (vocab_size - len(types))
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [-1e4] * (vocab_size - len(pieces) - 259)
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
                "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
                "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": True}
    if add_space_prefix is not None:
        metadata["tokenizer.ggml.add_space_prefix"] = add_space_prefix
    return metadata


def _byte_level_metadata(vocab_size: int) -> dict:
    """A byte-level BPE vocabulary ("gpt2", pre "qwen2"), as Qwen's files have."""
    extra = ["ĠĠ", "he", "Ġhe"] + [f"<extra_{i}>" for i in range(vocab_size - 259)]
    return {**byte_level_metadata("qwen2", extra, ["Ġ Ġ", "h e", "Ġ he"]),
            "tokenizer.ggml.eos_token_id": vocab_size - 1}


# ----------------------------------------------------------------------------- models

VOCAB = 416
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
               initializer_range=0.1)


def _family(name: str):
    """(GGUF architecture, model class, config) of a tiny model of family `name`.
    Unlike a folder, a GGUF file cannot say everything a config can: Gemma's
    query_pre_attn_scalar is llama.cpp's (head_dim here) and Gemma 3's layer
    pattern is its period of 6."""
    t = transformers
    if name == "qwen3":
        return "qwen3", t.Qwen3ForCausalLM, t.Qwen3Config(**_COMMON, num_hidden_layers=2, head_dim=24,
                                                          tie_word_embeddings=False)
    if name == "qwen3-sliding":
        return "qwen3", t.Qwen3ForCausalLM, t.Qwen3Config(**_COMMON, num_hidden_layers=3, head_dim=16,
                                                          use_sliding_window=True, sliding_window=WINDOW,
                                                          max_window_layers=1, tie_word_embeddings=True)
    if name == "qwen2-sliding":
        return "qwen2", t.Qwen2ForCausalLM, t.Qwen2Config(**_COMMON, num_hidden_layers=3, use_sliding_window=True,
                                                          sliding_window=WINDOW, max_window_layers=1,
                                                          tie_word_embeddings=False)
    if name == "mistral-sliding":
        return "llama", t.MistralForCausalLM, t.MistralConfig(**_COMMON, num_hidden_layers=2, sliding_window=WINDOW,
                                                              head_dim=16, tie_word_embeddings=False)
    if name == "phi3":
        return "phi3", t.Phi3ForCausalLM, t.Phi3Config(**{**_COMMON, "pad_token_id": 0}, num_hidden_layers=2,
                                                       sliding_window=WINDOW, tie_word_embeddings=False)
    if name == "gemma2":
        return "gemma2", t.Gemma2ForCausalLM, t.Gemma2Config(**_COMMON, num_hidden_layers=3, head_dim=32,
                                                             query_pre_attn_scalar=32, sliding_window=WINDOW,
                                                             attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                                                             pad_token_id=0)
    if name == "gemma3":
        return "gemma3", t.Gemma3ForCausalLM, t.Gemma3TextConfig(
            **_COMMON, num_hidden_layers=7, head_dim=32, query_pre_attn_scalar=32, sliding_window=WINDOW,
            layer_types=[SLIDING] * 5 + [FULL, SLIDING], pad_token_id=0,
            rope_parameters={FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                             SLIDING: {"rope_type": "default", "rope_theta": 1e4}})
    raise ValueError(name)


FAMILIES = ["qwen3", "qwen3-sliding", "qwen2-sliding", "mistral-sliding", "phi3", "gemma2", "gemma3"]
# The fields a GGUF file must reproduce (architecture aside: llama.cpp calls Mistral "llama").
CONFIG_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
                 "max_position_embeddings", "tie_word_embeddings", "attention_bias", "layer_types", "sliding_window",
                 "qk_norm", "gemma_norms", "hidden_act", "scale_embeddings", "attn_logit_softcapping",
                 "final_logit_softcapping", "query_pre_attn_scalar", "rope_local_theta")

# Hugging Face name (after "model.layers.{i}.") -> llama.cpp's, per architecture.
_HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    **{f"self_attn.{p}_proj.{kind}": f"attn_{p}.{kind}" for p in "qkv" for kind in ("weight", "bias")},
}
_GEMMA_HF_TO_GGUF = {**_HF_TO_GGUF, "post_attention_layernorm.weight": "post_attention_norm.weight",
                     "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                     "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
_PHI3_HF_TO_GGUF = {**_HF_TO_GGUF, "self_attn.qkv_proj.weight": "attn_qkv.weight",
                    "mlp.gate_up_proj.weight": "ffn_up.weight"}
_GGUF_NAMES = {"gemma2": _GEMMA_HF_TO_GGUF, "gemma3": _GEMMA_HF_TO_GGUF, "phi3": _PHI3_HF_TO_GGUF}


def _gguf_name(arch: str, hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        return f"blk.{layer}.{_GGUF_NAMES.get(arch, _HF_TO_GGUF)[rest]}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf_name]


def _permute_rotary_rows(array: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's LlamaModel.permute: each head's two halves interleaved.
    return array.reshape(heads, 2, array.shape[0] // heads // 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)


def write_gguf(path, arch: str, model, *, types: dict[str, str] | None = None, extra=None, skip=()) -> dict:
    """Write `model` as llama.cpp's converter would; return the float32 weights
    (Hugging Face names) a reader must recover: after the quantisation round
    trip and, for Gemma's norms, the 1 + w round trip. `types` maps name
    suffixes to tensor types (default F32); `extra(writer)` adds metadata;
    metadata keys in `skip` are left out."""
    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    keys = {"block_count": c.num_hidden_layers, "context_length": c.max_position_embeddings,
            "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
            "head_count": c.num_attention_heads, "head_count_kv": c.num_key_value_heads,
            "layer_norm_rms_eps": c.rms_norm_eps}
    for name, value in keys.items():
        if name not in skip:
            getattr(writer, f"add_{name}")(value)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = c.rope_parameters.get(FULL, c.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    # Mistral's config lists no layer types: its window covers every layer.
    layer_types = getattr(c, "layer_types", None) or ([SLIDING] * c.num_hidden_layers if c.sliding_window else [])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
        writer.add_sliding_window(c.sliding_window)
    elif arch == "gemma3":
        writer.add_sliding_window(c.sliding_window)  # the pattern is llama.cpp's: every 6th layer is full
        assert layer_types == [SLIDING if (i + 1) % 6 else FULL for i in range(c.num_hidden_layers)]
    elif arch == "phi3":
        writer.add_sliding_window(c.sliding_window or 0)
        writer.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
    elif SLIDING in layer_types:
        writer.add_sliding_window(c.sliding_window)
        if FULL in layer_types:
            writer.add_sliding_window_pattern([t == SLIDING for t in layer_types])

    if arch in ("phi3", "gemma2", "gemma3"):
        metadata = _spm_metadata(c.vocab_size, False if arch.startswith("gemma") else None)
        writer.add_token_scores(metadata["tokenizer.ggml.scores"])
        writer.add_bos_token_id(1)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
        if arch.startswith("gemma"):
            writer.add_add_space_prefix(False)
    else:
        metadata = _byte_level_metadata(c.vocab_size)
        writer.add_token_merges(metadata["tokenizer.ggml.merges"])
    writer.add_tokenizer_model(metadata["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(metadata["tokenizer.ggml.pre"])
    writer.add_token_list(metadata["tokenizer.ggml.tokens"])
    writer.add_token_types(metadata["tokenizer.ggml.token_type"])
    writer.add_eos_token_id(metadata["tokenizer.ggml.eos_token_id"])
    if extra is not None:
        extra(writer)

    expected = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        array = tensor.float().numpy()
        shift = arch.startswith("gemma") and name.endswith("norm.weight")
        if shift:
            array = array + np.float32(1)
        kind = next((t for suffix, t in (types or {}).items() if name.endswith(suffix)), "F32")
        qtype = gguf.GGMLQuantizationType[kind]
        data = quantize(array, qtype)
        recovered = dequantize(data, qtype).reshape(array.shape)
        expected[name] = torch.from_numpy(recovered - np.float32(1) if shift else recovered)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            data = _permute_rotary_rows(data, c.num_attention_heads if ".q_proj." in name else c.num_key_value_heads)
        writer.add_tensor(_gguf_name(arch, name), data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _split_phi3(weights: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Phi-3's fused tensors under the names FlexInfer's loader gives them."""
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    result = {}
    for name, tensor in weights.items():
        if name.endswith("qkv_proj.weight"):
            stem = name[: -len("qkv_proj.weight")]
            for part, piece in zip("qkv", tensor.split([q_rows, kv_rows, kv_rows])):
                result[f"{stem}{part}_proj.weight"] = piece
        elif name.endswith("gate_up_proj.weight"):
            stem = name[: -len("gate_up_proj.weight")]
            for part, piece in zip(("gate", "up"), tensor.chunk(2)):
                result[f"{stem}{part}_proj.weight"] = piece
        else:
            result[name] = tensor
    return result


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{family: (folder, gguf path, model, expected weights)}, built once per module."""
    result = {}
    for seed, name in enumerate(FAMILIES):
        arch, model_class, config = _family(name)
        model = random_model(model_class, config, seed=200 + seed)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        path = folder / f"{name}.gguf"
        expected = write_gguf(path, arch, model)
        # The folder's tokenizer: transformers' reading of the file's.
        transformers.AutoTokenizer.from_pretrained(folder, gguf_file=path.name).save_pretrained(folder)
        result[name] = (folder, path, model, expected)
    return result


# ----------------------------------------------------------------------------- the writer follows llama.cpp

@pytest.mark.parametrize("name", FAMILIES)
def test_transformers_reads_the_original_weights_from_the_file(built, name):
    """transformers' GGUF reader, given the file, recovers the model's
    weights: the writer above follows the convention transformers reads."""
    folder, path, model, expected = built[name]
    if name == "mistral-sliding":  # gguf-py knows no "mistral": its weights are Llama's, under Llama's names
        settings = {k: v for k, v in model.config.to_dict().items() if k != "model_type"}
        fresh = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings))
    else:
        fresh = type(model)(model.config)
    loaded = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=fresh)["tensors"]
    assert set(loaded) == set(expected)
    for hf_name, tensor in expected.items():
        torch.testing.assert_close(loaded[hf_name].float(), tensor, rtol=0, atol=0,
                                   msg=lambda m, n=hf_name: f"{name} {n}: {m}")


# ----------------------------------------------------------------------------- FlexInfer reads the file

@pytest.mark.parametrize("name", FAMILIES)
def test_gguf_config_and_weights_equal_the_folder_route(built, name):
    folder, path, model, expected = built[name]
    from_folder = load_model(str(folder / ""), torch.float32)
    from_gguf = load_model(str(path), torch.float32)
    for field in CONFIG_FIELDS:
        ours, theirs = getattr(from_gguf.config, field), getattr(from_folder.config, field)
        # GGUF stores floats in single precision (rms_norm_eps 1e-5 reads back as 9.9999997e-06).
        assert ours == (pytest.approx(theirs, rel=1e-7) if isinstance(theirs, float) else theirs), field
    assert from_gguf.config.architecture == ("llama" if name == "mistral-sliding" else from_folder.config.architecture)
    assert set(from_gguf.weights) == set(from_folder.weights)
    want = _split_phi3(expected, from_folder.config)
    for hf_name, tensor in from_gguf.weights.items():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous(), hf_name
        torch.testing.assert_close(tensor, want[hf_name], rtol=0, atol=0, msg=lambda m, n=hf_name: f"{n}: {m}")
        # The folder's weights, but for Gemma's norms' 1 + w rounding (an ulp of 1 at most).
        torch.testing.assert_close(tensor, from_folder.weights[hf_name], rtol=0, atol=2 ** -23)
    config, tokenizer = load_tokenizer(str(path))
    assert config == from_gguf.config and tokenizer.vocab_size == VOCAB


def test_gemma_norms_are_stored_plus_one(built):
    """The norm weights in the file are 1 + w (llama.cpp's Gemma converters),
    read back as w: a loader that forgot either step would be off by one."""
    folder, path, model, _ = built["gemma2"]
    reader = gguf.GGUFReader(path)
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    w = model.model.layers[1].pre_feedforward_layernorm.weight.detach().numpy()
    np.testing.assert_array_equal(stored["blk.1.ffn_norm.weight"], w + np.float32(1))
    loaded = load_model(str(path), torch.float32)
    torch.testing.assert_close(loaded.weights["model.layers.1.pre_feedforward_layernorm.weight"],
                               torch.from_numpy(w), rtol=0, atol=2 ** -23)


def _logits_after_each_pass(loaded, prompt: list[int], decode: list[int]) -> list[torch.Tensor]:
    model = LlamaModel(loaded.config, loaded.weights, torch.float32)
    result = []
    with vtm.Manager(backend="host", capacity_bytes=64 * CHUNK, chunk_bytes=CHUNK, granularity=CHUNK) as manager:
        kv = KVCache(manager, loaded.config, torch.float32, max_tokens=64, max_slots=2)
        vt = kv.create(len(prompt) + len(decode))
        attention = KernelAttention(torch.device("cpu"))
        passes = [(0, prompt)] + [(len(prompt) + i, [t]) for i, t in enumerate(decode)]
        for start, ids in passes:
            manager.step({v: start + len(ids) for v in vt}).result()
            batch = ForwardBatch.build([tuple(v.slot for v in vt)], [start], [len(ids)], torch.device("cpu"))
            result.append(model.forward(torch.tensor(ids), batch, kv, attention)[0])
        kv.release(vt)
        kv.close()
    return result


@pytest.mark.parametrize("name", FAMILIES)
def test_gguf_logits_match_transformers(built, name):
    """A prefill longer than the window, then decode steps: after each pass
    the logits equal transformers' on the original model."""
    folder, path, model, _ = built[name]
    rng = random.Random(7)
    prompt = [rng.randrange(3, VOCAB) for _ in range(21)]
    decode = [rng.randrange(3, VOCAB) for _ in range(4)]
    ours = _logits_after_each_pass(load_model(str(path), torch.float32), prompt, decode)
    for i, logits in enumerate(ours):
        sequence = prompt + decode[:i]
        with torch.no_grad():
            expected = model(torch.tensor([sequence])).logits[0, -1].float()
        torch.testing.assert_close(logits, expected, atol=LOGITS_ATOL, rtol=0, msg=lambda m, i=i: f"pass {i}: {m}")


@pytest.mark.parametrize("name", ["gemma3", "phi3"])
def test_gguf_greedy_tokens_match_transformers(built, name):
    """Through the engine, from the file alone (tokenizer included)."""
    folder, path, model, _ = built[name]
    rng = random.Random(11)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 23)]
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=24, eos_token_id=[], pad_token_id=0,
                                           bos_token_id=None)
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), generation_config=config,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            expected.append(out[0, len(prompt):].tolist())
    with LLM(str(path), max_model_len=96, kv_capacity_bytes=32 << 20) as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected


def test_quantized_gemma2_round_trips(tmp_path, built):
    """Q8_0 matrices and F16 norms (stored as 1 + w): read back as the
    quantisation round trip gives them, the norms less one."""
    _, _, model, _ = built["gemma2"]
    path = tmp_path / "gemma2-q8.gguf"
    expected = write_gguf(path, "gemma2", model, types={"proj.weight": "Q8_0", "norm.weight": "F16",
                                                        "layernorm.weight": "F16"})
    loaded = load_model(str(path), torch.float32)
    assert set(loaded.weights) == set(expected)
    for hf_name, tensor in expected.items():
        torch.testing.assert_close(loaded.weights[hf_name], tensor, rtol=0, atol=0,
                                   msg=lambda m, n=hf_name: f"{n}: {m}")
    assert not torch.equal(expected["model.layers.0.mlp.up_proj.weight"], model.model.layers[0].mlp.up_proj.weight)
    fresh = type(model)(model.config)
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=fresh)["tensors"]
    for hf_name, tensor in expected.items():
        torch.testing.assert_close(theirs[hf_name].float(), tensor, rtol=0, atol=0)


# ----------------------------------------------------------------------------- llama.cpp's hard-coded values

def _gemma_metadata(arch: str, layers: int, **extra) -> dict:
    return {"general.architecture": arch, f"{arch}.block_count": layers, f"{arch}.context_length": 8192,
            f"{arch}.embedding_length": 4608, f"{arch}.feed_forward_length": 36864,
            f"{arch}.attention.head_count": 32, f"{arch}.attention.head_count_kv": 16,
            f"{arch}.attention.key_length": 128, f"{arch}.attention.value_length": 128,
            f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, f"{arch}.vocab_size": 256000,
            **{f"{arch}.{k}": v for k, v in extra.items()}}


def test_gemma_defaults_are_llama_cpps():
    """What a Gemma file leaves out, llama.cpp assumes: Gemma 2's caps 50 and
    30 and window 4096; 27B models (by layer count) scale attention by
    (hidden / heads) ** -0.5, others by head_dim's; Gemma 3 slides 5 layers of
    6 with a local RoPE base of 10000."""
    from flexinfer.model.loader import _gguf_config_from_metadata

    def tensors(layers):  # block_count must count the layers the tensors hold
        return {"token_embd.weight", *(f"blk.{i}.attn_norm.weight" for i in range(layers))}

    g2 = _gguf_config_from_metadata(_gemma_metadata("gemma2", 46), tensors(46))
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.sliding_window) == (50.0, 30.0, 4096)
    assert g2.query_pre_attn_scalar == 144.0 and g2.layer_types[:3] == (SLIDING, FULL, SLIDING)
    assert g2.tie_word_embeddings and g2.hidden_act == "gelu_pytorch_tanh"
    assert _gguf_config_from_metadata(_gemma_metadata("gemma2", 42), tensors(42)).query_pre_attn_scalar == 128.0
    g3 = _gguf_config_from_metadata(_gemma_metadata("gemma3", 62, **{"attention.sliding_window": 1024}),
                                    tensors(62))
    assert g3.query_pre_attn_scalar == 144.0 and g3.rope_local_theta == 10000.0
    assert g3.layer_types[:12] == (SLIDING,) * 5 + (FULL,) + (SLIDING,) * 5 + (FULL,)
    assert (g3.attn_logit_softcapping, g3.final_logit_softcapping) == (None, None)
    # Without a window Gemma 3's layers are all full (llama.cpp: swa_type NONE).
    g3_full = _gguf_config_from_metadata(_gemma_metadata("gemma3", 26), tensors(26))
    assert g3_full.layer_types == () and g3_full.rope_local_theta is None and g3_full.query_pre_attn_scalar == 128.0


# ----------------------------------------------------------------------------- errors

def test_phi3_longrope_is_refused(tmp_path, built):
    _, _, model, _ = built["phi3"]
    path = tmp_path / "phi3-longrope.gguf"
    half = model.config.hidden_size // model.config.num_attention_heads // 2

    def longrope(writer):
        writer.add_rope_scaling_attn_factors(1.19)
        writer.add_tensor("rope_factors_long.weight", np.ones(half, np.float32))
        writer.add_tensor("rope_factors_short.weight", np.ones(half, np.float32))

    write_gguf(path, "phi3", model, extra=longrope)
    with pytest.raises(ModelLoadError, match=f"{path}.*phi3.rope.scaling.attn_factor"):
        load_model(str(path), torch.float32)

    # The factors alone (no attention factor) are refused too, by the tensor's name.
    path = tmp_path / "phi3-factors.gguf"
    write_gguf(path, "phi3", model, extra=lambda w: w.add_tensor("rope_factors_long.weight",
                                                                 np.ones(half, np.float32)))
    with pytest.raises(ModelLoadError, match=f"{path}.*LongRoPE.*rope_factors_long"):
        load_model(str(path), torch.float32)


def test_unknown_metadata_and_architecture_are_refused(tmp_path, built):
    _, _, model, _ = built["qwen3"]
    path = tmp_path / "experts.gguf"
    write_gguf(path, "qwen3", model, extra=lambda w: w.add_expert_count(8))
    with pytest.raises(ModelLoadError, match=f"{path}.*unsupported GGUF metadata qwen3.expert_count"):
        load_model(str(path), torch.float32)
    # A dense model's converter may write no experts as 0, and say whether rope scaling was fine-tuned.
    path = tmp_path / "dense.gguf"
    write_gguf(path, "qwen3", model, extra=lambda w: (w.add_expert_count(0), w.add_expert_used_count(0),
                                                      w.add_bool("qwen3.rope.scaling.finetuned", False)))
    assert load_model(str(path), torch.float32).config.architecture == "qwen3"
    path = tmp_path / "qwen3moe.gguf"
    write_gguf(path, "qwen3moe", model)
    with pytest.raises(ModelLoadError, match=f"{path}.*unsupported GGUF architecture 'qwen3moe'"):
        load_model(str(path), torch.float32)


@pytest.mark.parametrize("missing", ["embedding_length", "head_count", "layer_norm_rms_eps", "context_length"])
def test_missing_keys_are_refused(tmp_path, built, missing):
    _, _, model, _ = built["gemma2"]
    path = tmp_path / f"no-{missing}.gguf"
    write_gguf(path, "gemma2", model, skip={missing})
    key = {"head_count": "attention.head_count", "layer_norm_rms_eps": "attention.layer_norm_rms_epsilon"}
    with pytest.raises(ModelLoadError, match=f"{path}.*lacks gemma2.{key.get(missing, missing)}"):
        load_model(str(path), torch.float32)


def test_partial_rotary_and_value_length_are_refused(built):
    from flexinfer.model.loader import _gguf_config_from_metadata, _read_gguf_header

    metadata, names = _read_gguf_header(built["phi3"][1])
    assert _gguf_config_from_metadata(metadata, names).architecture == "phi3"
    with pytest.raises(ModelLoadError, match="partial rotary"):
        _gguf_config_from_metadata({**metadata, "phi3.rope.dimension_count": 8}, names)
    with pytest.raises(ModelLoadError, match="value_length"):
        _gguf_config_from_metadata({**metadata, "phi3.attention.value_length": 8}, names)


# ----------------------------------------------------------------------------- SentencePiece tokenizers

@pytest.fixture(scope="module")
def spm_files(tmp_path_factory):
    """{arch: folder} holding `model.gguf` with a tiny model and the test vocabulary."""
    folders = {}
    for arch, name in (("gemma2", "gemma2"), ("phi3", "phi3")):
        _, model_class, config = _family(name)
        folder = tmp_path_factory.mktemp(f"spm-{arch}")
        torch.manual_seed(0)
        write_gguf(folder / "model.gguf", arch, model_class(config))
        folders[arch] = folder
    return folders


@pytest.mark.parametrize("arch", ["gemma2", "phi3"])
def test_sentencepiece_tokenizer_matches_transformers(spm_files, arch):
    folder = spm_files[arch]
    oracle = transformers.AutoTokenizer.from_pretrained(folder, gguf_file="model.gguf")
    _, ours = load_tokenizer(str(folder / "model.gguf"))
    for text in SPM_TEXTS:
        ids = ours.encode(text)
        assert ids == oracle.encode(text, add_special_tokens=False), (arch, text, ids)
        assert ours.encode(text, add_special_tokens=True) == oracle.encode(text), (arch, text)
        assert ours.decode(ids) == oracle.decode(ids, skip_special_tokens=True), (arch, text)
    assert ours.bos_token_id == oracle.bos_token_id == 1 and ours.eos_token_ids == (2,)


def test_sentencepiece_tokens_spaces_and_bytes():
    """llama.cpp's conventions, spelled out: spaces are "▁" (one prepended
    where add_space_prefix, its default), pieces merge best score first, a
    character outside the vocabulary becomes its UTF-8 bytes, control tokens
    in the text are matched whole, and decoding inverts all of it."""
    prefixed = Tokenizer.from_gguf_metadata(_spm_metadata(VOCAB, None), "t.gguf")
    plain = Tokenizer.from_gguf_metadata(_spm_metadata(VOCAB, False), "t.gguf")

    def pieces(tokenizer, text):
        return [tokenizer.id_to_token(i) for i in tokenizer.encode(text)]

    # "ll" outranks "▁he", "he" outranks "el": the best-scoring pair merges first.
    assert pieces(prefixed, "hello world") == ["▁he", "ll", "o", "▁world"]
    assert pieces(plain, "hello world") == ["he", "ll", "o", "▁world"]
    assert pieces(plain, "the café") == ["t", "he", "▁café"]
    assert pieces(plain, "✓") == ["<0xE2>", "<0x9C>", "<0x93>"]
    assert pieces(plain, "a</s>b") == ["a", "</s>", "b"]
    assert prefixed.encode("hi", add_special_tokens=True)[0] == 1
    # With the prefix, llama.cpp puts a space after each special token too.
    assert pieces(prefixed, "a</s>b") == ["▁a", "</s>", "▁b"]
    for text in SPM_TEXTS:
        assert plain.decode(plain.encode(text), skip_special_tokens=False) == text
        if "s>" not in text:
            assert prefixed.decode(prefixed.encode(text), skip_special_tokens=False) == text


def test_sentencepiece_bytes_before_an_incomplete_character_keep_their_text():
    """A byte token of a whole character (Llama's newline is <0x0A>) stays
    text when the byte tokens after it do not form a character: cut short
    by max_tokens, or ill-formed. Only those bytes become U+FFFD, as
    llama.cpp's bytes decode, and the stream and the whole output agree."""
    tokenizer = Tokenizer.from_gguf_metadata(_spm_metadata(VOCAB, None), "t.gguf")
    ids = tokenizer.encode("Hi\n🦙")
    assert [tokenizer.id_to_token(i) for i in ids[-5:]] == ["<0x0A>", "<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    cut = ids[:-2]
    stream = IncrementalText(tokenizer, [])
    assert "".join(stream.push([i]) for i in cut) + stream.finish() == final_text(tokenizer, cut, []) == "Hi\n"
    stray = tokenizer.encode("Hi\n") + [tokenizer.token_to_id("<0x9F>")] + tokenizer.encode("x")
    assert tokenizer.decode(stray) == "Hi\n\ufffd x"
    stream = IncrementalText(tokenizer, [])
    assert "".join(stream.push([i]) for i in stray) + stream.finish() == "Hi\n\ufffd x"


def test_sentencepiece_chat_content_reads_special_token_text_as_text():
    """A SentencePiece tokenizer decodes through a Python decoder, which its
    copy that reads "</s>" as text is made without: the copy is made when
    the tokenizer is, and both decode as before."""
    plain = Tokenizer.from_gguf_metadata({**_spm_metadata(VOCAB, False), "tokenizer.chat_template": (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}")}, "t.gguf")
    conversation = [{"role": "user", "content": "a</s>b"}]
    ids = plain.encode_chat(conversation, add_generation_prompt=False)
    assert ids.count(plain.token_to_id("</s>")) == 1  # the template's only
    assert plain.decode(ids, skip_special_tokens=False) == "user: a</s>b</s>"
    for text in SPM_TEXTS:
        assert plain.decode(plain.encode(text), skip_special_tokens=False) == text
    shouting = Tokenizer.from_gguf_metadata({**_spm_metadata(VOCAB, False), "tokenizer.chat_template": (
        "{{ messages[0]['content'] | upper }}")}, "t.gguf")
    assert shouting.encode_chat([{"role": "user", "content": "ab"}]) == shouting.encode("AB")
    with pytest.raises(ChatTemplateError, match="special token's text"):
        shouting.encode_chat(conversation)


def test_sentencepiece_missing_scores_is_refused():
    metadata = _spm_metadata(VOCAB, None)
    del metadata["tokenizer.ggml.scores"]
    with pytest.raises(ModelLoadError, match="t.gguf.*lacks tokenizer.ggml.scores"):
        Tokenizer.from_gguf_metadata(metadata, "t.gguf")
    with pytest.raises(ModelLoadError, match="t.gguf.*tokenizer model 'bert'"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.model": "bert"}, "t.gguf")
