"""Checks on what callers pass in, done before anything is submitted: a bad
argument raises flexinfer.InvalidArgument and changes nothing.

Two kinds of problems are told apart. A malformed argument (bytes for a
prompt, a float token id, a message without content) raises at once. A
well-formed request that cannot run (an empty prompt, one longer than
max_model_len) fails alone: `request_problem` names it, and LLM.generate
returns it as that request's error while the others run.
"""

from __future__ import annotations

import numbers
from typing import Any

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
    """None, one SamplingParams for every prompt, or a list of one per prompt."""
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if isinstance(params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in params):
        if len(params) != count:
            raise InvalidArgument(f"one SamplingParams per prompt ({count}), or a single one for all; "
                                  f"got {len(params)}")
        return list(params)
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


def request_problem(prompt_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int) -> str | None:
    """Why a well-formed request cannot run, or None."""
    if not prompt_ids:
        return "the prompt is empty"
    if len(prompt_ids) + params.max_tokens > max_model_len:
        return (f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len {max_model_len}")
    if max(prompt_ids) >= vocab_size or min(prompt_ids) < 0:
        return "a prompt token id is outside the vocabulary"
    outside = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if outside:
        return f"stop_token_ids {outside[:4]} are outside the vocabulary (0 to {vocab_size - 1})"
    return None


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"
