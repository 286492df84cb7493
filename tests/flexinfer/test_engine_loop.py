"""The engine thread and what it promises: no bad request, failed step,
second thread or Ctrl-C breaks an LLM; streaming and cancellation; every
failure releases its KV. Issue 10's reproductions, one test each."""

from __future__ import annotations

import gc
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from flexinfer import LLM, EngineClosed, EngineError, InvalidArgument, SamplingParams  # noqa: E402
from flexinfer.detokenizer import IncrementalText, final_text  # noqa: E402
from test_engine import (Oracle, _build_tiny, assert_greedy_equal, greedy, random_prompts,  # noqa: E402
                         run)

POISON = 7  # token whose embedding is NaN in the poisoned model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_hf_tokenizer):
    folder = tmp_path_factory.mktemp("tiny-loop")
    return str(folder), Oracle(_build_tiny(folder, "llama", smollm2_hf_tokenizer, 3))


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory, smollm2_hf_tokenizer):
    """A model whose token POISON embeds to NaN once loaded (poison(llm): a
    file holding a NaN weight is refused at load): a prompt holding it gets
    NaN logits, others are fine."""
    folder = tmp_path_factory.mktemp("tiny-nan")
    model = _build_tiny(folder, "llama", smollm2_hf_tokenizer, 4)
    return str(folder), Oracle(model)


def poison(llm: LLM) -> LLM:
    with torch.no_grad():
        llm.engine.model.embed[POISON] = float("nan")
    return llm


def clean_prompts(lengths, seed):
    return [[t if t != POISON else POISON + 1 for t in p] for p in random_prompts(lengths, seed)]


def assert_idle_and_released(llm: LLM) -> None:
    llm.manager.check()
    assert not llm.scheduler.has_work()
    assert llm.manager.stats()["spaces"][llm.kv_cache.space.name]["vtensors"] == 0


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("call", [
    lambda llm: llm.generate(["hi"], SamplingParams(temperature=float("nan"))),
    lambda llm: llm.generate([[1.0, 2.0]]),
    lambda llm: llm.generate([b"hello"]),
    lambda llm: llm.generate([None]),
    lambda llm: llm.generate(5),
    lambda llm: llm.generate(["a", "b"], priorities=[1]),
    lambda llm: llm.generate(["a"], priorities=["high"]),
    lambda llm: llm.generate(["hello \udcff"]),
    lambda llm: llm.generate(["a"], [SamplingParams(), SamplingParams()]),
    lambda llm: llm.generate(["a"], "greedy"),
    lambda llm: llm.chat([{"role": "user"}]),
    lambda llm: llm.chat([{"role": "user", "content": 5}]),
    lambda llm: llm.chat([[]]),
    lambda llm: llm.submit(b"x"),
    lambda llm: llm.submit([5, 6, 7], stream=False, deliver=print),
    lambda llm: llm.submit([5, 6, 7], deliver="print"),
], ids=["nan-temperature", "float-ids", "bytes", "none", "int", "priorities-length", "priorities-type",
        "lone-surrogate", "params-length", "params-type", "message-without-content", "content-not-str",
        "empty-conversation", "submit-bytes", "deliver-without-stream", "deliver-not-callable"])
def test_bad_input_raises_invalid_argument_and_changes_nothing(tiny, call):
    folder, oracle = tiny
    prompts = clean_prompts([9, 14], seed=1)
    with LLM(folder) as llm:
        with pytest.raises(InvalidArgument):
            call(llm)
        assert_idle_and_released(llm)
        assert_greedy_equal(oracle, prompts, run(llm, prompts, greedy(6)), 6)


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("n", 0), ("n", 1.5), ("temperature", float("nan")), ("temperature", "0"), ("top_p", 2),
    ("top_k", -1), ("seed", "1"), ("seed", 1 << 70), ("stop", [""]), ("stop", 5), ("stop_token_ids", None),
    ("min_tokens", 99), ("ignore_eos", "no"),
])
def test_sampling_params_changed_after_they_were_built_are_checked_again(tiny, field, value):
    """SamplingParams is a plain dataclass, checked when built. One changed
    since is checked again by every call that submits it, whether given
    alone or in a list: it used to reach the engine thread unchecked, and
    fail there (n=0: an IndexError; seed="1": an EngineError for the whole
    step) or run as no valid one could (max_tokens=0 gave a token)."""
    folder, oracle = tiny
    prompts = clean_prompts([9, 14], seed=1)
    changed = greedy(6)
    setattr(changed, field, value)
    with LLM(folder) as llm:
        for call in (lambda: llm.generate(prompts, changed), lambda: llm.generate(prompts, [greedy(6), changed]),
                     lambda: llm.submit(prompts[0], changed),
                     lambda: llm.chat([{"role": "user", "content": "hi"}], changed)):
            with pytest.raises(InvalidArgument, match=field):
                call()
            assert_idle_and_released(llm)
        assert_greedy_equal(oracle, prompts, run(llm, prompts, greedy(6)), 6)


