"""scripts/bench_eviction.py end to end on small trees, with and without a
host tier: it runs, writes its JSON, every timed create evicted (or spilled)
one prefix and the tree kept its size. Its timings are not checked (a shared
machine's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_eviction.py"


@pytest.mark.parametrize("tier", [False, True])
def test_quick_run(tmp_path, tier):
    out = tmp_path / "eviction.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--sizes", "10,200", "--repeats", "20", "--json", str(out)]
                         + (["--tier"] if tier else []), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["tree_nodes"] for r in rows] == ([20, 400] if tier else [10, 200])  # with a tier, half on the host
    assert [r["host_tier_nodes"] for r in rows] == ([10, 200] if tier else [0, 0])
    # With a tier, filling it spilled N prefixes before the timed creates.
    assert all(r["evictions"] == 20 + r["host_tier_nodes"] and r["repeats"] == 20 for r in rows)
    assert all(r["spills"] == (r["evictions"] if tier else 0) for r in rows)
    assert all(r["evicting_p50_us"] > 0 and r["free_chunk_p50_us"] > 0 for r in rows)


def test_quick_run_on_a_path(tmp_path):
    """--shape chain: one path of N one-page nodes, the deeper half spilled
    before the timed creates, each of which spills one more node of it."""
    out = tmp_path / "eviction.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--sizes", "40", "--repeats", "30", "--tier", "--shape", "chain",
                          "--json", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    [row] = json.loads(out.read_text())["rows"]
    assert row["repeats"] == 19  # capped at N/2 - 1: the path's upper half, less its top node
    assert row["spills"] == row["evictions"] == 20 + 19
    assert row["host_tier_nodes"] == 39 and row["tree_nodes"] == 40 + 19  # the path, and a prefix per create
