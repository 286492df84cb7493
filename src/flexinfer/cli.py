"""The `flexinfer` command: generate, chat, bench, serve.

Exit status: 0 on success; 1 when a request failed in the engine (say, NaN
logits); 2 for bad input (a bad flag value; an empty, too long or non-UTF-8
prompt; a model that cannot be loaded) or no memory; 130 when interrupted
(Ctrl-C), 143 when terminated (SIGTERM): generate, chat and bench take their
requests back and close the engine (and its vtm broker session) first; serve
takes Ctrl-C and SIGTERM as a graceful shutdown, and exits 0 after SIGTERM.
With several prompts, every prompt's output or error is printed and the status
is the worst of them. Errors are one line, `flexinfer: error: ...` on stderr,
and so is every log line (cli_log.py). Anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import logging
import math
import os
import queue
import signal
import socket
import stat
import sys
import threading
import time

import torch

import vtm
import vtm.machine
from flexinfer import __version__
from flexinfer.attention import ATTENTION_BACKENDS
from flexinfer.cli_chat import ChatSession, utf8_problem
from flexinfer.cli_log import ENV, command_logging
from flexinfer.detokenizer import IncrementalText
from flexinfer.engine import BROKER_WAIT_S, MAX_BATCH_TOKENS, MAX_BYTES, MEMORY_WAIT_S
from flexinfer.errors import (ChatTemplateError, EngineClosed, EngineError, FlexInferError, InvalidArgument,
                              ModelLoadError)
from flexinfer.inputs import KVBudget, request_problem
from flexinfer.kv_cache import planned_kv_budget
from flexinfer.llm import LLM
from flexinfer.model.config import ModelConfig
from flexinfer.model.linear import LINEAR_KINDS
from flexinfer.model.loader import load_config, load_tokenizer
from flexinfer.outputs import RequestOutput
from flexinfer.sampling import SamplingParams
from flexinfer.server.main import add_serve_args, capacity_warning, serve

# Errors caused by the user's input or the machine's limits, not by a bug
# (an EngineError or EngineClosed among them means status 1, the others 2: a
# broker that does not answer at start is a wrong address).
_USER_ERRORS = (FlexInferError, vtm.InvalidArgument, vtm.OutOfMemory, vtm.Unavailable)
# A request (or chat turn) that failed with one of these was bad input or found
# no memory (2); any other error of a request is a failure in the engine (1).
_BAD_INPUT = (InvalidArgument, ModelLoadError, ChatTemplateError, vtm.InvalidArgument, vtm.OutOfMemory)

log = logging.getLogger("flexinfer")

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143


class Terminated(BaseException):
    """SIGTERM, raised on the main thread as Ctrl-C raises KeyboardInterrupt,
    so that a command ends the same way: its requests taken back, the engine
    closed (a broker session says goodbye), "terminated" said. Without it the
    interpreter died at once (143 all the same), mid-line, with no word. A
    BaseException, as KeyboardInterrupt: no `except Exception` swallows it,
    and chat's Ctrl-C handlers, which go on chatting, let it through."""


def _raise_terminated(signum, frame):
    raise Terminated()

# One default for the tokens a request may generate, in every sub-command.
DEFAULT_MAX_TOKENS = 128
# How long an interrupted command waits for its requests to let go of their memory (as LLM.generate).
_CANCEL_WAIT_S = 30.0
# The physical chunk size of an in-process pool: --kv-capacity-gib is rounded up to a multiple of it.
CHUNK_BYTES = 2 << 20
# An in-process pool's size without --kv-capacity-gib.
DEFAULT_KV_CAPACITY_GIB = 2.0
# How long a command waits at start for a vtm broker whose socket is not there
# yet, or refuses connections: one starting (`vtmd ... & flexinfer ...`) or restarting.
BROKER_START_WAIT_S = 10.0


