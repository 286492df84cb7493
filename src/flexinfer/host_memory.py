"""Keeping freed host memory in the process, so that a CPU forward pass does
not fault its activations in again every step.

Why: a forward pass allocates activations of a few hundred KiB to tens of MiB
and frees them at its end. glibc's malloc serves requests above its mmap
threshold (128 KiB, raised only as such blocks are freed) with fresh mappings
and returns a heap's free top to the kernel once it exceeds the trim
threshold, so the next pass touches new pages, and each first touch is a page
fault. On a VM the fault is dear (the hypervisor backs the page anew). On
the 2-core Xeon VM (family 6 model 207), idle, a bfloat16 prefill of 32
prompts x 32 tokens on SmolLM2-135M took 0.54-0.64 s with glibc's defaults
and 0.39-0.53 s with the memory kept; with another process busy, and before
the norms and SiLU were fused (more temporaries), 1.3-5.9 s against 0.6 s
(docs/benchmarks.md). So a CPU engine raises the mmap threshold to glibc's
maximum (32 MiB) and stops trimming: what a pass frees stays on malloc's
free lists and the next pass reuses it, as torch's CUDA caching allocator
does for device memory. Threads that start after the setting share the main
arena (M_ARENA_MAX = 1): a thread's own arena grows in 64 MiB heaps and
unmaps a heap as soon as it is empty, whatever the trim threshold, and the
engine computes on a thread of its own. So the setting is applied before the
engine thread starts (EngineLoop) as well as by the Engine.

Cost: the process keeps its peak heap (a step's activations: tens of MiB for
1,024 tokens) instead of returning it between steps. The setting is
process-wide and applied once; set FLEXINFER_KEEP_FREED_MEMORY=0 to leave
malloc as it is. Other C libraries (musl) and allocators preloaded in its
place are left alone.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("flexinfer")

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# The largest mmap threshold glibc accepts on 64-bit (HEAP_MAX_SIZE / 2);
# larger blocks still get mappings of their own.
MMAP_THRESHOLD = 32 << 20
# mallopt's largest value, above any heap top a step leaves free: never trim.
TRIM_THRESHOLD = 2**31 - 1
# Threads started after the setting share the main arena (see above).
ARENA_MAX = 1

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Tunes glibc's malloc as above, once per process. Returns whether the
    process runs with the setting (False: opted out, or not glibc)."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    if os.environ.get("FLEXINFER_KEEP_FREED_MEMORY", "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    if (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1
            or mallopt(_M_ARENA_MAX, ARENA_MAX) != 1):
        log.debug("mallopt refused the settings; host memory is returned to the kernel as usual")
        return False
    return True
