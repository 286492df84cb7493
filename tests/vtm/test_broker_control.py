"""vtmd --control tcp:HOST:PORT: the control calls (Stats, Trim, SetQuota)
and health over TCP, and nothing else: no Hello, so no session, lease or data
plane can be reached there."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import vtm
from broker_testing import CHUNK, ROW, BrokerProcess
from vtm.broker import ctl
from vtm.broker.server import tcp_target
from vtm.proto.vtm.v1 import vtm_pb2, vtm_pb2_grpc


@pytest.fixture
def broker(tmp_path):
    b = BrokerProcess(tmp_path, capacity_chunks=16, control="tcp:127.0.0.1:0")
    yield b
    b.kill()


def test_vtmctl_over_tcp_sees_and_steers_the_unix_clients(broker, capsys):
    address = broker.control_address
    assert address.startswith("tcp:127.0.0.1:") and not address.endswith(":0")
    with vtm.connect(broker.address, name="app") as mgr:
        vt = mgr.create_space(row_bytes=ROW, max_tokens=2000, max_slots=1).create(100).result()
        assert ctl.main(["--address", address, "stats", "--json"]) == 0
        stats = json.loads(capsys.readouterr().out)
        assert stats["chunks_held"] == 2 and [c["name"] for c in stats["clients"]] == ["app"]
        assert ctl.main(["--address", address, "set-quota", "app", str(2 * CHUNK)]) == 0
        assert "app: limit" in capsys.readouterr().out
        with pytest.raises(vtm.OutOfMemory, match="limited to"):
            vt.extend(200).result()  # 4 chunks > the limit set over TCP
        vt.release().result()
        assert ctl.main(["--address", address, "trim"]) == 0
        assert capsys.readouterr().out == f"released {2 * CHUNK} bytes\n"
        assert mgr.stats()["chunks_created"] == 0


def test_tcp_serves_no_data_plane(broker):
    target = tcp_target(broker.control_address)
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="vtm.v1.Broker"),
                                                          timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = vtm_pb2_grpc.BrokerStub(channel)
        for method, request in ((stub.Hello, vtm_pb2.HelloRequest(name="x")),
                                (stub.CreateSpace, vtm_pb2.CreateSpaceRequest(row_bytes=1, max_tokens=1, max_slots=1)),
                                (stub.Create, vtm_pb2.CreateRequest(space_id=1, num_tokens=1)),
                                (stub.Step, vtm_pb2.StepRequest()), (stub.Check, vtm_pb2.StatsRequest())):
            with pytest.raises(grpc.RpcError) as err:
                method(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert json.loads(stub.Stats(vtm_pb2.StatsRequest(), timeout=10).json)["clients"] == []
    with pytest.raises(vtm.InvalidArgument, match="unix:PATH"):
        vtm.connect(broker.control_address)


def test_bad_control_addresses_are_refused(tmp_path, capsys):
    for address in ("tcp:1234", "tcp:host:port", "unix:/x", "tcp::80"):
        done = subprocess.run([sys.executable, "-m", "vtm.broker", "--listen", f"unix:{tmp_path}/b/sock",
                               "--control", address, "--backend", "host"], capture_output=True, text=True,
                              timeout=60, cwd=tmp_path)
        assert done.returncode == 2 and "tcp:HOST:PORT" in done.stderr, (address, done.stderr)
    assert ctl.main(["--address", "tcp:nohost", "stats"]) == 2
    assert "tcp:HOST:PORT" in capsys.readouterr().err
    assert ctl.main(["--address", "http://x", "stats"]) == 2
    assert "unix:PATH or tcp:HOST:PORT" in capsys.readouterr().err


def test_hellos_nobody_attaches_do_not_lock_clients_out(tmp_path):
    """Found reviewing the broker: a process that sent --max-sessions Hellos
    and never attached refused every client for 10 s, and again at every
    round of Hellos. At the cap, a Hello ends the oldest session that has
    not attached (a client attaches within milliseconds of its Hello)."""
    b = BrokerProcess(tmp_path, extra_args=["--max-sessions", "4"])
    try:
        with grpc.insecure_channel(b.address) as channel:
            stub = vtm_pb2_grpc.BrokerStub(channel)
            for i in range(8):
                stub.Hello(vtm_pb2.HelloRequest(name=f"flood{i}"), timeout=10)
        with vtm.connect(b.address, name="victim") as mgr:
            vt = mgr.create_space(row_bytes=ROW, max_tokens=100, max_slots=1).create(10).result()
            assert vt.mapped_bytes == CHUNK
            assert [c["name"] for c in mgr.stats()["clients"] if c["name"] == "victim"] == ["victim"]
    finally:
        b.kill()


def test_a_hello_refused_anyway_ends_no_pending_session(tmp_path):
    """Review: a Hello past the guarantees was refused after it had ended
    another client's pending session to make room."""
    from vtm.broker.session_channel import SessionChannel

    quotas = tmp_path / "q.toml"
    quotas.write_text(f'[clients."big"]\nguaranteed_bytes = {64 * CHUNK}\n')
    b = BrokerProcess(tmp_path, extra_args=["--max-sessions", "2", "--quota-file", str(quotas)])
    try:
        with vtm.connect(b.address, name="big"), grpc.insecure_channel(b.address) as channel:
            stub = vtm_pb2_grpc.BrokerStub(channel)
            pending = stub.Hello(vtm_pb2.HelloRequest(name="slow"), timeout=10)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Hello(vtm_pb2.HelloRequest(name="big"), timeout=10)
            assert "guarantees would sum" in refused.value.details()
            SessionChannel(pending.fd_socket, pending.lease, 5).close()  # still pending: it attaches
    finally:
        b.kill()


