"""scripts/bench_memory_wait.py runs end to end: the baseline engine
(memory_wait_s=0) fails the request that finds the shared pool held, the
default one waits and finishes, and neither spins while it waits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_bench_memory_wait_reports_both_engines(tmp_path):
    out = tmp_path / "wait.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_memory_wait.py"), "--hold", "0.3", "--repeats", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "CPU:" in proc.stdout and "release -> 1st token ms" in proc.stdout
    engines = json.loads(out.read_text())["engines"]
    assert engines["memory_wait_s=0"]["finished"] == "0/1"
    waited = engines["memory_wait_s=30"]
    assert waited["finished"] == "1/1"
    assert 0 <= waited["release_to_first_token_ms"] and 0 <= waited["cpu_per_wait_s"] < 1.0
