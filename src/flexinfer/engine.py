"""Engine: a model, its KV cache space on a vtm manager (its own, or one
shared with other engines) and the scheduler, advanced one step at a time.

Invariant: one thread drives an Engine (the EngineLoop's); nothing in it is
locked. A failure inside a step fails the sequences it concerns, releases
their memory and leaves the engine ready for the next step: no request can
break the ones after it.

Overlap (on by default on CUDA): a step is launched, then the host reads the
tokens of the step before it, so the device computes step N while the host
plans step N+1 and checks, detokenises and delivers step N-1's tokens. A
greedy step's tokens stay on the device as the next step's input ids (see
_Step); the host waits for the device once per step, for the step before the
one it just queued. A sequence that stops has had one more token computed,
which is discarded, never emitted; one that reaches max_tokens is not planned
again (Scheduler). Greedy outputs equal those of the engine without overlap.
Sampled (non-greedy) rows are chosen on the device as well (BatchSampler;
a seeded request's draws are a function of its seed and its token's index
there). On a CPU the host
chooses them (sample(), the reference), with the requests' own CPU
generators, and the step is read at once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref

import torch

import vtm
from flexinfer.attention import KernelAttention, make_attention
from flexinfer.detokenizer import held_text, stops_from
from flexinfer.errors import EngineError, InvalidArgument
from flexinfer.host_memory import keep_freed_memory
from flexinfer.inputs import KVBudget
from flexinfer.kv_cache import KVCache, plan_spaces
from flexinfer.model.linear import resolve_linear_kind
from flexinfer.model.llama import ForwardBatch, LlamaModel, long_tensor
from flexinfer.model.loader import check_stop, load_config, load_model
from flexinfer.sampling import (DRAW_KERNEL_FROM_ROWS, NON_FINITE, BatchSampler, SamplingParams, greedy_tokens,
                                sample, warm_draw_kernel)
from flexinfer.scheduler import MEMORY_RETRY_S, Scheduler
from flexinfer.sequence import Sequence, Status
from flexinfer.threads import NeighbourLoad, ThreadTuner

log = logging.getLogger("flexinfer")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {value: name for name, value in _DTYPES.items()}
# More threads than this per CPU is a mistake, not a setting (torch would try to start them all).
_MAX_THREADS_PER_CPU = 8
# While the vtm broker is away, each step tries to reconnect for this long.
RECONNECT_TRY_S = 0.25
# How long requests wait for a broker that went away before they fail (broker_wait_s).
BROKER_WAIT_S = 30.0
# How long a request waits for memory the other users of a shared pool hold (memory_wait_s).
MEMORY_WAIT_S = 30.0
# The most tokens one step computes (prompt chunks and decodes together).
MAX_BATCH_TOKENS = 1024
# The largest byte size an option takes (4 EiB): vtm's sizes are int64, and
# one rounded up to whole chunks must still be one.
MAX_BYTES = 1 << 62


class Engine:
    def __init__(self, model: str, dtype: str | torch.dtype = "float32", kv_capacity_bytes: int = 2 << 30,
                 manager: vtm.Manager | None = None, backend: str = "auto", device: str | None = None,
                 max_num_seqs: int = 32, max_model_len: int | None = None, max_batch_tokens: int = MAX_BATCH_TOKENS,
                 enable_prefix_caching: bool = True, attention: str = "auto", chunk_bytes: int = 2 << 20,
                 workers: int = 1, namespace: str | None = None, layer_groups: int = 1,
                 linear: str = "auto", threads: int | str = "auto", cuda_graphs: bool | None = None,
                 broker_wait_s: float = BROKER_WAIT_S, host_tier_bytes: int = 0, preemption: str = "recompute",
                 spill_ahead_bytes: int = 0,
                 overlap: bool | None = None, memory_wait_s: float = MEMORY_WAIT_S,
                 _stop_loading: threading.Event | None = None):
        # A torch dtype names the same thing as its string: the name is what the namespace records.
        if isinstance(dtype, torch.dtype) and dtype in _DTYPE_NAMES:
            dtype = _DTYPE_NAMES[dtype]
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise InvalidArgument(f"dtype must be one of {sorted(_DTYPES)} or the torch dtype, got {dtype!r}")
        for name, value in (("max_num_seqs", max_num_seqs), ("max_batch_tokens", max_batch_tokens),
                            ("kv_capacity_bytes", kv_capacity_bytes), ("max_model_len", 1 if max_model_len is None else max_model_len),
                            ("chunk_bytes", chunk_bytes), ("workers", workers), ("layer_groups", layer_groups)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{name} must be a positive int, got {value!r}")
        for name, value in (("kv_capacity_bytes", kv_capacity_bytes), ("chunk_bytes", chunk_bytes)):
            if value > MAX_BYTES:
                raise InvalidArgument(f"{name} must be at most 2**62 (4 EiB), got {value!r}")
        if not isinstance(enable_prefix_caching, bool):
            raise InvalidArgument(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
        for name, value in (("cuda_graphs", cuda_graphs), ("overlap", overlap)):
            if value is not None and not isinstance(value, bool):
                raise InvalidArgument(f"{name} must be True, False or None (the default: on for CUDA), got {value!r}")
        if backend not in ("auto", "host", "cuda"):
            raise InvalidArgument(f"backend must be 'auto', 'host' or 'cuda', got {backend!r}")
        if device is not None:
            try:
                torch.device(device)
            except (RuntimeError, TypeError, ValueError):
                raise InvalidArgument(f"device must be a torch device ('cpu', 'cuda', 'cuda:1', ...), "
                                      f"got {device!r}") from None
        if namespace is not None and not isinstance(namespace, str):
            raise InvalidArgument(f"namespace must be a str or None, got {namespace!r}")
        for name, value in (("broker_wait_s", broker_wait_s), ("memory_wait_s", memory_wait_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise InvalidArgument(f"{name} must be a number >= 0, got {value!r}")
        for name, value in (("host_tier_bytes", host_tier_bytes), ("spill_ahead_bytes", spill_ahead_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_BYTES:
                raise InvalidArgument(f"{name} must be an int from 0 to 2**62 (4 EiB), got {value!r}")
        if preemption not in ("recompute", "swap"):
            raise InvalidArgument(f"preemption must be 'recompute' or 'swap', got {preemption!r}")
        if host_tier_bytes and manager is not None:
            raise InvalidArgument("host_tier_bytes sizes the host tier of the engine's own vtm manager; a manager "
                                  "passed in (or a vtm broker) has its own (or none)")
        if spill_ahead_bytes and not host_tier_bytes:
            raise InvalidArgument("spill_ahead_bytes spills prefixes to the host tier of the engine's own vtm manager: "
                                  "give host_tier_bytes too (a vtm broker spills ahead as vtmd --spill-ahead-bytes "
                                  "says)")
        self.broker_wait_s = float(broker_wait_s)
        max_threads = _MAX_THREADS_PER_CPU * (os.cpu_count() or 1)
        if threads != "auto" and (isinstance(threads, bool) or not isinstance(threads, int)
                                  or not 1 <= threads <= max_threads):
            raise InvalidArgument(f"threads must be 'auto' or an int from 1 to {max_threads} "
                                  f"({_MAX_THREADS_PER_CPU} per CPU), got {threads!r}")
        self.dtype = _DTYPES[dtype]
        self._own_manager = manager is None
        if manager is None:
            # On the GPU this engine computes on: vtm's own default is device 0.
            # The host tier in whole chunks: evicted prefixes wait there for their next turn.
            tier = -(-host_tier_bytes // chunk_bytes) * chunk_bytes
            ahead = -(-spill_ahead_bytes // chunk_bytes) * chunk_bytes
            try:
                manager = vtm.Manager(backend=backend, capacity_bytes=kv_capacity_bytes, chunk_bytes=chunk_bytes,
                                      workers=workers, prealloc_chunks=4, device=_cuda_index(device, backend),
                                      host_tier_bytes=tier, spill_ahead_bytes=ahead)
            except vtm.InvalidArgument as exc:  # vtm names its own parameters: say which options they are
                raise InvalidArgument(f"the KV pool of kv_capacity_bytes={kv_capacity_bytes}, "
                                      f"chunk_bytes={chunk_bytes}, workers={workers}, "
                                      f"host_tier_bytes={host_tier_bytes}, spill_ahead_bytes={spill_ahead_bytes}: "
                                      f"{exc}") from None
        self.manager = manager
        self.device = None
        self.kv_cache = None
        self.graphs = None
        self.draw_kernel_warm = False  # the sampler's draw kernel compiled at load (sampling.warm_draw_kernel)
        self.thread_tuner = None
        self._sink = []
        self._unhealthy_since = None  # when the manager was first seen unhealthy (a broker away)
        self._queues = (0, 0)  # (running, waiting): see _publish_queues
        self._keeps_sink = False
        self._sampled_batch = None  # the last sampled batch's _SampledBatch (holds its sequences until the next)
        self._shared_generator: torch.Generator | None = None  # unseeded rows' on the sampling device
        self._in_flight: _Step | None = None  # launched, its tokens not read yet (overlap)
        self._last_launched: _Step | None = None  # the last step() call's launch, if it launched one
        # (plan, its sequences, counts, slots, decode batch size or None) of
        # the last launch: a steady plan comes back as the same list.
        self._plan_lists: tuple | None = None
        try:
            # This thread (the engine loop's) computes on the memory: a broker
            # client revokes a lost session's mappings here, once the steps
            # in flight have completed, and serves no other engine's thread.
            try:
                manager.bind_thread(before_revoke=_weak_call(self._wait_for_device))
            except vtm.FailedPrecondition as exc:
                raise InvalidArgument(str(exc)) from None
            if device is None:
                device = "cuda" if manager.backend == "cuda" else "cpu"
            self.device = torch.device(device)
            if (self.device.type == "cuda") != (manager.backend == "cuda"):
                raise InvalidArgument(f"device {device} does not match the vtm backend {manager.backend}")
            if self.device.type == "cpu" and self.dtype == torch.float16:
                raise InvalidArgument("float16 is supported on CUDA only; use float32 or bfloat16 on CPU")
            # Every cheap check before the weights load.
            linear = resolve_linear_kind(linear, self.device, self.dtype)
            self.attention = make_attention(attention, self.device)
            # Decode as CUDA graph replays: on by default where the batched kernels run on CUDA.
            if cuda_graphs is None:
                cuda_graphs = self.device.type == "cuda" and isinstance(self.attention, KernelAttention)
            if cuda_graphs and (self.device.type != "cuda" or not isinstance(self.attention, KernelAttention)):
                raise InvalidArgument("cuda_graphs needs a CUDA device and attention='kernel' (or 'auto')")
            if preemption == "swap" and not self._on_the_broker(manager.stats).get("host_tier_capacity_bytes"):
                raise InvalidArgument("preemption='swap' keeps preempted requests' KV in vtm's host tier: give "
                                      "host_tier_bytes (or a vtm broker started with --host-tier-bytes)")
            # The checks that need the model's config read it alone (a tenth
            # of a second at most): load_model reads it again with the weights.
            config = load_config(model)
            if config.sliding_window is not None and not self.attention.bounds_windows:
                raise InvalidArgument(f"attention={self.attention.name!r} cannot run sliding-window layers on "
                                      "vtm's window spaces (it reads rows below a window); use 'kernel' or 'auto'")
            # None: the model's own limit; more than it is capped there.
            self.max_model_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
            # With the sink's slot on CUDA (see below), whether or not it is kept.
            plan_spaces(config, self.dtype, self.max_model_len, max_num_seqs + (self.device.type == "cuda"),
                        manager, layer_groups)
            # _stop_loading (EngineLoop.close while this runs: a Ctrl-C) ends the
            # load between tensors and between these steps, each of seconds on a large model.
            loaded = load_model(model, self.dtype, _stop_loading)
            fingerprint = loaded.fingerprint()
            check_stop(_stop_loading, model)
            self.config = loaded.config
            self.tokenizer = loaded.tokenizer
            self.model = LlamaModel(loaded.config, loaded.weights, self.dtype, self.device, linear=linear,
                                    consume_weights=True, max_positions=self.max_model_len)
            del loaded
            check_stop(_stop_loading, model)
            # The Triton kernels on CUDA get one more slot: the sink, a one-token
            # vTensor held for the engine's life. It is the first vTensor of a
            # new space, so it takes slot 0 and keeps mapped the first page,
            # where every layer's K and V views begin: Triton's launcher checks
            # each tensor argument's data_ptr() with cuPointerGetAttribute and
            # raises ValueError when the driver answers CUDA_ERROR_INVALID_VALUE,
            # which a reserved range with nothing mapped may give (not yet seen
            # on a GPU); eager steps run while no request holds slot 0 too.
            # CUDA-graph padding rows write into it. Attention's kernels take
            # those views, and so do the Triton layer ops (the rotary embedding
            # and K/V write) whatever the attention.
            self._keeps_sink = keep_sink = self.device.type == "cuda" and (
                isinstance(self.attention, KernelAttention) or self.model.layer_ops is not None)
            self.kv_cache = self._on_the_broker(lambda: KVCache(
                manager, self.config, self.dtype, self.max_model_len, max_num_seqs + (1 if keep_sink else 0),
                namespace=prefix_namespace(fingerprint, dtype, namespace), layer_groups=layer_groups))
            if self.device.type == "cuda" and self.kv_cache.device.index != _cuda_index(self.device, "cuda"):
                # Kernels would index one GPU's memory from another (a shared
                # manager opened on another device).
                raise InvalidArgument(f"the vtm manager's memory is on {self.kv_cache.device} but the engine "
                                      f"computes on cuda:{_cuda_index(self.device, 'cuda')}")
            if keep_sink:
                self._sink = self._on_the_broker(lambda: self.kv_cache.create(1))
            if cuda_graphs:
                from flexinfer.cuda_graphs import DecodeGraphs

                self.graphs = DecodeGraphs(self.model, self.kv_cache, self.attention, max_num_seqs,
                                           [vt.slot for vt in self._sink])
            # A pool given to the engine may have other users (engines in this
            # process, or other clients of a vtm broker): a request that finds
            # none of it free waits for them, up to memory_wait_s.
            self.scheduler = Scheduler(self.kv_cache, max_num_seqs, max_batch_tokens, enable_prefix_caching,
                                       swap=preemption == "swap",
                                       memory_wait_s=None if self._own_manager else float(memory_wait_s))
            # On a CPU a step computes while it is launched: overlap would only add a discarded token.
            self.overlap = self.device.type == "cuda" if overlap is None else overlap
            # Where sampled rows are chosen: the device's own (CUDA), else the host (None).
            self.sampling_device = self.device if self.device.type == "cuda" else None
            if self.sampling_device is not None and max_num_seqs >= DRAW_KERNEL_FROM_ROWS:
                self.draw_kernel_warm = warm_draw_kernel(self.sampling_device, self.config.vocab_size)
            self.scheduler.wait_for_device = _weak_call(self._wait_for_device)
            self.scheduler.never_fits = _weak_call(self._never_fits)
            self._budget = (self.manager.limit_bytes, self._kv_budget())
            # CPU threads: measured while decoding ("auto", see threads.py) or fixed.
            if self.device.type == "cpu":
                self.thread_tuner = (ThreadTuner(monitor=NeighbourLoad.open()) if threads == "auto"
                                     else ThreadTuner(max_threads=threads, adaptive=False))
                keep_freed_memory()  # activations reuse the heap instead of faulting pages in (host_memory.py)
        except BaseException:
            # A failed constructor leaves nothing behind: no space on a shared
            # manager, no manager of its own, torch's thread count as it was.
            if self.thread_tuner is not None:
                self.thread_tuner.close()
            if self.kv_cache is not None:
                self.kv_cache.release(self._sink)
                self.kv_cache.close()
            if self._own_manager:
                manager.close()
            raise

    # -- requests -----------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a sequence (checked by the caller: see flexinfer.inputs)."""
        seq.generator = self._generator_for(seq.params, seq.sample_index)
        self.scheduler.add(seq)
        self._publish_queues()

    def _generator_for(self, params: SamplingParams, sample_index: int) -> torch.Generator | None:
        """A sampled sequence's generator for the host's sampler, seeded
        with seed + sample_index; None for a greedy one, and where a device
        chooses the rows (BatchSampler: an unseeded row draws from the
        engine's shared generator, a seeded one from its seed and token
        index, _SampledBatch.seeds)."""
        if params.greedy or self.sampling_device is not None:
            return None
        generator = torch.Generator()
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed + sample_index)
        return generator

    def abort(self, seq: Sequence, reason: str = "abort", error: Exception | None = None) -> None:
        """Remove a sequence and release its KV (a cancel, or a failure)."""
        self.scheduler.abort(seq, reason, error)
        if seq.metrics.finish_s is None:
            seq.metrics.finish_s = time.perf_counter()
        self._publish_queues()

    def _publish_queues(self) -> None:
        """The (running, waiting) counts stats() reports, one tuple set
        between changes: read from another thread, the two lists could be
        seen halfway through a move (admitted, preempted), a request in
        neither."""
        self._queues = (len(self.scheduler.running), len(self.scheduler.waiting))

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    def settle(self) -> None:
        """Release now the memory that waits for the steps in flight (the
        host waits for the device): a cancelled request's KV, freed by the
        time its caller hears it ended."""
        self.scheduler.settle_steps()

    def drain(self) -> None:
        """Wait for every queued memory operation (when the engine goes idle),
        and hold no finished batch (its sequences, its vectors) while idle."""
        self._finish_in_flight()
        self.scheduler.drain()
        self._forget_batches()

    def _forget_batches(self) -> None:
        self._last_launched = self._sampled_batch = self._plan_lists = None

    def _on_the_broker(self, call):
        """call() on the manager while the engine is built. A broker session
        lost since vtm.connect (vtmd restarted while the model loaded) is
        opened again first, waiting for the broker up to broker_wait_s, as
        a request would; in process it is call()."""
        deadline = time.monotonic() + self.broker_wait_s  # inf: wait for it for ever
        while True:
            started = time.monotonic()
            try:
                if not self.manager.healthy:
                    self.manager.reconnect(timeout=min(RECONNECT_TRY_S, max(0.0, deadline - started)))
                return call()
            except vtm.Unavailable:
                # A session that is up and still unanswered is not ours to retry.
                if self.manager.healthy or time.monotonic() >= deadline:
                    raise
            # One try per RECONNECT_TRY_S at most, however fast it failed.
            time.sleep(max(0.0, min(started + RECONNECT_TRY_S, deadline) - time.monotonic()))

    @property
    def kv_budget(self) -> KVBudget:
        """What one request's KV can ever take (_kv_budget), as the manager
        grants it now: a broker client learns a new limit from the operator
        (vtmctl set-quota) while it runs. Read from any thread (submission
        checks): the pair is replaced whole."""
        limit, budget = self._budget
        if self.manager.limit_bytes != limit:
            limit, budget = self.manager.limit_bytes, self._kv_budget()
            self._budget = (limit, budget)
        return budget

    def _never_fits(self, seq: Sequence) -> str | None:
        """Why `seq` can never fit the KV budget as the manager grants it
        now, or None."""
        budget = self.kv_budget
        need = budget.chunks_needed(len(seq.prompt_ids), seq.params.max_tokens)
        if need <= budget.chunks:
            return None
        return (f"it needs {need} chunks of {budget.chunk_bytes} bytes and one request can now have at most "
                f"{budget.chunks}" + (f" (this client's limit is {self.manager.limit_bytes} bytes)"
                                      if self.manager.limit_bytes else ""))

    def _kv_budget(self) -> KVBudget:
        """What one request's KV can ever take: the pool, or with vtm.connect
        the broker's pool within this client's limit (as last granted),
        less the sink held for the engine's life. Requests that need more are
        refused at submission (request_problem). Computed when the engine
        starts, after a reconnect and when the limit changes (kv_budget):
        submitting reads it without calling vtm."""
        held = (self.kv_cache.groups if self._keeps_sink else 0) * self.manager.chunk_bytes
        pool, limit = self.manager.capacity_bytes, self.manager.limit_bytes
        limited = 0 < limit < pool
        return KVBudget(tuple(space.row_bytes for space in self.kv_cache.spaces), self.manager.chunk_bytes,
                        ((limit if limited else pool) - held) // self.manager.chunk_bytes,
                        self.scheduler.prefix_caching, tuple(self.kv_cache.windows), self.scheduler.max_batch_tokens,
                        limit if limited else 0)

    def stats(self, timeout: float | None = None) -> dict:
        """Counters for metrics; read from any thread (plain ints, and the
        queue lengths as of the last change).
        `timeout`: a manager on a broker (vtm.connect) must answer within it,
        else vtm.Unavailable, and a late answer leaves the connection usable;
        an in-process manager answers at once."""
        s = self.scheduler
        running, waiting = self._queues
        return {"running": running, "waiting": waiting, "preemptions": s.num_preemptions,
                "prefix_query_tokens": s.prefix_query_tokens, "prefix_hit_tokens": s.prefix_hit_tokens,
                "prefix_hit_tokens_host": s.prefix_hit_tokens_host,
                "swap_out_tokens": s.swap_out_tokens, "swap_in_tokens": s.swap_in_tokens,
                "admissions_undone": s.num_unadmitted,
                "prefix_failures": s.num_prefix_failures, "memory_faults": s.num_memory_faults,
                "vtm": self.manager.stats(timeout=timeout)}

    def close(self) -> None:
        """Release the KV space (and the manager, when this engine made it)."""
        if self.thread_tuner is not None:
            self.thread_tuner.close()
        try:
            self._finish_in_flight()
        except Exception:  # the device failing: the KV space goes all the same
            log.exception("reading the last step at close failed")
        self._forget_batches()
        self.graphs = None
        try:
            try:
                self.kv_cache.release(self._sink)
            finally:
                self._sink = []
                self.kv_cache.close()
        except vtm.Unavailable:
            # The broker is gone, and with it this session: it released the
            # space's memory when the connection dropped.
            log.warning("closing the KV space: the vtm broker is unavailable")
        finally:
            if self._own_manager:
                self.manager.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- one step -------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Run one step; returns the sequences that gained a token or finished.

        With overlap, the step is launched and the tokens returned are those
        of the step before it (see the module's docstring).

        A failure fails only what it concerns: an error in planning (a bug)
        fails every sequence in the scheduler, an error in the forward pass
        or sampling the sequences of this batch, a row of non-finite logits
        its own sequence. A broker that went away is a preemption: the
        running sequences wait, and resume by recompute once the engine has
        reconnected (see _recover)."""
        try:
            return self._step()
        finally:
            self._publish_queues()

    def _step(self) -> list[Sequence]:
        # The step before, for a decode batch that continues it (_launch);
        # any step that launches nothing (a lost session, a failure) forgets it.
        previous_launch, self._last_launched = self._last_launched, None
        if not self.manager.healthy:
            done = self._finish_in_flight()
            self._recover()
            return done + self._take_failed()
        if self._keeps_sink and not self._sink:
            try:
                self._make_sink()
            except vtm.OutOfMemory as exc:
                # The broker is back, but its other clients hold the pool:
                # requests wait for their memory (memory_wait_s), not for
                # the broker (which would fail them as unavailable).
                self._unhealthy_since = None
                self.scheduler.wait_for_memory(exc)
                time.sleep(max(MEMORY_RETRY_S, self.scheduler.retry_at - time.perf_counter()))
                return self._finish_in_flight() + self._take_failed()
            except vtm.Error as exc:  # lost again
                self._memory_not_back(exc)
                time.sleep(RECONNECT_TRY_S)  # one try per RECONNECT_TRY_S: the loop does not spin
                return self._finish_in_flight() + self._take_failed()
        self._unhealthy_since = None
        # Sequences the scheduler failed (one that can never fit in memory).
        failed = self._take_failed()
        try:
            plan = self.scheduler.schedule()
        except vtm.Unavailable as exc:
            done = self._finish_in_flight()
            self._lose_memory(str(exc))
            return failed + done + self._take_failed()
        except Exception as exc:
            log.exception("scheduling failed; failing every queued request")
            failed += list(self.scheduler.running) + list(self.scheduler.waiting)
            for seq in failed:
                self.abort(seq, "error", _engine_error("scheduling failed", exc))
            self._finish_in_flight()
            return failed
        failed += self._take_failed()
        if not self.manager.healthy:
            # The session went away while planning, and a failed wait for
            # vtm there unmapped its chunks (a broker client revokes on this
            # thread): the model must not read them.
            done = self._finish_in_flight()
            self._lose_memory("the vtm broker went away while a step was planned")
            return failed + done + self._take_failed()
        launched = launch_error = None
        if plan:
            try:
                launched = self._launch(plan, previous_launch)
            except Exception as exc:
                log.exception("a step failed; failing its %d requests", len(plan))
                launch_error = exc
        # The launched step is in flight before the one before it is read:
        # should reading raise, it is still there to be read.
        previous, self._in_flight = self._in_flight, launched
        self._last_launched = launched
        done = [] if previous is None else self._resolve(previous)
        if launch_error is not None:
            # After the step in flight (overlap) is read: a request whose
            # token there ended it (a stop id) ends as without overlap, and
            # the failed step fails only the others.
            broken = [seq for seq, _ in plan if seq.status is not Status.FINISHED]
            for seq in broken:
                self.abort(seq, "error", _engine_error("the model step failed", launch_error))
            try:
                self.scheduler.settle_steps()  # their memory back now, not when the next step is read
            except Exception:  # noqa: BLE001 - a device that fails here fails the next step too
                log.exception("waiting for the device after a failed step failed")
            failed += broken
        # Read at once: without overlap; tokens the host chose already;
        # nothing but discarded tokens (the last requests stopped).
        if launched is not None and (not self.overlap or (launched.seqs and (launched.chosen_on_host or all(
                seq.status is Status.FINISHED for seq in launched.seqs)))):
            done += self._finish_in_flight()
        if not plan and not self.scheduler.running:
            # The queue waits for memory a shared pool's other users hold:
            # the next try comes at retry_at, and the loop does not spin.
            # After the step before was read: its tokens are not held back.
            time.sleep(max(0.0, self.scheduler.retry_at - time.perf_counter()))
        return failed + done

    def _take_failed(self) -> list[Sequence]:
        failed, self.scheduler.failed = self.scheduler.failed, []
        return failed

    def _recover(self) -> None:
        """The vtm broker went away (this engine's session, and its vTensors,
        with it). Try for a new session, waiting briefly; this thread is the
        one that computes on the memory, so it is the one to reconnect. While
        there is none, requests wait, up to broker_wait_s of the broker's
        absence; then everything queued fails with vtm.Unavailable."""
        if self._unhealthy_since is None:
            # Said once an outage, running or idle, in one line: an operator
            # reading the log sees it begin, and end (reconnected, below) or
            # fail requests.
            resumed = self.scheduler.lose_memory()
            log.warning("the vtm broker is unavailable: reconnecting; requests wait up to %g s (broker_wait_s)%s",
                        self.broker_wait_s,
                        f"; {resumed} running requests will resume by recompute" if resumed else "")
            self._sink = []
        started = time.monotonic()
        try:
            self.manager.reconnect(timeout=RECONNECT_TRY_S)
        except vtm.Error as exc:
            if isinstance(exc, vtm.FailedPrecondition):  # closed, or a broker its reservations do not fit
                self._unhealthy_since = self._unhealthy_since or started
                self.scheduler.fail_waiting(vtm.Unavailable(f"the vtm broker cannot take this engine back now: {exc}"))
            else:  # no broker yet, or it cannot take this client back yet
                self._memory_not_back(exc)
            # One try per RECONNECT_TRY_S at most, however fast it failed: the loop does not spin.
            time.sleep(max(0.0, started + RECONNECT_TRY_S - time.monotonic()))
            return
        log.info("reconnected to the vtm broker; %d requests resume", len(self.scheduler.waiting))
        self._budget = (self.manager.limit_bytes, self._kv_budget())  # the new session may have another limit

    def _lose_memory(self, why: str) -> None:
        """The session is gone (`why`): the running requests go back to the
        queue, and the log says so once."""
        resumed = self.scheduler.lose_memory()
        if resumed:
            log.warning("%s: %d running requests will resume by recompute", why, resumed)

    def _memory_not_back(self, exc: Exception) -> None:
        """Requests wait for the memory to come back, up to broker_wait_s
        from the first step that found it gone; then everything queued fails."""
        now = time.monotonic()
        self._unhealthy_since = self._unhealthy_since or now
        if now - self._unhealthy_since >= self.broker_wait_s:
            if self.scheduler.waiting:
                log.warning("the vtm broker is still unavailable after %g s: failing %d queued requests",
                            self.broker_wait_s, len(self.scheduler.waiting))
            # `exc` is the last try's own failure, with the try's short wait
            # in it: said as such, not as the reason for broker_wait_s.
            self.scheduler.fail_waiting(vtm.Unavailable(f"the vtm broker is still unavailable after "
                                                        f"{self.broker_wait_s:g} s; the last try to reconnect: "
                                                        f"{exc}"))

    def _make_sink(self) -> None:
        """The sink in a new session, and new CUDA graphs where it is not
        where they write their padding rows."""
        self._sink = self.kv_cache.create(1, release=self.scheduler.release)
        if self.graphs is not None and self.graphs.sink_slots != [vt.slot for vt in self._sink]:
            from flexinfer.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.model, self.kv_cache, self.attention, self.graphs.buckets[-1],
                                       [vt.slot for vt in self._sink])

    def _launch(self, plan: list[tuple[Sequence, int]], previous: "_Step | None") -> "_Step":
        """Queue the forward pass of `plan` and the choice of its tokens on
        the device; the tokens become pending in their sequences. `previous`:
        the step launched by the engine's step() call before this one, if it
        launched one."""
        finished = self.scheduler.num_finished
        lists = self._plan_lists
        if lists is not None and lists[0] is plan:  # a steady plan, returned again (Scheduler)
            _, seqs, counts, slots, decode_batch = lists
        else:
            seqs = [seq for seq, _ in plan]
            counts = [n for _, n in plan]
            slots = [seq.slots for seq in seqs]
            decode_batch = len(plan) if counts.count(1) == len(counts) else None
            self._plan_lists = (plan, seqs, counts, slots, decode_batch)
        # The sequences the step before sampled decode on, one token each:
        # all of them end this step with a token to sample.
        continuing = decode_batch is not None and previous is not None and previous.seqs == seqs
        # The sequences whose sampled token this step makes pending.
        pending: list[Sequence] = []
        if continuing:
            if previous.chosen_on_host:
                input_ids = self._input_ids(seqs, [seq.num_cached for seq in seqs], counts)
            else:
                # Each one's input is the token the step before chose at its
                # row, as it lies on the device (pending, or read already).
                input_ids = previous.next_inputs()
            # Each one's token is computed by this step and the next one
            # sampled, in the scheduler's one pass over them. Done before
            # the forward pass, which evicts the sequences from the CPU's
            # caches: after it, a pass cost ~0.2 µs a sequence more at batch 256.
            number, starts = self.scheduler.launched_decode(seqs)
            pending = seqs
        else:
            starts = [seq.num_cached for seq in seqs]
            input_ids = self._input_ids(seqs, starts, counts)
            number = self.scheduler.launched(seqs)
        try:
            if self.thread_tuner is not None:
                self.thread_tuner.before_step(decode_batch)
            started = time.perf_counter()
            batch = None
            if self.graphs is not None and decode_batch and self.graphs.bucket_for(decode_batch):
                logits = self.graphs.run(input_ids, slots, starts)
            else:
                # A continuing step's vectors are the step before's, one row
                # further: packing them costs ~30 ns an int (~120 µs a step
                # at batch 256), and on CUDA a copy.
                batch = (previous.batch.advanced(starts) if continuing and previous.batch is not None
                         else ForwardBatch.build(slots, starts, counts, self.device))
                logits = self.model.forward(input_ids, batch, self.kv_cache, self.attention)
            if self.thread_tuner is not None:
                self.thread_tuner.after_step(decode_batch, time.perf_counter() - started)
            if continuing:
                ready_rows, ready, prefilled = None, seqs, ()
            else:
                ready_rows, ready, prefilled = [], [], []
                pending = ready
                for row, (seq, n) in enumerate(plan):
                    seq.num_cached += n
                    if seq.num_cached == seq.num_tokens:  # not in the middle of a chunked prompt
                        ready_rows.append(row)
                        ready.append(seq)
                        seq.add_pending(len(ready) - 1)
                        if not seq.prompt_recorded:
                            prefilled.append(seq)
            step = _Step(number, ready, finished)
            if decode_batch is not None and len(ready) == len(plan):
                step.batch = batch  # one row per sequence of step.seqs, in order
            if ready:
                rows = logits if len(ready) == len(plan) else logits.index_select(
                    0, self._to_device(long_tensor(ready_rows)))
                self._sample(rows, step)
            if self.device.type == "cuda":
                step.done = torch.cuda.Event()
                step.done.record()
            # Recorded once their first token is sampled: a step interrupted
            # in sampling, its slowest part after the forward pass, computes
            # their last row again, which must not be in the prefix tree by then.
            for seq in prefilled:
                self.scheduler.after_prefill(seq)
        except BaseException:
            # A step that raises, or is interrupted (KeyboardInterrupt in a
            # caller that drives step() itself and goes on), leaves none of
            # its tokens pending: the row that sampled each is computed again
            # by the next step (the other rows of a prompt chunk stay computed).
            for seq in pending:
                seq.discard_pending()
                seq.num_cached -= 1
            self._sampled_batch = None  # its step count now counts a step that added no token
            raise
        return step

    def _input_ids(self, seqs: list[Sequence], starts: list[int], counts: list[int]) -> torch.Tensor:
        """The step's input ids on the device: each sequence's tokens from
        its start. A pending token (a sequence's only token in this step, at
        its num_cached) is read from the device, where the step in flight
        chose it."""
        ids, fed = [], []
        for seq, start, n in zip(seqs, starts, counts):
            if seq.pending:
                fed.append((len(ids), seq.feed_row))
                ids.append(0)
            elif n == 1:
                ids.append(seq.token_at(start))
            else:
                ids.extend(seq.tokens_between(start, start + n))
        if not fed:
            return self._to_device(long_tensor(ids))
        feed = self._in_flight.next_inputs()
        n, k = len(ids), len(fed)
        packed = self._to_device(long_tensor(ids + [p for p, _ in fed] + [r for _, r in fed]))
        input_ids = packed[:n]
        input_ids.index_copy_(0, packed[n:n + k], feed.index_select(0, packed[n + k:]))
        return input_ids

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the engine's device without waiting for the
        device: a copy from pageable memory would wait for the queued steps."""
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _resolve(self, step: "_Step") -> list[Sequence]:
        """Read a launched step's tokens (waiting for the device if it has
        not finished), then deliver them: stop checks, outputs, releases."""
        # Host sampling reports a row's failure as its exception instead of a token.
        may_fail = step.chosen_on_host
        try:
            if step.done is not None:
                step.done.synchronize()
            tokens = step.tokens if step.chosen_on_host else step.tokens.tolist()
        except Exception as exc:  # noqa: BLE001 - the step failed on the device: its requests fail
            log.exception("reading a step's tokens failed; failing its %d requests", len(step.seqs))
            tokens, may_fail = [exc] * len(step.seqs), True
        self.scheduler.completed(step.number)
        suspect = may_fail or NON_FINITE in tokens  # a failed row, looked for once per step in C
        quiet = step.quiet_stops
        if (quiet is not None and not suspect and step.finished == self.scheduler.num_finished
                and (not quiet or quiet.isdisjoint(tokens))):
            # A quiet step (see _SampledBatch): none of its sequences
            # finished since its launch, and no token is a stop id or at a
            # length the stop checks start from (a sequence preempted since
            # takes its token all the same). Each token is only appended: at batch 256,
            # per-sequence status reads, calls and checks cost ~0.4 µs a
            # sequence, a third of a decode step's host work.
            for seq, token in zip(step.seqs, tokens):
                seq.pending -= 1
                seq.output_ids.append(token)
            return list(step.seqs)
        now = time.perf_counter()
        changed = []
        # Once per sequence per step: the common token costs resolve_pending
        # alone. (Status.FINISHED is read once: an enum member costs ~60 ns a
        # read.)
        finished = Status.FINISHED
        for seq, token in zip(step.seqs, tokens):
            if seq.status is finished:  # cancelled, or stopped at the token before
                seq.discard_pending()
                continue
            changed.append(seq)
            if suspect and self._row_failed(seq, token):
                continue
            if not seq.resolve_pending(token, now):
                continue
            try:
                reason = self._stop_reason(seq, token)
            except Exception as exc:  # noqa: BLE001 - a bug: this request fails alone
                log.exception("checking a request's stop conditions failed")
                self.abort(seq, "error", _engine_error("checking the stop conditions failed", exc))
                continue
            if reason is not None:
                seq.metrics.finish_s = now
                self.scheduler.finish(seq, reason)
        return changed

    def _row_failed(self, seq: Sequence, token) -> bool:
        """Fail `seq` if its row of a step has no token: sampling raised
        (host sampling reports it in the row), or the logits were not finite."""
        if isinstance(token, Exception):
            seq.discard_pending()
            self.abort(seq, "error", _engine_error("sampling failed", token))
            return True
        if token == NON_FINITE:
            seq.discard_pending()
            self.abort(seq, "error", EngineError("the model produced NaN or infinite logits for this request"))
            return True
        return False

    def _finish_in_flight(self) -> list[Sequence]:
        step, self._in_flight = self._in_flight, None
        return [] if step is None else self._resolve(step)

    def _wait_for_device(self) -> None:
        """Every launched step has completed (the scheduler needs memory they use)."""
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _sample(self, rows: torch.Tensor, step: "_Step") -> None:
        """One token per row, for each of step.seqs: step.tokens and
        step.feed. Rows are chosen where the logits are (greedy ones always,
        sampled ones on a sampling device): tokens a host tensor the device
        fills, feed the choice as the next step's input ids on the device
        (see greedy_tokens: None on a CPU). Otherwise the host chooses
        (tokens a list, feed None). What sampling and reading the tokens
        need of the batch's sequences is gathered once per batch
        (_SampledBatch), not per step; step.quiet_stops says whether the
        step is quiet."""
        ready = step.seqs
        facts = self._sampled_batch
        if facts is None or facts.seqs != ready:
            facts = self._sampled_batch = _SampledBatch(ready)
        if facts.quiet_from <= facts.steps < facts.quiet_until:
            step.quiet_stops = facts.stop_ids
        facts.steps += 1
        # Before min_tokens, no token may end the sequence. Pending tokens
        # count, this step's last among them: the token sampled now is the
        # (len(output_ids) + pending)-th.
        banned = None
        if facts.may_ban:
            banned = [s.banned_ids if s.banned_ids and len(s.output_ids) + s.pending <= s.params.min_tokens
                      else None for s in ready]
            if not any(banned):
                banned = None
        if facts.greedy and banned is None:
            choice, step.feed = greedy_tokens(rows)
        elif self.sampling_device is not None:
            if facts.sampler is None:
                facts.sampler = self._batch_sampler(facts)
            choice, step.feed = facts.sampler(rows, banned, facts.steps - 1)
        else:
            # Greedy rows are chosen where the logits are; only sampled ones come to the host.
            if not facts.greedy:
                rows = rows.cpu()
            step.tokens = sample(rows, facts.params, facts.generators, banned)
            return
        if choice.device.type == "cpu":
            step.tokens = choice
            return
        step.tokens = torch.empty(choice.shape, dtype=choice.dtype, pin_memory=True)
        step.tokens.copy_(choice, non_blocking=True)

    def _batch_sampler(self, facts: "_SampledBatch") -> BatchSampler:
        """The sampling device's sampler for a batch of sequences."""
        if self._shared_generator is None:
            self._shared_generator = torch.Generator(self.sampling_device)
            self._shared_generator.seed()
        return BatchSampler(facts.params, facts.seeds, self._shared_generator, self.sampling_device, facts.drawn)

    # -- helpers --------------------------------------------------------

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        output_tokens = len(seq.output_ids)
        may_stop = output_tokens >= seq.params.min_tokens
        if may_stop and token in seq.stop_ids:
            return "stop"
        if seq.params.stop and may_stop:
            # Decode only what the new tokens add, and look for a stop string
            # only where one can end: in the new text, or begun in the last
            # longest-1 characters before it (the only text `seq.text` keeps).
            # Constant cost per step, however long the output.
            # Nothing is decoded before the first look, which (offsets at 0)
            # decodes the whole text so far: `window` starts at the output's
            # start then, so stops_from() counts in it as in final_text.
            # The text of a token that ends inside a character, held back
            # until a later token completes it, is looked in too (`held`,
            # not kept): otherwise a stop string it completes went unseen
            # (the request ran on, and ended "length" at max_tokens).
            new_text, seq.prefix_offset, seq.read_offset = self.tokenizer.decode_incremental(
                seq.output_ids, seq.prefix_offset, seq.read_offset)
            held = held_text(self.tokenizer, seq.output_ids, seq.prefix_offset, seq.read_offset)
            if new_text or held:
                if seq.stops_from is None:
                    seq.stops_from = stops_from(self.tokenizer, seq.output_ids, seq.params.min_tokens)
                window = seq.text + new_text
                if any((window + held).find(s, max(0, seq.stops_from - len(s) + 1)) >= 0 for s in seq.params.stop):
                    return "stop"
                keep = max(map(len, seq.params.stop)) - 1
                seq.text = window[-keep:] if keep else ""
                seq.stops_from = max(0, seq.stops_from - (len(window) - len(seq.text)))
        if output_tokens >= seq.params.max_tokens:
            return "length"
        return None


class _Step:
    """A launched step: `seqs[i]` sampled `tokens[i]`. `tokens` is a list
    when the host chose them (`chosen_on_host`), else a host tensor the
    device fills, complete once `done` (a CUDA event; None on a CPU) has
    completed; `next_inputs()` gives the device's choices as the next step's
    input ids. `number` is the step's in the scheduler (its sequences'
    vTensors are released only after it completes), `finished` the
    scheduler's num_finished when it was launched. `quiet_stops`: for a
    quiet step (see _SampledBatch), the stop ids of its sequences; None
    otherwise. `batch`: the vectors of its forward pass, when that decoded
    one token for each of `seqs` and nothing else (None otherwise, or when
    a CUDA graph ran it): a decode step that continues it advances them."""

    __slots__ = ("number", "seqs", "finished", "tokens", "feed", "done", "quiet_stops", "batch")

    def __init__(self, number: int, seqs: list[Sequence], finished: int):
        self.number = number
        self.seqs = seqs
        self.finished = finished
        self.tokens: list | torch.Tensor = []
        self.feed: torch.Tensor | None = None
        self.done = None
        self.quiet_stops: frozenset[int] | None = None
        self.batch: ForwardBatch | None = None

    @property
    def chosen_on_host(self) -> bool:
        return isinstance(self.tokens, list)

    def next_inputs(self) -> torch.Tensor:
        if self.feed is None:  # chosen on a CPU: NON_FINITE must not reach the embedding
            self.feed = self.tokens.clamp(min=0)
        return self.feed


class _SampledBatch:
    """What sampling, and reading the tokens sampled, need of a batch's
    sequences, gathered once while the batch stays the same sequences in
    the same order (decode steps, mostly): their parameters and generators
    never change.

    A step is quiet when no sequence's token is its first (whose time is
    its TTFT) or at a length from which its stop checks run
    (Sequence.checks_from): reading its tokens then checks, for the whole
    batch at once, that none is one of `stop_ids` (the union of its
    sequences'), and appends them. Of the steps sampled for this batch,
    numbered from 0 (`steps` counts them), those from `quiet_from` to
    before `quiet_until` are. Step k gives each sequence its (count + k)-th
    token, count its tokens and pending ones before step 0: every step adds
    one pending token to each, read in order, unless the sequence ends
    (the batch's next step then has other sequences, other facts) or the
    step fails (_launch then forgets these facts)."""

    def __init__(self, seqs: list[Sequence]):
        self.seqs = seqs
        self.params: list[SamplingParams] = [s.params for s in seqs]
        self.generators = [s.generator for s in seqs]
        # BatchSampler's: each sampled row's seed (seed + sample_index; None
        # unseeded), and the tokens it had drawn before step 0.
        self.seeds = [None if s.params.greedy or s.params.seed is None else s.params.seed + s.sample_index
                      for s in seqs]
        # Every row greedy: one argmax over the batch, where the logits are.
        self.greedy = all(p.greedy for p in self.params)
        # Some row may have stop ids to ban (those of rows below min_tokens).
        self.may_ban = any(s.banned_ids for s in seqs)
        # The batch's BatchSampler on the sampling device, made at its first use.
        self.sampler: BatchSampler | None = None
        # Step 0's token is each sequence's (len(output_ids) + pending)-th.
        counts = [len(s.output_ids) + s.pending for s in seqs]
        self.drawn = [c - 1 for c in counts]
        self.steps = 0
        self.quiet_from = max(0, 2 - min(counts, default=0))
        self.quiet_until = min((s.checks_from - count for s, count in zip(seqs, counts)), default=0)
        self.stop_ids = frozenset().union(*(s.stop_ids for s in seqs))


def _weak_call(method):
    """A callback that does not keep its object alive (the scheduler's
    wait_for_device, which would make a cycle with its engine); None once
    the object is gone."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        target = ref()
        return None if target is None else target(*args)
    return call


def prefix_namespace(fingerprint: str, dtype: str, salt: str | None) -> str:
    """The prefix-tree namespace of an engine's KV: the model's fingerprint
    (its weights and forward config) and the KV dtype, plus the caller's salt
    (engines that must not share prefixes, such as tenants, pass different
    ones). The KV cache appends each layer group's layer range, and vtm
    refuses a space whose row size disagrees with its namespace's: together
    they name what the bytes mean, so engines with other weights, dtype or
    layout never map each other's KV as their own (issue 17, finding 14)."""
    return f"flexinfer:{fingerprint}:{dtype}" + (f":{salt}" if salt else "")


def _cuda_index(device, backend: str) -> int:
    """The CUDA device index an engine on `device` computes on: the one it
    names, else torch's current device (an index-less "cuda", or no device
    with a backend that may be cuda); 0 where no CUDA device is involved."""
    device = None if device is None else torch.device(device)
    if backend == "host" or (device is not None and device.type != "cuda"):
        return 0
    if device is not None and device.index is not None:
        return device.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def _engine_error(what: str, exc: Exception) -> Exception:
    """Errors a caller can act on (no memory, a dead broker) keep their type."""
    if isinstance(exc, (vtm.OutOfMemory, vtm.Unavailable, InvalidArgument)):
        return exc
    error = EngineError(f"{what}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error
