"""EngineLoop: the one thread that drives an Engine, and RequestStream, the
handle a caller gets for each request it submits.

Why a thread: a server takes requests from many threads (or an event loop)
while steps run back to back; `LLM.generate` from two threads must not
interleave two callers' steps; a caller interrupted by Ctrl-C must be able to
take its request back. So one thread owns the engine and everything else
talks to it through this file's thread-safe API: `submit`, `cancel`,
`close`. Requests are added and cancelled between steps, never during one.

Invariants: only the loop thread touches the Engine (and its Sequences until
they finish); a RequestStream's sequences are read by other threads only
after it is done (its `_done` event orders the two). Every stream ends: it
finishes, fails, or is cancelled (also when the loop closes), and its
sequences' KV is released before it is reported done.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import deque
from typing import Callable, Iterator

import torch

from flexinfer.detokenizer import final_text
from flexinfer.engine import Engine
from flexinfer.errors import EngineClosed, EngineError, InvalidArgument
from flexinfer.host_memory import keep_freed_memory
from flexinfer.inputs import request_problem
from flexinfer.outputs import CompletionOutput, RequestOutput, StreamEvent
from flexinfer.sampling import SamplingParams
from flexinfer.sequence import Sequence, Status
from flexinfer.threads import release_openmp_pool

log = logging.getLogger("flexinfer")

# The end of a stream, after its last StreamEvent.
_END = None
# An idle loop looks at its manager's health this often (a broker may go away while nothing runs).
_IDLE_CHECK_S = 1.0


class RequestStream:
    """One submitted request (all `params.n` samples of one prompt).

    Iterate it for StreamEvents as tokens are sampled (when submitted with
    stream=True), call `result()` for the RequestOutput, `cancel()` to take it
    back (its KV is released; unfinished samples end with "abort")."""

    def __init__(self, loop: EngineLoop, request_id: int, prompt: str | None, prompt_ids: list[int],
                 seqs: list[Sequence], stream: bool, deliver: Callable[[StreamEvent | None], None] | None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_ids
        self.params = seqs[0].params
        self._loop = loop
        self._seqs = seqs
        self._stream = stream
        self._events: queue.SimpleQueue | None = None
        if stream and deliver is None:
            self._events = queue.SimpleQueue()
            deliver = self._events.put
        self._deliver = deliver
        # Set (by whichever thread delivered) when `deliver` raised: it gets
        # nothing more, and the request ends with this error (_send).
        self._deliver_error: EngineError | None = None
        self._emitted = [0] * len(seqs)  # tokens already sent, per sample (loop thread)
        self._ended: set[int] = set()  # samples whose last event was sent (loop thread)
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop generating; a no-op once done. Returns at once: `wait()` for the KV to be released."""
        if not self._done.is_set():
            self._loop._post("cancel", self)

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def __iter__(self) -> Iterator[StreamEvent]:
        if self._events is None:
            raise InvalidArgument("this request was not submitted with stream=True (or delivers elsewhere)")
        while (event := self._events.get()) is not _END:
            yield event

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The RequestOutput, once every sample is done (TimeoutError otherwise)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} is not done after {timeout} s")
        tokenizer = self._loop.engine.tokenizer
        out = RequestOutput(self.prompt, self.prompt_token_ids)
        for seq in self._seqs:
            text = final_text(tokenizer, seq.output_ids, seq.params.stop, seq.params.min_tokens,
                              seq.params.stop_token_ids)
            out.outputs.append(CompletionOutput(text, list(seq.output_ids), seq.finish_reason, seq.metrics, seq.error,
                                                seq.sample_index))
        return out

    # -- loop thread ----------------------------------------------------

    def _publish(self, seq: Sequence) -> None:
        """Send what `seq` gained since its last event; end the stream when every sample is done."""
        i = seq.sample_index
        if self._stream and i not in self._ended:
            new = seq.output_ids[self._emitted[i]:]
            if new or seq.finish_reason is not None:
                self._emitted[i] = len(seq.output_ids)
                if seq.finish_reason is not None:
                    self._ended.add(i)
                self._send(StreamEvent(i, new, seq.finish_reason, seq.error, time.perf_counter()))

    def _finish_if_done(self) -> None:
        if all(s.status is Status.FINISHED for s in self._seqs) and not self._done.is_set():
            if self._deliver_error is not None:
                # Its caller missed events: the request failed, whatever its samples did.
                for seq in self._seqs:
                    if seq.error is None:
                        seq.finish_reason, seq.error = "error", self._deliver_error
            self._done.set()
            if self._stream:
                self._send(_END)

    def _send(self, event: StreamEvent | None) -> None:
        """Hand `event` to the caller's `deliver`. One that raises is its
        caller's bug, and stays theirs: logged once, sent nothing more, the
        request cancelled by the loop (EngineLoop._dispatch) with an error
        saying so; the loop and every other request go on. Raised on the
        final None, it is logged only: the request is already complete."""
        try:
            self._deliver(event)
        # Whatever it raises, KeyboardInterrupt and SystemExit too: on the
        # engine thread they are the callback's own (signals reach the main
        # thread only), and in the loop's handlers they would stop the engine
        # thread and fail every request. On the main thread (a refused
        # request's end is delivered on the caller's) they may be a Ctrl-C.
        except BaseException as exc:  # noqa: BLE001
            if not isinstance(exc, Exception) and threading.current_thread() is threading.main_thread():
                raise
            log.exception("request %d: its deliver callback raised; it gets no more events and the request "
                          "is cancelled", self.request_id)
            self._stream = False
            self._deliver_error = EngineError(f"the deliver callback raised {type(exc).__name__}: {exc}")
            self._deliver_error.__cause__ = exc