class _Parser(argparse.ArgumentParser):
    """Shows every default in --help and reports a bad argument in one line
    (status 2) like every other error. Sub-parsers are of this class too."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"flexinfer: error: {message} (see `{self.prog} --help`)\n")


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: ...)" to a flag's help, except where there is no
    value to show (None, or off for an on/off switch)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _int_at_least(low: int, what: str):
    """An int type >= low; `what` names it in the error."""
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = low - 1
        if number < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}")
        return number
    return parse


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "an integer >= 0")


def _number(low: float, high: float = math.inf, low_open: bool = False):
    """A float type in [low, high] (or (low, high] when low_open)."""
    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and (number > low if low_open else number >= low) and number <= high):
            interval = ("(" if low_open else "[") + f"{low:g}, " + (f"{high:.12g}]" if math.isfinite(high) else "inf)")
            raise argparse.ArgumentTypeError(f"expected a number in {interval}, got {value!r}")
        return number
    return parse


def _threads(value: str):
    return value if value == "auto" else _int_at_least(1, "'auto' or a positive number")(value)


def _text(value: str) -> str:
    """Command-line text: argv bytes that are not UTF-8 are bad input, said at parse time."""
    problem = utf8_problem(value)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return value


def _broker_address(value: str) -> str:
    """A vtm broker's address, said at parse time: a path without `unix:`
    was refused only once the model had loaded."""
    if not value.startswith("unix:") or value == "unix:":
        raise argparse.ArgumentTypeError(f"expected unix:PATH, vtmd's --listen address (chunks travel as fds, "
                                         f"over a Unix socket only), got {value!r}")
    return value


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="'smollm2', a .gguf file or a Hugging Face folder")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights, activations and KV cache (float16: CUDA only)")
    # Default None: one given with --manager is refused (the pool is the broker's), the default is not.
    p.add_argument("--kv-capacity-gib", type=_number(0, MAX_BYTES >> 30, low_open=True), default=None,
                   help=f"physical KV memory the pool may use, in GiB, rounded up to a whole number of "
                        f"{CHUNK_BYTES >> 20} MiB chunks; not with --manager, whose pool is the broker's "
                        f"(default: {DEFAULT_KV_CAPACITY_GIB})")
    p.add_argument("--host-tier-gib", type=_number(0, MAX_BYTES >> 30), default=0.0,
                   help="host memory, in GiB, that keeps the KV of prefixes evicted from the pool, so that a later "
                        "request (the next turn of a chat) copies it back instead of recomputing it; 0: none")
    p.add_argument("--spill-ahead-gib", type=_number(0, MAX_BYTES >> 30), default=0.0,
                   help="keep this much of the pool free by spilling the least recently used prefixes to the host "
                        "tier in the background, so that an admission does not copy on its critical path "
                        "(needs --host-tier-gib; 0: off)")
    p.add_argument("--preemption", default="recompute", choices=["recompute", "swap"],
                   help="a request preempted for memory: recompute its KV when it is readmitted (what prefix caching "
                        "still holds is mapped), or swap: keep its KV through vtm's host tier and copy it back "
                        "(needs --host-tier-gib, or a broker with a tier)")
    p.add_argument("--backend", default="auto", choices=["auto", "host", "cuda"],
                   help="where the KV cache and the model live: auto is cuda when a driver exists, else host")
    p.add_argument("--manager", type=_broker_address, default=None, metavar="unix:PATH",
                   help="use the vtm broker (vtmd) at this address instead of an in-process manager; "
                        "--backend and the pool (--kv-capacity-gib) are then the broker's. A broker that is "
                        f"starting is waited for, up to {BROKER_START_WAIT_S:g} s, and that wait is said on stderr; "
                        "a PATH where none can ever listen (a file that is not a socket, a path under a file, "
                        "one this user may not reach) fails at once")
    p.add_argument("--client-name", default=None, metavar="NAME",
                   help="the name this process connects to --manager under, which the operator's quotas "
                        "(priority, guarantee, limit) are keyed by (default: flexinfer-COMMAND)")
    p.add_argument("--priority", type=int, default=None, metavar="P",
                   help="with --manager: the priority to ask the broker for; the operator's quota for the client "
                        "name is the most it grants (default: the quota's)")
    p.add_argument("--max-model-len", type=_positive_int, default=4096,
                   help="most tokens (prompt + output) of one request; capped at the model's own maximum")
    p.add_argument("--max-num-seqs", type=_positive_int, default=32,
                   help="most sequences decoded together in one step (continuous batching)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="recompute every prompt instead of mapping the KV of earlier requests")
    p.add_argument("--linear", default="auto", choices=LINEAR_KINDS,
                   help="projection kernels: auto (timed at load per batch size), onednn (prepacked weights), "
                        "packed (FlexInfer's kernel for few rows), torch (F.linear) or triton (CUDA: decode steps "
                        "of up to 8 rows run each layer as four fused Triton kernels)")
    p.add_argument("--attention", default="auto", choices=ATTENTION_BACKENDS,
                   help="attention: kernel (one batched call per layer; what auto picks), sdpa (per request, the "
                        "reference) or flash_attn (CUDA, where flash-attn is installed)")
    p.add_argument("--threads", default="auto", type=_threads,
                   help="CPU compute threads: auto (measured while decoding) or a number")
    p.add_argument("--overlap", default="auto", choices=["auto", "on", "off"],
                   help="launch each step before reading the one before it, so the GPU computes while the host "
                        "plans and delivers (same outputs): auto is on for CUDA, off on a CPU")
    p.add_argument("--broker-wait", type=_number(0), default=BROKER_WAIT_S, metavar="S",
                   help="with --manager: how long requests wait for a vtm broker that went away to come back "
                        "(they resume by recompute) before they fail")
    p.add_argument("--memory-wait", type=_number(0), default=MEMORY_WAIT_S, metavar="S",
                   help="with --manager: how long requests wait for KV memory that the broker's other clients "
                        "hold before they fail with out of memory")
    _add_verbose(p, default=argparse.SUPPRESS)


def _add_verbose(p: argparse.ArgumentParser, default) -> None:
    """--verbose before the command (flexinfer --verbose generate) or after it:
    a sub-command's copy has no default, so it never undoes the first."""
    p.add_argument("--verbose", action="store_true", default=default,
                   help=f"log at debug level, with tracebacks (or {ENV}=debug; {ENV}=info|warning|error sets the "
                        "level); without it, each log line is one line and warnings and errors are shown")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=_positive_int, default=DEFAULT_MAX_TOKENS,
                   help="most tokens to generate per reply")
    p.add_argument("--temperature", type=_number(0), default=0.0,
                   help="sampling temperature; 0 is greedy. The command line defaults to greedy (reproducible); "
                        "SamplingParams in Python defaults to 1.0")
    p.add_argument("--top-k", type=_non_negative_int, default=0, help="sample among the k likeliest tokens; 0: off")
    p.add_argument("--top-p", type=_number(0, 1, low_open=True), default=1.0,
                   help="sample among the likeliest tokens whose probabilities add up to p; 1: off")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: a fresh one)")


