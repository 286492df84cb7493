"""scripts/bench_sampling.py runs end to end on a tiny setting: the per-row
cost of sample() now and before, decode rates greedy and sampled, and
BatchSampler's step over seeded rows now and before."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_bench_sampling_reports_both_samplers_per_row_and_in_decode(tiny_gpu_folder, tmp_path):
    out = tmp_path / "sampling.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_sampling.py"), "--model", tiny_gpu_folder,
                           "--batches", "1,2", "--rounds", "1", "--new-tokens", "3", "--seeded-batches", "1,3",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "CPU:" in proc.stdout
    result = json.loads(out.read_text())
    assert len(result["per_row"]) == 2 * 2 * 2
    assert all(r["before_us"] > 0 and r["now_us"] > 0 for r in result["per_row"])
    assert [r["batch"] for r in result["decode"]] == [1, 2]
    assert all(r["greedy_tok_s"] > 0 and r["before_tok_s"] > 0 and r["now_tok_s"] > 0 for r in result["decode"])
    assert [(r["params"], r["batch"]) for r in result["batch_sampler"]] == [
        ("plain", 1), ("plain", 3), ("top_p", 1), ("top_p", 3)]
    assert all(r["before_us"] > 0 and r["now_us"] > 0 and r["unseeded_us"] > 0 for r in result["batch_sampler"])
