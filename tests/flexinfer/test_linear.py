"""Linear: every kernel kind computes what F.linear computes, for the row
counts the engine feeds it (one decode row to a long prefill chunk)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexinfer.errors import InvalidArgument
from flexinfer.kernels import triton_available
from flexinfer.kernels.cpu_linear import PackedWeight, has_amx_bf16, has_bf16_dot_product
from flexinfer.model import linear as linear_module
from flexinfer.model.linear import (ROW_BUCKETS, Linear, available_kinds, bucket_of, measure_kinds, onednn_available,
                                    resolve_linear_kind)

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(not onednn_available(CPU, torch.float32), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 8, 33, 512])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_onednn_matches_float64_reference(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 64, generator=gen)
    got = Linear(weight, bias, "onednn")(x)
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.shape == (rows, 96) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


@needs_onednn
def test_onednn_takes_strided_and_batched_inputs():
    weight = torch.randn(40, 24)
    layer = Linear(weight, None, "onednn")
    wide = torch.randn(5, 50)
    torch.testing.assert_close(layer(wide[:, 3:27]), F.linear(wide[:, 3:27], weight), atol=1e-5, rtol=1e-5)
    x = torch.randn(2, 3, 24)
    torch.testing.assert_close(layer(x), F.linear(x, weight), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not onednn_available(CPU, torch.bfloat16), reason="torch built without oneDNN")
def test_onednn_bfloat16_matches_torch():
    weight = torch.randn(64, 128).bfloat16()
    x = torch.randn(4, 128).bfloat16()
    got = Linear(weight, None, "onednn")(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(x.float(), weight.float()), atol=0.1, rtol=1e-2)


def test_kind_resolution():
    assert resolve_linear_kind("torch", CPU, torch.float32) == "torch"
    # On CUDA "auto" times the fused decode layers at load where Triton is installed; "triton" is CUDA's only.
    cuda = torch.device("cuda")
    assert resolve_linear_kind("auto", cuda, torch.float16) == ("auto" if triton_available() else "torch")
    if triton_available():
        assert resolve_linear_kind("triton", cuda, torch.bfloat16) == "triton"
    with pytest.raises(ValueError, match="triton linear kernels run .* on CUDA"):
        resolve_linear_kind("triton", CPU, torch.float32)
    if onednn_available(CPU, torch.float32):
        assert resolve_linear_kind("auto", CPU, torch.float32) == "auto"  # measured at load
    with pytest.raises(ValueError, match="linear must be one of"):
        resolve_linear_kind("mkl", CPU, torch.float32)
    with pytest.raises(ValueError, match="onednn linear kernel needs"):
        resolve_linear_kind("onednn", CPU, torch.float16)
    assert resolve_linear_kind("packed", CPU, torch.bfloat16) == "packed"
    with pytest.raises(ValueError, match="packed linear kernel runs"):
        resolve_linear_kind("packed", CPU, torch.float16)


@pytest.mark.parametrize("kind", available_kinds(CPU, torch.float32))
def test_residual_is_added(kind):
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(32, 48, generator=gen), torch.randn(32, generator=gen)
    x, residual = torch.randn(5, 48, generator=gen), torch.randn(5, 32, generator=gen)
    before = residual.clone()
    got = Linear(weight, bias, kind)(x, residual=residual)
    want = residual.double() + F.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    assert torch.equal(residual, before)  # the residual input is not written


needs_onednn = pytest.mark.skipif(not onednn_available(CPU, torch.float32), reason="no oneDNN in this torch")


@needs_onednn
def test_measured_choice_names_a_kernel_per_bucket(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    choice = measure_kinds([torch.randn(96, 64, generator=gen), torch.randn(64, 96, generator=gen)], repeats=2)
    assert set(choice) == set(ROW_BUCKETS) and set(choice.values()) <= {"torch", "onednn", "packed"}
    # Measured once per process: the same shapes get the same answer without timing again.
    monkeypatch.setattr(linear_module, "_measure", lambda *a: pytest.fail("measured twice"))
    assert measure_kinds([torch.randn(96, 64, generator=gen), torch.randn(64, 96, generator=gen)]) == choice


@needs_onednn
def test_mixed_kinds_run_each_bucket_on_its_kernel():
    """A layer whose buckets chose different kernels gives the same result at every row count."""
    gen = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    layer = Linear(weight, bias, {1: "packed", 8: "onednn", 32: "torch", 128: "onednn"})
    assert layer.kind == "mixed" and set(layer.weights) == {"torch", "onednn", "packed"}
    for rows in (1, 2, 8, 9, 32, 100, 300):
        assert bucket_of(rows) == next((b for b in ROW_BUCKETS if rows <= b), ROW_BUCKETS[-1])
        x = torch.randn(rows, 24, generator=gen)
        want = F.linear(x.double(), weight.double(), bias.double())
        torch.testing.assert_close(layer(x).double(), want, atol=1e-4, rtol=1e-5)


# -- the packed kernel (src/flexinfer/csrc/linear_cpu.cc) ---------------------------

# Shapes around the kernel's edges: a slab is 32 columns and a row tile 8 rows
# at 16 lanes, 3 at 8 (rows cover each tile size and tail at both); bfloat16
# pairs k, so odd k leaves a half pair.
PACKED_SHAPES = [(96, 64), (33, 17), (31, 1), (64, 576), (50, 7)]


def _reference(x, weight, bias=None, residual=None):
    y = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    return y if residual is None else y + residual.double()


@pytest.mark.parametrize("n,k", PACKED_SHAPES)
@pytest.mark.parametrize("rows", [1, 4, 5, 8, 9, 33])
def test_packed_float32_matches_float64_reference(n, k, rows):
    gen = torch.Generator().manual_seed(n * 1000 + k + rows)
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x, residual = torch.randn(rows, k, generator=gen), torch.randn(rows, n, generator=gen)
    layer = PackedWeight(weight)
    torch.testing.assert_close(layer(x).double(), _reference(x, weight), atol=1e-4, rtol=1e-5)
    got = layer(x, bias, residual)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(x, weight, bias, residual), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", PACKED_SHAPES)
def test_packed_rounds_a_row_the_same_whatever_the_rows_beside_it(n, k, dtype):
    """docs/flexinfer-api.md (`linear`) promises it: a request's logits, and so
    its sampled tokens, must not change with its batch, a preemption or a
    prompt chunk's size. F.linear (MKL's sgemm) rounds by row count: on the
    dev machine a tiny Mistral's seeded sample changed its 7th token when its
    siblings shared its batch, under linear="auto" (torch at one row, packed
    at eight)."""
    gen = torch.Generator().manual_seed(n * 1000 + k)
    weight, bias = torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(70, k, generator=gen).to(dtype)
    layer = PackedWeight(weight)
    alone = torch.cat([layer(x[i:i + 1], bias) for i in range(len(x))])
    for rows in (2, 3, 8, 9, 33, 70):
        assert torch.equal(layer(x[:rows], bias), alone[:rows]), rows


def _bf16_reference(x, weight, bias=None, residual=None):
    """float32 sums of the bfloat16 products, bias and residual added in
    float32, rounded once: what the kernel claims."""
    return _reference(x, weight, bias, residual).float().bfloat16()


@pytest.mark.parametrize("n,k", PACKED_SHAPES)
@pytest.mark.parametrize("rows", [1, 8, 9, 20, 33, 70])
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_packed_bfloat16_rounds_a_float32_sum_once(n, k, rows, portable):
    gen = torch.Generator().manual_seed(n * 1000 + k + rows)
    weight, bias = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(n, generator=gen).bfloat16()
    x, residual = torch.randn(rows, k, generator=gen).bfloat16(), torch.randn(rows, n, generator=gen).bfloat16()
    got = PackedWeight(weight)(x, bias, residual, portable=portable)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    want = _bf16_reference(x, weight, bias, residual)
    # Summation order differs from float64's: at most one bfloat16 step apart.
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2 ** -7)


@pytest.mark.skipif(not (has_amx_bf16() or has_bf16_dot_product()),
                    reason="this CPU runs bfloat16 on the portable code only: nothing to compare it with")
@pytest.mark.parametrize("k", [96, 90], ids=["k%32==0", "k%32!=0"])
def test_packed_bfloat16_paths_agree(k):
    """AMX tiles (k a multiple of 32) or the AVX512-BF16 dot product, where
    the CPU has them, and the portable widening code give the same values up
    to float32 summation order."""
    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(200, k, generator=gen).bfloat16()
    x = torch.randn(12, k, generator=gen).bfloat16()
    layer = PackedWeight(weight)
    torch.testing.assert_close(layer(x).float(), layer(x, portable=True).float(), atol=1e-2, rtol=2 ** -7)


def test_packed_takes_strided_batched_inputs_and_threads():
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(70, 24, generator=gen)
    layer = PackedWeight(weight)
    wide = torch.randn(11, 50, generator=gen)
    for threads in (1, 2, 3):
        torch.testing.assert_close(layer(wide[:, 3:27], threads=threads).double(), _reference(wide[:, 3:27], weight),
                                   atol=1e-4, rtol=1e-5)
    x = torch.randn(2, 3, 24, generator=gen)
    residual = torch.randn(2, 3, 70, generator=gen)
    torch.testing.assert_close(layer(x, residual=residual).double(), _reference(x, weight, residual=residual),
                               atol=1e-4, rtol=1e-5)
    assert layer(torch.randn(0, 24)).shape == (0, 70)


def test_packed_refuses_bad_input_and_writes_nothing():
    layer = PackedWeight(torch.randn(40, 24))
    residual = torch.randn(3, 40)
    before = residual.clone()
    with pytest.raises(InvalidArgument, match="x must be"):
        layer(torch.randn(3, 25))
    with pytest.raises(InvalidArgument, match="x must be"):
        layer(torch.randn(3, 24).bfloat16())
    with pytest.raises(InvalidArgument, match="bias must be"):
        layer(torch.randn(3, 24), bias=torch.randn(41))
    with pytest.raises(InvalidArgument, match="residual must be"):
        layer(torch.randn(3, 24), residual=torch.randn(3, 41))
    assert torch.equal(residual, before)
    for bad in (torch.randn(4), torch.randn(4, 4).half(), torch.randn(2, 2, 2)):
        with pytest.raises(InvalidArgument, match="packed weight is"):
            PackedWeight(bad)


def test_packed_nan_stays_nan_in_bfloat16():
    weight = torch.ones(32, 16).bfloat16()
    x = torch.ones(2, 16).bfloat16()
    x[1, 3] = float("nan")
    got = PackedWeight(weight)(x)
    assert torch.all(got[0] == 16) and torch.all(torch.isnan(got[1]))
