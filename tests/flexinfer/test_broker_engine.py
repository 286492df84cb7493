"""FlexInfer on a vtm broker (vtmd): `LLM(model, manager=vtm.connect(addr))`
gives the same greedy tokens as an in-process manager, a second engine
(another broker session) maps the prefixes the first one recorded, and an
engine answers a reclaim notice by preempting without changing its output."""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time

import grpc
import pytest

pytest.importorskip("transformers")

import vtm  # noqa: E402
from broker_testing import BrokerProcess, mapped_chunks  # noqa: E402
from flexinfer import LLM, InvalidArgument  # noqa: E402
from flexinfer.cli import main  # noqa: E402
from flexinfer.engine import Engine  # noqa: E402
from flexinfer.sequence import Sequence, Status  # noqa: E402
from vtm.broker import ctl  # noqa: E402
from test_engine import TINY_PROMPT_LENGTHS, _build_tiny, greedy, random_prompts  # noqa: E402

PAGE = 4096  # 8 tiny rows a page: prompts span pages, some rows straddle
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, smollm2_hf_tokenizer):
    folder = tmp_path_factory.mktemp("tiny-broker")
    _build_tiny(folder, "llama", smollm2_hf_tokenizer, seed=0)
    return str(folder)


@pytest.fixture
def broker(tmp_path):
    b = BrokerProcess(tmp_path, capacity_chunks=2048, chunk_bytes=PAGE)
    yield b
    b.kill()


@pytest.mark.parametrize("map_ahead_pages", [0, 1])
def test_greedy_over_a_broker_equals_in_process(tiny_folder, broker, map_ahead_pages):
    prompts = random_prompts(TINY_PROMPT_LENGTHS, seed=20)
    with LLM(tiny_folder, backend="host") as local:
        want = [o.token_ids for o in local.generate(prompts, greedy(NEW_TOKENS), use_tqdm=False)]
    first = vtm.connect(broker.address, name="engine-a", map_ahead_pages=map_ahead_pages)
    second = vtm.connect(broker.address, name="engine-b", map_ahead_pages=map_ahead_pages)
    try:
        a = LLM(tiny_folder, manager=first)
        outs = a.generate(prompts, greedy(NEW_TOKENS), use_tqdm=False)
        assert [o.token_ids for o in outs] == want
        assert [o.metrics.prefix_hit_tokens for o in outs] == [0] * len(prompts)
        first.check()
        # Another session, same model (namespace): it maps engine a's recorded
        # prompts through its own reservation and computes the same tokens.
        b = LLM(tiny_folder, manager=second)
        again = b.generate(prompts, greedy(NEW_TOKENS), use_tqdm=False)
        assert [o.token_ids for o in again] == want
        assert [o.metrics.prefix_hit_tokens for o in again] == [len(p) - 1 for p in prompts]
        stats = second.stats()
        assert stats["spaces"][b.kv_cache.space.name]["vtensors"] == 0
        second.check()
        a.close()
        b.close()
        assert second.stats()["chunks_held"] == 0
    finally:
        first.close()
        second.close()


def test_engine_preempts_to_answer_a_reclaim_notice(tiny_folder, tmp_path):
    prompts = random_prompts([40, 40, 40, 40], seed=3)
    long = 150  # tokens each: the engine runs for a while
    with LLM(tiny_folder, backend="host") as local:
        want = [o.token_ids for o in local.generate(prompts, greedy(long), use_tqdm=False)]
    # 4 x 190 rows of 512 bytes = 95 pages of 4 KiB; the pool has 110.
    b = BrokerProcess(tmp_path, capacity_chunks=110, chunk_bytes=PAGE)
    assert ctl.main(["--address", b.address, "set-quota", "urgent", "--priority", "10"]) == 0  # the operator's word
    low = vtm.connect(b.address, name="engine")
    high = vtm.connect(b.address, name="urgent")
    worker = None
    try:
        engine = LLM(tiny_folder, manager=low)
        result = {}
        worker = threading.Thread(target=lambda: result.update(
            outs=engine.generate(prompts, greedy(long), use_tqdm=False)))
        worker.start()
        deadline = time.monotonic() + 60
        while low.stats()["chunks_held"] < 60 and time.monotonic() < deadline:
            time.sleep(0.01)
        # More pages than are free, so the engine must give some back.
        ask = 110 - low.stats()["chunks_held"] + 10
        space = high.create_space(row_bytes=PAGE, max_tokens=128, max_slots=1)
        vt = space.create(ask).result()
        assert vt.mapped_bytes == ask * PAGE and low.reclaim_notices == 1
        vt.release().result()
        worker.join(120)
        outs = result["outs"]
        assert [o.token_ids for o in outs] == want
        assert sum(o.metrics.preemptions for o in outs) > 0
        engine.close()
    finally:
        if worker is not None:
            worker.join(120)  # before unmapping what its compute reads
        high.close()
        low.close()
        b.kill()


