"""scripts/bench_swap.py runs end to end: requests preempted on a small
pool come back by recompute and by swap with the same greedy outputs, and
every token swap keeps comes back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_bench_swap_quick_run(tmp_path):
    out = tmp_path / "swap.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_swap.py"), "--model", "random", "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "CPU:" in proc.stdout
    result = json.loads(out.read_text())
    assert result["equal_outputs"] == result["outputs"] == 6
    assert result["recompute"]["preemptions"] > 0 and result["recompute"]["swap_out_tokens"] == 0
    swap = result["swap"]
    assert swap["preemptions"] > 0 and swap["swap_out_tokens"] > 0, swap
    assert swap["swap_in_tokens"] == swap["swap_out_tokens"], swap
