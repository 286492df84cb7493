"""vtmd: the vtm broker daemon.

    vtmd --listen unix:PATH [--control tcp:HOST:PORT] [--backend host|cuda|auto] [--capacity-bytes N]
         [--chunk-bytes N]

It owns the physical pool, the page accounting and the prefix trees; clients
(vtm.connect) map the chunks into their own address spaces. The gRPC socket
lives at PATH, the fd side socket at PATH.fds, the step socket (the fast path
of the hot calls) at PATH.step; their folder must be private (0700, created
so when missing). SIGTERM or SIGINT: stop admitting, let the calls in flight
finish, release everything, remove the sockets. --control also serves the
control calls (Stats, Trim, SetQuota) and health over TCP, and nothing else
(vtm/broker/control.py).
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import socket
import stat
import sys
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import vtm
from vtm.broker.control import ControlService
from vtm.broker.fd_channel import FdServer
from vtm.broker.service import BrokerService
from vtm.broker.step_channel import StepServer
from vtm.proto.vtm.v1 import vtm_pb2_grpc

SERVICE_NAME = "vtm.v1.Broker"
_GRACE_S = 5.0
_MAX_THREADS = 256  # so up to ~200 clients
_CONTROL_THREADS = 4


def unix_path(address: str) -> str:
    if not address.startswith("unix:") or len(address) <= len("unix:"):
        raise ValueError(f"address must be unix:PATH, got {address!r}")
    return os.path.abspath(address[len("unix:"):])


def tcp_target(address: str) -> str:
    """The gRPC target HOST:PORT of a tcp:HOST:PORT address."""
    host, sep, port = address[len("tcp:"):].rpartition(":")
    if not address.startswith("tcp:") or not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"address must be tcp:HOST:PORT, got {address!r}")
    return f"{host}:{port}"


def _private_folder(path: str) -> None:
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        os.makedirs(folder, mode=0o700)
    st = os.stat(folder)
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(f"the socket folder {folder} must belong to this user with mode 0700 "
                              f"(it has mode {stat.S_IMODE(st.st_mode):o})")


def _clear_stale(path: str) -> None:
    """Removes a socket left by a broker that died; refuses a live one."""
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)
        return
    finally:
        probe.close()
    raise FileExistsError(f"a broker already listens at {path}")


def _raise_fd_limit() -> None:
    # One fd per chunk is kept in the broker (DESIGN §6).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class Broker:
    """A running broker: the manager, the gRPC server, the fd socket and the step socket."""

    def __init__(self, listen: str, backend: str = "auto", capacity_bytes: int = 1 << 30,
                 chunk_bytes: int = 2 << 20, granularity: int | None = None, workers: int = 2,
                 control: str | None = None):
        self.path = unix_path(listen)
        control_target = tcp_target(control) if control else None
        _private_folder(self.path)
        _clear_stale(self.path)
        _clear_stale(self.path + ".fds")
        _clear_stale(self.path + ".step")
        _raise_fd_limit()
        # No slot cache: a released slot's pages go back to the pool at once,
        # so no operation of one client ever changes another client's
        # mappings (the effects of a call are on the caller's spaces only).
        self.manager = vtm.Manager(backend=backend, capacity_bytes=capacity_bytes, chunk_bytes=chunk_bytes,
                                   workers=workers, granularity=granularity, slot_cache_bytes=0,
                                   record_mappings=True, export_chunks=True)
        self.service = self.fds = self.steps = self.control = None
        self.control_address = None
        try:
            self.service = BrokerService(self.manager, self.manager.backend, 0, self.path + ".fds")
            self.fds = FdServer(self.path + ".fds", self.service.lookup, self.manager._chunk_fd)
            self.steps = StepServer(self.path + ".step", self.service, self.manager._chunk_fd)
            self.service.step_socket = self.steps.path
            # Each connected client holds one thread for its Notices stream;
            # the rest serve calls.
            self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=_MAX_THREADS, thread_name_prefix="vtmd"))
            vtm_pb2_grpc.add_BrokerServicer_to_server(self.service, self.server)
            self.health = health.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
            if self.server.add_insecure_port("unix:" + self.path) == 0:
                raise OSError(f"cannot listen at unix:{self.path}")
            os.chmod(self.path, 0o600)
            self.server.start()
            if control_target is not None:
                self.control = grpc.server(futures.ThreadPoolExecutor(max_workers=_CONTROL_THREADS,
                                                                      thread_name_prefix="vtmd-control"))
                vtm_pb2_grpc.add_BrokerServicer_to_server(ControlService(self.service), self.control)
                health_pb2_grpc.add_HealthServicer_to_server(self.health, self.control)
                port = self.control.add_insecure_port(control_target)
                if port == 0:
                    raise OSError(f"cannot listen at {control}")
                self.control_address = f"tcp:{control_target.rpartition(':')[0]}:{port}"
                self.control.start()
            for name in ("", SERVICE_NAME):
                self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        except BaseException:
            if self.control is not None:
                self.control.stop(None)
            if self.steps is not None:
                self.steps.close()  # and its socket file
            if self.fds is not None:
                self.fds.close()  # and its socket file
            if self.service is not None:
                self.service.close_all()  # stops its reaper thread
            self.manager.close()
            raise
        self._stopped = False

    def stop(self) -> None:
        """Stop admitting, finish calls in flight, release everything, remove the sockets."""
        if self._stopped:
            return
        self._stopped = True
        self.health.enter_graceful_shutdown()
        self.service.stop_admitting()
        if self.control is not None:
            self.control.stop(_GRACE_S)
        self.server.stop(_GRACE_S).wait()
        self.steps.close()  # an op in flight there holds its session lock: close_all waits for it
        self.service.close_all()
        self.fds.close()
        self.manager.close()
        try:
            os.unlink(self.path)  # the fd and step sockets went with their servers
        except FileNotFoundError:
            pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="vtmd", description="The vtm memory broker.")
    parser.add_argument("--listen", required=True, help="unix:PATH")
    parser.add_argument("--control", default=None,
                        help="tcp:HOST:PORT: also serve Stats, Trim, SetQuota and health there (no authentication: "
                             "loopback or a trusted network only; port 0 picks one)")
    parser.add_argument("--backend", default="auto", choices=["host", "cuda", "auto"])
    parser.add_argument("--capacity-bytes", type=int, default=1 << 30)
    parser.add_argument("--chunk-bytes", type=int, default=2 << 20)
    parser.add_argument("--granularity", type=int, default=None, help="host backend only (default 2 MiB)")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        broker = Broker(args.listen, args.backend, args.capacity_bytes, args.chunk_bytes, args.granularity,
                        args.workers, args.control)
    except (vtm.Error, OSError, ValueError) as exc:
        print(f"vtmd: error: {exc}", file=sys.stderr)
        return 2
    print(f"vtmd: listening on unix:{broker.path} ({broker.manager.backend}, "
          f"{broker.manager.capacity_bytes} bytes in chunks of {broker.manager.chunk_bytes})"
          + (f", control on {broker.control_address}" if broker.control_address else ""), flush=True)
    while not stop.wait(0.5):
        pass
    broker.stop()
    print("vtmd: stopped", flush=True)
    return 0