def test_an_engine_of_equal_priority_gets_its_share_of_a_pool_another_fills(tiny_folder, tmp_path):
    """Two engines of one priority on one pool. The first one's queue needs
    more than the pool and keeps it full (it admits more whenever some
    frees); the second one's request, within half the pool, gets its memory
    by a reclaim notice to the first, which preempts. It used to keep the
    pool: the second waited for its retries to catch memory between the
    first's admissions, or failed after its memory wait. Both outputs are
    the in-process ones."""
    hog_prompts = random_prompts([200] * 8, seed=5)
    prompts = random_prompts([200], seed=7)
    hog_tokens = 50
    with LLM(tiny_folder, backend="host") as local:
        hog_want = [o.token_ids for o in local.generate(hog_prompts, greedy(hog_tokens), use_tqdm=False)]
        want = [o.token_ids for o in local.generate(prompts, greedy(NEW_TOKENS), use_tqdm=False)]
    # Rows of 512 bytes, 8 a page: each first-engine request maps 25 pages
    # at once, 32 by its end; the second's needs 27 of the 60 that are half.
    b = BrokerProcess(tmp_path, capacity_chunks=120, chunk_bytes=PAGE)
    first = vtm.connect(b.address, name="first")
    second = vtm.connect(b.address, name="second")
    worker = hog = engine = None
    try:
        hog = LLM(tiny_folder, manager=first)
        engine = LLM(tiny_folder, manager=second)
        result = {}
        worker = threading.Thread(target=lambda: result.update(
            outs=hog.generate(hog_prompts, greedy(hog_tokens), use_tqdm=False)))
        worker.start()
        deadline = time.monotonic() + 60
        while mapped_chunks(first, "first", PAGE) < 100 and time.monotonic() < deadline:
            time.sleep(0.002)
        outs = engine.generate(prompts, greedy(NEW_TOKENS), use_tqdm=False)
        assert [o.error for o in outs] == [None] and [o.token_ids for o in outs] == want
        assert first.reclaim_notices >= 1
        worker.join(120)
        assert [o.token_ids for o in result["outs"]] == hog_want
        assert sum(o.metrics.preemptions for o in result["outs"]) > 0
    finally:
        if worker is not None:
            worker.join(120)  # before unmapping what its compute reads
        for llm in (engine, hog):
            if llm is not None:
                llm.close()
        second.close()
        first.close()
        b.kill()


def test_lowering_a_quota_preempts_instead_of_failing(tiny_folder, tmp_path):
    """vtmctl set-quota below what a running engine maps: the broker asks for
    the excess back (a reclaim notice) and the engine preempts and recomputes;
    every request finishes with the tokens it would have had."""
    prompts = random_prompts([40, 40, 40, 40], seed=5)
    long = 150  # 190 rows of 512 bytes: 24 pages a request, 96 for the four
    with LLM(tiny_folder, backend="host") as local:
        want = [o.token_ids for o in local.generate(prompts, greedy(long), use_tqdm=False)]
    b = BrokerProcess(tmp_path, capacity_chunks=400, chunk_bytes=PAGE)
    manager = vtm.connect(b.address, name="engine")
    worker = None
    try:
        engine = LLM(tiny_folder, manager=manager)
        result = {}
        worker = threading.Thread(target=lambda: result.update(
            outs=engine.generate(prompts, greedy(long), use_tqdm=False)))
        worker.start()

        def mapped() -> int:
            return manager.stats()["clients"][0]["mapped_bytes"]
        deadline = time.monotonic() + 60
        while mapped() < 60 * PAGE and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mapped() >= 60 * PAGE and worker.is_alive()
        assert ctl.main(["--address", b.address, "set-quota", "engine", str(50 * PAGE)]) == 0
        worker.join(120)
        outs = result["outs"]
        assert [o.error for o in outs] == [None] * len(prompts)
        assert [o.token_ids for o in outs] == want
        assert manager.reclaim_notices >= 1 and sum(o.metrics.preemptions for o in outs) > 0
        assert mapped() <= 50 * PAGE
        engine.close()
    finally:
        if worker is not None:
            worker.join(120)
        manager.close()
        b.kill()


