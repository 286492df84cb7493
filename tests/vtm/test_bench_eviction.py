"""scripts/bench_eviction.py end to end on small trees: it runs, writes its
JSON, every timed create evicted one prefix and the tree kept its size. Its
timings are not checked (a shared machine's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_eviction.py"


def test_quick_run(tmp_path):
    out = tmp_path / "eviction.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--sizes", "10,200", "--repeats", "20", "--json", str(out)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["tree_nodes"] for r in rows] == [10, 200]
    assert all(r["evictions"] == r["repeats"] == 20 for r in rows)
    assert all(r["evicting_p50_us"] > 0 and r["free_chunk_p50_us"] > 0 for r in rows)
