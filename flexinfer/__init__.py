"""FlexInfer: an LLM serving engine whose KV cache lives in vtm vTensors."""

from flexinfer.engine import LLM, CompletionOutput, RequestOutput
from flexinfer.errors import ChatTemplateError, FlexInferError, InvalidArgument, ModelLoadError
from flexinfer.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "FlexInferError", "InvalidArgument",
           "ModelLoadError", "ChatTemplateError"]
