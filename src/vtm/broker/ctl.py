"""vtmctl: look at and steer a running vtm broker.

    vtmctl --address unix:PATH stats [--json]
    vtmctl --address unix:PATH top [--interval S] [--iterations N]
    vtmctl --address unix:PATH set-quota NAME [LIMIT] [--limit SIZE] [--guaranteed SIZE] [--priority P]
                                         [--host-tier-limit SIZE]
    vtmctl --address unix:PATH trim [--bytes SIZE]

SIZE: a byte count or a number with a binary suffix, e.g. 20MiB (src/vtm/sizes.py).

--address may also be tcp:HOST:PORT, a broker's control listener (vtmd
--control); --token-file F sends the token such a listener may ask for.

set-quota sets the operator's quota of the clients named NAME, connected or
yet to connect (a client may ask for less, never more): a limit below what
one maps asks it for the excess back (a reclaim notice), a guarantee that
would sum past the capacity is refused.

Exit status 0 on success (also when the reader of its output stops early:
`vtmctl ... stats | head -1`), 2 when the broker cannot be reached or
refuses (one line on stderr), 130 when interrupted (Ctrl-C, as every vtm and
flexinfer command: also the Ctrl-C that ends `top`, and one sent to a vtmctl
started with SIGINT ignored, as a script's background job is).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import sys
import threading
import time

import grpc

from vtm import errors
from vtm.broker import status
from vtm.broker.cli_args import Parser, add_version, count, priority, seconds, size, utf8
from vtm.broker.control import TOKEN_KEY, read_token
from vtm.broker.server import tcp_target
from vtm.proto.vtm.v1 import vtm_pb2, vtm_pb2_grpc
from vtm.sizes import format_size

# 128 + SIGINT, the status a shell gives a command that Ctrl-C ended.
EXIT_INTERRUPTED = 130
# How long the connect that tells why a broker did not answer may take (a tcp: host that drops packets).
_PROBE_TIMEOUT_S = 2.0


def _call(stub_method, request, timeout: float, what: str, metadata=None):
    try:
        return stub_method(request, timeout=timeout, metadata=metadata)
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.UNAUTHENTICATED:
            raise errors.FailedPrecondition(f"{err.details()} (vtmctl --token-file)") from None
        raise status.from_rpc_error(err, what) from None


def _why_unreachable(address: str) -> str | None:
    """Why nothing listens at `address`, where a connect of our own tells;
    None where one connects (the broker is there but did not answer).
    gRPC's own words ("failed to connect to all addresses; last error:
    FAILED_PRECONDITION: ...") are its internals, not what to fix."""
    if address.startswith("unix:"):
        path = address[len("unix:"):]
        try:
            if not stat.S_ISSOCK(os.stat(path).st_mode):
                return "not a socket"
        except FileNotFoundError:
            return "no such socket"
        except OSError as exc:
            return exc.strerror
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        peer = path
    else:
        host, _, port = tcp_target(address).rpartition(":")
        try:
            family, kind, proto, _, peer = socket.getaddrinfo(host.strip("[]"), int(port),
                                                              type=socket.SOCK_STREAM)[0]
        except socket.gaierror as exc:
            return exc.strerror
        probe = socket.socket(family, kind, proto)
    with probe:
        probe.settimeout(_PROBE_TIMEOUT_S)
        try:
            probe.connect(peer)
        except ConnectionRefusedError:
            # What a vtmd that was killed (kill -9) leaves: its socket, which nobody listens on.
            return "connection refused" + (" (a vtmd that was killed leaves its socket behind)"
                                           if address.startswith("unix:") else "")
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


def _clients_table(stats: dict) -> list[str]:
    """One row a client; with a host tier, what its name keeps there and may keep (per name: quota.py)."""
    tier = bool(stats.get("host_tier_capacity_bytes"))
    rows = [f"{'client':<20} {'pid':>8} {'state':>11} {'prio':>5} {'mapped MiB':>11} {'guar MiB':>9} "
            f"{'limit MiB':>10} {'owes MiB':>9} {'spaces':>6} {'vts':>5}"
            + (f" {'tier MiB':>9} {'tier lim':>9}" if tier else "")]
    for c in stats["clients"]:
        pid = "-" if c["pid"] is None else c["pid"]  # none before the session attaches
        rows.append(f"{c['name'][:20]:<20} {pid:>8} {c['state']:>11} {c['priority']:>5} {_mib(c['mapped_bytes']):>11} "
                    f"{_mib(c['guaranteed_bytes']):>9} {_mib(c['limit_bytes']) if c['limit_bytes'] else '-':>10} "
                    f"{_mib(c['owes_bytes']):>9} {c['spaces']:>6} {c['vtensors']:>5}"
                    + (f" {_mib(c['host_tier_bytes']):>9} "
                       f"{_mib(c['host_tier_limit_bytes']) if c['host_tier_limit_bytes'] else '-':>9}" if tier else ""))
    for n in stats.get("tier_names_offline", []):  # prefixes in the tier, no session: only the tier's columns
        rows.append(f"{n['name'][:20]:<20} {'-':>8} {'offline':>11} {'-':>5} {'-':>11} {'-':>9} {'-':>10} {'-':>9} "
                    f"{'-':>6} {'-':>5} {_mib(n['host_tier_bytes']):>9} "
                    f"{_mib(n['host_tier_limit_bytes']) if n['host_tier_limit_bytes'] else '-':>9}")
    return rows