def test_a_client_whose_session_was_ended_before_its_attach_says_hello_again(tmp_path, monkeypatch):
    """Review: a client whose pending session another Hello ended to make
    room failed at once with "no such lease (say Hello first)". It is told
    why, and vtm.connect says Hello again within its timeout."""
    import vtm.broker.client as client_module

    b = BrokerProcess(tmp_path, extra_args=["--max-sessions", "1"])
    real, calls = client_module.SessionChannel, []

    def attach_after_another_hello(path, lease, timeout):
        calls.append(lease)
        if len(calls) == 1:  # another client's Hello lands between this one's Hello and its attach
            with grpc.insecure_channel(b.address) as channel:
                vtm_pb2_grpc.BrokerStub(channel).Hello(vtm_pb2.HelloRequest(name="other"), timeout=10)
        return real(path, lease, timeout)
    monkeypatch.setattr(client_module, "SessionChannel", attach_after_another_hello)
    try:
        with vtm.connect(b.address, name="victim", timeout=10) as mgr:
            assert len(calls) == 2 and calls[0] != calls[1]
            assert mgr.create_space(row_bytes=ROW, max_tokens=100, max_slots=1).create(10).result().mapped_bytes == CHUNK
    finally:
        b.kill()


def test_a_goodbye_on_the_session_channel_is_answered(tmp_path):
    """Review: a goodbye said on the session's own channel (the protocol
    allows any connection of the session's process) ended the session,
    whose end shut that channel down before the answer went: the client
    read EOF, not {"bye": true}."""
    import socket

    b = BrokerProcess(tmp_path)
    try:
        with grpc.insecure_channel(b.address) as channel:
            hello = vtm_pb2_grpc.BrokerStub(channel).Hello(vtm_pb2.HelloRequest(name="polite"), timeout=10)
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as anchor:
            anchor.settimeout(10)
            anchor.connect(hello.fd_socket)
            anchor.send(json.dumps({"lease": hello.lease, "attach": True}).encode())
            assert json.loads(anchor.recv(65536)) == {"attached": True}
            anchor.send(json.dumps({"lease": hello.lease, "bye": True}).encode())
            said = []
            while (message := anchor.recv(65536)) != b"":
                said.append(json.loads(message))
            assert {"bye": True} in said, said
        with vtm.connect(b.address, name="observer") as mgr:
            assert [c["name"] for c in mgr.stats()["clients"]] == ["observer"]
    finally:
        b.kill()