def test_a_submitted_request_keeps_the_sampling_params_it_was_submitted_with(tiny):
    """Changing a SamplingParams after submitting it changes no request
    already submitted (each keeps a checked copy), even one still queued:
    the engine read max_tokens at every step, so a request checked against
    max_model_len and the KV pool with one value ran to another."""
    folder, oracle = tiny
    prompt = clean_prompts([9], seed=2)[0]
    params = greedy(6)
    with LLM(folder) as llm:
        with llm._loop.together():  # the engine thread cannot take the request before it is changed
            handle = llm.submit(prompt, params)
            params.max_tokens = 20
        assert_greedy_equal(oracle, [prompt], [handle.result()], 6)


@pytest.mark.parametrize("kwargs", [dict(max_tokens="8"), dict(max_tokens=True), dict(temperature=float("inf")),
                                    dict(top_p=float("nan")), dict(seed=1.5), dict(stop=[""]), dict(stop=5),
                                    dict(stop_token_ids=["2"]), dict(ignore_eos=1), dict(n=0), dict(n=4097),
                                    dict(min_tokens=9, max_tokens=8),
                                    # Past float's range: an OverflowError out of math.isfinite.
                                    dict(temperature=10**400), dict(top_p=-10**400)])
def test_sampling_params_check_types_and_values(kwargs):
    with pytest.raises(InvalidArgument):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("field, value", [
    ("seed", np.uint64(2**64 - 2)), ("seed", np.int64(-5)), ("max_tokens", np.uint8(6)), ("n", np.int64(2)),
    ("top_k", np.int32(5)), ("min_tokens", np.int16(2)), ("stop_token_ids", [np.int64(9)]),
    ("temperature", np.float32(0.5)), ("top_p", np.float16(0.5)),
], ids=lambda value: value if isinstance(value, str) else type(value).__name__)
def test_numpy_numbers_in_sampling_params_sample_as_the_python_numbers_they_stand_for(tiny, field, value):
    """numpy's numbers pass SamplingParams' checks (numbers.Integral, Real)
    but failed inside the engine: torch's manual_seed takes no numpy int (a
    seed from a numpy RNG failed its step with an EngineError), and a uint8
    max_tokens overflowed in the KV budget's sums (an OverflowError)."""
    folder, _ = tiny
    prompt = clean_prompts([9], seed=5)[0]
    base = dict(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    python_value = [int(v) for v in value] if isinstance(value, list) else value.item()
    with LLM(folder) as llm:
        got = llm.generate([prompt], SamplingParams(**{**base, field: value}))[0]
        want = llm.generate([prompt], SamplingParams(**{**base, field: python_value}))[0]
        assert_idle_and_released(llm)
    assert got.error is None and [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_model_len=-1), "max_model_len must be a positive int"),
    (dict(max_model_len=0), "max_model_len must be a positive int"),
    (dict(kv_capacity_bytes=0), "kv_capacity_bytes must be a positive int"),
    (dict(max_num_seqs="4"), "max_num_seqs must be a positive int"),
    (dict(max_num_seq=4), "unknown option 'max_num_seq': did you mean 'max_num_seqs'?"),
    (dict(foo=1), "unknown option 'foo': the options are dtype, kv_capacity_bytes, "),
    (dict(layer_groups="2"), "layer_groups must be a positive int, got '2'"),
    (dict(chunk_bytes="4096"), "chunk_bytes must be a positive int, got '4096'"),
    (dict(workers=0), "workers must be a positive int, got 0"),
    # What vtm refuses is InvalidArgument too (not vtm's), naming the engine's options.
    (dict(workers=100000), "kv_capacity_bytes=2147483648, chunk_bytes=2097152, workers=100000, host_tier_bytes=0, "
                           "spill_ahead_bytes=0: workers must be in [1, 256], got 100000"),
    (dict(chunk_bytes=12289), "chunk_bytes=12289, workers=1, host_tier_bytes=0, spill_ahead_bytes=0: capacity_bytes "
                              "2147483648 is not a positive multiple of chunk_bytes 12289"),
    (dict(device="bogus"), "device must be a torch device"),
    (dict(backend="bogus"), "backend must be 'auto', 'host' or 'cuda'"),
    (dict(enable_prefix_caching="no"), "enable_prefix_caching must be True or False, got 'no'"),
    (dict(cuda_graphs="yes"), "cuda_graphs must be True, False or None"),
    (dict(namespace=5), "namespace must be a str or None, got 5"),
], ids=lambda value: next(iter(value)) if isinstance(value, dict) else "")
def test_engine_options_are_checked_before_loading(kwargs, message):
    """A bad or unknown option is InvalidArgument naming it, before the weights load (the model does
    not exist: loading it would raise ModelLoadError), not a TypeError or RuntimeError."""
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        LLM("/nonexistent/model", **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(preemption="swap"), "preemption='swap' keeps preempted requests' KV in vtm's host tier"),
    (dict(preemption="swap", manager="no tier"), "preemption='swap' keeps preempted requests' KV in vtm's host tier"),
    (dict(layer_groups=99), "layer_groups must be in [1, 2], got 99"),
    (dict(max_num_seqs=1 << 40), "1099511627776 slots of 256 tokens (2097152 bytes each) exceed the 128 TiB vtm "
                                 "reserves for a space"),
    (dict(max_num_seqs=10 ** 6), "1000000 slots of 256 tokens need a vtm page table of 17000000 entries, more than "
                                 "the 1048576"),
], ids=["swap-without-a-tier", "swap-on-a-manager-without-a-tier", "layer-groups-past-the-layers", "max-num-seqs",
        "max-num-seqs-past-the-page-table"])
