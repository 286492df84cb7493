"""Typed errors of vtm. The C++ core raises these by name (see error.h)."""


class Error(Exception):
    """Base of every vtm error."""


class OutOfMemory(Error, MemoryError):
    """No chunk within capacity or device memory, or no free slot (the message says which)."""


class InvalidArgument(Error, ValueError):
    """The request is malformed; nothing was changed."""


class NotFound(Error, LookupError):
    """A name or id that does not exist."""


class FailedPrecondition(Error):
    """The object is in the wrong state: released, closed, or of another space."""


class BackendError(Error):
    """The memory API (driver or kernel) failed; the message carries its text."""


class Unavailable(Error):
    """The backend cannot be used on this machine (for example, no CUDA driver)."""


class InternalError(Error):
    """A broken invariant inside vtm: a bug."""
