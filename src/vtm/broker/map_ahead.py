"""Mapping ahead (vtm.connect(..., map_ahead_pages=L); docs/broker.md,
"Mapping ahead"): the client's side of keeping L pages mapped ahead of each
growing vTensor, so that most steps need no round trip to the broker.

A vTensor that grows on the broker asks for rows(space, n) rows: the rows
of L pages more than n needs. The broker maps them and counts them as the
vTensor's (its num_tokens, kept here as vt._mapped_tokens). A growth whose
targets all fit in them is decided in the client (grow); once a vTensor
enters its last L pages, grow returns a refill for the client's worker to
send, not waited for.

Invariants, per vTensor vt of the client:
  * vt._num_tokens <= vt._mapped_tokens == the broker's num_tokens for vt
    (as last reported: only grow raises vt._num_tokens without the broker);
  * vt._refill_at is the row count past which fewer than L mapped pages lie
    ahead of the last row, or NEVER while a refill is on its way (or L = 0).

Not thread-safe by itself: grow runs on the caller's thread only when the
client's worker has nothing queued but refills (checked and done under the
client's submission lock), refills only raise vt._mapped_tokens, and a
shrink, which lowers it, is an operation of its own (set_mapped, on the
worker, for both).
"""

from __future__ import annotations

from vtm.broker.remote import RemoteVTensor

NEVER = 1 << 62  # a row count no vTensor reaches


class MapAhead:
    def __init__(self, pages: int, chunk_bytes: int):
        self.pages = pages
        self.chunk_bytes = chunk_bytes

    def rows(self, space, n: int, ahead: int | None = None) -> int:
        """The rows to ask the broker for, for n rows of `space`: all the rows
        of the pages n needs and of `ahead` more (default L). Without mapping
        ahead, n."""
        if not self.pages:
            return n
        row, chunk = space.row_bytes, self.chunk_bytes
        pages = -(-n * row // chunk) + (self.pages if ahead is None else ahead)
        return max(n, min(space.max_tokens, pages * chunk // row))

    def set_mapped(self, vt: RemoteVTensor, mapped: int) -> None:
        """The broker's num_tokens for vt is `mapped` now."""
        vt._mapped_tokens = mapped
        if self.pages:
            row, chunk = vt._space.row_bytes, self.chunk_bytes
            vt._refill_at = (-(-mapped * row // chunk) - self.pages) * chunk // row
        else:
            vt._refill_at = NEVER

    def grow(self, pairs, owner) -> list | None:
        """Grows the vTensors of `owner` here when every (vTensor, rows)
        target fits in what the broker mapped for it: the refills to send,
        [(vTensor, rows)], possibly none. None: nothing changed, the broker
        decides (a target past its pages, not an int, a released vTensor or
        another manager's). The hot path of a decode step: a few comparisons
        a vTensor."""
        if not self.pages:
            return None
        for vt, n in pairs:
            if (type(vt) is not RemoteVTensor or type(n) is not int or vt._mgr is not owner or vt._released
                    or not 0 <= n <= vt._mapped_tokens):
                return None
        refills = []
        for vt, n in pairs:
            if n > vt._num_tokens:
                vt._num_tokens = n
            if n > vt._refill_at:
                want = self.rows(vt._space, n)
                vt._refill_at = NEVER  # until the refill lands (set_mapped)
                if want > vt._mapped_tokens:
                    refills.append((vt, want))
        return refills
