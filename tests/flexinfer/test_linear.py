"""Linear: every kernel kind computes what F.linear computes, for the row
counts the engine feeds it (one decode row to a long prefill chunk)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexinfer.model import linear as linear_module
from flexinfer.model.linear import ROW_BUCKETS, Linear, bucket_of, measure_kinds, onednn_available, resolve_linear_kind

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
    assert resolve_linear_kind("auto", torch.device("cuda"), torch.float16) == "torch"
    if onednn_available(CPU, torch.float32):
        assert resolve_linear_kind("auto", CPU, torch.float32) == "auto"  # measured at load
    with pytest.raises(ValueError, match="linear must be one of"):
        resolve_linear_kind("mkl", CPU, torch.float32)
    with pytest.raises(ValueError, match="onednn linear kernel needs"):
        resolve_linear_kind("onednn", CPU, torch.float16)


@pytest.mark.parametrize("kind", ["torch"] + (["onednn"] if onednn_available(CPU, torch.float32) else []))
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
    assert set(choice) == set(ROW_BUCKETS) and set(choice.values()) <= {"torch", "onednn"}
    # Measured once per process: the same shapes get the same answer without timing again.
    monkeypatch.setattr(linear_module, "_measure", lambda *a: pytest.fail("measured twice"))
    assert measure_kinds([torch.randn(96, 64, generator=gen), torch.randn(64, 96, generator=gen)]) == choice


@needs_onednn
def test_mixed_kinds_run_each_bucket_on_its_kernel():
    """A layer whose buckets chose different kernels gives the same result at every row count."""
    gen = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    layer = Linear(weight, bias, {1: "torch", 8: "onednn", 32: "torch"})
    assert layer.kind == "mixed" and set(layer.weights) == {"torch", "onednn"}
    for rows in (1, 2, 8, 9, 32, 100):
        assert bucket_of(rows) == next((b for b in ROW_BUCKETS if rows <= b), ROW_BUCKETS[-1])
        x = torch.randn(rows, 24, generator=gen)
        want = F.linear(x.double(), weight.double(), bias.double())
        torch.testing.assert_close(layer(x).double(), want, atol=1e-4, rtol=1e-5)
