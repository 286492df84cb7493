"""/v1/completions and /v1/chat/completions: from a validated request body
to engine requests (SamplingParams, prompt token ids), and from their
updates to OpenAI responses, whole or as server-sent events.

Every check that can fail is done before anything is submitted, so a bad
request (a 400) leaves the engine untouched. Streams send nothing a later
chunk would contradict: text that may still become a stop string is held
back (IncrementalText), and usage comes last.

Admission: a request asks for prompts x n sequences; more than
`max_seqs_per_request` or `max_queued_seqs` is a 400, and more than the
free places of `max_queued_seqs` (sequences admitted and not finished) a
429, all before anything else happens. Tokenizing and submitting then run
on a worker thread (the tokenizer lets go of the GIL), so the event loop
keeps answering while a long prompt is read.
"""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from typing import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import vtm
from flexinfer.errors import ChatTemplateError, EngineClosed, InvalidArgument
from flexinfer.inputs import check_prompt, request_problem
from flexinfer.llm import LLM
from flexinfer.sampling import SamplingParams
from flexinfer.server.config import ServerLimits
from flexinfer.server.disconnect import EventStreamResponse, unless_disconnected
from flexinfer.server.errors import APIError, bad_request, model_not_found, too_busy, unavailable
from flexinfer.server.generation import ChoiceUpdate, Generation
from flexinfer.server.limits import Admission
from flexinfer.server.metrics import ServerMetrics
from flexinfer.server.protocol import (AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                       ChatCompletionResponse, ChatStreamChoice, CompletionChoice, CompletionRequest,
                                       CompletionResponse, Delta, ErrorResponse, SamplingRequest)

_DONE = b"data: [DONE]\n\n"
# SamplingParams names the field first in its messages ("top_p must be in (0, 1], ...").
_PARAM_FIELDS = {"max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids", "n",
                 "min_tokens", "ignore_eos"}


