"""Checks on what callers pass in, done before anything is submitted: a bad
argument raises flexinfer.InvalidArgument and changes nothing.

Two kinds of problems are told apart. A malformed argument (bytes for a
prompt, a float token id, a message without content) raises at once. A
well-formed request that cannot run (an empty prompt, one longer than
max_model_len) fails alone: `request_problem` names it, and LLM.generate
returns it as that request's error while the others run.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, NamedTuple

from flexinfer.errors import InvalidArgument
from flexinfer.sampling import SamplingParams


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_text(text: str, what: str = "a prompt") -> str:
    """Text must be encodable as UTF-8: a lone surrogate (from a file read
    with errors='surrogateescape', say) is not text the tokenizer can read."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"{what} is not valid Unicode text ({exc.reason} at index {exc.start})") from None
    return text


def check_prompt(prompt: Any, index: int | None = None) -> str | list[int]:
    """A prompt is a str or a sequence of int token ids; returns it as str or list[int]."""
    where = "prompt" if index is None else f"prompt {index}"
    if isinstance(prompt, str):
        return check_text(prompt, where)
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise InvalidArgument(f"{where} is bytes: decode it to str first (token ids are a list of int)")
    if isinstance(prompt, (list, tuple)) and all(_is_int(t) for t in prompt):
        return [int(t) for t in prompt]
    raise InvalidArgument(f"{where} must be a str or a list of int token ids, got {_describe(prompt)}")