def test_options_checked_against_the_manager_or_config_are_checked_before_the_weights_load(tiny, tmp_path, kwargs,
                                                                                           message):
    """A model folder whose weights are corrupt tells the order: these options
    are refused (InvalidArgument), not the weights (ModelLoadError)."""
    import shutil

    import vtm
    from flexinfer import ModelLoadError

    folder, _ = tiny
    for path in Path(folder).iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 1000)
    with pytest.raises(ModelLoadError):
        LLM(str(tmp_path))
    if kwargs.get("manager") == "no tier":
        kwargs = dict(kwargs, manager=vtm.Manager(backend="host", capacity_bytes=16 << 20, chunk_bytes=2 << 20))
    try:
        with pytest.raises(InvalidArgument, match=re.escape(message)):
            LLM(str(tmp_path), **kwargs)
    finally:
        if "manager" in kwargs:
            kwargs["manager"].close()


# ----------------------------------------------------------------------------- failures stay alone

def test_nan_logits_fail_their_request_alone(poisoned):
    folder, oracle = poisoned
    good = clean_prompts([6, 21, 12], seed=2)
    bad = [3, 9, POISON, 11]
    with poison(LLM(folder)) as llm:
        for params in (greedy(5), SamplingParams(max_tokens=5, temperature=0.8, seed=1, ignore_eos=True)):
            outs = run(llm, [good[0], bad, good[1], good[2]], params)
            assert outs[1].finish_reason == "error" and isinstance(outs[1].error, EngineError)
            assert "NaN" in str(outs[1].error) and outs[1].token_ids == []
            if params.greedy:
                assert_greedy_equal(oracle, good, [outs[0], outs[2], outs[3]], 5)
        # The engine serves the next request as if nothing happened.
        assert_greedy_equal(oracle, good, run(llm, good, greedy(7)), 7)


