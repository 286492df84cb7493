"""FlexInfer on vtm's host tier (LLM(host_tier_bytes=N), --host-tier-gib):
chat turns whose history the small pool evicted copy it back from host
memory instead of recomputing it, with the same greedy replies."""

from __future__ import annotations

import subprocess
import sys

import pytest

import vtm
from flexinfer import LLM, InvalidArgument, SamplingParams

CHUNK = 2 << 20


def chat_round_robin(llm: LLM, users: int, turns: int) -> list[list[int]]:
    """Each user's conversation grows by a reply and 10 new tokens per turn; one request at a time."""
    histories = [[1] + [(37 * u + 11 * i) % 500 + 3 for i in range(300)] for u in range(users)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    replies = []
    for turn in range(turns):
        for u in range(users):
            if turn:
                histories[u] += [(turn * 7 + u + i) % 500 + 3 for i in range(10)]
            out = llm.generate([histories[u]], params, use_tqdm=False)[0].outputs[0]
            assert out.error is None, out.error
            histories[u] += out.token_ids
            replies.append(out.token_ids)
    return replies


@pytest.fixture(scope="module")
def wide_kv_folder(tmp_path_factory, random_llama):
    """A small random Llama whose KV rows are wide (16 KiB a token in float32),
    so that a 300-token conversation spans three 2 MiB chunks."""
    return random_llama(tmp_path_factory.mktemp("wide-kv"), hidden_size=256, intermediate_size=512,
                               num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, head_dim=64)


def test_evicted_chat_history_comes_back_from_the_host_tier(wide_kv_folder):
    # Each conversation takes 3 chunks; the pool of 8 holds two of the four.
    options = dict(dtype="float32", backend="host", kv_capacity_bytes=8 * CHUNK, max_model_len=512, max_num_seqs=2)
    with LLM(wide_kv_folder, **options) as plain:
        expected = chat_round_robin(plain, users=4, turns=3)
        without = plain.stats()
    with LLM(wide_kv_folder, host_tier_bytes=16 * CHUNK, **options) as tiered:
        assert chat_round_robin(tiered, users=4, turns=3) == expected
        stats = tiered.stats()
        tiered.manager.check()
    assert without["vtm"]["restores_total"] == 0 and without["vtm"]["host_tier_capacity_bytes"] == 0
    assert stats["vtm"]["host_tier_capacity_bytes"] == 16 * CHUNK
    assert stats["vtm"]["spills_total"] > 0 and stats["vtm"]["restores_total"] >= 8  # turns 2 and 3 of 4 users
    assert stats["prefix_hit_tokens"] > without["prefix_hit_tokens"] + 8 * 300
    assert without["prefix_hit_tokens_host"] == 0 and stats["prefix_hit_tokens_host"] >= 8 * 300


def test_a_host_tier_needs_the_engines_own_manager(tiny_gpu_folder):
    with vtm.Manager(backend="host", capacity_bytes=4 * CHUNK, chunk_bytes=CHUNK) as manager:
        with pytest.raises(InvalidArgument, match="host_tier_bytes"):
            LLM(tiny_gpu_folder, manager=manager, host_tier_bytes=CHUNK)
    # Fuzzing the host tier: 2**63 - 1 and above were pybind's TypeError
    # (2**63 - 1 rounded up to whole chunks is past int64).
    for bad in (-1, 1.5, True, 2**63 - 1, 2**64):
        with pytest.raises(InvalidArgument, match="host_tier_bytes"):
            LLM(tiny_gpu_folder, backend="host", host_tier_bytes=bad)
    for name in ("kv_capacity_bytes", "chunk_bytes"):
        with pytest.raises(InvalidArgument, match=name):
            LLM(tiny_gpu_folder, backend="host", **{name: 2**64})


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench"])
def test_every_command_takes_host_tier_gib(command):
    out = subprocess.run([sys.executable, "-m", "flexinfer", command, "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--host-tier-gib" in out.stdout, out.stderr


def test_host_tier_gib_with_a_broker_is_refused_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "flexinfer", "generate", "--prompt", "hi", "--host-tier-gib", "1",
                          "--manager", f"unix:{tmp_path}/none"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "--host-tier-gib" in out.stderr and "Traceback" not in out.stderr
