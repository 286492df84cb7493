"""A broker client's liveness: whether its session is up, and what losing it costs.

A session is lost when the broker ends it, dies or stops answering. The first
error that says so is kept (`broken`): every later call fails with it, until a
reconnect renews the session. Losing the session costs this process its
memory: before the first such error of a vTensor operation reaches its
caller, the client unmaps every chunk it maps (the revoke). That happens on
the thread bound to compute on the memory (`bind`), so that no kernel of this
process is reading a page as it goes; from another thread (the client's
worker), the unmap could pull the memory from under one: a fault on the host,
an illegal address on CUDA. The bound thread's `before_revoke` runs first: an
engine with steps queued on the device waits for them there.

Invariants:
  * `broken` is None exactly while the session is up;
  * the revoke runs at most once per session, and only on the bound thread
    (on any thread while none is bound).
"""

from __future__ import annotations

import logging
import threading

from vtm import errors

log = logging.getLogger("vtm.broker")


class Liveness:
    def __init__(self):
        self.broken: errors.Error | None = None
        # False while pages of this session may still be mapped here (its
        # revoke, or the client's close, failed to unmap them): the broker
        # must not be told that none is (client.py, no goodbye). A retry
        # that unmaps them sets it back.
        self.unmapped = True
        self._revoked = False
        self._mu = threading.Lock()
        self._thread = None
        self._before_revoke = None

    def lose(self, error: errors.Error) -> errors.Error:
        """The session is lost, by `error` unless it was already; returns
        the error to raise (the first one's kind and words)."""
        broken = self.broken = self.broken or error
        return type(broken)(str(broken))

    def error(self) -> errors.Error:
        """A new exception saying why the session was lost (it must be lost)."""
        broken = self.broken
        return type(broken)(str(broken))

    def bind(self, before_revoke=None) -> None:
        """The calling thread computes on the memory: the revoke runs there.
        A second thread is refused (vtm.FailedPrecondition)."""
        if not self.on_bound_thread():
            raise errors.FailedPrecondition(
                "this vtm.connect manager already serves another computing thread (an engine): its mappings "
                "are revoked on that thread when the broker goes away; connect once per engine")
        self._thread = threading.get_ident()
        self._before_revoke = before_revoke

    def on_bound_thread(self) -> bool:
        return self._thread in (None, threading.get_ident())

    def revoke(self, unmap, closed) -> bool:
        """Runs `unmap` (after before_revoke) if this session's revoke is
        due here: on the bound thread, once, and not once `closed()`.
        Returns whether it ran now. A failure is logged and leaves `unmapped`
        False: the session is gone either way, and the caller is owed its own
        error."""
        if not self.on_bound_thread():
            return False  # the bound thread revokes, at its own first error or in reconnect()
        with self._mu:
            if self._revoked or closed():
                return False
            self._revoked = True
            try:
                if self._before_revoke is not None:
                    self._before_revoke()  # the kernels queued on this memory finish first
                unmap()
            except Exception:  # noqa: BLE001 - see above
                self.unmapped = False
                log.exception("unmapping the chunks of a lost vtm session failed")
        return True

    def renew(self) -> None:
        """A new session is up."""
        self._revoked = False
        self.unmapped = True
        self.broken = None