def test_a_step_that_raises_fails_its_batch_and_the_engine_goes_on(tiny, monkeypatch):
    folder, oracle = tiny
    prompts = clean_prompts([5, 18], seed=3)
    with LLM(folder) as llm:
        real = llm.engine.model.forward
        calls = []

        def broken(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:  # the first decode step
                raise RuntimeError("injected kernel failure")
            return real(*args, **kwargs)

        monkeypatch.setattr(llm.engine.model, "forward", broken)
        outs = run(llm, prompts, greedy(6))
        for out in outs:
            assert out.finish_reason == "error" and isinstance(out.error, EngineError)
            assert "injected kernel failure" in str(out.error)
            assert len(out.token_ids) == 1  # the token the prefill sampled
        assert_greedy_equal(oracle, prompts, run(llm, prompts, greedy(6)), 6)


def test_requests_queued_after_one_the_engine_fails_to_add_still_run(tiny, monkeypatch):
    """Requests reach the engine thread in batches (LLM.generate's, or
    whatever came while it stepped). One whose adding raises (a bug) fails
    with the requests already live, as any failure of the loop does; those
    after it in the batch used to be dropped, never added nor failed, and
    their callers waited forever."""
    folder, oracle = tiny
    prompts = clean_prompts([5, 9, 14], seed=4)
    with LLM(folder) as llm:
        real_add = llm.engine.add

        def add(seq):
            if seq.prompt_ids == prompts[0]:
                raise RuntimeError("injected failure to add")
            real_add(seq)

        monkeypatch.setattr(llm.engine, "add", add)
        with llm._loop.together():  # one batch for the engine thread
            handles = [llm.submit(p, greedy(6)) for p in prompts]
        failed, *others = [handle.result(timeout=30) for handle in handles]
        assert isinstance(failed.error, EngineError) and "injected failure to add" in str(failed.error)
        assert_greedy_equal(oracle, prompts[1:], others, 6)
        assert_idle_and_released(llm)
        monkeypatch.undo()
        assert_greedy_equal(oracle, prompts, run(llm, prompts, greedy(6)), 6)


# ----------------------------------------------------------------------------- threads

def test_two_threads_generating_at_once_get_their_own_outputs(tiny):
    folder, oracle = tiny
    sets = [clean_prompts([7, 30, 11], seed=10), clean_prompts([25, 4, 16, 9], seed=11)]
    results: dict[int, list] = {}
    errors = []
    with LLM(folder) as llm:
        def work(i):
            try:
                results[i] = llm.generate(sets[i], greedy(12), use_tqdm=False)
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors
        for i in range(2):
            assert_greedy_equal(oracle, sets[i], results[i], 12)
        assert_idle_and_released(llm)


def test_ctrl_c_cancels_the_interrupted_generate(tiny, monkeypatch, python_sigint):
    """The Ctrl-C arrives after the engine's first step, while generate waits
    for the ~1,000 steps left: at a point in the work, not after a delay (a
    timer lost the race on fast machines, and its late signal killed pytest)."""
    folder, oracle = tiny
    prompts = clean_prompts([10] * 8, seed=12)
    with LLM(folder, max_num_seqs=2) as llm:
        main = threading.main_thread().ident
        step, interrupted = llm.engine.step, threading.Event()

        def step_then_interrupt():
            changed = step()
            if not interrupted.is_set():
                interrupted.set()
                signal.pthread_kill(main, signal.SIGINT)
            return changed

        monkeypatch.setattr(llm.engine, "step", step_then_interrupt)
        started = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, greedy(240), use_tqdm=False)
        assert interrupted.is_set() and time.perf_counter() - started < 20
        monkeypatch.undo()
        # Nothing of the interrupted call is left to run or to hold memory.
        assert_idle_and_released(llm)
        assert_greedy_equal(oracle, prompts[:2], run(llm, prompts[:2], greedy(5)), 5)


def read_slowly_and_ctrl_c(monkeypatch, folder: str) -> tuple[list[str], int]:
    """Has the load read its tensors 0.2 s apart and send the main thread a
    SIGINT (a Ctrl-C) once it has read the first; returns the list of names
    it reads and the folder's number of tensors."""
    from flexinfer.model import loader

    main, real, read = threading.main_thread().ident, loader._safetensors_tensors, []

    def slowly(path):
        for item in real(path):
            read.append(item[0])
            if len(read) == 1:
                signal.pthread_kill(main, signal.SIGINT)
            time.sleep(0.2)
            yield item

    monkeypatch.setattr(loader, "_safetensors_tensors", slowly)
    return read, sum(1 for _ in real(Path(folder)))


def assert_the_load_stopped(read: list[str], tensors: int) -> None:
    assert len(read) <= 3 < tensors, (len(read), tensors)
    assert not any(t.name == "flexinfer-engine" for t in threading.enumerate())  # closed, not left loading


def test_ctrl_c_while_the_model_loads_stops_the_load(tiny, monkeypatch, python_sigint):
    """Ctrl-C during LLM(...) waited for the whole load: the engine thread
    read every tensor before it closed what it had built (`flexinfer
    generate` said nothing for 10-19 s after Ctrl-C on a busy 2-core VM with
    SmolLM2; a large model's minute). The load now stops at its next tensor."""
    folder, _ = tiny
    read, tensors = read_slowly_and_ctrl_c(monkeypatch, folder)
    with pytest.raises(KeyboardInterrupt):
        LLM(folder, linear="torch")
    assert_the_load_stopped(read, tensors)