def test_a_request_the_lowered_quota_can_never_fit_fails_at_once(tiny_folder, tmp_path):
    """vtmctl set-quota below what one request alone needs: the engine
    preempts it (the reclaim notice), and its re-admission used to wait
    memory_wait_s for memory no other client held before failing (the
    limit, not the pool, refused it). The broker now tells the client its
    new quota, and the request fails at once naming the limit; later
    requests that could never fit it are refused at submission, naming it."""
    prompt = random_prompts([40], seed=9)[0]
    b = BrokerProcess(tmp_path, capacity_chunks=400, chunk_bytes=PAGE)
    manager = vtm.connect(b.address, name="engine")
    try:
        with LLM(tiny_folder, manager=manager) as llm:
            handle = llm.submit(prompt, greedy(200))  # 239 rows of 512 bytes: 30 pages
            deadline = time.monotonic() + 60
            while manager.stats()["clients"][0]["mapped_bytes"] < 10 * PAGE and time.monotonic() < deadline:
                time.sleep(0.01)
            assert ctl.main(["--address", b.address, "set-quota", "engine", str(8 * PAGE)]) == 0
            started = time.monotonic()
            out = handle.result(timeout=60)
            assert isinstance(out.error, vtm.OutOfMemory), out.error
            assert f"this client's limit is {8 * PAGE} bytes" in str(out.error), out.error
            assert time.monotonic() - started < 10  # not memory_wait_s (30 s)
            assert manager.limit_bytes == 8 * PAGE
            refused = llm.submit(prompt, greedy(200)).result(timeout=60).error
            # It names the limit, which the operator may lift, not the pool (found by fuzzing).
            assert isinstance(refused, InvalidArgument) and (
                f"can never fit in this client's share of the KV pool (the vtm broker's limit for it, "
                f"{8 * PAGE} bytes, which its operator may change)") in str(refused), refused
            fits = llm.generate([prompt], greedy(4), use_tqdm=False)[0]
            assert fits.error is None and len(fits.token_ids) == 4
    finally:
        manager.close()
        b.kill()


def test_cli_manager_flag_reaches_the_broker(tmp_path, tiny_folder, capsys):
    dead = f"unix:{tmp_path}/nobody/sock"
    # (A prompt within the tiny vocabulary: one outside it is refused before anything connects.)
    assert main(["generate", "--model", tiny_folder, "--manager", dead, "--prompt", "a b"]) == 2
    assert "no vtm broker answers" in capsys.readouterr().err


def test_client_name_flag_picks_the_operators_quota(tiny_folder, broker, capsys):
    """Issue 17, finding 13: every CLI process connected as flexinfer-generate,
    so one quota hit all of them, and no flag named a client."""
    assert ctl.main(["--address", broker.address, "set-quota", "tenant-x", str(2 * PAGE)]) == 0
    args = ["generate", "--model", tiny_folder, "--manager", broker.address, "--prompt", "a b c d e f g h",
            "--max-tokens", "40"]
    assert main(args + ["--client-name", "tenant-x"]) == 2  # 2 pages of 8 rows: 48 tokens never fit
    assert "kv" in capsys.readouterr().err.lower()
    assert main(args) == 0  # flexinfer-generate has no limit


