"""The fake CUDA driver (tests/vtm/fake_cuda/fake_libcuda.c): building it, and
controlling it from a test.

vtm loads libcuda.so.1 once per process, so the fake is used in a child
pytest whose LD_LIBRARY_PATH starts with the fake's folder and whose
environment names that folder in VTM_FAKE_CUDA (tests/vtm/test_fake_cuda.py
starts them). There, `--vtm-backend cuda` runs vtm's real CUDA backend
against host memory: device pointers are host addresses, so RowIO reads and
writes a space's rows at its base address instead of through torch CUDA
tensors, and `driver()` reaches the fake's counters, leak accounting and
fault injection through ctypes (the same library vtm loaded).
"""

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

ENV = "VTM_FAKE_CUDA"
SOURCE = Path(__file__).resolve().parent / "fake_cuda" / "fake_libcuda.c"
# The driver's entry points vtm uses (backend_cuda.cc's VTM_CUDA_ENTRY_POINTS), by their prototypes' names.
ENTRY_POINTS = ("cuGetErrorName", "cuGetErrorString", "cuInit", "cuDeviceGetCount", "cuDeviceGet",
                "cuDeviceGetAttribute", "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease", "cuCtxGetCurrent",
                "cuCtxSetCurrent", "cuStreamCreate", "cuStreamDestroy", "cuStreamSynchronize", "cuStreamWaitEvent",
                "cuEventCreate", "cuEventRecord", "cuEventSynchronize", "cuEventDestroy",
                "cuMemGetAllocationGranularity", "cuMemAddressReserve", "cuMemAddressFree", "cuMemCreate",
                "cuMemRelease", "cuMemMap", "cuMemUnmap", "cuMemSetAccess", "cuMemExportToShareableHandle",
                "cuMemImportFromShareableHandle", "cuMemcpyDtoDAsync", "cuMemcpyDtoHAsync", "cuMemcpyHtoDAsync",
                "cuMemHostAlloc", "cuMemFreeHost", "cuMemsetD8Async")
LIVE = ("handles", "allocations", "device_bytes", "mappings", "reservations", "host_allocations", "memfds",
        "streams", "events", "context_refs", "context_reclaimed", "queued")


def active():
    """Whether this process runs against the fake driver."""
    return bool(os.environ.get(ENV))


def cuda_include():
    """The folder of cuda.h, searched where CMakeLists.txt searches it; None if absent."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    candidates = [Path(r) / "include" for r in roots if r]
    candidates += [Path("/usr/local/cuda/include"), Path("/usr/local/cuda-13.0/include"), Path("/usr/include")]
    return next((c for c in candidates if (c / "cuda.h").is_file()), None)


def build(folder):
    """Compiles the fake into folder/<hash of source and header>/libcuda.so.1; that folder.

    Raises RuntimeError with the compiler's output if it fails."""
    include = cuda_include()
    if include is None:
        raise RuntimeError("no cuda.h: the fake driver is compiled against the CUDA headers")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    key = hashlib.sha256(SOURCE.read_bytes() + (include / "cuda.h").read_bytes() + str(cc).encode()).hexdigest()
    out = Path(folder) / key[:16]
    lib = out / "libcuda.so.1"
    if lib.is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"libcuda.so.1.{os.getpid()}"
    # Without the sanitizer lane's preloaded runtime: the compiler is not under test.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    cmd = [cc, "-shared", "-fPIC", "-O1", "-g", "-std=gnu11", "-Wall", "-Wextra", "-Werror",
           "-fvisibility=hidden", f"-I{include}", "-Wl,-soname,libcuda.so.1", "-o", str(tmp), str(SOURCE),
           "-lpthread"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"compiling the fake driver failed: {' '.join(cmd)}\n{done.stdout}{done.stderr}")
    tmp.replace(lib)
    return out