def test_ctrl_c_before_the_engine_threads_start_returns_stops_the_load(tiny, monkeypatch, python_sigint):
    """The Ctrl-C can reach the main thread while Thread.start() still waits
    to see its thread run (on a loaded machine the engine thread may read
    its first tensors first). EngineLoop caught it only around its wait for
    the build: one raised by start() left the thread loading the whole
    model, never closed (test_ctrl_c_while_the_model_loads_stops_the_load
    failed so in each of three 20-run loops beside two busy loops on 2
    cores). Here start() returns only once the first tensor is read, as it
    did there."""
    folder, _ = tiny
    read, tensors = read_slowly_and_ctrl_c(monkeypatch, folder)
    real_start = threading.Thread.start

    def start_late(thread):
        real_start(thread)
        if thread.name == "flexinfer-engine":
            deadline = time.monotonic() + 10
            while not read and time.monotonic() < deadline:  # the SIGINT ends this wait
                time.sleep(0.01)

    monkeypatch.setattr(threading.Thread, "start", start_late)
    with pytest.raises(KeyboardInterrupt):
        LLM(folder, linear="torch")
    assert_the_load_stopped(read, tensors)


def test_ctrl_c_before_the_engine_thread_exists_is_a_keyboard_interrupt(tiny, monkeypatch):
    """A Ctrl-C in Thread.start() before it made the thread is still a
    KeyboardInterrupt: the loop's close() must not join a thread never
    started (join() raises a RuntimeError, which would take its place)."""
    folder, _ = tiny
    real_start = threading.Thread.start

    def interrupted_start(thread):
        if thread.name == "flexinfer-engine":
            raise KeyboardInterrupt
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", interrupted_start)
    with pytest.raises(KeyboardInterrupt):
        LLM(folder, linear="torch")


# ----------------------------------------------------------------------------- streaming and cancel

def test_streamed_events_add_up_to_the_result(tiny):
    folder, oracle = tiny
    prompt = clean_prompts([13], seed=13)[0]
    with LLM(folder) as llm:
        handle = llm.submit(prompt, SamplingParams(max_tokens=9, temperature=0.7, seed=5, n=2, ignore_eos=True))
        streamed = {0: [], 1: []}
        finishes = {}
        times = []
        for event in handle:
            streamed[event.sample_index] += event.token_ids
            times.append(event.time_s)
            if event.finish_reason:
                finishes[event.sample_index] = event.finish_reason
        out = handle.result()
        assert [o.token_ids for o in out.outputs] == [streamed[0], streamed[1]]
        assert finishes == {0: "length", 1: "length"} and times == sorted(times)
        greedy_out = llm.submit(prompt, greedy(9))
        assert [t for e in greedy_out for t in e.token_ids] == oracle.greedy(prompt, 9)
        assert_idle_and_released(llm)


def test_a_request_waiting_for_a_slot_counts_its_prompt_once(tiny):
    """The test holds one of the cache's two slots: a second request cannot
    get its vTensors beside a running one, and waits, trying each step,
    until the running one's deliver callback gives the slot back (on the
    engine thread, at its third event: the running one still has tokens to
    go). Its prompt is counted once in prefix_query_tokens; each refused try
    used to count it again (review)."""
    folder, oracle = tiny
    prompts = clean_prompts([9, 7], seed=19)
    with LLM(folder, max_num_seqs=2) as llm:
        held = llm.kv_cache.create()
        events = []

        def deliver(event):
            events.append(event)
            if len(events) == 3:
                llm.kv_cache.release(held)

        running = llm.submit(prompts[0], greedy(40), deliver=deliver)
        waiting = llm.submit(prompts[1], greedy(4))
        assert_greedy_equal(oracle, prompts[:1], [running.result(timeout=60)], 40)
        assert_greedy_equal(oracle, prompts[1:], [waiting.result(timeout=60)], 4)
        assert llm.stats()["prefix_query_tokens"] == len(prompts[0]) + len(prompts[1])
        assert_idle_and_released(llm)


