"""Typed errors raised by FlexInfer.

Every error a caller can act on derives from FlexInferError; the ones caused by bad
input also derive from ValueError so that generic `except ValueError` handlers keep
working.
"""


class FlexInferError(Exception):
    """Base class of every error FlexInfer raises on purpose."""


class InvalidArgument(FlexInferError, ValueError):
    """A bad argument or request: an unknown option, a value out of range, a
    prompt that does not fit. Nothing was changed."""


class ModelLoadError(FlexInferError, ValueError):
    """A model could not be loaded: missing or malformed file, or an unsupported
    architecture, quantization type or tokenizer. The message names the file."""


class ChatTemplateError(FlexInferError, ValueError):
    """A chat template is missing, or it rejected the conversation (its
    `raise_exception(...)` was called)."""


class EngineError(FlexInferError):
    """A request failed inside the engine: the model produced NaN or infinite
    logits for it, or a step it was part of raised. It failed alone (with the
    other requests of that step); the engine goes on serving."""


class EngineClosed(FlexInferError):
    """The engine was closed (or is closing): no request is accepted any more."""
