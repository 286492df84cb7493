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
`max_interval`, so an idle machine probes rarely; without a monitor (below)
a smaller count keeps the base interval, since only a probe can see the
competing load leave. A change of load must not wait that long: when
`slow_steps` decode steps in a row of the probe's batch size take over
`slowdown` times the winner's probe median, the tuner probes at once. Prefill steps are not timed
(their cost depends on prompt lengths) and do not advance the schedule.

What step times cannot show, the neighbours' CPU time can. At a reduced
count a step costs the same whether or not the neighbour is still there (it
never shared our remaining cores), so a periodic probe was the only way to
see it leave: up to `interval` steps, seconds at ~60 % speed. With a
`NeighbourLoad` monitor (the engine passes one where /proc/stat is readable)
the tuner reads, every window of wall time, how many cores other processes
kept busy; a change of `LOAD_CHANGE` cores or more since the window after the
last probe, in two windows in a row (one noisy window is not a neighbour),
starts a probe at once, in either direction. The periodic probes
then back off at any count while the winner repeats (a probe decides on a
few noisy steps, so a neighbour's presence is re-checked, less and less
often), and a quiet machine at the full count is probed only every
`max_interval` steps, as a safety net. A monitor that fails to read is
dropped, and the tuner goes back to periodic probes: a measurement must never
fail a step.

Invariant: `torch.get_num_threads()` equals `current` whenever the engine
runs a step (the setting is process-wide, so each step re-asserts it). The
count torch had when no tuner was open is every tuner's default maximum and
is restored on `close()`: a second engine in a process must not take the
first one's current (perhaps reduced) setting for the machine's.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import torch

# A change of neighbour load that starts a probe, in cores. Measured on the
# 2-core Xeon VM over 0.3 s windows: alone 0.00 +- 0.04; beside one busy loop
# 0.61-0.77 while we run two threads (it gets a share of our second core) and
# 0.99-1.01 while we run one.
LOAD_CHANGE = 0.4


class ThreadTuner:
    def __init__(self, max_threads: int | None = None, adaptive: bool = True, probe_steps: int = 2,
                 interval: int = 128, max_interval: int = 2048, slowdown: float = 1.5, slow_steps: int = 3,
                 monitor: "NeighbourLoad | None" = None):
        self.saved = _machine_threads()
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
        self.monitor = monitor if len(self.candidates) > 1 else None
        self._load_reference = None  # neighbour cores in the first window after the last probe
        self._load_changed = 0  # windows in a row that differ from it by LOAD_CHANGE or more
        torch.set_num_threads(self.current)  # may refuse the count: then nothing is counted as open
        _open_tuner(self.saved)
        self._closed = False

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
            if self.monitor is not None and self._until_probe > 0:
                self._read_monitor()
            return
        self._samples[self._probe.pop(0)].append(seconds)
        if self._probe:
            return
        medians = {c: statistics.median(self._samples[c]) for c in self.candidates}
        best = min(self.candidates, key=medians.__getitem__)
        # Back off while the winner repeats. Without a monitor, only at the
        # full count: below it only a probe can see the load that made fewer
        # threads faster leave; the monitor sees that without probing.
        repeated = bool(self.choices) and self.choices[-1] == best
        backs_off = repeated and (self.monitor is not None or best == self.candidates[0])
        self.interval = min(self.max_interval, self.interval * 2) if backs_off else self.base_interval
        if self.monitor is not None:
            self._load_reference, self._load_changed = None, 0
            try:
                self.monitor.restart()  # the probe's window mixed thread counts
            except (OSError, ValueError):
                self._drop_monitor()
        self.choices.append(best)
        self._reference = (self._probe_batch, medians[best])
        self._until_probe = self.interval
        self._set(best)

    def _read_monitor(self) -> None:
        try:
            load = self.monitor.poll()
        except (OSError, ValueError):
            self._drop_monitor()
            return
        if load is None:
            return
        if self._load_reference is None:
            self._load_reference = load
            if load < LOAD_CHANGE and self.current == self.candidates[0]:
                # A quiet machine at the full count: nothing for a probe to
                # find until the monitor sees a neighbour arrive.
                self.interval = self._until_probe = self.max_interval
            return
        changed = abs(load - self._load_reference) >= LOAD_CHANGE  # a neighbour came or left
        self._load_changed = self._load_changed + 1 if changed else 0
        if self._load_changed >= 2:
            self._until_probe = 0

    def _drop_monitor(self) -> None:
        """Periodic probes from here on, as without a monitor."""
        self.monitor = None
        self.interval = self.base_interval
        self._until_probe = min(self._until_probe, self.interval)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _close_tuner()
            torch.set_num_threads(self.saved)

    def _set(self, count: int) -> None:
        if count != self.current:
            torch.set_num_threads(count)
            self.current = count


