"""scripts/bench_cpu_kernels.py runs end to end on a few calls: every kernel
beside its torch baseline, from the same process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_bench_cpu_kernels_reports_each_kernel_against_torch(tmp_path):
    out = tmp_path / "kernels.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_cpu_kernels.py"), "--calls", "3", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "CPU:" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {r["op"].split()[0] for r in rows} == {"greedy_pick", "silu_mul", "rms_norm", "decode"}
    assert all(r["torch_us"] > 0 and r["kernel_us"] > 0 for r in rows)
