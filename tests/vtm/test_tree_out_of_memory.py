"""The prefix tree survives a failed allocation in every step of an insert,
a split and a merge (review: Split counted its node out of the index's
sizes before the allocations that could fail, a failed LRU entry or child
entry left a node out of its list or references taken for a leaf that
never joined, and an adoption's first block given back to a fresh host
tier grew its free list halfway through the node's change; a pool that
could not register a chunk just created leaked it). Out of memory is an
error to handle, never a broken tree or a lost chunk:
tests/vtm/tree_out_of_memory.cc fails each allocation in turn and checks
the tree after each, built here from the sources."""

from vtm_testing import run_tree_harness


def test_the_tree_is_whole_after_every_failed_allocation(tmp_path):
    run = run_tree_harness("tree_out_of_memory", tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "whole after every failure" in run.stdout
    for scenario in ("a new path", "a path that splits a node", "a leaf below a node", "merging halves",
                     "adopting a node on the host", "a window path with holes", "filling its holes",
                     "adopting a created chunk"):
        assert f"{scenario}: succeeded after" in run.stdout, run.stdout
