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


def test_spilling_ahead_gives_the_same_replies_and_spills_before_admissions_need_room(wide_kv_folder):
    """spill_ahead_bytes: vtm keeps that much of the pool free by spilling
    the least recently used histories in the background, so admissions find
    room without spilling on their critical path."""
    options = dict(dtype="float32", backend="host", kv_capacity_bytes=8 * CHUNK, max_model_len=512, max_num_seqs=2)
    with LLM(wide_kv_folder, **options) as plain:
        expected = chat_round_robin(plain, users=4, turns=3)
    with LLM(wide_kv_folder, host_tier_bytes=16 * CHUNK, spill_ahead_bytes=3 * CHUNK, **options) as ahead:
        assert chat_round_robin(ahead, users=4, turns=3) == expected
        stats = ahead.stats()["vtm"]
        ahead.manager.check()
    assert stats["spills_ahead_total"] > 0 and stats["restores_total"] >= 8
    assert stats["spill_failures_total"] == 0
    with pytest.raises(InvalidArgument, match="host_tier_bytes too"):
        LLM(wide_kv_folder, spill_ahead_bytes=CHUNK, **options)
    for bad in (-1, 1.5, True, 2**64):
        with pytest.raises(InvalidArgument, match="spill_ahead_bytes"):
            LLM(wide_kv_folder, host_tier_bytes=CHUNK, spill_ahead_bytes=bad, **options)


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


