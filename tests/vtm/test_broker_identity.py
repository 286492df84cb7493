"""Identity and authority (issue 17, finding 10): the broker takes a
client's pid from the kernel, never from the client; priorities, guarantees
and limits are the operator's (a quota file, vtmctl), a client may only ask
for less; the TCP control listener needs a token off loopback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import grpc
import pytest

import vtm
from broker_testing import CHUNK, ROW, BrokerProcess, held, holder
from vtm.broker import ctl
from vtm.broker.server import tcp_target
from vtm.proto.vtm.v1 import vtm_pb2, vtm_pb2_grpc

ROWS_PER_CHUNK = 65


def _quota_file(tmp_path, text: str) -> str:
    path = tmp_path / "quotas.toml"
    path.write_text(text)
    return str(path)


def _vtmd(tmp_path, *args) -> subprocess.CompletedProcess:
    """Runs vtmd expecting it to refuse its configuration (it exits at once)."""
    return subprocess.run([sys.executable, "-m", "vtm.broker", "--listen", f"unix:{tmp_path}/v/sock",
                           "--backend", "host", "--capacity-bytes", str(16 * CHUNK), "--chunk-bytes", str(CHUNK),
                           "--granularity", str(CHUNK), *args], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)


_IN_ITS_OWN_PID_NAMESPACE = """
import os, sys
import numpy as np
import vtm
assert os.getpid() == 1, os.getpid()  # pid 1 of its own namespace: not what the broker sees
with vtm.connect(sys.argv[1], name="contained", timeout=20) as mgr:
    space = mgr.create_space(row_bytes=1000, max_tokens=1000, max_slots=1)
    vt = space.create(200).result()
    view = space.tensor(np.uint8)
    view[vt.slot, :200 * 1000] = 7
    assert int(view[vt.slot, :200 * 1000].sum()) == 7 * 200 * 1000
    print("ok", vt.mapped_bytes, flush=True)
"""


def test_a_client_in_its_own_pid_namespace_connects(tmp_path):
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1) on this machine")
    probe = subprocess.run([unshare, "--pid", "--fork", "--map-root-user", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"the kernel refuses an unprivileged user + PID namespace: {probe.stderr.strip()}")
    b = BrokerProcess(tmp_path, capacity_chunks=16)
    try:
        done = subprocess.run([unshare, "--pid", "--fork", "--map-root-user", sys.executable, "-c",
                               _IN_ITS_OWN_PID_NAMESPACE, b.address], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path)
        assert done.returncode == 0 and done.stdout.split() == ["ok", str(4 * CHUNK)], done
        with vtm.connect(b.address) as mgr:
            assert held(mgr) == 0  # it closed its session on exit
    finally:
        b.kill()


def test_a_client_cannot_raise_its_own_priority(tmp_path):
    # The operator gives nobody a priority; a client claiming 10 gets 0, so
    # it cannot make the client holding the pool give memory back beyond
    # the fair share of an equal (half the pool: it asks for 10 chunks of 16).
    b = BrokerProcess(tmp_path, capacity_chunks=16)
    try:
        with vtm.connect(b.address, name="holder") as holder, \
                vtm.connect(b.address, name="claimer", priority=10, guaranteed_bytes=16 * CHUNK) as claimer:
            vts = [holder.create_space(row_bytes=ROW, max_tokens=2000, max_slots=1).create(
                14 * ROWS_PER_CHUNK).result()]
            space = claimer.create_space(row_bytes=ROW, max_tokens=2000, max_slots=1)
            with pytest.raises(vtm.OutOfMemory):
                space.create(10 * ROWS_PER_CHUNK).result()
            assert holder.reclaim_notices == 0 and vts[0].mapped_bytes == 14 * CHUNK
            clients = {c["name"]: c for c in holder.stats()["clients"]}
            assert clients["claimer"]["priority"] == 0 and clients["claimer"]["guaranteed_bytes"] == 0
    finally:
        b.kill()


def test_the_operators_quota_file_sets_priorities_and_limits(tmp_path):
    quotas = _quota_file(tmp_path, f"""
[default]
limit_bytes = {12 * CHUNK}

