"""The packed linear kernel (C++, src/flexinfer/csrc/linear_cpu.cc): a weight
packed once, then y = x @ W.T (+ bias) (+ residual) for few rows.

The kernel reads every weight element once per call for all rows, so a decode
step's projections run as fast as the weights stream from memory; see
linear_cpu.h for the layout and why. This module checks shapes, dtypes and
devices torch-side and passes raw pointers.
"""

from __future__ import annotations

import torch

from flexinfer import _kernels
from flexinfer.errors import InvalidArgument
from flexinfer.kernels import FLOAT32_BFLOAT16_CODES as _DTYPE_CODES



def has_amx_bf16() -> bool:
    """Whether bfloat16 calls with in_features a multiple of 32 run on AMX
    tiles (the CPU has AMX-BF16 and Linux granted this process the tile state)."""
    return _kernels.has_amx_bf16()


def has_bf16_dot_product() -> bool:
    """Whether bfloat16 calls run on the CPU's AVX512-BF16 dot product
    (otherwise on vector code that widens the weights to float32)."""
    return _kernels.has_bf16_dot_product()


class PackedWeight:
    """W [out_features, in_features] (float32 or bfloat16, CPU) packed for
    the kernel. The original weight is not kept."""

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype not in _DTYPE_CODES:
            raise InvalidArgument(f"a packed weight is a 2-D float32 or bfloat16 CPU tensor, got "
                                  f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
        if weight.stride(1) != 1:
            weight = weight.contiguous()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self._code = _DTYPE_CODES[weight.dtype]
        size = _kernels.packed_linear_size(self.out_features, self.in_features, self._code)
        self.data = torch.empty(size, dtype=weight.dtype)
        _kernels.pack_linear_weight(weight.data_ptr(), weight.stride(0), self.out_features, self.in_features,
                                    self._code, self.data.data_ptr())

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                 threads: int | None = None, portable: bool = False) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features] (+ bias) (+ residual, of
        the output's shape; not written). `portable` forces the portable
        vector code where AMX or the AVX512-BF16 dot product would run."""
        n, k = self.out_features, self.in_features
        if x.dtype is not self.dtype or not x.is_cpu or x.dim() == 0 or x.shape[-1] != k:
            raise InvalidArgument(f"x must be a {self.dtype} CPU tensor [..., {k}], got "
                                  f"{tuple(x.shape)} {x.dtype} on {x.device}")
        # The engine passes dense 2-D rows: no reshape or copy for them.
        rows = x if x.dim() == 2 else x.reshape(-1, k)
        m = rows.shape[0]
        x_stride, k_stride = rows.stride()
        if k_stride != 1 or (m > 1 and x_stride < k):
            rows = rows.contiguous()
            x_stride = k
        if bias is not None and (bias.shape != (n,) or bias.dtype is not self.dtype or not bias.is_cpu
                                 or bias.stride(0) != 1):
            raise InvalidArgument(f"bias must be a contiguous {self.dtype} CPU tensor [{n}]")
        res_rows, res_stride = None, 0
        if residual is not None:
            if residual.shape != x.shape[:-1] + (n,) or residual.dtype is not self.dtype or not residual.is_cpu:
                raise InvalidArgument(f"residual must be a {self.dtype} CPU tensor {tuple(x.shape[:-1]) + (n,)}")
            res_rows = residual if residual.dim() == 2 else residual.reshape(-1, n)
            res_stride, n_stride = res_rows.stride()
            if n_stride != 1 or (m > 1 and res_stride < n):
                res_rows = res_rows.contiguous()
                res_stride = n
        y = torch.empty(m, n, dtype=self.dtype)
        try:
            _kernels.linear(rows.data_ptr(), x_stride if m > 1 else k, self.data.data_ptr(),
                            0 if bias is None else bias.data_ptr(),
                            0 if res_rows is None else res_rows.data_ptr(), res_stride if m > 1 else n,
                            y.data_ptr(), n, m, n, k, self._code,
                            torch.get_num_threads() if threads is None else threads, portable)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        return y if x.dim() == 2 else y.view(*x.shape[:-1], n)