_SWAP_NEEDS_TIER = "--preemption swap keeps preempted requests' KV in vtm's host tier"


def _check_engine_flags(args) -> None:
    """The flags that do not go together, and a --manager where no broker can
    ever listen, refused before anything loads (the engine would refuse the
    flags too, naming its Python arguments)."""
    if args.manager is not None:
        problem = _broker_socket_problem(args.manager[len("unix:"):])
        if problem is not None:
            raise InvalidArgument(f"--manager {args.manager}: {problem}, so no vtm broker can listen there "
                                  "(vtmd --listen gives the address)")
    if args.manager is not None and args.kv_capacity_gib is not None:
        raise InvalidArgument("--kv-capacity-gib sizes an in-process pool; with --manager the pool is the "
                              "broker's (vtmd --capacity-bytes; vtmctl set-quota limits this client)")
    if args.manager is not None and args.host_tier_gib > 0:
        raise InvalidArgument("--host-tier-gib sizes the host tier of an in-process pool; with --manager the "
                              "tier is the broker's (vtmd --host-tier-bytes)")
    if args.preemption == "swap" and args.manager is None and args.host_tier_gib == 0:
        raise InvalidArgument(f"{_SWAP_NEEDS_TIER}: give --host-tier-gib too")
    if args.spill_ahead_gib > 0 and (args.manager is not None or args.host_tier_gib == 0):
        raise InvalidArgument("--spill-ahead-gib spills to the host tier of an in-process pool: give --host-tier-gib "
                              "too (with --manager, vtmd --spill-ahead-bytes is the broker's)")
    if args.manager is None:
        _check_sizes_fit(args)


