"""Text <-> token ids, chat templates and streaming detokenisation.

Invariant: a Tokenizer wraps one `tokenizers.Tokenizer` that reproduces the model's
original tokenisation exactly; ids are those of the model's embedding table. Built
either from a Hugging Face tokenizer.json or from the metadata of a GGUF file.
"""

from __future__ import annotations

import json
import math
import re
import threading
import uuid
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from flexinfer.errors import ChatTemplateError, ModelLoadError

# GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
_GGUF_TOKEN_NORMAL, _GGUF_TOKEN_UNKNOWN, _GGUF_TOKEN_CONTROL, _GGUF_TOKEN_USER_DEFINED = 1, 2, 3, 4
_GGUF_TOKENS_MATCHED_WHOLE = (_GGUF_TOKEN_UNKNOWN, _GGUF_TOKEN_CONTROL, _GGUF_TOKEN_USER_DEFINED)
# SentencePiece tokens that pieces of text merge into (not <0xNN> bytes, not control tokens).
_GGUF_MERGEABLE_TYPES = (_GGUF_TOKEN_NORMAL, _GGUF_TOKEN_USER_DEFINED)
# SentencePiece's stand-in for a space.
_SPM_SPACE = "\u2581"
# A SentencePiece byte-fallback token: one byte of a character outside the vocabulary.
_SPM_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")

# GPT-2's split rule; the base of most byte-level BPE pre-tokenizers.
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# `tokenizer.ggml.pre` names llama.cpp's pre-tokenizer; each is a list of regexes applied in
# turn (every match isolated), then the byte-level mapping. "smollm" (like StarCoder's)
# isolates every digit first, then applies GPT-2's rule.
_GGUF_PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2_PATTERN,),
    "gpt-2": (_GPT2_PATTERN,),
    "smollm": (r"\p{N}", _GPT2_PATTERN),
    "starcoder": (r"\p{N}", _GPT2_PATTERN),
    "llama-bpe": (_LLAMA3_PATTERN,),
    "qwen2": (_QWEN2_PATTERN,),
}
# Llama 3's tokenizer looks a whole pre-token up in the vocabulary before merging.
_GGUF_IGNORE_MERGES = {"llama-bpe"}
# The special tokens' ids a GGUF file may give (the ones read here).
_GGUF_TOKEN_ID_KEYS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                       "tokenizer.ggml.eom_token_id", "tokenizer.ggml.unknown_token_id")


