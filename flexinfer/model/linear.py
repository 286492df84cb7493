"""Linear layers with their weights prepared once for the kernel that runs them.

Why not plain `F.linear`: on CPU, torch sends float32 matmuls to MKL's sgemm,
which on AMD processors takes a generic path. Decode multiplies a few rows by
every weight matrix, so each step streams all weights once; measured with
scripts/bench_linear.py on the 2-core EPYC dev machine over SmolLM2's 538 MB of
float32 projections, sgemm moves 17 GB/s at one row and 12 GB/s at eight, on a
machine that streams 45-80 GB/s. oneDNN's matmul, with each weight reordered
once into its blocked layout, moves 41 and 36 GB/s (0.41x and 0.34x the time
per step); in bfloat16 it is also faster than torch's own path (see the script's
--dtype). The reorder happens at load and the blocked copy replaces the
original, so it costs no memory (beyond the embedding table when the LM head
shares it); the engine's load frees each original as it goes.

`kind="torch"` keeps `F.linear` everywhere (the reference path; also what runs
on CUDA, where cuBLAS needs no help).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexinfer.errors import InvalidArgument

LINEAR_KINDS = ("auto", "onednn", "torch")

# The row count oneDNN tunes its blocked layout for; decode batches are this small.
_ROWS_HINT = 8


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    if not (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        # Without native bfloat16 instructions oneDNN falls back to slow reference kernels.
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def resolve_linear_kind(kind: str, device: torch.device, dtype: torch.dtype) -> str:
    if kind not in LINEAR_KINDS:
        raise InvalidArgument(f"linear must be one of {LINEAR_KINDS}, got {kind!r}")
    if kind == "auto":
        return "onednn" if onednn_available(device, dtype) else "torch"
    if kind == "onednn" and not onednn_available(device, dtype):
        raise InvalidArgument(f"the onednn linear kernel needs a CPU torch with oneDNN and float32 or bfloat16, "
                              f"not {device.type}/{dtype}")
    return kind


class Linear:
    """y = x @ weight.T + bias (+ residual) for x of shape [..., in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kind: str):
        self.in_features = weight.shape[1]
        self.bias = bias
        self.kind = kind
        if kind == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _ROWS_HINT)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """With `residual`, returns residual + linear(x); oneDNN adds it as the
        matmul writes its output, saving a pass over the result."""
        if self.kind == "onednn":
            if residual is not None:
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        y = F.linear(x, self.weight, self.bias)
        return y if residual is None else residual + y
