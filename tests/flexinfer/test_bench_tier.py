"""scripts/bench_tier.py runs end to end on a sliding-window model: the
conversations' window group comes back from the host tier too, and the
greedy replies are the same with and without it, and spilling ahead."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_bench_tier_restores_a_gemma3_models_window_group_from_the_host(tmp_path):
    out = tmp_path / "tier.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_tier.py"), "--family", "gemma3", "--window", "64",
                           "--users", "3", "--turns", "2", "--history", "160", "--new", "8", "--reply", "4",
                           "--spill-ahead", "1", "--think-ms", "20", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "CPU:" in proc.stdout and "2 groups" in proc.stdout
    result = json.loads(out.read_text())
    assert result["same_replies"] is True
    assert result["without"]["restores"] == 0 and result["without"]["evictions"] > 0
    # The pool: 2 conversations' pages and, once, a restore's page copies
    # (per group: the nodes' own first pages, 2 in turn 2, and the match's last page).
    assert result["restore_margin_chunks"] == 2 * 3
    assert result["pool_chunks"] == 2 * result["conversation_chunks"] + 2 * 3
    assert "for a restore's page copies" in proc.stdout
    # Every later turn restores both groups: the full one and the window one.
    assert result["with_tier"]["restores"] == 2 * 3, result["with_tier"]
    assert result["with_tier"]["spills"] > 0
    # A restore's time split: its copies, within it, and the spills' copies.
    assert 0 < result["ratios"]["restore_copy_share"] <= 1 and result["with_tier"]["spill_copy_s"] > 0
    # The backend's time by operation: the tier's copies are there, with their calls, and a restore's
    # copies took at least as long in the backend as the manager timed them around it.
    costs = result["with_tier"]["backend_costs"]
    assert costs["copy_to_host"]["calls"] == result["with_tier"]["spills"]
    assert costs["copy_from_host"]["calls"] == result["with_tier"]["restores"]
    assert 0 < costs["copy_from_host"]["seconds"] <= result["with_tier"]["restore_copy_s"]
    assert "copy_from_host" not in result["without"]["backend_costs"] and "with the tier      backend time: " in proc.stdout
    # The third engine spilled one conversation's chunks ahead of need, with the same replies (same_replies).
    assert result["spill_ahead_chunks"] == result["conversation_chunks"]
    assert result["spill_ahead"]["spills_ahead"] > 0 and result["spill_ahead"]["restores"] == 2 * 3
    # Its ratios take the tier without spilling ahead as the baseline, not the engine without a tier.
    assert "spilling ahead, against the tier without it" in proc.stdout
    assert result["ratios"]["ahead_ttft_later_p50"] == pytest.approx(
        result["with_tier"]["ttft_later_p50_ms"] / result["spill_ahead"]["ttft_later_p50_ms"])
