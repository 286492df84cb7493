"""vtmd: the vtm broker daemon.

    vtmd --listen unix:PATH [--control tcp:HOST:PORT [--control-token-file F]] [--backend host|cuda|auto]
         [--capacity-bytes SIZE] [--chunk-bytes SIZE] [--host-tier-bytes SIZE [--spill-ahead-bytes SIZE]]
         [--max-sessions N] [--max-calls-in-flight-per-client N] [--quota-file PATH]

SIZE: a byte count or a number with a binary suffix, e.g. 64GiB (src/vtm/sizes.py).

It owns the physical pool, the page accounting and the prefix trees; clients
(vtm.connect) map the chunks into their own address spaces. The gRPC socket
lives at PATH, the fd side socket (chunk fds and the sessions' channels) at
PATH.fds, the step socket (the fast path of the hot calls) at PATH.step;
their folder must be private (0700, created so when missing). SIGTERM or
SIGINT: stop admitting, let the calls in flight finish, release everything,
remove the sockets; exit 0 (SIGINT: 130, src/_vtmd.py). --control also serves the control calls (Stats, Trim,
SetQuota) and health over TCP, and nothing else (src/vtm/broker/control.py).

Threads are fixed whatever the number of sessions: GRPC_THREADS serve gRPC
calls (all unary), one reactor thread waits on every side-socket connection
and client pidfd, and IO_THREADS answer them (src/vtm/broker/reactor.py).
A client process holds at most --max-calls-in-flight-per-client of the gRPC
threads over all its sessions, and the callers that name no attached session
(Hello, vtmctl) as many together (service.py, _in_flight).
"""

from __future__ import annotations

import contextlib
import errno
import grp
import logging
import os
import pwd
import re
import resource
import shlex
import socket
import stat
import sys
import threading
from concurrent import futures
from typing import Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import vtm
from vtm import machine
from vtm.broker.cli_args import Parser, add_version, size
from vtm.broker.control import ControlService, is_loopback, read_token
from vtm.broker.fd_channel import FdServer
from vtm.broker.quota import Quotas
from vtm.broker.reactor import Reactor
from vtm.broker.service import MAX_CALLS_IN_FLIGHT, BrokerService
from vtm.broker.step_channel import StepServer
from vtm.log_lines import OneLineFormatter
from vtm.proto.vtm.v1 import vtm_pb2_grpc

SERVICE_NAME = "vtm.v1.Broker"
_GRACE_S = 5.0
GRPC_THREADS = 32
IO_THREADS = 32  # a call may wait up to ~2 s for reclaim; policy.MAX_WAITS of them at once, at most
_CONTROL_THREADS = 4
DEFAULT_MAX_SESSIONS = 256
# vtm.Manager's arguments in its errors, which vtmd shows as the flags that set them.
_MANAGER_ARGUMENTS = re.compile(r"\b(capacity_bytes|chunk_bytes|host_tier_bytes|spill_ahead_bytes)\b|"
                                r"^(workers|granularity)\b")


def unix_path(address: str) -> str:
    if not address.startswith("unix:") or len(address) <= len("unix:"):
        raise ValueError(f"--listen must be unix:PATH, got {address!r}")
    return os.path.abspath(address[len("unix:"):])


def tcp_target(address: str) -> str:
    """The gRPC target HOST:PORT of a tcp:HOST:PORT address."""
    host, sep, port = address[len("tcp:"):].rpartition(":")
    if not address.startswith("tcp:") or not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"address must be tcp:HOST:PORT, got {address!r}")
    return f"{host}:{port}"


def _private_group(gid: int, owner: int) -> bool:
    """Whether group `gid` is user `owner`'s alone: it exists, and its
    members, by their passwd entry or by its member list, are that user and
    nobody else. A group with no member known is not (setgid programs run
    as such groups, and a directory service may list none of its users)."""
    try:
        group, name = grp.getgrgid(gid), pwd.getpwuid(owner).pw_name
    except KeyError:  # a group or owner without an entry: who is in it cannot be told
        return False
    by_passwd = {user.pw_uid for user in pwd.getpwall() if user.pw_gid == gid}
    listed = set(group.gr_mem)
    return by_passwd <= {owner} and listed <= {name} and bool(by_passwd or listed)