def test_a_broker_restart_is_a_preemption(tiny_folder, broker):
    """Issue 17, finding 8: SIGKILL the broker mid-generate and start it
    again. The running request resumes by recompute and ends with the tokens
    it would have had (a broker restart was fatal: the engine never
    reconnected); a request submitted while the broker is away waits for it."""
    prompts = random_prompts(TINY_PROMPT_LENGTHS, seed=21)
    with LLM(tiny_folder, backend="host") as local:
        want = [o.token_ids for o in local.generate(prompts[:2], greedy(60), use_tqdm=False)]
    manager = vtm.connect(broker.address, name="engine-restart", timeout=2)
    llm = LLM(tiny_folder, manager=manager)
    try:
        handle = llm.submit(prompts[0], greedy(60))
        next(iter(handle))  # decoding
        broker.kill()
        waiting = llm.submit(prompts[1], greedy(60))
        time.sleep(0.5)
        assert not manager.healthy and not handle.done and not waiting.done
        broker.start()
        first, second = handle.result(timeout=60), waiting.result(timeout=60)
        assert (first.error, second.error) == (None, None)
        assert [first.token_ids, second.token_ids] == want
        assert first.metrics.preemptions >= 1
        assert manager.healthy and manager.reconnects == 1
        again = llm.generate(prompts[:2], greedy(60), use_tqdm=False)
        assert [o.token_ids for o in again] == want
        manager.check()
    finally:
        llm.close()
        manager.close()


def test_a_mapping_that_fails_in_the_engines_process_is_a_preemption(tiny_folder, broker, monkeypatch):
    """The engine's own process fails to map a page the broker gave a
    sequence (an mmap past vm.max_map_count; a driver call on CUDA). The
    client raised a BackendError with the session up while the broker
    counted the page as mapped: the engine failed the request, and its next
    write there would have faulted. Now the session is lost and the engine
    reconnects, its requests resuming by recompute with the tokens they
    would have had."""
    monkeypatch.setattr(vtm._core, "ClientMapper", functools.partial(vtm._core.ClientMapper, faults=True))
    prompts = random_prompts(TINY_PROMPT_LENGTHS, seed=22)
    with LLM(tiny_folder, backend="host") as local:
        want = [o.token_ids for o in local.generate(prompts[:2], greedy(60), use_tqdm=False)]
    manager = vtm.connect(broker.address, name="engine-map-fails")
    llm = LLM(tiny_folder, manager=manager)
    try:
        handles = [llm.submit(p, greedy(60)) for p in prompts[:2]]
        next(iter(handles[0]))  # decoding: a new page every 8 tokens
        manager._mapper.faults.fail_nth("map", 1)
        outs = [h.result(timeout=60) for h in handles]
        assert [o.error for o in outs] == [None, None]
        assert [o.token_ids for o in outs] == want
        assert manager._mapper.faults.calls("map") > 0 and manager.reconnects == 1
        assert sum(o.metrics.preemptions for o in outs) >= 1
        manager.check()
    finally:
        llm.close()
        manager.close()


