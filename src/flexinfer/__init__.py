"""FlexInfer: an LLM serving engine whose KV cache lives in vtm vTensors."""

from vtm import __version__
from flexinfer.engine import Engine
from flexinfer.engine_loop import RequestStream
from flexinfer.errors import (ChatTemplateError, EngineClosed, EngineError, FlexInferError, InvalidArgument,
                              ModelLoadError)
from flexinfer.llm import LLM
from flexinfer.outputs import CompletionOutput, RequestOutput, StreamEvent
from flexinfer.sampling import SamplingParams

__all__ = ["LLM", "Engine", "SamplingParams", "RequestOutput", "CompletionOutput", "StreamEvent", "RequestStream",
           "FlexInferError", "InvalidArgument", "ModelLoadError", "ChatTemplateError", "EngineError",
           "EngineClosed", "__version__"]
