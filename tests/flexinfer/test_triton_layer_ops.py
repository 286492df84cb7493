"""The Triton layer ops (src/flexinfer/kernels/triton_layer_ops.py) in Triton's
interpreter, on CPU tensors, in a child process (triton_layer_ops_child.py
says why); tests/flexinfer/test_gpu.py runs the same checks on CUDA.

The residual add, the rotary embedding and the K/V write are bit for bit what
transformers' torch code gives in 16-bit dtypes, and the residual add in
float32; the rest may differ in the last bits (the norm's variance is summed
in another order, SiLU's exp is not torch's, and in float32 a GPU compiler
fuses the rotary embedding's multiply and add). The interpreter converts float32 to bfloat16 by truncation
where the GPU rounds to nearest, so bfloat16 here is checked to one unit in
the last place for each conversion; on the GPU it is bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent
# Bit for bit where each result is one rounding of exact operands. Not the
# rotary embedding: a GPU compiler fuses its multiply and add into one FMA, in
# float32 (an H100, 2026-11-27) and in bfloat16 too (an H200, 2026-11-30: 8.6 %
# of the values one unit in the last place apart), so x*cos is not rounded
# before the add as torch rounds it.
EXACT = ("add_rms_norm_sum",)


@pytest.fixture(scope="module")
def results():
    run = subprocess.run([sys.executable, str(HERE / "triton_layer_ops_child.py")], capture_output=True, text=True,
                         timeout=600, cwd=HERE)
    assert run.returncode == 0, f"child died ({run.returncode}):\n{run.stdout}\n{run.stderr[-3000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def check_layer_op_results(results: dict, bfloat16_rounds: bool) -> None:
    """The assertions for either device; `bfloat16_rounds`: conversions to
    bfloat16 round to nearest (a GPU), else they may truncate (the interpreter)."""
    for dtype, checks in results.items():
        for name, r in checks.items():
            where = f"{dtype} {name}: {r}"
            if "scale" not in r:  # a yes or no
                assert r["bitwise"], where
            elif name.startswith("forward"):
                # The torch path's F.rms_norm rounds 16-bit norms once, the kernels twice (as transformers).
                rel = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 0.08}[dtype]
                assert r["max_err"] <= rel * max(1.0, r["scale"]), where
            elif name in EXACT and (dtype != "bfloat16" or bfloat16_rounds):
                assert r["bitwise"], where
            else:  # a unit in the last place of the largest value per conversion (two at most)
                ulp = {"float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}[dtype]
                assert r["max_err"] <= 2 * ulp * max(1.0, r["scale"]), where


def test_layer_ops_equal_the_torch_code_in_the_interpreter(results):
    assert set(results) == {"float32", "bfloat16", "float16"}
    check_layer_op_results(results, bfloat16_rounds=False)
