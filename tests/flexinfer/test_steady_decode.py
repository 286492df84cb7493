"""A steady decode's fast paths (issue 20, item 2): the scheduler returns the
step before's plan while no sequence nears a limit (Scheduler's _Steady), a
continuing decode advances the step before's batch vectors, and the engine
reads a quiet step's tokens for the whole batch at once (_SampledBatch).
Each must give what the full per-sequence work gives: checked here against
the same engine with the three paths turned off, over requests that stop at
a stop id, at max_tokens, sample with a seed, share a prefix (n > 1), are
preempted or wait behind a full batch, with overlap on and off.
"""

from __future__ import annotations

import pytest

import vtm
from flexinfer import LLM, SamplingParams
from flexinfer import engine as engine_module
from flexinfer import scheduler as scheduler_module
from flexinfer.engine import Engine
from flexinfer.model.llama import ForwardBatch
from flexinfer.sequence import Sequence
from engine_testing import step_to_end
from scheduler_testing import SteadyPlans

CHUNK = 16384  # ~10.7 rows of the tiny model a page: steady runs of a few steps, and pages that fill often
PROMPTS = [[1] + list(range(40, 60)), [1, 300, 301, 302], [1] + list(range(40, 52)) + [9, 9], [1, 77] * 9,
           [1, 5, 6, 7, 8, 9, 10], [1] + list(range(100, 131))]


def _params(reference: list[list[int]]) -> list[SamplingParams]:
    """Per prompt: to max_tokens, a shorter max_tokens, a stop id met midway
    (the first time the reference run chose it), a seeded sample, two samples
    of one prompt, and min_tokens over a stop id."""
    stop = reference[2][12]
    return [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop]),
            SamplingParams(max_tokens=25, temperature=0.8, seed=7, ignore_eos=True),
            SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, n=2),
            SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, min_tokens=15,
                           stop_token_ids=[reference[5][3]])]


def _slow_paths(monkeypatch) -> None:
    """The fast paths off: every plan made in full, every batch's vectors
    packed from the sequences, every token read alone."""
    monkeypatch.setattr(scheduler_module._Steady, "of", staticmethod(lambda *args: None))
    # No step keeps its batch for the next to advance.
    monkeypatch.setattr(engine_module._Step, "batch", property(lambda self: None, lambda self, batch: None))
    init = engine_module._SampledBatch.__init__

    def no_quiet_steps(self, seqs):
        init(self, seqs)
        self.quiet_until = 0
    monkeypatch.setattr(engine_module._SampledBatch, "__init__", no_quiet_steps)


def _run(folder, overlap: bool, pool_chunks: int, params=None, max_num_seqs: int = 8):
    manager = vtm.Manager(backend="host", capacity_bytes=pool_chunks * CHUNK, chunk_bytes=CHUNK, granularity=CHUNK)
    quiet = []
    with LLM(folder, manager=manager, max_model_len=128, max_num_seqs=max_num_seqs, max_batch_tokens=64,
             overlap=overlap) as llm:
        plans = SteadyPlans(llm.engine.scheduler)
        sample = llm.engine._sample

        def watched_sample(rows, step):
            sample(rows, step)
            quiet.append(step.quiet_stops is not None)
        llm.engine._sample = watched_sample
        if params is None:
            params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        preemptions = llm.engine.scheduler.num_preemptions
    manager.check()
    manager.close()
    results = [[(o.token_ids, o.finish_reason, o.error) for o in out.outputs] for out in outputs]
    first_tokens = [out.metrics.first_token_s is not None for out in outputs]
    return results, first_tokens, plans, sum(quiet), preemptions


@pytest.mark.parametrize("pool_chunks, max_num_seqs", [(512, 8), (12, 8), (512, 3)],
                         ids=["roomy", "preempting", "queued-behind-a-full-batch"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_steady_plans_and_quiet_steps_change_no_output(tiny_gpu_folder, monkeypatch, overlap, pool_chunks,
                                                       max_num_seqs):
    reference = [r[0][0] for r in _run(tiny_gpu_folder, False, 512)[0]]
    params = _params(reference)
    advanced, advance = [], ForwardBatch.advanced
    monkeypatch.setattr(ForwardBatch, "advanced", lambda batch, starts: advanced.append(1) or advance(batch, starts))
    fast, fast_first, plans, quiet_steps, preemptions = _run(tiny_gpu_folder, overlap, pool_chunks, params,
                                                             max_num_seqs)
    fast_advanced = len(advanced)
    with monkeypatch.context() as patch:
        _slow_paths(patch)
        slow, slow_first, slow_plans, slow_quiet, slow_preemptions = _run(tiny_gpu_folder, overlap, pool_chunks,
                                                                          params, max_num_seqs)
    assert slow_plans.steady == 0 and slow_quiet == 0 and len(advanced) == fast_advanced
    assert fast == slow and fast_first == slow_first == [True] * len(PROMPTS)
    assert preemptions == slow_preemptions and (preemptions > 0) == (pool_chunks == 12)
    # What the requests did: the stop id and the shorter max_tokens ended theirs early.
    assert fast[1][0][1] == "length" and len(fast[1][0][0]) == 9
    assert fast[2][0][1] == "stop" and len(fast[2][0][0]) == 13
    assert len(fast[5][0][0]) >= 15
    # Both paths ran, and often: a step plans steadily while every sequence
    # is mid-page (a page holds ~10.7 rows here), and reads quietly while none
    # is at its first token or a stop check.
    assert plans.steady >= 5 and quiet_steps >= 10 and fast_advanced >= 10, (plans.steady, quiet_steps, fast_advanced)


def test_a_step_interrupted_after_sampling_leaves_the_quiet_count_right(tiny_gpu_folder):
    """A caller driving Engine.step() is interrupted (Ctrl-C) right after a
    prefill step sampled each sequence's first token, and steps on. That
    step's tokens were discarded: the batch's next step samples the first
    tokens again, which must not be read as quiet (that would skip their
    time to first token). Nor may any later step read a token quietly that
    reached max_tokens."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run(interrupt_at):
        manager = vtm.Manager(backend="host", capacity_bytes=512 * CHUNK, chunk_bytes=CHUNK, granularity=CHUNK)
        engine = Engine(tiny_gpu_folder, manager=manager, max_model_len=128)
        seqs = [Sequence(i, i, 0, p, params, 0, ()) for i, p in enumerate(PROMPTS[:3])]
        for seq in seqs:
            engine.add(seq)
        sample, calls = engine._sample, [0]

        def interrupting(rows, step):
            sample(rows, step)
            calls[0] += 1
            if calls[0] in interrupt_at:
                raise KeyboardInterrupt
        engine._sample = interrupting
        step_to_end(engine, 50)
        engine.close()
        manager.check()
        manager.close()
        return [(s.finish_reason, s.output_ids, s.metrics.first_token_s is not None) for s in seqs]

    expected = run(())
    assert all(reason == "length" and len(tokens) == 6 and first for reason, tokens, first in expected)
    assert run((1,)) == expected  # the prefill step's sampling
    assert run((1, 2, 6)) == expected  # and then its retry, and the last step's