class _Proxy:
    """Forwards everything to `target`, except what a subclass defines."""

    def __init__(self, target):
        self._target = target

    def __getattr__(self, name):
        return getattr(self._target, name)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_session_lost_while_planning_computes_nothing_on_revoked_memory(tiny_folder, broker, overlap):
    """The broker dies while a step, which found the session up, checks a
    prompt's record. The failed record unmaps every chunk of the session on
    this thread (the revoke), and the scheduler swallows that error (a
    record concerns no running request); with its mapping done ahead, the
    step then ran the model on the unmapped pages: a segfault, seen in
    local runs. Now a step that finds the session lost after planning
    computes nothing; the requests resume by recompute once the broker is
    back, with their tokens unchanged. With overlap, the step in flight is
    read first."""
    prompts = random_prompts([20, 6], seed=23)
    with LLM(tiny_folder, backend="host") as local:
        want = [o.token_ids for o in local.generate(prompts, greedy(30), use_tqdm=False)]
    manager = vtm.connect(broker.address, name="engine-revoke", timeout=2)
    engine = Engine(tiny_folder, manager=manager, overlap=overlap)
    revoked, computed_after = [], []
    forward = engine.model.forward

    def counting(input_ids, *args, **kwargs):
        if revoked and manager.reconnects == 0:
            computed_after.append(input_ids.shape[0])
        return forward(input_ids, *args, **kwargs)

    class WatchedMapper(_Proxy):
        def revoke(self):
            revoked.append(True)
            return self._target.revoke()

    class LateRecord:
        """A prompt's record, sent only when the next step checks it, and
        only after the broker died: after that step found the session up."""

        def __init__(self, kv, args):
            self.kv, self.args = kv, args

        def done(self):
            return True

        def result(self, timeout=None):
            broker.kill()
            for future in self.kv.record(*self.args):
                future.result(timeout)

    class RecordsLate(_Proxy):
        armed = False

        def record(self, *args):
            if RecordsLate.armed:
                RecordsLate.armed = False
                return [LateRecord(self._target, args)]
            return self._target.record(*args)
    engine.model.forward = counting
    manager._mapper = WatchedMapper(manager._mapper)
    engine.scheduler.kv = RecordsLate(engine.scheduler.kv)
    first = Sequence(1, 0, 0, prompts[0], greedy(30), 0, ())
    second = Sequence(2, 1, 0, prompts[1], greedy(30), 0, ())
    try:
        engine.add(first)
        for _ in range(4):
            engine.step()
        assert first.status is Status.RUNNING and len(first.output_ids) >= 2
        RecordsLate.armed = True
        engine.add(second)  # its prompt's record is the late one
        for _ in range(4):
            engine.step()  # a segfault here before the fix
        assert revoked, "the session was never revoked: the test checks nothing"
        assert computed_after == [], "a step computed on a revoked session's memory"
        assert not manager.healthy and first.status is second.status is Status.WAITING
        broker.start()
        deadline = time.monotonic() + 60
        while engine.has_work() and time.monotonic() < deadline:
            engine.step()
        assert [first.output_ids, second.output_ids] == want
        assert first.metrics.preemptions >= 1
        engine.drain()
        manager.check()
    finally:
        engine.close()
        manager.close()


def test_a_broker_that_stays_away_fails_requests_and_the_engine_lives_on(tiny_folder, broker, caplog):
    """Past broker_wait_s of the broker's absence every request ends with
    vtm.Unavailable (no hang), the engine thread survives, and it serves
    again once the broker is back. The log says when the outage began and
    what it failed (an operator saw only the reconnect)."""
    caplog.set_level(logging.INFO, logger="flexinfer")
    prompts = random_prompts(TINY_PROMPT_LENGTHS, seed=21)
    manager = vtm.connect(broker.address, name="engine-orphan", timeout=2)
    llm = LLM(tiny_folder, manager=manager, broker_wait_s=1.0)
    try:
        handle = llm.submit(prompts[0], greedy(200))
        next(iter(handle))  # decoding
        broker.kill()
        started = time.monotonic()
        out = handle.result(timeout=30)
        assert out.finish_reason == "error" and isinstance(out.error, vtm.Unavailable), out.error
        # Not "still unavailable after 1 s: no vtm broker answers ... (waited 0.25 s)", a contradiction.
        assert str(out.error).startswith("the vtm broker is still unavailable after 1 s; the last try to "
                                         "reconnect: no vtm broker answers at "), out.error
        later = llm.generate(prompts[:2], greedy(4), use_tqdm=False)
        assert all(isinstance(o.error, vtm.Unavailable) for o in later), [o.error for o in later]
        assert time.monotonic() - started < 30
        assert llm._loop._thread.is_alive()
        broker.start()
        back = llm.generate(prompts[:2], greedy(4), use_tqdm=False)
        assert all(o.error is None and len(o.token_ids) == 4 for o in back), [o.error for o in back]
        said = [r.getMessage() for r in caplog.records if r.name == "flexinfer"]
        begun = [m for m in said if m.startswith("the vtm broker is unavailable: reconnecting; requests wait up to "
                                                 "1 s (broker_wait_s)")]
        assert len(begun) == 1, said
        # Each says something the others do not (one said "went away (the vtm broker is unavailable)").
        assert all(m.count("the vtm broker") == 1 for m in said), said
        assert any(m.startswith("the vtm broker is still unavailable after 1 s: failing ") for m in said), said
        assert any(m.startswith("reconnected to the vtm broker") for m in said), said
    finally:
        llm.close()
        manager.close()


