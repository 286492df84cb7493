"""vtm: the vTensor Manager.

An LLM KV cache in contiguous virtual memory whose physical chunks are mapped
on demand, shared by prefix, and managed on CPU worker threads. See
docs/api.md for the whole API and DESIGN.md for the architecture.
"""

from vtm._core import (
    FaultInjector,
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
from vtm.views import tensor as _tensor

Space.tensor = _tensor

__all__ = [
    "BackendError",
    "Error",
    "FailedPrecondition",
    "FaultInjector",
    "Future",
    "InternalError",
    "InvalidArgument",
    "Manager",
    "Match",
    "NotFound",
    "OutOfMemory",
    "RawBackend",
    "Space",
    "Unavailable",
    "VTensor",
    "cuda_available",
]