def _private_folder(path: str) -> list[str]:
    """The socket folder is the only wall around the control calls: it must
    be this user's and closed to others, under folders where nobody else may
    replace it. A missing one (and its missing parents) is created so; an
    existing one is never changed (it may be a home folder, or /tmp).
    Returns the folders it created, deepest first."""
    folder = os.path.dirname(path)
    created, existing = [], folder
    while not os.path.isdir(existing):
        created.append(existing)
        existing = os.path.dirname(existing)
    # Whoever may rename entries of a folder above it may swap the socket
    # folder, or a folder on its way, for one of theirs: every one must be
    # this user's or root's, and closed to other writers or sticky (/tmp),
    # as ssh asks of the folders above authorized_keys (group-writable
    # only where the group is this user's alone, as Debian's ssh allows).
    above = existing if created else os.path.dirname(folder)
    while True:
        st = os.stat(above)
        mode = stat.S_IMODE(st.st_mode)
        others_write = mode & 0o002 or (mode & 0o020 and not _private_group(st.st_gid, st.st_uid))
        if st.st_uid not in (0, os.getuid()) or (others_write and not st.st_mode & stat.S_ISVTX):
            raise PermissionError(f"{above}, above the socket folder, is another user's or writable by other users "
                                  f"without the sticky bit: anyone who may write there may replace the socket folder; "
                                  f"listen in a folder of your own, e.g. --listen unix:{_own_socket_example()}")
        if os.path.dirname(above) == above:
            break
        above = os.path.dirname(above)
    for made in reversed(created):  # each 0700: makedirs gives the parents the umask's mode
        try:
            os.mkdir(made, 0o700)
        except OSError as exc:  # /proc/x: the bare errno named neither the folder's role nor the flag
            _remove_folders(created[created.index(made) + 1:])
            raise OSError(f"cannot create the socket folder {made} (--listen unix:{path}): {exc.strerror}") from None
        os.chmod(made, 0o700)  # whatever the umask
    st = os.stat(folder)
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.getuid():
        raise PermissionError(f"the socket folder {folder} belongs to uid {st.st_uid}, not this user: listen in a "
                              f"folder of your own (vtmd creates a missing one with mode 0700), e.g. "
                              f"--listen unix:{_own_socket_example()}")
    if mode & 0o002:  # /tmp and the like: others' files live there, so it is theirs to keep open
        raise PermissionError(f"the socket folder {folder} is writable by every user (mode {mode:04o}): listen in a "
                              f"folder of its own (vtmd creates a missing one with mode 0700), e.g. "
                              f"--listen unix:{_own_socket_example()}")
    if mode & 0o077:
        raise PermissionError(f"the socket folder {folder} must have mode 0700, not {mode:04o}: run "
                              f"`chmod 700 {shlex.quote(folder)}`, or listen in a folder of its own (vtmd creates a "
                              f"missing one with mode 0700)")
    return created


def _listen(server, target: str, address: str | None = None) -> int:
    """server.add_insecure_port(target), whose failure (an address in use) is
    an OSError naming `address` (the target as the user wrote it), not
    gRPC's RuntimeError or a port of 0. A TCP address is tried first with a
    socket of our own: gRPC logs its own error lines before it fails."""
    if not target.startswith("unix:"):
        _check_bindable(target, address or target)
    try:
        port = server.add_insecure_port(target)
    except RuntimeError as exc:
        raise OSError(f"cannot listen at {address or target}: {exc}") from None
    if port == 0:
        raise OSError(f"cannot listen at {address or target}")
    return port


def _check_bindable(target: str, address: str) -> None:
    """OSError, naming `address`, unless one of the addresses HOST:PORT
    resolves to can be bound now, as gRPC needs (`localhost` is ::1 too,
    where IPv6 may be off). A port in use is the error named first."""
    host, _, port = target.rpartition(":")
    try:
        resolved = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise OSError(f"cannot listen at {address}: {exc.strerror}") from None
    failures = []
    for family, kind, proto, _, sockaddr in resolved:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no obstacle
                probe.bind(sockaddr)
            return
        except OSError as exc:
            failures.append(exc)
    first = min(failures, key=lambda exc: exc.errno != errno.EADDRINUSE)
    raise OSError(f"cannot listen at {address}: {first.strerror}")


