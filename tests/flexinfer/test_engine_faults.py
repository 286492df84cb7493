"""Fault containment in the engine (issue 17): a failed memory operation, a
bad request or a row that cannot be sampled fails at most its own request,
and the engine serves the next requests exactly as before.

vtm's fault injector (`Manager(faults=True)`) makes the n-th call of one
backend operation fail once; every operation the engine drives through vtm
is swept. The oracle is the same engine on a manager without faults (the
engine itself is checked against transformers in test_engine.py).
"""

from __future__ import annotations

import pytest
import torch

import vtm
from flexinfer import LLM, InvalidArgument, SamplingParams
from flexinfer.engine import Engine
from flexinfer.sequence import Sequence, Status
from engine_testing import step_to_end

CHUNK = 4096  # ~2.7 rows of the tiny model a page: rows straddle pages, prompts span several
# Every backend operation a serving engine reaches: mapping (create, step,
# match), unmapping (release), the copies of prefix record and match, and
# the fence those copies wait on.
ENGINE_OPS = ["create_chunk", "map", "set_access", "unmap", "copy", "record_fence"]
PROMPT = [1] + list(range(40, 100))
PROMPTS = [PROMPT + [7, 8], PROMPT + [9], PROMPT[:30] + [11, 12, 13], [1, 5, 6, 7]]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=2)


def _manager(faults: bool) -> vtm.Manager:
    return vtm.Manager(backend="host", capacity_bytes=512 * CHUNK, chunk_bytes=CHUNK, granularity=CHUNK,
                       faults=faults)


def _llm(folder, manager, overlap: bool = False) -> LLM:
    return LLM(folder, manager=manager, max_model_len=256, max_num_seqs=8, max_batch_tokens=64, overlap=overlap)


def _tokens(outputs) -> list[list[list[int]]]:
    return [[o.token_ids for o in out.outputs] for out in outputs]


def _assert_empty(llm: LLM) -> None:
    llm.manager.check()
    assert not llm.scheduler.has_work()
    llm.kv_cache.space.clear_prefixes()
    llm.manager.trim()
    llm.manager.check()
    assert llm.manager.stats()["chunks_held"] == 0


@pytest.fixture(scope="module")
def expected(tiny_gpu_folder):
    manager = _manager(faults=False)
    llm = _llm(tiny_gpu_folder, manager)
    tokens = _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    # Twice: the second run maps the first run's recorded prompts.
    assert _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == tokens
    llm.close()
    manager.close()
    return tokens


