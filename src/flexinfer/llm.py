"""LLM: the synchronous Python API. A thin wrapper over an Engine driven by
its EngineLoop thread: `generate` and `chat` submit requests and wait for
them, so any number of threads may call them at once, and a caller
interrupted (Ctrl-C) takes its requests back before the exception goes on.
"""

from __future__ import annotations

import difflib
import inspect
import sys
import threading
import weakref

from tqdm import tqdm

from flexinfer.engine import Engine
from flexinfer.engine_loop import EngineLoop, RequestStream
from flexinfer.errors import InvalidArgument
from flexinfer.inputs import check_conversation, check_params, check_priorities, check_prompt, check_prompts
from flexinfer.outputs import RequestOutput
from flexinfer.sampling import SamplingParams

# What LLM(model, **options) takes: Engine's keyword parameters (not the private ones, `_stop_loading`).
OPTIONS = tuple(name for name in inspect.signature(Engine.__init__).parameters
                if name not in ("self", "model") and not name.startswith("_"))
_POLL_S = 0.1
# How long a cancelled generate waits for its requests to let go of their memory.
_CANCEL_WAIT_S = 30.0


class LLM:
    """An LLM on a vtm KV cache. `LLM(model, **options)`: the options are
    Engine's (dtype, kv_capacity_bytes, manager, max_num_seqs, max_model_len,
    enable_prefix_caching, attention, linear, threads, cuda_graphs, ...).
    `_stop_loading` (private, for `flexinfer serve`): an event that, once set,
    ends the load early with EngineClosed, as close() or a Ctrl-C does."""

    def __init__(self, model: str, *, _stop_loading: threading.Event | None = None, **options):
        _check_option_names(options)
        self._loop = EngineLoop(lambda stop: Engine(model, _stop_loading=stop, **options), _stop_loading)
        self.engine = self._loop.engine
        # Stop the thread and release the memory even if close() is never called.
        self._finalizer = weakref.finalize(self, self._loop.close)

    # What the engine holds, for callers and tests that look inside.
    tokenizer = property(lambda self: self.engine.tokenizer)
    config = property(lambda self: self.engine.config)
    model = property(lambda self: self.engine.model)
    kv_cache = property(lambda self: self.engine.kv_cache)
    manager = property(lambda self: self.engine.manager)
    scheduler = property(lambda self: self.engine.scheduler)
    attention = property(lambda self: self.engine.attention)
    thread_tuner = property(lambda self: self.engine.thread_tuner)
    device = property(lambda self: self.engine.device)
    dtype = property(lambda self: self.engine.dtype)
    max_model_len = property(lambda self: self.engine.max_model_len)
    kv_budget = property(lambda self: self.engine.kv_budget)  # what one request's KV can ever take

    # -- requests -------------------------------------------------------

    def submit(self, prompt, sampling_params: SamplingParams | None = None, priority: int = 0,
               stream: bool = True, deliver=None) -> RequestStream:
        """Queue one prompt (a str or a list of token ids) and return its
        handle at once: iterate it for StreamEvents, `result()` for the
        RequestOutput, `cancel()` to stop it. Text for the events comes from
        flexinfer.detokenizer.IncrementalText. `deliver(event)`, if given,
        receives the events (then None) on the engine thread instead, and
        must not block (AsyncLLM uses it); if it raises, it gets nothing
        more and the request ends with an EngineError saying so. It needs
        stream=True: with stream=False there are no events to deliver."""
        if deliver is not None and not callable(deliver):
            raise InvalidArgument(f"deliver must be a callable taking a StreamEvent (then None), got {deliver!r}")
        if deliver is not None and not stream:
            raise InvalidArgument("deliver receives the stream's events: a request submitted with stream=False "
                                  "has none (leave stream=True, or wait for the result instead)")
        prompt = check_prompt(prompt)
        params = check_params(sampling_params, 1)[0]
        priority = check_priorities([priority], 1)[0]
        text, ids = self._encode(prompt)
        return self._loop.submit(text, ids, params, priority, stream=stream, deliver=deliver)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | None = None, priorities: list[int] | None = None) -> list[RequestOutput]:
        """Complete each prompt (a string or a list of token ids). A request
        that cannot run or fails comes back with `outputs[i].error` set; the
        others are unaffected. Malformed arguments raise InvalidArgument
        before anything runs."""
        prompts = check_prompts(prompts)
        params = check_params(sampling_params, len(prompts))
        priorities = check_priorities(priorities, len(prompts))
        encoded = [self._encode(p) for p in prompts]
        handles: list[RequestStream] = []
        try:
            with self._loop.together():
                for (text, ids), p, priority in zip(encoded, params, priorities):
                    handles.append(self._loop.submit(text, ids, p, priority))
            # A bar is for a person watching: not in a log or a pipe.
            show = use_tqdm if use_tqdm is not None else len(handles) > 1 and _stderr_is_a_terminal()
            with tqdm(total=len(handles), desc="generate", disable=not show, unit="req") as bar:
                for handle in handles:
                    # In slices: a signal (Ctrl-C) is handled between them.
                    while not handle.wait(_POLL_S):
                        pass
                    bar.update(1)
            return [handle.result() for handle in handles]
        except BaseException:
            # Ctrl-C (or any error here): take the requests back, so that
            # nothing of this call runs on or holds memory after it.
            for handle in handles:
                handle.cancel()
            for handle in handles:
                handle.wait(_CANCEL_WAIT_S)
            raise

    def chat(self, conversations, sampling_params: SamplingParams | None = None, **kwargs):
        """Apply the chat template and generate. One conversation (a list of
        messages) gives one RequestOutput; a list of conversations, a list.
        Earlier turns are mapped from the prefix cache, not recomputed."""
        single = isinstance(conversations, (list, tuple)) and bool(conversations) and isinstance(conversations[0], dict)
        convs = [conversations] if single else conversations
        if not isinstance(convs, (list, tuple)):
            convs = [convs]  # check_conversation names the problem
        prompts = [self.chat_prompt(c, i if not single else None) for i, c in enumerate(convs)]
        outs = self.generate(prompts, sampling_params or SamplingParams(max_tokens=256, temperature=0.0), **kwargs)
        return outs[0] if single else outs

    def chat_prompt(self, conversation, index: int | None = None) -> list[int]:
        """The token ids of a conversation under the model's chat template,
        ending with the assistant's turn to answer. Special-token text in a
        message's content stays text (Tokenizer.encode_chat)."""
        conversation = check_conversation(conversation, index)
        return self.tokenizer.encode_chat(conversation, add_generation_prompt=True)

    def stats(self, timeout: float | None = None) -> dict:
        """Scheduler counters and the vtm manager's stats, safe from any
        thread. `timeout`: see Engine.stats (for monitoring a broker's pool
        without letting a stalled broker break the engine)."""
        return self.engine.stats(timeout)

    @property
    def problem(self) -> str | None:
        """Why this LLM cannot serve requests now, or None: its engine thread
        stopped or is closing, or its manager lost the vtm broker. Reads
        state only (never calls the broker): safe on an event loop."""
        if not self._loop.running:
            return "the engine thread has stopped"
        # A vtm.connect manager whose session was lost (the engine is
        # reconnecting: requests wait); an in-process one is healthy until closed.
        if not self.manager.healthy:
            return "the vtm broker is unavailable (the engine is reconnecting)"
        return None

    # -- lifetime -------------------------------------------------------

    def close(self) -> None:
        """Cancel what is still running, stop the engine thread, release the
        KV space (and the manager, when this engine made it)."""
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _encode(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, prompt


def _check_option_names(options: dict) -> None:
    """An unknown option (a typo, say) raises InvalidArgument naming it and
    the known option closest to it, before the engine thread starts, not a
    TypeError from Engine's constructor."""
    for name in options:
        if name not in OPTIONS:
            close = difflib.get_close_matches(name, OPTIONS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"the options are {', '.join(OPTIONS)}"
            raise InvalidArgument(f"unknown option {name!r}: {hint}")


def _stderr_is_a_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except ValueError:  # closed
        return False