[clients.urgent]
priority = 10
guaranteed_bytes = {4 * CHUNK}
""")
    b = BrokerProcess(tmp_path, capacity_chunks=16, extra_args=["--quota-file", quotas])
    try:
        low = vtm.connect(b.address, name="batch")
        high = vtm.connect(b.address, name="urgent", priority=10)
        shy = vtm.connect(b.address, name="urgent", priority=3, limit_bytes=2 * CHUNK)  # asks for less: granted
        try:
            assert (low.priority, low.guaranteed_bytes, low.limit_bytes) == (0, 0, 12 * CHUNK)
            assert (high.priority, high.guaranteed_bytes, high.limit_bytes) == (10, 4 * CHUNK, 0)
            assert (shy.priority, shy.limit_bytes) == (3, 2 * CHUNK)
            space = low.create_space(row_bytes=ROW, max_tokens=2000, max_slots=8)
            with pytest.raises(vtm.OutOfMemory, match="limited to"):
                space.create(13 * ROWS_PER_CHUNK).result()
            holder(low, 12, "held")  # 12 of 16
            vt = high.create_space(row_bytes=ROW, max_tokens=2000, max_slots=1).create(8 * ROWS_PER_CHUNK).result()
            assert vt.mapped_bytes == 8 * CHUNK and low.reclaim_notices == 1
        finally:
            shy.close()
            high.close()
            low.close()
    finally:
        b.kill()


def test_guarantees_never_sum_past_the_capacity(tmp_path, capsys):
    done = _vtmd(tmp_path, "--quota-file", _quota_file(tmp_path, f"""
[clients.a]
guaranteed_bytes = {10 * CHUNK}
[clients.b]
guaranteed_bytes = {10 * CHUNK}
"""))
    assert done.returncode == 2 and "guarantees" in done.stderr and "capacity" in done.stderr, done.stderr
    done = _vtmd(tmp_path, "--quota-file", _quota_file(tmp_path, "[clients.a]\npriority = 'high'\n"))
    assert done.returncode == 2 and "priority" in done.stderr, done.stderr
    quotas = _quota_file(tmp_path, f"[default]\nguaranteed_bytes = {6 * CHUNK}\n")
    b = BrokerProcess(tmp_path, capacity_chunks=16, extra_args=["--quota-file", quotas])
    try:
        first, second = vtm.connect(b.address, name="x"), vtm.connect(b.address, name="y")
        try:
            with pytest.raises(vtm.OutOfMemory, match="guarantee"):
                vtm.connect(b.address, name="z")  # a third 6-chunk guarantee: 18 of 16
            vtm.connect(b.address, name="z", guaranteed_bytes=4 * CHUNK).close()  # asking for less fits
            assert ctl.main(["--address", b.address, "set-quota", "x", "--guaranteed", str(12 * CHUNK)]) == 2
            assert "capacity" in capsys.readouterr().err
            assert ctl.main(["--address", b.address, "set-quota", "x", "--guaranteed", str(8 * CHUNK),
                             "--priority", "4"]) == 0
            capsys.readouterr()
            clients = {c["name"]: c for c in first.stats()["clients"]}
            assert (clients["x"]["guaranteed_bytes"], clients["x"]["priority"]) == (8 * CHUNK, 4)
        finally:
            second.close()
            first.close()
    finally:
        b.kill()


def test_a_non_loopback_control_listener_needs_a_token(tmp_path, capsys):
    done = _vtmd(tmp_path, "--control", "tcp:0.0.0.0:0")
    assert done.returncode == 2 and "--control-token-file" in done.stderr, done.stderr
    token = tmp_path / "token"
    token.write_text("s3cret-token-0123456789\n")
    token.chmod(0o644)
    done = _vtmd(tmp_path, "--control", "tcp:0.0.0.0:0", "--control-token-file", str(token))
    assert done.returncode == 2 and "0600" in done.stderr, done.stderr
    token.chmod(0o600)
    b = BrokerProcess(tmp_path, capacity_chunks=16, control="tcp:0.0.0.0:0",
                      extra_args=["--control-token-file", str(token)])
    try:
        port = b.control_address.rsplit(":", 1)[1]
        address = f"tcp:127.0.0.1:{port}"
        with grpc.insecure_channel(tcp_target(address)) as channel:
            stub = vtm_pb2_grpc.BrokerStub(channel)
            for metadata in (None, (("vtm-control-token", "wrong"),)):
                with pytest.raises(grpc.RpcError) as err:
                    stub.Stats(vtm_pb2.StatsRequest(), timeout=10, metadata=metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                stub.Trim(vtm_pb2.TrimRequest(all=True), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert ctl.main(["--address", address, "stats", "--json"]) == 2
        assert "token" in capsys.readouterr().err
        assert ctl.main(["--address", address, "--token-file", str(token), "stats", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["clients"] == []
    finally:
        b.kill()
