"""How a client's hot operations reach the broker: one interface, two bindings.

create, extend, step and release run on the client's worker (client.py), one
at a time, and return only once this process maps what the broker changed.
Two bindings carry them:

- GrpcTransport: the Broker service's Create / Extend / Step / Release calls.
  Every broker answers them; a client uses them alone with fast_path=False.
- StepTransport: the broker's step socket (step_channel.py), one datagram each
  way with the new chunks' fds attached. Only it can ask for pages ahead
  (map_ahead.py): the broker refuses them rather than reclaim memory for
  them, and the rows needed are then asked for as usual. A request too large
  for a datagram goes over gRPC.

Both answer in the same terms: a create gives the new vTensor's id, slot and
the rows mapped for it; a growth gives the rows mapped for each vTensor. What
a reply changed is mapped through the client (`_apply` for gRPC replies,
`_apply_step_reply` for the step socket's), which owns the mapper and the
vTensors' state; `_rpc` makes a gRPC call. A failure that leaves the
connection's state unknown marks the session lost (`client._liveness`,
liveness.py).
"""

from __future__ import annotations

from vtm import errors
from vtm.broker import step_channel
from vtm.proto.vtm.v1 import vtm_pb2


def _message(cls, what: str, **fields):
    """A request message; a field out of its proto range is InvalidArgument."""
    try:
        return cls(**fields)
    except (ValueError, TypeError) as exc:
        raise errors.InvalidArgument(f"{what}: {exc}") from None


class Transport:
    """The interface. `sizes` are (vTensor, tokens, low mark or None).
    `ahead` and `exact` are the rows to ask for, per vTensor, with the
    pages ahead and with the pages needed only (MapAhead.rows); a binding
    that cannot map ahead asks for the tokens themselves."""

    maps_ahead = False

    def create(self, space_id: int, tokens: int, ahead: int, exact: int) -> tuple[int, int, int]:
        """(vTensor id, slot, rows mapped) of a new vTensor of `tokens` rows."""
        raise NotImplementedError

    def grow(self, what: str, sizes, ahead: list[int], exact: list[int]) -> list[int]:
        """extend ("extend", one vTensor) or step: the rows mapped for each."""
        raise NotImplementedError

    def release(self, vt_id: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class GrpcTransport(Transport):
    def __init__(self, client):
        self._client = client

    def create(self, space_id: int, tokens: int, ahead: int, exact: int) -> tuple[int, int, int]:
        client = self._client
        reply = client._rpc("create", client._stub.Create,
                            _message(vtm_pb2.CreateRequest, "create", space_id=space_id, num_tokens=tokens))
        state = next(s for s in reply.vtensors if s.vtensor_id == reply.vtensor_id)
        client._apply(reply)
        return reply.vtensor_id, state.slot, state.num_tokens

    def grow(self, what: str, sizes, ahead: list[int], exact: list[int]) -> list[int]:
        client = self._client
        targets = [_message(vtm_pb2.ExtendRequest, what, vtensor_id=vt.id, num_tokens=n, low=low)
                   for vt, n, low in sizes]
        if what == "extend":
            client._apply(client._rpc(what, client._stub.Extend, targets[0]))
        else:
            client._apply(client._rpc(what, client._stub.Step, vtm_pb2.StepRequest(targets=targets)))
        return [n for _, n, _ in sizes]

    def release(self, vt_id: int) -> None:
        client = self._client
        client._apply(client._rpc("release", client._stub.Release, vtm_pb2.VTensorRequest(vtensor_id=vt_id)))


class StepTransport(Transport):
    maps_ahead = True

    def __init__(self, client, steps: step_channel.StepClient):
        self._client = client
        self._steps = steps
        self._grpc = GrpcTransport(client)  # for requests a datagram cannot carry

    def create(self, space_id: int, tokens: int, ahead: int, exact: int) -> tuple[int, int, int]:
        (vt_id, slot, mapped, _), _ = self._ahead_or_exact(
            "create", step_channel.CREATE_AHEAD, step_channel.CREATE, [space_id], [ahead], [exact])
        return vt_id, slot, mapped

    def grow(self, what: str, sizes, ahead: list[int], exact: list[int]) -> list[int]:
        lows = any(low is not None for _, _, low in sizes)
        fits = (len(sizes) <= (step_channel.MAX_TRIPLES if lows else step_channel.MAX_PAIRS)
                and all(n < 1 << 64 and (low is None or low < step_channel.KEEP_LOW) for _, n, low in sizes))
        if not fits:
            return self._grpc.grow(what, sizes, ahead, exact)
        if lows:
            op = step_channel.EXTEND_LOW if what == "extend" else step_channel.STEP_LOW
            self.call(what, op, [x for vt, n, low in sizes
                                 for x in (vt.id, n, step_channel.KEEP_LOW if low is None else low)])
            return [n for _, n, _ in sizes]
        op = step_channel.EXTEND if what == "extend" else step_channel.STEP
        return self._ahead_or_exact(what, step_channel.STEP_AHEAD, op, [vt.id for vt, _, _ in sizes], ahead,
                                    exact)[1]

    def release(self, vt_id: int) -> None:
        self.call("release", step_channel.RELEASE, (vt_id, 0))

    def refill(self, wants, mapped) -> None:
        """Maps pages ahead, (vTensor, rows) each, in parts of a datagram;
        `mapped(part)` as each part is granted (the broker refuses them
        without free memory as it is)."""
        for start in range(0, len(wants), step_channel.MAX_PAIRS):
            part = wants[start:start + step_channel.MAX_PAIRS]
            try:
                self.call("step", step_channel.STEP_AHEAD, [x for vt, want in part for x in (vt.id, want)])
            except errors.OutOfMemory:
                continue
            mapped(part)

    def close(self) -> None:
        self._steps.close()

    def call(self, what: str, op: int, words):
        """Runs one op on the step socket and maps what it changed; the
        reply's vTensor fields."""
        try:
            reply = self._steps.call(op, words)
        except errors.Error as exc:
            # The broker's answer (InvalidArgument is a ValueError too);
            # Unavailable: it ended the session.
            if isinstance(exc, errors.Unavailable):
                self._client._liveness.lose(exc)
            raise
        except (OSError, ValueError) as exc:
            # Dead, hung or confused broker: the connection's state is
            # unknown from here on, like a gRPC call past its deadline.
            raise self._client._liveness.lose(
                errors.Unavailable(f"the vtm broker did not answer {what}: {exc}")) from None
        return self._client._apply_step_reply(reply)

    def _ahead_or_exact(self, what: str, ahead_op: int, exact_op: int, keys, ahead, exact):
        """Runs `what` for (key, rows) pairs: with the `ahead` rows (the
        pages ahead too) where they differ from `exact`, else, or when the
        broker refuses the pages ahead, with `exact` (the rows of the pages
        needed). Returns the reply and the rows the broker granted."""
        if ahead != exact:
            try:
                return self.call(what, ahead_op, [x for k, r in zip(keys, ahead) for x in (k, r)]), ahead
            except errors.OutOfMemory:
                pass  # refused (free memory only, within the limit): the rows needed, as usual
        return self.call(what, exact_op, [x for k, r in zip(keys, exact) for x in (k, r)]), exact
