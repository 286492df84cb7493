"""How much memory this machine has: what a command checks the sizes it is
given against (vtmd's --capacity-bytes and --host-tier-bytes, flexinfer's
--kv-capacity-gib and --host-tier-gib), before anything is made. A pool's
chunks and a host tier's are made as they are needed, so a size past the
machine's memory was accepted and failed later (out of memory at whichever
allocation found none, or in the kernel's OOM killer), or never (a pool
that stays small), and said nothing about the size given.

Host memory is the machine's physical RAM (sysconf), not what a cgroup
allows this process: that limit may change while a daemon runs. A CUDA
device's memory is the driver's word (cuDeviceTotalMem, asked through
ctypes: vtmd imports no torch); where there is no driver or no such device
it is unknown, and nothing is checked against it.
"""

from __future__ import annotations

import ctypes
import os

from vtm import cuda_available
from vtm.sizes import format_size

HOST_MEMORY = "this machine's memory"


def host_memory_bytes() -> int:
    """The machine's physical RAM."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cuda_memory_bytes(device: int = 0) -> int | None:
    """CUDA device `device`'s memory (its ordinal among the visible ones), or
    None where it is not known. Needs no context: nothing is allocated."""
    total, handle = ctypes.c_size_t(), ctypes.c_int()
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        if (driver.cuInit(0) != 0 or driver.cuDeviceGet(ctypes.byref(handle), device) != 0
                or driver.cuDeviceTotalMem_v2(ctypes.byref(total), handle) != 0):
            return None
    except (OSError, AttributeError):  # no driver, or one without the call (a test's fake)
        return None
    return total.value


def pool_memory(backend: str, device: int = 0) -> tuple[int | None, str]:
    """(bytes, its name in an error) of the memory a pool of `backend` ("host",
    "cuda", or "auto": cuda where a driver is present) lives in; bytes is
    None where it is not known."""
    if backend == "cuda" or (backend == "auto" and cuda_available()):
        return cuda_memory_bytes(device), f"the memory of CUDA device {device}"
    return host_memory_bytes(), HOST_MEMORY


def too_large(what: str, nbytes: int, limit: int | None, memory: str) -> str | None:
    """Why `nbytes` of `what` (the flags that give it) cannot fit in `limit`
    bytes of `memory`, or None where they may (or the limit is unknown)."""
    if limit is None or nbytes <= limit:
        return None
    return f"{what} ({format_size(nbytes)}) is more than {memory} ({format_size(limit)})"
