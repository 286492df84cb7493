"""The broker's gRPC service: sessions and the instruction set over one
manager that maps nothing (record_mappings) and exports every chunk once.

Each call authenticates its lease, then runs under the session's lock, so
one client's calls are serialised (a client's own worker sends them one at
a time anyway) while different clients run concurrently on the manager,
which is thread safe. A reply carries the page states of the client's spaces
that the call changed (drained from the manager under the same lock), so the
client maps exactly what the broker accounted for.

Invariants:
  * sessions holds every open session, by lease; a session is removed and
    closed (its spaces closed, which releases its vTensors) exactly once;
  * a call only ever names spaces and vTensors of its own session;
  * while stopping, no session is admitted and no operation starts.
"""

from __future__ import annotations

import json
import queue
import threading
import time

import grpc

import vtm
from vtm.broker import status
from vtm.broker.policy import Policy
from vtm.broker.session import Session
from vtm.proto.vtm.v1 import vtm_pb2, vtm_pb2_grpc

_MAX_COUNT = 1 << 62  # sizes above this are malformed (the manager takes int64)
_ATTACH_S = 10.0  # a session whose Notices stream never opens is dropped after this


def _count(value: int, what: str) -> int:
    if value >= _MAX_COUNT:
        raise vtm.InvalidArgument(f"{what} {value} is out of range")
    return value


