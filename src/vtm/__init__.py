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
from importlib import metadata as _metadata

from vtm import limits
from vtm.views import tensor as _tensor

Space.tensor = _tensor

try:  # the `vtm` distribution: vtm, vtmd, vtmctl and flexinfer ship in it
    __version__ = _metadata.version("vtm")
except _metadata.PackageNotFoundError:  # an uninstalled source tree
    __version__ = "0+unknown"


def connect(address, name=None, priority=None, guaranteed_bytes=None, limit_bytes=None, timeout=10, fast_path=True,
            map_ahead_pages=0):
    """A manager served by the vtm broker at `address` ("unix:PATH") with the
    API of Manager; see docs/broker.md. Needs grpcio (imported only here).
    The operator sets priorities, guarantees and limits; a client may ask for less.
    map_ahead_pages=L keeps L pages mapped ahead of each growing vTensor, so
    that most steps need no round trip to the broker (docs/api.md)."""
    from vtm.broker.client import connect as _connect

    return _connect(address, name, priority, guaranteed_bytes, limit_bytes, timeout, fast_path, map_ahead_pages)

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