def test_requests_that_do_not_stream_hear_only_of_their_end(tiny):
    """The loop hands a step's sequences to their requests (_dispatch) when
    one of them ended or some request streams: a pass over sequences that
    neither stream nor ended costs ~0.2 µs each at batch 256. The results
    are the same either way, and a stream beside requests that do not
    stream gets each token as it comes."""
    folder, oracle = tiny
    prompts = clean_prompts([9, 14, 5], seed=21)
    lengths = [12, 16, 20]
    with LLM(folder) as llm:
        loop, dispatched = llm._loop, []
        dispatch = loop._dispatch

        def counted(seqs):
            dispatched.append(len(seqs))
            dispatch(seqs)
        loop._dispatch = counted
        outs = llm.generate(prompts, [greedy(n) for n in lengths])
        for prompt, n, out in zip(prompts, lengths, outs):
            assert out.outputs[0].token_ids == oracle.greedy(prompt, n) and out.outputs[0].finish_reason == "length"
        assert 1 <= len(dispatched) <= len(prompts), dispatched  # the steps that ended one: not ~20
        dispatched.clear()
        quiet = [llm.submit(p, greedy(n), stream=False) for p, n in zip(prompts[1:], lengths[1:])]
        streamed = llm.submit(prompts[0], greedy(lengths[0]))
        events = [event.token_ids for event in streamed]
        assert [t for e in events for t in e] == oracle.greedy(prompts[0], lengths[0])
        assert len(events) >= lengths[0] - 1 and len(dispatched) >= lengths[0] - 1
        for handle, prompt, n in zip(quiet, prompts[1:], lengths[1:]):
            assert handle.result().outputs[0].token_ids == oracle.greedy(prompt, n)
        assert not loop._streamed
        assert_idle_and_released(llm)


def test_incremental_text_holds_back_stop_strings(tiny):
    folder, _ = tiny
    with LLM(folder) as llm:
        tok = llm.tokenizer
        ids = tok.encode("Hello there, general Kenobi. You are a bold one.")
        for stop in ([], ["Kenobi"], ["bold one", "zzz"], ["."]):
            text = IncrementalText(tok, stop)
            pieces = [text.push([t]) for t in ids] + [text.finish()]
            assert "".join(pieces) == final_text(tok, ids, stop)
            for s in stop:
                assert all(s not in p for p in pieces)


def test_cancel_mid_stream_releases_the_kv(tiny):
    folder, oracle = tiny
    prompts = clean_prompts([12, 20], seed=14)
    with LLM(folder) as llm:
        handle = llm.submit(prompts[0], greedy(200))
        got = []
        for event in handle:
            got += event.token_ids
            if len(got) >= 3:
                handle.cancel()
        out = handle.result()
        assert out.finish_reason == "abort" and out.error is None
        assert 3 <= len(out.token_ids) < 200
        assert out.token_ids == oracle.greedy(prompts[0], len(out.token_ids))
        assert_idle_and_released(llm)
        assert_greedy_equal(oracle, prompts, run(llm, prompts, greedy(4)), 4)


def test_close_ends_running_requests_and_refuses_new_ones(tiny):
    folder, _ = tiny
    llm = LLM(folder)
    handle = llm.submit(clean_prompts([8], seed=15)[0], greedy(240))
    next(iter(handle))
    llm.close()
    out = handle.result(timeout=10)
    assert out.finish_reason == "error" and isinstance(out.error, EngineClosed)
    with pytest.raises(EngineClosed):
        llm.submit([5, 6, 7])
    # Closed comes first: not a request that could never run (an empty prompt) returned as refused.
    with pytest.raises(EngineClosed):
        llm.submit([])
    with pytest.raises(EngineClosed):
        llm.generate([[]])


def test_a_refused_request_is_checked_before_its_samples_are_built(tiny, monkeypatch):
    """A request's n samples share one copy of its prompt, built once it is
    known to run or to be refused: n=20000 samples of a 5000-token prompt
    too long to run used to take 3 s and 800 MiB before being refused."""
    from flexinfer import engine_loop

    folder, _ = tiny
    real_sequence, real_problem = engine_loop.Sequence, engine_loop.request_problem
    events = []
    monkeypatch.setattr(engine_loop, "Sequence", lambda *a, **k: events.append("sample") or real_sequence(*a, **k))
    monkeypatch.setattr(engine_loop, "request_problem",
                        lambda *a, **k: events.append("check") or real_problem(*a, **k))
    sampled = SamplingParams(max_tokens=3, temperature=0.8, seed=1, n=3)
    with LLM(folder, max_model_len=64) as llm:
        for prompt, refused in (([5] * 80, True), ([5, 6, 7], False)):
            events.clear()
            handle = llm.submit(prompt, sampled)
            out = handle.result(timeout=30)
            assert events == ["check", "sample", "sample", "sample"]
            assert all(isinstance(o.error, InvalidArgument) if refused else o.error is None for o in out.outputs)
            prompts = [seq.prompt_ids for seq in handle._seqs]
            assert prompts[0] == prompt and prompts[0] is not prompt and all(p is prompts[0] for p in prompts)


