"""Linear layers with their weights prepared once for the kernel that runs them.

Three kernels exist on CPU: `torch` (F.linear: MKL's sgemm for float32),
`onednn` (oneDNN's matmul with each weight reordered once, at load, into its
blocked layout; AMX for bfloat16 where the CPU has it) and `packed`
(FlexInfer's own kernel for few rows, src/flexinfer/csrc/linear_cpu.h: weights
packed into column slabs, each element read once per call for every row).
Which is fastest depends on the processor, the dtype and the row count, and
the differences are large both ways (scripts/bench_linear.py, SmolLM2's 121
projections): on the 2-core AMD EPYC dev machine sgemm takes a generic path
and oneDNN needs 0.41x its time at one row; on an Intel Xeon with AMX sgemm
is fastest at one float32 row, `packed` at 8 and 32 (0.7-0.9x oneDNN's time),
and in bfloat16 `packed` runs on AMX tiles in half oneDNN's time at 32 rows.
So nothing is chosen by vendor: `kind="auto"` times the kernels at load on
the model's own first-layer shapes at each row bucket (1, 8, 32 rows and 128
for prefill chunks) and each layer then runs the winner of the bucket a
call's row count falls in. One layer's weights fit in cache where a whole
step's stream from memory, so a close call can go either way; the
differences that matter are the large ones. Where a CPU model can run its
layers as one C++ call, which needs `packed`, a tie (within TIE) at decode
row counts goes to `packed`.
When different buckets pick different kernels, a layer holds its weight in
each format (up to three times the projection memory); force one with
`kind="torch"`, `"onednn"` or `"packed"` to avoid that. The engine's load
frees each original weight as it goes.

On CUDA the projections run F.linear (cuBLAS). `triton` there is a choice
for decode steps of up to 8 rows: each layer runs as four Triton kernels,
the projections fused with the norm, rotary embedding and K/V write, SiLU
and residual adds around them (kernels/triton_linear.py); `auto` times that
against cuBLAS and the separate ops on the model's first layer at load
(model/fused_layer_timing.py).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from flexinfer.errors import InvalidArgument
from flexinfer.kernels import triton_available

LINEAR_KINDS = ("auto", "onednn", "packed", "torch", "triton")

# The row count oneDNN tunes its blocked layout for; decode batches are this small.
_ROWS_HINT = 8
# Row buckets timed by `measure_kinds`: a call with r rows uses the choice of
# the smallest bucket >= r (the last bucket beyond it).
ROW_BUCKETS = (1, 8, 32, 128)


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    if not (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        # Without native bfloat16 instructions oneDNN falls back to slow reference kernels.
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def packed_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)


def available_kinds(device: torch.device, dtype: torch.dtype) -> list[str]:
    """The kernels that can run this device and dtype, F.linear first."""
    return (["torch"] + (["onednn"] if onednn_available(device, dtype) else [])
            + (["packed"] if packed_available(device, dtype) else []))


def resolve_linear_kind(kind: str, device: torch.device, dtype: torch.dtype) -> str:
    if kind not in LINEAR_KINDS:
        raise InvalidArgument(f"linear must be one of {LINEAR_KINDS}, got {kind!r}")
    fused = device.type == "cuda" and dtype in (torch.float32, torch.bfloat16, torch.float16) and triton_available()
    if kind == "auto":
        return "auto" if len(available_kinds(device, dtype)) > 1 or fused else "torch"
    if kind == "triton" and not fused:
        raise InvalidArgument(f"the triton linear kernels run float32, bfloat16 or float16 on CUDA with Triton "
                              f"installed, not {device.type}/{dtype}")
    if kind == "packed" and not packed_available(device, dtype):
        raise InvalidArgument(f"the packed linear kernel runs float32 or bfloat16 on the CPU, not {device.type}/{dtype}")
    if kind == "onednn" and not onednn_available(device, dtype):
        raise InvalidArgument(f"the onednn linear kernel needs a CPU torch with oneDNN and float32 or bfloat16, "
                              f"not {device.type}/{dtype}")
    return kind


def bucket_of(rows: int) -> int:
    for bucket in ROW_BUCKETS:
        if rows <= bucket:
            return bucket
    return ROW_BUCKETS[-1]


# Choices already measured in this process, by (shapes, dtype, threads): two
# engines of one model (a benchmark and its baseline, two instances behind
# one server) run the same kernels instead of two noisy draws.
_measured: dict[tuple, dict[int, str]] = {}


# Kernels whose medians are within this factor of the fastest tie, and
# `prefer` then decides: timings of one cache-hot layer do not separate them
# (a close call flipped between runs), and the preferred kernel saves more
# than the timing sees (see measure_kinds). Only up to PREFER_MAX_ROWS rows:
# that saving is a fixed time per layer, which stops covering the margin once
# the projections take milliseconds (prefill chunks).
TIE = 1.15
# At one row the margin is wider, because this timing runs one layer's
# weights from cache while a one-row decode step streams the whole model from
# memory, which closes the gaps between kernels: float32, one thread (Xeon
# model 207), F.linear ran 0.80-1.17x packed's time here from run to run, but
# 954 against 955 us a layer streaming all 30 layers. At TIE the one-row
# choice flipped between processes and took the one call with it (42 against
# 49 ms a step).
ONE_ROW_TIE = 1.3
PREFER_MAX_ROWS = 32


def measure_kinds(weights: list[torch.Tensor], repeats: int = 7, prefer: str | None = None) -> dict[int, str]:
    """The faster kernel per row bucket for this chain of projections (one
    layer's weights, [out, in] each): the median of `repeats` interleaved
    timings of running every projection once per kernel. Among kernels that
    tie with the fastest (within TIE), `prefer` wins: a model that runs its
    layers in one C++ call when they use `packed` (kernels/cpu_decoder.py)
    prefers it, since that call saves ~80-90 us a layer at one row (float32
    SmolLM2: 24.8-25.7 ms a step against 27.5-28.1 through the Python loop),
    ~20 % of the ~440 us one layer's projections take in this timing. Measured
    once per process for a given set of shapes, dtype, thread count and
    preference."""
    key = (tuple(tuple(w.shape) for w in weights), weights[0].dtype, torch.get_num_threads(), prefer)
    if key not in _measured:
        _measured[key] = _measure(weights, repeats, prefer)
    return dict(_measured[key])


def choose_kind(medians: dict[str, float], prefer: str | None = None, rows: int = 1) -> str:
    """The fastest kernel by median seconds, or `prefer` where it ties (within
    ONE_ROW_TIE at one row, TIE at up to PREFER_MAX_ROWS rows)."""
    fastest = min(medians, key=medians.get)
    margin = ONE_ROW_TIE if rows == 1 else TIE
    if prefer in medians and rows <= PREFER_MAX_ROWS and medians[prefer] <= margin * medians[fastest]:
        return prefer
    return fastest


def _measure(weights: list[torch.Tensor], repeats: int, prefer: str | None) -> dict[int, str]:
    kinds = available_kinds(weights[0].device, weights[0].dtype)
    layers = {kind: [Linear(w, None, kind) for w in weights] for kind in kinds}
    choice = {}
    for rows in ROW_BUCKETS:
        inputs = [torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights]
        times = {kind: [] for kind in kinds}
        for rep in range(repeats + 1):
            for kind in kinds:
                start = time.perf_counter()
                for layer, x in zip(layers[kind], inputs):
                    layer(x)
                if rep:  # the first round warms caches and kernels up
                    times[kind].append(time.perf_counter() - start)
        choice[rows] = choose_kind({kind: statistics.median(times[kind]) for kind in kinds}, prefer, rows)
    return choice


class Linear:
    """y = x @ weight.T + bias (+ residual) for x of shape [..., in_features].

    `kind` is one kernel for every call, or a map from row bucket to kernel
    (see `measure_kinds`); the weight is prepared once per kernel used.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kind: str | dict[int, str]):
        self.in_features = weight.shape[1]
        self.bias = bias
        self.kinds = {bucket: kind for bucket in ROW_BUCKETS} if isinstance(kind, str) else dict(kind)
        self.kind = next(iter(self.kinds.values())) if len(set(self.kinds.values())) == 1 else "mixed"
        self.weights = {}
        for k in set(self.kinds.values()):
            if k == "onednn":
                self.weights[k] = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _ROWS_HINT)
            elif k == "packed":
                # Imported here: the compiled extension must not load with `import flexinfer`.
                from flexinfer.kernels.cpu_linear import PackedWeight

                self.weights[k] = PackedWeight(weight)
            else:
                self.weights[k] = weight

    def kind_for(self, rows: int) -> str:
        """The kernel a call with `rows` rows runs."""
        return self.kinds[bucket_of(rows)] if self.kind == "mixed" else self.kind

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """With `residual`, returns residual + linear(x); oneDNN adds it as the
        matmul writes its output, saving a pass over the result."""
        kind = self.kind_for(x.numel() // self.in_features)
        weight = self.weights[kind]
        if kind == "packed":
            return weight(x, self.bias, residual)
        if kind == "onednn":
            if residual is not None:
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, self.bias, "add")
            return torch.ops.mkldnn._linear_pointwise(x, weight, self.bias, "none", [], "")
        y = F.linear(x, weight, self.bias)
        return y if residual is None else residual + y
