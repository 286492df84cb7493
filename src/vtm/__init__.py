"""vtm: the vTensor Manager.

An LLM KV cache in contiguous virtual memory whose physical chunks are mapped
on demand, shared by prefix, and managed on CPU worker threads. See
docs/api.md for the whole API and docs/design.md for the design.
"""

from vtm._core import (
    MAX_SPACE_BYTES,
    FaultInjector,
    Fence,
    Future,
    Manager,
    Match,
    RawBackend,
    Space,
    VTensor,
    cuda_available,
)
from vtm.errors import (
    BackendError,
    Error,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    NotFound,
    OutOfMemory,
    Unavailable,
)
from vtm import limits
from vtm.views import tensor as _tensor

Space.tensor = _tensor


def __getattr__(name):
    """vtm.__version__, looked up on first use (PEP 562): importlib.metadata
    takes ~30 ms to import, which every `import vtm` paid (vtmd's start,
    before its signal handlers, among them: python -m vtm.broker)."""
    if name != "__version__":
        raise AttributeError(f"module 'vtm' has no attribute {name!r}")
    from importlib import metadata

    try:  # the `vtm` distribution: vtm, vtmd, vtmctl and flexinfer ship in it
        version = metadata.version("vtm")
    except metadata.PackageNotFoundError:  # an uninstalled source tree
        version = "0+unknown"
    globals()["__version__"] = version
    return version


def connect(address, name=None, priority=None, guaranteed_bytes=None, limit_bytes=None, timeout=10, fast_path=True,
            map_ahead_pages=0, stop=None):
    """A manager served by the vtm broker at `address` ("unix:PATH") with the
    API of Manager; see docs/broker.md. Needs grpcio (imported only here).
    The operator sets priorities, guarantees and limits; a client may ask for less.
    map_ahead_pages=L keeps L pages mapped ahead of each growing vTensor, so
    that most steps need no round trip to the broker (docs/api.md).
    stop: a threading.Event that, once set, ends the wait for a broker that
    is starting at once, with vtm.Unavailable."""
    from vtm.broker.client import connect as _connect

    return _connect(address, name, priority, guaranteed_bytes, limit_bytes, timeout, fast_path, map_ahead_pages,
                    stop)

__all__ = [
    "MAX_SPACE_BYTES",
    "BackendError",
    "Error",
    "FailedPrecondition",
    "FaultInjector",
    "Fence",
    "Future",
    "InternalError",
    "InvalidArgument",
    "Manager",
    "Match",
    "NotFound",
    "OutOfMemory",
    "RawBackend",
    "limits",
    "Space",
    "Unavailable",
    "VTensor",
    "connect",
    "cuda_available",
    "__version__",
]