def test_min_tokens_defers_stop_tokens(tiny):
    folder, oracle = tiny
    prompt = clean_prompts([9], seed=16)[0]
    first = oracle.greedy(prompt, 1)[0]
    with LLM(folder) as llm:
        stopped = run(llm, [prompt], SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[first]))[0]
        assert stopped.finish_reason == "stop" and stopped.token_ids == [first]
        held = run(llm, [prompt], SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[first],
                                                 min_tokens=3))[0]
        assert len(held.token_ids) >= 3 and first not in held.token_ids[:3]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_min_tokens_bans_stop_tokens_for_exactly_the_first_min_tokens(tiny, overlap):
    """The boundary of min_tokens, in a decode batch that continues step
    after step (where a sampled token becomes pending before its row is
    sampled): with the first new occurrence of a greedy token s at output
    position j + 1, min_tokens=j lets it stop there, and min_tokens=j + 1
    bans it there. Another prompt decodes beside it."""
    folder, oracle = tiny
    prompts = clean_prompts([9, 7], seed=16)
    want = oracle.greedy(prompts[0], 12)
    j = next(i for i in range(2, len(want)) if want[i] not in want[:i])
    s = want[j]
    beside = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(folder, overlap=overlap) as llm:
        allowed = llm.generate(prompts, [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                        stop_token_ids=[s], min_tokens=j), beside],
                               use_tqdm=False)[0].outputs[0]
        assert allowed.finish_reason == "stop" and allowed.token_ids == want[:j + 1]
        banned = llm.generate(prompts, [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                       stop_token_ids=[s], min_tokens=j + 1), beside],
                              use_tqdm=False)[0].outputs[0]
        assert banned.token_ids[:j] == want[:j] and banned.token_ids[j] != s and len(banned.token_ids) > j + 1


def test_an_unclosed_llm_stops_its_thread_when_collected(tiny):
    folder, _ = tiny
    before = {t.ident for t in threading.enumerate()}
    llm = LLM(folder)
    run(llm, [[5, 6, 7]], greedy(2))
    del llm
    gc.collect()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not [t for t in threading.enumerate() if t.name == "flexinfer-engine" and t.ident not in before]:
            break
        time.sleep(0.05)
    assert not [t for t in threading.enumerate() if t.name == "flexinfer-engine" and t.ident not in before]


def test_a_dead_engine_thread_ends_every_stream_and_refuses_new_requests(tiny, monkeypatch):
    from flexinfer import engine_loop

    folder, _ = tiny
    started = threading.Event()
    release = threading.Event()

    def broken_serve(self):
        started.set()
        release.wait(10)
        raise RuntimeError("injected: the thread cannot serve")

    monkeypatch.setattr(engine_loop.EngineLoop, "_serve", broken_serve)
    with LLM(folder) as llm:
        started.wait(10)
        handle = llm.submit([5, 6, 7], greedy(4))
        release.set()
        out = handle.result(timeout=10)
        assert out.finish_reason == "error" and isinstance(out.error, EngineError)
        assert "injected" in str(out.error)
        llm._loop._thread.join(10)
        with pytest.raises(EngineClosed):
            llm.submit([5, 6, 7])


@pytest.mark.parametrize("raises_on, error", [("every-event", RuntimeError), ("last-event", RuntimeError),
                                              ("every-event", KeyboardInterrupt), ("every-event", SystemExit)])
def test_a_deliver_that_raises_fails_its_own_request_alone(tiny, caplog, raises_on, error):
    """A `deliver` callback that raises is its caller's bug: it is logged once
    and called no more, its request ends with an error saying so, and the
    engine thread, a request beside it and later ones are unaffected (it
    used to fail every live request, and one raising on every event stopped
    the engine thread for good, its own handle never done). KeyboardInterrupt
    and SystemExit too: they stopped the engine thread."""
    folder, oracle = tiny
    prompts = clean_prompts([12, 6], seed=18)
    calls = []

    def deliver(event):
        calls.append(event)
        if raises_on == "every-event" or event.finish_reason is not None:
            raise error("a bug in the caller's deliver")

    with LLM(folder) as llm:
        beside = llm.submit(prompts[0], greedy(24))
        handle = llm.submit(prompts[1], greedy(3), deliver=deliver)
        out = handle.result(timeout=30)
        assert out.finish_reason == "error" and isinstance(out.error, EngineError)
        assert f"the deliver callback raised {error.__name__}: a bug in the caller's deliver" in str(out.error)
        assert None not in calls and len(calls) == (1 if raises_on == "every-event" else 3)
        assert [r.message for r in caplog.records].count(
            f"request {handle.request_id}: its deliver callback raised; it gets no more events and the request "
            "is cancelled") == 1
        assert_greedy_equal(oracle, prompts[:1], [beside.result(timeout=30)], 24)
        assert llm.problem is None
        assert_greedy_equal(oracle, prompts, run(llm, prompts, greedy(4)), 4)
        assert_idle_and_released(llm)


