"""The broker's control calls alone, for its TCP listener (vtmd --control
tcp:HOST:PORT): Stats, Trim and SetQuota, plus the gRPC health service.

Chunks travel as fds over Unix sockets only, so TCP can carry no data
plane: without Hello there is no session, no lease and no vTensor to reach,
and every other call of the Broker service answers UNIMPLEMENTED. The
listener has no authentication of its own (the Unix socket's is its private
folder): bind it to loopback or a trusted network only.

Invariant: a call here never opens a session nor reaches one.
"""

from __future__ import annotations

from vtm.proto.vtm.v1 import vtm_pb2_grpc


class ControlService(vtm_pb2_grpc.BrokerServicer):
    def __init__(self, service):
        self._service = service  # the BrokerService of the Unix socket

    def Stats(self, request, context):
        return self._service.Stats(request, context)

    def Trim(self, request, context):
        return self._service.Trim(request, context)

    def SetQuota(self, request, context):
        return self._service.SetQuota(request, context)