def _remove_folders(folders: list[str]) -> None:
    """Removes the folders _private_folder created, deepest first, where empty."""
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:
            return


def _own_socket_example() -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return f"{runtime}/vtm/sock" if runtime else f"/tmp/vtm-{os.getuid()}/sock"


def _clear_stale(path: str, kind: int) -> None:
    """Removes a socket of type `kind` left by a broker that died; refuses a
    live one (probed with its own type: a connect of the wrong type fails
    on a live socket too)."""
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, kind)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)
        return
    finally:
        probe.close()
    raise FileExistsError(f"a broker already listens at {path}")


def _raise_fd_limit() -> None:
    # One fd per chunk is kept in the broker (docs/design.md §6).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class Broker:
    """A running broker: the manager, the gRPC server, the fd socket and the
    step socket, the last two on one reactor."""

    def __init__(self, listen: str, backend: str = "auto", capacity_bytes: int = 1 << 30,
                 chunk_bytes: int = 2 << 20, granularity: int | None = None, workers: int = 2,
                 control: str | None = None, max_sessions: int = DEFAULT_MAX_SESSIONS, quota_file: str | None = None,
                 control_token_file: str | None = None, host_tier_bytes: int = 0, spill_ahead_bytes: int = 0,
                 max_calls_in_flight_per_client: int = MAX_CALLS_IN_FLIGHT):
        self.path = unix_path(listen)
        control_target = tcp_target(control) if control else None
        if max_sessions < 1:
            raise ValueError(f"--max-sessions must be at least 1, got {max_sessions}")
        if max_calls_in_flight_per_client < 1:
            raise ValueError("--max-calls-in-flight-per-client must be at least 1, "
                             f"got {max_calls_in_flight_per_client}")
        token = read_token(control_token_file) if control_token_file else None
        if control_target is not None and token is None and not is_loopback(control_target.rpartition(":")[0]):
            raise ValueError(f"--control {control} is not on loopback: anyone who reaches it could steer the "
                             "broker; give --control-token-file (every control call must then carry the token)")
        created = _private_folder(self.path)
        try:
            _clear_stale(self.path, socket.SOCK_STREAM)
            _clear_stale(self.path + ".fds", socket.SOCK_SEQPACKET)
            _clear_stale(self.path + ".step", socket.SOCK_SEQPACKET)
            _raise_fd_limit()
            # No slot cache: a released slot's pages go back to the pool at once,
            # so no operation of one client ever changes another client's
            # mappings (the effects of a call are on the caller's spaces only).
            try:
                self.manager = vtm.Manager(backend=backend, capacity_bytes=capacity_bytes, chunk_bytes=chunk_bytes,
                                           workers=workers, granularity=granularity, slot_cache_bytes=0,
                                           record_mappings=True, export_chunks=True,
                                           host_tier_bytes=host_tier_bytes, spill_ahead_bytes=spill_ahead_bytes)
            except vtm.InvalidArgument as exc:  # its arguments are vtmd's flags: say them so
                raise vtm.InvalidArgument(_MANAGER_ARGUMENTS.sub(
                    lambda m: "--" + m.group(0).replace("_", "-"), str(exc))) from None
        except BaseException:
            _remove_folders(created)  # a broker that never started leaves nothing behind
            raise
        self.service = self.fds = self.steps = self.server = self.control = self.reactor = None
        self.control_address = None
        try:
            # A host tier keeps whole chunks: its limits are set in them. Without
            # one they have no effect, and a quota file shared with vtmds that
            # have one is not refused for them.
            chunk = self.manager.chunk_bytes if host_tier_bytes else 1
            quotas = (Quotas.load(quota_file, self.manager.capacity_bytes, chunk) if quota_file
                      else Quotas(self.manager.capacity_bytes, chunk_bytes=chunk))
            self.reactor = Reactor(IO_THREADS)
            self.service = BrokerService(self.manager, self.manager.backend, 0, self.path + ".fds", self.reactor,
                                         quotas, max_sessions, max_calls_in_flight_per_client)
            # A session holds its channel and a fetch connection on the fd
            # socket, one on the step socket; a few more for vtmctl and tests.
            self.fds = FdServer(self.path + ".fds", self.service, self.manager._chunk_fd, self.reactor,
                                2 * max_sessions + 16)
            self.steps = StepServer(self.path + ".step", self.service, self.manager._chunk_fd, self.reactor,
                                    max_sessions + 16)
            self.service.step_socket = self.steps.path
            self.service.session_ended += [self.fds.end_session, self.steps.end_session]
            self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=GRPC_THREADS, thread_name_prefix="vtmd"))
            vtm_pb2_grpc.add_BrokerServicer_to_server(self.service, self.server)
            self.health = health.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
            _listen(self.server, "unix:" + self.path)
            os.chmod(self.path, 0o600)
            self.server.start()
            if control_target is not None:
                # Not SO_REUSEPORT (gRPC's default): a second vtmd on this
                # port would share its connections with the first.
                self.control = grpc.server(futures.ThreadPoolExecutor(max_workers=_CONTROL_THREADS,
                                                                      thread_name_prefix="vtmd-control"),
                                           options=[("grpc.so_reuseport", 0)])
                vtm_pb2_grpc.add_BrokerServicer_to_server(ControlService(self.service, token), self.control)
                health_pb2_grpc.add_HealthServicer_to_server(self.health, self.control)
                port = _listen(self.control, control_target, control)
                self.control_address = f"tcp:{control_target.rpartition(':')[0]}:{port}"
                self.control.start()
            for name in ("", SERVICE_NAME):
                self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        except BaseException:
            if self.control is not None:
                self.control.stop(None)
            if self.server is not None:
                self.server.stop(None)
                try:
                    os.unlink(self.path)  # gRPC leaves the socket file behind
                except FileNotFoundError:
                    pass
            if self.steps is not None:
                self.steps.close()  # and its socket file
            if self.fds is not None:
                self.fds.close()  # and its socket file
            if self.service is not None:
                self.service.close_all()  # stops its reaper thread
            if self.reactor is not None:
                self.reactor.close()
            self.manager.close()
            _remove_folders(created)
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
        self.reactor.close()
        self.manager.close()
        try:
            os.unlink(self.path)  # the fd and step sockets went with their servers
        except FileNotFoundError:
            pass