class EngineLoop:
    """Builds its Engine on its own thread (`make_engine(stop)`; an exception
    there is raised by the constructor) so that the loading, the kernel
    timings and every step run on one thread: one OpenMP pool for the
    engine's whole life (see threads.release_openmp_pool). `stop` is set
    when the loop closes: a build still loading the model ends early (Ctrl-C
    while loading waits for the tensor being read, not for every tensor).
    `stop_loading`: the caller's own such event, set by the caller (a server
    told to stop while it loads) or by close()."""

    def __init__(self, make_engine: Callable[[threading.Event], Engine],
                 stop_loading: threading.Event | None = None):
        self.engine: Engine | None = None
        self._cv = threading.Condition()
        self._inbox: deque[tuple[str, RequestStream]] = deque()
        self._closing = False
        self._ids = itertools.count()
        self._live: dict[Sequence, RequestStream] = {}  # loop thread only
        # Those of _live whose request streams: without any, a step that
        # finished no sequence has nothing to dispatch (_serve).
        self._streamed: set[Sequence] = set()
        # torch's current CUDA device is per thread: the engine thread starts on the creator's.
        self._cuda_index = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self._ready = threading.Event()
        self._stop_loading = stop_loading if stop_loading is not None else threading.Event()
        self._build_error: BaseException | None = None
        # Before the thread starts, so that it shares malloc's main arena (host_memory.py).
        keep_freed_memory()
        self._thread = threading.Thread(target=self._run, args=(make_engine,), name="flexinfer-engine", daemon=True)
        # A Ctrl-C may come while start() still waits to see the thread run
        # (a loaded machine may run the thread's load first): it too closes
        # the thread, or the thread would load the whole model, never closed.
        try:
            self._thread.start()
            self._ready.wait()
        except BaseException:  # Ctrl-C while loading: the thread closes what it built
            self.close()
            raise
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error

    # -- any thread -----------------------------------------------------

    def submit(self, prompt: str | None, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
               stream: bool = False, deliver: Callable[[StreamEvent | None], None] | None = None) -> RequestStream:
        """Queue one request. A request that cannot run (empty, too long for
        max_model_len, a token outside the vocabulary) comes back already
        done, its samples failed with InvalidArgument. `deliver` (called on
        the loop thread, must not block) receives the StreamEvents and then
        None; one that raises fails its own request alone (RequestStream._send).
        Without it a streaming request is iterated."""
        if self._closing:  # a closed engine judges no request, not even one that could never run
            raise EngineClosed("the engine is closed")
        engine = self.engine
        # Before the samples are built: a refused request costs its check, not n copies of its prompt.
        problem = request_problem(prompt_ids, params, engine.max_model_len, engine.config.vocab_size,
                                  engine.config.eos_token_ids, engine.kv_budget)
        request_id = next(self._ids)
        # One copy of the caller's list, shared by the samples (a Sequence never changes its prompt).
        shared_prompt = list(prompt_ids)
        seqs, leader = [], None
        for sample_index in range(params.n):
            seq = Sequence(next(self._ids), request_id, sample_index, shared_prompt, params, priority,
                           engine.config.eos_token_ids)
            # Parallel samples fork from the first one's prompt by prefix match.
            seq.leader = leader
            leader = leader or seq
            seqs.append(seq)
        handle = RequestStream(self, request_id, prompt, list(prompt_ids), seqs, stream, deliver)
        if problem:
            for seq in seqs:
                seq.status, seq.finish_reason = Status.FINISHED, "error"
                seq.error = InvalidArgument(problem.message)
                handle._publish(seq)
            handle._finish_if_done()
            return handle
        self._post("add", handle)
        return handle

    @property
    def running(self) -> bool:
        """The loop takes requests: its thread lives and it is not closing."""
        return self._thread.is_alive() and not self._closing

    def close(self, timeout: float | None = None) -> None:
        """Cancel what is still queued or running, stop the thread and close the engine."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._stop_loading.set()
        # Not alive: done, or not started yet (a Ctrl-C in start()): join() would raise, and
        # such a thread, should it run, stops its load at its first tensor (stop is set).
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join(timeout)

    @contextlib.contextmanager
    def together(self):
        """Requests submitted inside reach the engine thread together: a
        batch of prompts (LLM.generate) is admitted as one, not as the
        thread happened to wake between them (which changed the plans, and
        with a pool that preempts, which requests were preempted)."""
        with self._cv:  # reentrant: _post takes it again
            yield

    def _post(self, op: str, handle: RequestStream) -> None:
        with self._cv:
            if self._closing and op == "add":
                raise EngineClosed("the engine is closed")
            self._inbox.append((op, handle))
            self._cv.notify()

    # -- the loop thread ------------------------------------------------

    def _run(self, make_engine: Callable[[], Engine]) -> None:
        try:
            if self._cuda_index is not None:
                torch.cuda.set_device(self._cuda_index)
            self.engine = make_engine(self._stop_loading)
            if self.engine.device.type == "cuda" and self.engine.device.index is not None:
                torch.cuda.set_device(self.engine.device)
        except BaseException as exc:  # handed to the constructor
            self._build_error = exc
            return
        finally:
            self._ready.set()
        try:
            self._serve()
        except BaseException as exc:  # the thread cannot go on: end every stream, refuse new ones
            log.exception("the engine thread stopped")
            with self._cv:
                self._closing = True
                inbox, self._inbox = self._inbox, deque()
            error = EngineError(f"the engine thread stopped: {type(exc).__name__}: {exc}")
            for handle in set(self._live.values()) | {h for op, h in inbox if op == "add"}:
                self._cancel(handle, error)
        finally:
            # The KV space (and the pool the engine made) go with the thread.
            try:
                self.engine.close()
            except Exception:
                log.exception("closing the engine failed")

    def _serve(self) -> None:
        idle = True
        while True:
            with self._cv:
                # Sleep only when idle and drained (see below), and wake now
                # and then to see whether the vtm broker went away meanwhile:
                # an idle engine reconnects too (see below).
                while (not self._inbox and not self._closing and idle and not self.engine.has_work()
                       and self.engine.manager.healthy):
                    self._cv.wait(_IDLE_CHECK_S)
                inbox, self._inbox = self._inbox, deque()
                closing = self._closing
            try:
                while inbox:
                    op, handle = inbox.popleft()
                    if op == "add":
                        self._add(handle)
                    else:
                        self._cancel(handle)
                if closing:
                    break
                if self.engine.has_work() or not self.engine.manager.healthy:
                    # A step on a manager that lost its broker tries to reconnect.
                    idle = False
                    finished = self.engine.scheduler.num_finished
                    changed = self.engine.step()
                    if not self.engine.has_work():
                        # Going idle: finish queued memory work before anyone
                        # is told their request is done.
                        self.engine.drain()
                    # A request that does not stream hears only of its end:
                    # a pass over 256 sequences that ended nowhere cost ~50 µs.
                    if self._streamed or self.engine.scheduler.num_finished != finished:
                        self._dispatch(changed)
                elif not idle:
                    idle = True
                    self.engine.drain()
                    release_openmp_pool()
            except Exception as exc:  # a bug in this loop: fail what is live, keep serving
                log.exception("the engine loop failed; failing %d live requests", len(self._live))
                for handle in set(self._live.values()):
                    self._cancel(handle, EngineError(f"the engine loop failed: {type(exc).__name__}: {exc}"))
                # What came after the op that raised was neither added nor
                # failed: left out, its callers would wait forever.
                with self._cv:
                    self._inbox.extendleft(reversed(inbox))
        for handle in set(self._live.values()):
            self._cancel(handle, EngineClosed("the engine was closed before this request finished"))
        try:
            self.engine.drain()
        except Exception:
            log.exception("waiting for vtm's queued work at close failed")

    def _add(self, handle: RequestStream) -> None:
        for seq in handle._seqs:
            self._live[seq] = handle
            if handle._stream:
                self._streamed.add(seq)
            self.engine.add(seq)

    def _cancel(self, handle: RequestStream, error: Exception | None = None) -> None:
        for seq in handle._seqs:
            if seq.status is not Status.FINISHED:
                try:
                    self.engine.abort(seq, "error" if error else "abort", error)
                except Exception as exc:  # the sequence still ends: a stream must always end
                    log.exception("aborting a sequence failed")
                    seq.status, seq.finish_reason = Status.FINISHED, "error"
                    seq.error = error or EngineError(f"cancelling failed: {type(exc).__name__}: {exc}")
        try:
            self.engine.settle()  # the KV is released when the stream ends, not a step later
        except Exception:  # noqa: BLE001 - released at the next step instead
            log.exception("releasing a cancelled request's KV failed")
        for seq in handle._seqs:
            self._live.pop(seq, None)
            self._streamed.discard(seq)
            handle._publish(seq)
        handle._finish_if_done()

    def _dispatch(self, seqs: list[Sequence]) -> None:
        # Once per sequence per step: the enum member is read once (~60 ns a read).
        finished, undeliverable, ended = [], [], Status.FINISHED
        for seq in seqs:
            handle = self._live.get(seq)
            if handle is None:
                continue
            if handle._stream:  # else nothing is sent before the request is done
                handle._publish(seq)
                if handle._deliver_error is not None:
                    undeliverable.append(handle)
            if seq.status is ended:
                del self._live[seq]
                self._streamed.discard(seq)
                finished.append(handle)
        for handle in finished:
            handle._finish_if_done()
        for handle in undeliverable:
            if not handle.done:
                self._cancel(handle, handle._deliver_error)
