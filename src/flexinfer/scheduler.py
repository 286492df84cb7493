"""The FlexInfer scheduler (Algorithm 1): continuous batching on vtm.

Each step: await the pre-extend submitted last step; plan a batch under a
token budget (running sequences first, one token each when decoding, then
prompt chunks of newly admitted ones); make sure every planned sequence's
vTensor covers the tokens it is about to write; then submit the *next*
step's extend before the model runs, so mapping overlaps compute. Only the
steps that map or unmap a page go to vtm (a page holds many tokens: most
decode steps need none); vtm's token count of a vTensor then lags, and is
raised before the vTensor is recorded (a record may cover no more).

New request: `prefix_match` (a hit maps the recorded chunks), else
`create`. Out of memory: vtm first evicts prefix-tree leaves itself; if it
still cannot, the lowest-priority, latest sequence is preempted (its
computed prefix is recorded, its vTensor released; it is readmitted later
with its output so far, mapping what the tree still holds of it, from the
device or vtm's host tier, and computing the rest, so its output is
unchanged). With prefix caching off it is recorded only under
preemption="swap", which needs a host tier, and matched back no further
than that record; nothing else matches it, so vtm forgets it
(prefix_forget) once the readmitted sequence's vTensors are released, or
when the sequence ends while swapped out: kept, it would be spilled to the
host tier and crowd out the records of sequences still swapped out. A
preempted sequence is recorded and released in one vtm operation, which
needs no free chunk (a preemption comes when none is left); a swapped-out
one whose KV the host tier keeps waits for room to copy it back rather
than compute it again. A sequence that cannot
fit even alone fails with an error while the others go on, unless the
pool is shared (memory_wait_s: a manager given to the engine, in-process
or vtm.connect): there memory others hold comes back, so a sequence alone
in this engine that finds none goes back to the queue (released, as if
preempted) and admission is tried again every MEMORY_RETRY_S (retry_at:
the engine sleeps until then, see Engine.step; a retry maps its whole prompt
before computing any of it, so a retry that cannot go on computes nothing,
except in a window model, whose groups hold less). It fails with
vtm.OutOfMemory once memory_wait_s have passed since it arrived or since
the engine last computed a token, whichever is later (a readmission that
only computes again what it had does not count), or at once when it could
never fit the KV budget the manager grants now (never_fits). Finished
sequences are recorded so the next chat turn maps them.

A memory operation that fails for another reason (a device error: a failed
map, unmap or copy; vtm leaves its state as it was) fails only what it
concerns: a failed prefix record or match costs that prefix its reuse, a
failed map the sequences whose own mapping fails again when retried alone,
a failed release is retried at the next step. Each is logged and counted.
A broker that is gone (vtm.Unavailable) takes every vTensor with it: the
running sequences go back to waiting, as if preempted (lose_memory), and
are computed again once the engine has a new session (see Engine.step).

On a vtm broker (vtm.connect), a reclaim notice for a higher-priority client
is answered the same way: the next step preempts running sequences until
about the asked bytes are unmapped, and admits nobody in that step. The
broker reserves the freed memory for the asker's retry (an admission meanwhile
waits there), so re-admitting a preempted sequence cannot take it first.

Steps in flight (the engine's overlap, see Engine.step): the engine plans
step N+1 while the device still runs step N, so a running sequence may carry
a pending token (see Sequence). Its vTensors may be released only once every
step that used them has completed: the engine numbers its steps
(`launched`) and says which have completed (`completed`). A finished or
cancelled sequence's release waits for that (its prefix is recorded at once:
vtm orders the record's copies after the kernels queued), and so do a
window's low marks (planned from the start of the step in flight); a
preemption, or an admission that finds no memory while some waits to be
released, first waits for the device (`wait_for_device`, the engine's). A
running sequence whose pending token is its last (max_tokens) is not
planned again: no token is computed to be thrown away.

A steady decode (every running sequence one token, nobody to admit) plans
the same batch step after step, and no page is mapped or unmapped until a
sequence nears one of its limits: a planned step finds out once (the
`slack`, in steps, of _Steady) and returns the same plan until then,
without a pass over the sequences.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque

import vtm
from flexinfer.kv_cache import KVCache
from flexinfer.sequence import Sequence, Status

log = logging.getLogger("flexinfer")

# On a shared pool, how often a request alone in the engine that found no
# memory tries again: a try is one allocation (a broker round trip).
MEMORY_RETRY_S = 0.05


def _weak_handler(method):
    """A reclaim handler that does not keep its scheduler (and engine) alive."""
    ref = weakref.WeakMethod(method)

    def handler(nbytes: int) -> int:
        target = ref()
        return 0 if target is None else target(nbytes)
    return handler


class Scheduler:
    def __init__(self, kv_cache: KVCache, max_num_seqs: int, max_batch_tokens: int, prefix_caching: bool,
                 swap: bool = False, memory_wait_s: float | None = None):
        self.kv = kv_cache
        self.manager = kv_cache.manager
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.prefix_caching = prefix_caching
        # Preemption by swap: a preempted sequence's KV is recorded and matched
        # again when it is readmitted, with prefix caching on or off (the tree
        # keeps it, on the device or in vtm's host tier).
        self.swap = swap
        # None: the pool is this engine's alone, and what does not fit with
        # nothing else running never will. Else how long a sequence alone
        # here waits for memory the pool's other users hold.
        self.memory_wait_s = memory_wait_s
        # Since when a sequence alone here finds no memory (None: a step
        # has computed a token since, or the queue emptied); no admission
        # is tried before retry_at. time.perf_counter(), the clock of a
        # sequence's arrival_s.
        self._starved_since: float | None = None
        self._preempted_in_wait: Sequence | None = None  # the lone sequence preempted in this wait (_ensure)
        self.retry_at = 0.0
        # The engine's: why a sequence can never fit its KV budget as the
        # manager grants it now (a broker client's limit, lowered since it
        # was admitted), or None. None: nothing to ask.
        self.never_fits = None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._pending = None  # (future, {seq: (tokens, start)}) of the pre-extend for this step
        self._background: list = []  # prefix_record futures, checked as they complete
        self._unreleased: list = []  # vTensors whose release failed, retried each step
        # Steps the engine launched (numbered from 1) and the last one known
        # complete on the device; releases waiting for a step to complete:
        # (step, vTensors).
        self._launched = 0
        self._completed = 0
        # (step, vTensors, the swap record to forget once they are released or None).
        self._retiring: list[tuple[int, list, tuple | None]] = []
        # Without prefix caching, the record each swapped-out sequence's
        # preemption made (its tokens, and the groups whose record held): no
        # other sequence matches it, so it is forgotten once dead (_forget).
        self._swap_records: dict[Sequence, tuple[list[int], list[int]]] = {}
        # Dead swap records whose path vTensors still lock (their release
        # failed and is retried): (those vTensors, the record), forgotten
        # once the retry released them all (_forget_once_released).
        self._forget_after_release: list[tuple[list, tuple[list[int], list[int]]]] = []
        # The engine's: waits until every launched step has completed (and
        # calls completed()). None: nothing is ever in flight.
        self.wait_for_device = None
        # A broker's reclaim request, [bytes, done event, bytes freed], set by
        # reclaim() on the client's notice thread, answered in schedule().
        self._reclaim_mu = threading.Lock()
        self._reclaim_request = None
        self._steady: _Steady | None = None
        # Counters for metrics (tokens, like vLLM's): prompt tokens looked up in
        # the prefix cache at admission, and those found there.
        self.num_preemptions = 0
        # Sequences that ended here (finish, abort): a step whose count did
        # not move since its launch has none of its sequences finished
        # (Engine._resolve's quiet path reads no status per sequence).
        self.num_finished = 0
        self.failed: list[Sequence] = []  # failed by schedule() (no memory), for the engine to report
        self.prefix_query_tokens = 0
        # preemption="swap": tokens whose KV preemptions recorded, and those
        # readmissions mapped back (fewer when the host tier dropped some).
        self.swap_out_tokens = 0
        self.swap_in_tokens = 0
        # Releases so far, and their count when an admission last had to be
        # undone (_unadmit): until memory comes back (a release) or nothing
        # runs, admitting again would only be undone again.
        self._releases = 0
        self._unadmitted_at = -1
        self.num_unadmitted = 0  # admissions undone (_unadmit)
        self.prefix_hit_tokens = 0
        self.prefix_hit_tokens_host = 0  # of those, tokens vtm copied back from its host tier
        # What each admission of the step being planned adds to the four
        # counts above, added once the step's plan holds (_commit_admissions):
        # an admission undone (_unadmit) adds nothing. Added at admission and
        # taken back when undone, the counts went down between a scrape and
        # the next, which Prometheus reads as a counter reset.
        self._admission_counts: dict[Sequence, tuple[int, int, int, int]] = {}
        self.num_prefix_failures = 0  # prefix records and matches that failed (the prefix is not reused)
        self.num_memory_faults = 0  # maps and releases that failed and were contained
        add_handler = getattr(self.manager, "add_reclaim_handler", None)
        if add_handler is not None:
            add_handler(_weak_handler(self.reclaim))

    # -- queues ---------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- steps in flight ------------------------------------------------

    def launched(self, seqs) -> int:
        """A step over `seqs` (before their num_cached advances) is queued
        on the device; returns its number."""
        self._launched += 1
        for seq in seqs:
            seq.last_step = self._launched
            seq.last_start = seq.num_cached
        return self._launched

    def launched_decode(self, seqs) -> tuple[int, list[int]]:
        """launched(seqs) for a decode step that continues the one before
        (Engine._launch): each sequence's last token (pending, with
        overlap) is computed by this step and its next one sampled, so
        num_cached, pending and num_tokens advance by one
        (Sequence.add_pending, feed_row unchanged). Returns the step's
        number and the sequences' starts. One pass over them, where the
        engine made three (the starts, launched(), the advance)."""
        self._launched += 1
        number = self._launched
        starts = []
        for seq in seqs:
            start = seq.num_cached
            starts.append(start)
            seq.last_step = number
            seq.last_start = start
            seq.num_cached = start + 1
            seq.pending += 1
            seq.num_tokens += 1
        return number, starts

    def completed(self, step: int) -> None:
        """Step `step` (and every one before it) has completed on the device:
        the releases that waited for it happen now."""
        self._completed = max(self._completed, step)
        if not self._retiring:
            return
        ready = [r for r in self._retiring if r[0] <= self._completed]
        self._retiring = [r for r in self._retiring if r[0] > self._completed]
        if ready:
            self._await_pending()  # the pre-extend submitted last may still target them
        for _, vtensors, dead in ready:
            self.release(vtensors)
            self._forget_once_released(vtensors, dead)

    def _in_use(self, seq: Sequence) -> bool:
        return seq.last_step > self._completed

    def settle_steps(self) -> None:
        """Wait until every launched step has completed, and release what waited for them."""
        if self._launched > self._completed:
            if self.wait_for_device is not None:
                self.wait_for_device()
            self.completed(self._launched)

    # -- memory ---------------------------------------------------------

    def _await_pending(self) -> None:
        if self._pending is None:
            return
        future, targets = self._pending
        self._pending = None
        try:
            future.result()
        except vtm.Error:
            return  # the synchronous path retries: it preempts, or fails only what fails again
        for seq, (tokens, start) in targets.items():
            if seq.vtensors:
                self._stepped(seq, tokens, start)

    def _ensure(self, plan: list[tuple[Sequence, int]], late: list[tuple[Sequence, int]],
                admitted: set[Sequence]) -> list[tuple[Sequence, int]]:
        """Map what `plan` writes, preempting until it fits; returns the
        surviving plan. `late`: the entries of `plan` that may need a page;
        `admitted`: those admitted by this step, which go back to waiting
        uncounted when they must give way (they computed nothing yet)."""
        while True:
            need = self._with_starts({s: t for s, n in late
                                      if s.map_limit < (t := self._writes_to(s, n)) and s.status is Status.RUNNING})
            if not need:
                return plan
            # Low marks due go with it: the pages they unmap are the first
            # this step's mapping takes (the pre-extend that carried them may
            # have run out of memory), before anything is evicted.
            self._add_due_low_marks(need, plan, ahead=0)
            try:
                self.manager.step(self._targets(need)).result()
            except vtm.OutOfMemory as exc:
                if self._launched > self._completed:
                    # Memory held only until the steps in flight complete:
                    # finished sequences' (retiring), and the rows below a
                    # window's low mark that a step in flight still reads
                    # (_low_start), which KVBudget does not count. Take it
                    # before preempting anyone, or failing a lone sequence
                    # that fits once they have completed.
                    self.settle_steps()
                    continue
                victim = self._victim()
                # Alone and still too big: this request can never fit (it
                # fails), unless others hold the memory (a shared pool):
                # then it gives way as a victim does, to be tried again.
                alone = victim is None or (victim in need and len(self.running) == 1)
                victim = victim or next(iter(need))
                # A lone sequence preempted again in the same wait (it
                # computed what fitted, and no more fits) counts once: else
                # the count would rise at every retry.
                again = alone and self._starved_since is not None and victim is self._preempted_in_wait
                gives_way = not alone or self._fail_unless_waiting(victim, exc)
                if gives_way and alone:
                    # Its retries map its whole prompt first (a window's
                    # group holds less than the prompt: not there).
                    victim.map_prompt_first = not self.kv.has_window
                if gives_way and victim in admitted:
                    self._unadmit(victim)
                elif gives_way:
                    self._preempt(victim, counted=not again)
                    if alone:
                        self._preempted_in_wait = victim
                plan = [(s, n) for s, n in plan if s.status is Status.RUNNING]
                continue
            except vtm.Unavailable:
                raise
            except vtm.Error as exc:
                log.warning("mapping the KV of %d sequences failed (%s); retrying each alone", len(need), exc)
                self.num_memory_faults += 1
                self._ensure_each(need)
                plan = [(s, n) for s, n in plan if s.status is Status.RUNNING]
                continue
            for seq, (tokens, start) in need.items():
                seq.map_prompt_first = False
                self._stepped(seq, tokens, start)

    def _writes_to(self, seq: Sequence, n: int) -> int:
        """The rows `seq` must have mapped to compute its next `n` tokens:
        all of them once it gave way in a wait (map_prompt_first)."""
        return max(seq.num_cached + n, seq.num_tokens) if seq.map_prompt_first else seq.num_cached + n

    def _ensure_each(self, need: dict[Sequence, tuple[int, int]]) -> None:
        """After a batched map failed: map each sequence alone and fail those
        whose own map fails again (out of memory is left to _ensure's loop)."""
        for seq, (tokens, start) in need.items():
            try:
                self.manager.step(self._targets({seq: (tokens, start)})).result()
            except vtm.OutOfMemory:
                continue  # _ensure's loop preempts for it
            except vtm.Unavailable:
                raise
            except vtm.Error as exc:
                self._fail(seq, exc)
                continue
            seq.map_prompt_first = False
            self._stepped(seq, tokens, start)

    def _with_starts(self, wanted: dict[Sequence, int]) -> dict[Sequence, tuple[int, int]]:
        """(tokens, start) per sequence: the first query row a window's low
        mark may rise to. It stays below what a step in flight still reads."""
        return {seq: (tokens, self._low_start(seq)) for seq, tokens in wanted.items()}

    def _low_start(self, seq: Sequence) -> int:
        return seq.last_start if self._in_use(seq) else seq.num_cached

    def _add_due_low_marks(self, targets: dict[Sequence, tuple[int, int]], plan: list[tuple[Sequence, int]],
                           ahead: int) -> None:
        """Adds to `targets` each running sequence of `plan` whose window has
        slid past a page (its low mark is due), covering the rows it writes
        and `ahead` more. Nothing without a window group."""
        if not self.kv.has_window:
            return
        most = self.kv.max_tokens
        for seq, n in plan:
            if seq not in targets and seq.status is Status.RUNNING and (
                    start := self._low_start(seq)) >= seq.unmap_at:
                targets[seq] = (min(seq.num_cached + n + ahead, most), start)

    def _targets(self, need: dict[Sequence, tuple[int, int]]) -> dict:
        """One step target per vTensor (one per layer group) of each
        sequence, for the step about to run (see KVCache.targets)."""
        return self.kv.targets((seq.vtensors, tokens, start) for seq, (tokens, start) in need.items())

    def _stepped(self, seq: Sequence, tokens: int, start: int) -> None:
        """vtm completed a step of `seq` to `tokens`, low marks from `start`."""
        self._steady = None  # its slack was counted from the limits before
        seq.extended = max(seq.extended, tokens)
        seq.map_limit, seq.unmap_at = self.kv.limits(seq.extended, start)

    def _count_to(self, seq: Sequence, tokens: int) -> None:
        """Raise vtm's token count of `seq`'s vTensors to `tokens` (their
        pages hold them): the steps that mapped nothing were not sent. Not
        waited for: vtm runs a vTensor's operations in submission order (a
        broker client too), so the record submitted next finds the count
        raised; should this step fail, that record fails and is counted."""
        if seq.extended < tokens:
            self.manager.step({vt: tokens for vt in seq.vtensors})
            seq.extended = tokens

    def _victim(self) -> Sequence | None:
        """The lowest-priority (largest value), latest-arrived running sequence."""
        if not self.running:
            return None
        return max(self.running, key=lambda s: (s.priority, s.metrics.arrival_s, s.id))

    def _unadmit(self, seq: Sequence) -> None:
        """Undoes this step's admission of `seq`, which did not fit beside
        the running sequences: it goes back to the front of the queue, as
        it was (what its admission matched stays in the tree, and a
        swapped-out sequence's record with it). Not a preemption: it had not
        run, and counting it would count one per step while memory is short."""
        self._admission_counts.pop(seq, None)
        swapped = seq.swapped
        self._drop_vtensors(seq, record=False, forget=False)
        seq.swapped = swapped
        self.running.remove(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self._unadmitted_at = self._releases
        self.num_unadmitted += 1

    def _preempt(self, seq: Sequence, counted: bool = True) -> None:
        # The memory is needed now: wait for the steps still using it.
        if self._in_use(seq):
            self.settle_steps()
        self._drop_vtensors(seq, record=self.prefix_caching or self.swap, swap=self.swap)
        self.running.remove(seq)
        seq.status = Status.WAITING
        if counted:
            seq.metrics.preemptions += 1
            self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def reclaim(self, nbytes: int, timeout_s: float = 1.5) -> int:
        """Give back about `nbytes` (a broker's reclaim notice; another
        thread). Returns the bytes unmapped, 0 when idle or not answered in
        time (the engine loop does the preempting, at its next step)."""
        with self._reclaim_mu:
            if not self.running:
                return 0
            request = self._reclaim_request
            if request is None:
                request = self._reclaim_request = [nbytes, threading.Event(), 0]
            else:
                # A notice the step has not answered yet: the broker's
                # notices add up (each asks for what it adds), so one answer
                # gives back both (replacing it lost the first's bytes).
                request[0] += nbytes
        request[1].wait(timeout_s)
        return request[2]

    def _answer_reclaim(self) -> bool:
        with self._reclaim_mu:
            request, self._reclaim_request = self._reclaim_request, None
        if request is None:
            return False
        while request[2] < request[0] and (victim := self._victim()) is not None:
            request[2] += sum(vt.mapped_bytes for vt in victim.vtensors)
            self._preempt(victim)
        request[1].set()
        return True

    def lose_memory(self) -> int:
        """The broker session is gone, and every vTensor with it (a broker
        restart): the running sequences go back to the front of the queue,
        keeping their outputs, to be computed again once memory is back, as
        after a preemption; nothing queued for the old session is awaited.
        Returns how many were running (the engine says so, with why)."""
        resumed = len(self.running)
        for seq in reversed(self.running):
            seq.reset_cache_state()
            seq.prompt_recorded = False  # the new session's tree has none of it
            seq.status = Status.WAITING
            seq.metrics.preemptions += 1
            self.waiting.appendleft(seq)
        for seq in self.waiting:
            seq.swapped = 0  # nor of what swapped-out ones kept
        self.num_preemptions += len(self.running)
        self.running.clear()
        self._end_wait()  # a wait for others' memory starts again in the new session
        self._steady = None
        self._pending = None
        self._background.clear()
        self._unreleased.clear()
        self._retiring.clear()
        self._swap_records.clear()  # the old session's trees are gone
        self._forget_after_release.clear()
        return resumed

    def fail_waiting(self, exc: Exception) -> None:
        """Fails every queued sequence with `exc` (no memory will come back in time)."""
        for seq in list(self.waiting):
            self._fail(seq, exc)

    def wait_for_memory(self, exc: vtm.OutOfMemory) -> None:
        """Nothing can run until the pool's other users free memory (`exc`:
        the engine's own fixed memory did not fit, after a reconnect): each
        queued sequence waits as one that found no memory does, up to
        memory_wait_s, and is tried again at retry_at."""
        for seq in list(self.waiting):
            self._fail_unless_waiting(seq, exc)

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        self.abort(seq, "error", exc)
        self.failed.append(seq)

    def abort(self, seq: Sequence, reason: str = "abort", error: Exception | None = None) -> None:
        """Remove `seq` wherever it is (cancelled, or failed with `error`) and
        release its vTensors. What it computed is not recorded: a prompt's
        prefix was recorded when its prefill ended."""
        if seq.status is Status.FINISHED:
            return
        self._unqueue(seq)
        seq.status = Status.FINISHED
        self.num_finished += 1
        seq.finish_reason = reason
        seq.error = error
        if seq.vtensors:
            try:
                # The pre-extend submitted last step may still target its vTensors.
                self._await_pending()
                self._drop_vtensors(seq, record=False)
            except Exception:  # vtm failing (a dead broker): the sequence is gone all the same
                log.exception("releasing the KV of a %s sequence failed",
                              "failed" if reason == "error" else "cancelled")
                seq.reset_cache_state()
        else:
            self._forget(self._swap_records.pop(seq, None))  # swapped out: nothing locks its record

    def _unqueue(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if not self.waiting:
            self._end_wait()  # nobody waits for memory

    def _drop_vtensors(self, seq: Sequence, record: bool, swap: bool = False, forget: bool = True) -> None:
        # Recording first keeps the computed prefix matchable (the tree holds
        # the chunks, evictable LRU when memory runs out): a preempted or
        # finished conversation is resumed by mapping instead of recomputing.
        # Every token below num_cached is resolved (pending ones are at or
        # above it), and its KV is written by steps launched already.
        # Recorded now, whatever is in flight: the record orders its copies
        # after the kernels queued so far (vtm's fence), and a caller told
        # its request is done may ask for the next turn at once.
        # A readmitted sequence's swap record is dead once its vTensors are
        # released (`forget`: unless its admission is only undone, _unadmit):
        # forgotten then, not at readmission, since the match's vTensor locks
        # the matched path until its release, and a forget before that would
        # leave the nodes to eviction, which spills them to the host tier.
        dead = self._swap_records.pop(seq, None) if forget else None
        record = record and seq.num_cached > 0
        seq.swapped = 0
        if self._in_use(seq):
            # A step in flight still reads or writes these pages: the record
            # copies the page it writes next, and the release waits for it.
            if record:
                self._record(seq, seq.token_ids[: seq.num_cached])
            self._retiring.append((seq.last_step, seq.vtensors, dead))
        elif record:
            # Nothing writes them again: recorded and released in one
            # operation, which copies no page. So a preemption, which comes
            # when no chunk is free, still keeps the KV it swaps out.
            token_ids = seq.token_ids[: seq.num_cached]
            groups = self._record_and_release(seq, token_ids)
            seq.swapped = seq.num_cached if swap and len(groups) == len(self.kv.spaces) else 0
            self.swap_out_tokens += seq.swapped
            if not self.prefix_caching:  # a swap record: matched by this sequence's readmission only
                if seq.swapped:
                    self._swap_records[seq] = (token_ids, groups)
                else:
                    self._forget((token_ids, groups))  # some group failed: nobody matches the others'
            # After the new record, which goes on along the old one's path (its nodes stay).
            self._forget_once_released(seq.vtensors, dead)
        else:
            self.release(seq.vtensors)
            self._forget_once_released(seq.vtensors, dead)
        seq.reset_cache_state()

    def _forget(self, record: tuple[list[int], list[int]] | None) -> None:
        """Forgets a dead swap record (tokens, groups), so that vtm neither
        spills its nodes to the host tier nor keeps its blocks there, where
        they would push out the records of sequences still swapped out. A
        failure only leaves the nodes to eviction (logged)."""
        if record is None or not record[1]:
            return
        try:
            self.kv.forget(*record)
        except vtm.Error as exc:
            log.warning("forgetting a swapped-out sequence's record failed (%s)", exc)

    def _forget_once_released(self, vtensors: list, record: tuple[list[int], list[int]] | None) -> None:
        """Forgets a dead swap record once `vtensors` (a readmission's, whose
        match locks the record's path) are all released: now, or when the
        retry of a release that failed succeeds (_retry_releases). A forget
        while they lock the path takes the record back but leaves its nodes,
        which the retried release then unlocks as ordinary cache that no
        forget would ever take."""
        if record is None:
            return
        live = [vt for vt in vtensors if vt is not None and not vt.released]
        if live:
            self._forget_after_release.append((live, record))
        else:
            self._forget(record)

    def _record(self, seq: Sequence, token_ids: list[int]) -> None:
        try:
            self._count_to(seq, len(token_ids))
            self._background += self.kv.record(seq.vtensors, token_ids)
        except vtm.Error as exc:  # refused at submission: a fence the device would not record, a lost broker
            self._record_failed(exc)

    def _record_and_release(self, seq: Sequence, token_ids: list[int]) -> list[int]:
        """The groups that recorded `token_ids`; seq's vTensors are
        released either way (those a failure left live, as release does)."""
        try:
            self._count_to(seq, len(token_ids))
            outcomes = self.kv.record_and_release(seq.vtensors, token_ids)
        except vtm.Error as exc:  # the count's step refused at submission: a lost broker
            outcomes = [exc]  # no group recorded
        for exc in outcomes:
            if exc is not None and not isinstance(exc, (vtm.OutOfMemory, vtm.Unavailable)):
                self._record_failed(exc)
        self._releases += 1  # vtm released them (or release below does)
        self.release([vt for vt in seq.vtensors if vt is not None and not vt.released])
        return [g for g, exc in enumerate(outcomes) if exc is None]

    def _tier_keeps(self, token_ids: list[int], vtensors: list | None) -> bool:
        """Whether vtm's host tier keeps KV of token_ids that a match could
        copy back. Asked between a match and the sequence taking its
        vTensors: where the question fails (a broker's call), the match's
        vTensors are released before the error goes on, as nobody else
        holds them (their slots and the locks on the path were lost)."""
        try:
            return self.kv.restore_bytes(token_ids) > 0
        except BaseException:
            if vtensors is not None:
                self.release(vtensors)
            raise

    def release(self, vtensors: list) -> None:
        """Releases vTensors; one the device refuses to unmap (vtm leaves it
        as it was) is retried at the next step instead of failing anyone.
        One of a lost broker session is gone already."""
        if vtensors:
            self._releases += 1
        for vt, future in [(vt, vt.release()) for vt in vtensors if vt is not None]:
            try:
                future.result()
            except vtm.Unavailable:
                continue
            except vtm.Error as exc:
                log.warning("releasing a vTensor failed (%s); retrying at the next step", exc)
                self.num_memory_faults += 1
                self._unreleased.append(vt)

    def _retry_releases(self) -> None:
        # A broker client's vTensor whose release the broker refused, or
        # whose unmap failed here, is unusable but not released
        # (vt.released) until a retry the broker answers; one released
        # meanwhile (a reconnect, a closed space) needs none.
        retry, self._unreleased = [vt for vt in self._unreleased if not vt.released], []
        self.release(retry)
        waiting, self._forget_after_release = self._forget_after_release, []
        for vtensors, record in waiting:
            self._forget_once_released(vtensors, record)

    # -- admission ------------------------------------------------------

    def _admissible(self, seq: Sequence) -> bool:
        # Parallel samples (n > 1) wait for their first sibling's prompt to be
        # recorded, then fork from it by prefix match.
        # A sequence preempted while a step computed its next token waits for it.
        if seq.pending:
            return False
        leader = seq.leader
        return leader is None or leader.prompt_recorded or leader.status is Status.FINISHED

    def _admit(self, seq: Sequence) -> bool:
        """Gives `seq` its vTensors and makes it running. False when it must
        wait (out of memory), or when it failed alone (a device error: then
        it is finished)."""
        counts = (0, 0, 0, 0)  # counted once its admission holds (vTensors and all)
        try:
            if (self.prefix_caching or seq.swapped) and seq.num_tokens > 1:
                # Without prefix caching, a swapped-out sequence maps back
                # what its own preemption recorded, never more (the match
                # stops before the last token it is given).
                swapped_ids = seq.token_ids[: seq.swapped + 1]
                try:
                    vtensors, matched, restored = self._match(seq.token_ids if self.prefix_caching else swapped_ids)
                except vtm.OutOfMemory:
                    if self.running or self._retiring:
                        raise  # memory others hold comes back: wait for it (below)
                    # Alone, and still out of memory: the match locks the
                    # node it ends in, whose chunks may be all the pool has
                    # (a prefix cache that fills it), and its copy of its
                    # partial last page needs one more. Computing the prompt
                    # instead lets the create evict that node.
                    vtensors, matched, restored = None, 0, 0
                if matched < seq.swapped and self.running and self._tier_keeps(swapped_ids, vtensors):
                    # The host tier keeps the rest of its KV, but the pool
                    # has no room to copy it back yet (the match fell back to
                    # what the device holds): wait for room, as a swap-in
                    # does, rather than compute again what is kept. Running
                    # sequences end or are preempted, so room comes.
                    if vtensors is not None:
                        self.release(vtensors)
                    return False
                hit = hit_host = 0
                if vtensors is not None:
                    # vtm spills the tree from its leaves up: what it copied
                    # back is the match's last `restored` tokens, which may
                    # be a readmission's output rather than its prompt.
                    hit = min(matched, len(seq.prompt_ids))
                    hit_host = max(0, hit - (matched - restored))
                    seq.vtensors = vtensors
                    seq.num_cached = matched
                    seq.extended = matched
                    # A window group's low mark after a match is vtm's: the next step sets it.
                    seq.map_limit, seq.unmap_at = self.kv.limits(matched, matched)[0], 0
                    seq.metrics.prefix_hit_tokens = max(seq.metrics.prefix_hit_tokens, hit)
                counts = (len(seq.prompt_ids), min(matched, seq.swapped), hit, hit_host)
            if not seq.vtensors:
                seq.vtensors = self.kv.create(release=self.release)
            self._count_admission(seq, counts)
        except vtm.OutOfMemory as exc:
            if self._retiring:
                # Finished sequences' memory, held only until the step in
                # flight completes: wait for it rather than fail or wait.
                self.settle_steps()
                return self._admit(seq)
            if not self.running:
                self._fail_unless_waiting(seq, exc)
            return False
        except vtm.Unavailable:
            raise
        except vtm.Error as exc:
            log.warning("mapping a new request's KV failed: %s", exc)
            self.num_memory_faults += 1
            self._fail(seq, exc)
            return False
        seq.slots = tuple(vt.slot for vt in seq.vtensors)
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.status = Status.RUNNING
        return True

    def _fail_unless_waiting(self, seq: Sequence, exc: vtm.OutOfMemory) -> bool:
        """`seq`, alone in this engine, found no memory (`exc`): whether it
        waits, because the pool is shared and it has not waited
        memory_wait_s yet; else it fails. It has waited since the engine
        last computed a token, or since it arrived if later: requests
        queued behind it waited as long. One that could never fit the pool
        was refused at submission (KVBudget), and one that no longer fits
        the limit granted now (never_fits) fails at once: what it waits for
        is memory others hold."""
        if self.memory_wait_s is None:
            self._fail(seq, exc)
            return False
        problem = self.never_fits(seq) if self.never_fits is not None else None
        if problem is not None:  # no other user's memory will make it fit: fail now, not at memory_wait_s
            self._fail(seq, vtm.OutOfMemory(f"{exc}; {problem}"))
            return False
        now = time.perf_counter()
        if self._starved_since is None:
            self._starved_since = now
            if self.memory_wait_s > 0:
                log.info("no KV memory free in the shared pool: requests wait up to %g s for its other users",
                         self.memory_wait_s)
        waited = now - max(self._starved_since, seq.metrics.arrival_s)
        if waited >= self.memory_wait_s:
            self._fail(seq, vtm.OutOfMemory(f"{exc}; waited {waited:.1f} s (memory_wait_s) for the pool's other "
                                            f"users to free memory"))
            return False
        self.retry_at = now + MEMORY_RETRY_S
        return True

    def _end_wait(self) -> None:
        self._starved_since = None
        self._preempted_in_wait = None

    def _count_admission(self, seq: Sequence, counts: tuple[int, int, int, int]) -> None:
        """An admission's (prompt tokens queried, swapped-in tokens, prefix
        hit tokens, of those from the host tier), counted if it holds."""
        self._admission_counts[seq] = counts

    def _commit_admissions(self) -> None:
        """The step's plan holds: its admissions count."""
        for query, swap_in, hit, hit_host in self._admission_counts.values():
            self.prefix_query_tokens += query
            self.swap_in_tokens += swap_in
            self.prefix_hit_tokens += hit
            self.prefix_hit_tokens_host += hit_host
        self._admission_counts.clear()

    def _match(self, token_ids: list[int]):
        """kv.match, where a failure other than out of memory (a failed copy)
        only costs the prefix its reuse: the prompt is computed instead. A
        vTensor the match gives back and fails to unmap is retried as any
        failed release (release), not lost."""
        try:
            return self.kv.match(token_ids, release=self.release)
        except (vtm.OutOfMemory, vtm.Unavailable):
            raise
        except vtm.Error as exc:
            log.warning("prefix match failed (%s); computing the prompt instead", exc)
            self.num_prefix_failures += 1
            return None, 0, 0

    # -- the step -------------------------------------------------------

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The batch of this step: (sequence, tokens to compute), memory mapped."""
        self._await_pending()
        self._reap_background()
        self._retry_releases()
        reclaimed = self._answer_reclaim()
        steady, self._steady = self._steady, None
        # Nobody waiting, or nobody can be admitted (a full batch, with a
        # queue behind it: the usual state of a busy server).
        if (steady is not None and steady.slack > 0 and not reclaimed
                and (not self.waiting or len(self.running) >= self.max_num_seqs) and self.running == steady.seqs):
            steady.slack -= 1
            self._steady = steady
            return steady.plan
        self._admission_counts.clear()  # those of a plan that failed (a broker lost) never held
        budget = self.max_batch_tokens
        plan: list[tuple[Sequence, int]] = []
        # Of the plan, those whose next step or the one after needs a page
        # mapped: the only ones the mapping below looks at. Per sequence per
        # step, this loop is the scheduler's whole cost of a decode step.
        late: list[tuple[Sequence, int]] = []
        for seq in self.running:
            if budget == 0:
                break
            if seq.pending and seq.pending_is_last:
                continue  # it ends when its pending token is read: nothing left to compute
            n = seq.num_tokens - seq.num_cached
            if n > budget:
                n = budget
            plan.append((seq, n))
            budget -= n
            if seq.num_cached + n >= seq.map_limit:
                late.append((seq, n))
        admitted: set[Sequence] = set()
        room = (self._unadmitted_at != self._releases or not self.running) and (
            self.running or self._starved_since is None or time.perf_counter() >= self.retry_at)
        while room and budget > 0 and len(self.running) < self.max_num_seqs and not reclaimed:
            seq = next((s for s in self.waiting if self._admissible(s)), None)
            if seq is None:
                break
            if not self._admit(seq):
                if seq.status is Status.FINISHED:
                    continue  # failed alone: the next one may fit
                break
            admitted.add(seq)
            n = min(seq.num_tokens - seq.num_cached, budget)
            plan.append((seq, n))
            late.append((seq, n))
            budget -= n
        plan = self._ensure(plan, late, admitted)
        self._commit_admissions()
        if self._starved_since is not None and any(s.num_cached + n >= s.num_tokens for s, n in plan):
            # This step computes a token: the engine gets further, and a
            # later wait starts anew. Computing again what a preemption
            # dropped (a prompt's chunks) is not getting further.
            self._end_wait()
        # Pre-extend: map what the next step will write while this one
        # computes. Only where it maps or unmaps a page: a step within both
        # limits would only advance vtm's token count, which a record raises
        # first instead (_count_to).
        most = self.kv.max_tokens
        ahead = self._with_starts({s: t for s, n in late if s.status is Status.RUNNING
                                   and (t := min(s.num_cached + n + 1, most)) > s.map_limit})
        self._add_due_low_marks(ahead, plan, ahead=1)
        if ahead:
            self._pending = (self.manager.step(self._targets(ahead)), ahead)
        elif not admitted and len(plan) == len(self.running) and len(late) == 0:
            self._steady = _Steady.of(plan, self.running, self.kv.has_window)
        return plan

    def after_prefill(self, seq: Sequence) -> None:
        """The prompt's KV is complete: make it matchable (n > 1 siblings, shared prompts)."""
        if self.prefix_caching and not seq.prompt_recorded:
            self._record(seq, seq.prompt_ids)
        seq.prompt_recorded = True

    def finish(self, seq: Sequence, reason: str) -> None:
        """`seq` ended (a stop, or its length). It may be waiting: preempted
        while a step computed the token that ended it."""
        seq.finish_reason = reason
        seq.status = Status.FINISHED
        self.num_finished += 1
        self._unqueue(seq)
        if seq.vtensors:
            self._drop_vtensors(seq, record=self.prefix_caching)
        else:
            self._forget(self._swap_records.pop(seq, None))  # swapped out: nothing locks its record

    def drain(self) -> None:
        """Wait for every queued memory operation (end of generate)."""
        self._steady = None  # idle: hold no finished sequence
        self.settle_steps()
        self._await_pending()
        background, self._background = self._background, []
        for fut in background:
            self._check_record(fut)
        self._retry_releases()

    def _reap_background(self) -> None:
        still = []
        for fut in self._background:
            if fut.done():
                self._check_record(fut)
            else:
                still.append(fut)
        self._background = still

    def _check_record(self, fut) -> None:
        # A record that finds no memory for its copy just leaves that prefix
        # uncached; one that fails otherwise (a failed copy) costs the same,
        # and is logged and counted: it concerned no running request.
        try:
            fut.result()
        except vtm.OutOfMemory:
            pass
        except vtm.Error as exc:
            self._record_failed(exc)

    def _record_failed(self, exc: Exception) -> None:
        log.warning("recording a prefix failed (%s); it will be computed again when asked for", exc)
        self.num_prefix_failures += 1


class _Steady:
    """A plan that later steps may return as it is: every running sequence,
    in order, decoding (one token to compute), and `slack` more steps before
    one of them could need a page mapped or unmapped, or stop being planned.

    Each step of a steady decode advances every sequence by one token, in
    num_cached and num_tokens alike (a step that raises advances none: it
    fails its sequences, or an interrupted one is rolled back). So what the
    plan loop and the mapping check would find k steps on follows from what
    they found at step 0, k steps before, erring only towards a late one: a
    sequence is late (a page to map now, or the pre-extend's next) once
    map_limit - num_cached < 2, a window's low mark is due once num_cached
    reaches unmap_at, and a pending token is its last once its output and
    pending tokens reach max_tokens. Anything else that changes the batch
    changes `running` (an admission, a preemption, a finish), brings a
    sequence to admit or a reclaim (checked each step), or completes a vtm
    step (_stepped forgets the plan)."""

    __slots__ = ("plan", "seqs", "slack")

    def __init__(self, plan: list[tuple[Sequence, int]], seqs: list[Sequence], slack: int):
        self.plan = plan
        self.seqs = seqs
        self.slack = slack

    @staticmethod
    def of(plan: list[tuple[Sequence, int]], running: list[Sequence], has_window: bool) -> "_Steady | None":
        """The steady plan `plan` starts, if it is one (None otherwise)."""
        # n is 1 for a prompt the budget clipped to one token too: not a decode.
        if not plan or any(s.num_tokens - s.num_cached != 1 for s, _ in plan):
            return None
        slack = min(min(s.map_limit - s.num_cached - 2,
                        s.params.max_tokens - (s.num_tokens - len(s.prompt_ids)) - 1) for s, _ in plan)
        if has_window:
            slack = min(slack, min(s.unmap_at - s.num_cached - 1 for s, _ in plan))
        return _Steady(plan, list(running), slack) if slack > 0 else None
