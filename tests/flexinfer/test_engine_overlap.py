"""The engine's overlap (issue 20, item 1): a step is launched before the host
reads the tokens of the step before it, so the device computes step N while the
host plans step N+1 and delivers step N-1.

Oracle: the same engine without overlap (itself checked against transformers in
test_engine.py), on the same weights, prompts and parameters. On the CPU a step
computes as it is launched, so these tests check the bookkeeping that makes
overlap exact: pending tokens, stop conditions (at most one discarded token per
stopped sequence, none for one that reaches max_tokens), releases that wait for
the step still using the memory, preemption, cancels and faults. On a GPU
(marker gpu) the same outputs with CUDA graphs, and no host-device
synchronisation while a step is launched.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

import vtm
from flexinfer import LLM, InvalidArgument, SamplingParams
from flexinfer.engine import Engine
from flexinfer.sequence import Sequence, Status
from manager_testing import WatchedSteps

CHUNK = 4096  # a few tiny rows a page: sequences grow through several pages
VOCAB = 512


def _prompts(lengths, seed=3):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, VOCAB) for _ in range(n - 1)] for n in lengths]


PROMPTS = _prompts([5, 17, 9, 30, 2, 12])
MAX_TOKENS = [1, 7, 12, 20, 3, 16]


def _greedy(max_tokens, **kwargs):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def _manager(chunks=512):
    return vtm.Manager(backend="host", capacity_bytes=chunks * CHUNK, chunk_bytes=CHUNK, granularity=CHUNK)


class Counted:
    """Runs prompts on a fresh engine and counts the tokens its forward
    passes computed or mapped from the prefix cache."""

    def __init__(self, folder, overlap, manager=None, **kwargs):
        self.manager = manager or _manager()
        self.llm = LLM(folder, manager=self.manager, overlap=overlap, max_model_len=256, max_num_seqs=8, **kwargs)
        self.computed = 0
        forward = self.llm.model.forward

        def counting(input_ids, *args, **kw):
            self.computed += input_ids.shape[0]
            return forward(input_ids, *args, **kw)
        self.llm.model.forward = counting

    def generate(self, prompts, params):
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        # Tokens mapped from the prefix cache count as computed: which
        # requests hit depends on when others' prompts were recorded.
        self.computed += sum(out.metrics.prefix_hit_tokens for out in outputs)
        self.llm.manager.check()
        stats = self.llm.manager.stats()["spaces"][self.llm.kv_cache.space.name]
        assert stats["vtensors"] == 0, "a finished generate left a vTensor alive"
        assert not self.llm.engine.has_work()
        return outputs

    def close(self, empty=True):
        if empty:
            self.llm.kv_cache.space.clear_prefixes()
            self.llm.manager.trim()
            self.llm.manager.check()
            assert self.llm.manager.stats()["chunks_held"] == 0
        self.llm.close()
        self.manager.close()


def _samples(outputs):
    return [[(s.token_ids, s.finish_reason) for s in out.outputs] for out in outputs]


def test_overlap_is_checked():
    with pytest.raises(InvalidArgument, match="overlap"):
        LLM("no-such-model", backend="host", overlap="yes", max_model_len=64)


def test_overlap_is_on_by_default_only_on_cuda(tiny_gpu_folder):
    with LLM(tiny_gpu_folder, backend="host", max_model_len=64) as llm:
        assert llm.engine.overlap is False  # a CPU step computes as it is launched: nothing to overlap


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-on", "prefix-off"])
@pytest.mark.parametrize("max_batch_tokens", [7, 1024], ids=["chunked", "whole"])
def test_greedy_outputs_and_work_equal_the_engine_without_overlap(tiny_gpu_folder, prefix_caching, max_batch_tokens):
    """Requests of different lengths end at different steps (1 to 20 tokens);
    chunked prompts run beside decodes. Each reaches max_tokens, so overlap
    computes not one token more: a sequence whose pending token is its last
    is not planned again."""
    params = [_greedy(m) for m in MAX_TOKENS]
    runs = {}
    for overlap in (False, True):
        run = Counted(tiny_gpu_folder, overlap, enable_prefix_caching=prefix_caching,
                      max_batch_tokens=max_batch_tokens)
        first = run.generate(PROMPTS, params)
        # Again: prefix hits (with prefix caching) and reused slots.
        again = run.generate(PROMPTS, params)
        runs[overlap] = (_samples(first), _samples(again), run.computed,
                         [o.metrics.prefix_hit_tokens for o in again])
        run.close()
    assert runs[True] == runs[False]
    assert [len(s[0][0]) for s in runs[True][0]] == MAX_TOKENS


def _stop_ids_from(outputs, at=3):
    """Per request, its own output token at index `at` as a stop token (where it has one)."""
    return [[out.outputs[0].token_ids[at]] if len(out.outputs[0].token_ids) > at else [] for out in outputs]


def test_a_stop_costs_at_most_one_discarded_token(tiny_gpu_folder):
    """Stop tokens met before max_tokens: the outputs and finish reasons equal
    the engine's without overlap, and overlap computed at most one token
    more per stopped sequence (the token after the stop, never emitted).
    That token's KV is the stop token's, so the next turn of the
    conversation maps it too."""
    results, stop_ids = {}, None
    for overlap in (False, True):
        run = Counted(tiny_gpu_folder, overlap)
        reference = run.generate(PROMPTS, [_greedy(m) for m in MAX_TOKENS])
        stop_ids = stop_ids or _stop_ids_from(reference)
        run.llm.kv_cache.space.clear_prefixes()  # the follow-ups below map only what the stopped requests recorded
        params = [_greedy(m, stop_token_ids=ids) for m, ids in zip(MAX_TOKENS, stop_ids)]
        before = run.computed
        outputs = run.generate(PROMPTS, params)
        work = run.computed - before
        follow_ups = [p + out.outputs[0].token_ids + [5, 6] for p, out in zip(PROMPTS, outputs)]
        second = run.generate(follow_ups, [_greedy(4)] * len(follow_ups))
        results[overlap] = (_samples(outputs), work, _samples(second), [o.metrics.prefix_hit_tokens for o in second])
        run.close()
    samples, work, second, hits = results[True]
    assert samples == results[False][0] and second == results[False][2]
    stopped = sum(sample[0][1] == "stop" for sample in samples)
    assert stopped >= 3, "the stop tokens stopped too few requests: the test checks nothing"
    assert 0 < work - results[False][1] <= stopped, (work, results[False][1], stopped)
    assert all(h >= h0 for h, h0 in zip(hits, results[False][3])) and sum(hits) > sum(results[False][3])


def test_stop_strings_min_tokens_and_sampling_equal_the_engine_without_overlap(tiny_gpu_folder):
    """Stop strings (checked on the host while the next step computes),
    min_tokens with stop tokens (chosen on the host while a stop is banned),
    seeded sampling (chosen on the host with the requests' generators) and
    greedy requests in the same batches."""
    results, params = {}, None
    for overlap in (False, True):
        run = Counted(tiny_gpu_folder, overlap)
        reference = run.generate(PROMPTS, [_greedy(m) for m in MAX_TOKENS])
        if params is None:
            stop_word = run.llm.tokenizer.decode(reference[3].outputs[0].token_ids[4:5]).strip()
            stop_ids = _stop_ids_from(reference, at=1)
            params = [
                _greedy(MAX_TOKENS[0]),
                _greedy(MAX_TOKENS[1], stop_token_ids=stop_ids[1], min_tokens=4),
                SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=7, ignore_eos=True),
                _greedy(MAX_TOKENS[3], stop=[stop_word]),
                SamplingParams(max_tokens=9, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True, n=2),
                _greedy(MAX_TOKENS[5], stop_token_ids=stop_ids[5]),
            ]
        results[overlap] = _samples(run.generate(PROMPTS, params))
        run.close()
    assert results[True] == results[False]
    reasons = [s[1] for out in results[True] for s in out]
    assert reasons.count("stop") >= 2, reasons


def test_sampled_rows_chosen_where_the_logits_are_keep_the_step_on_the_device(tiny_gpu_folder):
    """The GPU engine's path for sampled rows (BatchSampler), run on the
    CPU: their steps are no longer read at once, seeded requests repeat
    their tokens in another engine and beside other requests, top_k=1 is
    greedy, greedy rows in the same batches are unchanged, and min_tokens
    bans the stop ids of a sampled row."""
    greedy = [_greedy(m) for m in MAX_TOKENS]
    params = list(greedy)
    params[1] = SamplingParams(max_tokens=10, temperature=0.9, top_k=30, top_p=0.9, seed=4, ignore_eos=True)
    params[3] = SamplingParams(max_tokens=MAX_TOKENS[3], temperature=1.0, top_k=1, seed=1, ignore_eos=True)
    params[5] = SamplingParams(max_tokens=12, temperature=1.5, seed=8, ignore_eos=True, n=2)
    results, chosen_on_host = [], []
    for prompts, order in ((PROMPTS, range(6)), (PROMPTS[::-1], range(5, -1, -1))):
        run = Counted(tiny_gpu_folder, overlap=True)
        engine = run.llm.engine
        engine.sampling_device = torch.device("cpu")
        sample = engine._sample

        def watched(rows, step):
            sample(rows, step)
            chosen_on_host.append(step.chosen_on_host)
        engine._sample = watched
        outs = _samples(run.generate(prompts, [params[i] for i in order]))
        results.append([outs[list(order).index(i)] for i in range(6)])
        if prompts is PROMPTS:  # the first engine also runs the baselines
            plain = _samples(run.generate(PROMPTS, greedy))
            # Nearly greedy, its greedy tokens its stop ids: without the ban it would stop at once.
            stops = plain[1][0][0][:3]
            banned = SamplingParams(max_tokens=10, temperature=0.05, seed=4, stop_token_ids=stops, min_tokens=5)
            early = _samples(run.generate(PROMPTS[1:2], [banned]))[0][0]
        run.close()
    assert not any(chosen_on_host)
    assert results[0] == results[1]
    for i in (0, 2, 4):
        assert results[0][i] == plain[i]
    assert results[0][3] == plain[3]  # top_k=1
    assert results[0][1] != plain[1] and len({tuple(s[0]) for s in results[0][5]}) == 2
    assert len(early[0]) >= 5 and not set(early[0][:5]) & set(stops), early


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_with_a_step_in_flight(tiny_gpu_folder, preemption):
    """Room for a few requests at a time: the scheduler preempts sequences
    whose next token is still in flight (it waits for the device before it
    releases their memory) and readmits them once that token is read."""
    params = [_greedy(24) for _ in PROMPTS]
    results = {}
    for overlap in (False, True):
        manager = vtm.Manager(backend="host", capacity_bytes=24 * CHUNK, chunk_bytes=CHUNK, granularity=CHUNK,
                              host_tier_bytes=512 * CHUNK)
        run = Counted(tiny_gpu_folder, overlap, manager=manager, preemption=preemption)
        outputs = run.generate(PROMPTS, params)
        results[overlap] = (_samples(outputs), sum(o.metrics.preemptions for o in outputs))
        run.close()
    assert results[True][0] == results[False][0]
    assert results[True][1] > 0 and results[False][1] > 0


def _engine(folder, **kwargs):
    return Engine(folder, manager=_manager(), max_model_len=256, max_num_seqs=8, overlap=True, **kwargs)


def _run(engine, seqs=()):
    """Adds `seqs`, then steps until the engine is idle."""
    for seq in seqs:
        engine.add(seq)
    while engine.has_work():
        engine.step()


def test_an_end_of_sequence_id_outside_the_vocabulary_bans_nothing_on_the_device_path(tiny_gpu_folder):
    """A model whose end-of-sequence id lies outside its vocabulary (a
    config quirk) bans it below min_tokens: the device's sampler leaves it
    out, as it can never be chosen. It used to send the step to the host,
    whose sample() fails such a row (and, on CUDA, every seeded row: their
    generators are the device's; found by review)."""
    engine = _engine(tiny_gpu_folder)
    engine.sampling_device = torch.device("cpu")
    params = SamplingParams(max_tokens=9, temperature=0.9, seed=6, min_tokens=4)
    seqs = [Sequence(i, i, 0, [1, 30 + i, 7], params, 0, (4096,)) for i in range(3)]
    try:
        _run(engine, seqs)
        assert [(s.finish_reason, s.error) for s in seqs] == [("length", None)] * 3
        assert all(len(s.output_ids) == 9 for s in seqs)
    finally:
        engine.close()


def _vtensors(engine):
    return engine.manager.stats()["spaces"][engine.kv_cache.space.name]["vtensors"]


def _close(engine):
    manager = engine.manager
    engine.drain()
    engine.kv_cache.space.clear_prefixes()
    manager.trim()
    manager.check()
    assert manager.stats()["chunks_held"] == 0
    engine.close()
    manager.close()


def test_a_finished_sequence_keeps_its_memory_until_the_step_in_flight_completes(tiny_gpu_folder):
    """A stops at a stop token while the next step, which still computes A's
    discarded token, is in flight: A is reported finished at once, but its
    vTensor is released only when that step has been read (on a GPU the step
    still writes A's pages)."""
    engine = _engine(tiny_gpu_folder)
    probe = Sequence(1, 0, 0, PROMPTS[1], _greedy(8), 0, ())
    _run(engine, [probe])
    stop = probe.output_ids[2]
    engine.kv_cache.space.clear_prefixes()  # the next turn below can map only what A records
    a = Sequence(2, 1, 0, PROMPTS[1], _greedy(8, stop_token_ids=[stop]), 0, ())
    b = Sequence(3, 2, 0, PROMPTS[3], _greedy(12), 0, ())
    engine.add(a)
    engine.add(b)
    seen = []
    while a.status is not Status.FINISHED:
        seen += [s.id for s in engine.step()]
    assert a.finish_reason == "stop" and a.output_ids == probe.output_ids[:3]
    assert a.pending == 1 and _vtensors(engine) == 2  # A's discarded token is in flight, and its memory held
    # A's conversation is recorded already: its next turn, asked for now, maps all of it.
    turn = Sequence(4, 3, 0, PROMPTS[1] + a.output_ids + [5], _greedy(2), 0, ())
    engine.add(turn)
    engine.step()
    assert a.pending == 0 and _vtensors(engine) == 2  # A's released, the next turn's created
    assert turn.metrics.prefix_hit_tokens == len(PROMPTS[1]) + len(a.output_ids)
    assert a.output_ids == probe.output_ids[:3]  # the discarded token was never emitted
    _run(engine)
    assert b.finish_reason == "length" and len(b.output_ids) == 12
    assert _vtensors(engine) == 0
    _close(engine)


def test_a_request_waiting_for_memory_that_a_step_in_flight_holds_is_admitted(tiny_gpu_folder):
    """Two slots, both held by requests cancelled while their step is in
    flight: their release waits for that step, and the waiting request's
    admission, which finds no free slot, waits for it too (it failed before:
    "no memory", with nothing running)."""
    engine = Engine(tiny_gpu_folder, manager=_manager(), max_model_len=256, max_num_seqs=2, overlap=True)
    a, b, x = (Sequence(i, i, 0, PROMPTS[i], _greedy(10), 0, ()) for i in range(3))
    for seq in (a, b, x):
        engine.add(seq)
    for _ in range(3):
        engine.step()
    assert a.pending and b.pending and x.status is Status.WAITING
    engine.abort(a)
    engine.abort(b)
    _run(engine)
    assert x.finish_reason == "length" and len(x.output_ids) == 10, x.error
    assert _vtensors(engine) == 0
    _close(engine)


def test_a_window_low_mark_keeps_what_the_step_in_flight_reads(tmp_path, save_word_tokenizer):
    """A sliding-window model: each step raises the window's low mark
    (unmapping pages wholly below it). With a step in flight, the mark must
    stay at the first row that step reads; planned from the next step's
    start, it unmapped a page the step in flight still read (on CUDA an
    illegal address). Outputs equal the engine without overlap."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                                        max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path)
    save_word_tokenizer(tmp_path, VOCAB)
    prompts, params = _prompts([20, 33, 9], seed=9), [_greedy(30), _greedy(25), _greedy(40)]
    outputs = {}
    for overlap in (False, True):
        engine = Engine(str(tmp_path), manager=_manager(), max_model_len=256, max_num_seqs=4, max_batch_tokens=7,
                        overlap=overlap)
        window = max(engine.kv_cache.windows)
        assert window == 8
        scheduler, marks, early = engine.scheduler, [0], []

        def check(targets):
            owner = {vt: seq for seq in scheduler.running for vt in seq.vtensors}
            for vt, target in targets.items():
                seq = owner.get(vt)
                if not isinstance(target, tuple) or seq is None:
                    continue
                marks[0] += 1
                if seq.last_step > scheduler._completed and target[1] > max(0, seq.last_start - window + 1):
                    early.append((seq.id, target[1], seq.last_start))
        scheduler.manager = WatchedSteps(scheduler.manager, check)
        seqs = [Sequence(i, i, 0, p, q, 0, ()) for i, (p, q) in enumerate(zip(prompts, params))]
        _run(engine, seqs)
        outputs[overlap] = [(s.finish_reason, s.output_ids) for s in seqs]
        assert marks[0] > 15 and early == [], early[:5]  # only steps that map or unmap go to vtm
        _close(engine)
    assert outputs[True] == outputs[False]


def test_a_cancel_while_its_token_is_in_flight(tiny_gpu_folder):
    """A request cancelled between steps has a token in flight: it is never
    emitted, the memory is released after that step, the others go on."""
    engine = _engine(tiny_gpu_folder)
    seqs = [Sequence(i, i, 0, p, _greedy(10), 0, ()) for i, p in enumerate(PROMPTS[:3])]
    for seq in seqs:
        engine.add(seq)
    for _ in range(4):
        engine.step()
    victim = seqs[1]
    assert victim.pending == 1
    emitted = list(victim.output_ids)
    engine.abort(victim)
    assert victim.status is Status.FINISHED
    _run(engine)
    assert victim.output_ids == emitted and victim.pending == 0
    assert [len(s.output_ids) for s in (seqs[0], seqs[2])] == [10, 10]
    assert _vtensors(engine) == 0
    _close(engine)


def test_a_cancelled_stream_ends_with_its_memory_released(tiny_gpu_folder):
    """RequestStream.cancel: once wait() returns, the KV is released. With
    overlap the release waits for the step in flight, so the engine loop
    waits for the device when it cancels; the step after the cancel is held
    here until the count is read."""
    llm = LLM(tiny_gpu_folder, manager=_manager(), overlap=True, max_model_len=256)
    engine, gate, aborted = llm.engine, threading.Event(), threading.Event()
    step, abort = engine.step, engine.abort

    def gated_step():
        if aborted.is_set():
            gate.wait(30)
        return step()

    def noted_abort(*args, **kwargs):
        abort(*args, **kwargs)
        aborted.set()
    engine.step, engine.abort = gated_step, noted_abort
    try:
        keep = llm.submit(PROMPTS[3], _greedy(60))
        victim = llm.submit(PROMPTS[1], _greedy(60))
        events = iter(victim)
        next(events)
        next(events)  # decoding, a step in flight
        victim.cancel()
        assert victim.wait(30)
        held = _vtensors(engine)
        gate.set()
        assert held == 1, "the cancelled request's KV outlived its stream"
        assert keep.result(timeout=60).finish_reason == "length"
    finally:
        gate.set()
        manager = llm.manager
        llm.close()
        manager.close()


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(tiny_gpu_folder):
    """The forward pass raises once with a step in flight: the requests of
    the failed step fail, the step in flight is still read, nothing leaks,
    and the next requests run as before."""
    engine = _engine(tiny_gpu_folder)
    forward, calls = engine.model.forward, [0]

    def failing_once(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("injected")
        return forward(*args, **kwargs)
    engine.model.forward = failing_once
    seqs = [Sequence(i, i, 0, p, _greedy(8), 0, ()) for i, p in enumerate(PROMPTS[:3])]
    _run(engine, seqs)
    assert all(s.status is Status.FINISHED for s in seqs)
    assert {s.finish_reason for s in seqs} == {"error"}, [s.finish_reason for s in seqs]
    assert _vtensors(engine) == 0
    engine.manager.check()
    again = Sequence(9, 9, 0, PROMPTS[0], _greedy(8), 0, ())
    _run(engine, [again])
    assert again.finish_reason == "length" and len(again.output_ids) == 8
    _close(engine)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_failed_step_does_not_fail_a_request_the_step_before_ended(tiny_gpu_folder, overlap):
    """With overlap, the step after the one that sampled a request's stop id
    is launched before that token is read, with the request in it. When
    that launch raised, the request was failed ("error", its stop token
    dropped) before the step before was read, where without overlap it had
    ended with "stop". Now the step in flight is read first."""
    probe = _engine(tiny_gpu_folder)
    free = Sequence(0, 0, 0, PROMPTS[1], _greedy(8), 0, ())
    _run(probe, [free])
    _close(probe)
    k = next(i for i, t in enumerate(free.output_ids) if i >= 3 and t not in free.output_ids[:i])
    engine = _engine(tiny_gpu_folder) if overlap else Engine(
        tiny_gpu_folder, manager=_manager(), max_model_len=256, max_num_seqs=8, overlap=False)
    forward, calls = engine.model.forward, [0]

    def failing_after_the_stop(*args, **kwargs):
        calls[0] += 1
        if calls[0] == k + 2:  # call 1 is the prompt's, sampling token 0; call k + 1 samples token k
            raise RuntimeError("injected")
        return forward(*args, **kwargs)
    engine.model.forward = failing_after_the_stop
    seq = Sequence(1, 1, 0, PROMPTS[1], _greedy(8, stop_token_ids=[free.output_ids[k]]), 0, ())
    _run(engine, [seq])
    assert (seq.finish_reason, seq.output_ids) == ("stop", free.output_ids[:k + 1])
    assert _vtensors(engine) == 0
    _close(engine)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_row_of_nan_logits_fails_its_request_alone(tiny_gpu_folder, overlap):
    """One step's logits for one request are NaN. Its choice reads
    NON_FINITE: that request fails with an EngineError, and with overlap
    the step launched meanwhile, which was fed that choice, must not read
    an id outside the vocabulary (it feeds 0 and its token is discarded):
    the other requests end exactly as without the fault."""
    clean = {}
    for faulty in (False, True):
        engine = _engine(tiny_gpu_folder) if overlap else Engine(
            tiny_gpu_folder, manager=_manager(), max_model_len=256, max_num_seqs=8, overlap=False)
        forward, calls = engine.model.forward, [0]

        def nan_once(*args, **kwargs):
            logits = forward(*args, **kwargs)
            calls[0] += 1
            if faulty and calls[0] == 5:
                logits = logits.clone()  # the model's is an inference tensor
                logits[1] = float("nan")
            return logits
        engine.model.forward = nan_once
        seqs = [Sequence(i, i, 0, p, _greedy(10), 0, ()) for i, p in enumerate(PROMPTS[:3])]
        _run(engine, seqs)
        clean[faulty] = [(s.finish_reason, list(s.output_ids)) for s in seqs]
        if faulty:
            assert seqs[1].finish_reason == "error" and "NaN" in str(seqs[1].error)
        assert _vtensors(engine) == 0
        _close(engine)
    assert clean[True][0] == clean[False][0] and clean[True][2] == clean[False][2]


gpu = pytest.mark.skipif(not (vtm.cuda_available() and torch.cuda.is_available()),
                         reason="needs a CUDA driver, a device and a CUDA build of torch")


def _in_sync_debug_mode(mode, fn):
    """fn, run under torch's CUDA sync debug `mode` ("error": a call that
    waits for the device raises), the mode before it restored after."""
    def run(*args):
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(mode)
        try:
            return fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode(before)
    return run


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
def test_gpu_overlap_equals_the_synchronous_engine_and_launches_without_waiting(tiny_gpu_folder, cuda_graphs):
    """bfloat16 on CUDA, graphs and eager: the same tokens with and without
    overlap, and a step is launched without any host-device synchronisation
    (torch's sync debug mode turns one into an error; a graph's first
    capture, which waits for the device once, is let through), sampled rows
    too: a seeded one draws at its seed's own uniforms (sent with one
    pinned copy a step), so it comes out the same in both runs; an unseeded one draws from the shared
    generator, and one below min_tokens has its stop ids banned there."""
    prompts = PROMPTS + _prompts([40, 3, 25, 12], seed=5)
    params = [_greedy(m) for m in MAX_TOKENS + [30, 9]] + [
        SamplingParams(max_tokens=17, temperature=0.8, top_k=20, top_p=0.9, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=11, temperature=1.0, ignore_eos=True)]
    params[4] = SamplingParams(max_tokens=8, temperature=0.7, seed=2, stop_token_ids=list(range(3, 200)),
                               min_tokens=5)
    unseeded = len(params) - 1
    outs = {}
    for overlap in (False, True):
        with LLM(tiny_gpu_folder, dtype="bfloat16", backend="cuda", max_model_len=256, max_num_seqs=16,
                 cuda_graphs=cuda_graphs, overlap=overlap) as llm:
            engine = llm.engine
            launch, launches = engine._launch, [0]

            def counted(*args):
                launches[0] += 1
                return launch(*args)
            if overlap:
                llm.generate(prompts[:2], params[:2], use_tqdm=False)  # kernels compiled
                engine._launch = _in_sync_debug_mode("error", counted)
                if engine.graphs is not None:
                    engine.graphs._capture = _in_sync_debug_mode("default", engine.graphs._capture)
            outputs = llm.generate(prompts, params, use_tqdm=False)
            assert all(o.outputs[0].error is None for o in outputs), [o.outputs[0].error for o in outputs]
            outs[overlap] = _samples(outputs)
            # The unseeded row's tokens are its own each run: its length only.
            outs[overlap][unseeded] = [(len(t), r) for t, r in outs[overlap][unseeded]]
            banned = outs[overlap][4][0][0]
            assert len(banned) >= 5 and all(t not in range(3, 200) for t in banned[:5]), banned
            if overlap:
                assert launches[0] > max(MAX_TOKENS)
    assert outs[True] == outs[False]