def test_spill_ahead_gib_without_a_tier_is_refused_in_one_line():
    out = subprocess.run([sys.executable, "-m", "flexinfer", "generate", "--prompt", "hi", "--spill-ahead-gib", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "--spill-ahead-gib" in out.stderr and "--host-tier-gib" in out.stderr and "Traceback" not in out.stderr


def test_host_tier_gib_with_a_broker_is_refused_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "flexinfer", "generate", "--prompt", "hi", "--host-tier-gib", "1",
                          "--manager", f"unix:{tmp_path}/none"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "--host-tier-gib" in out.stderr and "Traceback" not in out.stderr


def bench_tier_chat(llm: LLM, users: int, turns: int, history: int, new: int, reply: int):
    """scripts/bench_tier.py's load: a warm-up, then `users` conversations
    round robin, each turn the whole conversation so far plus `new` tokens,
    `reply` greedy tokens, one request at a time. Returns the replies and,
    per turn after the first, (tokens the turn's prompt had recorded before
    it, restores, prefix hit tokens, of those from the host tier), read off
    the engine's stats around the turn."""
    llm.generate([[1, 5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    histories = [[1] + [(37 * u + 11 * i) % 500 + 3 for i in range(history - 1)] for u in range(users)]
    params = SamplingParams(max_tokens=reply, temperature=0.0, ignore_eos=True)
    replies, later = [], []
    for turn in range(turns):
        for u in range(users):
            recorded = len(histories[u]) - 1  # the last reply token's KV was never computed
            if turn:
                histories[u] += [(turn * 7 + u + i) % 500 + 3 for i in range(new)]
            before = llm.stats()
            out = llm.generate([histories[u]], params, use_tqdm=False)[0].outputs[0]
            after = llm.stats()
            assert out.error is None and out.finish_reason == "length", (out.error, out.finish_reason)
            histories[u] += out.token_ids
            replies.append(out.token_ids)
            if turn:
                later.append((recorded, after["vtm"]["restores_total"] - before["vtm"]["restores_total"],
                              after["prefix_hit_tokens"] - before["prefix_hit_tokens"],
                              after["prefix_hit_tokens_host"] - before["prefix_hit_tokens_host"]))
    return replies, later


@pytest.mark.parametrize("margin", [0, 1, 3], ids=["one_conversation", "one_chunk_more", "with_restore_margin"])
def test_a_pool_of_one_conversation_restores_every_later_turn(wide_kv_folder, margin):
    """bench_tier's `--pool 1` scaled down (on an H200: 8000-token histories,
    91 rows a 2 MiB page; here 400 tokens, 128 rows a page): the pool holds
    one conversation's pages as bench_tier's conversation_chunks counts them
    (5 chunks), and `margin` more. A later turn's restore takes more than
    the conversation's pages: the tree keeps [0, 1) (the BOS every prompt
    shares, on the device), the first prompt [1, 400) and the reply
    [400, 415), each of the last two with its own copy of the page it starts
    in (4 chunks and 1), and the match copies its partial last page (1):
    7 chunks, while the turn itself (4 pages) fits. Before b90ea53 the match
    restored nothing in a pool of 5 (as bench_tier on the H200, whose CUDA
    sink took the chunk the host backend has spare), and in a pool of 6 it
    restored the prefix, then failed for its last page's copy: the engine
    computed all 432 tokens of the prompt either way, with no prefix hit
    from the host. Now the match restores the longest part that fits and
    the engine computes the rest; with bench_tier's restore_margin (3 chunks
    on the host backend) the whole prefix comes back."""
    users, turns, history, new, reply = 3, 2, 400, 16, 16
    row = 4 * 2 * 8 * 64 * 4  # wide_kv_folder's KV row in float32: 4 layers, K and V, 8 heads of 64
    conversation = -(-(history + turns * (new + reply)) * row // CHUNK) + 1  # bench_tier's conversation_chunks
    assert conversation == 5
    options = dict(dtype="float32", backend="host", kv_capacity_bytes=(conversation + margin) * CHUNK,
                   max_model_len=512, max_num_seqs=4)
    with LLM(wide_kv_folder, **options) as plain:
        assert [space.row_bytes for space in plain.kv_cache.spaces] == [row]
        expected, recomputed = bench_tier_chat(plain, users, turns, history, new, reply)
    assert all(hit <= 1 for _, _, hit, _ in recomputed)  # without the tier only the BOS stays
    with LLM(wide_kv_folder, host_tier_bytes=8 * conversation * CHUNK, **options) as tiered:
        replies, later = bench_tier_chat(tiered, users, turns, history, new, reply)
        assert replies == expected
        stats = tiered.stats()
        for recorded, restores, hit, hit_host in later:
            assert restores == 1, later
            if margin == 3:  # the whole recorded conversation, all but the shared BOS from the host
                assert hit == recorded and hit_host >= recorded - 1, later
            else:  # all but what did not fit: less than a page and a copy
                assert history - CHUNK // row <= hit_host <= hit < recorded, later
        assert stats["vtm"]["restores_total"] == users * (turns - 1)
        assert stats["prefix_hit_tokens_host"] == sum(hit_host for *_, hit_host in later)
        assert stats["prefix_failures"] == 0 and stats["memory_faults"] == 0
        manager = tiered.manager
        manager.check()
        assert tiered.kv_cache.clear_prefixes() > 0
        manager.trim()
        manager.check()
        stats = manager.stats()
        assert stats["chunks_held"] == 0 and stats["tree_nodes"] == 0 and stats["chunks_in_tree"] == 0, stats
        assert stats["host_tier_used_bytes"] == 0 and stats["host_tier_nodes"] == 0, stats


def test_prompt_hits_from_the_host_count_only_prompt_tokens_the_host_tier_held(tiny_gpu_folder):
    """A preempted sequence's readmission matches its prompt and its output
    so far. The tier spills the tree from its leaves up, so what a match
    copies back is its last tokens: here the output (its own node), while
    the prompt stayed on the device. prefix_hit_tokens_host counted
    min(restored, prompt), 15 prompt tokens from the host that the device
    had served; none of the prompt came from the host."""
    from flexinfer.engine import Engine
    from flexinfer.sequence import Sequence

    chunk = 4096
    manager = vtm.Manager(backend="host", capacity_bytes=64 * chunk, chunk_bytes=chunk, granularity=chunk,
                          host_tier_bytes=64 * chunk)
    engine = Engine(tiny_gpu_folder, manager=manager, max_model_len=256, max_num_seqs=4)
    prompt = [1] + list(range(40, 79))
    seq = Sequence(1, 0, 0, prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), 0, ())
    engine.add(seq)
    while len(seq.output_ids) < 16:
        engine.step()
    engine.scheduler.reclaim(1, timeout_s=0)  # the next step preempts it, recording prompt and output
    engine.step()
    assert engine.scheduler.num_preemptions == 1
    space = engine.kv_cache.space
    assert [(n["start"], n["end"]) for n in space.prefix_nodes()] == [(0, 40), (40, 55)]
    # Memory wanted elsewhere spills the output's node, the leaf, and no more.
    filler, rows = space.create(1).result(), 1
    while not any(n["on_host"] for n in space.prefix_nodes()):
        rows += 1
        manager.step({filler: rows}).result()
    filler.release().result()
    assert [(n["start"], n["end"], n["on_host"]) for n in space.prefix_nodes()] == [(0, 40, False), (40, 55, True)]
    while engine.has_work():
        engine.step()
    engine.drain()
    stats = engine.stats()
    assert len(seq.output_ids) == 30 and stats["vtm"]["restores_total"] == 1
    assert stats["prefix_hit_tokens"] == len(prompt) and stats["prefix_hit_tokens_host"] == 0, stats
    engine.close()
    manager.close()


def test_swap_records_are_forgotten_once_dead_with_prefix_caching_off(tiny_gpu_folder):
    """With prefix caching off, preemption="swap" records a preempted
    sequence only for its own readmission. Those records stayed in the tree
    after the readmission and after the sequence ended: nobody matched them
    again, yet eviction spilled them to the host tier on an admission's path,
    and their host blocks pushed out the records of sequences still swapped
    out. Now vtm forgets each once dead: after the requests end the tree and
    the tier hold nothing, and the outputs are those of a run that preempts
    nobody. Two prompts are equal (greedy: equal outputs), so one's record
    may lie along the other's path, which a forget must leave to the other."""
    chunk = 4096  # 2.7 of the tiny model's 1536-byte rows a page: rows straddle pages
    shared = [1] + list(range(100, 124))
    prompts = [shared + [(7 * i + j) % 400 + 50 for j in range(3 + 5 * i)] for i in range(6)]
    prompts.append(list(prompts[2]))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    options = dict(enable_prefix_caching=False, max_model_len=256, max_num_seqs=len(prompts))

    def generate(manager, **extra):
        with LLM(tiny_gpu_folder, manager=manager, **options, **extra) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            assert all(o.outputs[0].error is None for o in outputs)
            manager.check()
            return [o.outputs[0].token_ids for o in outputs], llm.stats()  # with the spaces open: their trees

    with vtm.Manager(backend="host", capacity_bytes=512 * chunk, chunk_bytes=chunk, granularity=chunk) as roomy:
        expected, stats = generate(roomy)
    assert stats["preemptions"] == 0
    with vtm.Manager(backend="host", capacity_bytes=40 * chunk, chunk_bytes=chunk, granularity=chunk,
                     host_tier_bytes=256 * chunk) as small:
        replies, stats = generate(small, preemption="swap")
    after = stats["vtm"]
    assert replies == expected
    assert stats["preemptions"] > 0 and stats["swap_in_tokens"] > 0, stats
    assert after["spills_total"] > 0 and after["restores_total"] > 0, after  # the tier held swapped-out KV
    assert (after["tree_nodes"], after["chunks_in_tree"]) == (0, 0), after
    assert (after["host_tier_used_bytes"], after["host_tier_nodes"]) == (0, 0), after


@pytest.mark.parametrize("error", [vtm.BackendError, vtm.OutOfMemory])
def test_a_failed_question_to_the_host_tier_releases_the_match_it_follows(tiny_gpu_folder, error):
    """A swapped-out sequence's readmission matches its record, then asks
    the host tier what more it keeps (a broker's call). When that question
    raised, the match's vTensors were in no variable: their slots, pages
    and locks on the record's path were lost for the session. Now they are
    released before the error goes on (an out-of-memory waits, another
    error fails that request), and everything comes back."""
    chunk = 4096
    shared = [1] + list(range(100, 124))
    prompts = [shared + [(7 * i + j) % 400 + 50 for j in range(3 + 5 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with vtm.Manager(backend="host", capacity_bytes=40 * chunk, chunk_bytes=chunk, granularity=chunk,
                     host_tier_bytes=256 * chunk) as manager, \
            LLM(tiny_gpu_folder, manager=manager, enable_prefix_caching=False, max_model_len=256,
                max_num_seqs=len(prompts), preemption="swap") as llm:
        kv, asked = llm.kv_cache, []

        def failing_once(token_ids):
            asked.append(len(token_ids))
            if len(asked) == 1:
                raise error("injected")
            return type(kv).restore_bytes(kv, token_ids)
        kv.restore_bytes = failing_once
        outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert asked, "no readmission asked the host tier"
        errors = [o.error for o in outputs if o.error is not None]
        assert len(errors) == (1 if error is vtm.BackendError else 0), errors
        stats = manager.stats()
        assert all(space["vtensors"] == 0 for space in stats["spaces"].values()), stats
        for space in kv.spaces:
            space.clear_prefixes()
        manager.trim()
        manager.check()
        assert manager.stats()["chunks_held"] == 0


@pytest.mark.parametrize("where", ["finish", "second_preemption"])
def test_a_swap_record_is_forgotten_after_a_failed_release_too(tiny_gpu_folder, where):
    """Prefix caching off, preemption="swap": a readmitted sequence's match
    locks its swap record's path, so the record is forgotten once the
    match's vTensor is released. When that release failed (the device
    refusing an unmap; the scheduler retries it at the next step), the
    forget went ahead while the vTensor still locked the path: the record
    was taken back, but its nodes stayed, and once the retried release
    unlocked them they were ordinary cache that nothing would forget.
    `where` the failed release comes: at the sequence's end, or at a second
    preemption, whose record and release fail together (nothing recorded),
    and so does the plain release the scheduler tries next."""
    from flexinfer.engine import Engine
    from flexinfer.sequence import Sequence

    chunk = 4096
    manager = vtm.Manager(backend="host", capacity_bytes=64 * chunk, chunk_bytes=chunk, granularity=chunk,
                          host_tier_bytes=64 * chunk, faults=True)
    engine = Engine(tiny_gpu_folder, manager=manager, max_model_len=256, max_num_seqs=4,
                    enable_prefix_caching=False, preemption="swap")
    space = engine.kv_cache.space
    prompt = [1] + list(range(40, 79))
    seq = Sequence(1, 0, 0, prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), 0, ())
    engine.add(seq)
    while len(seq.output_ids) < 16:
        engine.step()
    engine.scheduler.reclaim(1, timeout_s=0)  # the next step preempts it: its swap record
    engine.step()
    while len(seq.output_ids) < (20 if where == "second_preemption" else 29):
        engine.step()
    assert engine.scheduler.num_preemptions == 1 and seq.vtensors  # readmitted: its match locks the record
    assert [n["locks"] for n in space.prefix_nodes()] == [1]
    unmaps = manager.faults.calls("unmap")
    manager.faults.fail_nth("unmap", 1)
    if where == "second_preemption":
        record_and_release = engine.kv_cache.record_and_release

        def failing_twice(*args):
            outcomes = record_and_release(*args)
            manager.faults.fail_nth("unmap", 1)  # and the release the scheduler tries next
            return outcomes

        engine.kv_cache.record_and_release = failing_twice
        engine.scheduler.reclaim(1, timeout_s=0)
        engine.step()
        del engine.kv_cache.record_and_release
        assert engine.scheduler.num_preemptions == 2 and engine.scheduler.num_prefix_failures == 1
    while engine.has_work():
        engine.step()
    engine.drain()  # the failed release is retried here at the latest
    manager.faults.clear()
    assert manager.faults.calls("unmap") > unmaps and engine.scheduler.num_memory_faults == 1
    assert len(seq.output_ids) == 30 and seq.error is None
    manager.check()
    stats = manager.stats()
    assert all(space["vtensors"] == 0 for space in stats["spaces"].values()), stats
    assert space.prefix_nodes() == [] and stats["tree_nodes"] == 0 and stats["host_tier_nodes"] == 0, stats
    manager.trim()
    stats = manager.stats()
    assert stats["chunks_held"] == 0 and stats["host_tier_used_bytes"] == 0, stats  # nothing leaked
    engine.close()
    manager.close()