@pytest.mark.parametrize("op", ENGINE_OPS)
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_one_failed_backend_call_fails_at_most_its_own_requests(tiny_gpu_folder, expected, op, overlap):
    """With overlap too: a failure while a step is in flight, and releases
    that wait for it (the oracle is the engine without overlap)."""
    manager = _manager(faults=True)
    llm = _llm(tiny_gpu_folder, manager, overlap)
    fired = 0
    for nth in (1, 2, 3, 5, 8, 13):
        manager.trim()  # chunks come from the device again, not the pool's free list
        calls = manager.faults.calls(op)
        manager.faults.fail_nth(op, nth)
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        fired += manager.faults.calls(op) - calls >= nth
        manager.faults.clear()
        failed = 0
        for out, want in zip(outputs, expected):
            for sample, tokens in zip(out.outputs, want):
                if sample.error is None:
                    assert sample.token_ids == tokens, (op, nth)
                else:  # failed alone, with vtm's typed error
                    assert sample.finish_reason == "error" and isinstance(sample.error, vtm.Error), sample.error
                    failed += 1
        # One failed call concerns one sequence's memory at most: a batched
        # map that fails is retried per sequence, a failed record, match or
        # release costs no request anything.
        assert failed <= 1, (op, nth, [s.error for out in outputs for s in out.outputs])
        llm.manager.check()
        # The engine is not wedged: the next requests run exactly as without faults.
        assert _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == expected, (op, nth)
        llm.manager.check()
    assert fired >= 3, f"the injected {op} faults fired only {fired} times: the sweep tests nothing"
    _assert_empty(llm)
    llm.close()
    manager.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_session_lost_between_decode_steps_recomputes_exactly(tiny_gpu_folder, overlap):
    """The session is lost (vtm.Unavailable while planning) as a request
    decodes, one token a step (max_batch_tokens=1): it resumes by computing
    its tokens again, one a step, the same sequence as before. That must not
    pass for a decode continuing the step before the loss: the engine fed
    that step's token at a prompt row and sampled a token there."""
    prompt = [1, 17, 99, 23, 250, 7]

    def run(lose_at):
        manager = _manager(faults=False)
        engine = Engine(tiny_gpu_folder, manager=manager, max_model_len=256, max_num_seqs=8, max_batch_tokens=1,
                        enable_prefix_caching=False, overlap=overlap)
        seq = Sequence(1, 0, 0, prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), 0, ())
        engine.add(seq)
        schedule, steps = engine.scheduler.schedule, 0

        def lost():
            engine.scheduler.schedule = schedule
            raise vtm.Unavailable("the broker went away (simulated)")
        while engine.has_work():
            steps += 1
            if steps == lose_at:
                engine.scheduler.schedule = lost
            engine.step()
        engine.drain()
        engine.close()
        manager.close()
        return seq.finish_reason, seq.output_ids, seq.metrics.preemptions

    reason, tokens, _ = run(None)
    assert (reason, len(tokens)) == ("length", 12)
    assert run(len(prompt) + 4) == (reason, tokens, 1)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_decode_step_interrupted_in_its_forward_pass_is_computed_again(tiny_gpu_folder, overlap):
    """A caller driving Engine.step() itself is interrupted (Ctrl-C) during
    a decode step's forward pass, catches it and steps on: the sequences are
    as the step found them, and their tokens those of an uninterrupted run.
    The continuing decode advanced each sequence before its forward pass and
    left it so: a token pending that no step had sampled."""
    prompts = [[1, 17, 99, 23], [1, 250, 7, 31, 64]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

    def run(interrupt_at):
        manager = _manager(faults=False)
        engine = Engine(tiny_gpu_folder, manager=manager, max_model_len=256, overlap=overlap)
        seqs = [Sequence(i, i, 0, p, params, 0, ()) for i, p in enumerate(prompts)]
        for seq in seqs:
            engine.add(seq)
        forward, calls, interrupted = engine.model.forward, [0], []

        def interrupting(*args, **kwargs):
            calls[0] += 1
            if calls[0] == interrupt_at:
                raise KeyboardInterrupt
            return forward(*args, **kwargs)
        engine.model.forward = interrupting
        step_to_end(engine, 100, lambda: interrupted.append(
            [(s.pending, s.num_tokens - len(s.prompt_ids) - len(s.output_ids)) for s in seqs]))
        engine.close()
        manager.close()
        return [(s.finish_reason, s.output_ids) for s in seqs], interrupted

    expected, _ = run(None)
    assert all(reason == "length" and len(tokens) == 10 for reason, tokens in expected)
    got, interrupted = run(4)  # a decode of both, continuing the one before
    assert len(interrupted) == 1 and got == expected
    # With overlap the step before's tokens are still pending: one each, counted in num_tokens.
    assert interrupted[0] == ([(1, 1)] * 2 if overlap else [(0, 0)] * 2)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_seeded_rows_draw_the_same_tokens_after_an_interrupted_step_and_beside_others(tiny_gpu_folder, overlap):
    """On the device's sampling path (BatchSampler, forced here on a CPU), a
    seeded request's tokens are those it draws alone: beside requests that
    end before it (its batch changes, and its sampler with it), and when a
    step is interrupted (Ctrl-C) after sampling and computed again. A seeded
    row's uniform is a function of its seed and its token's index; it drew
    from a generator whose state the interrupted step had advanced."""
    prompts = [[1, 17, 99, 23], [1, 250, 7, 31, 64], [1, 5, 6]]
    params = [SamplingParams(max_tokens=12, temperature=1.5, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=1.2, top_k=40, seed=9, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=1.0, ignore_eos=True)]

    def run(rows, interrupt_at=None):
        manager = _manager(faults=False)
        engine = Engine(tiny_gpu_folder, manager=manager, max_model_len=256, overlap=overlap)
        engine.sampling_device = torch.device("cpu")
        seqs = [Sequence(i, i, 0, prompts[i], params[i], 0, ()) for i in rows]
        for seq in seqs:
            engine.add(seq)
        sample, calls = engine._sample, [0]

        def interrupting(*args):
            sample(*args)
            calls[0] += 1
            if calls[0] == interrupt_at:
                raise KeyboardInterrupt
        engine._sample = interrupting
        interrupted = step_to_end(engine, 100)
        engine.close()
        manager.close()
        assert len(interrupted) == (interrupt_at is not None)
        return {i: (s.finish_reason, s.output_ids) for i, s in zip(rows, seqs)}

    alone = run([0])[0]
    assert alone[0] == "length" and len(alone[1]) == 12 and len(set(alone[1])) > 3
    assert run([1])[1] == run([2, 1, 0])[1]
    for interrupt_at in (3, 6):
        got = run([0, 1, 2], interrupt_at)
        assert got[0] == alone and got[1] == run([1])[1], interrupt_at


@pytest.mark.parametrize("where", ["forward", "sampling"])
def test_sequences_a_failed_step_fails_hold_no_pending_token(tiny_gpu_folder, where):
    """A step whose forward pass or sampling raises fails its requests; none
    of them is left with a token pending that no step will resolve."""
    manager = _manager(faults=False)
    engine = Engine(tiny_gpu_folder, manager=manager, max_model_len=256)
    seqs = [Sequence(i, i, 0, [1, 40 + i, 9], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), 0, ())
            for i in range(2)]
    for seq in seqs:
        engine.add(seq)
    for _ in range(3):
        engine.step()
    target = engine.model if where == "forward" else engine
    name = "forward" if where == "forward" else "_sample"

    def broken(*args, **kwargs):
        raise RuntimeError("a failed step (simulated)")
    setattr(target, name, broken)
    engine.step()
    delattr(target, name)
    for seq in seqs:
        assert seq.status is Status.FINISHED and seq.finish_reason == "error"
        assert seq.pending == 0 and seq.num_tokens == len(seq.prompt_ids) + len(seq.output_ids) == 3 + 3
    engine.drain()
    engine.close()
    manager.close()