def test_a_ctrl_c_while_a_deliver_runs_on_the_callers_thread_is_not_swallowed(tiny, python_sigint):
    """A refused request's end is delivered on the caller's thread, where a
    KeyboardInterrupt may be the user's Ctrl-C: it reaches the caller (review:
    catching everything there made it the request's error). The engine
    serves on."""
    folder, oracle = tiny
    prompt = clean_prompts([6], seed=20)[0]
    with LLM(folder, max_model_len=32) as llm:
        def deliver(event):
            signal.raise_signal(signal.SIGINT)

        with pytest.raises(KeyboardInterrupt):
            llm.submit(list(range(3, 40)), greedy(4), deliver=deliver)  # 37 + 4 tokens: past max_model_len
        assert llm.problem is None
        assert_greedy_equal(oracle, [prompt], run(llm, [prompt], greedy(4)), 4)
        assert_idle_and_released(llm)


def hold_after_the_first_token(llm: LLM) -> None:
    """The next request llm.submit takes samples no second token until
    cancel() is called on its handle (10 s at most): its engine thread waits
    in the deliver that sent the first."""
    real_submit, cancelled = llm.submit, threading.Event()

    def submit(prompt, params, priority, stream, deliver):
        def deliver_then_wait(event):
            deliver(event)
            if event is not None and event.token_ids:
                cancelled.wait(10)

        handle = real_submit(prompt, params, priority, stream=stream, deliver=deliver_then_wait)
        real_cancel = handle.cancel

        def cancel():
            real_cancel()
            cancelled.set()

        handle.cancel = cancel
        llm.submit = real_submit
        return handle

    llm.submit = submit


def test_async_requests_stream_and_leaving_early_cancels(tiny):
    """Leaving the `async for` cancels the request at its first token. The
    engine thread waits there for the cancel (hold_after_the_first_token):
    it used to sample on while the event loop closed the generator: up to
    105 of the 200 tokens in 20 runs beside two busy loops on 2 cores, and
    where it sampled all 200 the request ended "length", not "abort"."""
    import asyncio

    from flexinfer.async_llm import AsyncLLM

    folder, oracle = tiny
    prompts = clean_prompts([11, 6], seed=17)

    async def scenario(llm):
        engine = AsyncLLM(llm)
        full = engine.submit(prompts[0], greedy(8))
        tokens = [t async for event in full for t in event.token_ids]
        out = await full.result()
        assert tokens == out.token_ids == oracle.greedy(prompts[0], 8)
        hold_after_the_first_token(llm)
        early = engine.submit(prompts[1], greedy(200))
        async for event in early:
            if event.token_ids:
                break  # a client that went away
        await asyncio.wait_for(early.result(), 10)
        out = early.handle.result()
        assert (out.finish_reason, out.token_ids) == ("abort", oracle.greedy(prompts[1], 1))

    with LLM(folder) as llm:
        asyncio.run(scenario(llm))
        assert_idle_and_released(llm)


def test_an_async_result_then_iterating_gives_every_event(tiny):
    """As with a RequestStream, awaiting result() first leaves the events to
    `async for` (result() used to consume them and the end of the stream:
    the loop then waited forever)."""
    import asyncio

    from flexinfer.async_llm import AsyncLLM

    folder, oracle = tiny
    prompt = clean_prompts([7], seed=19)[0]

    async def scenario(llm):
        request = AsyncLLM(llm).submit(prompt, greedy(5))
        out = await asyncio.wait_for(request.result(), 30)

        async def tokens():
            return [t async for event in request for t in event.token_ids]

        assert await asyncio.wait_for(tokens(), 5) == out.token_ids == oracle.greedy(prompt, 5)

    with LLM(folder) as llm:
        asyncio.run(scenario(llm))
        assert_idle_and_released(llm)
