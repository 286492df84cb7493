"""The prefix tree's per-node record counts (what prefix_forget takes back)
are checked by CheckIndex, hence Manager.check(), against their sums: the
tree keeps no list of what was recorded, and a leaf may rightly hold no
record (prefix_tree.h). tests/vtm/tree_records.cc, built here from the
sources, runs records, splits, locks and forgets that must pass, then
changes counts by hand as a broken split or merge would, which must be
caught: the only way to break them without a hook in the module."""

from vtm_testing import run_tree_harness


def test_check_index_recomputes_the_record_counts(tmp_path):
    run = run_tree_harness("tree_records", tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "records, splits, locks and forgets: passed" in run.stdout, run.stdout
    for what in ("a count a split left on the upper half", "a count a split copied to both halves",
                 "a count a merge lost", "a negative count", "a node whose key is not its path's"):
        assert f"caught {what}: invariant broken" in run.stdout, run.stdout
    assert "record counts checked" in run.stdout
