"""vtm errors <-> gRPC status codes, the one table both sides of the broker use.

The broker aborts a call with the code of the vtm exception and names the
exception class in the trailing metadata key "vtm-error", so the client
raises exactly the class the in-process manager would have raised; the code
alone decides when the metadata is missing (another client, a proxy).
"""

from __future__ import annotations

import grpc

from vtm import errors

ERROR_KEY = "vtm-error"
LEASE_KEY = "vtm-lease"
# PrefixNode.pages: a page a window space's tree does not hold (a hole).
HOLE_PAGE = (1 << 32) - 1
# How an OutOfMemory begins when the client that asked maps pages ahead: it
# gives them back (a Shrink with all_ahead) and asks once more, before the
# broker asks any other client for memory (docs/broker.md, "Mapping ahead").
OWN_PAGES_AHEAD = "this client maps pages ahead: it gives them back first"
# What an OutOfMemory for too many calls in flight names (service.py,
# _in_flight): vtm.connect tries a Hello refused for it again (client.py).
CALLS_IN_FLIGHT_FLAG = "--max-calls-in-flight-per-client"

_CODES = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.OutOfMemory: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.BackendError: grpc.StatusCode.INTERNAL,
    errors.InternalError: grpc.StatusCode.INTERNAL,
}

_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.OutOfMemory,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.Unavailable,
    grpc.StatusCode.CANCELLED: errors.Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unavailable,
}

_CLASSES = {cls.__name__: cls for cls in (*_CODES, errors.Error)}


def code_of(error: errors.Error) -> grpc.StatusCode:
    for cls in type(error).__mro__:
        if cls in _CODES:
            return _CODES[cls]
    return grpc.StatusCode.INTERNAL


def from_rpc_error(err: grpc.RpcError, what: str) -> errors.Error:
    """The vtm exception for a failed call `what`."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(code)
    metadata = dict(err.trailing_metadata() or ()) if hasattr(err, "trailing_metadata") else {}
    cls = _CLASSES.get(metadata.get(ERROR_KEY, ""))
    if cls is None:
        cls = _BY_CODE.get(code, errors.InternalError)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        details = f"the vtm broker did not answer {what}: {details}"
    return cls(details)