class BrokerService(vtm_pb2_grpc.BrokerServicer):
    def __init__(self, manager, backend: str, device: int, fd_socket: str, step_socket: str = ""):
        self.manager = manager
        self._chunk_bytes = manager.chunk_bytes
        self._backend = backend
        self._device = device
        self._fd_socket = fd_socket
        self.step_socket = step_socket  # advertised in Hello once its server listens
        self._mu = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._next_client = 1
        self._stopping = False
        self.policy = Policy(self._open_sessions, manager.chunk_bytes, self._free_bytes)
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

    def end_session(self, session: Session) -> None:
        """Releases everything the client holds; its chunks go back to the
        pool, except those the prefix tree still references for others."""
        with self._mu:
            if self._sessions.get(session.lease) is not session:
                return
            del self._sessions[session.lease]
        with session.lock:
            if session.closed:
                return
            session.closed = True
            for space_id, space in list(session.spaces.items()):
                try:
                    space.close()
                    self.manager._drain_effects(space_id)
                except vtm.Error:
                    pass  # counted by the manager (rollback_failures_total); nothing else to do
            session.spaces.clear()
            session.vtensors.clear()
            session.vt_state.clear()
            session.geometry.clear()
            session.pages.clear()
            session.serial_refs.clear()
            session.chunk_of.clear()
        session.notices.put(None)

    def _reap(self) -> None:
        while not self._reaper_stop.wait(1.0):
            now = time.monotonic()
            with self._mu:
                stale = [s for s in self._sessions.values() if not s.attached and now - s.created_at > _ATTACH_S]
            for session in stale:
                self.end_session(session)

    def stop_admitting(self) -> None:
        with self._mu:
            self._stopping = True
            sessions = list(self._sessions.values())
        for session in sessions:
            # Then the stream ends, so the server's grace period is spent on
            # calls in flight, not on waiting for long-lived streams.
            session.notices.put(vtm_pb2.Notice(kind=vtm_pb2.Notice.SHUTDOWN, reason="the broker is stopping"))
            session.notices.put(None)

    def close_all(self) -> None:
        self._reaper_stop.set()
        with self._mu:
            sessions = list(self._sessions.values())
        for session in sessions:
            self.end_session(session)

    def clients(self) -> list[dict]:
        with self._mu:
            sessions = list(self._sessions.values())
        chunk_bytes = self.manager.chunk_bytes
        return [{"id": s.client_id, "name": s.name, "pid": s.pid, "priority": s.priority,
                 "guaranteed_bytes": s.guaranteed_bytes, "limit_bytes": s.limit_bytes,
                 "mapped_bytes": s.mapped_bytes(chunk_bytes), "spaces": len(s.spaces),
                 "vtensors": len(s.vtensors), "owes_bytes": (0 if s.owed_target is None else
                                                             max(0, s.mapped_bytes(chunk_bytes) - s.owed_target))}
                for s in sessions]

    # -- plumbing ------------------------------------------------------------

    def _run(self, context, body, session_required=True):
        """Runs body(session) under the session lock, mapping vtm errors to codes."""
        try:
            if self._stopping:
                raise vtm.Unavailable("the broker is stopping")
            if not session_required:
                return body(None)
            session = self._session(context)
            with session.lock:
                if session.closed:
                    context.abort(grpc.StatusCode.UNAUTHENTICATED, "the session ended")
                return body(session)
        except vtm.Error as exc:
            context.set_trailing_metadata(((status.ERROR_KEY, type(exc).__name__),))
            context.abort(status.code_of(exc), str(exc))
        except (TypeError, ValueError, OverflowError) as exc:
            # Malformed input the manager's binding rejected before running.
            context.set_trailing_metadata(((status.ERROR_KEY, "InvalidArgument"),))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def run_op(self, session: Session, body):
        """Runs body() under the session lock for the step socket
        (vtm/broker/step_channel.py), as _run does for gRPC: vtm errors
        propagate; input the manager's binding rejected is InvalidArgument."""
        if self._stopping:
            raise vtm.Unavailable("the broker is stopping")
        with session.lock:
            if session.closed:
                raise vtm.Unavailable("the session ended")
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
        spaces the call changed; states: (id, [space, slot, tokens] or None
        when released) of the vTensors with ids `vtensors`; fresh: the
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
                reply.vtensors.append(vtm_pb2.VTensorState(vtensor_id=vt_id, space_id=state[0], slot=state[1],
                                                           num_tokens=state[2]))
        return reply

    def _pages_for(self, session: Session, space_id: int, num_tokens: int) -> int:
        return -(-num_tokens * session.geometry[space_id][0] // self._chunk_bytes)

    def _missing_bytes(self, session: Session, vt_id: int, num_tokens: int) -> int:
        """Bytes an extend of a vTensor to `num_tokens` rows would map."""
        space_id, _, current = session.vt_state[vt_id]
        if num_tokens <= current:
            return 0  # the common decode step: within what is mapped
        row_bytes, max_tokens = session.geometry[space_id]
        if num_tokens > max_tokens:
            return 0  # the manager refuses it with InvalidArgument
        # A live vTensor maps exactly the pages covering its rows (the broker
        # keeps no slot cache), so the difference is what it will map.
        chunk = self._chunk_bytes
        return (-(-num_tokens * row_bytes // chunk) + (current * row_bytes // -chunk)) * chunk

    def _free_bytes(self) -> int:
        stats = self.manager.stats()
        return stats["capacity_bytes"] - stats["chunks_held"] * self._chunk_bytes

    def _allocate(self, session: Session, extra_bytes: int, op, gate_bytes: int | None = None):
        """Runs an allocating op under the policy: the client's limit and
        debts first; memory reserved for another client's retry left alone
        (`gate_bytes`, default extra_bytes: what the op may take); on out of
        memory, reclaim from lower priorities, with what they free reserved
        for this op, and retry once."""
        self.policy.admit(session, extra_bytes)
        gate_bytes = extra_bytes if gate_bytes is None else gate_bytes
        try:
            with self.policy.gate(session, gate_bytes):
                return op()
        except vtm.OutOfMemory:
            if not self.policy.reclaim(session, extra_bytes, reserve_bytes=max(extra_bytes, gate_bytes)):
                raise
        try:
            with self.policy.gate(session, gate_bytes):
                return op()
        finally:
            self.policy.unreserve(session)

    # -- RPCs --------------------------------------------------------------

    def Hello(self, request, context):
        def body(_):
            with self._mu:
                client_id = self._next_client
                self._next_client += 1
                name = request.name or f"client{client_id}"
                session = Session(client_id, name, request.priority, _count(request.guaranteed_bytes, "guaranteed_bytes"),
                                  _count(request.limit_bytes, "limit_bytes"), request.pid)
                self._sessions[session.lease] = session
            m = self.manager
            return vtm_pb2.HelloReply(lease=session.lease, client_id=client_id, backend=self._backend,
                                      device=self._device, chunk_bytes=m.chunk_bytes, capacity_bytes=m.capacity_bytes,
                                      granularity=m.granularity, fd_socket=self._fd_socket, name=name,
                                      step_socket=self.step_socket)
        return self._run(context, body, session_required=False)

    def Notices(self, request, context):
        session = self._session(context)
        session.attached = True
        # The stream ends when the client closes it, disconnects or dies:
        # its leases end with it.
        if not context.add_callback(
                lambda: threading.Thread(target=self.end_session, args=(session,), daemon=True).start()):
            self.end_session(session)
            return
        while context.is_active():
            try:
                notice = session.notices.get(timeout=0.25)
            except queue.Empty:
                continue
            if notice is None:
                return
            yield notice

    def CreateSpace(self, request, context):
        def body(session):
            name = request.name or f"space{session.next_space}"
            if name in session.space_names.values():
                raise vtm.InvalidArgument(f"a space named '{name}' already exists")
            space = self.manager.create_space(
                _count(request.row_bytes, "row_bytes"), _count(request.max_tokens, "max_tokens"),
                _count(request.max_slots, "max_slots"), namespace=request.namespace or None,
                name=f"c{session.client_id}/{name}")
            session.next_space += 1
            session.spaces[space.id] = space
            session.space_names[space.id] = name
            session.geometry[space.id] = (space.row_bytes, space.max_tokens)
            return vtm_pb2.SpaceReply(space_id=space.id, name=name, namespace=space.namespace,
                                      row_bytes=space.row_bytes, max_tokens=space.max_tokens, max_slots=space.max_slots,
                                      slot_bytes=space.slot_bytes, pages_per_slot=space.pages_per_slot)
        return self._run(context, body)

    def CloseSpace(self, request, context):
        def body(session):
            space = self._space(session, request.space_id)
            space.close()
            del session.spaces[request.space_id]
            del session.space_names[request.space_id]
            del session.geometry[request.space_id]
            gone = [vt_id for vt_id, state in session.vt_state.items() if state[0] == request.space_id]
            for vt_id in gone:
                session.drop_vtensor(vt_id)
            return self._reply(session, vtensors=gone, closed=(request.space_id,))
        return self._run(context, body)

    # The hot ops, shared by the gRPC calls below and the step socket; each
    # runs under the session lock and leaves its page effects to collect().

    def create(self, session: Session, space_id: int, num_tokens: int) -> int:
        space = self._space(session, space_id)
        n = _count(num_tokens, "num_tokens")
        extra = self._pages_for(session, space.id, min(n, session.geometry[space.id][1])) * self._chunk_bytes
        vt = self._allocate(session, extra, lambda: space.create(n).result())
        session.add_vtensor(vt)
        return vt.id

    def extend(self, session: Session, vt_id: int, num_tokens: int) -> None:
        vt = self._vtensor(session, vt_id)
        n = _count(num_tokens, "num_tokens")
        self._allocate(session, self._missing_bytes(session, vt.id, n), lambda: vt.extend(n).result())
        state = session.vt_state[vt.id]
        state[2] = max(state[2], n)

    def step(self, session: Session, targets) -> None:
        """targets: (vTensor id, tokens) pairs; a vTensor named twice gets the larger size."""
        wanted = {}
        for vt_id, n in targets:
            self._vtensor(session, vt_id)
            n = _count(n, "num_tokens")
            if n > wanted.get(vt_id, -1):
                wanted[vt_id] = n
        extra = sum(self._missing_bytes(session, vt_id, n) for vt_id, n in wanted.items())
        vts = session.vtensors
        self._allocate(session, extra, lambda: self.manager.step({vts[i]: n for i, n in wanted.items()}).result())
        states = session.vt_state
        for vt_id, n in wanted.items():
            state = states[vt_id]
            if n > state[2]:
                state[2] = n

    def release(self, session: Session, vt_id: int) -> None:
        vt = self._vtensor(session, vt_id)
        vt.release().result()
        session.drop_vtensor(vt.id)

    def Create(self, request, context):
        def body(session):
            vt_id = self.create(session, request.space_id, request.num_tokens)
            return self._reply(session, vtensors=[vt_id], vtensor_id=vt_id)
        return self._run(context, body)

    def Extend(self, request, context):
        def body(session):
            self.extend(session, request.vtensor_id, request.num_tokens)
            return self._reply(session)  # the client knows the new size: max(old, n)
        return self._run(context, body)

    def Step(self, request, context):
        def body(session):
            self.step(session, [(t.vtensor_id, t.num_tokens) for t in request.targets])
            return self._reply(session)  # the client knows the new sizes: max(old, n)
        return self._run(context, body)

    def Release(self, request, context):
        def body(session):
            self.release(session, request.vtensor_id)
            return self._reply(session, vtensors=[request.vtensor_id])
        return self._run(context, body)

    def PrefixRecord(self, request, context):
        def body(session):
            space = self._space(session, request.space_id)
            vt = self._vtensor(session, request.vtensor_id)
            added = space.prefix_record(vt, list(request.token_ids)).result()
            return self._reply(session, value=added)
        return self._run(context, body)

    def PrefixMatch(self, request, context):
        def body(session):
            space = self._space(session, request.space_id)
            tokens = list(request.token_ids)
            # A match maps recorded chunks and copies at most its partial last page.
            match = self._allocate(session, 0, lambda: space.prefix_match(tokens).result(),
                                   gate_bytes=self._chunk_bytes)
            if match.vtensor is None:
                return self._reply(session, matched_tokens=0)
            mapped = sum(c is not None for c in match.vtensor.page_chunks()) * self._chunk_bytes
            if session.limit_bytes and session.mapped_bytes(self._chunk_bytes) + mapped > session.limit_bytes:
                match.vtensor.release().result()  # its effects cancel out in the drain
                raise vtm.OutOfMemory(f"client '{session.name}' is limited to {session.limit_bytes} bytes; "
                                      f"the match would map {mapped} more")
            session.add_vtensor(match.vtensor)
            return self._reply(session, vtensors=[match.vtensor.id], vtensor_id=match.vtensor.id,
                               matched_tokens=match.num_tokens)
        return self._run(context, body)

    def ClearPrefixes(self, request, context):
        def body(session):
            dropped = self._space(session, request.space_id).clear_prefixes()
            return self._reply(session, value=dropped)
        return self._run(context, body)

    def PrefixNodes(self, request, context):
        def body(session):
            nodes = self._space(session, request.space_id).prefix_nodes()
            return vtm_pb2.PrefixNodesReply(nodes=[
                vtm_pb2.PrefixNode(start=n["start"], end=n["end"], tokens=n["tokens"], locks=n["locks"],
                                   pages=n["pages"]) for n in nodes])
        return self._run(context, body)

    # Control calls: no lease needed (see the proto).

    def Trim(self, request, context):
        def body(_):
            # No page effects: the broker keeps no slot cache, so trimming
            # unmaps nothing any client maps.
            return vtm_pb2.OpReply(value=self.manager.trim(None if request.all else _count(request.bytes, "bytes")))
        return self._run(context, body, session_required=False)

    def Stats(self, request, context):
        def body(_):
            stats = self.manager.stats()
            stats["clients"] = self.clients()
            return vtm_pb2.StatsReply(json=json.dumps(stats))
        return self._run(context, body, session_required=False)

    def Check(self, request, context):
        def body(_):
            self.manager.check()
            return vtm_pb2.OpReply()
        return self._run(context, body, session_required=False)

    def SetQuota(self, request, context):
        def body(_):
            matching = [s for s in self._open_sessions() if s.name == request.name]
            if not matching:
                raise vtm.NotFound(f"no client named '{request.name}'")
            for session in matching:
                session.limit_bytes = _count(request.limit_bytes, "limit_bytes")
                if request.set_guaranteed:
                    session.guaranteed_bytes = _count(request.guaranteed_bytes, "guaranteed_bytes")
            return vtm_pb2.StatsReply(json=json.dumps([c for c in self.clients() if c["name"] == request.name]))
        return self._run(context, body, session_required=False)

    def Ack(self, request, context):
        def body(session):
            self.policy.settle(session)
            return vtm_pb2.OpReply()
        return self._run(context, body)
