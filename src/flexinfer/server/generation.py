"""Generation: the engine requests of one API call (one per prompt, each
with n samples) merged into one stream of per-choice updates on the event
loop, with text decoded incrementally and the latency metrics observed.

Why not one AsyncRequest per prompt: a call with several prompts would need
a task per prompt to merge their streams. Here every request delivers into
one asyncio queue (`LLM.submit(deliver=...)` runs on the engine thread and
hands each event over with call_soon_threadsafe), tagged with its prompt.

A Generation is built on a worker thread (serving.py: submitting holds the
prompts' sequences, which the event loop should not wait for) and consumed
on the event loop. It gives back its places in the server's Admission as
its requests end (on the engine thread), or at once for those it never
submitted.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from flexinfer.detokenizer import IncrementalText
from flexinfer.engine_loop import RequestStream
from flexinfer.llm import LLM
from flexinfer.outputs import StreamEvent
from flexinfer.sampling import SamplingParams
from flexinfer.server.limits import Admission
from flexinfer.server.metrics import ServerMetrics
from flexinfer.server.protocol import PromptTokensDetails, Usage


@dataclass
class Choice:
    """One sample of one prompt: choice `index` = prompt index * n + sample index."""

    index: int
    detokenizer: IncrementalText
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: Exception | None = None
    last_token_s: float = 0.0


@dataclass
class ChoiceUpdate:
    """What one StreamEvent added to a choice: its text delta (text that may
    still turn into a stop string is held back) and new token ids."""

    choice: Choice
    text: str
    token_ids: list[int]
    finish_reason: str | None


class Generation:
    """Invariant: once `updates()` has ended, however it ended (every choice
    finished, the consumer stopped early, the task was cancelled), no request
    of this call runs or holds KV in the engine: each is done or cancelled."""

    def __init__(self, llm: LLM, prompts: list[list[int]], params: SamplingParams, metrics: ServerMetrics,
                 arrival_s: float, loop: asyncio.AbstractEventLoop, admission: Admission):
        """`admission` holds len(prompts) * n places for this call (any thread)."""
        self._metrics = metrics
        self._arrival_s = arrival_s
        self._n = params.n
        self.requests: list[RequestStream] = []
        self.choices: list[Choice] = []
        try:
            self._queue: asyncio.Queue[tuple[int, StreamEvent | None]] = asyncio.Queue()
            self.choices = [Choice(i, IncrementalText(llm.tokenizer, params.stop, params.min_tokens,
                                                      params.stop_token_ids))
                            for i in range(len(prompts) * params.n)]
            for i, ids in enumerate(prompts):
                release = _release(admission, params.n)
                self.requests.append(llm.submit(ids, params, deliver=_deliver_to(loop, self._queue, i, release)))
        except BaseException:
            admission.release(params.n * (len(prompts) - len(self.requests)))
            self.cancel()
            raise
        self._open = len(self.requests)  # requests whose end (None) has not been received
        metrics.prompt_tokens.inc(sum(len(ids) for ids in prompts))

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        try:
            while self._open:
                prompt_index, event = await self._queue.get()
                if event is None:
                    self._open -= 1
                    continue
                yield self._apply(prompt_index, event)
        finally:
            self.cancel()

    async def run(self) -> None:
        """Consume every update (a response that is not streamed)."""
        async for _ in self.updates():
            pass

    def cancel(self) -> None:
        """Take back every request not yet done; its unfinished choices count
        as aborted. The choices of prompts never submitted (submitting one
        failed) are not counted: no sample of theirs began, so none ended."""
        for request in self.requests:
            request.cancel()
        for choice in self.choices[:len(self.requests) * self._n]:
            if choice.finish_reason is None:
                choice.finish_reason = "abort"
                self._metrics.requests.labels("abort").inc()

    def abort(self) -> None:
        """Take back every request not yet done, as a server shutting down
        does: unlike cancel(), its choices end through updates() as any
        other end would (finish_reason "abort"), so that the handler still
        answers with them. A no-op once every request is done."""
        for request in self.requests:
            request.cancel()

    def usage(self) -> Usage:
        """Token counts, once every request is done. cached_tokens: prompt
        tokens mapped from the prefix cache (the first sample's; the others
        fork from it)."""
        prompt = sum(len(r.prompt_token_ids) for r in self.requests)
        completion = sum(len(c.token_ids) for c in self.choices)
        cached = sum(r.result(timeout=0).outputs[0].metrics.prefix_hit_tokens for r in self.requests)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def first_error(self) -> Exception | None:
        return next((c.error for c in self.choices if c.error is not None), None)

    def _apply(self, prompt_index: int, event: StreamEvent) -> ChoiceUpdate:
        choice = self.choices[prompt_index * self._n + event.sample_index]
        if event.token_ids:
            first = not choice.token_ids
            since = event.time_s - (self._arrival_s if first else choice.last_token_s)
            self._metrics.observe_tokens(len(event.token_ids), first, since)
            choice.last_token_s = event.time_s
            choice.token_ids.extend(event.token_ids)
        text = choice.detokenizer.push(event.token_ids) if event.token_ids else ""
        if event.finish_reason is not None:
            text += choice.detokenizer.finish()
            choice.finish_reason, choice.error = event.finish_reason, event.error
            self._metrics.requests.labels(event.finish_reason).inc()
            if event.finish_reason in ("stop", "length"):
                self._metrics.e2e_request_latency.observe(event.time_s - self._arrival_s)
        if text:
            choice.text.append(text)
        return ChoiceUpdate(choice, text, event.token_ids, event.finish_reason)


def _release(admission: Admission, count: int) -> Callable[[], None]:
    return lambda: admission.release(count)


def _deliver_to(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, prompt_index: int,
                on_end: Callable[[], None]):
    def deliver(event: StreamEvent | None) -> None:  # on the engine thread: must not block
        try:
            if event is None:  # the request's end: its KV is released
                on_end()
        finally:  # the end reaches the handler whatever on_end does, or it would wait for ever
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (prompt_index, event))
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

    return deliver
