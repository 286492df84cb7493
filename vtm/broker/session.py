"""A client's session with the broker: its lease, its spaces and vTensors,
and the chunks it may fetch fds for.

Invariants (guarded by `lock`, which also serialises the client's calls):
  * spaces / vtensors hold exactly the live spaces and vTensors this client
    created (or matched); nothing of another client is reachable through them;
  * pages[(space, slot, page)] is the (chunk, serial) mapped there as the
    client was last told; serial_refs[s] counts those pages, so a chunk's fd
    is handed out only while the client maps it (DESIGN §6);
  * once `closed`, the session holds nothing and every call fails;
  * limit_bytes / guaranteed_bytes / priority / owed_* are the policy's
    (vtm/broker/policy.py); 0 limit means none.
"""

from __future__ import annotations

import collections
import queue
import secrets
import threading
import time


class Session:
    def __init__(self, client_id: int, name: str, priority: int, guaranteed_bytes: int, limit_bytes: int, pid: int):
        self.client_id = client_id
        self.name = name
        self.priority = priority
        self.guaranteed_bytes = guaranteed_bytes
        self.limit_bytes = limit_bytes
        self.pid = pid
        self.lease = secrets.token_hex(16)
        self.lock = threading.Lock()
        self.spaces = {}  # space id -> vtm Space of the broker's manager
        self.space_names = {}  # space id -> the name the client chose
        self.vtensors = {}  # vTensor id -> vtm VTensor
        # Cached so the hot path (a step over many vTensors) asks the manager
        # nothing but the step: geometry never changes, a slot is fixed for
        # a vTensor's life, and num_tokens changes only through this session.
        self.geometry = {}  # space id -> (row_bytes, max_tokens)
        self.vt_state = {}  # vTensor id -> [space id, slot, num_tokens]
        self.pages = {}  # (space, slot, page) -> (chunk, serial)
        self.serial_refs = collections.Counter()
        self.chunk_of = {}  # serial -> chunk id, for mapped serials
        self.notices = queue.Queue()
        self.attached = False  # the Notices stream is open
        self.created_at = time.monotonic()
        self.closed = False
        self.next_space = 1
        # Set by the policy's reclaim notices (vtm/broker/policy.py).
        self.owed_target = None  # mapped bytes the client was asked to come down to
        self.owed_deadline = 0.0

    def note_effects(self, space_id: int, effects) -> list:
        """Record the page states the client is about to be told; returns the
        serials the client did not map before (it may lack their fds)."""
        fresh = []
        for slot, page, chunk, serial in effects:
            key = (space_id, slot, page)
            old = self.pages.pop(key, None)
            if old is not None:
                self.serial_refs[old[1]] -= 1
                if self.serial_refs[old[1]] == 0:
                    del self.serial_refs[old[1]]
                    del self.chunk_of[old[1]]
            if serial != 0:
                self.pages[key] = (chunk, serial)
                if self.serial_refs[serial] == 0:
                    fresh.append(serial)
                self.serial_refs[serial] += 1
                self.chunk_of[serial] = chunk
        return fresh

    def add_vtensor(self, vt) -> None:
        self.vtensors[vt.id] = vt
        self.vt_state[vt.id] = [vt.space.id, vt.slot, vt.num_tokens]

    def drop_vtensor(self, vt_id: int) -> None:
        self.vtensors.pop(vt_id, None)
        self.vt_state.pop(vt_id, None)

    def mapped_bytes(self, chunk_bytes: int) -> int:
        return len(self.pages) * chunk_bytes
