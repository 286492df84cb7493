"""The broker's gRPC service: sessions and the instruction set over one
manager that maps nothing (record_mappings) and exports every chunk once.

Each call authenticates its lease, then runs under the session's lock, so
one client's calls are serialised (a client's own worker sends them one at
a time anyway) while different clients run concurrently on the manager,
which is thread safe. A reply carries the page states of the client's spaces
that the call changed (drained from the manager under the same lock), so the
client maps exactly what the broker accounted for.

Sessions (src/vtm/broker/session.py has their states): Hello opens one, PENDING;
the client then attaches its channel on the fd socket, where the kernel
gives its pid and the broker opens a pidfd, watched by the reactor (one
thread for every session). The session's memory is freed when the client
says goodbye there or its process exits; its channel ending while the
process lives quarantines it (nothing freed, nothing served). No thread is
held per session.

What a client can make the broker hold is bounded: at most max_sessions
sessions (Hello beyond is RESOURCE_EXHAUSTED), of which one process holds at
most max_sessions_per_process (its attach beyond is refused: a client that
leaks sessions leaves room to the others), at most max_calls_per_client
gRPC calls in flight a client (one past it is refused at once: a call that
waits, for memory, a session's lock or the manager, holds one of the
server's fixed gRPC threads, and one client must not hold them all; see
_in_flight for what a client is; the step socket serves a session one op at
a time on each of its 2 connections, on the reactor's workers), at most
MAX_SPACES spaces a
session, and page tables (slots x pages a slot) of at most the budget one
space of the manager may have (vtm.limits.page_table_budget) a session;
a closed space leaves nothing behind (the manager erases it). The host
tier's per-name accounts are forgotten once no session has the name and no
prefix is charged to it (_forget_idle_accounts), so clients that connect
under ever new names do not grow them either.

Invariants:
  * sessions holds every session not CLOSED, by lease; a session is removed
    and closed (its spaces closed, which releases its vTensors) exactly
    once, and only on goodbye, its process's exit, an attach that never came,
    or the broker stopping;
  * a call only ever names spaces and vTensors of its own LIVE session;
  * the granted guarantees of all sessions sum to at most the capacity;
  * while stopping, no session is admitted and no operation starts;
  * _calls_in_flight[caller] counts the caller's gRPC calls on the Unix
    socket between their start (after the lease's check) and their end, at
    most max_calls_per_client, and holds no caller with none (_in_flight).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import socket
import threading
import time

import grpc

import vtm
from vtm.broker import status, step_channel
from vtm.broker.policy import Policy
from vtm.broker.quota import Ask, grant
from vtm.broker.seqpacket import peer_pidfd
from vtm.broker.session import CLOSED, LIVE, PENDING, QUARANTINED, Session
from vtm.limits import page_table_budget, page_table_entries
from vtm.proto.vtm.v1 import vtm_pb2, vtm_pb2_grpc

log = logging.getLogger("vtm.broker")

_MAX_COUNT = 1 << 62  # sizes above this are malformed (the manager takes int64)
MAX_NAME = 256  # characters of a client's or a space's name
MAX_NAMESPACE = 1024  # of a namespace (FlexInfer's hold a model fingerprint, a dtype, a salt, layers)
_ATTACH_S = 10.0  # a session whose channel never attaches is dropped after this
# A process being killed closes its sockets (its channel ends) a moment
# before its pidfd reports the exit: only a session still quarantined this
# long after is one whose process lives on, which the operator is told of.
_QUARANTINE_WARN_S = 1.0
MAX_SPACES = 64  # per session
# gRPC calls one client (a process: _in_flight) may have in flight (vtmd
# --max-calls-in-flight-per-client): vtm.connect sends a session's calls one at
# a time from its worker thread, plus stats(timeout=...) from a metrics thread,
# so 4 leaves an engine's session room for a call it gave up on (its deadline
# passed) that still runs here, while a process holds at most an eighth of the
# 32 gRPC threads.
MAX_CALLS_IN_FLIGHT = 4
# The caller _in_flight counts a call against when it cannot name the process:
# the call carries no lease of an attached session.
UNIDENTIFIED = None
# A prefix tree listed in one reply (PrefixNodes), in bytes of its index:
# at 4 bytes a token there and at least 1 in a reply, a larger tree's reply
# passes the 4 MiB a gRPC client receives by default. Listing it anyway built
# ~13 bytes a token in vtmd for every call, whatever the client could take,
# and the index budget grows with the pool (an eighth of it and the tier).
MAX_LISTED_INDEX_BYTES = 16 << 20


def _count(value: int, what: str) -> int:
    if value >= _MAX_COUNT:
        raise vtm.InvalidArgument(f"{what} {value} is out of range")
    return value


def _label(value: str, what: str, most: int = MAX_NAME) -> str:
    """A name a client gives: the broker keeps it for the session's life
    and shows it (stats, vtmctl), so it is short and printable, or a client
    could make the broker hold megabytes per space and print control
    characters to an operator's terminal."""
    if len(value) > most or not value.isprintable():
        raise vtm.InvalidArgument(f"{what} must be at most {most} printable characters, got {len(value)} "
                                  f"characters{'' if value.isprintable() else ' with control characters'}")
    return value