def _summary(stats: dict) -> list[str]:
    chunk = stats["chunk_bytes"]
    return [f"backend {stats['backend']}, capacity {format_size(stats['capacity_bytes'])} "
            f"in chunks of {format_size(chunk)}",
            f"chunks: created {stats['chunks_created']}, held {stats['chunks_held']}, free {stats['chunks_free']}, "
            f"mapped {stats['chunks_mapped']}, in prefix trees {stats['chunks_in_tree']} "
            f"({stats['tree_nodes']} nodes, {stats['tree_tokens']} tokens, index "
            f"{format_size(stats['index_bytes'])} of {format_size(stats['index_budget_bytes'])})",
            f"evictions {stats['evictions_total']}, copy-on-write {stats['cow_copies_total']}, "
            f"released to the device {stats['chunks_released_total']}"] + _tier(stats)


def _tier(stats: dict) -> list[str]:
    """The host tier's line, where the broker has one."""
    if not stats.get("host_tier_capacity_bytes"):
        return []
    return [f"host tier: {_mib(stats['host_tier_used_bytes'])} of {_mib(stats['host_tier_capacity_bytes'])} MiB "
            f"({stats['host_tier_nodes']} nodes); spills {stats['spills_total']}, restores "
            f"{stats['restores_total']}, dropped {stats['host_tier_drops_total']}, failed spills "
            f"{stats['spill_failures_total']}; accounts of {stats.get('tier_accounts', 0)} client names"]


# The terminal's alternate screen (as `top` and `less` use): entered, each frame
# drawn from the top left of a cleared screen, left at the end so the user's
# screen and scrollback come back as they were.
_ALT_SCREEN_ON, _ALT_SCREEN_OFF, _HOME_CLEAR = "\x1b[?1049h", "\x1b[?1049l", "\x1b[H\x1b[2J"


def _top(read_stats, address: str, interval: float, iterations: int) -> None:
    """Redraws in place on a terminal; appends frames elsewhere (a pipe, a
    file), where escape sequences would be noise."""
    out = sys.stdout
    terminal = out.isatty()
    if terminal:
        out.write(_ALT_SCREEN_ON)
    try:
        n = 0
        while iterations == 0 or n < iterations:
            stats = read_stats()
            heading = f"vtm broker at {address}, {time.strftime('%H:%M:%S')}, every {interval:g} s"
            frame = "\n".join([heading] + _summary(stats)[1:2] + _tier(stats) + _clients_table(stats))
            out.write(_HOME_CLEAR + frame if terminal else frame + "\n")
            out.flush()
            n += 1
            if iterations == 0 or n < iterations:
                time.sleep(interval)
    finally:
        if terminal:
            out.write(_ALT_SCREEN_OFF)
            out.flush()


