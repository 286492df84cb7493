"""FlexInfer's kernels: attention over a vtm space's per-layer K/V views, one
call per layer for the whole batch (`cpu_attention` in C++, `triton_attention`
on CUDA), and the CPU linear kernel, layer ops and one-call decoder in C++
(`cpu_linear`, `cpu_layer_ops`, `cpu_decoder`)."""

import math
import operator

import torch

from flexinfer.errors import InvalidArgument

# The C++ kernels' dtype codes (csrc/cpu_numeric.h's DType).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# The dtypes of the linear kernel, the layer ops and the decoder.
FLOAT32_BFLOAT16_CODES = {dtype: DTYPE_CODES[dtype] for dtype in (torch.float32, torch.bfloat16)}


def triton_available() -> bool:
    """Whether the Triton kernels can be imported (CUDA's layer ops and sampler)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def check_variant(scale, window, softcap) -> tuple[float | None, int, float]:
    """A layer's attention variant, as (scale, window, softcap): scale None (the
    kernel's head_dim ** -0.5) or positive, window an int >= 0 (0: none),
    softcap >= 0 (0: none), all finite. Anything else is InvalidArgument."""
    try:
        window = operator.index(window)
        softcap = float(softcap)
        scale = None if scale is None else float(scale)
    except (TypeError, ValueError):
        raise InvalidArgument(f"scale, window and softcap must be numbers (window an int), got {scale!r}, "
                              f"{window!r}, {softcap!r}") from None
    # Negated comparisons: NaN fails them too.
    if scale is not None and not (0.0 < scale < math.inf):
        raise InvalidArgument(f"scale must be positive and finite, got {scale}")
    if window < 0:
        raise InvalidArgument(f"window must be 0 (none) or positive, got {window}")
    if not (0.0 <= softcap < math.inf):
        raise InvalidArgument(f"softcap must be 0 (none) or positive and finite, got {softcap}")
    return scale, window, softcap