def sessions_per_process(max_sessions: int) -> int:
    """The sessions one process may hold: a quarter of --max-sessions, at
    least 16 (and at most all of them). A client that leaks sessions (a new
    connect per request, say) then leaves room to the others; a process
    that needs more is one the operator sizes --max-sessions for."""
    return min(max_sessions, max(16, max_sessions // 4))


def _process_exited(pidfd: int) -> bool:
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


class BrokerService(vtm_pb2_grpc.BrokerServicer):
    def __init__(self, manager, backend: str, device: int, fd_socket: str, reactor, quotas, max_sessions: int,
                 max_calls_per_client: int = MAX_CALLS_IN_FLIGHT):
        self.manager = manager
        self._chunk_bytes = manager.chunk_bytes
        self._backend = backend
        self._device = device
        self._fd_socket = fd_socket
        self.step_socket = ""  # advertised in Hello once its server listens
        self.session_ended: list = []  # f(session) for each side socket: ends the session's connections
        self._evicted: dict[str, None] = {}  # leases ended before their attach to make room, oldest first
        self._reactor = reactor
        self.quotas = quotas  # guarded by _mu
        self.max_sessions = max_sessions
        self.max_sessions_per_process = sessions_per_process(max_sessions)
        self.max_calls_per_client = max_calls_per_client
        # pid (or UNIDENTIFIED) -> its gRPC calls in flight (_in_flight), under _mu.
        self._calls_in_flight: dict[int | None, int] = {}
        self._unidentified_refused = False  # logged once (_in_flight)
        # A session's spaces together: what one space of the manager may have.
        self._table_budget = page_table_budget(manager.capacity_bytes, self._chunk_bytes)
        self._mu = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._next_client = 1
        # The host tier charges the prefixes a client records to its name's
        # account (quota.py): name -> account, while a session has the name
        # or a prefix is charged to it. Numbers of forgotten accounts are
        # reused; the idle ones are looked for once the accounts reach
        # _sweep_at (see _forget_idle_accounts).
        self._tier_accounts: dict[str, int] = {}
        self._free_accounts: list[int] = []
        self._next_account = 1
        self._sweep_at = max_sessions
        # Names whose account a space is being created with (count), and
        # names whose account was taken since a sweep began: neither is
        # forgotten by that sweep.
        self._tier_users: dict[str, int] = {}
        self._tier_touched: set[str] = set()
        self._tier_mu = threading.Lock()  # orders the host-tier limits given to the manager
        self._has_tier = manager.stats()["host_tier_capacity_bytes"] > 0
        self._stopping = False
        self.policy = Policy(self._open_sessions, manager.chunk_bytes, self._free_bytes,
                             capacity_bytes=manager.capacity_bytes)
        self._reaper_stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="vtmd-reaper", daemon=True)
        self._reaper.start()

    # -- sessions ---------------------------------------------------------

    def _open_sessions(self) -> list[Session]:
        with self._mu:
            return list(self._sessions.values())

    def lookup(self, lease: str):
        with self._mu:
            return self._sessions.get(lease)

    def _session(self, context) -> Session:
        lease = dict(context.invocation_metadata()).get(status.LEASE_KEY)
        session = self.lookup(lease) if lease else None
        if session is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "no valid lease: say Hello first (or the session ended)")
        return session

    def attach(self, session: Session, conn) -> None:
        """Makes `conn` (on the fd socket) the session's channel: its peer's
        pid, from the kernel, becomes the session's, and its exit ends the
        session. Refused past max_sessions_per_process sessions of that
        process (live, quarantined or attaching): the session stays pending,
        ended by the reaper, or first by a Hello at --max-sessions."""
        with session.lock:  # and so before end_session can close the pidfd
            if session.state != PENDING:
                raise vtm.FailedPrecondition(f"the session is {session.state}, not waiting to attach")
            # Counted and claimed at once (the pid of an attach under way
            # counts), so that attaches racing from one process cannot
            # each find room.
            with self._mu:
                held = sum(1 for s in self._sessions.values() if s.pid == conn.pid and s.state != CLOSED)
                if held < self.max_sessions_per_process:
                    session.pid = conn.pid
            if session.pid != conn.pid:
                raise vtm.OutOfMemory(
                    f"process {conn.pid} holds {held} sessions of vtmd already, as many as one process may "
                    f"(a quarter of --max-sessions, at least 16): close one first")
            try:
                self._watch_process(session, conn)
            except BaseException:
                session.pid = None
                raise

    def _watch_process(self, session: Session, conn) -> None:
        """The rest of an attach (the session's lock held): its process's
        exit ends the session from now on."""
        try:
            pidfd = peer_pidfd(conn.sock, conn.pid)
        except OSError as exc:
            raise vtm.Unavailable(f"cannot watch process {conn.pid}: {exc}") from None
        try:
            # Readable once the process has exited (at once if it already has).
            self._reactor.watch(pidfd, lambda fd: self._pidfd_ready(session, fd))
        except OSError as exc:
            os.close(pidfd)
            raise vtm.Unavailable(f"cannot watch process {conn.pid}: {exc}") from None
        session.pidfd, session.channel, session.state = pidfd, conn, LIVE

    def _pidfd_ready(self, session: Session, fd: int) -> None:
        """The reactor's callback for a session's pidfd. It may run for a
        report about an earlier fd of the same number, closed since (the
        reactor's invariants): the pidfd of a session that ended by its
        channel or a goodbye, whose number a new session's pidfd took. That
        ended the new session while its process lived, and its chunks went to
        other clients while the process still mapped them. So the session
        ends only when this is its pidfd and its process has exited; else the
        watch, one-shot, is armed again for the real exit."""
        if session.pidfd != fd:
            return
        if _process_exited(fd):
            self.end_session(session)
        else:
            self._reactor.rearm(fd)

    def evicted(self, lease: str) -> bool:
        """Whether `lease` was ended before its attach to make room."""
        with self._mu:
            return lease in self._evicted

    def attached(self, session: Session) -> None:
        """The client has the reply to its attach: a set-quota between Hello
        and the attach found no channel to tell, so it hears its grant as
        it stands now, which Hello's reply may predate."""
        with self._mu:
            self._notify_quota(session)

    def _notify_quota(self, session: Session) -> None:
        """Tells the client its grant as it stands (with _mu held: grants
        change under it, so the last notice sent carries the last grant)."""
        session.notify({"notice": "quota", "priority": session.priority,
                        "guaranteed_bytes": session.guaranteed_bytes, "limit_bytes": session.limit_bytes})

    def channel_closed(self, session: Session) -> None:
        """The session's channel ended: if its process lives, the session is
        quarantined (its chunks may still be mapped there), else it ends."""
        with session.lock:
            if session.state != LIVE:
                return
            if not _process_exited(session.pidfd):
                session.state, session.channel = QUARANTINED, None
                session.quarantined_at = time.monotonic()  # the reaper warns of it if it lasts
                return
        self.end_session(session)

    def ack(self, session: Session, notice_id) -> None:
        """The client answered notice `notice_id`: a reclaim notice's debt
        may be paid, a recall notice is answered."""
        self.policy.settle(session)
        self.policy.answered(session, notice_id)

    def end_session(self, session: Session) -> None:
        """Releases everything the client holds; its chunks go back to the
        pool, except those the prefix tree still references for others."""
        with self._mu:
            if self._sessions.get(session.lease) is not session:
                return
            del self._sessions[session.lease]
        with session.lock:
            session.state = CLOSED
            for space_id, space in list(session.spaces.items()):
                try:
                    space.close()
                    self.manager._drain_effects(space_id)
                except vtm.Error:
                    pass  # counted by the manager (rollback_failures_total); nothing else to do
            session.spaces.clear()
            session.space_names.clear()
            session.space_entries.clear()
            session.vtensors.clear()
            session.vt_state.clear()
            session.geometry.clear()
            session.pages.clear()
            session.serial_refs.clear()
            session.chunk_of.clear()
            pidfd, channel = session.pidfd, session.channel
            session.pidfd = session.channel = None
        self.policy.session_ended(session)
        for end_connections in self.session_ended:
            end_connections(session)
        if pidfd is not None:
            self._reactor.unwatch(pidfd)
            os.close(pidfd)
        if channel is not None:
            try:
                channel.sock.shutdown(socket.SHUT_RDWR)  # the fd server sees the end and closes it
            except OSError:
                pass

    def _make_room_for_a_session(self) -> bool:
        """At --max-sessions, ends the oldest session that said Hello and has
        not attached: a client attaches within milliseconds of its Hello,
        and Hellos nobody attaches (one process can send hundreds a second;
        no pid is known before the attach) must not lock the others out
        for _ATTACH_S. Whether there is room now (another Hello may take it
        first: the caller tries again). An ended lease is remembered, so
        that its client is told why when it attaches (and says Hello again)."""
        with self._mu:
            if len(self._sessions) < self.max_sessions:
                return True
            pending = [s for s in self._sessions.values() if s.state == PENDING]
        for session in sorted(pending, key=lambda s: s.created_at):
            with session.lock:
                if session.state != PENDING:
                    continue  # it attached meanwhile
                session.state = CLOSED  # so it cannot attach any more
            log.warning("vtmd serves at most %d sessions: ending client %d ('%s'), which said Hello %.1f s ago and "
                        "has not attached, to make room", self.max_sessions, session.client_id, session.name,
                        time.monotonic() - session.created_at)
            with self._mu:
                self._evicted[session.lease] = None
                while len(self._evicted) > self.max_sessions:
                    del self._evicted[next(iter(self._evicted))]
            self.end_session(session)
            return True
        return False

    def _reap(self) -> None:
        while not self._reaper_stop.wait(1.0):
            now = time.monotonic()
            with self._mu:
                stale = [s for s in self._sessions.values() if s.state == PENDING and now - s.created_at > _ATTACH_S]
                cut_off = [s for s in self._sessions.values() if s.state == QUARANTINED
                           and s.quarantined_at is not None and now - s.quarantined_at >= _QUARANTINE_WARN_S]
                for session in cut_off:
                    session.quarantined_at = None  # warned once
            for session in cut_off:
                log.warning("client '%s' (pid %d) lost its channel while it lives: its %d bytes are quarantined "
                            "until it exits or says goodbye", session.name, session.pid,
                            session.mapped_bytes(self._chunk_bytes))
            for session in stale:
                with session.lock:
                    if session.state != PENDING:
                        continue  # it attached meanwhile
                    session.state = CLOSED  # so it cannot attach any more
                self.end_session(session)

    def stop_admitting(self) -> None:
        with self._mu:
            self._stopping = True
            sessions = list(self._sessions.values())
        for session in sessions:
            session.notify({"notice": "shutdown", "reason": "the broker is stopping"})

    def close_all(self) -> None:
        self._reaper_stop.set()
        with self._mu:
            sessions = list(self._sessions.values())
        for session in sessions:
            self.end_session(session)

    def clients(self, tier: dict | None = None) -> list[dict]:
        """`tier`: the manager's stats()["host_tier_accounts"], where the caller has them."""
        with self._mu:
            sessions = list(self._sessions.values())
            accounts = dict(self._tier_accounts)
        chunk_bytes = self.manager.chunk_bytes
        if tier is None:
            tier = self.manager.stats()["host_tier_accounts"] if accounts else {}
        return [{"id": s.client_id, "name": s.name, "pid": s.pid, "state": s.state, "priority": s.priority,
                 "guaranteed_bytes": s.guaranteed_bytes, "limit_bytes": s.limit_bytes,
                 "host_tier_bytes": tier.get(accounts.get(s.name), {}).get("used_bytes", 0),
                 "host_tier_limit_bytes": s.host_tier_limit_bytes,
                 "mapped_bytes": s.mapped_bytes(chunk_bytes), "spaces": len(s.spaces),
                 "vtensors": len(s.vtensors), "owes_bytes": (0 if s.owed_target is None else
                                                             max(0, s.mapped_bytes(chunk_bytes) - s.owed_target))}
                for s in sessions]

    def _tier_names_offline(self, tier: dict, clients: list[dict]) -> list[dict]:
        """The names with prefixes in the host tier and no session: a prefix
        outlives its session, and without these rows the tier's use would
        not add up to the clients'."""
        online = {c["name"] for c in clients}
        with self._mu:
            return [{"name": name, "host_tier_bytes": tier[account]["used_bytes"],
                     "host_tier_limit_bytes": self.quotas.offered(name).host_tier_limit_bytes}
                    for name, account in sorted(self._tier_accounts.items())
                    if name not in online and tier.get(account, {}).get("used_bytes")]

    # -- plumbing ------------------------------------------------------------

    def _run(self, context, body, session_required=True, counted=True):
        """Runs body(session) under the session lock, mapping vtm errors to
        codes; a lease-free call runs body(None) (no lease needed, none taken).
        `counted`: the call holds one of the Unix socket's gRPC threads, so it
        counts against its caller's calls in flight (_in_flight); the TCP
        control listener's calls run on threads of its own (control.py)."""
        try:
            if self._stopping:
                raise vtm.Unavailable("the broker is stopping")
            if not session_required:
                with self._in_flight(self._caller(context)) if counted else contextlib.nullcontext():
                    return body(None)
            session = self._session(context)
            with self._in_flight(session), session.lock:
                if session.state == PENDING:
                    raise vtm.FailedPrecondition("attach the session's channel (the fd socket) first")
                if session.state != LIVE:
                    context.abort(grpc.StatusCode.UNAUTHENTICATED, f"the session is {session.state}")
                return body(session)
        except vtm.Error as exc:
            context.set_trailing_metadata(((status.ERROR_KEY, type(exc).__name__),))
            context.abort(status.code_of(exc), str(exc))
        except (TypeError, ValueError, OverflowError) as exc:
            # Malformed input the manager's binding rejected before running.
            context.set_trailing_metadata(((status.ERROR_KEY, "InvalidArgument"),))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def _caller(self, context) -> Session | None:
        """The session whose lease a lease-free call carries (vtm.connect
        sends it with stats, trim and check), or None: a lease-free call
        needs none, so one it lacks, or one no longer valid, is no error."""
        lease = dict(context.invocation_metadata()).get(status.LEASE_KEY)
        return self.lookup(lease) if lease else None

    @contextlib.contextmanager
    def _in_flight(self, session: Session | None):
        """Counts a gRPC call while it runs against its client; refuses it at
        once, changing nothing, when that client has max_calls_per_client in
        flight already.

        A client is a process, named by the pid the kernel gave at the attach
        of the session whose lease the call carries: every session of one
        process shares one count, whatever names they connect under (a name is
        a label a client picks: counted by name, a process would get round the
        cap by picking new ones, and replicas sharing a name would refuse each
        other). Calls that name no attached session (Hello, which comes before
        any; calls of a session not attached yet; vtmctl's, which carry no
        lease) share one count of their own, UNIDENTIFIED: gRPC tells the
        server nothing of a Unix socket's peer (no pid), and a caller vtmd
        cannot tell apart from another must not get a count per call, or a
        flood of them (of Hellos, say) would hold every thread. So a process
        holds at most max_calls_per_client threads with its sessions, and all
        callers without one together as many; vtm.connect tries a Hello
        refused for this again until its deadline (client.py).
        The step socket needs no count: each of a session's connections
        there is served one datagram at a time (reactor.py)."""
        most = self.max_calls_per_client
        with self._mu:
            caller = UNIDENTIFIED if session is None else session.pid  # None until the attach
            held = self._calls_in_flight.get(caller, 0)
            refused = held >= most
            if not refused:
                self._calls_in_flight[caller] = held + 1
            elif caller is UNIDENTIFIED:
                first_refusal, self._unidentified_refused = not self._unidentified_refused, True
            else:
                first_refusal, session.calls_refused = not session.calls_refused, True
        if refused:
            calls = f"{most} call" if most == 1 else f"{most} calls"
            # Once a session, and once for the unidentified callers: a client
            # that keeps trying must not flood the log.
            if caller is UNIDENTIFIED:
                if first_refusal:
                    log.warning("callers without an attached session (Hello, vtmctl) keep more than %d calls in "
                                "flight: vtmd refuses the excess (--max-calls-in-flight-per-client)", most)
                raise vtm.OutOfMemory(f"callers without an attached session (Hello, vtmctl) have {calls} in "
                                      f"flight already, as many as vtmd serves a client at once "
                                      f"({status.CALLS_IN_FLIGHT_FLAG} {most}): wait for one to end")
            if first_refusal:
                log.warning("process %d (client %d, '%s') keeps more than %d calls in flight over its sessions: vtmd "
                            "refuses the excess (--max-calls-in-flight-per-client)", caller, session.client_id,
                            session.name, most)
            raise vtm.OutOfMemory(f"process {caller} (client '{session.name}') has {calls} in flight already "
                                  f"over its sessions together, as many as vtmd serves a client at once "
                                  f"({status.CALLS_IN_FLIGHT_FLAG} {most}): wait for one to end")
        try:
            yield
        finally:
            with self._mu:
                self._calls_in_flight[caller] -= 1
                if not self._calls_in_flight[caller]:
                    del self._calls_in_flight[caller]

    def calls_in_flight(self) -> dict[int | None, int]:
        """pid (UNIDENTIFIED: callers without an attached session) -> its
        gRPC calls in flight (the tests read it)."""
        with self._mu:
            return dict(self._calls_in_flight)

    def run_op(self, session: Session, body):
        """Runs body() under the session lock for the step socket
        (src/vtm/broker/step_channel.py), as _run does for gRPC: vtm errors
        propagate; input the manager's binding rejected is InvalidArgument."""
        if self._stopping:
            raise vtm.Unavailable("the broker is stopping")
        with session.lock:
            if session.state != LIVE:
                raise vtm.Unavailable(f"the session is {session.state}")
            try:
                return body()
            except vtm.Error:
                raise
            except (TypeError, ValueError, OverflowError) as exc:
                raise vtm.InvalidArgument(str(exc)) from None

    def _space(self, session: Session, space_id: int):
        space = session.spaces.get(space_id)
        if space is None:
            raise vtm.NotFound(f"no space {space_id} in this session")
        return space

    def _vtensor(self, session: Session, vt_id: int):
        vt = session.vtensors.get(vt_id)
        if vt is None:
            raise vtm.FailedPrecondition(f"vTensor {vt_id} is not live (already released)")
        return vt

    def collect(self, session: Session, vtensors=(), closed=()):
        """What a call changed, for a transport to encode: (groups, states,
        fresh). groups: (space id, closed, page effects) of the session's
        spaces the call changed; states: (id, VTensorState or None when
        released) of the vTensors with ids `vtensors`; fresh: the
        serials the client maps now and mapped nowhere before."""
        groups, fresh = [], []
        for space_id in list(session.spaces) + list(closed):
            effects = self.manager._drain_effects(space_id)
            if not effects and space_id not in closed:
                continue
            fresh += session.note_effects(space_id, effects)
            self.policy.settle(session)
            groups.append((space_id, space_id in closed, effects))
        states = [(vt_id, session.vt_state.get(vt_id)) for vt_id in vtensors]
        return groups, states, [s for s in dict.fromkeys(fresh) if s in session.chunk_of]

    def _reply(self, session: Session, vtensors=(), closed=(), **fields) -> vtm_pb2.OpReply:
        """An OpReply with what the call changed (see collect)."""
        reply = vtm_pb2.OpReply(**fields)
        groups, states, _ = self.collect(session, vtensors, closed)
        for space_id, is_closed, effects in groups:
            reply.effects.append(vtm_pb2.SpaceEffects(
                space_id=space_id, closed=is_closed,
                pages=[vtm_pb2.PageEffect(slot=s, page=p, chunk=c, serial=n) for s, p, c, n in effects]))
        for vt_id, state in states:
            if state is None:
                reply.vtensors.append(vtm_pb2.VTensorState(vtensor_id=vt_id, released=True))
            else:
                reply.vtensors.append(vtm_pb2.VTensorState(vtensor_id=vt_id, space_id=state.space_id,
                                                           slot=state.slot, num_tokens=state.num_tokens,
                                                           low=state.low))
        return reply

    def _pages_for(self, session: Session, space_id: int, num_tokens: int) -> int:
        return -(-num_tokens * session.geometry[space_id][0] // self._chunk_bytes)

    def _partial_page_bytes(self, session: Session, space_id: int, num_tokens: int) -> int:
        """The chunk an op may copy a page ending mid-way at row
        `num_tokens` into (0 when the rows end on a page boundary)."""
        return self._chunk_bytes if num_tokens * session.geometry[space_id][0] % self._chunk_bytes else 0

    def _full_pages(self, session: Session, space_id: int, num_tokens: int) -> int:
        return num_tokens * session.geometry[space_id][0] // self._chunk_bytes

    def _shrink_copy_bytes(self, session: Session, vt_id: int, num_tokens: int) -> int:
        """The chunk a shrink of the vTensor to `num_tokens` rows copies its
        new end page into: only when that page is partly kept and may be
        shared with the prefix tree (0 otherwise, as for a give-back of
        pages ahead, whose kept rows end on pages of the vTensor's own)."""
        state = session.vt_state[vt_id]
        if num_tokens >= state.num_tokens:
            return 0
        page = self._full_pages(session, state.space_id, num_tokens)
        return self._partial_page_bytes(session, state.space_id, num_tokens) if page < state.shared_pages else 0

    def _growth(self, session: Session, vt_id: int, num_tokens: int, low: int | None) -> tuple[int, int]:
        """(bytes, new bytes): what an extend of a vTensor to `num_tokens`
        rows and low mark `low` (None: kept) adds to the client's mapped
        bytes, net of the pages below the mark it unmaps, and the bytes of
        the pages it maps (taken from the pool, unless a page it unmaps
        moves there)."""
        state = session.vt_state[vt_id]
        low = state.low if low is None else low
        if num_tokens <= state.num_tokens and low == state.low:
            return 0, 0  # the common decode step: within what is mapped
        row_bytes, max_tokens = session.geometry[state.space_id]
        if num_tokens > max_tokens or low < state.low:
            return 0, 0  # the manager refuses it with InvalidArgument
        # A live vTensor maps exactly the pages covering its rows [low,
        # num_tokens) (the broker keeps no slot cache).
        chunk = self._chunk_bytes
        first, end = state.low * row_bytes // chunk, -(-state.num_tokens * row_bytes // chunk)
        new_first, new_end = low * row_bytes // chunk, max(end, -(-num_tokens * row_bytes // chunk))
        mapped = max(0, new_end - max(end, new_first))
        unmapped = max(0, min(new_first, end) - first)
        return max(0, mapped - unmapped) * chunk, mapped * chunk

    @staticmethod
    def _own_pages_ahead_first(session: Session, refused: vtm.OutOfMemory) -> vtm.OutOfMemory:
        if not session.maps_ahead:
            return refused
        return vtm.OutOfMemory(f"{status.OWN_PAGES_AHEAD}: {refused}")

    def _free_bytes(self) -> int:
        stats = self.manager.stats()
        return stats["capacity_bytes"] - stats["chunks_held"] * self._chunk_bytes

    def _allocate(self, session: Session, extra_bytes: int, op, gate_bytes: int | None = None,
                  speculative: bool = False, slot_space=None, recount=None):
        """Runs an allocating op under the policy: the client's limit and
        debts first; memory reserved for another client's retry left alone
        (`gate_bytes`, default extra_bytes: what the op may take); on out of
        memory, reclaim from lower priorities, with what they free reserved
        for this op, and retry once. Called with the session's lock held;
        `op` looks up what it works on when it runs (see below).
        `speculative` (rows mapped ahead of need) takes free memory only: it
        is refused at once rather than evict a cached prefix, reclaim, wait
        for memory reserved for another's retry, or add to a debt; within
        a limit it may take what the limit leaves. A client that maps pages
        ahead gets any refusal at once (status.OWN_PAGES_AHEAD): it gives
        them back and asks again before others are asked for anything.
        `slot_space`: the space whose slot the op takes; a refusal while it
        has no free slot is about the slot, and no other client can help.
        `recount()`: (extra_bytes, gate_bytes) counted again, for a retry
        after the wait (the client's other calls may have changed what the
        op adds: shrunk the vTensor it grows, say)."""
        gate_bytes = extra_bytes if gate_bytes is None else gate_bytes
        if speculative:
            self.policy.admit(session, extra_bytes)
            if not session.gives_back_ahead:
                raise vtm.OutOfMemory(f"client '{session.name}' does not give pages ahead back: it gets none")
            if session.owed_target is not None:
                raise vtm.OutOfMemory(f"client '{session.name}' owes memory: no pages ahead")
            if session.recall_id is not None:
                raise vtm.OutOfMemory(f"client '{session.name}' is asked for its pages ahead: no more of them")
            if self._free_bytes() < gate_bytes:
                raise vtm.OutOfMemory("pages ahead take free memory only, and the pool has too little")
            with self.policy.gate(session, gate_bytes, wait=False):
                self.policy.mapped_ahead(session)  # before the grant: a recall from now on asks for it
                return op()
        try:
            self.policy.admit(session, extra_bytes)
        except vtm.OutOfMemory as exc:
            raise self._own_pages_ahead_first(session, exc) from None
        try:
            with self.policy.gate(session, gate_bytes):
                return op()
        except vtm.OutOfMemory as exc:
            if slot_space is not None and slot_space.free_slots == 0:
                raise
            if session.maps_ahead:
                raise self._own_pages_ahead_first(session, exc) from None
            refused = exc
        # Waiting for lower priorities to answer takes up to the policy's
        # wait_s: not under this session's lock, so its other calls (an fd
        # fetch, its goodbye, its process's exit) are not held up meanwhile.
        # The session may change meanwhile, which the retry's op sees.
        session.lock.release()
        try:
            need = max(extra_bytes, gate_bytes)  # a step's net bytes may be less than its copies take
            asked = self.policy.reclaim(session, need, reserve_bytes=need)
        finally:
            session.lock.acquire()
        try:
            if not asked:
                raise refused
            if session.state != LIVE:
                raise vtm.Unavailable(f"the session is {session.state}")
            # Admitted again: the client's other calls may have mapped
            # memory while this one waited without the lock, or changed
            # what this one adds.
            if recount is not None:
                extra_bytes, gate_bytes = recount()
            try:
                self.policy.admit(session, extra_bytes)
            except vtm.OutOfMemory as exc:
                raise self._own_pages_ahead_first(session, exc) from None
            with self.policy.gate(session, gate_bytes):
                return op()
        finally:
            self.policy.unreserve(session)

    @contextlib.contextmanager
    def _tier_account(self, name: str):
        """The host-tier account of the clients named `name` (made on first
        use with the operator's host_tier_limit_bytes for the name), kept
        from being forgotten until the block, which creates a space with it,
        ends."""
        with self._mu:
            self._tier_users[name] = self._tier_users.get(name, 0) + 1
            self._tier_touched.add(name)
            account = self._tier_accounts.get(name)
        try:
            yield account if account is not None else self._apply_tier_limit(name)
        finally:
            with self._mu:
                self._tier_users[name] -= 1
                if not self._tier_users[name]:
                    del self._tier_users[name]

    def _apply_tier_limit(self, name: str, make: bool = True) -> int | None:
        """Gives the manager the operator's host-tier limit of `name` (making
        its account if needed, unless `make` is False); returns the account.
        Not under _mu: the manager's lock may be held through a long copy
        meanwhile, and every RPC needs _mu. _tier_mu orders the calls, so
        the last one applies the last quota stored."""
        with self._tier_mu:
            with self._mu:
                account = self._tier_accounts.get(name)
                sweep = account is None and make and len(self._tier_accounts) >= self._sweep_at
            if sweep:
                self._forget_idle_accounts()
            with self._mu:
                account = self._tier_accounts.get(name)
                if account is None and not make:
                    return None
                if account is None:
                    if self._free_accounts:
                        account = self._free_accounts.pop()
                    else:
                        account, self._next_account = self._next_account, self._next_account + 1
                    self._tier_accounts[name] = account
                limit = self.quotas.offered(name).host_tier_limit_bytes
            if self._has_tier:
                self.manager.set_host_tier_limit(account, limit)
            return account

    def _forget_idle_accounts(self) -> None:
        """Forgets the accounts of the names no session has and the manager
        finds unused (no open space records into them, no prefix is charged
        to them: nothing can charge them again), erases their limits and
        frees their numbers. Under _tier_mu, which every new account and
        limit takes too. A name whose account was taken since the sweep began
        (_tier_touched: a session that came, and maybe went, may have charged
        it), or is being taken (_tier_users), is kept. The sweep asks about
        every idle account: it runs when a new account would reach
        _sweep_at, which then doubles what survives (at least
        max_sessions), so the sweeps stay few per new name however many
        names keep prefixes."""
        with self._mu:
            self._tier_touched.clear()
            busy = {s.name for s in self._sessions.values()} | self._tier_users.keys()
            idle = {name: account for name, account in self._tier_accounts.items() if name not in busy}
        unused = set(self.manager.unused_host_tier_accounts(list(idle.values()))) if idle else set()
        with self._mu:
            busy = {s.name for s in self._sessions.values()} | self._tier_users.keys() | self._tier_touched
            gone = {name: account for name, account in idle.items() if account in unused and name not in busy}
            for name in gone:
                del self._tier_accounts[name]
            freed = list(gone.values())
            self._sweep_at = max(self.max_sessions, 2 * len(self._tier_accounts))
        if self._has_tier:
            for account in freed:
                self.manager.set_host_tier_limit(account, 0)  # 0 erases it
        with self._mu:
            self._free_accounts += freed

    # -- RPCs --------------------------------------------------------------

    def Hello(self, request, context):
        def body(_):
            asked = Ask(request.priority if request.HasField("priority") else None,
                        _count(request.guaranteed_bytes, "guaranteed_bytes")
                        if request.HasField("guaranteed_bytes") else None,
                        _count(request.limit_bytes, "limit_bytes") if request.HasField("limit_bytes") else None)
            capacity = self.manager.capacity_bytes
            named = _label(request.name, "a client name")
            while True:
                with self._mu:
                    client_id = self._next_client
                    name = named or f"client{client_id}"
                    granted = grant(self.quotas.offered(name), asked)
                    guaranteed = sum(s.guaranteed_bytes for s in self._sessions.values()) + granted.guaranteed_bytes
                    if guaranteed > capacity:
                        raise vtm.OutOfMemory(f"the sessions' guarantees would sum to {guaranteed} bytes, past the "
                                              f"capacity of {capacity}: ask for a smaller guarantee")
                    if len(self._sessions) < self.max_sessions:
                        self._next_client += 1
                        session = Session(client_id, name, asked, granted)
                        session.gives_back_ahead = request.gives_back_ahead
                        self._sessions[session.lease] = session
                        break
                # Admitted but for the cap: room is made only now.
                if not self._make_room_for_a_session():
                    raise vtm.OutOfMemory(f"vtmd serves at most {self.max_sessions} sessions (--max-sessions); "
                                          "try again when one ends")
            m = self.manager
            return vtm_pb2.HelloReply(lease=session.lease, client_id=client_id, backend=self._backend,
                                      device=self._device, chunk_bytes=m.chunk_bytes, capacity_bytes=capacity,
                                      granularity=m.granularity, fd_socket=self._fd_socket, name=name,
                                      step_socket=self.step_socket, priority=granted.priority,
                                      guaranteed_bytes=granted.guaranteed_bytes, limit_bytes=granted.limit_bytes)
        return self._run(context, body, session_required=False)

    def CreateSpace(self, request, context):
        def body(session):
            name = _label(request.name, "a space name") or f"space{session.next_space}"
            _label(request.namespace, "a namespace", MAX_NAMESPACE)
            if name in session.space_names.values():
                raise vtm.InvalidArgument(f"a space named '{name}' already exists")
            row_bytes = _count(request.row_bytes, "row_bytes")
            max_tokens = _count(request.max_tokens, "max_tokens")
            max_slots = _count(request.max_slots, "max_slots")
            entries = page_table_entries(row_bytes, max_tokens, max_slots, self._chunk_bytes)
            if entries > self._table_budget:
                raise vtm.InvalidArgument(
                    f"a space of {max_slots} slots of {max_tokens} rows of {row_bytes} bytes needs a page table of "
                    f"{entries} entries; a client may hold {self._table_budget} (by the pool's capacity)")
            if len(session.spaces) >= MAX_SPACES:
                raise vtm.OutOfMemory(f"a client may hold at most {MAX_SPACES} spaces; close one first")
            if session.table_entries + entries > self._table_budget:
                raise vtm.OutOfMemory(f"this client's spaces would need page tables of "
                                      f"{session.table_entries + entries} entries, more than the "
                                      f"{self._table_budget} a client may hold; close a space first")
            window_tokens = _count(request.window_tokens, "window_tokens")
            with self._tier_account(session.name) as account:
                space = self.manager.create_space(row_bytes, max_tokens, max_slots,
                                                  namespace=request.namespace or None,
                                                  name=f"c{session.client_id}/{name}", window_tokens=window_tokens,
                                                  tier_account=account)
            session.next_space += 1
            session.spaces[space.id] = space
            session.space_names[space.id] = name
            session.space_entries[space.id] = entries
            session.table_entries += entries
            session.geometry[space.id] = (space.row_bytes, space.max_tokens)
            return vtm_pb2.SpaceReply(space_id=space.id, name=name, namespace=space.namespace,
                                      row_bytes=space.row_bytes, max_tokens=space.max_tokens, max_slots=space.max_slots,
                                      slot_bytes=space.slot_bytes, pages_per_slot=space.pages_per_slot,
                                      window_tokens=space.window_tokens)
        return self._run(context, body)

    def CloseSpace(self, request, context):
        def body(session):
            space = self._space(session, request.space_id)
            space.close()
            del session.spaces[request.space_id]
            del session.space_names[request.space_id]
            del session.geometry[request.space_id]
            session.table_entries -= session.space_entries.pop(request.space_id)
            gone = [vt_id for vt_id, state in session.vt_state.items() if state.space_id == request.space_id]
            self._drop_vtensors(session, gone)
            return self._reply(session, vtensors=gone, closed=(request.space_id,))
        return self._run(context, body)

    # The hot ops, shared by the gRPC calls below and the step socket; each
    # runs under the session lock and leaves its page effects to collect().
    # Their ops look the space or vTensors up when they run: a retry after a
    # reclaim runs after the session's lock was let go (see _allocate).

    def create(self, session: Session, space_id: int, num_tokens: int, speculative: bool = False) -> int:
        space = self._space(session, space_id)
        n = _count(num_tokens, "num_tokens")
        extra = self._pages_for(session, space.id, min(n, session.geometry[space.id][1])) * self._chunk_bytes
        vt = self._allocate(session, extra, lambda: self._space(session, space_id).create(n).result(),
                            speculative=speculative, slot_space=space)
        session.add_vtensor(vt)
        return vt.id

    def extend(self, session: Session, vt_id: int, num_tokens: int, low: int | None = None) -> None:
        self.step(session, [(vt_id, num_tokens, low)], op="extend")

    def step(self, session: Session, targets, op: str = "step", speculative: bool = False) -> None:
        """targets: (vTensor id, tokens, low mark or None to keep it); a
        vTensor named twice gets the larger size and the larger mark. Each
        target is checked as the manager checks it (the merge must not
        hide a bad one)."""
        wanted = {}
        for vt_id, n, low in targets:
            state = session.vt_state.get(vt_id)
            self._vtensor(session, vt_id)
            n = _count(n, "num_tokens")
            if low is not None:
                low = _count(low, "low")
                if low < state.low:
                    raise vtm.InvalidArgument(f"{op}: low {low} is below the low mark {state.low} of vTensor "
                                              f"{vt_id}: the rows below it are gone")
                if low > n:
                    raise vtm.InvalidArgument(f"{op}: low {low} exceeds num_tokens {n}")
            was_n, was_low = wanted.get(vt_id, (-1, None))
            wanted[vt_id] = (max(n, was_n), low if was_low is None else max(was_low, low or 0))

        def growth():
            counts = [self._growth(session, vt_id, n, low) for vt_id, (n, low) in wanted.items()]
            return sum(c[0] for c in counts), sum(c[1] for c in counts)

        def recount():
            for vt_id in wanted:
                self._vtensor(session, vt_id)  # one released while the retry waited: its error
            return growth()
        extra, new = growth()

        def run():
            if op == "extend":
                [(vt_id, (n, low))] = wanted.items()
                return self._vtensor(session, vt_id).extend(n, low=low).result()
            return self.manager.step({self._vtensor(session, i): n if low is None else (n, low)
                                      for i, (n, low) in wanted.items()}).result()
        self._allocate(session, extra, run, gate_bytes=new, speculative=speculative, recount=recount)
        for vt_id, (n, low) in wanted.items():
            state = session.vt_state[vt_id]
            state.num_tokens = max(state.num_tokens, n)
            if low is not None:
                state.low = low

    def shrink(self, session: Session, targets, all_ahead: bool = False) -> None:
        """targets: (vTensor id, rows to keep). It maps nothing new but the
        copy of a shared page holding a new end, which replaces a mapped
        page: admitted as 0 bytes, so a client over its limit or in debt
        can always give memory back. The copy still takes a chunk from the
        pool, so it waits at the gate like any allocation; a shrink that
        copies nothing passes at once, and so does any shrink of a client
        that owes memory, even past its notice's deadline: it pays the
        debt. `all_ahead`: the client keeps no page ahead after it (its
        refusals go through the whole policy again)."""
        wanted = {}
        for vt_id, n in targets:
            self._vtensor(session, vt_id)
            wanted[vt_id] = max(_count(n, "num_tokens"), wanted.get(vt_id, 0))
        self._allocate(session, 0, lambda: self.manager.shrink(
            {self._vtensor(session, i): n for i, n in wanted.items()}).result(),
            gate_bytes=0 if self.policy.owes(session) else sum(self._shrink_copy_bytes(session, i, n)
                                                                for i, n in wanted.items()))
        for vt_id, n in wanted.items():
            state = session.vt_state[vt_id]
            state.num_tokens = n
            state.shared_pages = min(state.shared_pages, self._full_pages(session, state.space_id, n))
        if all_ahead:
            self.policy.gave_back_ahead(session)

    def _drop_vtensors(self, session: Session, vt_ids) -> None:
        """Forgets vTensors the manager released (a release, a record that
        releases, their space closed). With the last of them go the client's
        pages ahead: a recall would ask a client that holds none."""
        for vt_id in vt_ids:
            session.drop_vtensor(vt_id)
        if not session.vtensors:
            self.policy.gave_back_ahead(session)

    def release(self, session: Session, vt_id: int) -> None:
        vt = self._vtensor(session, vt_id)
        vt.release().result()
        self._drop_vtensors(session, [vt.id])

    def prefix_record(self, session: Session, space_id: int, vt_id: int, tokens, release: bool = False) -> int:
        """Records the vTensor's rows under `tokens`; the tree's copy of a
        partial last page takes a chunk from the pool, so it waits at the
        gate (memory reserved for another's retry stays free) and, when no
        chunk is free, fails rather than ask anyone for memory. `release`:
        the vTensor goes too, and the record copies nothing (vtm's
        prefix_record(..., release=True))."""
        space = self._space(session, space_id)
        vt = self._vtensor(session, vt_id)
        if release:
            added = space.prefix_record(vt, tokens, release=True).result()
            self._drop_vtensors(session, [vt.id])
            return added
        try:
            with self.policy.gate(session, self._partial_page_bytes(session, space.id, len(tokens))):
                added = space.prefix_record(vt, tokens).result()
        except vtm.OutOfMemory as exc:
            raise self._own_pages_ahead_first(session, exc) from None
        state = session.vt_state[vt.id]
        state.shared_pages = max(state.shared_pages, self._full_pages(session, space.id, len(tokens)))
        return added

    def Create(self, request, context):
        def body(session):
            vt_id = self.create(session, request.space_id, request.num_tokens)
            return self._reply(session, vtensors=[vt_id], vtensor_id=vt_id)
        return self._run(context, body)

    def Extend(self, request, context):
        def body(session):
            self.extend(session, request.vtensor_id, request.num_tokens,
                        request.low if request.HasField("low") else None)
            return self._reply(session)  # the client knows the new size, max(old, n), and mark
        return self._run(context, body)

    def Step(self, request, context):
        def body(session):
            self.step(session, [(t.vtensor_id, t.num_tokens, t.low if t.HasField("low") else None)
                                for t in request.targets])
            return self._reply(session)  # the client knows the new sizes, max(old, n), and marks
        return self._run(context, body)

    def Shrink(self, request, context):
        def body(session):
            self.shrink(session, [(t.vtensor_id, t.num_tokens) for t in request.targets], request.all_ahead)
            return self._reply(session, vtensors=[t.vtensor_id for t in request.targets])
        return self._run(context, body)

    def Release(self, request, context):
        def body(session):
            self.release(session, request.vtensor_id)
            return self._reply(session, vtensors=[request.vtensor_id])
        return self._run(context, body)

    def PrefixRecord(self, request, context):
        def body(session):
            added = self.prefix_record(session, request.space_id, request.vtensor_id, list(request.token_ids),
                                       request.release)
            return self._reply(session, value=added, vtensors=[request.vtensor_id] if request.release else ())
        return self._run(context, body)

    def prefix_match(self, session: Session, space_id: int, tokens):
        """The space's longest recorded prefix of `tokens` mapped into a new
        vTensor of the client: vtm's PrefixMatch (vtensor None when nothing
        matched)."""
        space = self._space(session, space_id)
        # A match maps recorded chunks, copies at most its partial last
        # page, and with a host tier restores the path's pages on the
        # host: admitted as that many chunks, so a client over its limit,
        # or past a reclaim notice's deadline, gets no memory this way
        # either, and memory reserved for another's retry stays free. The
        # match restores no more than was admitted (the tree may change
        # in between): past that, it takes what the device holds above.
        restore = space.prefix_restore_bytes(tokens)
        match = self._allocate(session, self._chunk_bytes + restore,
                               lambda: self._space(session, space_id).prefix_match(
                                   tokens, max_restore_bytes=restore).result(), slot_space=space)
        if match.vtensor is None:
            return match
        # The recorded pages it maps count too, against the limit and a
        # fair share the client is held to (its re-admissions would lock
        # again the chunks it gave back for an equal); a client that maps
        # pages ahead gives them back and asks again.
        mapped = sum(c is not None for c in match.vtensor.page_chunks()) * self._chunk_bytes
        try:
            self.policy.admit(session, mapped)
        except vtm.OutOfMemory as exc:
            match.vtensor.release().result()  # its effects cancel out in the drain
            raise self._own_pages_ahead_first(session, exc) from None
        session.add_vtensor(match.vtensor)
        session.vt_state[match.vtensor.id].shared_pages = self._full_pages(session, space.id, match.num_tokens)
        return match

    def PrefixMatch(self, request, context):
        def body(session):
            match = self.prefix_match(session, request.space_id, list(request.token_ids))
            if match.vtensor is None:
                return self._reply(session, matched_tokens=0)
            return self._reply(session, vtensors=[match.vtensor.id], vtensor_id=match.vtensor.id,
                               matched_tokens=match.num_tokens, restored_tokens=match.restored_tokens)
        return self._run(context, body)

    def PrefixRestoreBytes(self, request, context):
        def body(session):
            restore = self._space(session, request.space_id).prefix_restore_bytes(list(request.token_ids))
            return vtm_pb2.OpReply(value=restore)
        return self._run(context, body)

    def PrefixForget(self, request, context):
        def body(session):
            removed = self._space(session, request.space_id).prefix_forget(list(request.token_ids)).result()
            return self._reply(session, value=removed)
        return self._run(context, body)

    def ClearPrefixes(self, request, context):
        def body(session):
            dropped = self._space(session, request.space_id).clear_prefixes()
            return self._reply(session, value=dropped)
        return self._run(context, body)

    def PrefixNodes(self, request, context):
        def body(session):
            nodes = self._space(session, request.space_id).prefix_nodes(max_index_bytes=MAX_LISTED_INDEX_BYTES)
            return vtm_pb2.PrefixNodesReply(nodes=[
                vtm_pb2.PrefixNode(start=n["start"], end=n["end"], tokens=n["tokens"], locks=n["locks"],
                                   pages=[status.HOLE_PAGE if c is None else c for c in n["pages"]],
                                   on_host=n["on_host"], host_pages=n["host_pages"]) for n in nodes])
        return self._run(context, body)

    # Control calls: no lease needed (see the proto). `counted`: False for the
    # TCP control listener's (control.py), which hold none of the Unix socket's
    # gRPC threads (_run).

    def Trim(self, request, context, counted=True):
        def body(_):
            # No page effects: the broker keeps no slot cache, so trimming
            # unmaps nothing any client maps.
            return vtm_pb2.OpReply(value=self.manager.trim(None if request.all else _count(request.bytes, "bytes")))
        return self._run(context, body, session_required=False, counted=counted)

    def Stats(self, request, context, counted=True):
        def body(_):
            stats = self.manager.stats()
            tier = stats.pop("host_tier_accounts")
            stats["clients"] = self.clients(tier)
            stats["tier_names_offline"] = self._tier_names_offline(tier, stats["clients"])
            with self._mu:
                stats["tier_accounts"] = len(self._tier_accounts)
            return vtm_pb2.StatsReply(json=json.dumps(stats))
        return self._run(context, body, session_required=False, counted=counted)

    def Check(self, request, context):
        def body(_):
            self.manager.check()
            return vtm_pb2.OpReply()
        return self._run(context, body, session_required=False)

    def SetQuota(self, request, context, counted=True):
        def body(_):
            fields = {f: getattr(request, f) for f in ("priority", "guaranteed_bytes", "limit_bytes",
                                                       "host_tier_limit_bytes") if request.HasField(f)}
            if not fields and not request.reset:
                raise vtm.InvalidArgument("set-quota: nothing to set (a priority, guarantee or limit, or a reset)")
            if fields.get("host_tier_limit_bytes") and not self._has_tier:
                raise vtm.InvalidArgument("set-quota: this vtmd has no host tier (--host-tier-bytes) to limit")
            name = _label(request.name, "a client name")
            if not name:  # a client that gives no name is named client<id>: no session could have ""
                raise vtm.InvalidArgument("set-quota: give the name of the clients to set it for")
            capacity = self.manager.capacity_bytes
            with self._mu:
                entry = self.quotas.with_entry(name, reset=request.reset, **fields)
                quota = self.quotas.default if entry is None else entry
                matching = [s for s in self._sessions.values() if s.name == name]
                grants = {s: grant(quota, s.asked) for s in matching}
                guaranteed = sum(s.guaranteed_bytes for s in self._sessions.values() if s.name != name)
                guaranteed += sum(g.guaranteed_bytes for g in grants.values())
                if guaranteed > capacity:
                    raise vtm.InvalidArgument(f"the connected clients' guarantees would sum to {guaranteed} bytes, "
                                              f"past the capacity of {capacity}")
                self.quotas.store(name, entry)
                limits = {session: session.limit_bytes for session in matching}
                for session, granted in grants.items():
                    session.grant(granted)
                    # The client's view of its grant, before any reclaim
                    # this asks: an engine checks a request against its
                    # limit before it waits for memory the limit would
                    # never give it.
                    self._notify_quota(session)
            if "host_tier_limit_bytes" in fields or request.reset:
                self._apply_tier_limit(name, make=False)  # a name without an account gets it when it makes one
            for session in matching:
                # Under the session's lock: a call of the client admitted
                # under the old limit may be under way (waiting at the gate,
                # say), and what it maps counts once it has run.
                with session.lock:
                    if session.limit_bytes != limits[session] and session.state == LIVE:
                        # Over a lowered limit: ask for the excess, as for a
                        # higher priority; nothing the client runs fails. A
                        # lifted one forgives what the old one asked.
                        self.policy.limit_changed(session, f"the operator limited client '{name}' to "
                                                           f"{session.limit_bytes} bytes")
            clients = [c for c in self.clients() if c["name"] == name]
            return vtm_pb2.StatsReply(json=json.dumps({"quota": quota._asdict(), "clients": clients}))
        return self._run(context, body, session_required=False, counted=counted)

