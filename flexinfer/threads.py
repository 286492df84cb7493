"""The CPU compute thread count, chosen by measuring decode steps while serving.

Why measure: torch runs every op on an OpenMP team that ends each parallel
region at a barrier. On an idle machine all cores help. When another busy
process shares the cores, one team thread is descheduled for whole time slices
and every barrier waits for it: on a 2-core machine with one busy loop, two
threads kept 16 % of their idle throughput where one thread kept 64 %. No
static setting is right in both cases, and the load changes while a server
runs, so the engine keeps measuring.

How: decode steps of one batch size cost about the same, so the tuner times
them. Every `interval` decode steps it probes: each candidate count runs
`probe_steps` steps, candidates interleaved, and the count with the lowest
median time per step wins until the next probe. A probe costs a few steps on
a worse setting: 2 of every 128 or more with the defaults (with 3 per
candidate every 64 steps, auto ran 3-6 % below a fixed count on an idle
machine). When all cores win again the interval doubles, up to
`max_interval`, so an idle machine probes rarely; a smaller count keeps the
base interval, since only a probe can see the competing load leave. A change of load must not wait that long: when `slow_steps` decode
steps in a row of the probe's batch size take over `slowdown` times the
winner's probe median, the tuner probes at once. Prefill steps are not timed
(their cost depends on prompt lengths) and do not advance the schedule.

Invariant: `torch.get_num_threads()` equals `current` whenever the engine
runs a step (the setting is process-wide, so each step re-asserts it), and
the thread count found at construction is restored on `close()`.
"""

from __future__ import annotations

import statistics

import torch


class ThreadTuner:
    def __init__(self, max_threads: int | None = None, adaptive: bool = True, probe_steps: int = 2,
                 interval: int = 128, max_interval: int = 2048, slowdown: float = 1.5, slow_steps: int = 3):
        self.saved = torch.get_num_threads()
        top = max_threads or self.saved
        # All cores, and fewer: halving down to one covers a busy neighbour on any core count.
        self.candidates = [top]
        if adaptive:
            self.candidates = sorted({top} | {max(1, top >> i) for i in range(1, top.bit_length())}, reverse=True)
        self.current = top
        self.probe_steps = probe_steps
        self.base_interval = self.interval = interval
        self.max_interval = max_interval
        self._until_probe = 0  # probe on the first decode steps
        self._probe: list[int] = []  # counts still to run in this probe, in order
        self._samples: dict[int, list[float]] = {}
        self._probe_batch = None
        self.slowdown, self.slow_steps = slowdown, slow_steps
        self._reference = None  # (batch size, median seconds) of the last winner
        self._slow = 0
        self.choices: list[int] = []  # the winner of each probe, for tests and stats
        torch.set_num_threads(self.current)

    def before_step(self, decode_batch: int | None) -> None:
        """Sets the thread count for the coming step (`decode_batch`: its
        size for a decode step, None for a step with prompt tokens)."""
        if torch.get_num_threads() != self.current:  # another engine in this process changed it
            torch.set_num_threads(self.current)
        if decode_batch is None or len(self.candidates) == 1:
            return
        if not self._probe and self._until_probe <= 0:
            self._probe = [c for _ in range(self.probe_steps) for c in self.candidates]
            self._samples = {c: [] for c in self.candidates}
            self._probe_batch = decode_batch
        if self._probe:
            if decode_batch != self._probe_batch:  # not comparable: start over at this size
                self._probe = [c for _ in range(self.probe_steps) for c in self.candidates]
                self._samples = {c: [] for c in self.candidates}
                self._probe_batch = decode_batch
            self._set(self._probe[0])

    def after_step(self, decode_batch: int | None, seconds: float) -> None:
        if decode_batch is None or len(self.candidates) == 1:
            return
        if not self._probe:
            self._until_probe -= 1
            if self._reference and decode_batch == self._reference[0]:
                slow = seconds > self.slowdown * self._reference[1]
                self._slow = self._slow + 1 if slow else 0
                if self._slow >= self.slow_steps:  # the load changed: probe now
                    self._slow = 0
                    self._until_probe = 0
                    self.interval = self.base_interval
            return
        self._samples[self._probe.pop(0)].append(seconds)
        if self._probe:
            return
        medians = {c: statistics.median(self._samples[c]) for c in self.candidates}
        best = min(self.candidates, key=medians.__getitem__)
        # Back off only at the full count: below it, the load that made fewer
        # threads faster may leave, and only a probe can tell.
        stable = bool(self.choices) and self.choices[-1] == best and best == self.candidates[0]
        self.interval = min(self.max_interval, self.interval * 2) if stable else self.base_interval
        self.choices.append(best)
        self._reference = (self._probe_batch, medians[best])
        self._until_probe = self.interval
        self._set(best)

    def close(self) -> None:
        torch.set_num_threads(self.saved)

    def _set(self, count: int) -> None:
        if count != self.current:
            torch.set_num_threads(count)
            self.current = count


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP worker threads (OpenMP 5's
    omp_pause_resource_all, soft). Returns False where the runtime lacks it.

    Why: libgomp counts every pool's threads, and once a process holds more
    of them than it has cores (two threads that each ran a torch op: two
    engines, or an engine beside other torch code) every pool stops spinning
    between parallel regions and sleeps instead; each of a step's hundreds
    of regions then waits for a wake-up, which in a VM costs tens of µs. On
    the 2-core Xeon VM a batch-32 float32 decode ran 12-15 % slower that way.
    So an engine thread frees its pool whenever it goes idle: the next
    request recreates it (once per burst, ~0.1 ms)."""
    global _pause
    if _pause is None:
        _pause = _find_pause()
    return _pause is not False and _pause(1) == 0  # 1: omp_pause_soft


_pause = None


def _find_pause():
    import ctypes

    try:
        # The libgomp torch loaded (and flexinfer._kernels shares): dlopen by
        # soname returns the copy already in the process.
        return ctypes.CDLL("libgomp.so.1").omp_pause_resource_all
    except (OSError, AttributeError):
        return False
