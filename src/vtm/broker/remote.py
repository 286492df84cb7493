"""The client-side objects of a broker connection: Future, Space, VTensor and
Match with the same API as vtm's in-process ones (docs/api.md).

They hold ids and the state the broker last reported; every operation goes
through the RemoteManager's worker (src/vtm/broker/client.py), which applies the
reply (mapping chunks, updating vTensor state) before resolving the future,
exactly as the in-process worker maps before its future resolves.
"""

from __future__ import annotations

import concurrent.futures

from vtm import errors, views


class RemoteFuture:
    """vtm.Future's API over a concurrent.futures.Future. `on_error(exc)`,
    when given, runs on the caller's thread before an error reaches it
    (client.py revokes a lost session's mappings there)."""

    def __init__(self, inner: concurrent.futures.Future, on_error=None):
        self._inner = inner
        self._on_error = on_error

    def result(self, timeout=None):
        self.exception(timeout)
        return self._inner.result()

    def done(self) -> bool:
        return self._inner.done()

    def exception(self, timeout=None):
        try:
            exc = self._inner.exception(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError("the vtm operation did not finish in time") from None
        if exc is not None and self._on_error is not None:
            self._on_error(exc)
        return exc


class RemoteMatch:
    def __init__(self, vtensor, num_tokens: int, restored_tokens: int = 0):
        self.vtensor = vtensor
        self.num_tokens = num_tokens
        self.restored_tokens = restored_tokens  # of num_tokens, those the broker copied back from its host tier

    def __repr__(self):
        vt = "None" if self.vtensor is None else str(self.vtensor.id)
        return f"Match(num_tokens={self.num_tokens}, vtensor={vt})"


class RemoteVTensor:
    """One request's KV in a space of a broker client. State (slot,
    num_tokens, low) is what the broker reported with the last reply, or
    what an extend it accepted asked for."""

    def __init__(self, mgr, space, vt_id: int, slot: int, num_tokens: int, low: int = 0):
        self._mgr = mgr
        self._space = space
        self.id = vt_id
        self._slot = slot
        self._num_tokens = num_tokens
        self._low = low
        self._released = False  # its release began here: unusable, whatever the broker answered
        # Unusable here, and the broker has not released it (the unmap here
        # or the release there failed): the broker still holds the slot, its
        # pages and the locks of the prefix path it matched, so it is not
        # `released` until a release() the broker answers (client.py,
        # _release).
        self._broker_holds = False
        # Held at the broker, and its pages may still be mapped here: the
        # unmap before its release failed (client.py, _unmap_held).
        self._mapped_here = False
        # The broker's num_tokens: >= _num_tokens, larger when the client
        # maps ahead (client.py); rows up to it need no new page. Past
        # _refill_at rows the pages ahead run short (client.py sets both).
        self._mapped_tokens = num_tokens
        self._refill_at = num_tokens

    def _live(self):
        if self._broker_holds:
            raise errors.FailedPrecondition(f"vTensor {self.id} is unusable, and its release failed (unmapping it "
                                            f"here, or at the broker): release() it again")
        if self._released:
            raise errors.FailedPrecondition(f"vTensor {self.id} was released")
        return self

    @property
    def released(self) -> bool:
        """Whether the broker released it: as in process, a release that
        failed leaves it unreleased (and a caller that waits for the
        release, to forget the prefix path it locks, say, waits on)."""
        return self._released and not self._broker_holds

    @property
    def space(self):
        return self._live()._space

    @property
    def slot(self) -> int:
        return self._live()._slot

    @property
    def num_tokens(self) -> int:
        return self._live()._num_tokens

    @property
    def low(self) -> int:
        return self._live()._low

    @property
    def address(self) -> int:
        self._live()
        return self._space.base_address + self._slot * self._space.slot_bytes

    @property
    def mapped_bytes(self) -> int:
        self._live()
        return self._mgr._mapper.mapped_pages(self._space.id, self._slot) * self._mgr.chunk_bytes

    def page_chunks(self):
        self._live()
        return self._mgr._mapper.pages(self._space.id, self._slot)

    def extend(self, num_tokens: int, low: int | None = None) -> RemoteFuture:
        return self._mgr._extend(self, num_tokens, low)

    def shrink(self, num_tokens: int) -> RemoteFuture:
        return self._mgr.shrink({self: num_tokens})

    def release(self) -> RemoteFuture:
        return self._mgr._release(self)

    def __hash__(self):
        return hash(self.id)

    def __eq__(self, other):
        return isinstance(other, RemoteVTensor) and other._mgr is self._mgr and other.id == self.id

    def __repr__(self):
        if self._released:
            return f"VTensor(id={self.id}, released)"
        return f"VTensor(id={self.id}, slot={self._slot}, num_tokens={self._num_tokens})"


class RemoteSpace:
    """A space whose accounting lives in the broker and whose reservation
    lives in this process."""

    def __init__(self, mgr, reply):
        self._mgr = mgr
        self.id = reply.space_id
        self.name = reply.name
        self.namespace = reply.namespace
        self.row_bytes = reply.row_bytes
        self.max_tokens = reply.max_tokens
        self.max_slots = reply.max_slots
        self.slot_bytes = reply.slot_bytes
        self.pages_per_slot = reply.pages_per_slot
        self.window_tokens = reply.window_tokens
        self.closed = False
        # close() was called: a reconnect does not bring the space back,
        # even if the broker never answered the close (the session lost).
        self.close_requested = False

    @property
    def base_address(self) -> int:
        return self._mgr._mapper.base_address(self.id)

    @property
    def free_slots(self) -> int:
        return self.max_slots - self._mgr._live_in(self)

    @property
    def _device(self):
        return self._mgr._mapper._device

    def _dlpack(self, code, bits, shape, versioned):
        self._open()
        return self._mgr._mapper._dlpack(self.id, code, bits, shape, versioned)

    def tensor(self, dtype, shape=None):
        return views.tensor(self, dtype, shape)

    def _open(self) -> None:
        # A closed space's id may be another space's by now (a new session
        # numbers its spaces from 1 again): nothing of it goes to the broker.
        if self.closed:
            raise errors.FailedPrecondition(f"space '{self.name}' is closed")

    def create(self, num_tokens: int) -> RemoteFuture:
        self._open()
        return self._mgr._create(self, num_tokens)

    def prefix_record(self, vtensor, token_ids, *, stream=None, release=False) -> RemoteFuture:
        self._open()
        return self._mgr._prefix_record(self, vtensor, token_ids, stream, release)

    def prefix_match(self, token_ids, *, stream=None) -> RemoteFuture:
        self._open()
        return self._mgr._prefix_match(self, token_ids, stream)

    def prefix_forget(self, token_ids) -> RemoteFuture:
        self._open()
        return self._mgr._prefix_forget(self, token_ids)

    def clear_prefixes(self) -> int:
        self._open()
        return self._mgr._clear_prefixes(self).result()

    def prefix_restore_bytes(self, token_ids) -> int:
        self._open()
        return self._mgr._prefix_restore_bytes(self, token_ids).result()

    def prefix_nodes(self):
        self._open()
        return self._mgr._prefix_nodes(self).result()

    def close(self) -> None:
        self._open()
        self._mgr._close_space(self).result()

    def __repr__(self):
        return (f"Space(name='{self.name}', row_bytes={self.row_bytes}, max_tokens={self.max_tokens}, "
                f"max_slots={self.max_slots})")