def main(argv=None) -> int:
    parser = Parser(prog="vtmctl", description="Inspect and steer a vtm broker (vtmd). Sizes are a byte count "
                    "(4096) or a number with a binary suffix KiB, MiB, GiB or TiB (512MiB, 0.5GiB).")
    add_version(parser)
    parser.add_argument("--address", required=True, type=utf8,
                        help="unix:PATH of the broker, or tcp:HOST:PORT of its control")
    parser.add_argument("--timeout", type=seconds, default=5.0, metavar="S",
                        help="seconds to wait for each answer of the broker")
    parser.add_argument("--token-file", default=None, metavar="FILE",
                        help="the control token (vtmd --control-token-file; default: send none)")
    sub = parser.add_subparsers(dest="command", required=True)
    st = sub.add_parser("stats", help="the pool, prefix trees and clients")
    st.add_argument("--json", action="store_true", help="everything the broker reports, as JSON")
    top = sub.add_parser("top", help="the clients, refreshed (in place on a terminal)")
    top.add_argument("--interval", type=seconds, default=1.0, metavar="S", help="seconds between refreshes")
    top.add_argument("--iterations", type=count, default=0, metavar="N",
                     help="refreshes before exiting; 0: until interrupted")
    quota = sub.add_parser("set-quota", help="the operator's limit (0: none), guarantee and priority for a client name")
    quota.add_argument("name", type=utf8, help="the client name (vtm.connect(name=...), flexinfer --client-name)")
    quota.add_argument("bytes", type=size, nargs="?", default=None, metavar="LIMIT", help="the limit (as --limit)")
    quota.add_argument("--limit", type=size, default=None, metavar="SIZE",
                       help="most bytes the clients of this name may map; 0: no limit (default: unchanged)")
    quota.add_argument("--guaranteed", type=size, default=None, metavar="SIZE",
                       help="bytes never reclaimed from them (default: unchanged)")
    quota.add_argument("--priority", type=priority, default=None, metavar="P",
                       help="higher keeps memory longer under pressure (default: unchanged)")
    quota.add_argument("--host-tier-limit", type=size, default=None, metavar="SIZE",
                       help="most bytes of vtmd's host tier the prefixes they record may keep; 0: no limit "
                            "(default: unchanged)")
    quota.add_argument("--reset", action="store_true",
                       help="forget the name's own quota first: its clients get the default one (vtmd's "
                            "--quota-file [default]), with the other flags given applied to it")
    trim = sub.add_parser("trim", help="give memory back to the device: every free chunk, or --bytes")
    trim.add_argument("--bytes", type=size, default=None, metavar="SIZE",
                      help="at least this much where it can: free chunks first, then cached prefixes no client "
                           "uses, least recently used first (default: every free chunk, no prefix evicted)")
    args = parser.parse_args(argv)
    if threading.current_thread() is threading.main_thread():  # the command (a caller's thread may not)
        # Ctrl-C (or kill -INT) ends `top` even where it was started with
        # SIGINT ignored, as a non-interactive shell starts its background jobs.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if args.address.startswith("tcp:"):
            try:
                target = tcp_target(args.address)
            except ValueError as exc:
                raise errors.InvalidArgument(str(exc)) from None
        elif args.address.startswith("unix:"):
            target = args.address
        else:
            raise errors.InvalidArgument(f"--address must be unix:PATH or tcp:HOST:PORT, got {args.address!r}")
        metadata = ((TOKEN_KEY, read_token(args.token_file)),) if args.token_file else None
        with grpc.insecure_channel(target) as channel:
            stub = vtm_pb2_grpc.BrokerStub(channel)
            if args.command == "stats":
                stats = json.loads(_call(stub.Stats, vtm_pb2.StatsRequest(), args.timeout, "stats", metadata).json)
                print(json.dumps(stats, indent=2) if args.json else "\n".join(_summary(stats) + _clients_table(stats)))
            elif args.command == "top":
                _top(lambda: json.loads(_call(stub.Stats, vtm_pb2.StatsRequest(), args.timeout, "stats",
                                              metadata).json), args.address, args.interval, args.iterations)
            elif args.command == "set-quota":
                if args.bytes is not None and args.limit is not None:
                    raise errors.InvalidArgument("give the limit once: LIMIT or --limit")
                limit = args.limit if args.limit is not None else args.bytes
                request = vtm_pb2.SetQuotaRequest(name=args.name, limit_bytes=limit, guaranteed_bytes=args.guaranteed,
                                                  priority=args.priority, host_tier_limit_bytes=args.host_tier_limit,
                                                  reset=args.reset)
                reply = json.loads(_call(stub.SetQuota, request, args.timeout, "set-quota", metadata).json)
                quota = reply["quota"]
                print(f"{args.name}: limit {quota['limit_bytes']} bytes, guaranteed {quota['guaranteed_bytes']} "
                      f"bytes, priority {quota['priority']}, host tier limit {quota['host_tier_limit_bytes']} bytes "
                      f"({len(reply['clients'])} connected client(s))")
            else:
                request = vtm_pb2.TrimRequest(all=args.bytes is None, bytes=args.bytes or 0)
                print(f"released {_call(stub.Trim, request, args.timeout, 'trim', metadata).value} bytes")
    except errors.Unavailable as exc:
        reason = _why_unreachable(args.address)
        print(f"vtmctl: error: {f'no vtm broker answers at {args.address}: {reason}' if reason else exc}",
              file=sys.stderr)
        return 2
    except errors.Error as exc:
        print(f"vtmctl: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # quiet: the Ctrl-C that ends `top` is its usual end, but a script must see it
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`| head`): what is left to write has no one
        # to read it, and Python's flush of stdout at exit must not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