class Serving:
    """The two generation endpoints over one loaded LLM."""

    def __init__(self, llm: LLM, model_name: str, metrics: ServerMetrics, limits: ServerLimits | None = None):
        self.llm = llm
        self.model_name = model_name
        self.metrics = metrics
        self.limits = limits or ServerLimits()
        self.admission = Admission(self.limits.max_queued_seqs)
        # The generations whose handlers may still run (abort_all); one
        # goes with its handler, and aborting one that ended does nothing.
        self._generations: weakref.WeakSet[Generation] = weakref.WeakSet()
        self._aborting = False
        # Set by the app when SIGTERM comes: an engine closed from then on
        # is the shutdown's doing, not a problem of the engine's own.
        self.shutting_down = False
        # A template that does not name the "developer" role would print it
        # as an unknown role: OpenAI's newer name for "system" is read as that.
        self._developer_as_system = "developer" not in (llm.tokenizer.chat_template or "")

    # -- /v1/completions ------------------------------------------------

    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        arrival = time.perf_counter()
        self._check_common(body)
        count = _prompt_count(body.prompt) * body.n

        def prepare() -> tuple[list[list[int]], SamplingParams]:  # on a worker thread
            prompts = self._completion_prompts(body.prompt)
            max_tokens = body.max_tokens
            given = "max_tokens" if max_tokens is not None else None
            if max_tokens is None:  # an explicit null: up to the context length, or the pool, for every prompt
                max_tokens = min(self._default_max_tokens(len(ids)) for ids in prompts)
            params = _sampling_params(body, max_tokens, given)
            for ids in prompts:
                self._check_fits(ids, params, "prompt", given)
            return prompts, params

        generation, prompts = await self._admit(count, "prompt" if body.n == 1 else "n", prepare, arrival)
        response_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return await self._stream(request, generation, lambda updates: self._completion_events(
                generation, updates, body, response_id, created))
        if not await self._finish(request, generation):
            return Response(status_code=499)  # nobody is listening
        choices = [CompletionChoice(index=c.index, text="".join(c.text), finish_reason=c.finish_reason,
                                    token_ids=c.token_ids if body.return_token_ids else None)
                   for c in generation.choices]
        out = CompletionResponse(id=response_id, created=created, model=self.model_name, choices=choices,
                                 usage=generation.usage(),
                                 prompt_token_ids=prompts if body.return_token_ids else None)
        return JSONResponse(out.model_dump(mode="json"))

    def refuse_long_token_prompts(self, data) -> None:
        """A completions body as decoded JSON, before it is validated (limits.BodyReader, on
        a worker thread for a large body): a prompt of token ids that alone
        fills the context is refused with the 400 `prepare` would give it,
        before pydantic and check_prompt copy a list that an 8 MiB body can
        fill with 4 million ids. The body's other faults, if it has any, are
        then not reported; what is not well-formed here is left to validation."""
        if not isinstance(data, dict) or not isinstance(data.get("prompt"), list):
            return
        max_tokens = data.get("max_tokens", CompletionRequest.model_fields["max_tokens"].default)
        if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
            return  # SamplingParams or validation names what is wrong with it
        prompt = data["prompt"]
        for ids in [prompt] if prompt and type(prompt[0]) is int else prompt:
            if type(ids) is list and ids and type(ids[0]) is int and len(ids) >= self.llm.max_model_len:
                # An explicit null asks for the default, which is 1 after a prompt that fills the context.
                given = None if max_tokens is None else "max_tokens"
                self._check_fits(ids, SamplingParams(max_tokens=max_tokens or 1), "prompt", given)

    async def _completion_events(self, generation: Generation, updates: AsyncIterator[ChoiceUpdate],
                                 body: CompletionRequest, response_id: str, created: int) -> AsyncIterator[bytes]:
        def chunk(choices, usage=None) -> bytes:
            return _event(CompletionResponse(id=response_id, created=created, model=self.model_name,
                                             choices=choices, usage=usage))

        async for update in updates:
            if update.choice.error is not None:
                yield _error_event(update.choice.error)
                return
            if update.text or update.finish_reason or (body.return_token_ids and update.token_ids):
                yield chunk([CompletionChoice(index=update.choice.index, text=update.text,
                                              finish_reason=update.finish_reason,
                                              token_ids=update.token_ids if body.return_token_ids else None)])
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunk([], generation.usage())
        yield _DONE

    def _completion_prompts(self, prompt) -> list[list[int]]:
        """Text, token ids, or a list of either, as lists of token ids."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        prompts = []
        for i, p in enumerate(prompt):
            try:
                p = check_prompt(p, i)
            except InvalidArgument as exc:
                raise bad_request(str(exc), "prompt") from None
            prompts.append(self.llm.tokenizer.encode(p) if isinstance(p, str) else p)
        return prompts

    # -- /v1/chat/completions -------------------------------------------

    async def chat(self, request: Request, body: ChatCompletionRequest) -> Response:
        arrival = time.perf_counter()
        self._check_common(body)
        conversation = [{"role": self._role(m.role), "content": m.text()} for m in body.messages]

        def prepare() -> tuple[list[list[int]], SamplingParams]:  # on a worker thread
            try:
                ids = self.llm.chat_prompt(conversation)
            except (InvalidArgument, ChatTemplateError) as exc:
                raise bad_request(str(exc), "messages") from None
            # OpenAI's newer name wins over the deprecated max_tokens, and
            # an error about the value names the field it came from.
            given = ("max_completion_tokens" if body.max_completion_tokens is not None
                     else "max_tokens" if body.max_tokens is not None else None)
            if given is None:
                # Up to the context length, as OpenAI and vLLM do.
                max_tokens = self._default_max_tokens(len(ids))
            else:
                max_tokens = getattr(body, given)
            params = _sampling_params(body, max_tokens, given)
            self._check_fits(ids, params, "messages", given)
            return [ids], params

        generation, (ids,) = await self._admit(body.n, "n", prepare, arrival)
        response_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return await self._stream(request, generation, lambda updates: self._chat_events(
                generation, updates, body, response_id, created))
        if not await self._finish(request, generation):
            return Response(status_code=499)
        choices = [ChatChoice(index=c.index, message=AssistantMessage(content="".join(c.text)),
                              finish_reason=c.finish_reason,
                              token_ids=c.token_ids if body.return_token_ids else None)
                   for c in generation.choices]
        out = ChatCompletionResponse(id=response_id, created=created, model=self.model_name, choices=choices,
                                     usage=generation.usage(), prompt_token_ids=ids if body.return_token_ids else None)
        return JSONResponse(out.model_dump(mode="json"))

    async def _chat_events(self, generation: Generation, updates: AsyncIterator[ChoiceUpdate],
                           body: ChatCompletionRequest, response_id: str, created: int) -> AsyncIterator[bytes]:
        def chunk(choices, usage=None) -> bytes:
            return _event(ChatCompletionChunk(id=response_id, created=created, model=self.model_name,
                                              choices=choices, usage=usage))

        # The role first, for every choice, as OpenAI's server does.
        for choice in generation.choices:
            yield chunk([ChatStreamChoice(index=choice.index, delta=Delta(role="assistant", content=""))])
        async for update in updates:
            if update.choice.error is not None:
                yield _error_event(update.choice.error)
                return
            if update.text or update.finish_reason or (body.return_token_ids and update.token_ids):
                yield chunk([ChatStreamChoice(index=update.choice.index, delta=Delta(content=update.text or None),
                                              finish_reason=update.finish_reason,
                                              token_ids=update.token_ids if body.return_token_ids else None)])
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunk([], generation.usage())
        yield _DONE

    # -- shared ---------------------------------------------------------

    def _check_common(self, body: SamplingRequest) -> None:
        if body.model is not None and body.model != self.model_name:
            raise model_not_found(body.model, self.model_name, "model")
        unsupported = body.unsupported()
        if unsupported is not None:
            raise bad_request(f"{unsupported} is not supported by this server", unsupported)
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    def _role(self, role: str) -> str:
        return "system" if role == "developer" and self._developer_as_system else role

    def _default_max_tokens(self, prompt_tokens: int) -> int:
        """Up to the context length, or what the KV pool can hold after the
        prompt when that is less; at least 1, so that a prompt that fills
        either is reported as too long."""
        fit = self.llm.kv_budget.max_new_tokens(prompt_tokens)
        return max(1, min(self.llm.max_model_len - prompt_tokens, fit))

    def _check_fits(self, ids: list[int], params: SamplingParams, param: str, max_tokens_param: str | None) -> None:
        """`max_tokens_param`: the field max_tokens came from, None where
        the request left it to the server (up to the context length)."""
        kv = self.llm.kv_budget
        config = self.llm.config
        problem = request_problem(ids, params, self.llm.max_model_len, config.vocab_size, config.eos_token_ids, kv,
                                  max_tokens_param)
        if problem is not None:
            if problem.param != "prompt":
                raise bad_request(problem.message, problem.param)
            if len(ids) + params.max_tokens > self.llm.max_model_len:
                code = "context_length_exceeded"
            elif ids and kv.chunks_needed(len(ids), params.max_tokens) > kv.chunks:
                code = "kv_capacity_exceeded"
            else:
                code = None
            raise bad_request(problem.message, param, code)

    async def _admit(self, count: int, param: str,
                     prepare: Callable[[], tuple[list[list[int]], SamplingParams]],
                     arrival: float) -> tuple[Generation, list[list[int]]]:
        """Take `count` places in the queue, then on a worker thread run
        `prepare()` (tokenize and check: the prompts' token ids and the
        params) and submit. The places go back if that fails, else as the
        requests end (Generation)."""
        limit = self.limits.max_seqs_per_request
        if count > limit:
            raise bad_request(f"this request asks for {count} sequences (prompts x n); this server takes at most "
                              f"{limit} in one request (--max-seqs-per-request)", param, "too_many_sequences")
        if count > self.admission.limit:  # a 429 would be retried for ever
            raise bad_request(f"this request asks for {count} sequences (prompts x n); this server queues at most "
                              f"{self.admission.limit} at once (--max-queued-seqs)", param, "too_many_sequences")
        if not self.admission.reserve(count):
            raise too_busy(f"the server is busy: {self.admission.queued} sequences of at most {self.admission.limit} "
                           f"(--max-queued-seqs) are queued or running, and this request asks for {count} more; "
                           f"retry later")
        loop = asyncio.get_running_loop()

        def run() -> tuple[Generation, list[list[int]]]:
            try:
                prompts, params = prepare()
            except BaseException:
                self.admission.release(count)
                raise
            return self._start(prompts, params, arrival, loop), prompts  # it owns the places from here

        try:
            started = loop.run_in_executor(None, run)
        except BaseException:  # no worker thread (the server is stopping)
            self.admission.release(count)
            raise
        try:
            generation, prompts = await asyncio.shield(started)
        except asyncio.CancelledError:
            # The client left (or the server is stopping) while the request
            # was being submitted: take it back once it is.
            started.add_done_callback(_cancel_generation)
            raise
        self._generations.add(generation)
        if self._aborting:  # submitted while abort_all() ran
            generation.abort()
        return generation, prompts

    def abort_all(self) -> None:
        """Abort every request in flight, and any submitted from now on (on
        the event loop, when the server's shutdown timeout has passed): each
        handler answers with finish_reason "abort" before the server would
        cancel it, which would cut its stream or answer a bare 500."""
        self._aborting = True
        for generation in list(self._generations):
            generation.abort()

    def _start(self, prompts: list[list[int]], params: SamplingParams, arrival: float,
               loop: asyncio.AbstractEventLoop) -> Generation:
        try:
            return Generation(self.llm, prompts, params, self.metrics, arrival, loop, self.admission)
        except EngineClosed:
            # The reason /health gives (the engine thread stopped), unless the server closed it.
            reason = "the server is shutting down" if self.shutting_down else self.llm.problem
            raise unavailable(reason or "the engine is closed") from None

    async def _stream(self, request: Request, generation: Generation,
                      events: Callable[[AsyncIterator[ChoiceUpdate]], AsyncIterator[bytes]]) -> Response:
        """A streamed response, begun once the engine has the first update
        for it: a request that fails before its first token (no memory came
        within memory_wait_s, the broker stayed away) is answered with its
        error's status, as one that is not streamed is, rather than 200 and
        an error event. A client that leaves while it waits cancels it."""
        updates = generation.updates()
        first: list[ChoiceUpdate | None] = []

        async def wait() -> None:
            first.append(await anext(updates, None))
        if not await unless_disconnected(request, wait()):
            await updates.aclose()
            return Response(status_code=499)
        if first[0] is not None and first[0].choice.error is not None:
            await updates.aclose()
            raise _api_error(first[0].choice.error)
        return EventStreamResponse(events(_after(first[0], updates)), on_close=generation.cancel)

    async def _finish(self, request: Request, generation: Generation) -> bool:
        """Run a generation that is not streamed to its end; False if the client left first.
        A failed choice fails the call with the status its error calls for."""
        if not await unless_disconnected(request, generation.run()):
            return False
        error = generation.first_error()
        if error is not None:
            raise _api_error(error)
        return True


async def _after(first: ChoiceUpdate | None, rest: AsyncIterator[ChoiceUpdate]) -> AsyncIterator[ChoiceUpdate]:
    """`first` (None: nothing), then the updates of `rest`."""
    if first is not None:
        yield first
    async for update in rest:
        yield update


def _prompt_count(prompt) -> int:
    """Prompts in a completions `prompt` (text, token ids, or a list of either)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return 1
    return max(1, len(prompt))  # an empty list is refused later, as an empty prompt


def _cancel_generation(started: asyncio.Future) -> None:
    if not started.cancelled() and started.exception() is None:
        started.result()[0].cancel()


def _sampling_params(body: SamplingRequest, max_tokens: int, max_tokens_param: str | None) -> SamplingParams:
    """`body`'s SamplingParams; `max_tokens_param`: the field max_tokens
    came from (chat's max_completion_tokens), named in its errors; None:
    the request left it to the server."""
    top_k = body.top_k or 0
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
            top_k=0 if top_k == -1 else top_k,  # vLLM's -1: off
            top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
            stop=[] if body.stop is None else body.stop,  # "" is refused, as in a list, not read as no stop
            stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos, n=body.n,
            min_tokens=body.min_tokens)
    except InvalidArgument as exc:
        message = str(exc)
        field = message.split(" ", 1)[0]
        said = max_tokens_param or "the default max_tokens"  # named as the client sent it, or not
        if field == "max_tokens":
            field, message = max_tokens_param, said + message[len(field):]
        elif field == "min_tokens":
            message = message.replace("max_tokens (", f"{said} (")
        elif field not in _PARAM_FIELDS:
            field = None
        raise bad_request(message, field) from None


def _api_error(error: Exception) -> APIError:
    # A broker away longer than the engine waits, or memory that other work
    # holds: the request may succeed later (503, which clients retry).
    if isinstance(error, (EngineClosed, vtm.Unavailable, vtm.OutOfMemory)):
        return unavailable(str(error))
    if isinstance(error, (InvalidArgument, vtm.InvalidArgument)):
        return bad_request(str(error))
    return APIError(500, f"{type(error).__name__}: {error}", "internal_server_error")


def _event(model) -> bytes:
    return b"data: " + model.model_dump_json().encode() + b"\n\n"


def _error_event(error: Exception) -> bytes:
    """An error after the stream began (the status line is already sent): one
    event with the OpenAI error body, then the end of the stream."""
    return _event(ErrorResponse(error=_api_error(error).info)) + _DONE