class Tokenizer:
    def __init__(self, backend: BackendTokenizer, *, bos_token_id: int | None,
                 eos_token_ids: Sequence[int], chat_template: str | None) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None
        # For the content of chat messages (encode_chat): the special tokens'
        # text, and the same tokenizer reading that text as the characters it is.
        added = backend.get_added_tokens_decoder().values()
        # The longest first, as the tokenizer matches them.
        specials = sorted({t.content for t in added if t.special and t.content}, key=len, reverse=True)
        self._special_pattern = re.compile("|".join(map(re.escape, specials))) if specials else None
        # Made on first need (~0.2 s for SmolLM2's vocabulary), but at once
        # where a Python decoder must be swapped out to copy the tokenizer:
        # later, another thread may be decoding with it.
        self._text_backend_lock = threading.Lock()
        self._text_backend = _specials_as_text(backend) if specials and _python_decoder(backend) else None

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_hf_folder(cls, folder: Path, eos_token_ids: Sequence[int]) -> Tokenizer:
        """tokenizer.json (+ tokenizer_config.json / chat_template.jinja when present).

        `eos_token_ids` are the model's end ids (config + generation config); the
        tokenizer's own eos token is added to them."""
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: missing (only fast tokenizers, tokenizer.json, are supported)")
        with _backend_errors(str(path)):
            backend = BackendTokenizer.from_file(str(path))

        config_path = folder / "tokenizer_config.json"
        tok_config: dict[str, Any] = {}
        if config_path.is_file():
            try:
                tok_config = json.loads(config_path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                raise ModelLoadError(f"{config_path}: malformed JSON: {exc}") from exc

        template_path = folder / "chat_template.jinja"
        if template_path.is_file():
            chat_template = template_path.read_text(encoding="utf-8")
        else:
            chat_template = _default_template(tok_config.get("chat_template"))

        bos_token_id = _special_token_id(backend, tok_config.get("bos_token"))
        eos_ids = list(eos_token_ids)
        tokenizer_eos = _special_token_id(backend, tok_config.get("eos_token"))
        if tokenizer_eos is not None and tokenizer_eos not in eos_ids:
            eos_ids.append(tokenizer_eos)
        return cls(backend, bos_token_id=bos_token_id, eos_token_ids=eos_ids, chat_template=chat_template)

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], source: str) -> Tokenizer:
        """From `tokenizer.ggml.*` keys: byte-level BPE ("gpt2": Llama 3, Qwen,
        SmolLM2) or SentencePiece ("llama": Gemma, Phi-3, Llama 2), tokenized
        as llama.cpp tokenizes them."""
        kind = metadata.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise ModelLoadError(f"{source}: unsupported GGUF tokenizer model {kind!r} "
                                 "(supported: byte-level BPE 'gpt2', SentencePiece 'llama')")
        tokens = _gguf_list(metadata, "tokenizer.ggml.tokens", str, source)
        if len(set(tokens)) != len(tokens):
            # A token listed twice has two ids and text encodes to only one of
            # them (the vocabulary keeps the last): llama.cpp refuses such a
            # file too (it asserts that every token has one id).
            seen: dict[str, int] = {}
            for index, token in enumerate(tokens):
                if token in seen:
                    raise ModelLoadError(f"{source}: tokenizer.ggml.tokens lists {token!r:.60} twice, "
                                         f"as ids {seen[token]} and {index}")
                seen[token] = index
        token_types = _gguf_list(metadata, "tokenizer.ggml.token_type", int, source, default=[])
        if token_types and len(token_types) != len(tokens):
            raise ModelLoadError(f"{source}: {len(token_types)} token types for {len(tokens)} tokens")
        for key in _GGUF_TOKEN_ID_KEYS:
            value = metadata.get(key)
            if value is not None and not (_is_int(value) and 0 <= value < len(tokens)):
                raise ModelLoadError(f"{source}: {key} is {value!r}, not one of the {len(tokens)} tokens' ids")
        backend = (_byte_level_bpe(metadata, tokens, source) if kind == "gpt2"
                   else _sentencepiece(metadata, tokens, token_types, source))
        # Control and unknown tokens are special (matched whole, dropped by
        # skip_special_tokens); user-defined ones are matched whole but are
        # ordinary text when decoding. llama.cpp matches all three in raw text first.
        backend.add_tokens([AddedToken(tokens[i], special=t != _GGUF_TOKEN_USER_DEFINED, normalized=False)
                            for i, t in enumerate(token_types) if t in _GGUF_TOKENS_MATCHED_WHOLE])

        bos_token_id = metadata.get("tokenizer.ggml.bos_token_id")
        eos_ids = [int(metadata[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                                  "tokenizer.ggml.eom_token_id") if k in metadata]
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")) and bos_token_id is not None
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and bool(eos_ids)
        if add_bos or add_eos:
            bos = [(tokens[bos_token_id], bos_token_id)] if add_bos else []
            eos = [(tokens[eos_ids[0]], eos_ids[0])] if add_eos else []
            single = " ".join([t for t, _ in bos] + ["$A"] + [t for t, _ in eos])
            backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=bos + eos)
        return cls(backend, bos_token_id=bos_token_id, eos_token_ids=list(dict.fromkeys(eos_ids)),
                   chat_template=metadata.get("tokenizer.chat_template"))

    # ---------------------------------------------------------------- encode / decode

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special-token strings in `text` (e.g. "<|im_start|>") always map to their ids;
        `add_special_tokens` adds the model's BOS/EOS framing, if it has one.

        Through encode_batch, which (unlike `encode`) lets go of the GIL while
        it runs: a long prompt tokenized on a worker thread then leaves the
        server's event loop free (about 1 s for 2 MB of text)."""
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_incremental(self, ids: Sequence[int], prefix_offset: int, read_offset: int,
                           skip_special_tokens: bool = True) -> tuple[str, int, int]:
        """Text that `ids[read_offset:]` adds to the text already emitted.

        Returns (new_text, prefix_offset, read_offset) to pass to the next call. Start a
        stream with prefix_offset = read_offset = 0, or, to stream only the output after a
        prompt of n tokens, with read_offset = n and prefix_offset a few tokens earlier.
        Decoding from `prefix_offset` rather than from the start keeps the cost per call
        constant, and still gives the tokenizer the left context it needs for spacing.
        Text ending in U+FFFD is an incomplete UTF-8 sequence split across tokens: it is
        held back until the next token completes it."""
        prefix_text = self.decode(ids[prefix_offset:read_offset], skip_special_tokens)
        full_text = self.decode(ids[prefix_offset:], skip_special_tokens)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            return full_text[len(prefix_text):], read_offset, len(ids)
        return "", prefix_offset, read_offset

    # ---------------------------------------------------------------- chat

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """The token ids of a conversation under the chat template.

        A message's content is text: special-token text in it (SmolLM2's
        "<|im_end|>") is tokenized as the characters it is, as OpenAI's API
        reads it, never as the special token, so that no client can write a
        turn its roles do not show (a system prompt of its own). The special
        tokens the template writes stay special. A conversation with no such
        text is tokenized as transformers' apply_chat_template(tokenize=True)
        does; one with it, as that would with each such text a stretch of its
        own, as a special token is."""
        if self._special_pattern is None or not any(self._special_pattern.search(m["content"]) for m in messages):
            return self.encode(self.apply_chat_template(messages, add_generation_prompt))
        # Each such text rendered as a stand-in nothing else holds, then
        # tokenized where its stand-in lies; the template still sees (and may
        # trim) the rest of the content.
        key = uuid.uuid4().hex
        found: list[str] = []

        def stand_in(match: re.Match) -> str:
            found.append(match.group())
            return f"\ue000{key}:{len(found) - 1}\ue000"

        marked = [dict(m, content=self._special_pattern.sub(stand_in, m["content"])) for m in messages]
        rendered = self.apply_chat_template(marked, add_generation_prompt)
        ids: list[int] = []
        for k, piece in enumerate(re.split(f"\ue000{key}:(\\d+)\ue000", rendered)):
            if k % 2 == 1:
                ids += self._specials_as_text().encode_batch([found[int(piece)]], add_special_tokens=False)[0].ids
            elif key in piece.lower():
                raise ChatTemplateError("the chat template changes message content (case, or cuts it) so that a "
                                        "special token's text in it cannot be kept apart as plain text")
            elif piece:
                ids += self.encode(piece)
        return ids

    def _specials_as_text(self) -> BackendTokenizer:
        with self._text_backend_lock:
            if self._text_backend is None:
                self._text_backend = _specials_as_text(self._backend)
            return self._text_backend

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render a conversation with the model's Jinja2 chat template, with the same
        environment and variables as Hugging Face transformers."""
        if self._compiled_template is None:
            if not self.chat_template:
                raise ChatTemplateError("this model has no chat template")
            try:
                self._compiled_template = _chat_environment().from_string(self.chat_template)
            except jinja2.TemplateError as exc:
                raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from exc
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None
        eos = self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None
        try:
            return self._compiled_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                  bos_token=bos or "", eos_token=eos or "")
        except jinja2.TemplateError as exc:  # e.g. a message lacks a field the template reads
            raise ChatTemplateError(f"the chat template rejected the conversation: {exc}") from exc


def _python_decoder(backend: BackendTokenizer) -> bool:
    # decoders.Decoder.custom's type is the base class; the built-in ones subclass it.
    return type(backend.decoder) is decoders.Decoder


def _specials_as_text(backend: BackendTokenizer) -> BackendTokenizer:
    """A copy of `backend` that reads special tokens' text as plain text.
    Built through its JSON, which a Python decoder has none of: a plain one
    stands in while it is written (so no other thread may use `backend`
    then), as the copy decodes nothing."""
    decoder = backend.decoder
    python_decoder = _python_decoder(backend)
    try:
        if python_decoder:
            backend.decoder = decoders.Fuse()
        copy = BackendTokenizer.from_str(backend.to_str())
    finally:
        if python_decoder:
            backend.decoder = decoder
    copy.encode_special_tokens = True
    return copy


def _byte_level_bpe(metadata: Mapping[str, Any], tokens: list[str], source: str) -> BackendTokenizer:
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _GGUF_PRE_TOKENIZERS:
        raise ModelLoadError(f"{source}: unsupported GGUF pre-tokenizer {pre!r} "
                             f"(supported: {', '.join(sorted(_GGUF_PRE_TOKENIZERS))})")
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = []
    for merge in _gguf_list(metadata, "tokenizer.ggml.merges", str, source):
        pair = tuple(merge.split(" ", 1))
        # The backend refuses a merge of unknown tokens, and panics on one whose result is unknown.
        if len(pair) != 2 or not (pair[0] in vocab and pair[1] in vocab and pair[0] + pair[1] in vocab):
            raise ModelLoadError(f"{source}: tokenizer.ggml.merges entry {merge!r} is not two tokens of the "
                                 "vocabulary that merge into a third")
        merges.append(pair)
    with _backend_errors(source):
        backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                              ignore_merges=pre in _GGUF_IGNORE_MERGES))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in _GGUF_PRE_TOKENIZERS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(metadata: Mapping[str, Any], tokens: list[str], token_types: list[int],
                   source: str) -> BackendTokenizer:
    """llama.cpp's SentencePiece tokenizer (llm_tokenizer_spm) as a BPE model.

    llama.cpp writes spaces as U+2581 (after a leading one where
    `add_space_prefix`, its default), splits the text into characters, then
    repeatedly joins the adjacent pair whose union is the vocabulary's
    highest-scoring token (the leftmost on a tie); a character outside the
    vocabulary becomes its UTF-8 bytes' <0xNN> tokens. A BPE model whose merges
    are every split of every token into two tokens, ranked by that token's
    score, makes the same choices. The text is never split into words."""
    scores = _gguf_list(metadata, "tokenizer.ggml.scores", (int, float), source)
    if len(scores) != len(tokens):
        raise ModelLoadError(f"{source}: {len(scores)} token scores for {len(tokens)} tokens")
    # The scores rank the merges: a NaN one compares false with every other,
    # so the order (and which merge wins) would depend on where it sits; an
    # infinite one is no log-probability, which SentencePiece's scores are.
    for index, score in enumerate(scores):
        if not math.isfinite(score):
            raise ModelLoadError(f"{source}: tokenizer.ggml.scores[{index}] is {score!r}, not a finite number")
    if metadata.get("tokenizer.ggml.precompiled_charsmap"):
        raise ModelLoadError(f"{source}: unsupported SentencePiece normalisation (tokenizer.ggml.precompiled_charsmap)")
    vocab = {token: index for index, token in enumerate(tokens)}
    mergeable = [i for i in range(len(tokens)) if not token_types or token_types[i] in _GGUF_MERGEABLE_TYPES]
    ranked = sorted(((-scores[i], i, token[:cut], token[cut:]) for i in mergeable if len(token := tokens[i]) > 1
                     for cut in range(1, len(token)) if token[:cut] in vocab and token[cut:] in vocab))
    unknown_id = metadata.get("tokenizer.ggml.unknown_token_id")
    with _backend_errors(source):
        backend = BackendTokenizer(models.BPE(
            vocab=vocab, merges=[(left, right) for _, _, left, right in ranked], byte_fallback=True, fuse_unk=True,
            unk_token=tokens[unknown_id] if unknown_id is not None else None))
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    # A normaliser runs on each stretch of text between special tokens, so
    # the prefix follows every special token too, as llama.cpp's does.
    backend.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(_SPM_SPACE)] if add_space_prefix else []) + [normalizers.Replace(" ", _SPM_SPACE)])
    backend.decoder = decoders.Decoder.custom(_SentencePieceDecoder(strip_leading_space=add_space_prefix))
    return backend


class _SentencePieceDecoder:
    """Tokens to text as llama.cpp's token_to_piece gives them: spaces for
    U+2581, <0xNN> tokens as their byte, all joined into one byte string
    whose invalid UTF-8 sequences become one U+FFFD each. The tokenizers
    library's ByteFallback decoder instead turns a whole run of byte tokens
    into one U+FFFD per byte when any of them is invalid: a newline (<0x0A>)
    before a character cut short or ill-formed would vanish from the text,
    which then disagrees with the text streamed before that character."""

    def __init__(self, strip_leading_space: bool) -> None:
        # The space llama.cpp prepends when encoding (add_space_prefix) is not the text's.
        self._strip_leading_space = strip_leading_space

    def decode_chain(self, tokens: list[str]) -> list[str]:
        data = bytearray()
        for token in tokens:
            byte = _SPM_BYTE_TOKEN.fullmatch(token)
            data += bytes([int(byte[1], 16)]) if byte else token.replace(_SPM_SPACE, " ").encode("utf-8")
        text = data.decode("utf-8", "replace")
        return [text[1:] if self._strip_leading_space and text.startswith(" ") else text]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _gguf_list(metadata: Mapping[str, Any], key: str, kind: type | tuple[type, ...], source: str,
               default: list | None = None) -> list:
    """metadata[key] (or `default` where absent), refused unless a list of
    `kind` (bools aside: GGUF keeps them apart from numbers)."""
    value = metadata.get(key, default)
    if value is None:
        raise ModelLoadError(f"{source}: GGUF metadata lacks {key}")
    if not isinstance(value, list):
        raise ModelLoadError(f"{source}: {key} must be an array, got {value!r:.60}")
    for index, item in enumerate(value):
        if not isinstance(item, kind) or isinstance(item, bool):
            raise ModelLoadError(f"{source}: {key}[{index}] is {item!r:.60}, not of the array's type")
    return value


@contextmanager
def _backend_errors(source: str) -> Iterator[None]:
    """The tokenizers library reports a malformed vocabulary as a bare
    Exception, and some as a Rust panic (pyo3_runtime.PanicException, a
    BaseException, which `except Exception` lets through): either is the
    file's fault, a ModelLoadError."""
    try:
        yield
    except Exception as exc:
        raise ModelLoadError(f"{source}: malformed tokenizer: {exc}") from exc
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":
            raise
        raise ModelLoadError(f"{source}: malformed tokenizer: {exc}") from exc


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _chat_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    # Same settings as transformers' chat templating, which is what templates are written for.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _default_template(value: str | list[dict[str, str]] | None) -> str | None:
    # tokenizer_config.json may hold several named templates; "default" is the chat one.
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value}
        return named.get("default")
    return value


def _special_token_id(backend: BackendTokenizer, token: str | dict[str, Any] | None) -> int | None:
    # tokenizer_config.json stores a special token as a string or as an AddedToken dict.
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if token else None
