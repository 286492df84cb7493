"""What the benchmark scripts share: the machine they ran on, and how they time a call."""

from __future__ import annotations

import platform
import statistics
import time


def cpu_model() -> str:
    """The CPU's model name (every benchmark number is reported next to it)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def median_per_call_s(fn, repeats: int, calls: int = 1, warmup: int = 1) -> float:
    """Seconds per call of fn: the median over `repeats` samples, each timing
    `calls` back-to-back calls, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)
