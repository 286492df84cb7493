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

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = ["prefix_tree.cc", "pool.cc", "host_tier.cc", "error.cc", "backend_host.cc"]


def test_the_tree_is_whole_after_every_failed_allocation(tmp_path):
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        pytest.skip("no C++ compiler")
    csrc = ROOT / "src" / "vtm" / "csrc"
    binary = tmp_path / "tree_out_of_memory"
    subprocess.run([compiler, "-std=c++17", "-O1", "-g", f"-I{csrc}", str(ROOT / "tests" / "vtm" / "tree_out_of_memory.cc"),
                    *(str(csrc / s) for s in SOURCES), "-o", str(binary), "-lpthread"], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # not under the sanitizers' runtime
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "whole after every failure" in run.stdout
    for scenario in ("a new path", "a path that splits a node", "a leaf below a node", "merging halves",
                     "adopting a node on the host", "a window path with holes", "filling its holes",
                     "adopting a created chunk"):
        assert f"{scenario}: succeeded after" in run.stdout, run.stdout