_tuners_lock = threading.Lock()
_open_tuners = 0
_outside_threads = 0  # torch's count when the first open tuner was made


def _machine_threads() -> int:
    """Torch's thread count from before any open tuner changed it."""
    with _tuners_lock:
        return _outside_threads if _open_tuners else torch.get_num_threads()


def _open_tuner(machine_threads: int) -> None:
    global _open_tuners, _outside_threads
    with _tuners_lock:
        if _open_tuners == 0:
            _outside_threads = machine_threads
        _open_tuners += 1


def _close_tuner() -> None:
    global _open_tuners
    with _tuners_lock:
        _open_tuners -= 1


class NeighbourLoad:
    """How many cores other processes keep busy: the busy time /proc/stat
    counts on the CPUs this process may run on, less this process's own CPU
    time, per second of wall time over a window.

    Why this and not the load average: it answers within a window (0.3 s by
    default) instead of a minute, and subtracts our own threads, including
    OpenMP's spinning ones, which the load average cannot tell apart. Steal
    and I/O wait are not counted as busy: they are not a neighbour on our
    cores. Another engine in this process counts as ours; its arrival shows
    in step times instead.

    Which CPUs: the union of every thread's affinity when the monitor is
    made, not the calling thread's alone, since OMP_PROC_BIND pins an OpenMP
    thread to one CPU and a neighbour on the others would read as none. A
    container pinned to a cpuset sees only its own cores' neighbours. Where
    /proc/stat does not list every one of those CPUs (lxcfs renumbers them
    inside a container) the numbers cannot be matched: no monitor.

    A window in which the engine paused for over `max_gap_s` between two
    polls (idle between requests, a long prompt) is dropped: a neighbour's
    threads spread over the cores we left idle, which says nothing about
    the cores we use while we run."""

    def __init__(self, window_s: float = 0.3, max_gap_s: float = 1.0, stat_path: str = "/proc/stat"):
        self.window_s, self.max_gap_s, self.stat_path = window_s, max_gap_s, stat_path
        self._ticks_per_s = os.sysconf("SC_CLK_TCK")
        self.cpus = _process_cpus()
        listed = self._listed_cpus()
        if not self.cpus or not self.cpus <= listed:
            raise ValueError(f"{stat_path} lists CPUs {sorted(listed)}, not all of this process's "
                             f"{sorted(self.cpus)}")
        self.restart()

    @classmethod
    def open(cls, **kwargs) -> "NeighbourLoad | None":
        """A monitor, or None where /proc/stat or the affinity cannot be read
        or matched (not Linux, an lxcfs container): the tuner then keeps
        probing periodically."""
        try:
            return cls(**kwargs)
        except (OSError, ValueError, AttributeError):
            return None

    def restart(self) -> None:
        self._start = (time.perf_counter(), self._busy_s(), time.process_time())
        self._last_poll = self._start[0]

    def poll(self) -> float | None:
        """The neighbours' cores over the window just ended, or None while
        it runs (one clock read: cheap enough for every step). Raises
        OSError where /proc/stat stops being readable."""
        wall = time.perf_counter()
        if wall - self._last_poll > self.max_gap_s:
            self.restart()
            return None
        self._last_poll = wall
        elapsed = wall - self._start[0]
        if elapsed < self.window_s:
            return None
        busy, own = self._busy_s(), time.process_time()
        load = ((busy - self._start[1]) - (own - self._start[2])) / elapsed
        self._start = (wall, busy, own)
        return max(0.0, load)

    def _lines(self):
        """(cpu number, fields) of each per-CPU line of /proc/stat."""
        with open(self.stat_path) as f:
            for line in f:
                if not line.startswith("cpu"):
                    break
                name, *fields = line.split()
                if name != "cpu":
                    yield int(name[3:]), fields

    def _listed_cpus(self) -> set[int]:
        return {cpu for cpu, _ in self._lines()}

    def _busy_s(self) -> float:
        ticks = 0
        for cpu, fields in self._lines():
            if cpu in self.cpus:
                # user nice system idle iowait irq softirq steal ...: busy is user, nice, system, irq, softirq.
                user, nice, system, _idle, _iowait, irq, softirq = map(int, fields[:7])
                ticks += user + nice + system + irq + softirq
        return ticks / self._ticks_per_s


def _process_cpus() -> set[int]:
    """The CPUs any thread of this process may run on."""
    cpus = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            cpus |= os.sched_getaffinity(int(tid))
        except (ProcessLookupError, PermissionError):  # the thread ended meanwhile
            continue
    return cpus


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
