"""GGUF vocabularies the loader tests write: shared by test_loader.py and test_gguf_families.py."""

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