def test_a_failed_background_record_does_not_wedge_the_engine(tiny_gpu_folder, expected):
    """Finding 2: a prefix_record whose copy failed stayed in the scheduler's
    background list, and drain() / the next step re-raised its error forever."""
    manager = _manager(faults=True)
    llm = _llm(tiny_gpu_folder, manager)
    manager.faults.fail_nth("copy", 1)
    first = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert manager.faults.calls("copy") >= 1
    assert all(s.error is None for out in first for s in out.outputs)  # a record concerns no running request
    assert _tokens(first) == expected
    assert llm.engine.stats()["prefix_failures"] >= 1
    assert _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == expected
    _assert_empty(llm)
    llm.close()
    manager.close()


def test_a_stop_token_outside_the_vocabulary_fails_only_its_request(tiny_gpu_folder, expected):
    """Finding 3: an id >= vocab in stop_token_ids with min_tokens >= 1 raised
    IndexError in sample() and failed every request of the step."""
    manager = _manager(faults=False)
    llm = _llm(tiny_gpu_folder, manager)
    vocab = llm.config.vocab_size
    bad = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, min_tokens=2, stop_token_ids=[vocab + 5])
    outputs = llm.generate(PROMPTS + [PROMPT], [PARAMS] * len(PROMPTS) + [bad], use_tqdm=False)
    assert _tokens(outputs[:-1]) == expected
    refused = outputs[-1].outputs[0]
    assert refused.finish_reason == "error" and isinstance(refused.error, InvalidArgument)
    assert "stop_token_ids" in str(refused.error)
    _assert_empty(llm)
    llm.close()
    manager.close()


def test_a_row_that_cannot_be_sampled_fails_alone(tiny_gpu_folder):
    """Behind the submission checks: a row whose sampling raises (here a banned
    id outside the vocabulary, which EngineLoop.submit would refuse) fails its
    own sequence; the other rows of the batch get their tokens."""
    manager = _manager(faults=False)
    engine = Engine(tiny_gpu_folder, manager=manager, max_model_len=256, max_num_seqs=4)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    broken = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, min_tokens=2,
                            stop_token_ids=[engine.config.vocab_size + 1])
    good = Sequence(1, 0, 0, PROMPT, greedy, 0, ())
    bad = Sequence(2, 1, 0, PROMPT[:20], broken, 0, ())
    alone = Sequence(3, 2, 0, PROMPT, greedy, 0, ())
    for seq in (good, bad):
        engine.add(seq)
    while engine.has_work():
        engine.step()
    engine.add(alone)
    while engine.has_work():
        engine.step()
    engine.drain()
    assert bad.status is Status.FINISHED and bad.finish_reason == "error" and bad.error is not None
    assert good.finish_reason == "length" and good.output_ids == alone.output_ids
    engine.manager.check()
    engine.close()
    manager.close()