def _check_sizes_fit(args) -> None:
    """The in-process pool and host tier fit in this machine's memory (the
    pool in the device's, where it is on CUDA and the driver tells its size):
    made as they fill, larger ones were accepted and ran out later."""
    pool, tier = _pool_bytes(args), _host_tier_bytes(args)
    pool_limit, pool_memory = vtm.machine.pool_memory(args.backend)
    ram, host = vtm.machine.host_memory_bytes(), vtm.machine.HOST_MEMORY
    problem = (vtm.machine.too_large("--kv-capacity-gib", pool, pool_limit, pool_memory)
               or vtm.machine.too_large("--host-tier-gib", tier, ram, host))
    if problem is None and pool_memory == host:  # both in host memory
        problem = vtm.machine.too_large("--kv-capacity-gib and --host-tier-gib together", pool + tier, ram, host)
    if problem is not None:
        raise InvalidArgument(problem)


def _broker_socket_problem(path: str) -> str | None:
    """Why no vtm broker can ever listen at `path`, or None where one may
    (it does, or its socket may still appear: vtmd creates missing folders)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:  # a part of the path is a file (ENOTDIR), a folder this user may not enter (EACCES)
        return exc.strerror.lower()
    return None if stat.S_ISSOCK(mode) else "not a socket"


def _announce_broker_wait(address: str) -> None:
    """Says on stderr, before vtm.connect waits for a broker that is not
    there yet, that it waits, for what and for how long: a wait of seconds
    without a word looked like a hang."""
    path = address[len("unix:"):]
    if not os.path.exists(path):
        why = "no socket there yet"
    else:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
                return  # a broker listens: no wait
            except OSError as exc:  # refused: the socket of a vtmd that died, until a new one replaces it
                why = f"its socket: {exc.strerror.lower()}"
    print(f"flexinfer: waiting up to {BROKER_START_WAIT_S:g} s for the vtm broker at {address} ({why})",
          file=sys.stderr, flush=True)


def _engine(args, stop_loading: threading.Event | None = None) -> LLM:
    """The LLM the flags ask for; once `stop_loading` is set, its load (and
    its wait for a --manager broker) ends early with EngineClosed (serve,
    stopped while it loads)."""
    manager = None
    _check_engine_flags(args)
    if args.manager is not None:
        name = args.client_name or f"flexinfer-{args.command}"
        # Closed by main() after the command: an LLM never closes a manager it was given.
        # One page mapped ahead of each sequence: most decode steps need no round trip to vtmd.
        _announce_broker_wait(args.manager)
        try:
            # `stop_loading` ends the wait too: serve, told to stop while it waited, took all of it to exit.
            manager = args.broker = vtm.connect(args.manager, name=name, priority=args.priority, map_ahead_pages=1,
                                                timeout=BROKER_START_WAIT_S, stop=stop_loading)
        except vtm.Unavailable:
            if stop_loading is not None and stop_loading.is_set():
                raise EngineClosed(f"--manager {args.manager}: stopped while waiting for the vtm broker") from None
            raise
        if args.priority is not None and manager.priority < args.priority:
            log.warning("asked for priority %d; the operator's quota for '%s' grants %d", args.priority, name,
                        manager.priority)
        if args.preemption == "swap" and not manager.stats().get("host_tier_capacity_bytes"):
            raise InvalidArgument(f"{_SWAP_NEEDS_TIER}, and the vtm broker at --manager has none "
                                  "(vtmd --host-tier-bytes)")
    capacity = _pool_bytes(args)
    host_tier = _host_tier_bytes(args)
    spill_ahead = math.ceil(args.spill_ahead_gib * (1 << 30) / CHUNK_BYTES) * CHUNK_BYTES
    return LLM(args.model, dtype=args.dtype, kv_capacity_bytes=capacity, chunk_bytes=CHUNK_BYTES,
               backend=args.backend, max_model_len=args.max_model_len, manager=manager,
               enable_prefix_caching=not args.no_prefix_caching, linear=args.linear,
               attention=args.attention, threads=args.threads, max_num_seqs=args.max_num_seqs,
               broker_wait_s=args.broker_wait, memory_wait_s=args.memory_wait, host_tier_bytes=host_tier,
               preemption=args.preemption, spill_ahead_bytes=spill_ahead,
               overlap=None if args.overlap == "auto" else args.overlap == "on", _stop_loading=stop_loading)


def _pool_bytes(args) -> int:
    """An in-process pool's size: --kv-capacity-gib in whole chunks."""
    gib = DEFAULT_KV_CAPACITY_GIB if args.kv_capacity_gib is None else args.kv_capacity_gib
    return max(1, math.ceil(gib * (1 << 30) / CHUNK_BYTES)) * CHUNK_BYTES


