"""GGUF files and vocabularies the loader tests write: shared by test_loader.py, test_gguf_families.py,
test_gguf_malformed.py and test_cli.py."""

from __future__ import annotations


def byte_level_metadata(pre: str, extra_tokens: list[str], merges: list[str]) -> dict:
    """A byte-level BPE vocabulary ("gpt2" tokenizer model, pre-tokenizer
    `pre`): the 256 byte symbols as GPT-2 maps them, then `extra_tokens`."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    tokens = symbols + extra_tokens
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.token_type": [1] * len(tokens)}


# The tiny Llama write_tiny_llama writes: two layers, two heads of 8 dimensions sharing one KV head.
TINY_LAYERS, TINY_HIDDEN, TINY_HEADS, TINY_KV_HEADS, TINY_FFN = 2, 16, 2, 1, 32


def tiny_llama_tensors() -> dict:
    """The tiny Llama's tensors: GGUF names -> float32 arrays in torch's shape order."""
    import numpy as np

    rng = np.random.default_rng(0)
    head_dim = TINY_HIDDEN // TINY_HEADS
    shapes = {"token_embd.weight": (257, TINY_HIDDEN), "output_norm.weight": (TINY_HIDDEN,)}
    for i in range(TINY_LAYERS):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (TINY_HIDDEN,), f"blk.{i}.ffn_norm.weight": (TINY_HIDDEN,),
            f"blk.{i}.attn_q.weight": (TINY_HEADS * head_dim, TINY_HIDDEN),
            f"blk.{i}.attn_k.weight": (TINY_KV_HEADS * head_dim, TINY_HIDDEN),
            f"blk.{i}.attn_v.weight": (TINY_KV_HEADS * head_dim, TINY_HIDDEN),
            f"blk.{i}.attn_output.weight": (TINY_HIDDEN, TINY_HEADS * head_dim),
            f"blk.{i}.ffn_gate.weight": (TINY_FFN, TINY_HIDDEN), f"blk.{i}.ffn_up.weight": (TINY_FFN, TINY_HIDDEN),
            f"blk.{i}.ffn_down.weight": (TINY_HIDDEN, TINY_FFN),
        })
    return {name: (rng.standard_normal(shape) * 0.1).astype(np.float32) for name, shape in shapes.items()}


def write_tiny_llama(path, metadata: dict | None = None, tensors: dict | None = None):
    """Write a tiny random Llama as a GGUF file (F32 tensors, a byte-level
    vocabulary of 257 tokens whose last is EOS) and return its path.
    `metadata` adds keys or replaces them, `tensors` adds tensors (GGUF name
    -> array in torch's shape order) or replaces them; None leaves one out.
    Values are written as the smallest GGUF type that holds them (an int as
    uint32, uint64 past it, int32 below 0; a float as float32; bytes as a
    string, as they are)."""
    import gguf

    keys = {
        "llama.block_count": TINY_LAYERS, "llama.context_length": 64, "llama.embedding_length": TINY_HIDDEN,
        "llama.feed_forward_length": TINY_FFN, "llama.attention.head_count": TINY_HEADS,
        "llama.attention.head_count_kv": TINY_KV_HEADS, "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.freq_base": 10000.0, **byte_level_metadata("smollm", ["ĠĠ"], ["Ġ Ġ"]),
        "tokenizer.ggml.eos_token_id": 256, **(metadata or {}),
    }
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in keys.items():
        if value is not None:
            kind = _gguf_type(value)
            writer.add_key_value(key, value, kind, _gguf_type(value[0]) if kind == gguf.GGUFValueType.ARRAY else None)
    for name, array in {**tiny_llama_tensors(), **(tensors or {})}.items():
        if array is not None:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_type(value):
    from gguf import GGUFValueType

    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        return GGUFValueType.INT32 if value < 0 else GGUFValueType.UINT32 if value < 2**32 else GGUFValueType.UINT64
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    if isinstance(value, (str, bytes)):
        return GGUFValueType.STRING
    return GGUFValueType.ARRAY


def set_tensor_offset(path, name: str, offset: int) -> None:
    """Point tensor `name`'s data at `offset` (from the start of the data section), in place."""
    import gguf

    reader = gguf.GGUFReader(path, "r+")
    tensor = next(t for t in reader.tensors if t.name == name)
    tensor.field.parts[-1][0] = offset  # the parts are views of the mapped file
    reader.data.flush()


def set_tensor_type(path, name: str, ggml_type: int) -> None:
    """Declare tensor `name`'s data to be of `ggml_type` (gguf.GGMLQuantizationType), in place."""
    import gguf

    reader = gguf.GGUFReader(path, "r+")
    tensor = next(t for t in reader.tensors if t.name == name)
    tensor.field.parts[-2][0] = ggml_type  # name length, name, dimension count, dimensions, type, offset
    reader.data.flush()