@contextlib.contextmanager
def _logging_to_stderr() -> Iterator[None]:
    """The broker's log lines read `vtmd: warning: ...`, as its own lines do
    (unconfigured, Python printed bare messages), while the block runs.
    Tracebacks are kept: a daemon logs one only for a failure no client
    caused, a bug to report."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter("vtmd", tracebacks=True))
    logger = logging.getLogger("vtm")
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False  # else a handler on the root logger prints each record again
    try:
        yield
    finally:  # main() may run in a caller's process, whose logging stays its own
        logger.removeHandler(handler)
        logger.level, logger.propagate = saved


def main(argv, stop: threading.Event) -> int:
    """Serves until `stop` is set (src/_vtmd.py sets it on SIGTERM or SIGINT); the exit status."""
    parser = Parser(prog="vtmd", description="The vtm memory broker (docs/broker.md). Sizes are a byte count "
                    "(4096) or a number with a binary suffix KiB, MiB, GiB or TiB (512MiB, 0.5GiB).")
    add_version(parser)
    parser.add_argument("--listen", required=True, metavar="unix:PATH",
                        help="the socket; its folder must be private (0700): vtmd creates a missing one so")
    parser.add_argument("--control", default=None, metavar="tcp:HOST:PORT",
                        help="also serve Stats, Trim, SetQuota and health there; off loopback only "
                             "with --control-token-file (port 0 picks one; default: no TCP listener)")
    parser.add_argument("--control-token-file", default=None, metavar="FILE",
                        help="a file (mode 0600) holding the token every call to --control must carry "
                             "(metadata vtm-control-token; default: no token, loopback only)")
    parser.add_argument("--backend", default="auto", choices=["host", "cuda", "auto"],
                        help="where chunks live (auto: cuda when a driver is present)")
    parser.add_argument("--capacity-bytes", type=size, default="1GiB", metavar="SIZE",
                        help="the pool: bounds the chunks of every client together")
    parser.add_argument("--chunk-bytes", type=size, default="2MiB", metavar="SIZE",
                        help="bytes of one chunk (one page)")
    parser.add_argument("--host-tier-bytes", type=size, default="0", metavar="SIZE",
                        help="host memory that keeps the prefixes the pool evicts, for any client's later match to "
                             "copy back (a multiple of --chunk-bytes; 0: none); see docs/api.md, the host tier")
    parser.add_argument("--spill-ahead-bytes", type=size, default="0", metavar="SIZE",
                        help="keep this much of the pool free by spilling the least recently used prefixes to the "
                             "host tier in the background, so that a client's allocation does not copy on its "
                             "critical path (a multiple of --chunk-bytes; 0: off; needs --host-tier-bytes)")
    parser.add_argument("--granularity", type=size, default=None, metavar="SIZE",
                        help="the host backend's mapping granularity (default: 2MiB; cuda: the driver's)")
    parser.add_argument("--workers", type=int, default=2, help="the manager's worker threads")
    parser.add_argument("--max-sessions", type=int, default=DEFAULT_MAX_SESSIONS,
                        help="client sessions served at once; Hello beyond gets RESOURCE_EXHAUSTED; one process "
                             "holds at most a quarter of them, at least 16")
    parser.add_argument("--max-calls-in-flight-per-client", type=int, default=MAX_CALLS_IN_FLIGHT, metavar="N",
                        help="gRPC calls one client process may have in flight at once over all its sessions "
                             "(any call carrying the lease of a session it attached, waiting for memory included); "
                             "the calls that carry no attached session's lease (Hello, vtmctl) count together as "
                             "one more client; calls beyond get RESOURCE_EXHAUSTED at once, so that one process "
                             f"cannot hold all {GRPC_THREADS} of vtmd's gRPC threads (vtm.connect sends one at a time "
                             "a session; the TCP --control listener's calls are not counted: they have threads of "
                             "their own)")
    parser.add_argument("--quota-file", default=None, metavar="FILE",
                        help="TOML: each client name's priority, guaranteed_bytes and limit_bytes (default: priority "
                             "0, no guarantee and no limit for every client); see docs/broker.md")
    args = parser.parse_args(argv)
    with _logging_to_stderr():
        return _serve(args, stop)


def _check_sizes_fit(args) -> None:
    """ValueError where the pool or the host tier cannot fit in this machine's
    memory (the pool in the device's, where it is on CUDA and the driver tells its
    size): made as they fill, larger ones were accepted and ran out later."""
    pool_limit, pool_memory = machine.pool_memory(args.backend)
    ram, host = machine.host_memory_bytes(), machine.HOST_MEMORY
    problem = (machine.too_large("--capacity-bytes", args.capacity_bytes, pool_limit, pool_memory)
               or machine.too_large("--host-tier-bytes", args.host_tier_bytes, ram, host))
    if problem is None and pool_memory == host:  # both in host memory
        problem = machine.too_large("--capacity-bytes and --host-tier-bytes together",
                                    args.capacity_bytes + args.host_tier_bytes, ram, host)
    if problem is not None:
        raise ValueError(problem)


def _serve(args, stop: threading.Event) -> int:
    """Starts the broker and serves until `stop` is set; the exit status."""
    try:
        _check_sizes_fit(args)
        broker = Broker(args.listen, args.backend, args.capacity_bytes, args.chunk_bytes, args.granularity,
                        args.workers, args.control, args.max_sessions, args.quota_file, args.control_token_file,
                        args.host_tier_bytes, args.spill_ahead_bytes, args.max_calls_in_flight_per_client)
    except (vtm.Error, OSError, ValueError) as exc:
        print(f"vtmd: error: {exc}", file=sys.stderr)
        return 2
    tier = broker.manager.stats()["host_tier_capacity_bytes"]
    # On stderr, with the log lines, as a daemon's messages go (and flexinfer serve's).
    print(f"vtmd: listening on unix:{broker.path} ({broker.manager.backend}, "
          f"{broker.manager.capacity_bytes} bytes in chunks of {broker.manager.chunk_bytes}"
          + (f", a host tier of {tier} bytes" if tier else "") + ")"
          + (f", control on {broker.control_address}" if broker.control_address else ""), file=sys.stderr,
          flush=True)
    while not stop.wait(0.5):
        pass
    broker.stop()
    print("vtmd: stopped", file=sys.stderr, flush=True)
    return 0
