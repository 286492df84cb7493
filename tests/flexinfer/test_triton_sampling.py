"""BatchSampler's Triton draw (src/flexinfer/kernels/triton_sampling.py) token
for token against its torch path: in Triton's interpreter on CPU tensors, in a
child process (triton_sampling_child.py says why), and on CUDA at a real
vocabulary and batch (`pytest -m gpu`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent


def check_results(results: dict) -> None:
    assert set(results) == {"random", "ties_bans_non_finite", "top_p_keeps_ties_at_its_bar", "u_zero",
                            "u_below_one", "u_one", "non_finite_rows"}
    for case, r in results.items():
        assert r["differing"] == 0, (case, r)
    # Not a degenerate draw: the rows' tokens vary, and the tied tokens at top-p's bar are all drawn.
    assert results["random"]["draws"] >= 5 and results["ties_bans_non_finite"]["draws"] >= 5
    assert results["top_p_keeps_ties_at_its_bar"]["first_differences"] == [0, 1, 2, 3]


def test_the_kernel_draws_what_the_torch_ops_draw_in_the_interpreter():
    run = subprocess.run([sys.executable, str(HERE / "triton_sampling_child.py")], capture_output=True, text=True,
                         timeout=600, cwd=HERE)
    assert run.returncode == 0, f"child died ({run.returncode}):\n{run.stdout}\n{run.stderr[-3000:]}"
    check_results(json.loads(run.stdout.strip().splitlines()[-1]))


@pytest.mark.gpu
def test_the_kernel_draws_what_the_torch_ops_draw_on_cuda():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device and a CUDA build of torch")
    sys.path.insert(0, str(HERE))
    from triton_sampling_child import run_checks

    # SmolLM2's vocabulary, 112 rows.
    check_results(run_checks("cuda", vocab=49152, repeat=8, steps=4))
