"""FlexInfer's kernels: attention over a vtm space's per-layer K/V views, one
call per layer for the whole batch (`cpu_attention` in C++, `triton_attention`
on CUDA), and the CPU linear kernel, layer ops and one-call decoder in C++
(`cpu_linear`, `cpu_layer_ops`, `cpu_decoder`)."""

import torch

# The C++ kernels' dtype codes (csrc/cpu_numeric.h's DType).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# The dtypes of the linear kernel, the layer ops and the decoder.
FLOAT32_BFLOAT16_CODES = {dtype: DTYPE_CODES[dtype] for dtype in (torch.float32, torch.bfloat16)}
