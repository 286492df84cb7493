"""The CPU kernels' two vector widths (src/flexinfer/csrc/cpu_vec.h) agree:
16 lanes where the CPU has AVX-512, 8 elsewhere or with
FLEXINFER_KERNEL_LANES=8. A child process runs the kernels with lane
operations over the same inputs at each width: the greedy pick, SiLU and
the packed linear (row tiles of 8 at 16 lanes, 3 at 8: each output's sum
runs over k in the same order) must give the same bits; attention may
round its dot products and row sums in another order, so it agrees to
within that."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

CHILD = r"""
import os
import sys
import torch
import flexinfer
if os.environ.get("FLEXINFER_KERNELS_DIR"):  # another build's kernels, as conftest.py loads them
    flexinfer.__path__.insert(0, os.environ["FLEXINFER_KERNELS_DIR"])
from flexinfer import _kernels
from flexinfer.kernels import cpu_attention, cpu_layer_ops
from flexinfer.kernels.cpu_linear import PackedWeight

torch.manual_seed(0)
out = {"lanes": _kernels.vector_lanes(), "pick": []}
inf, nan = float("inf"), float("nan")
for vocab in (1, 7, 8, 9, 15, 16, 17, 33, 512, 1000):
    rows = torch.randn(6, vocab)
    rows[1] = 1.0                                  # every lane ties: the first index
    rows[2, vocab // 2] = inf                      # an infinity: not finite, -1
    rows[3, vocab - 1] = nan                       # a NaN anywhere: -1
    rows[4] = -0.0
    rows[4, vocab // 3] = 0.0                      # -0.0 == 0.0: the first index
    rows[5] = rows[5].round()                      # many ties between lanes
    picked = torch.empty(6, dtype=torch.long)
    _kernels.greedy_pick(rows.data_ptr(), 6, vocab, vocab, 1, picked.data_ptr())
    out["pick"].append(picked)
for dtype in (torch.float32, torch.bfloat16):
    name = str(dtype)
    gate_up = (torch.randn(5, 2 * 100) * 8).to(dtype)
    gate_up[0, :4] = torch.tensor([inf, -inf, nan, -200.0])
    out["silu " + name] = cpu_layer_ops.silu_mul(gate_up, threads=1)
    for head_dim, softcap in ((64, 0.0), (128, 0.0), (24, 0.0), (64, 30.0)):
        k = torch.randn(3, 70, 2, head_dim).to(dtype)
        v = torch.randn_like(k)
        q = torch.randn(3, 4, head_dim).to(dtype)
        plan = cpu_attention.Plan(torch.arange(3, dtype=torch.int32), torch.tensor([70, 33, 5], dtype=torch.int32),
                                  threads=1)
        out[f"attention {name} {head_dim} {softcap}"] = plan.run(q, k, v, torch.empty_like(q), softcap=softcap)
    for n, k in ((50, 7), (96, 64), (33, 17)):
        layer = PackedWeight(torch.randn(n, k).to(dtype))
        bias, x = torch.randn(n).to(dtype), torch.randn(34, k).to(dtype)
        for rows in (1, 2, 3, 4, 5, 8, 9, 34):  # every tile size at either width, and their tails
            out[f"linear {name} {n}x{k} {rows}"] = layer(x[:rows], bias, portable=True)
torch.save(out, sys.argv[1])
"""


def run_child(tmp_path, name, **env):
    path = tmp_path / f"{name}.pt"
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr
    return torch.load(path)


def test_the_two_vector_widths_agree(tmp_path):
    eight = run_child(tmp_path, "eight", FLEXINFER_KERNEL_LANES="8")
    assert eight["lanes"] == 8
    native = run_child(tmp_path, "native", FLEXINFER_KERNEL_LANES="")
    if native["lanes"] == 8:
        pytest.skip("this CPU has no AVX-512: both runs took the 8-lane code")
    assert native["lanes"] == 16
    for a, b in zip(native["pick"], eight["pick"]):
        assert torch.equal(a, b)
    for key, value in native.items():
        if key.startswith(("silu", "linear")):
            assert torch.equal(value.view(torch.int16 if value.dtype == torch.bfloat16 else torch.int32),
                               eight[key].view(torch.int16 if value.dtype == torch.bfloat16 else torch.int32)), key
        elif key.startswith("attention"):
            tolerance = 1e-5 if "float32" in key else 1e-2
            torch.testing.assert_close(value.float(), eight[key].float(), rtol=tolerance, atol=tolerance, msg=key)


def test_the_picks_are_the_first_maximum_at_eight_lanes(tmp_path):
    # The 8-lane run checked against the definition, on any CPU.
    eight = run_child(tmp_path, "eight", FLEXINFER_KERNEL_LANES="8")
    torch.manual_seed(0)
    for picked, vocab in zip(eight["pick"], (1, 7, 8, 9, 15, 16, 17, 33, 512, 1000)):
        rows = torch.randn(6, vocab)
        rows[5] = rows[5].round()
        expected_first = int(torch.nonzero(rows[5] == rows[5].max())[0])
        assert picked[1] == 0 and picked[2] == -1 and picked[3] == -1
        assert picked[4] == 0 and picked[5] == expected_first
        assert picked[0] == int(torch.argmax(rows[0]))
