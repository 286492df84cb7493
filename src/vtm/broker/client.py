"""vtm.connect: a vtm manager whose accounting lives in a broker (vtmd).

The returned RemoteManager has vtm.Manager's API. Its operations run, in
submission order, on one worker thread of this process: it sends the call
(with a deadline), trades the chunk serials of the reply it has not imported
yet for fds on the broker's side socket, maps the page changes into this
process's own reservations (C++ ClientMapper, without the GIL), updates the
vTensors' state and only then resolves the future. So, as in process, a
caller may submit the next step's extend and compute meanwhile; the memory is
mapped when its future resolves.

The hot calls (create, extend, step, release) go through a transport
(transport.py): the broker's step socket when it advertises one (one datagram
each way, the new chunks' fds attached), else gRPC; everything else over
gRPC. Mapping ahead (map_ahead.py) decides what a growth asks for, and
whether it needs to ask at all. The session
itself lives on a channel to the broker's fd socket
(src/vtm/broker/session_channel.py): the broker learns this process's pid from
the kernel there and sends its reclaim notices there.

Memory is given back in the order that keeps other clients safe: the client
unmaps a vTensor's (or a space's) pages before it asks the broker to release
them, keeps no import of a chunk it maps no more (so the broker can hand it
to another client as soon as it is free), and on close unmaps everything
before it says goodbye.

A broker that dies or stops answering, or ends the session, makes every
pending and later call raise vtm.Unavailable within the call deadline; the
session (and with it the client's memory) is lost: `healthy` is False.
Before the first such error of a vTensor operation reaches its caller, this
client unmaps every chunk it maps and releases every import (the revoke, on
the thread that computes on the memory: liveness.py). Then it says goodbye,
so a broker that still holds the session frees it at once.

A lost session is a preemption, not the end (docs/design.md §6): `reconnect()`, on
that same thread, opens a new session (the broker restarted, or came back)
and gives every open space a new one of the same geometry, keeping its
reservation, so tensor views of it stay valid; the old session's vTensors
are gone and their owners compute them again. Operations submitted before
the reconnect fail with Unavailable; none of them reaches the new session.

Invariants:
  * the worker applies replies in the order the broker executed them (one
    call at a time), so the mapper's page tables follow the broker's;
  * _vtensors holds every live vTensor this client has, by id;
  * the mapper maps exactly the pages the broker last reported, except the
    pages of a vTensor or space whose release is on its way (unmapped first);
    it imports exactly the chunks it maps. Where a change cannot be made
    here, the session is lost (_follow); where a page cannot be unmapped,
    the broker is never told it was (no goodbye: _disconnect);
  * after close() (or the connection broke), no call reaches the broker;
  * an operation runs only in the session it was submitted in (_epoch), and
    the worker runs one at a time under _op_mu, which reconnect() holds
    while it replaces the session.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import operator
import os
import queue
import threading
import time
import weakref

import grpc

from vtm import _core, errors
from vtm.broker import status
from vtm.broker.fd_channel import MAX_FDS, FdClient
from vtm.broker.liveness import Liveness
from vtm.broker.map_ahead import MapAhead
from vtm.broker import step_channel
from vtm.broker.remote import RemoteFuture, RemoteMatch, RemoteSpace, RemoteVTensor
from vtm.broker.session_channel import Evicted, SessionChannel, say_bye
from vtm.broker.transport import GrpcTransport, StepTransport, _message
from vtm.proto.vtm.v1 import vtm_pb2, vtm_pb2_grpc

log = logging.getLogger("vtm.broker")

_BYE_TIMEOUT_S = 2.0
# How often connect's wait for a broker whose socket is there but refuses looks at its `stop`.
_STOP_POLL_S = 0.05
_PARKED = 1 << 31  # space ids a broker never gives (ids count up from 1): reconnect's renames pass through them


def _count(n, what: str) -> int:
    """A count the broker's frames carry (an unsigned 64-bit word), checked
    at the call: a bad one is refused before anything is queued."""
    n = int(n)
    if not 0 <= n < 1 << 64:
        raise errors.InvalidArgument(f"{what} must be >= 0 and < 2**64, got {n}")
    return n


def _ask(value, what: str):
    return None if value is None else _count(value, what)


def _token_ids(token_ids) -> list[int]:
    """The ids as Python ints. Anything but a sequence of integers is a
    TypeError, as the in-process manager raises: int() would truncate 1.5 and
    parse "12"."""
    if isinstance(token_ids, (str, bytes)):
        raise TypeError(f"token ids must be a sequence of integers, got {type(token_ids).__name__}")
    return [operator.index(t) for t in token_ids]


class RemoteManager:
    def __init__(self, address: str, name: str | None = None, priority: int | None = None,
                 guaranteed_bytes: int | None = None, limit_bytes: int | None = None, timeout: float = 10.0,
                 fast_path: bool = True, map_ahead_pages: int = 0, stop: threading.Event | None = None):
        self._timeout = float(timeout)
        self._address = address
        self._fast_path = fast_path
        self._map_ahead_asked = _count(map_ahead_pages, "map_ahead_pages")
        self._map_ahead = MapAhead(0, chunk_bytes=0)  # set at hello
        # Held by a submission, and while a growth is decided here: an
        # operation submitted after that growth (a shrink reads the rows
        # grown into) runs after it, one submitted before keeps it from
        # being decided here.
        self._submit_mu = threading.Lock()
        # Operations submitted and finished (refills not counted): equal when
        # nothing is queued or running, so a step may be decided here.
        self._submitted = 0
        self._finished = 0
        self._liveness = Liveness()  # the session up or lost, the revoke (liveness.py)
        self._closed = False
        self._op_mu = threading.Lock()  # held by the worker around each operation, and by reconnect()
        self._grant_mu = threading.Lock()  # a quota notice's check of its session, and its fields
        self._epoch = 0  # sessions opened after the first
        self._spaces: dict[int, RemoteSpace] = {}
        self._vtensors: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._live: dict[int, RemoteVTensor] = {}
        # Released here (unusable), not released at the broker yet (RemoteVTensor._broker_holds).
        self._held_at_broker: dict[int, RemoteVTensor] = {}
        self._mapper = None
        self._channel = None
        self._fds = None
        self._transport = None  # create, extend, step and release (transport.py)
        self._session = None
        self._lease = None
        self._reclaim_handlers = []
        self.reclaim_notices = 0  # RECLAIM notices received
        self.recall_notices = 0  # RECALL notices received (pages ahead asked back)
        self.reconnects = 0  # sessions rebuilt after a lost one
        if not address.startswith("unix:"):
            # Chunks travel as fds: only a Unix socket carries them (a tcp:
            # listener serves control calls only).
            raise errors.InvalidArgument(f"vtm.connect needs a unix:PATH address, got {address!r}")
        if stop is not None and not isinstance(stop, threading.Event):
            raise errors.InvalidArgument(f"vtm.connect's stop must be a threading.Event, got {stop!r}")
        # Unset asks take what the operator gives (proto3 presence); sent
        # again by every reconnect.
        self._hello = _message(vtm_pb2.HelloRequest, "connect", name=name or "", priority=priority,
                               guaranteed_bytes=_ask(guaranteed_bytes, "guaranteed_bytes"),
                               limit_bytes=_ask(limit_bytes, "limit_bytes"), gives_back_ahead=True)
        try:
            hello = self._open_session(time.monotonic() + self._timeout, stop=stop)
            # No idle imports (keep_idle 0): a chunk this process maps no more
            # may be another client's a moment later.
            self._mapper = _core.ClientMapper(hello.backend, hello.chunk_bytes,
                                              hello.granularity if hello.backend == "host" else 0, hello.device, 0)
        except BaseException:
            self._teardown()
            raise
        self._queue: queue.Queue = queue.Queue()
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(None)
        self._done = RemoteFuture(done)  # what a growth decided here returns
        self._worker = threading.Thread(target=self._work, name=f"vtm-client-{self.client_id}", daemon=True)
        self._worker.start()

    def _open_session(self, deadline: float, geometry: tuple | None = None, stop: threading.Event | None = None):
        """Says hello to the broker (waiting until `deadline` for one that is
        starting, or until `stop` is set), attaches the session's channel,
        opens the fd and step sockets and starts the notice listener; returns
        the HelloReply. `geometry`: the (backend, chunk_bytes, granularity)
        this client's reservations were made for; a broker of another is
        refused (FailedPrecondition) before any of this client's fields take
        its values."""
        path = self._address[len("unix:"):]
        wait = f"{max(0.0, deadline - time.monotonic()):.2g} s"  # this call's wait: a reconnect's try is short
        while not os.path.exists(path):
            # A broker that is starting (or restarting) creates its socket
            # soon: wait for it, within the deadline.
            if time.monotonic() >= deadline:
                raise errors.Unavailable(f"no vtm broker answers at {self._address} (no such socket after {wait})")
            self._pause(0.05, stop)
        self._channel = grpc.insecure_channel(self._address)
        ready = grpc.channel_ready_future(self._channel)
        while True:  # in slices where there is a `stop`, looked at between them
            left = deadline - time.monotonic()
            try:
                ready.result(timeout=max(0.0, left if stop is None else min(left, _STOP_POLL_S)))
                break
            except grpc.FutureTimeoutError:
                if time.monotonic() >= deadline:
                    raise errors.Unavailable(f"no vtm broker answers at {self._address} (waited {wait})") from None
                self._pause(0, stop)
        self._stub = vtm_pb2_grpc.BrokerStub(self._channel)
        while True:
            try:
                hello = self._rpc("hello", self._stub.Hello, self._hello, lease=False)
            except errors.OutOfMemory as exc:
                # Refused for the calls in flight of the callers vtmd cannot
                # tell apart, Hellos among them (service.py, _in_flight): one
                # ends in a moment, so it is asked again within the deadline.
                if status.CALLS_IN_FLIGHT_FLAG not in str(exc) or time.monotonic() >= deadline:
                    raise
                self._pause(0.01, stop)
                continue
            self._metadata = ((status.LEASE_KEY, hello.lease),)
            self._lease = hello.lease
            self._fd_socket = hello.fd_socket
            if geometry is not None and (hello.backend, hello.chunk_bytes, hello.granularity) != geometry:
                # The session goes again (the caller disconnects, saying bye
                # with the lease above); the next reconnect compares with the
                # same geometry, and a broker of it is taken.
                raise errors.FailedPrecondition(
                    f"the vtm broker came back with backend {hello.backend}, chunks of {hello.chunk_bytes} bytes "
                    f"(was {geometry[0]}, {geometry[1]}): this client's reservations do not fit it")
            self.name = hello.name
            self.client_id = hello.client_id
            self.backend = hello.backend
            self.chunk_bytes = self._map_ahead.chunk_bytes = hello.chunk_bytes
            self._map_ahead.pages = self._map_ahead_asked
            self.capacity_bytes = hello.capacity_bytes
            self.granularity = hello.granularity
            # What the operator granted (less where this client asked for less);
            # a quota notice brings the operator's changes (_listen).
            self.priority = hello.priority
            self.guaranteed_bytes = hello.guaranteed_bytes
            self.limit_bytes = hello.limit_bytes
            # The session's anchor, first: the broker serves nothing else
            # before it knows this process.
            try:
                self._session = SessionChannel(hello.fd_socket, hello.lease, self._timeout)
                break
            except Evicted:
                # Ended before its attach, to make room for others at the
                # broker's --max-sessions: a new Hello may get a place.
                if time.monotonic() >= deadline:
                    raise
            except (OSError, ValueError) as exc:
                raise errors.Unavailable(f"attaching to the vtm broker failed: {exc}") from None
        try:
            self._fds = FdClient(hello.fd_socket, hello.lease, self._timeout)
        except (OSError, ValueError) as exc:
            raise errors.Unavailable(f"the vtm broker's fd socket failed: {exc}") from None
        self._transport = GrpcTransport(self)
        if self._fast_path and hello.step_socket:
            try:
                steps = step_channel.StepClient(hello.step_socket, hello.lease, self._timeout)
            except errors.Error:
                raise
            except (OSError, ValueError) as exc:
                raise errors.Unavailable(f"the vtm broker's step socket failed: {exc}") from None
            self._transport = StepTransport(self, steps)
        threading.Thread(target=self._listen, args=(self._session,), name=f"vtm-notices-{self.client_id}",
                         daemon=True).start()
        return hello

    def _pause(self, seconds: float, stop: threading.Event | None) -> None:
        """Sleeps `seconds` between two tries to reach the broker (0: only
        looks at `stop`); raises Unavailable at once where `stop` is (or
        gets) set: its caller no longer waits (a server told to stop while
        it starts)."""
        if stop is None:
            time.sleep(seconds)
        elif stop.wait(seconds):
            raise errors.Unavailable(f"stopped waiting for the vtm broker at {self._address}: its stop was set")

    # -- plumbing ------------------------------------------------------------

    def _rpc(self, what: str, method, request, lease: bool = True, timeout: float | None = None,
             fatal: bool = True):
        """`fatal`: a broker that does not answer marks this client broken."""
        try:
            return method(request, timeout=self._timeout if timeout is None else timeout,
                          metadata=self._metadata if lease else None)
        except grpc.RpcError as err:
            error = status.from_rpc_error(err, what)
            if fatal and isinstance(error, errors.Unavailable):
                self._liveness.lose(error)
            raise error from None

    def _apply_step_reply(self, reply):
        """Maps what a step-socket reply changed (importing its chunks, from
        the fds it carries or else through the fd socket); its vTensor
        fields for the caller."""
        try:
            received = dict(zip(reply.serials, reply.fds))
            for space_id, effects in reply.groups:
                self._follow(space_id, effects, received)
        finally:
            for fd in reply.fds:
                os.close(fd)
        return reply.vtensor

    def _follow(self, space_id: int, effects, received: dict | None = None) -> None:
        """Brings this process's pages of a space to what the broker says
        (`effects`), importing the chunks it lacks from the fds `received`
        (serial: fd) or else through the fd socket. The broker has made the
        change by then, so one that cannot be made here (an import, a map or
        an unmap failed part-way) leaves this process's mappings unlike the
        broker's: a page the broker counts as a vTensor's that is not mapped
        here (the next write to it faults), or a chunk the broker may hand to
        another client still mapped here. The session is lost then
        (Unavailable): the revoke unmaps everything before the caller sees the
        error, and a reconnect starts again from what the broker says."""
        try:
            missing = self._mapper.missing(effects)
            if missing:
                received = received or {}
                for serial in missing:
                    if serial in received:
                        self._mapper.import_fd(serial, received[serial])
                self._import([s for s in missing if s not in received])
            self._mapper.apply(space_id, effects)
        except errors.Unavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever failed, the mappings no longer follow the broker's
            raise self._liveness.lose(errors.Unavailable(
                f"mapping what the vtm broker changed failed in this process ({exc}): its mappings no longer "
                f"follow the broker's, so the session ends")) from None

    def _listen(self, session: SessionChannel) -> None:
        """Consumes one session's notices; its channel ending means that
        session is gone (a later one, after reconnect(), has its own listener)."""
        for notice in session.notices():
            if notice.get("notice") == "shutdown":
                self._session_lost(session, f"the vtm broker is stopping: {notice.get('reason', '')}")
            elif notice.get("notice") == "reclaim":
                self._answer_reclaim(notice, session)
            elif notice.get("notice") == "recall":
                self.recall_notices += 1
                self._give_back_pages_ahead(float(notice.get("deadline_s", self._timeout)))
                session.ack(notice.get("id"))
            elif notice.get("notice") == "quota":
                # The operator's grant as it stands (vtmctl set-quota), as Hello
                # gave it; never an old session's over a new one's (_disconnect).
                with self._grant_mu:
                    if session is self._session:
                        self.priority = int(notice["priority"])
                        self.guaranteed_bytes = int(notice["guaranteed_bytes"])
                        self.limit_bytes = int(notice["limit_bytes"])
        if not self._closed:
            self._session_lost(session, "the vtm broker ended this session (its channel closed)")

    def _session_lost(self, session: SessionChannel, why: str) -> None:
        if session is self._session:
            self._liveness.lose(errors.Unavailable(why))

    def _answer_reclaim(self, notice: dict, session: SessionChannel) -> None:
        """Runs the reclaim handlers in turn (on this listener thread, so they
        may wait on futures) until the asked bytes are freed, then acknowledges."""
        self.reclaim_notices += 1
        remaining = int(notice.get("bytes", 0))
        remaining -= self._give_back_pages_ahead(float(notice.get("deadline_s", self._timeout)))
        for handler in list(self._reclaim_handlers):
            if remaining <= 0:
                break
            try:
                remaining -= handler(remaining) or 0
            except Exception:  # noqa: BLE001 - a failing handler frees nothing; the broker's deadline applies
                continue
        session.ack(notice.get("id"))

    def _lost(self, error: BaseException) -> None:
        """The caller is about to see `error`: when it says the session is
        gone, this process gives up every chunk first (revoke, see the top of
        this file), then says goodbye so the broker frees them now."""
        if not isinstance(error, errors.Unavailable) or self._liveness.broken is None:
            return
        if not self._liveness.revoke(self._mapper.revoke, lambda: self._closed):
            return
        if not self._liveness.unmapped:
            # Some pages are still mapped here: a goodbye would let the broker
            # hand their chunks to another client. Not said until they are
            # unmapped (reconnect() tries again, close() too); a session whose
            # channel ends first is quarantined: the broker keeps its chunks
            # from everyone until this process exits.
            log.warning("unmapping the chunks of the lost vtm session failed: no goodbye until they are unmapped")
            return
        lease, self._lease = self._lease, None  # said once
        if lease is None:
            return
        try:
            # Not waiting for the answer: the caller is owed its error now.
            say_bye(self._fd_socket, lease, min(self._timeout, _BYE_TIMEOUT_S), wait=False)
        except (OSError, ValueError, errors.Error):
            pass  # no broker to tell (it died), or it ended the session itself

    def set_reclaim_handler(self, handler) -> None:
        """handler(bytes) is called (on a thread of this client) when the
        broker asks for `bytes` back for a higher-priority client: release
        vTensors, then return the bytes freed. A client that does not come
        down to what was asked within the notice's deadline gets no more
        memory until it does. Replaces every handler added before."""
        self._reclaim_handlers = [handler]

    def add_reclaim_handler(self, handler) -> None:
        """Another handler (say, one per FlexInfer engine sharing this
        manager); handlers run in the order added until enough is freed."""
        self._reclaim_handlers = self._reclaim_handlers + [handler]

    def remove_reclaim_handler(self, handler) -> None:
        self._reclaim_handlers = [h for h in self._reclaim_handlers if h is not handler]

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, future, epoch, counted = item
            if not future.set_running_or_notify_cancel():
                self._finished += counted
                continue
            result, error = None, None
            with self._op_mu:
                try:
                    if epoch != self._epoch:
                        raise errors.Unavailable("the vtm broker session this operation was submitted in was "
                                                 "lost (the client has reconnected since)")
                    if self._liveness.broken is not None:
                        raise self._liveness.error()
                    result = fn()
                except BaseException as exc:  # noqa: BLE001 - delivered through the future
                    error = exc
            # Counted before the caller wakes: its next step may be decided here.
            self._finished += counted
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

    def _submit(self, fn, data_plane: bool = False, counted: bool = True) -> RemoteFuture:
        """Queues fn for the worker. A data-plane op's future revokes this
        process's mappings before it reports a lost session (_lost).
        `counted` False: a map-ahead refill, which a step decided here need
        not wait for (it only maps more)."""
        if self._closed:
            raise errors.FailedPrecondition("the manager is closed")
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._submit_mu:
            if counted:
                self._submitted += 1
            self._queue.put((fn, future, self._epoch, counted))
        return RemoteFuture(future, self._lost if data_plane else None)

    # -- a lost session ----------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """True while operations can run: the session is up and not closed."""
        return not self._closed and self._liveness.broken is None

    def bind_thread(self, before_revoke=None) -> None:
        """Names the calling thread as the one that computes on this
        manager's memory (a FlexInfer engine's loop): a lost session's
        mappings are revoked there and nowhere else, since a revoke on any
        other thread could unmap pages under its kernels. `before_revoke`,
        when given, is called there first: a caller that queues device work
        ahead (an engine with steps in flight) waits for it, so nothing
        reads pages being unmapped. A second thread is refused
        (vtm.FailedPrecondition): connect once per computing thread; each
        connection is a session of its own."""
        self._liveness.bind(before_revoke)

    def reconnect(self, timeout: float | None = None) -> None:
        """After a lost session (healthy is False): a new one. Call it on the
        thread that computes on this memory (bind_thread): it first unmaps
        every chunk of the old session here (as a failed vTensor operation
        does). Then it says hello again (waiting up to `timeout` seconds,
        default the connect timeout, for a broker that is restarting) and
        gives every open space a space of the same geometry in the new
        session; the space keeps its reservation and its tensor views. Every
        vTensor of the old session is released. Raises vtm.Unavailable when
        no broker answers in time and another vtm.Error when the new session
        cannot take the spaces back (both leave the manager as it was: try
        again later; so does vtm.BackendError when pages of the old session
        are still mapped here and unmapping them fails again),
        vtm.FailedPrecondition when the manager is closed, the
        broker came back with another backend or chunk size, or this is not
        the bound thread. Returns at once when the session is up."""
        if self._closed:
            raise errors.FailedPrecondition("the manager is closed")
        if self._liveness.broken is None:
            return
        if not self._liveness.on_bound_thread():
            raise errors.FailedPrecondition("reconnect() belongs to the thread bound with bind_thread()")
        deadline = time.monotonic() + (self._timeout if timeout is None else float(timeout))
        with self._op_mu:
            self._lost(self._liveness.broken)
            if not self._liveness.unmapped:
                # The revoke left pages mapped: tried again here. A new session
                # waits for it: its spaces move into the old reservations,
                # which must map nothing, and the old session may say goodbye
                # only once this process maps none of its chunks.
                try:
                    self._mapper.revoke()
                except errors.Error as exc:
                    raise errors.BackendError(
                        f"this process still maps chunks of the lost vtm session, and unmapping them failed again "
                        f"({exc}): no new session until they are unmapped (try again later)") from None
                self._liveness.unmapped = True
            self._disconnect()
            try:
                self._open_session(deadline, (self.backend, self.chunk_bytes, self.granularity))
                replies = self._reopen_spaces()
            except BaseException:
                self._disconnect()
                raise
            # Nothing can fail from here: the spaces move to their new ids.
            for vt in list(self._live.values()):
                vt._released = True
            self._live.clear()
            self._released_at_broker(list(self._held_at_broker.values()))  # the old session took them
            self._forget_closed_spaces()
            self._rename_spaces(replies)
            self._epoch += 1
            self._liveness.renew()
            self.reconnects += 1
        log.info("reconnected to the vtm broker at %s: %d spaces rebuilt", self._address, len(self._spaces))

    def _reopen_spaces(self) -> dict[int, int]:
        """A space in the new session for every open space, of the same
        geometry, namespace and name: {old id: new id}. All or none (a
        failure closes the ones made, and the old spaces stay as they were)."""
        made = {}
        try:
            for space in [s for s in self._spaces.values() if not (s.closed or s.close_requested)]:
                request = _message(vtm_pb2.CreateSpaceRequest, "create_space", row_bytes=space.row_bytes,
                                   max_tokens=space.max_tokens, max_slots=space.max_slots,
                                   namespace=space.namespace, name=space.name, window_tokens=space.window_tokens)
                reply = self._rpc("create_space", self._stub.CreateSpace, request)
                made[space.id] = reply.space_id
                if (reply.max_slots, reply.slot_bytes) != (space.max_slots, space.slot_bytes):
                    raise errors.FailedPrecondition(
                        f"the vtm broker gives space '{space.name}' another geometry now ({reply.max_slots} slots "
                        f"of {reply.slot_bytes} bytes, was {space.max_slots} of {space.slot_bytes})")
        except BaseException:
            for new_id in made.values():
                try:
                    self._rpc("close_space", self._stub.CloseSpace, vtm_pb2.SpaceRequest(space_id=new_id))
                except errors.Error:
                    pass  # the session is being dropped: the broker closes it with the session
            raise
        return made

    def _forget_closed_spaces(self) -> None:
        """Removes the spaces closed while the session was lost (_close_space),
        and those whose close the lost session never answered (the close
        that found it lost, or one queued behind it), from the mapper, the
        old session's mappings revoked already."""
        for space in [s for s in self._spaces.values() if s.closed or s.close_requested]:
            space.closed = True
            del self._spaces[space.id]
            try:
                self._mapper.remove_space(space.id)
            except errors.Error:
                pass  # an unmap failed: the range stays reserved under its mapping (mapper_client.cc)

    def _rename_spaces(self, new_ids: dict[int, int]) -> None:
        """Moves every space (its mapper area, reservation and object) to its
        new id. Through ids no broker gives first (the top bit set), since a
        new id may be another space's old one."""
        spaces = [self._spaces.pop(old) for old in new_ids]
        for space in spaces:
            self._mapper.rename_space(space.id, _PARKED | space.id)
        for space in spaces:
            self._mapper.rename_space(_PARKED | space.id, new_ids[space.id])
            space.id = new_ids[space.id]
            self._spaces[space.id] = space

    def _apply(self, reply) -> None:
        """Maps the page changes of a reply and updates vTensor state."""
        for space_effects in reply.effects:
            self._follow(space_effects.space_id, [(e.slot, e.page, e.chunk, e.serial) for e in space_effects.pages])
            if space_effects.closed:
                self._mapper.remove_space(space_effects.space_id)
                space = self._spaces.pop(space_effects.space_id, None)
                if space is not None:
                    space.closed = True
        for state in reply.vtensors:
            vt = self._vtensors.get(state.vtensor_id)
            if vt is None:
                continue
            if state.released:
                vt._released = True
                self._live.pop(vt.id, None)
                self._released_at_broker([vt])
            else:
                # The broker's num_tokens is the vTensor's own, or more where it maps ahead.
                vt._slot, vt._low = state.slot, state.low
                self._map_ahead.set_mapped(vt, state.num_tokens)
                vt._num_tokens = min(vt._num_tokens, state.num_tokens)

    def _import(self, serials) -> None:
        """Imports chunks by serial through the fd socket, MAX_FDS at a time,
        so this process never holds more fds than that (its RLIMIT_NOFILE
        may be low; a large vTensor maps thousands of chunks)."""
        for start in range(0, len(serials), MAX_FDS):
            try:
                fetched = self._fds.fetch(serials[start:start + MAX_FDS])
            except (OSError, ValueError) as exc:
                raise self._liveness.lose(errors.Unavailable(
                    f"fetching chunk fds from the vtm broker failed: {exc}")) from None
            try:
                for serial, fd in fetched:
                    self._mapper.import_fd(serial, fd)
            finally:
                for _, fd in fetched:
                    os.close(fd)

    def _new_vtensor(self, space: RemoteSpace, reply) -> RemoteVTensor:
        state = next(s for s in reply.vtensors if s.vtensor_id == reply.vtensor_id)
        return self._add_vtensor(space, reply.vtensor_id, state.slot, state.num_tokens, state.low)

    def _add_vtensor(self, space: RemoteSpace, vt_id: int, slot: int, num_tokens: int, low: int = 0) -> RemoteVTensor:
        vt = RemoteVTensor(self, space, vt_id, slot, num_tokens, low)
        self._vtensors[vt.id] = vt
        self._live[vt.id] = vt
        return vt

    def _own(self, vt, what: str) -> RemoteVTensor:
        if not isinstance(vt, RemoteVTensor) or vt._mgr is not self:
            raise errors.FailedPrecondition(f"{what}: vTensor of another manager")
        return vt

    def _release_vtensors_of(self, space: RemoteSpace) -> None:
        """Marks the space's live vTensors released (its close takes them),
        and those whose release failed at the broker."""
        for vt in [vt for vt in self._live.values() if vt._space is space]:
            vt._released = True
            self._live.pop(vt.id, None)
        self._released_at_broker([vt for vt in list(self._held_at_broker.values()) if vt._space is space])

    def _released_at_broker(self, vtensors) -> None:
        """The broker released these vTensors, unmapped here already."""
        for vt in vtensors:
            vt._broker_holds = False
            self._held_at_broker.pop(vt.id, None)

    def _live_in(self, space: RemoteSpace) -> int:
        """The space's slots the broker holds for this client: its vTensors
        whose release it has not answered hold theirs."""
        return sum(1 for held in (self._live, self._held_at_broker) for vt in list(held.values())
                   if vt._space is space)

    # -- operations (run on the worker) ------------------------------------------

    def _create(self, space: RemoteSpace, n) -> RemoteFuture:
        n = _count(n, "num_tokens")

        def run():
            ahead, exact = self._map_ahead.rows(space, n), self._map_ahead.rows(space, n, ahead=0)
            vt_id, slot, mapped = self._or_without_pages_ahead(
                lambda exact_only: self._transport.create(space.id, n, exact if exact_only else ahead, exact))
            vt = self._add_vtensor(space, vt_id, slot, n)
            self._map_ahead.set_mapped(vt, mapped)
            return vt
        return self._submit(run, data_plane=True)

    def _extend(self, vt: RemoteVTensor, n, low=None) -> RemoteFuture:
        if low is None and self._map_ahead.pages and self._grown_here(((vt, n),)):
            return self._done
        return self._grow([(vt, _count(n, "num_tokens"), _ask(low, "low"))], "extend")

    def step(self, targets) -> RemoteFuture:
        if self._map_ahead.pages and self._grown_here(targets.items()):
            return self._done
        sizes = []
        for vt, target in targets.items():
            # n_tokens, or (n_tokens, low) to raise the low mark too.
            if isinstance(target, tuple):
                if len(target) != 2:
                    raise errors.InvalidArgument("step: a target is n_tokens or (n_tokens, low)")
                n, low = target
                sizes.append((self._own(vt, "step"), _count(n, "num_tokens"), _count(low, "low")))
            else:
                sizes.append((self._own(vt, "step"), _count(target, "num_tokens"), None))
        return self._grow(sizes, "step")

    def shrink(self, targets) -> RemoteFuture:
        """Each vTensor of {vTensor: rows} keeps its first rows, and every
        page wholly past them goes back to the broker (docs/api.md,
        "Shrinking a vTensor"). Nothing else in this process may use those
        pages meanwhile, as for a release."""
        sizes = [(self._own(vt, "shrink"), _count(n, "num_tokens")) for vt, n in targets.items()]

        def run():
            for vt, n in sizes:
                vt._live()
                # The broker counts the rows mapped ahead as the vTensor's:
                # the bound is checked here, against the rows it grew into.
                if n > vt._num_tokens:
                    raise errors.InvalidArgument(f"shrink: {n} tokens exceed the {vt._num_tokens} of vTensor "
                                                 f"{vt.id} (extend grows a vTensor)")
                if n < vt._low:
                    raise errors.InvalidArgument(f"shrink: {n} tokens are below the low mark {vt._low} of vTensor "
                                                 f"{vt.id}")
            # Its copy of a shared end page may find no chunk: pages ahead first, as for any allocation.
            self._or_without_pages_ahead(lambda _: self._send_shrink(sizes))
        return self._submit(run, data_plane=True)

    def _send_shrink(self, sizes, all_ahead: bool = False) -> None:
        """Shrinks on the broker (on the worker). The pages past each new end
        are unmapped here first, as for a release: the broker hands a freed
        chunk to the next client at once. An unmap that fails here (for any
        of the vTensors, or part-way through one) and a refusal there changed
        nothing at the broker, so every page unmapped is mapped again: a
        vTensor whose pages went here while the broker kept them would fault
        at its next write, its rows mapped ahead counted as mapped."""
        chunk = self.chunk_bytes
        unmapped = []
        try:
            for vt, n in sizes:
                mapped = self._mapper.mapped_from(vt._space.id, vt._slot, -(-n * vt._space.row_bytes // chunk))
                if mapped:
                    # Listed first: an apply that fails may have unmapped some runs.
                    unmapped.append((vt._space.id, mapped))
                    self._mapper.apply(vt._space.id, [(slot, page, -1, 0) for slot, page, _, _ in mapped])
            request = vtm_pb2.ShrinkRequest(targets=[vtm_pb2.ShrinkTarget(vtensor_id=vt.id, num_tokens=n)
                                                     for vt, n in sizes], all_ahead=all_ahead)
            reply = self._rpc("shrink", self._stub.Shrink, request)
        except errors.Unavailable:
            raise  # the session is lost: every mapping goes (_lost)
        except Exception:
            # Mapping a page that is still mapped changes nothing (ClientMapper.apply).
            for space_id, mapped in unmapped:
                self._follow(space_id, mapped)
            raise
        self._apply(reply)

    def _grow(self, sizes, what: str) -> RemoteFuture:
        """extend or step: sizes are (vTensor, tokens, low mark or None)."""
        ahead = [self._map_ahead.rows(vt._space, n) for vt, n, _ in sizes]
        exact = [self._map_ahead.rows(vt._space, n, ahead=0) for vt, n, _ in sizes]

        def run():
            granted = self._or_without_pages_ahead(
                lambda exact_only: self._transport.grow(what, sizes, exact if exact_only else ahead, exact))
            for (vt, n, low), rows in zip(sizes, granted):
                vt._num_tokens = max(vt._num_tokens, n)
                self._map_ahead.set_mapped(vt, max(vt._mapped_tokens, rows))
                if low is not None:
                    vt._low = low
        return self._submit(run, data_plane=True)

    # -- mapping ahead (map_ahead.py) ----------------------------------------------

    def _grown_here(self, pairs) -> bool:
        """A growth decided here (MapAhead.grow), when nothing but refills is
        queued before it (its order would not show otherwise); False: ask
        the broker."""
        transport = self._transport
        with self._submit_mu:
            if (self._finished != self._submitted or self._liveness.broken is not None or transport is None
                    or not transport.maps_ahead):
                return False
            refills = self._map_ahead.grow(pairs, self)
        if refills is None:
            return False
        if refills:
            self._submit(lambda: self._refill(refills), data_plane=False, counted=False)
        return True

    def _refill(self, refills) -> None:
        """Runs on the worker: maps the pages ahead that MapAhead.grow asked
        for. A refused one is asked for by the step that needs its rows; no
        refill of it until a step of its reaches the broker."""
        def mapped(part):
            for vt, want in part:
                self._map_ahead.set_mapped(vt, max(vt._mapped_tokens, want))
        self._transport.refill([(vt, want) for vt, want in refills if not vt._released], mapped)

    def _shrink_to_pages_needed(self) -> int:
        """On the worker: shrinks every vTensor to the pages its rows need,
        giving back its pages ahead (they hold nothing yet, so this costs no
        sequence its progress), and tells the broker it keeps none; returns
        the bytes freed."""
        chunk = self.chunk_bytes

        def pages(vt, rows):
            return -(-rows * vt._space.row_bytes // chunk)

        targets = [(vt, self._map_ahead.rows(vt._space, vt._num_tokens, ahead=0)) for vt in list(self._live.values())]
        targets = [(vt, keep) for vt, keep in targets if vt._mapped_tokens > keep]
        freed = sum(pages(vt, vt._mapped_tokens) - pages(vt, keep) for vt, keep in targets) * chunk
        self._send_shrink(targets, all_ahead=True)
        return freed

    def _give_back_pages_ahead(self, timeout: float) -> int:
        """The first answer to a reclaim or recall notice (on the listener):
        _shrink_to_pages_needed, in order after the operations submitted
        before it (a submission holds _submit_mu, so no growth is decided
        here between the rows it reads and the shrink: _grown_here). Waits
        up to `timeout` (the notice's deadline): the answer is late rather
        than never. Returns the bytes freed (0 when it failed or is late)."""
        if not self._map_ahead.pages or self._transport is None or not self._transport.maps_ahead:
            return 0
        try:
            return self._submit(self._shrink_to_pages_needed, data_plane=True).result(timeout=timeout)
        except Exception:  # noqa: BLE001 - the handlers may still free what is asked
            log.warning("giving back the pages mapped ahead failed", exc_info=True)
            return 0

    def _or_without_pages_ahead(self, fn):
        """Runs fn(exact_only) (an allocation, on the worker). The broker
        refuses a client that maps pages ahead at once (status.OWN_PAGES_AHEAD):
        it gives them back and runs fn once more, asking only for the rows it
        needs, so memory held for the steps to come never refuses the one at
        hand, nor costs another client anything while it is held."""
        try:
            return fn(False)
        except errors.OutOfMemory as exc:
            if not str(exc).startswith(status.OWN_PAGES_AHEAD):
                raise
        self._shrink_to_pages_needed()
        return fn(True)

    def _unmap_first(self, vt: RemoteVTensor) -> None:
        """Unmaps a vTensor's pages here before the broker is asked to free
        them: the broker hands a freed chunk to the next client at once.
        From here the vTensor is unusable, whatever the broker answers; it
        is released once the broker released it (_released_at_broker). One
        whose unmap failed is not asked of the broker (its pages may still
        be mapped here) and stays unreleased, its slot held there: the next
        release() unmaps it again (_unmap_held)."""
        if vt._released:
            raise errors.FailedPrecondition(f"vTensor {vt.id} is not live (already released)")
        self._hold(vt)
        self._unmap_held(vt)

    def _hold(self, vt: RemoteVTensor) -> None:
        """A live vTensor whose release (or its space's close) begins:
        unusable from here on, and held at the broker, its pages possibly
        mapped here, until the broker released it (_released_at_broker)."""
        vt._released = True
        self._live.pop(vt.id, None)
        vt._broker_holds = True
        vt._mapped_here = True
        self._held_at_broker[vt.id] = vt

    def _unmap_held(self, vt: RemoteVTensor) -> None:
        """Unmaps the pages of a vTensor the broker holds, once: an unmap
        that failed keeps what it did not unmap recorded (mapper_client.cc),
        so the next call unmaps the rest."""
        if vt._mapped_here:
            self._mapper.unmap_slot(vt._space.id, vt._slot)
            vt._mapped_here = False

    def _release(self, vt: RemoteVTensor) -> RemoteFuture:
        def run():
            # A release whose unmap failed here, or that the broker failed
            # (refused it: too many calls in flight, say), left the vTensor
            # held there: this one unmaps what is left and asks again.
            if vt._broker_holds:
                self._unmap_held(vt)
            else:
                self._unmap_first(vt)
            self._transport.release(vt.id)
            self._released_at_broker([vt])
        return self._submit(run, data_plane=True)

    def _prefix_record(self, space: RemoteSpace, vt, token_ids, stream=None, release=False) -> RemoteFuture:
        vt = self._own(vt, "prefix_record")
        request = _message(vtm_pb2.PrefixRecordRequest, "prefix_record", space_id=space.id, vtensor_id=vt.id,
                           token_ids=_token_ids(token_ids), release=bool(release))
        # The broker copies the recorded bytes in its own process, where no
        # stream of ours orders anything: the bytes are made final (the work
        # queued on `stream` now has finished; None on the host) before the
        # call is sent (docs/design.md §5).
        fence = self._mapper.record_fence(stream)

        def run():
            # Checked here, in order after the vTensor's earlier growth: the
            # broker's count includes the rows mapped ahead, never written.
            if len(request.token_ids) > vt._num_tokens and not vt._released:
                raise errors.InvalidArgument(f"prefix_record: {len(request.token_ids)} tokens, but the vTensor "
                                             f"holds only {vt._num_tokens}")
            if fence is not None:
                fence.wait()
            if not release:
                reply = self._or_without_pages_ahead(
                    lambda _: self._rpc("prefix_record", self._stub.PrefixRecord, request))
                self._apply(reply)
                return reply.value
            # As a release: unmapped here first, so the vTensor is unusable
            # whatever the broker answers; if its record (or release) failed,
            # the vTensor is released there alone (a release that fails too
            # leaves it unreleased, for release() to ask again; a session
            # that is gone freed it already). Bad input is refused here
            # first, as in process, so that it changes nothing.
            if vt._space is not space:
                raise errors.FailedPrecondition(f"prefix_record: vTensor {vt.id} belongs to space "
                                                f"'{vt._space.name}', not '{space.name}'")
            if space.closed:
                raise errors.FailedPrecondition(f"prefix_record: space '{space.name}' is closed")
            self._unmap_first(vt)
            try:
                reply = self._rpc("prefix_record", self._stub.PrefixRecord, request)
            except errors.Error:
                self._release_at_broker(vt)
                raise
            self._apply(reply)
            if not any(state.vtensor_id == vt.id and state.released for state in reply.vtensors):
                self._release_at_broker(vt)  # a broker from before `release`: it recorded only
            return reply.value
        return self._submit(run, data_plane=True)

    def _release_at_broker(self, vt: RemoteVTensor) -> None:
        """Releases at the broker a vTensor unmapped here already (best
        effort: one the broker does not release stays unreleased, for the
        caller's release() to ask again; a session that is gone frees it)."""
        try:
            self._transport.release(vt.id)
        except errors.Error:
            return
        self._released_at_broker([vt])

    def _prefix_match(self, space: RemoteSpace, token_ids, stream=None) -> RemoteFuture:
        # `stream` orders nothing here: a match copies only pages of the
        # tree, and every client waited for its bytes before recording them.
        request = _message(vtm_pb2.PrefixMatchRequest, "prefix_match", space_id=space.id,
                           token_ids=_token_ids(token_ids))

        def run():
            reply = self._or_without_pages_ahead(lambda _: self._rpc("prefix_match", self._stub.PrefixMatch, request))
            vt = self._new_vtensor(space, reply) if reply.vtensor_id else None
            self._apply(reply)
            return RemoteMatch(vt, reply.matched_tokens, reply.restored_tokens)
        return self._submit(run, data_plane=True)

    def _prefix_forget(self, space: RemoteSpace, token_ids) -> RemoteFuture:
        request = _message(vtm_pb2.PrefixMatchRequest, "prefix_forget", space_id=space.id,
                           token_ids=_token_ids(token_ids))
        return self._submit(lambda: self._rpc("prefix_forget", self._stub.PrefixForget, request).value)

    def _clear_prefixes(self, space: RemoteSpace) -> RemoteFuture:
        def run():
            reply = self._rpc("clear_prefixes", self._stub.ClearPrefixes, vtm_pb2.SpaceRequest(space_id=space.id))
            self._apply(reply)
            return reply.value
        return self._submit(run)

    def _prefix_restore_bytes(self, space: RemoteSpace, token_ids) -> RemoteFuture:
        request = _message(vtm_pb2.PrefixMatchRequest, "prefix_restore_bytes", space_id=space.id,
                           token_ids=_token_ids(token_ids))
        return self._submit(lambda: self._rpc("prefix_restore_bytes", self._stub.PrefixRestoreBytes, request).value)

    def _prefix_nodes(self, space: RemoteSpace) -> RemoteFuture:
        def run():
            reply = self._rpc("prefix_nodes", self._stub.PrefixNodes, vtm_pb2.SpaceRequest(space_id=space.id))
            return [{"start": n.start, "end": n.end, "tokens": list(n.tokens), "locks": n.locks,
                     "pages": [None if c == status.HOLE_PAGE else c for c in n.pages], "on_host": n.on_host,
                     "host_pages": list(n.host_pages)}
                    for n in reply.nodes]
        return self._submit(run)

    def _close_space(self, space: RemoteSpace) -> RemoteFuture:
        with self._op_mu:
            space.close_requested = True
            lost = self._liveness.broken is not None and not space.closed
            if lost:
                # The lost session took the space with it: closed here, so
                # that reconnect() does not bring it back; its area goes once
                # the old mappings are revoked (reconnect, close).
                self._release_vtensors_of(space)
                space.closed = True
        if lost:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(None)
            return RemoteFuture(done, None)

        def run():
            if space.closed:
                if space.close_requested:
                    return  # closed since it was queued (a reconnect forgot it): what this close asked
                raise errors.FailedPrecondition(f"space '{space.name}' is closed")
            # Unmapped here first, as for a release; the space's vTensors
            # are unusable from here on, and released once the broker closed
            # the space. An unmap here or a call there that fails leaves them
            # held there, as a failed release does (a second close(), or their
            # release(), asks again): not `released`, so that a caller waiting
            # for their release does not take them for gone.
            for vt in [vt for vt in self._live.values() if vt._space is space]:
                self._hold(vt)
            self._mapper.unmap_space(space.id)
            for vt in [vt for vt in self._held_at_broker.values() if vt._space is space]:
                vt._mapped_here = False
            self._apply(self._rpc("close_space", self._stub.CloseSpace, vtm_pb2.SpaceRequest(space_id=space.id)))
            self._release_vtensors_of(space)
        return self._submit(run)

    # -- the Manager API -----------------------------------------------------

    def create_space(self, row_bytes, max_tokens, max_slots, namespace=None, name=None, *,
                     window_tokens=0) -> RemoteSpace:
        request = _message(vtm_pb2.CreateSpaceRequest, "create_space", row_bytes=_count(row_bytes, "row_bytes"),
                           max_tokens=_count(max_tokens, "max_tokens"), max_slots=_count(max_slots, "max_slots"),
                           namespace=namespace or "", name=name or "",
                           window_tokens=_count(window_tokens, "window_tokens"))

        def run():
            reply = self._rpc("create_space", self._stub.CreateSpace, request)
            try:
                self._mapper.add_space(reply.space_id, reply.max_slots, reply.slot_bytes)
            except BaseException:
                # No reservation here: give the broker's space back.
                self._rpc("close_space", self._stub.CloseSpace, vtm_pb2.SpaceRequest(space_id=reply.space_id))
                raise
            space = RemoteSpace(self, reply)
            self._spaces[space.id] = space
            return space
        return self._submit(run).result()

    def trim(self, bytes=None) -> int:  # noqa: A002 - the in-process API's name
        request = _message(vtm_pb2.TrimRequest, "trim", all=bytes is None,
                           bytes=0 if bytes is None else _count(bytes, "bytes"))

        def run():
            reply = self._rpc("trim", self._stub.Trim, request)
            self._apply(reply)
            return reply.value
        return self._submit(run).result()

    def stats(self, timeout: float | None = None) -> dict:
        """The broker's stats (the whole pool, every client's spaces) plus
        "clients", and "client_id", this client's id there; this client's
        spaces appear under the names it gave them.

        `timeout` (seconds) is for monitoring: the call skips the op queue
        (stats orders against nothing), and a broker that does not answer in
        time raises Unavailable without marking this client broken, so a
        metrics scrape during a stall cannot end the session."""
        def run():
            reply = self._rpc("stats", self._stub.Stats, vtm_pb2.StatsRequest(), timeout=timeout,
                              fatal=timeout is None)
            stats = json.loads(reply.json)
            mine = f"c{self.client_id}/"
            stats["spaces"] = {(name[len(mine):] if name.startswith(mine) else name): info
                               for name, info in stats["spaces"].items()}
            stats["client_id"] = self.client_id  # this client's row of "clients"
            return stats
        if timeout is None:
            return self._submit(run).result()
        if self._closed:
            raise errors.FailedPrecondition("the manager is closed")
        if self._liveness.broken is not None:
            raise self._liveness.error()
        return run()

    def check(self) -> None:
        self._submit(lambda: self._rpc("check", self._stub.Check, vtm_pb2.StatsRequest()) and None).result()

    @property
    def faults(self):
        return None

    @property
    def imports(self) -> int:
        """Chunks imported into this process (mapped, or kept for reuse)."""
        return self._mapper.imports

    def close(self) -> None:
        """Ends the session: this process unmaps everything, then the broker
        releases every vTensor and space of this client. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._worker.join()
        self._teardown()
        for space in self._spaces.values():
            space.closed = True
        for vt in self._live.values():
            vt._released = True
        self._released_at_broker(list(self._held_at_broker.values()))  # the goodbye released them
        self._spaces.clear()
        self._live.clear()

    def _teardown(self) -> None:
        # Unmapped before the goodbye: the broker frees the chunks at goodbye.
        # Where an unmap failed, no goodbye (_disconnect): the broker keeps the
        # session's chunks from other clients until this process exits.
        if self._mapper is not None:
            self._liveness.unmapped = self._mapper.close()
            if not self._liveness.unmapped:
                log.warning("closing: some chunks stay mapped here: no goodbye; the broker keeps them from other "
                            "clients until this process exits")
        self._disconnect()

    def _disconnect(self) -> None:
        """Says goodbye (the broker frees what the session held) and closes
        the session's channels; the mapper stays. No goodbye while some of
        the session's pages are still mapped here (a revoke or close whose
        unmap failed): the broker would hand their chunks to another client."""
        if self._lease is not None:
            if self._liveness.unmapped:
                try:
                    say_bye(self._fd_socket, self._lease, min(self._timeout, _BYE_TIMEOUT_S))
                except (OSError, ValueError, errors.Error):
                    pass  # the broker is gone (or hung), and the session with it
            self._lease = None
        with self._grant_mu:  # from here on, the old session's listener applies no quota notice
            session, self._session = self._session, None
        if session is not None:
            session.close()  # ends the listener's wait; the listener closes the fd
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._fds is not None:
            self._fds.close()
            self._fds = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"RemoteManager(name='{self.name}', backend='{self.backend}', chunk_bytes={self.chunk_bytes})"


def connect(address: str, name: str | None = None, priority: int | None = None, guaranteed_bytes: int | None = None,
            limit_bytes: int | None = None, timeout: float = 10.0, fast_path: bool = True,
            map_ahead_pages: int = 0, stop: threading.Event | None = None) -> RemoteManager:
    """A manager served by the vtm broker at `address` ("unix:PATH"), with
    vtm.Manager's API. Raises vtm.Unavailable when no broker answers within
    `timeout` seconds, which is also the deadline of every later call.
    The operator decides the client's priority, guarantee and limit (by
    `name`); priority, guaranteed_bytes and limit_bytes may only ask for less
    (None: what the operator gives; the granted values are the manager's
    priority, guaranteed_bytes and limit_bytes).
    fast_path=False sends every call over gRPC, even where the broker offers
    its step socket (a baseline for scripts/bench_colocation.py).
    map_ahead_pages=L: a growing vTensor keeps L pages mapped ahead of its
    rows (they count against the limit), so that a step needs a round trip
    to the broker only when it outgrows them (see "mapping ahead" below).
    stop: an event that, once set, ends the wait for a broker at once with
    vtm.Unavailable (a server told to stop while it starts)."""
    return RemoteManager(address, name, priority, guaranteed_bytes, limit_bytes, timeout, fast_path, map_ahead_pages,
                         stop)
