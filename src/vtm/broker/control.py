"""The broker's control calls alone, for its TCP listener (vtmd --control
tcp:HOST:PORT): Stats, Trim and SetQuota, plus the gRPC health service.

Chunks travel as fds over Unix sockets only, so TCP can carry no data
plane: without Hello there is no session, no lease and no vTensor to reach,
and every other call of the Broker service answers UNIMPLEMENTED.

Who may call: vtmd refuses to listen off loopback without a token
(--control-token-file); with one, every control call must carry it in the
metadata key "vtm-control-token", else UNAUTHENTICATED (health needs none:
it tells nothing). On loopback without a token, anyone on the host may call
(the Unix socket's folder, 0700, is what guards the rest).

Its calls run on threads of its own (vtmd's _CONTROL_THREADS), none of the
Unix socket's: they do not count against --max-calls-in-flight-per-client,
which bounds what one client holds of those (service.py, _in_flight).

Invariant: a call here never opens a session nor reaches one.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import stat

import grpc

from vtm import errors
from vtm.proto.vtm.v1 import vtm_pb2_grpc

TOKEN_KEY = "vtm-control-token"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def read_token(path: str) -> str:
    """The token in `path`, which only its owner may read (like an ssh key)."""
    try:
        st = os.stat(path)
        with open(path) as f:
            token = f.read().strip()
    except OSError as exc:
        raise errors.InvalidArgument(f"control token file: {exc}") from None
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise errors.InvalidArgument(f"control token file {path} must be private (mode 0600, it has "
                                     f"{stat.S_IMODE(st.st_mode):o})")
    if len(token) < 16:
        raise errors.InvalidArgument(f"control token file {path} must hold a token of at least 16 characters")
    return token


class ControlService(vtm_pb2_grpc.BrokerServicer):
    def __init__(self, service, token: str | None):
        self._service = service  # the BrokerService of the Unix socket
        self._token = token

    def _authorized(self, context) -> None:
        if self._token is None:
            return
        given = dict(context.invocation_metadata()).get(TOKEN_KEY, "")
        if not hmac.compare_digest(given.encode(), self._token.encode()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"a control call needs the broker's token ({TOKEN_KEY})")

    def Stats(self, request, context):
        self._authorized(context)
        return self._service.Stats(request, context, counted=False)

    def Trim(self, request, context):
        self._authorized(context)
        return self._service.Trim(request, context, counted=False)

    def SetQuota(self, request, context):
        self._authorized(context)
        return self._service.SetQuota(request, context, counted=False)
