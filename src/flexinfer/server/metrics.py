"""The server's Prometheus metrics, in a registry of its own (two servers in
one process, as in the tests, never share counters).

Two sources. Latencies are histograms observed by the request handlers as
tokens reach them (so they include queueing and detokenisation, what a
client sees minus the network). Engine and memory figures come from
`llm.stats()`, read at each scrape on a thread of their own (never on the
event loop: with a vtm broker it is a call to another process) and kept:
a read that fails or takes longer than the timeout leaves the previous
figures in place, marked by `flexinfer_metrics_stale` and counted in
`flexinfer_metrics_stats_failures_total`, and is never retried while it is
still running. Names follow docs/design.md §7: `flexinfer_` / `vtm_` prefixes,
base units, `_total` on counters.
"""

from __future__ import annotations

import asyncio
import logging
import numbers
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("flexinfer.server")

# Seconds: from a few ms (a cached prefix on a tiny model) to minutes (a long queue on CPU).
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0)

# Per-space figures of vtm's stats()["spaces"], exposed as vtm_space_<key>{space="..."}.
_SPACE_GAUGES = ("vtensors", "slots_free", "max_slots", "used_tokens", "used_bytes", "mapped_bytes",
                 "cached_bytes")


class ServerMetrics:
    """Invariant: every metric lives in `self.registry`; engine figures are
    the last `stats()` that answered (None while no engine is loaded: then
    only the server's own metrics are exposed). `refresh()` before
    `render()` reads them again, waiting at most `timeout_s`."""

    def __init__(self, stats: Callable[[], dict | None], timeout_s: float = 2.0):
        self.registry = CollectorRegistry()
        self.engine = EngineStats(stats, timeout_s)
        self.stats_failures = Counter(
            "flexinfer_metrics_stats_failures", "Scrapes whose engine figures could not be read (reason: timeout "
            "or error, e.g. a stalled or lost vtm broker); those scrapes show the previous figures",
            ["reason"], registry=self.registry)
        self.time_to_first_token = Histogram(
            "flexinfer_time_to_first_token_seconds", "From the request's arrival to its first output token",
            buckets=_TTFT_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram(
            "flexinfer_inter_token_latency_seconds", "Between successive output tokens of one sample",
            buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e_request_latency = Histogram(
            "flexinfer_e2e_request_latency_seconds", "From a request's arrival to its last token (finished requests)",
            buckets=_E2E_BUCKETS, registry=self.registry)
        self.requests = Counter(
            "flexinfer_requests", "Samples ended, by finish reason (stop, length, abort, error)",
            ["finish_reason"], registry=self.registry)
        self.prompt_tokens = Counter("flexinfer_prompt_tokens", "Prompt tokens of admitted requests",
                                     registry=self.registry)
        self.generation_tokens = Counter("flexinfer_generation_tokens", "Output tokens sent",
                                         registry=self.registry)
        self.registry.register(_EngineCollector(self.engine))

    def observe_tokens(self, count: int, first: bool, since_s: float) -> None:
        """`count` new tokens of one sample, `since_s` after its arrival (first) or its previous tokens."""
        if count <= 0:
            return
        self.generation_tokens.inc(count)
        if first:
            self.time_to_first_token.observe(since_s)
            # Tokens that came with the first one came no time after it.
            gaps = [0.0] * (count - 1)
        else:
            gaps = [since_s / count] * count
        for gap in gaps:
            self.inter_token_latency.observe(gap)

    async def refresh(self) -> None:
        failure = await self.engine.refresh()
        if failure is not None:
            self.stats_failures.labels(failure).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def close(self) -> None:
        self.engine.close()


class EngineStats:
    """The engine's figures, read on a thread of their own and cached.

    Invariant: at most one `stats()` call runs at a time, so a stalled one
    is neither waited for longer than the timeout nor piled on; when it
    answers at last, its figures are kept."""

    def __init__(self, stats: Callable[[], dict | None], timeout_s: float):
        self._stats = stats
        self.timeout_s = timeout_s
        self.snapshot: dict | None = None
        self.stale = False  # the last read failed or is late: `snapshot` is older than the last scrape
        self._reading: asyncio.Future | None = None
        self._read_since = 0.0  # time.monotonic() when `_reading` started
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="flexinfer-metrics")

    async def refresh(self) -> str | None:
        """Read the figures again (on the event loop); the failure's kind, or None."""
        try:
            if self._reading is None or self._reading.done():
                self._read_since = time.monotonic()
                self._reading = asyncio.get_running_loop().run_in_executor(self._thread, self._stats)
                self._reading.add_done_callback(self._keep)
            await asyncio.wait_for(asyncio.shield(self._reading), self.timeout_s)
        except asyncio.TimeoutError:
            log.warning("engine metrics not read in %g s: this scrape shows the previous figures", self.timeout_s)
            failure = "timeout"
        except Exception as exc:  # a broker gone away (vtm.Unavailable): still expose the rest
            log.warning("engine metrics not read (%s: %s): this scrape shows the previous figures",
                        type(exc).__name__, exc)
            # A read given up after the timeout is a stall however it ended: the broker
            # client's own deadline (the same timeout) can end it before the wait does.
            late = time.monotonic() - self._read_since >= self.timeout_s
            failure = "timeout" if late else "error"
        else:
            return None
        self.stale = True
        return failure

    def _keep(self, reading: asyncio.Future) -> None:
        if not reading.cancelled() and reading.exception() is None:
            self.snapshot, self.stale = reading.result(), False

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


class _EngineCollector(Collector):
    def __init__(self, engine: EngineStats):
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        yield _gauge("flexinfer_metrics_stale", "1 when the engine figures below are from an earlier scrape "
                     "(the last read of them failed or took too long), else 0", int(self._engine.stale))
        stats = self._engine.snapshot
        if stats is None:
            return
        yield _gauge("flexinfer_num_requests_running", "Sequences in the running batch", stats["running"])
        yield _gauge("flexinfer_num_requests_waiting", "Sequences queued for admission", stats["waiting"])
        yield _counter("flexinfer_num_preemptions", "Sequences preempted to free memory", stats["preemptions"])
        swapped = CounterMetricFamily("flexinfer_swapped_tokens", "With --preemption swap: tokens whose KV "
                                      "preemptions kept (out) and readmissions mapped back (in)",
                                      labels=["direction"])
        swapped.add_metric(["out"], stats["swap_out_tokens"])
        swapped.add_metric(["in"], stats["swap_in_tokens"])
        yield swapped
        yield _counter("flexinfer_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                       stats["prefix_query_tokens"])
        hits = CounterMetricFamily("flexinfer_prefix_cache_hits", "Prompt tokens found in the prefix cache (not "
                                   "recomputed), by where vtm found them: mapped on the device, or copied back "
                                   "from its host tier", labels=["tier"])
        hits.add_metric(["device"], stats["prefix_hit_tokens"] - stats["prefix_hit_tokens_host"])
        hits.add_metric(["host"], stats["prefix_hit_tokens_host"])
        yield hits
        vtm_stats = stats["vtm"]
        yield _gauge("flexinfer_kv_cache_usage_ratio",
                     "Share of the KV memory this server may map that it maps for live requests: the pool's "
                     "capacity, or on a vtm broker its limit (reclaimable cached and prefix-tree chunks not "
                     "counted)", kv_cache_usage(vtm_stats))
        yield from _vtm_metrics(vtm_stats)


def kv_cache_usage(vtm_stats: dict) -> float:
    """Chunks mapped in live slots (mapped minus those mapped only in released
    slots) over the chunks the capacity allows. On a broker (vtm.connect)
    the pool is every client's: this client's mapped bytes over its limit
    (the capacity without one, or where the limit is larger), so that each server of a shared pool
    reports its own use, not the others'."""
    mine = next((c for c in vtm_stats.get("clients", ()) if c["id"] == vtm_stats.get("client_id")), None)
    if mine is not None:
        limit, capacity = mine["limit_bytes"], vtm_stats["capacity_bytes"]
        allowed = min(limit, capacity) if limit else capacity  # a limit above the pool allows the pool
        return mine["mapped_bytes"] / allowed if allowed else 0.0
    capacity_chunks = vtm_stats["capacity_bytes"] // vtm_stats["chunk_bytes"]
    live = vtm_stats["chunks_mapped"] - vtm_stats["chunks_cached"]
    return live / capacity_chunks if capacity_chunks else 0.0


def _vtm_metrics(vtm_stats: dict) -> Iterator[Metric]:
    """Every number of vtm's stats(): `*_total` keys as counters, the rest as gauges."""
    for key, value in vtm_stats.items():
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            continue  # "backend" (a name), "spaces", "ops", a broker's "clients"
        if key.endswith("_total"):
            yield _counter(f"vtm_{key[:-len('_total')]}", f"vtm stats() {key}", value)
        else:
            yield _gauge(f"vtm_{key}", f"vtm stats() {key}", value)
    spaces = vtm_stats.get("spaces", {})
    for key in _SPACE_GAUGES:
        family = GaugeMetricFamily(f"vtm_space_{key}", f"vtm stats() spaces[...][{key!r}]", labels=["space"])
        for name, space in spaces.items():
            if key in space:
                family.add_metric([name], space[key])
        yield family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