def test_an_engine_built_after_a_broker_restart_reconnects(tiny_folder, broker):
    """vtmd restarted between vtm.connect and LLM(...) (while the model
    loaded): the engine's first call on the lost session raised
    vtm.Unavailable out of LLM(...). It now opens a new session first,
    waiting for the broker up to broker_wait_s as a request would, and
    raises Unavailable only once that has passed."""
    manager = vtm.connect(broker.address, name="engine-late", timeout=2)
    orphan = None
    try:
        broker.kill()
        broker.start()
        with LLM(tiny_folder, manager=manager) as llm:
            assert manager.reconnects == 1
            out = llm.generate([[1, 5, 6, 7]], greedy(4), use_tqdm=False)[0]
            assert out.error is None and len(out.token_ids) == 4
        orphan = vtm.connect(broker.address, name="engine-orphan", timeout=2)
        broker.kill()
        started = time.monotonic()
        with pytest.raises(vtm.Unavailable):
            LLM(tiny_folder, manager=orphan, broker_wait_s=1.0)
        assert 1.0 <= time.monotonic() - started < 20
    finally:
        manager.close()
        if orphan is not None:
            orphan.close()


def test_an_idle_engine_reconnects_without_traffic(tiny_folder, broker):
    """Review of finding 8: only a step reconnected, and an idle loop never
    stepped: /health stayed 503 after the broker came back, and a load
    balancer that stops sending traffic on 503 never sent any again."""
    manager = vtm.connect(broker.address, name="engine-idle", timeout=2)
    llm = LLM(tiny_folder, manager=manager)
    try:
        assert llm.problem is None
        broker.kill()
        broker.start()
        deadline = time.monotonic() + 20
        while manager.reconnects == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert manager.reconnects == 1 and manager.healthy and llm.problem is None
        out = llm.generate([[1, 5, 6, 7]], greedy(4), use_tqdm=False)[0]
        assert out.error is None and len(out.token_ids) == 4
    finally:
        llm.close()
        manager.close()


@pytest.mark.parametrize("sink", [False, True])
def test_an_engine_closed_as_the_broker_stops_answering_leaves_no_space_to_rebuild(tiny_folder, broker, sink):
    """Review: an engine closing while the broker hung stopped at the first
    call that failed (the sink's release, CUDA's: given by hand here, or
    the first space's close), so its spaces were never closed and the
    connection's next reconnect() rebuilt them, open for ever."""
    manager = vtm.connect(broker.address, name="engine-closing", timeout=1)
    engine = Engine(tiny_folder, manager=manager, layer_groups=2)
    try:
        if sink:
            engine._keeps_sink, engine._sink = True, engine.kv_cache.create(1)
        os.kill(broker.proc.pid, signal.SIGSTOP)
        try:
            engine.close()
        finally:
            os.kill(broker.proc.pid, signal.SIGCONT)
        manager.reconnect(timeout=10)
        assert manager.stats()["spaces"] == {}
        manager.check()
    finally:
        manager.close()


def test_kv_usage_is_each_clients_own(broker):
    """flexinfer_kv_cache_usage_ratio on a shared pool was the whole pool's
    (found by fuzzing: an idle server reported its neighbour's 0.72). It is
    this client's mapped bytes over its limit, or the pool's capacity
    where it has none or a larger one (review: a client whose limit is
    twice the pool's read 0.5 with the whole pool mapped)."""
    from flexinfer.server.metrics import kv_cache_usage

    assert ctl.main(["--address", broker.address, "set-quota", "capped", "--limit", str(8 * PAGE)]) == 0
    assert ctl.main(["--address", broker.address, "set-quota", "loose", "--limit",
                     str(2 * broker.capacity_bytes)]) == 0
    busy = vtm.connect(broker.address, name="busy")
    capped = vtm.connect(broker.address, name="capped")
    idle = vtm.connect(broker.address, name="idle")
    loose = vtm.connect(broker.address, name="loose")
    try:
        rows = busy.create_space(row_bytes=PAGE, max_tokens=64, max_slots=1).create(16).result()
        few = capped.create_space(row_bytes=PAGE, max_tokens=64, max_slots=1).create(2).result()
        assert kv_cache_usage(busy.stats()) == 16 * PAGE / broker.capacity_bytes
        assert kv_cache_usage(capped.stats()) == 2 / 8
        assert kv_cache_usage(idle.stats()) == 0
        rows.release().result()
        few.release().result()
        pages = broker.capacity_bytes // PAGE
        everything = loose.create_space(row_bytes=PAGE, max_tokens=pages, max_slots=1).create(pages).result()
        assert kv_cache_usage(loose.stats()) == 1.0
        everything.release().result()
    finally:
        for manager in (busy, capped, idle, loose):
            manager.close()


