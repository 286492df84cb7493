"""A client's session with the broker: its lease, its process, its spaces
and vTensors, and the chunks it may fetch fds for.

A session's life (docs/broker.md, "Trust model"):

  PENDING      after Hello: a lease and nothing else; no call but the attach
               is served, and it holds no memory (dropped after a while);
  LIVE         the client attached its channel on the fd socket: the kernel
               gave its pid (SO_PEERCRED) and a pidfd the broker watches;
  QUARANTINED  the channel ended while the process lives (a transport
               reset, a client bug): no call is served and the client's
               chunks stay held, handed to nobody, because the process may
               still map them;
  CLOSED       the client said goodbye (after unmapping everything) or its
               process exited: its spaces are closed, its chunks back in
               the pool.

Invariants (guarded by `lock`, which also serialises the client's calls;
calls_refused by the service's _mu):
  * spaces / vtensors hold exactly the live spaces and vTensors this client
    created (or matched); nothing of another client is reachable through them;
  * pages[(space, slot, page)] is the (chunk, serial) mapped there as the
    client was last told; serial_refs[s] counts those pages, so a chunk's fd
    is handed out only while the client maps it (docs/design.md §6);
  * pid and pidfd are set exactly from attach on; once CLOSED the session
    holds nothing, and its pidfd is closed;
  * table_entries is the page-table size of its open spaces (service.py);
  * asked holds what the client asked for in Hello (None: the operator's
    value); priority / guaranteed_bytes / limit_bytes /
    host_tier_limit_bytes are what it was granted (quota.py); owed_* are
    the policy's (policy.py).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import secrets
import threading
import time

from vtm.broker.quota import Quota

PENDING, LIVE, QUARANTINED, CLOSED = "pending", "live", "quarantined", "closed"


@dataclasses.dataclass(slots=True)
class VTensorState:
    """One vTensor as the client was last told: its space and slot (fixed
    for its life), its rows, and its low mark (pages wholly below it are
    unmapped); and, the broker's own, how many of its first pages it may
    share with the prefix tree (those it recorded or matched: only a
    shrink whose new end falls partway into one of them copies a page).
    It may count pages the tree did not take (a record of a prefix the
    tree held already): such a shrink then waits at the gate needlessly,
    never the other way round."""

    space_id: int
    slot: int
    num_tokens: int
    low: int
    shared_pages: int = 0


class Session:
    def __init__(self, client_id: int, name: str, asked: Quota, granted: Quota):
        self.client_id = client_id
        self.name = name
        self.asked = asked
        self.priority = granted.priority
        self.guaranteed_bytes = granted.guaranteed_bytes
        self.limit_bytes = granted.limit_bytes
        self.host_tier_limit_bytes = granted.host_tier_limit_bytes  # charged per name (quota.py)
        self.lease = secrets.token_hex(16)
        self.lock = threading.Lock()
        # Whether a gRPC call of it was refused for its process's calls in
        # flight (service.py, _in_flight, which counts them per process).
        self.calls_refused = False
        self.state = PENDING
        self.pid = None  # the kernel's word, at attach
        self.pidfd = None
        self.channel = None  # the attached Connection (src/vtm/broker/seqpacket.py)
        self.spaces = {}  # space id -> vtm Space of the broker's manager
        self.space_names = {}  # space id -> the name the client chose
        self.space_entries = {}  # space id -> its page-table entries (service.py)
        self.table_entries = 0  # their sum
        self.vtensors = {}  # vTensor id -> vtm VTensor
        # Cached so the hot path (a step over many vTensors) asks the manager
        # nothing but the step: geometry never changes, a slot is fixed for
        # a vTensor's life, and num_tokens changes only through this session.
        self.geometry = {}  # space id -> (row_bytes, max_tokens)
        self.vt_state = {}  # vTensor id -> VTensorState
        self.pages = {}  # (space, slot, page) -> (chunk, serial)
        self.serial_refs = collections.Counter()
        self.chunk_of = {}  # serial -> chunk id, for mapped serials
        self.created_at = time.monotonic()
        self.quarantined_at = None  # time.monotonic() when quarantined, until the broker warned of it
        self.next_space = 1
        # Set by the policy's reclaim notices (src/vtm/broker/policy.py).
        self.owed_target = None  # mapped bytes the client was asked to come down to
        self.owed_reclaim = None  # the lowest of those other clients' reclaims asked (None: the limit's only)
        self.owed_deadline = 0.0
        # The lowest target a notice told the client (None: it is there),
        # forgiven or not: a later notice asks for what it adds below it.
        self.announced = None
        self.asked_by = {}  # asking session -> bytes its notices added to `announced`
        # (bytes, time.monotonic() until when, asking session): what an
        # equal's reclaim asked it down to, which it may not map past meanwhile.
        self.share_cap = (0, 0.0, None)
        # Pages ahead (docs/broker.md, "Mapping ahead"): whether the client
        # said at hello that it gives them back (else it gets none), whether
        # it holds some (policy.py), and its recall notice not yet answered.
        self.gives_back_ahead = False
        self.maps_ahead = False
        self.recall_id = None
        self.recall_sent_s = 0.0  # time.monotonic() when recall_id was sent

    @property
    def closed(self) -> bool:
        return self.state == CLOSED

    def grant(self, granted: Quota) -> None:
        self.priority, self.guaranteed_bytes, self.limit_bytes, self.host_tier_limit_bytes = granted

    def notify(self, message: dict) -> bool:
        """Sends a notice on the session's channel without waiting: a client
        that does not read its channel misses notices (and answers none,
        which the policy's deadline handles). False when not sent."""
        channel = self.channel
        return channel is not None and channel.post(json.dumps(message).encode())

    def note_effects(self, space_id: int, effects) -> list:
        """Record the page states the client is about to be told; returns the
        serials the client did not map before (it may lack their fds). A
        chunk the effects unmap and map again elsewhere (a sliding window's
        page moving up) is not fresh: the client holds it until it applies
        them, so its fd is not sent again."""
        fresh, emptied = [], set()
        for slot, page, chunk, serial in effects:
            key = (space_id, slot, page)
            old = self.pages.pop(key, None)
            if old is not None:
                self.serial_refs[old[1]] -= 1
                if self.serial_refs[old[1]] == 0:
                    emptied.add(old[1])
            if serial != 0:
                self.pages[key] = (chunk, serial)
                if self.serial_refs[serial] == 0 and serial not in emptied:
                    fresh.append(serial)
                self.serial_refs[serial] += 1
                self.chunk_of[serial] = chunk
        for serial in emptied:
            if self.serial_refs[serial] == 0:
                del self.serial_refs[serial]
                del self.chunk_of[serial]
        return fresh

    def add_vtensor(self, vt) -> None:
        self.vtensors[vt.id] = vt
        self.vt_state[vt.id] = VTensorState(vt.space.id, vt.slot, vt.num_tokens, vt.low)

    def drop_vtensor(self, vt_id: int) -> None:
        self.vtensors.pop(vt_id, None)
        self.vt_state.pop(vt_id, None)

    def mapped_bytes(self, chunk_bytes: int) -> int:
        return len(self.pages) * chunk_bytes
