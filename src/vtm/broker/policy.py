"""The broker's memory policy across clients: limits, priorities and
cooperative reclaim (docs/design.md §6, docs/broker.md).

A mapped chunk cannot be revoked from a live process (its mapping keeps the
memory alive), so reclaim is cooperative. Under pressure the manager itself
first takes free chunks, then evicts unreferenced prefix-tree leaves (LRU),
then the chunks a live match's path keeps without mapping them (a path one
vTensor alone locks; Manager::UnpinPrefix); when that fails, a client's allocation first asks every other client that
maps pages ahead, whatever its priority, for them (a RECALL notice: pages
nobody uses yet, so no debt), and when what they free is not enough, asks
lower-priority clients that map more than their guarantee, then clients of
its own priority that map more than their fair share, to give back what the
pool lacks (a RECLAIM notice with a deadline; nobody, when they cannot
cover it all); it waits briefly for the answers and retries once; then it
fails with RESOURCE_EXHAUSTED. (A client that
maps pages ahead itself gives those back before any of this: its refusals
come at once, service.py.) A client that has not come down to what a
notice asked by its deadline gets no more memory until it does. The
operator lowering a client's limit below what it maps asks for the
excess the same way (ask_back): the client gives back its pages ahead,
then preempts and recomputes, and no allocation of zero bytes (a step
within pages already mapped) is ever refused, so lowering a quota never
fails work the client already has.

Memory freed in answer to a notice is reserved for the allocation that
asked: from the notice until its retry has run (or reserve_s passed), an
allocation of any other client that would leave less free than the
reservations of others waits (gate()); otherwise the victim's own next
admission, or a third client, could take the freed chunks first and the
asker's retry would fail anyway. A client that still owes memory is not
held back until its notice's deadline: it may have to allocate (its
engine's step already under way) before it gets to answer, and what it
owes counts what it mapped since (past the deadline only its shrinks pass,
which pay the debt: service.py). Nor is another asker's retry (two retries
waiting for each other's reservation would both stall until the
reservations lapse).

Notices go on the session's channel (Session.notify), as JSON:
{"notice": "reclaim", "id": N, "bytes": B, "deadline_s": S, "reason": ...}
(B: what it asks beyond what earlier notices told the client and it has
not given back yet; the client frees each notice's B)
or {"notice": "recall", "id": N, "reason": ...}; the client answers with
{"ack": N} there (src/vtm/broker/fd_channel.py).

Invariants:
  * a session owes memory (owed_target is not None) only between a notice
    and the moment its mapped bytes are at or below owed_target;
    owed_reclaim, the part other clients' reclaims asked, is None or at
    least owed_target (the rest the operator's limit asked, which a new
    limit forgives);
  * recall_id is the recall notice the session has not answered (None:
    none); maps_ahead holds from a grant of pages ahead until the client
    gives them all back (gave_back_ahead), answering its recall too;
  * _reserved holds, per asking session, the bytes its pending retry needs
    and the deadline after which they are no longer reserved;
  * admit() never changes state: it only refuses, and never an allocation
    of 0 bytes;
  * reclaim() waits holding no lock of this module (nor, by contract with
    its caller, the asker's session lock);
  * announced is None or the lowest target a notice told the session and
    it has not come down to; asked_by[asker] is the part of what it was
    told that asker's notices added;
  * share_cap is (bytes, until, asker): asker, an equal, asked the session
    down to its fair share of `bytes`, and admit() refuses it more until
    then or the asker's end;
  * at most max_waits allocations wait in reclaim() or gate() at once.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time

from vtm import errors
from vtm.broker.session import LIVE


# Allocations that may wait at once: half the broker's pool of side-socket
# workers (server.IO_THREADS), so that as many are left for the calls that
# end waits.
MAX_WAITS = 16


class Policy:
    def __init__(self, sessions, chunk_bytes: int, free_bytes=None, notice_deadline_s: float = 2.0,
                 wait_s: float = 1.0, reserve_s: float = 2.0, capacity_bytes: int = 0, max_waits: int = MAX_WAITS):
        self._sessions = sessions  # () -> list of open sessions
        self.chunk_bytes = chunk_bytes
        self.capacity_bytes = capacity_bytes  # the pool's, split into fair shares among equals (0: none)
        # Allocations waiting at once (for answers, or at the gate). A wait
        # holds the thread that serves the call, which the broker's fixed
        # pools share with the calls that end waits (the victims' releases
        # and acks): without a bound, enough askers at once left none to
        # carry them, and every wait ran out. Past it an allocation is
        # refused at once; a client tries again (FlexInfer every 50 ms).
        self.max_waits = max_waits
        self._waits = threading.BoundedSemaphore(max_waits)
        self._free_bytes = free_bytes  # () -> bytes of the pool no chunk holds (None: no reservations)
        self.notice_deadline_s = notice_deadline_s
        self.wait_s = wait_s
        self.reserve_s = reserve_s
        self._ids = itertools.count(1)
        self._mu = threading.Lock()
        self._answered = threading.Condition(self._mu)  # a debt paid, a recall answered
        self._gate = threading.Condition()
        self._reserved = {}  # session -> (bytes, deadline), under _gate

    def admit(self, session, extra_bytes: int) -> None:
        """Refuses an allocation of `extra_bytes` more that the client may not make."""
        if extra_bytes == 0:
            return  # maps nothing new: over a lowered limit, the client is asked to come down instead
        mapped = session.mapped_bytes(self.chunk_bytes)
        if session.limit_bytes and mapped + extra_bytes > session.limit_bytes:
            raise errors.OutOfMemory(f"client '{session.name}' is limited to {session.limit_bytes} bytes: it maps "
                                     f"{mapped} and asks for {extra_bytes} more")
        with self._mu:
            target, deadline = session.owed_target, session.owed_deadline
        if target is not None and time.monotonic() > deadline and mapped > target:
            raise errors.OutOfMemory(f"client '{session.name}' ignored a reclaim notice: it maps {mapped} bytes, "
                                     f"{mapped - target} more than asked; no more memory until it gives them back")
        with self._mu:
            cap, until, _ = session.share_cap
        if time.monotonic() < until and mapped + extra_bytes > cap:
            # Given back for an equal below its share: not taken again
            # (re-admitting what it preempted) before that equal took it.
            raise errors.OutOfMemory(f"client '{session.name}' is held to its fair share of {cap} bytes for a "
                                     "moment: a client of its priority is taking the memory it gave back")

    def owes(self, session) -> bool:
        """Whether the client has a reclaim notice's debt to pay."""
        with self._mu:
            return session.owed_target is not None

    def settle(self, session) -> None:
        """Clears a debt the client has paid (called after its mappings change)."""
        with self._mu:
            mapped = session.mapped_bytes(self.chunk_bytes)
            if session.announced is not None and mapped <= session.announced:
                session.announced = None
                session.asked_by.clear()
            if session.owed_target is not None and mapped <= session.owed_target:
                session.owed_target = session.owed_reclaim = None
                self._answered.notify_all()

    def limit_changed(self, session, reason: str) -> None:
        """The operator set the client's limit anew: what the old limit
        asked of it is forgiven (what other clients' reclaims asked is not),
        and a limit below what it maps asks for the excess."""
        mapped = session.mapped_bytes(self.chunk_bytes)
        with self._mu:
            session.owed_target = session.owed_reclaim
            if session.owed_target is None:
                if not session.limit_bytes or mapped <= session.limit_bytes:
                    # Nothing owed, nor asked: what notices told it is
                    # forgiven too, and a later limit asks for its whole
                    # excess. (A lower limit asks for what it adds.)
                    session.announced = None
                    session.asked_by.clear()
                self._answered.notify_all()
        self.settle(session)
        if session.limit_bytes:
            self.ask_back(session, session.limit_bytes, reason, for_limit=True)

    def _reserved_for_others(self, session) -> int:
        now = time.monotonic()
        return sum(b for s, (b, deadline) in self._reserved.items() if s is not session and deadline > now)

    @contextlib.contextmanager
    def gate(self, session, extra_bytes: int, wait: bool = True):
        """Runs an allocation of `extra_bytes` by `session` (the with-block)
        so that it leaves the bytes reserved for others' retries free:
        while it would not, it waits (until they retried or their
        reservations expired; wait=False, or max_waits allocations waiting
        already: raises OutOfMemory instead). With
        no reservation of others, it runs at once and concurrently with any
        other; otherwise gated allocations run one at a time, so two of them
        cannot both pass the check."""
        with self._gate:
            gated = self._gated(session, extra_bytes)
            waiting = False
            try:
                while gated:
                    others = self._reserved_for_others(session)
                    if others == 0 or self._free_bytes() - extra_bytes >= others:
                        break
                    if not wait:
                        raise errors.OutOfMemory(f"{others} bytes are reserved for other clients' retries")
                    if not waiting:
                        waiting = self._waits.acquire(blocking=False)
                        if not waiting:
                            raise self._too_many_waits(f"{others} bytes are reserved for other clients' retries")
                    now = time.monotonic()
                    deadlines = [d for s, (_, d) in self._reserved.items() if s is not session and d > now]
                    self._gate.wait(min(deadlines) - now if deadlines else 0)
                    # A notice sent meanwhile lets it through (_notified wakes it).
                    gated = self._gated(session, extra_bytes)
            finally:
                if waiting:
                    self._waits.release()
            if gated:
                yield  # under the lock: the next gated allocation checks after this one
                return
        yield

    def _too_many_waits(self, why: str) -> errors.OutOfMemory:
        return errors.OutOfMemory(f"{why}, and {self.max_waits} allocations already wait for memory: "
                                  "try again shortly")

    def _gated(self, session, extra_bytes: int) -> bool:
        """Whether gate() holds this allocation to others' reservations (under
        _gate). Not a client that owes memory (until its notice's deadline)
        or has a recall to answer (until wait_s after it was sent, when its
        askers stop waiting for it): its worker may have to allocate before it
        gets to answer. Past that it is held like anyone (admit()
        refuses it more memory; this holds what admit() lets through, the
        copies of a shrink or a record): a client whose notices go unanswered
        (a listener stuck behind an engine step) took others' reservations
        for as long as it never answered."""
        with self._mu:
            now = time.monotonic()
            owing = session.owed_target is not None and now <= session.owed_deadline
            recalled = session.recall_id is not None and now - session.recall_sent_s < self.wait_s
            asked = owing or recalled
        return (self._free_bytes is not None and extra_bytes > 0 and not asked
                and session not in self._reserved and self._reserved_for_others(session) > 0)

    def _notified(self) -> None:
        """A notice went out: an allocation of its client waiting in gate()
        goes on (_gated)."""
        with self._gate:
            self._gate.notify_all()

    def unreserve(self, session) -> None:
        """The session's retry has run: others may take what it left."""
        with self._gate:
            if self._reserved.pop(session, None) is not None:
                self._gate.notify_all()

    def session_ended(self, session) -> None:
        """Its reservation goes, and the equals it asked down to their
        share may take memory again: it needs none."""
        self.unreserve(session)
        others = self._sessions()  # the service's lock, not under _mu
        with self._mu:
            for other in others:
                if other.share_cap[2] is session:
                    other.share_cap = (0, 0.0, None)
                other.asked_by.pop(session, None)

    def answered(self, session, notice_id) -> None:
        """The client acknowledged notice `notice_id`."""
        with self._mu:
            if session.recall_id == notice_id:
                session.recall_id = None
                self._answered.notify_all()

    def mapped_ahead(self, session) -> None:
        """The broker is granting `session` pages ahead."""
        with self._mu:
            session.maps_ahead = True

    def gave_back_ahead(self, session) -> None:
        """The client holds no page ahead any more (a Shrink with all_ahead,
        or its last vTensor gone: released, or its space closed): a recall of
        it is answered."""
        with self._mu:
            session.maps_ahead = False
            if session.recall_id is not None:
                session.recall_id = None
                self._answered.notify_all()

    def _reserve(self, requester, reserve_bytes: int) -> None:
        """Reserves for the requester's retry from now until unreserve() or
        reserve_s from now: a reclaim after a recall renews it, so it still
        holds when the retry runs after both waits."""
        if reserve_bytes > 0 and self._free_bytes is not None:
            with self._gate:
                self._reserved[requester] = (reserve_bytes, time.monotonic() + self.reserve_s)

    def _wait(self, done, enough=None) -> None:
        """Up to wait_s until done() (checked under _mu) or enough() (checked
        without it: it takes _gate, which is taken before _mu elsewhere),
        woken by answers; a session that ends or memory freed wakes nobody,
        hence the short timeouts."""
        end = time.monotonic() + self.wait_s
        while enough is None or not enough():
            with self._answered:
                if done():
                    return
                left = end - time.monotonic()
                if left <= 0:
                    return
                self._answered.wait(min(left, 0.05))

    def recall(self, requester, reserve_bytes: int = 0, need_bytes: int = 0) -> bool:
        """Asks every other live client that maps pages ahead for them (a
        RECALL notice each, unless one is on its way) and waits up to wait_s
        for their answers, or until the pool has `need_bytes` free beyond
        others' reservations (0: every answer); False when nobody maps any.
        So a client that does not answer holds the requester only while the
        others' answers fall short, and only until its recall is wait_s old,
        whenever the requester came: later recalls do not wait for it again
        until it answers (a hung client would hold every asker up for
        wait_s). What they free stays reserved for the requester's retry, as
        in reclaim(). A client keeps maps_ahead until
        it gave them back (gave_back_ahead): meanwhile its own refusals still
        send it to its pages ahead first (service.py)."""
        asked = []
        for session in self._sessions():
            if session is requester or session.state != LIVE or not session.maps_ahead:
                continue
            if not asked:
                self._reserve(requester, reserve_bytes)
            with self._mu:
                pending = session.recall_id is not None
                if not pending:
                    session.recall_id = notice_id = next(self._ids)
                    session.recall_sent_s = time.monotonic()
                overdue = pending and time.monotonic() - session.recall_sent_s >= self.wait_s
            if overdue:
                continue
            if pending:
                asked.append(session)
            elif session.notify({"notice": "recall", "id": notice_id, "deadline_s": self.wait_s,
                                 "reason": f"client '{requester.name}' needs memory"}):
                asked.append(session)
            else:
                self.answered(session, notice_id)
        if asked:
            self._notified()
            # A client no longer live frees nothing more by answering.
            # A recall wait_s old is given up on: its client may never answer.
            self._wait(lambda: all(s.recall_id is None or s.state != LIVE
                                   or time.monotonic() - s.recall_sent_s >= self.wait_s for s in asked),
                       enough=(lambda: self._has_free(requester, need_bytes)) if need_bytes > 0 else None)
        return bool(asked)

    def _has_free(self, requester, need_bytes: int) -> bool:
        """Whether the pool has `need_bytes` free beyond what is reserved for
        others' retries."""
        return self._free_bytes is not None and self._available(requester) >= need_bytes

    def reclaim(self, requester, need_bytes: int, reserve_bytes: int = 0) -> bool:
        """Recalls pages ahead (recall()); when the pool's free memory is
        still short of `need_bytes`, asks lower-priority clients above their
        guarantee, then equals above their fair share (_victims), for what
        it lacks, and waits up to wait_s; False when there was nobody to
        ask, or not enough to cover it. When it asked, `reserve_bytes` stay
        reserved for the requester's retry from before the first notice
        until unreserve() (or reserve_s). Raises OutOfMemory, asking nobody,
        when max_waits allocations wait already."""
        if not self._waits.acquire(blocking=False):
            raise self._too_many_waits("the pool is out of memory")
        try:
            return self._reclaim(requester, need_bytes, reserve_bytes)
        finally:
            self._waits.release()

    def _reclaim(self, requester, need_bytes: int, reserve_bytes: int) -> bool:
        recalled = self.recall(requester, reserve_bytes, need_bytes)
        if recalled and self._has_free(requester, need_bytes):
            return True
        # What the pool lacks, asked of the victims in order, below what
        # each was told to give back already (but for what this requester's
        # own notices asked: a retry's, which are its to take); and only
        # when they can cover it all: a victim that gives back less than
        # the retry needs preempts its requests for nothing.
        shortfall = max(need_bytes - self._available(requester), self.chunk_bytes)
        asks = []
        for victim, floor in self._victims(requester, need_bytes):
            with self._mu:
                base = self._coming_back(victim, requester)
            ask = min(base - floor, shortfall)
            if ask > 0:
                asks.append((victim, floor, ask))
                shortfall -= ask
            if shortfall <= 0:
                break
        if not asks or shortfall > 0:
            return recalled
        self._reserve(requester, reserve_bytes)
        reason = f"client '{requester.name}' (priority {requester.priority}) needs memory"
        for victim, floor, ask in asks:
            equal = victim.priority == requester.priority
            self._ask(victim, lambda base, floor=floor, ask=ask: max(floor, base - ask),
                      reason + (", and it maps less than its fair share" if equal else ""), requester, equal)
        # A victim no longer live (quarantined, closed) frees nothing more by answering.
        self._wait(lambda: all(v.owed_target is None or v.state != LIVE for v, _, _ in asks))
        return True

    def _available(self, requester) -> int:
        """The pool's free bytes beyond what is reserved for others' retries."""
        if self._free_bytes is None:
            return 0
        with self._gate:
            return max(0, self._free_bytes() - self._reserved_for_others(requester))

    def _victims(self, requester, need_bytes: int) -> list:
        """Whom reclaim asks, in order, with the bytes each may keep: lower
        priorities first (lowest first), down to their guarantee; then the
        requester's equals above their fair share, largest first, down to
        it (_fair_shares). Equals are asked only by a requester that stays
        within its own share with what it asks and owes nothing itself: two
        equal engines on one pool settle at a share each, and neither
        preempts the other's requests to run more than its share (they
        would take turns recomputing)."""
        sessions = self._sessions()
        if requester not in sessions:
            # Its session ended while it waited for its recall (its process
            # exited): its retry fails, and no client gives memory back for it.
            return []
        live = [s for s in sessions if s is not requester and s.state == LIVE]
        victims = [(s, s.guaranteed_bytes) for s in sorted(live, key=lambda s: s.priority)
                   if s.priority < requester.priority and s.mapped_bytes(self.chunk_bytes) > s.guaranteed_bytes]
        with self._mu:
            owing = requester.owed_target is not None
        if not owing and self.capacity_bytes:
            shares = self._fair_shares(requester, need_bytes, sessions)
            if shares is not None:
                victims += [(s, share) for s, share in shares]
        return victims

    def _fair_shares(self, requester, need_bytes: int, sessions: list):
        """The requester's equals that map more than their fair share, with
        that share, largest first; None when the requester's own demand
        (what it maps and asks) passes its share. `sessions`: the open
        sessions, the requester among them (read once by the caller: a
        second read may find it gone).

        The shares split what the equals contend for (the pool less what
        higher priorities map, what lower ones keep by their guarantee, and
        what sessions no longer live hold) max-min fairly: each client gets
        its demand up to one level, and at least its guarantee; a client
        that maps little (or nothing) leaves the rest of its share to the
        others. An equal's demand is what it maps; its limit bounds it."""
        contended = self.capacity_bytes
        demands = {}  # session -> (demand, guarantee)
        for s in sessions:
            mapped = s.mapped_bytes(self.chunk_bytes)
            if s is requester:
                demands[s] = (mapped + need_bytes, s.guaranteed_bytes)
            elif s.state != LIVE or s.priority > requester.priority:
                contended -= mapped
            elif s.priority < requester.priority:
                contended -= min(mapped, s.guaranteed_bytes)
            elif mapped > 0:
                demands[s] = (min(mapped, s.limit_bytes) if s.limit_bytes else mapped, s.guaranteed_bytes)
        level = self._fair_level(contended, demands.values())
        demand, guarantee = demands[requester]
        if demand > max(level, guarantee):
            return None
        shares = [(s, max(level, g)) for s, (d, g) in demands.items() if s is not requester and d > max(level, g)]
        return sorted(shares, key=lambda sg: sg[1] - sg[0].mapped_bytes(self.chunk_bytes))

    def _fair_level(self, contended: int, demands) -> int:
        """The highest level, in whole chunks, at which every client's
        max(guarantee, min(demand, level)) fits in `contended` bytes."""
        demands = list(demands)

        def total(level: int) -> int:
            return sum(max(g, min(d, level)) for d, g in demands)

        chunk = self.chunk_bytes
        low, high = 0, max(d for d, _ in demands) // chunk + 1
        while low < high:  # the highest level (in chunks) whose total fits
            mid = (low + high + 1) // 2
            if total(mid * chunk) <= contended:
                low = mid
            else:
                high = mid - 1
        return low * chunk

    def ask_back(self, session, target_bytes: int, reason: str, for_limit: bool = False) -> None:
        """Asks `session` to come down to mapping `target_bytes` (a RECLAIM
        notice for the excess, with a deadline); a no-op when it maps no more.
        `for_limit`: the operator's limit asks it, not another client."""
        self._ask(session, lambda base: target_bytes, reason, for_limit=for_limit)

    def _coming_back(self, victim, asker) -> int:
        """What `victim` maps less what notices told it to give back and it
        has not yet, plus what `asker`'s own notices asked of that (theirs
        to take on a retry): the bytes `asker` may still ask below. Under
        _mu."""
        mapped = victim.mapped_bytes(self.chunk_bytes)
        told = mapped if victim.announced is None else min(mapped, victim.announced)
        return min(mapped, told + victim.asked_by.get(asker, 0))

    def _ask(self, session, target, reason: str, asker=None, share_cap: bool = False, for_limit: bool = False) -> int:
        """Sends `session` a reclaim notice down to target(base) bytes, base
        as _coming_back reads it; read and lowered under one lock, so that
        two askers at once each ask for their own bytes, and an asker's
        retry does not ask again for what its notice asked. The notice
        carries what it adds to what the client was told (the client frees
        each notice's bytes). Returns those bytes. `share_cap`: `asker`'s
        equal, asked down to its fair share, which it may not map past until
        the notice's deadline or the asker's end (admit)."""
        mapped = session.mapped_bytes(self.chunk_bytes)
        with self._mu:
            target_bytes = target(self._coming_back(session, asker))
            if mapped <= target_bytes:
                return 0
            # Owed even when no notice adds to what it was told: it was told.
            session.owed_target = (target_bytes if session.owed_target is None
                                   else min(session.owed_target, target_bytes))
            if not for_limit:
                session.owed_reclaim = (target_bytes if session.owed_reclaim is None
                                        else min(session.owed_reclaim, target_bytes))
            session.owed_deadline = time.monotonic() + self.notice_deadline_s
            if share_cap:
                session.share_cap = (target_bytes, session.owed_deadline, asker)
            told = mapped if session.announced is None else min(mapped, session.announced)
            if told <= target_bytes:
                return 0
            session.announced = target_bytes
            if asker is not None:
                session.asked_by[asker] = session.asked_by.get(asker, 0) + told - target_bytes
        session.notify({"notice": "reclaim", "id": next(self._ids), "bytes": told - target_bytes,
                        "deadline_s": self.notice_deadline_s, "reason": reason})
        self._notified()
        return told - target_bytes