def child_env(lib_dir, **extra):
    """The environment of a child process that runs against the fake in lib_dir."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(lib_dir), env.get("LD_LIBRARY_PATH")) if p)
    env[ENV] = str(lib_dir)
    env.update({k: str(v) for k, v in extra.items()})
    return env


class FakeDriver:
    """The fake's control functions (see the header of fake_libcuda.c)."""

    def __init__(self, lib):
        self._lib = lib
        lib.fake_cuda_fail.argtypes = [ctypes.c_char_p, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_int]
        lib.fake_cuda_calls.argtypes = [ctypes.c_char_p]
        lib.fake_cuda_calls.restype = ctypes.c_longlong
        lib.fake_cuda_injected.argtypes = [ctypes.c_char_p]
        lib.fake_cuda_injected.restype = ctypes.c_longlong
        lib.fake_cuda_calls_behind.argtypes = [ctypes.c_char_p]
        lib.fake_cuda_calls_behind.restype = ctypes.c_longlong
        lib.fake_cuda_live.argtypes = [ctypes.c_char_p]
        lib.fake_cuda_live.restype = ctypes.c_longlong
        lib.fake_cuda_violations.restype = ctypes.c_longlong
        lib.fake_cuda_last_violation.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        lib.fake_cuda_set_option.argtypes = [ctypes.c_char_p, ctypes.c_longlong]
        lib.fake_cuda_range.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ulonglong),
                                        ctypes.POINTER(ctypes.c_size_t)]
        # Violations a test provoked on purpose (violations_expected); the
        # rest fail the test that made them (tests/vtm/conftest.py).
        self.forgiven = 0

    @property
    def lib(self):
        """The library itself: the driver's entry points, for tests of the fake."""
        return self._lib

    def calls(self, entry):
        n = self._lib.fake_cuda_calls(entry.encode())
        if n < 0:
            raise KeyError(entry)
        return n

    def calls_behind(self, entry):
        """The calls of `entry` made while copies or memsets were queued and had not run."""
        n = self._lib.fake_cuda_calls_behind(entry.encode())
        if n < 0:
            raise KeyError(entry)
        return n

    def injected(self, entry):
        return self._lib.fake_cuda_injected(entry.encode())

    def fail(self, entry, nth=1, count=1, error="CUDA_ERROR_UNKNOWN"):
        """The nth call of `entry` from now and the count-1 after it (count -1: all) return `error`."""
        code = ERRORS[error] if isinstance(error, str) else int(error)
        if self._lib.fake_cuda_fail(entry.encode(), nth, count, code) != 0:
            raise KeyError(entry)

    def clear_faults(self):
        self._lib.fake_cuda_clear_faults()

    def live(self):
        return {what: self._lib.fake_cuda_live(what.encode()) for what in LIVE}

    def mark(self):
        """Notes what is alive now, for grown()."""
        self._mark = self.live()

    def grown(self, what=None):
        """How much `what` grew since mark(), or every count that changed, by how much."""
        live, mark = self.live(), getattr(self, "_mark", None) or dict.fromkeys(LIVE, 0)
        if what is not None:
            return live[what] - mark[what]
        return {k: live[k] - mark[k] for k in LIVE if live[k] != mark[k]}

    def ranges(self, what):
        """[(va, size)] of the driver's "mappings" or "reservations", by address."""
        out, va, size = [], ctypes.c_ulonglong(), ctypes.c_size_t()
        while self._lib.fake_cuda_range(what.encode(), len(out), ctypes.byref(va), ctypes.byref(size)) == 0:
            out.append((va.value, size.value))
        return out

    def violations(self):
        return self._lib.fake_cuda_violations()

    def last_violation(self):
        buf = ctypes.create_string_buffer(512)
        self._lib.fake_cuda_last_violation(buf, len(buf))
        return buf.value.decode()

    def set_option(self, name, value):
        if self._lib.fake_cuda_set_option(name.encode(), int(value)) != 0:
            raise KeyError(name)

    @contextlib.contextmanager
    def violations_expected(self):
        """For a test that breaks a driver rule on purpose: yields a list that
        holds, after the block, the last violation's message (if any), and
        forgives the block's violations."""
        before = self.violations()
        seen = []
        yield seen
        made = self.violations() - before
        self.forgiven += made
        if made:
            seen.append(self.last_violation())


ERRORS = {"CUDA_ERROR_INVALID_VALUE": 1, "CUDA_ERROR_OUT_OF_MEMORY": 2, "CUDA_ERROR_NOT_INITIALIZED": 3,
          "CUDA_ERROR_INVALID_CONTEXT": 201, "CUDA_ERROR_INVALID_HANDLE": 400, "CUDA_ERROR_ILLEGAL_ADDRESS": 700,
          "CUDA_ERROR_LAUNCH_FAILED": 719, "CUDA_ERROR_NOT_SUPPORTED": 801, "CUDA_ERROR_UNKNOWN": 999}

_driver = None


def driver():
    """The fake driver this process runs against (only when active())."""
    global _driver
    if _driver is None:
        lib = ctypes.CDLL(str(Path(os.environ[ENV]) / "libcuda.so.1"))
        if not hasattr(lib, "fake_cuda_fail"):
            raise RuntimeError(f"{ENV} names {os.environ[ENV]}, whose libcuda.so.1 is not the fake driver")
        _driver = FakeDriver(lib)
    return _driver


# Device bytes, read and written by address: under the fake a device pointer
# is a host address, and touching one whose page is not mapped with access
# faults, as a kernel would.


def read_device(address, nbytes):
    import numpy as np

    return np.frombuffer(ctypes.string_at(address, nbytes), dtype=np.uint8).copy()


def write_device(address, data):
    import numpy as np

    if isinstance(data, (bytes, bytearray)):
        ctypes.memmove(address, bytes(data), len(data))
        return
    data = np.ascontiguousarray(data, dtype=np.uint8)
    ctypes.memmove(address, data.ctypes.data, data.nbytes)