def _host_tier_bytes(args) -> int:
    """An in-process pool's host tier: --host-tier-gib in whole chunks."""
    return math.ceil(args.host_tier_gib * (1 << 30) / CHUNK_BYTES) * CHUNK_BYTES


def _kv_before_load(args, config: ModelConfig) -> tuple[int, KVBudget | None]:
    """(max_model_len as the engine caps it, the KV budget of the pool where
    its sizes alone tell it: an in-process pool; None with --manager, whose
    limit for this client is the broker's to say). What the engine refuses
    once loaded, refused before the weights load, in the same words."""
    max_model_len = min(args.max_model_len, config.max_position_embeddings)
    if args.manager is not None:
        return max_model_len, None
    return max_model_len, planned_kv_budget(config, getattr(torch, args.dtype), max_model_len, _pool_bytes(args),
                                            CHUNK_BYTES, not args.no_prefix_caching, MAX_BATCH_TOKENS)


def _load(args) -> LLM:
    """The engine, with what loads and how long it took said on stderr (a
    progress bar too on a terminal, where loading takes more than a second)."""
    _check_engine_flags(args)  # before "loading": nothing loads
    print(f"flexinfer: loading {args.model} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    llm = _engine(args)
    print(f"flexinfer: loaded {args.model} in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return llm


def _params(args) -> SamplingParams:
    if args.temperature == 0:
        # Greedy decoding ignores them: a user who gave them meant to sample.
        idle = [flag for flag, given in (("--top-k", args.top_k != 0), ("--top-p", args.top_p != 1.0),
                                         ("--seed", args.seed is not None)) if given]
        if idle:
            named = " and ".join([", ".join(idle[:-1]), idle[-1]] if len(idle) > 1 else idle)
            log.warning("%s change%s nothing at temperature 0: the command line samples greedily unless "
                        "--temperature is given", named, "" if len(idle) > 1 else "s")
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed)


def _status(error: Exception) -> int:
    return EXIT_BAD_INPUT if isinstance(error, _BAD_INPUT) else EXIT_FAILED


def cmd_generate(args) -> int:
    """One prompt: its completion streams to stdout as it is generated. Several:
    each is printed, labelled `[prompt I] `, as soon as it completes. On Ctrl-C
    or an error, what was printed stays, its line ended."""
    params = _params(args)  # before the model loads: a bad flag fails at once
    several = len(args.prompt) > 1
    status = EXIT_OK
    prompts = {}  # the index and token ids of each prompt that can run
    for i, ids in enumerate(_checked_prompts(args, args.prompt, params)):
        if isinstance(ids, str):
            print(f"flexinfer: error: {f'prompt {i}: ' if several else ''}{ids}", file=sys.stderr)
            status = EXIT_BAD_INPUT
        else:
            prompts[i] = ids
    if not prompts:
        return status
    llm = _load(args)
    try:
        if several:
            return max(status, _print_each_when_done(llm, args, prompts, params))
        out = _stream(llm, args, prompts[0], params)
    finally:
        llm.close()
    return _report(out, None)  # after close: its own log lines, if any, come before the outcome


def _stream(llm: LLM, args, ids: list[int], params: SamplingParams) -> RequestOutput:
    text = IncrementalText(llm.tokenizer, params.stop, params.min_tokens, params.stop_token_ids)
    printed = False  # whether stdout holds a line this function must end
    if args.echo:
        print(args.prompt[0], end="", flush=True)
        printed = True
    handle = llm.submit(ids, params, stream=True)
    try:
        for event in handle:
            piece = text.push(event.token_ids)
            if piece:
                print(piece, end="", flush=True)
                printed = True
    except BaseException:  # Ctrl-C: take the request back; the text printed stays, its line ended
        handle.cancel()
        handle.wait(_CANCEL_WAIT_S)
        if printed:
            print(flush=True)
        raise
    out = handle.result()
    if out.error is None or printed:
        print(text.finish(), flush=True)
    return out


def _print_each_when_done(llm: LLM, args, prompts: dict[int, list[int]], params: SamplingParams) -> int:
    done: queue.SimpleQueue[int] = queue.SimpleQueue()

    def on_event(i: int, event) -> None:  # on the engine thread: must not block
        if event is None:  # the request's stream ended
            done.put(i)

    handles = {i: llm.submit(ids, params, stream=True, deliver=functools.partial(on_event, i))
               for i, ids in prompts.items()}
    status = EXIT_OK
    try:
        for _ in handles:
            i = done.get()
            out = handles[i].result()
            if out.error is None:
                print(f"[prompt {i}] " + (args.prompt[i] if args.echo else "") + out.text, flush=True)
            status = max(status, _report(out, i))
    except BaseException:  # Ctrl-C: take back what still runs; what was printed stays
        for handle in handles.values():
            handle.cancel()
        for handle in handles.values():
            handle.wait(_CANCEL_WAIT_S)
        raise
    return status


def _report(out: RequestOutput, index: int | None) -> int:
    """A request's error, or its stats, on stderr; its exit status."""
    label = f"prompt {index}: " if index is not None else ""
    if out.error is not None:
        print(f"flexinfer: error: {label}{out.error}", file=sys.stderr, flush=True)
        return _status(out.error)
    m = out.metrics
    rate = m.decode_tokens_per_s
    print(f"[{label}{m.output_tokens} tokens, TTFT {m.ttft_s * 1000:.0f} ms" + (f", {rate:.1f} tok/s" if rate else "")
          + f", finish: {out.finish_reason}]", file=sys.stderr, flush=True)
    return EXIT_OK


def _checked_prompts(args, prompts: list[str], params: SamplingParams) -> list[list[int] | str]:
    """Each prompt's token ids, or why it cannot run (empty, too long for the
    model, its KV more than an in-process pool can ever hold). Only the
    tokenizer and the config are read (load_tokenizer), so that such a
    prompt is refused in a tenth of a second, not after the seconds the
    weights take to load."""
    config, tokenizer = load_tokenizer(args.model)
    max_model_len, kv = _kv_before_load(args, config)
    checked = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        problem = request_problem(ids, params, max_model_len, config.vocab_size, config.eos_token_ids, kv)
        checked.append(problem.message if problem else ids)
    return checked


def cmd_chat(args) -> int:
    params = _params(args)
    llm = _load(args)
    try:
        errors = ChatSession(llm, params, args.system).run()
    finally:
        llm.close()
    return max((_status(e) for e in errors), default=EXIT_OK)


def cmd_bench(args) -> int:
    """Decode throughput of a batch. A request that cannot run or fails
    (the warm-up's too) is reported as `generate` reports it, with its
    status, and no throughput is printed: it would count tokens never made."""
    prompts = [f"Write a short story about the number {i}." for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    # Before the model loads, as generate does; one line, the first prompt's: the others differ by a number only.
    problem = next((p for p in _checked_prompts(args, prompts, params) if isinstance(p, str)), None)
    if problem is not None:
        print(f"flexinfer: error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    llm = _load(args)
    try:
        warm_up = llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
        if warm_up.error is not None:
            return _report(warm_up, None)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        llm.close()
    failed = [(i, out) for i, out in enumerate(outs) if out.error is not None]
    if failed:
        return max(_report(out, i) for i, out in failed)
    generated = sum(len(o.token_ids) for o in outs)
    print(f"batch {args.batch}: {generated} tokens in {elapsed:.2f} s = {generated / elapsed:.1f} tok/s")
    return EXIT_OK


def cmd_serve(args) -> int:
    # Before the port is bound: the model loads after it, in a thread, and a
    # missing model was reported twice, after uvicorn had started.
    _check_engine_flags(args)
    max_model_len, kv = _kv_before_load(args, load_config(args.model))  # the config alone: a tenth of a second
    early_warning = None if kv is None else capacity_warning(kv.max_tokens, max_model_len)
    return serve(args, functools.partial(_engine, args), early_warning)


def _did_you_mean(unrecognized: list[str], command: argparse.ArgumentParser) -> str:
    """"; did you mean --max-tokens?" for the first unrecognized flag that is
    close to one of the command's, else ""."""
    flags = [flag for action in command._actions for flag in action.option_strings]
    for word in unrecognized:
        if word.startswith("--"):
            close = difflib.get_close_matches(word.split("=", 1)[0], flags, n=1)
            if close:
                return f"; did you mean {close[0]}?"
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="flexinfer", description="LLM serving on vtm vTensor KV caches. Exit status: 0 success, "
                     "1 a request failed in the engine, 2 bad input or no memory, 130 interrupted, "
                     "143 terminated.")
    parser.add_argument("--version", action="version", version=f"flexinfer {__version__}")
    _add_verbose(parser, default=False)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete one or more prompts")
    _add_engine_args(g)
    _add_sampling_args(g)
    g.add_argument("--prompt", action="append", required=True, type=_text,
                   help="text to complete, streamed to stdout as it is generated; may be given several times "
                        "(each completion is then printed as it completes, labelled [prompt I])")
    g.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    g.set_defaults(fn=cmd_generate)
    c = sub.add_parser("chat", help="interactive multi-turn chat, streamed, showing prefix reuse per turn")
    _add_engine_args(c)
    _add_sampling_args(c)
    c.add_argument("--system", default=None, type=_text, help="a system message (kept when old turns are dropped)")
    c.set_defaults(fn=cmd_chat)
    b = sub.add_parser("bench", help="decode throughput of a batch")
    _add_engine_args(b)
    b.add_argument("--batch", type=_positive_int, default=8, help="requests decoded together (at most --max-num-seqs)")
    b.add_argument("--max-tokens", type=_positive_int, default=DEFAULT_MAX_TOKENS,
                   help="tokens decoded per request (end-of-sequence ignored)")
    b.set_defaults(fn=cmd_bench)
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (docs/server.md)")
    _add_engine_args(s)
    add_serve_args(s)
    s.set_defaults(fn=cmd_serve)
    try:
        args, unrecognized = parser.parse_known_args(argv)
        if unrecognized:
            # The sub-command's parser: its --help lists the flags (flexinfer --help lists the commands).
            command = sub.choices[args.command]
            command.error(f"unrecognized arguments: {' '.join(unrecognized)}{_did_you_mean(unrecognized, command)}")
        if args.priority is not None and args.manager is None:
            # The sub-command's parser: its --help lists both flags.
            sub.choices[args.command].error("--priority is what a client asks of a vtm broker: give --manager too")
        if args.command == "bench" and args.batch > args.max_num_seqs:
            # Not decoded together; and bench builds the batch's prompts
            # before anything else is checked: --batch 10**11 took all memory.
            sub.choices["bench"].error(f"--batch {args.batch} is more than --max-num-seqs {args.max_num_seqs}: "
                                       "a batch is decoded together, in one step (raise --max-num-seqs)")
    except SystemExit as exc:  # --help, --version or a bad argument (already printed)
        return exc.code
    args.broker = None
    terminate = None
    if args.command != "serve":  # serve handles both as a graceful shutdown (server/graceful.py)
        # Ctrl-C stops a command even where it was started with SIGINT
        # ignored, as non-interactive shells start background jobs.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        terminate = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        if args.command == "serve":  # its own logging (server/main.py)
            return args.fn(args)
        with command_logging(args.verbose):
            return args.fn(args)
    except _USER_ERRORS as e:
        print(f"flexinfer: error: {e}", file=sys.stderr)
        return EXIT_FAILED if isinstance(e, (EngineError, EngineClosed)) else EXIT_BAD_INPUT
    except KeyboardInterrupt:
        # The command has taken its requests back (a chat its reply) before this.
        print("flexinfer: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print("flexinfer: terminated", file=sys.stderr)
        return EXIT_TERMINATED
    finally:
        if args.broker is not None:
            args.broker.close()
        if terminate is not None:  # a caller of main() in-process gets its own handler back
            signal.signal(signal.SIGTERM, terminate)


def run() -> int:
    """The `flexinfer` command (pyproject's script, `python -m flexinfer`):
    main(), then the interpreter exits. A Ctrl-C while it does (a second
    one, after "interrupted") printed a traceback from its shutdown: from
    here on it ends the process at once, quietly, with 130 (the flush
    below included: a blocked pipe may hold it), and a SIGTERM with 143.
    Not main's: a caller of main() in-process keeps its own handlers."""
    code = main()
    signal.signal(signal.SIGINT, lambda *_: os._exit(EXIT_INTERRUPTED))
    signal.signal(signal.SIGTERM, lambda *_: os._exit(EXIT_TERMINATED))
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (| head): nothing more to show there
            pass
    return code


if __name__ == "__main__":
    sys.exit(run())