def test_one_broker_connection_serves_one_engine(tiny_folder, broker):
    """Review of finding 8: a lost session's mappings are revoked on the
    thread that computes on them; a second engine's thread on the same
    connection could have had its pages unmapped under its kernels."""
    manager = vtm.connect(broker.address, name="engine-shared", timeout=2)
    llm = LLM(tiny_folder, manager=manager)
    try:
        with pytest.raises(InvalidArgument, match="connect once per engine"):
            LLM(tiny_folder, manager=manager)
        assert llm.generate([[1, 5, 6, 7]], greedy(4), use_tqdm=False)[0].error is None
    finally:
        llm.close()
        manager.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_waits_for_memory_another_client_holds(tiny_folder, tmp_path, overlap):
    """Another client of the broker holds most of the pool for a while: a
    request that fits the pool waits for it (it used to fail at once with
    OutOfMemory, as if it could never fit) and gets its tokens when the
    other client lets go."""
    prompts = random_prompts([40], seed=7)
    with LLM(tiny_folder, backend="host") as local:
        want = [o.token_ids for o in local.generate(prompts, greedy(NEW_TOKENS), use_tqdm=False)]
    b = BrokerProcess(tmp_path, capacity_chunks=40, chunk_bytes=PAGE)
    hog = vtm.connect(b.address, name="hog")
    manager = vtm.connect(b.address, name="engine")
    try:
        # 36 of the 40 pages: the request (52 rows of 512 bytes, 7 pages) cannot map now.
        held = hog.create_space(row_bytes=PAGE, max_tokens=64, max_slots=1, name="held").create(36).result()
        with LLM(tiny_folder, manager=manager, overlap=overlap) as engine:
            release = threading.Timer(1.0, lambda: held.release().result())
            release.start()
            started = time.monotonic()
            outs = engine.generate(prompts, greedy(NEW_TOKENS), use_tqdm=False)
            release.join()
            assert [o.error for o in outs] == [None]
            assert [o.token_ids for o in outs] == want
            assert time.monotonic() - started >= 0.9
            assert engine.stats()["preemptions"] == 0  # it waited before it ran: nothing was preempted
    finally:
        hog.close()
        manager.close()
        b.kill()


def test_an_engine_on_a_broker_forgets_its_dead_swap_records(tiny_folder, tmp_path):
    """preemption="swap" with prefix caching off, through vtmd's host tier:
    each preemption's record is forgotten in the broker's tree once the
    sequence no longer needs it, so a finished run leaves the tree and the
    tier empty, with the output of an engine that preempts nobody."""
    prompts = random_prompts([30, 30, 30, 30, 30], seed=7)
    with LLM(tiny_folder, backend="host", enable_prefix_caching=False) as local:
        want = [o.token_ids for o in local.generate(prompts, greedy(40), use_tqdm=False)]
    # 5 x 70 rows of 512 bytes = 45 pages of 4 KiB; the pool has 24.
    b = BrokerProcess(tmp_path, capacity_chunks=24, chunk_bytes=PAGE, extra_args=["--host-tier-bytes", str(256 * PAGE)])
    try:
        with vtm.connect(b.address, name="engine") as mgr:
            with LLM(tiny_folder, manager=mgr, enable_prefix_caching=False, preemption="swap") as engine:
                outs = engine.generate(prompts, greedy(40), use_tqdm=False)
                assert [o.token_ids for o in outs] == want
                stats = engine.stats()
                assert stats["preemptions"] > 0 and stats["swap_in_tokens"] > 0, stats
                assert engine.kv_cache.space.prefix_nodes() == []
                tier = mgr.stats()
                assert (tier["tree_nodes"], tier["host_tier_used_bytes"], tier["host_tier_nodes"]) == (0, 0, 0), tier
                mgr.check()
    finally:
        b.kill()