def test_two_reclaim_notices_before_a_step_are_answered_together(tiny_gpu_folder):
    """A broker's second reclaim notice comes before the engine's step has
    answered the first (a step may take seconds when its own allocation
    waits in the broker). Each notice asks for what it adds, so the step
    gives back both; the second used to replace the first, which left a
    debt the broker then enforced by refusing the engine memory."""
    manager = _manager(faults=False)
    engine = Engine(tiny_gpu_folder, manager=manager, max_model_len=256, max_num_seqs=8)
    seqs = [Sequence(i, i, 0, [1, 40 + i] * 20, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), 0, ())
            for i in range(4)]
    for seq in seqs:
        engine.add(seq)
    engine.step()
    one = sum(vt.mapped_bytes for vt in engine.scheduler.running[-1].vtensors)
    assert len(engine.scheduler.running) == 4 and one > 0
    assert engine.scheduler.reclaim(one, timeout_s=0) == 0  # not answered yet
    assert engine.scheduler.reclaim(one, timeout_s=0) == 0
    engine.step()
    assert engine.scheduler.num_preemptions == 2 and len(engine.scheduler.running) == 2
    while engine.has_work():
        engine.step()
    engine.drain()
    assert [len(seq.output_ids) for seq in seqs] == [8] * 4
    engine.close()
    manager.close()


def test_a_failed_release_in_a_partial_match_of_layer_groups_is_retried(tiny_gpu_folder):
    """Two layer groups, preemption by swap with prefix caching off: a
    readmission's match where one group serves the swapped-out prefix and
    the other serves none gives back the first group's vTensor. A failed
    unmap there (vtm leaves the vTensor live) was raised out of the match
    and the vTensor was never released again: its chunks stayed held, and
    the requests that needed them failed for want of memory. Now it is
    retried at the next step, as any failed release."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [PROMPT[:20], PROMPT[:45] + [7], PROMPT[5:38], PROMPT + [3], PROMPT[:12], PROMPT[10:60]]

    def llm_on(manager):
        return LLM(tiny_gpu_folder, manager=manager, max_model_len=256, max_num_seqs=8, max_batch_tokens=64,
                   layer_groups=2, enable_prefix_caching=False, preemption="swap", memory_wait_s=0)

    def pool(faults: bool) -> vtm.Manager:
        return vtm.Manager(backend="host", capacity_bytes=40 * CHUNK, chunk_bytes=CHUNK, granularity=CHUNK,
                           host_tier_bytes=256 * CHUNK, faults=faults)

    with pool(faults=False) as manager, llm_on(manager) as llm:
        expected = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.stats()["swap_in_tokens"] > 0  # the pool is small enough to preempt
    for nth in range(1, 14):
        with pool(faults=True) as manager, llm_on(manager) as llm:
            manager.faults.fail_nth("unmap", nth)
            outputs = [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)]
            manager.faults.clear()
            assert [o.token_ids for o in outputs] == expected, (nth, [o.error for o in outputs])
            manager.check()
            stats = manager.stats()
            assert all(space["vtensors"] == 0 for space in stats["spaces"].values()), nth
            assert stats["tree_nodes"] == 0, nth  # every swap record forgotten, after a failed release too
            for space in llm.kv_cache.spaces:
                space.clear_prefixes()
            manager.trim()
            assert manager.stats()["chunks_held"] == 0, nth


def test_a_create_that_fails_in_a_later_group_gives_the_earlier_ones_to_the_schedulers_release(tiny_gpu_folder):
    """Two layer groups: the second group's create runs out of memory and
    the release of the first group's vTensor fails. KVCache.create raised
    that release's BackendError (an out-of-memory, which waits, became a
    failure) and left the vTensor live, held by nobody: its slot and page
    were lost for the session. Now the scheduler's release keeps it for its
    retry at the next step, and the create raises its own OutOfMemory."""
    # No slot cache: a release unmaps at once.
    with vtm.Manager(backend="host", capacity_bytes=64 * CHUNK, chunk_bytes=CHUNK, granularity=CHUNK,
                     slot_cache_bytes=0, faults=True) as manager, \
            LLM(tiny_gpu_folder, manager=manager, max_model_len=256, max_num_seqs=2, layer_groups=2) as llm:
        kv, scheduler = llm.kv_cache, llm.scheduler
        manager.faults.fail_nth("create_chunk", 2, oom=True)  # the second group's page
        manager.faults.fail_nth("unmap", 1)  # the release of the first group's
        with pytest.raises(vtm.OutOfMemory):
            kv.create(1, release=scheduler.release)
        manager.faults.clear()
        assert scheduler.num_memory_faults == 1 and [vt.released for vt in scheduler._unreleased] == [False]
        scheduler._retry_releases()
        assert scheduler._unreleased == []
        assert [space.free_slots for space in kv.spaces] == [kv.max_slots] * 2
        manager.check()
