"""scripts/bench_overhead.py runs end to end on a tiny setting and reports,
per batch, a step that contains its forward pass and a `rest` that is their
per-step difference (what docs/benchmarks.md quotes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_bench_overhead_reports_the_step_its_forward_pass_and_the_rest(tmp_path):
    out = tmp_path / "overhead.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_overhead.py"), "--batches", "1,4", "--new-tokens", "6",
                           "--repeats", "1", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "CPU:" in proc.stdout and "rest µs/seq" in proc.stdout
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"1", "4"}
    for batch, r in results.items():
        assert 0 < r["forward_us"] < r["step_us"] and r["loop_us"] > 0
        assert 0 < r["rest_us"] < r["step_us"]
        assert r["host_us_per_seq"] == pytest.approx(r["rest_us"] / int(batch))
