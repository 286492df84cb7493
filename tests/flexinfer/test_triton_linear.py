"""The fused Triton decode kernels (src/flexinfer/kernels/triton_linear.py)
in Triton's interpreter, on CPU tensors, in a child process
(triton_linear_child.py); tests/flexinfer/test_gpu.py runs the same checks
on CUDA.

Each kernel against the torch code it replaces (a projection accumulated
exactly and rounded once, the norm, rotary embedding and SiLU rounded as
transformers rounds them): within a few units in the last place, since only
the order of the float32 sums differs (in float16 the sums come out bit for
bit). In bfloat16 the interpreter converts by truncation where a GPU rounds to
nearest, and a truncated normed row changes every sum that reads it, so the
bound there is wider. A tiny model's decode steps through the kernels
against the same model on the separate layer ops: close in every dtype; its
prefill (more rows than the kernels take) bit for bit, since it runs the
separate ops either way."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def results():
    run = subprocess.run([sys.executable, str(HERE / "triton_linear_child.py")], capture_output=True, text=True,
                         timeout=600, cwd=HERE)
    assert run.returncode == 0, f"child died ({run.returncode}):\n{run.stdout}\n{run.stderr[-3000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def check_triton_linear_results(results: dict, bfloat16_rounds: bool) -> None:
    """The assertions for either device; `bfloat16_rounds`: conversions to
    bfloat16 round to nearest (a GPU), else they may truncate (the interpreter)."""
    assert set(results) == {"float32", "bfloat16", "float16"}
    for dtype, checks in results.items():
        for name, r in checks.items():
            where = f"{dtype} {name}: {r}"
            if "scale" not in r or name == "forward_prefill_logits":  # a yes or no; the same ops either way
                assert r["bitwise"], where
            elif name.startswith("forward"):
                rel = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 0.08}[dtype]
                assert r["max_err"] <= rel * max(1.0, r["scale"]), where
            else:
                # 16 units in the last place in float32, 2 in float16, 4 in
                # bfloat16 rounded to nearest, 8 truncated.
                rel = {"float32": 2.0 ** -19, "float16": 2.0 ** -9,
                       "bfloat16": 2.0 ** -5 if bfloat16_rounds else 2.0 ** -4}[dtype]
                assert r["max_err"] <= rel * max(1.0, r["scale"]), where
    assert {name for name in results["float32"]} >= {"linear_5_rows", "linear_7_rows", "linear_8_rows",
                                                     "norm_gate_up_silu_5_rows", "norm_qkv_rotary",
                                                     "norm_qkv_kv_write", "norm_qkv_outside_is_skipped",
                                                     "norm_qkv_head_dim_80_4_4_heads_8_rows_kv_write",
                                                     "norm_qkv_head_dim_256_2_1_heads_7_rows_kv_write",
                                                     "forward_decode_1_row_logits", "forward_decode_3_rows_logits"}


def test_the_fused_kernels_equal_the_torch_code_in_the_interpreter(results):
    check_triton_linear_results(results, bfloat16_rounds=False)


def test_a_decode_step_runs_the_fused_kernels_and_differs_from_the_separate_ops_only_in_the_last_bits(results):
    """The fused path ran (its float32 logits are not the separate ops' bits)
    and stayed close (checked above)."""
    assert not results["float32"]["forward_decode_1_row_logits"]["bitwise"]