def check_prompts(prompts: Any) -> list[str | list[int]]:
    """`prompts` is one prompt (a str, or a list of token ids) or a list of prompts."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and _is_int(prompts[0])):
        return [check_prompt(prompts)]
    if not isinstance(prompts, (list, tuple)):
        raise InvalidArgument(f"prompts must be a str, a list of token ids or a list of prompts, "
                              f"got {_describe(prompts)}")
    return [check_prompt(p, i) for i, p in enumerate(prompts)]


def check_params(params: Any, count: int) -> list[SamplingParams]:
    """None, one SamplingParams for every prompt, or a list of one per prompt.

    Returns copies, checked again: a SamplingParams is a plain dataclass,
    checked only when built, and one changed since (`params.n = 0`) reached
    the engine thread unchecked, where it failed deep inside (an IndexError,
    a step failing its batch mates) or ran as no valid one could (a token
    for max_tokens=0). A request keeps its copy, so changing the caller's
    object afterwards changes no request already submitted."""
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [dataclasses.replace(params)] * count
    if isinstance(params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in params):
        if len(params) != count:
            raise InvalidArgument(f"one SamplingParams per prompt ({count}), or a single one for all; "
                                  f"got {len(params)}")
        return [dataclasses.replace(p) for p in params]
    raise InvalidArgument(f"sampling_params must be a SamplingParams or a list of them, got {_describe(params)}")


def check_priorities(priorities: Any, count: int) -> list[int]:
    if priorities is None:
        return [0] * count
    if not isinstance(priorities, (list, tuple)) or not all(_is_int(p) for p in priorities):
        raise InvalidArgument(f"priorities must be a list of int, got {_describe(priorities)}")
    if len(priorities) != count:
        raise InvalidArgument(f"one priority per prompt ({count}), got {len(priorities)}")
    return [int(p) for p in priorities]


def check_conversation(conversation: Any, index: int | None = None) -> list[dict[str, str]]:
    """A conversation is a non-empty list of {"role": str, "content": str} messages."""
    where = "the conversation" if index is None else f"conversation {index}"
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise InvalidArgument(f"{where} must be a non-empty list of messages, got {_describe(conversation)}")
    for i, message in enumerate(conversation):
        if not isinstance(message, dict):
            raise InvalidArgument(f"{where}: message {i} must be a dict with 'role' and 'content', "
                                  f"got {_describe(message)}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise InvalidArgument(f"{where}: message {i} needs a str {key!r}, got {_describe(message.get(key))}")
            check_text(message[key], f"{where}: message {i}'s {key}")
    return [dict(m) for m in conversation]


@dataclasses.dataclass(frozen=True)
class KVBudget:
    """The KV memory one request can ever have: the whole pool to itself.

    `row_bytes`: one token's KV in each layer group (a vTensor per group);
    `chunks`: the pool's chunks, less those the engine holds for its life.
    A request of P prompt tokens and up to M new ones writes the KV of
    P + M - 1 tokens (the last token sampled is never fed back), each
    group's vTensor rounded up to whole chunks. With prefix caching the
    prompt is recorded when its prefill ends, and the tree keeps its own
    copy of each group's partial last prompt page while the request runs:
    one chunk more per group (measured: on 8-token pages a 15-token prompt
    fits 120 tokens of KV in 16 chunks, a 16-token one 128). A prefix hit
    whose matched length ends inside a page holds one more such copy, which
    this bound does not count: a request within a chunk of the whole pool
    may still run out of memory after a hit.

    `windows`: per group, its sliding window (0: every token). A window
    group's vTensor holds at most the window and the tokens of one step
    (`step_tokens`) and the page the window starts in, however long the
    request grows.

    `limit_bytes`: a vtm broker's limit for this client where it, not the
    pool, bounds `chunks` (0: the pool does); the operator may change it."""

    row_bytes: tuple[int, ...]
    chunk_bytes: int
    chunks: int
    prefix_caching: bool
    windows: tuple[int, ...] = ()
    step_tokens: int = 0
    limit_bytes: int = 0

    def chunks_needed(self, prompt_tokens: int, max_tokens: int) -> int:
        return self._chunks_for(prompt_tokens + max_tokens - 1) + self._prompt_copies(prompt_tokens)

    def max_new_tokens(self, prompt_tokens: int) -> int:
        """The most tokens a request with this prompt may ask for (0: none fit)."""
        tokens = self._most_tokens(self.chunks - self._prompt_copies(prompt_tokens))
        return max(0, tokens - prompt_tokens + 1)

    @property
    def max_tokens(self) -> int:
        """The most tokens of KV one request can hold (prompt copies aside): the pool in tokens."""
        return self._most_tokens(self.chunks)

    def _chunks_for(self, tokens: int) -> int:
        windows = self.windows or (0,) * len(self.row_bytes)
        total = 0
        for row, window in zip(self.row_bytes, windows):
            rows = tokens if not window else min(tokens, window + self.step_tokens)
            total += -(-rows * row // self.chunk_bytes) + (1 if window and rows < tokens else 0)
        return total

    def _prompt_copies(self, prompt_tokens: int) -> int:
        if not self.prefix_caching:
            return 0
        return sum(1 for row in self.row_bytes if prompt_tokens * row % self.chunk_bytes)

    def _most_tokens(self, chunks: int) -> int:
        """The largest T whose KV takes at most `chunks` chunks (0 if none)."""
        low, high = 0, max(0, chunks) * self.chunk_bytes // max(1, min(self.row_bytes))
        while low < high:
            mid = (low + high + 1) // 2
            if self._chunks_for(mid) <= chunks:
                low = mid
            else:
                high = mid - 1
        return low


class RequestProblem(NamedTuple):
    """Why a well-formed request cannot run: `message`, and `param`, the
    field at fault ("prompt": the prompt or what it asks for with it, its
    length and max_tokens; "stop_token_ids")."""

    message: str
    param: str


def request_problem(prompt_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int,
                    eos_ids: tuple[int, ...], kv: KVBudget | None = None,
                    max_tokens_name: str | None = "max_tokens") -> RequestProblem | None:
    """Why a well-formed request cannot run, or None. With `kv`, a request
    whose KV can never fit in the pool is one of them: admitted, it would
    run until memory ran out and then fail with its output lost. `eos_ids`:
    the model's end-of-sequence ids, which stop a sample (and are banned
    before min_tokens) unless it ignores them. `max_tokens_name`: what the
    caller called max_tokens (None: it left max_tokens to the server)."""
    if not prompt_ids:
        return RequestProblem("the prompt is empty", "prompt")
    if max_tokens_name:
        asked = f"{max_tokens_name} ({params.max_tokens})"
    else:
        asked = "one new token" if params.max_tokens == 1 else f"the default max_tokens ({params.max_tokens})"
    if len(prompt_ids) + params.max_tokens > max_model_len:
        return RequestProblem(f"prompt ({len(prompt_ids)} tokens) + {asked} exceeds max_model_len {max_model_len}",
                              "prompt")
    if max(prompt_ids) >= vocab_size or min(prompt_ids) < 0:
        return RequestProblem("a prompt token id is outside the vocabulary", "prompt")
    outside = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if outside:
        return RequestProblem(f"stop_token_ids {outside[:4]} are outside the vocabulary (0 to {vocab_size - 1})",
                              "stop_token_ids")
    if params.min_tokens:
        # Every one of them is banned before min_tokens (Sequence.banned_ids):
        # with none left, no token could be sampled, and the engine would
        # fail the request as if the model had produced no finite logit.
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        if sum(1 for t in banned if 0 <= t < vocab_size) == vocab_size:
            eos = "" if params.ignore_eos else " with the end-of-sequence ids (ignore_eos is false)"
            return RequestProblem(f"stop_token_ids{eos} cover the whole vocabulary ({vocab_size} tokens): they leave "
                                  f"no token to sample before min_tokens ({params.min_tokens})", "stop_token_ids")
    if kv is not None and kv.chunks_needed(len(prompt_ids), params.max_tokens) > kv.chunks:
        fit = kv.max_new_tokens(len(prompt_ids))
        where = (f"this client's share of the KV pool (the vtm broker's limit for it, {kv.limit_bytes} bytes, "
                 f"which its operator may change)" if kv.limit_bytes else "the KV pool")
        return RequestProblem(
            f"prompt ({len(prompt_ids)} tokens) + {asked} can never fit in {where}: "
            f"it needs {kv.chunks_needed(len(prompt_ids), params.max_tokens)} chunks of "
            f"{kv.chunk_bytes} bytes and one request can have at most {kv.chunks}; "
            + (f"at most {fit} new tokens fit after this prompt" if fit else "this prompt alone does not fit"),
            "prompt")
    return None


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"