def test_a_swap_record_waits_for_the_release_the_broker_refused(tiny_folder, tmp_path):
    """Prefix caching off, preemption="swap": a readmitted sequence's match
    locks its swap record's path, and the record is forgotten once the
    match's vTensor is released. A broker client unmapped the vTensor before
    asking vtmd to release it and called it released whatever vtmd answered;
    when vtmd refused the release (here: the process had its calls in flight
    already, --max-calls-in-flight-per-client), the forget went ahead while
    vtmd still held the vTensor and its lock on the path (so the record was
    taken back and its nodes stayed), and nobody asked vtmd again: the
    vTensor, its slot and the nodes stayed held until the session ended.
    Now the vTensor is released once vtmd released it: the scheduler asks
    again at its next step, and forgets the record after that."""
    from flexinfer import SamplingParams
    from vtm.broker import status
    from vtm.broker.server import Broker
    from vtm.proto.vtm.v1 import vtm_pb2, vtm_pb2_grpc

    broker = Broker("unix:" + str(tmp_path / "vtmd" / "sock"), backend="host", capacity_bytes=64 * PAGE,
                    chunk_bytes=PAGE, granularity=PAGE, host_tier_bytes=64 * PAGE, max_calls_in_flight_per_client=1)
    address = "unix:" + broker.path
    try:
        # fast_path off: every call over gRPC, where vtmd counts them.
        with vtm.connect(address, name="engine", fast_path=False) as mgr, vtm.connect(address, name="other") as other:
            engine = Engine(tiny_folder, manager=mgr, max_model_len=256, max_num_seqs=4, enable_prefix_caching=False,
                            preemption="swap")
            space = engine.kv_cache.space
            seq = Sequence(1, 0, 0, [1] + list(range(40, 79)),
                           SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), 0, ())
            engine.add(seq)
            while len(seq.output_ids) < 16:
                engine.step()
            engine.scheduler.reclaim(1, timeout_s=0)  # the next step preempts it: its swap record
            engine.step()
            while len(seq.output_ids) < 29:
                engine.step()
            assert engine.scheduler.num_preemptions == 1 and seq.vtensors  # readmitted: its match locks the record
            assert [n["locks"] for n in space.prefix_nodes()] == [1]
            other_space = other.create_space(row_bytes=512, max_tokens=64, max_slots=1)
            other_session = broker.service.lookup(other._lease)
            release = mgr._transport.release
            refused = []

            def refused_once(vt_id):
                """The sequence's release, sent while another session of this
                process has a call in flight (waiting for its lock): refused."""
                mgr._transport.release = release
                with grpc.insecure_channel(address) as channel:
                    with other_session.lock:
                        waiting = vtm_pb2_grpc.BrokerStub(channel).Create.future(
                            vtm_pb2.CreateRequest(space_id=other_space.id, num_tokens=8), timeout=60,
                            metadata=((status.LEASE_KEY, other._lease),))
                        deadline = time.monotonic() + 30
                        while broker.service.calls_in_flight() != {os.getpid(): 1} and time.monotonic() < deadline:
                            time.sleep(0.01)
                        with pytest.raises(vtm.OutOfMemory, match="--max-calls-in-flight-per-client") as refusal:
                            release(vt_id)
                    waiting.result()  # served once the lock is free
                refused.append(refusal.value)
                raise refusal.value

            mgr._transport.release = refused_once
            while engine.has_work():
                engine.step()
            engine.drain()  # the refused release is asked again here at the latest
            assert len(refused) == 1 and "--max-calls-in-flight-per-client" in str(refused[0])
            assert engine.scheduler.num_memory_faults == 1 and len(seq.output_ids) == 30 and seq.error is None
            stats = mgr.stats()
            assert stats["spaces"][space.name]["vtensors"] == 0, stats
            assert space.prefix_nodes() == [] and stats["tree_nodes"] == 0, stats  # the record forgotten
            mgr.check()
            engine.close()
    finally:
        broker.stop()
