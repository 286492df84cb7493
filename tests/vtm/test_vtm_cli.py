"""vtmd's and vtmctl's command lines: sizes as people type them (one parser
everywhere: vtmd's flags, vtmctl's, the quota file), every default in every
--help, a socket folder error that says the command fixing it, and `vtmctl top`
redrawing in place on a terminal."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import vtm
import vtm.machine
from broker_testing import BrokerProcess, wait_serving
from vtm.broker import ctl, server
from vtm.sizes import format_size

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("text, nbytes", [
    ("4096", 4096), ("512MiB", 512 * MiB), ("8GiB", 8 * GiB), ("0.5GiB", GiB // 2), ("1.5 GiB", 3 * GiB // 2),
    ("64kib", 64 * KiB), ("2TiB", 2 << 40), (" 7 ", 7), ("0", 0), (".25KiB", 256), ("100B", 100),
])
def test_sizes_accept_bytes_and_binary_suffixes(text, nbytes):
    from vtm.sizes import parse_size

    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text, says", [
    ("1.5GB", "GB is ambiguous: write 1.5GiB"), ("512M", "M is ambiguous: write 512MiB"), ("-1", "expected"),
    ("0.1KiB", "not a whole number of bytes"), ("1.5", "not a whole number"), ("", "expected"), ("MiB", "expected"),
    ("1e9", "expected"), ("12 parsecs", "expected"), ("9223372036854775808", "more than the largest size"),
    ("8388608TiB", "more than the largest size"),
])
def test_sizes_refused_say_what_is_accepted(text, says):
    from vtm.sizes import parse_size

    with pytest.raises(ValueError, match=re.escape(says)) as refused:
        parse_size(text)
    assert "KiB, MiB, GiB or TiB" in str(refused.value)


@pytest.mark.parametrize("nbytes, text", [
    (64 * KiB, "64KiB"), (2 * MiB, "2MiB"), (3 * GiB // 2, "1.5GiB"), (1000, "1000B"), (0, "0B"),
    (100_000_000, "95.37MiB"), ((1 << 63) - 1, "8388608TiB"),
])
def test_sizes_are_shown_in_the_units_they_are_typed_in(nbytes, text):
    from vtm.sizes import format_size, parse_size

    assert format_size(nbytes) == text
    if "." not in text and nbytes < 1 << 62:  # exact: read back as it was (the largest is rounded up)
        assert parse_size(text) == nbytes


def vtmd(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vtm.broker", *args], capture_output=True, text=True, timeout=60)


def test_a_vtmd_without_a_tier_takes_a_quota_file_with_tier_limits(tmp_path, capsys):
    """Review: the check that a host tier limit is at least a chunk refused
    a quota file that vtmds with a tier share with one without, where the
    limit has no effect."""
    path = tmp_path / "quotas.toml"
    path.write_text('[clients."a"]\nhost_tier_limit_bytes = 4096\n')
    b = BrokerProcess(tmp_path, extra_args=["--quota-file", str(path)])
    try:
        assert ctl.main(["--address", b.address, "stats"]) == 0
    finally:
        b.kill()


def test_vtmd_takes_human_sizes(tmp_path, capsys):
    b = BrokerProcess(tmp_path, extra_args=["--capacity-bytes", "4MiB", "--chunk-bytes", "64KiB",
                                            "--granularity", "64KiB"])
    try:
        assert ctl.main(["--address", b.address, "stats", "--json"]) == 0
        stats = json.loads(capsys.readouterr().out)
        assert stats["capacity_bytes"] == 4 * MiB and stats["chunk_bytes"] == 64 * KiB
        assert ctl.main(["--address", b.address, "set-quota", "app", "1MiB", "--guaranteed", "0.5MiB"]) == 0
        assert capsys.readouterr().out.startswith(f"app: limit {MiB} bytes, guaranteed {MiB // 2} bytes")
        # No session is named "": a quota for it was stored and never applied.
        assert ctl.main(["--address", b.address, "set-quota", "", "1MiB"]) == 2
        assert "give the name" in capsys.readouterr().err
        assert ctl.main(["--address", b.address, "trim", "--bytes", "128KiB"]) == 0
    finally:
        b.kill()


def test_vtmd_refuses_a_limit_of_no_call_in_flight_in_one_line(tmp_path):
    done = vtmd("--listen", f"unix:{tmp_path}/v/sock", "--max-calls-in-flight-per-client", "0")
    says = "vtmd: error: --max-calls-in-flight-per-client must be at least 1, got 0\n"
    assert done.returncode == 2 and done.stderr == says, done.stderr
    assert not (tmp_path / "v").exists()


@pytest.mark.parametrize("argv, says", [
    (["--capacity-bytes", "3MiB"], "--capacity-bytes 3145728 is not a positive multiple of --chunk-bytes 2097152"),
    (["--capacity-bytes", "0"], "--capacity-bytes 0 is not a positive multiple of --chunk-bytes 2097152"),
    (["--host-tier-bytes", "3MiB"], "--host-tier-bytes 3145728 is not a multiple of --chunk-bytes 2097152"),
    (["--spill-ahead-bytes", "4MiB"], "--spill-ahead-bytes spills prefixes to the host tier: give --host-tier-bytes "
                                      "too"),
    (["--workers", "0"], "--workers must be in [1, 256], got 0"),
])
def test_vtmd_names_its_own_flags_when_the_pool_cannot_be_made(tmp_path, argv, says):
    """It named vtm.Manager's arguments ("capacity_bytes 3145728 is not a
    positive multiple of chunk_bytes ..."), which no vtmd user typed."""
    done = vtmd("--listen", f"unix:{tmp_path}/v/sock", "--backend", "host", *argv)
    assert done.returncode == 2 and done.stderr == f"vtmd: error: {says}\n", done.stderr
    assert not (tmp_path / "v").exists()


# Whole 2 MiB chunks just past half the machine's RAM, and just past all of it.
_RAM = vtm.machine.host_memory_bytes()
_PAST_HALF, _PAST_ALL = (_RAM // 2 // (2 << 20) + 1) * (2 << 20), (_RAM // (2 << 20) + 1) * (2 << 20)


@pytest.mark.parametrize("argv, what, nbytes", [
    (["--capacity-bytes", str(_PAST_ALL)], "--capacity-bytes", _PAST_ALL),
    (["--host-tier-bytes", str(_PAST_ALL)], "--host-tier-bytes", _PAST_ALL),
    (["--capacity-bytes", str(_PAST_HALF), "--host-tier-bytes", str(_PAST_HALF)],
     "--capacity-bytes and --host-tier-bytes together", 2 * _PAST_HALF),
])
def test_vtmd_refuses_sizes_past_the_machines_memory(tmp_path, argv, what, nbytes):
    """A pool or a host tier larger than the machine's RAM started (chunks
    are made as they fill) and ran out of memory later, far from the flag
    that asked for it. Now refused at start, naming the flag."""
    done = vtmd("--listen", f"unix:{tmp_path}/v/sock", "--backend", "host", *argv)
    says = f"{what} ({format_size(nbytes)}) is more than this machine's memory ({format_size(_RAM)})"
    assert done.returncode == 2 and done.stderr == f"vtmd: error: {says}\n", done.stderr
    assert not (tmp_path / "v").exists()


# A CUDA driver that has one device of 80 GiB and answers nothing but how much memory it has.
_DRIVER_OF_80_GIB = r"""
#include <stddef.h>
int cuInit(unsigned flags) { return flags != 0; }
int cuDeviceGet(int *device, int ordinal) { if (ordinal != 0) return 101; *device = 7; return 0; }
int cuDeviceTotalMem_v2(size_t *bytes, int device) { if (device != 7) return 101; *bytes = (size_t)80 << 30; return 0; }
"""


def test_vtmd_refuses_a_pool_past_the_devices_memory(tmp_path):
    """The device's memory is the driver's word (vtm.machine asks it through
    ctypes): a --capacity-bytes past it is refused at start, as one past the
    RAM is on the host backend."""
    compiler = shutil.which("cc") or pytest.skip("no C compiler to build the stand-in driver")
    (tmp_path / "driver.c").write_text(_DRIVER_OF_80_GIB)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(tmp_path / "libcuda.so.1"), str(tmp_path / "driver.c")],
                   check=True)
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp_path))
    asked = subprocess.run([sys.executable, "-c", "import vtm.machine as m; print(m.cuda_memory_bytes(0), "
                            "m.cuda_memory_bytes(1))"], env=env, capture_output=True, text=True, timeout=60)
    assert asked.stdout == f"{80 << 30} None\n", asked.stderr
    done = subprocess.run([sys.executable, "-m", "vtm.broker", "--listen", f"unix:{tmp_path}/v/sock",
                           "--backend", "cuda", "--capacity-bytes", "81GiB"],
                          env=env, capture_output=True, text=True, timeout=60)
    says = "vtmd: error: --capacity-bytes (81GiB) is more than the memory of CUDA device 0 (80GiB)\n"
    assert done.returncode == 2 and done.stderr == says, done.stderr


def test_vtmd_names_listen_when_its_address_is_not_a_unix_socket(tmp_path):
    done = vtmd("--listen", f"{tmp_path}/sock")
    assert done.returncode == 2 and done.stderr == f"vtmd: error: --listen must be unix:PATH, got '{tmp_path}/sock'\n"


@pytest.mark.parametrize("argv, says", [
    (["--capacity-bytes", "1.5GB"], "argument --capacity-bytes: expected a byte count"),
    (["--chunk-bytes", "2M"], "M is ambiguous: write 2MiB"),
])
def test_vtmd_refuses_a_bad_size_in_one_line(tmp_path, argv, says):
    done = vtmd("--listen", f"unix:{tmp_path}/v/sock", *argv)
    assert done.returncode == 2 and done.stderr.startswith("vtmd: error: ") and says in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1


@pytest.mark.parametrize("argv, says", [
    (["--limit", "20MB"], "write 20MiB"),
    # Past 64 bits: protobuf used to raise ValueError out of vtmctl, a traceback.
    (["--host-tier-limit", "99999999999999999999999"], "largest size"),
])
def test_vtmctl_refuses_a_bad_size_in_one_line(capsys, argv, says):
    with pytest.raises(SystemExit) as done:
        ctl.main(["--address", "unix:/nonexistent", "set-quota", "app", *argv])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("vtmctl: error: ") and says in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, says", [
    # Past the protocol's int32: a ValueError traceback out of protobuf (found by fuzzing).
    (["set-quota", "app", "--priority", "2147483648"], "2147483648 is out of range: a priority is from"),
    (["set-quota", "app", "--priority", "-99999999999999999999"], "out of range"),
    (["set-quota", "app", "--priority", "high"], "expected an integer"),
    # Accepted, then every call failed with "Deadline Exceeded".
    (["--timeout", "-1", "stats"], "expected a number of seconds above 0"),
    (["--timeout", "nan", "stats"], "expected a number of seconds above 0"),
    (["top", "--interval", "-1"], "expected a number of seconds above 0"),
    (["top", "--interval", "0"], "expected a number of seconds above 0"),  # a busy loop against the broker
    (["top", "--iterations", "-2"], "expected 0 or more"),
])
def test_vtmctl_refuses_a_bad_number_in_one_line(capsys, argv, says):
    with pytest.raises(SystemExit) as done:
        ctl.main(["--address", "unix:/nonexistent", *argv])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("vtmctl: error: ") and says in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, says", [
    # argv bytes that are not UTF-8 (lone surrogates in Python): a UnicodeEncodeError traceback out of protobuf
    # building the request, or out of gRPC making the channel.
    (["--address", "unix:/nonexistent", "set-quota", "app\udcff", "1MiB"],
     "argument name: not valid UTF-8: b'app\\xff'"),
    (["--address", "unix:/tmp/\udcff", "stats"], "argument --address: not valid UTF-8: b'unix:/tmp/\\xff'"),
], ids=["name", "address"])
def test_vtmctl_refuses_text_that_is_not_utf8_in_one_line(capsys, argv, says):
    with pytest.raises(SystemExit) as done:
        ctl.main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("vtmctl: error: ") and says in err and err.count("\n") == 1, err


def test_the_quota_file_takes_human_sizes(tmp_path):
    from vtm.broker.quota import Quota, Quotas

    path = tmp_path / "quotas.toml"
    path.write_text('[clients."a"]\npriority = 3\nguaranteed_bytes = "1GiB"\nlimit_bytes = "1.5GiB"\n'
                    'host_tier_limit_bytes = "8GiB"\n[default]\nlimit_bytes = 4096\n')
    quotas = Quotas.load(str(path), 4 * GiB)
    assert quotas.offered("a") == Quota(3, GiB, 3 * GiB // 2, 8 * GiB) and quotas.default == Quota(0, 0, 4096)
    path.write_text('[default]\nhost_tier_limit_bytes = -1\n')
    with pytest.raises(Exception, match=r"host_tier_limit_bytes -1 is out of range"):
        Quotas.load(str(path), 4 * GiB)
    # The tier keeps whole chunks: a limit is stored (and shown) as what it enforces.
    path.write_text('[clients."a"]\nhost_tier_limit_bytes = "100KiB"\n')
    assert Quotas.load(str(path), 4 * GiB, 64 << 10).offered("a").host_tier_limit_bytes == 64 << 10
    path.write_text('[clients."a"]\nhost_tier_limit_bytes = 65535\n')
    with pytest.raises(Exception, match=r"quota file .*'a'.*65535 is less than one chunk \(65536 bytes\)"):
        Quotas.load(str(path), 4 * GiB, 64 << 10)
    path.write_text('[default]\nlimit_bytes = "2GB"\n')
    with pytest.raises(Exception, match=r"\[default\]: limit_bytes: expected .*write 2GiB"):
        Quotas.load(str(path), 4 * GiB)


# ----------------------------------------------------------------------------- --help


def vtmd_main(argv) -> int:
    """vtmd's command line in this process, without its signal handlers (src/_vtmd.py's)."""
    return server.main(argv, threading.Event())


def _help(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main(argv + ["--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def _check_every_flag_has_help(text: str) -> None:
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("  -"):
            flag_and_help = re.split(r"\s{2,}", line.strip(), maxsplit=1)
            has_help = len(flag_and_help) == 2 or (i + 1 < len(lines) and lines[i + 1].startswith(" " * 10))
            assert has_help, f"{line.strip()} has no help text"


def test_vtmd_help_shows_every_default(capsys):
    text = _help(vtmd_main, [], capsys)
    _check_every_flag_has_help(text)
    flat = " ".join(text.split())
    for shown in ("(default: auto)", "(default: 1GiB)", "(default: 2MiB)", "(default: 2)", "(default: 256)",
                  "(default: 4)"):
        assert shown in flat, flat
    assert "(default: None)" not in flat


@pytest.mark.parametrize("command, shown", [
    ([], ["(default: 5.0)"]),
    (["top"], ["(default: 1.0)", "(default: 0)"]),
    (["stats"], []), (["set-quota"], []), (["trim"], []),
])
def test_vtmctl_help_shows_every_default_and_every_flag_has_help(capsys, command, shown):
    text = _help(ctl.main, command, capsys)
    _check_every_flag_has_help(text)
    flat = " ".join(text.split())
    for default in shown:
        assert default in flat, flat
    assert "(default: None)" not in flat and "(default: False)" not in flat


# ----------------------------------------------------------------------------- socket folder


@pytest.mark.parametrize("mode, says", [
    (0o755, "must have mode 0700, not 0755: run `chmod 700 {folder}`, or listen in a folder of its own"),
    # A folder every user writes to (like /tmp) is not ours to close: no chmod.
    (0o1777, "is writable by every user (mode 1777): listen in a folder of its own"),
])
def test_a_shared_socket_folder_error_says_how_to_fix_it(tmp_path, mode, says):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    done = vtmd("--listen", f"unix:{shared}/sock", "--backend", "host")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"vtmd: error: the socket folder {shared} ")
    assert says.format(folder=shared) in done.stderr, done.stderr


def test_vtmd_creates_a_missing_socket_folder_private(tmp_path):
    b = BrokerProcess(tmp_path)  # listens in tmp_path/vtmd/sock, a folder that does not exist yet
    try:
        assert os.stat(os.path.dirname(b.path)).st_mode & 0o777 == 0o700
    finally:
        b.kill()


# ----------------------------------------------------------------------------- vtmctl top


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def broker(tmp_path):
    b = BrokerProcess(tmp_path, capacity_chunks=16)
    yield b
    b.kill()


def test_top_redraws_in_place_on_a_terminal(broker, monkeypatch):
    screen = Terminal()
    monkeypatch.setattr(sys, "stdout", screen)
    assert ctl.main(["--address", broker.address, "top", "--iterations", "3", "--interval", "0.01"]) == 0
    text = screen.getvalue()
    # The alternate screen, each frame from the top left of a cleared screen, the user's screen back at the end.
    assert text.startswith("\x1b[?1049h") and text.endswith("\x1b[?1049l")
    assert text.count("\x1b[H\x1b[2J") == 3 and text.count("client") == 3


def test_top_appends_when_not_a_terminal(broker, capsys):
    assert ctl.main(["--address", broker.address, "top", "--iterations", "2", "--interval", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and out.count("client") == 2


def test_top_says_whose_broker_and_when(broker, capsys):
    """Each frame's first line was a bare clock time."""
    assert ctl.main(["--address", broker.address, "top", "--iterations", "1", "--interval", "0.5"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert re.fullmatch(rf"vtm broker at {re.escape(broker.address)}, \d\d:\d\d:\d\d, every 0\.5 s", first), first


def test_stats_shows_a_small_chunk_in_its_own_unit(tmp_path, capsys):
    """A 64 KiB chunk was shown as "0.1 MiB"."""
    b = BrokerProcess(tmp_path, capacity_chunks=16, chunk_bytes=64 * KiB)
    try:
        assert ctl.main(["--address", b.address, "stats"]) == 0
    finally:
        b.kill()
    assert "capacity 1MiB in chunks of 64KiB" in capsys.readouterr().out


# ----------------------------------------------------------------------------- what a new user meets


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_vtmd_says_it_listens_on_stderr(tmp_path, sig, status):
    """The daemon's lines go with its log lines, on stderr: `vtmd ... 2> vtmd.log`
    (docs/getting-started.md) left the log empty and the terminal noisy. It
    stops the same way on both signals; Ctrl-C is status 130, as for every vtm
    and flexinfer command (it was 0)."""
    address = f"unix:{tmp_path}/run/sock"
    proc = subprocess.Popen([sys.executable, "-m", "vtm.broker", "--listen", address, "--backend", "host",
                             "--capacity-bytes", "4MiB"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_serving(address, 30)
    finally:
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == status and out == "", (out, err)
    assert err.startswith(f"vtmd: listening on {address} (host, ") and err.endswith("\nvtmd: stopped\n"), err


def test_a_vtmd_that_cannot_start_leaves_no_socket_folder(tmp_path):
    done = vtmd("--listen", f"unix:{tmp_path}/a/b/sock", "--backend", "host", "--capacity-bytes", "3MiB")
    assert done.returncode == 2 and "not a positive multiple" in done.stderr, done.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("main, prog", [(vtmd_main, "vtmd"), (ctl.main, "vtmctl")])
def test_version(main, prog, capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    try:
        installed = metadata.version("vtm")
    except metadata.PackageNotFoundError:  # a source tree on the path (scripts/gpu_check.sh stages one)
        installed = "0+unknown"
    assert vtm.__version__ == installed
    assert capsys.readouterr().out == f"{prog} {installed}\n"


def test_vtmctl_without_a_broker_says_so_in_one_line(tmp_path, capsys):
    """It printed gRPC's 'failed to connect to all addresses; last error: ...'."""
    assert ctl.main(["--address", f"unix:{tmp_path}/sock", "stats"]) == 2
    assert capsys.readouterr().err == f"vtmctl: error: no vtm broker answers at unix:{tmp_path}/sock: no such socket\n"


def _stale_unix_socket(path: str) -> None:
    """A socket file nobody listens on, as a vtmd killed with -9 leaves."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
        gone.bind(path)


def _closed_tcp_port() -> int:
    with socket.socket() as gone:
        gone.bind(("127.0.0.1", 0))
        return gone.getsockname()[1]


@pytest.mark.parametrize("kind, reason", [
    ("socket", "connection refused (a vtmd that was killed leaves its socket behind)"),
    ("file", "not a socket"),
    ("tcp", "connection refused"),
])
def test_vtmctl_at_a_dead_address_says_why_in_one_line(tmp_path, capsys, kind, reason):
    """A stale socket printed gRPC's 'failed to connect to all addresses; last error: FAILED_PRECONDITION:
    unix:...: connect failed: ...'."""
    path = str(tmp_path / "sock")
    if kind == "socket":
        _stale_unix_socket(path)
    elif kind == "file":
        open(path, "w").close()
    address = f"tcp:127.0.0.1:{_closed_tcp_port()}" if kind == "tcp" else f"unix:{path}"
    assert ctl.main(["--address", address, "stats"]) == 2
    assert capsys.readouterr().err == f"vtmctl: error: no vtm broker answers at {address}: {reason}\n"


def test_a_client_that_leaves_normally_is_no_warning_in_vtmds_log(tmp_path):
    """vtmd logged 'PATH.fds: closing a connection of a session that ended' (and .step), bare, at every
    client's exit: one that said goodbye and one whose process ended."""
    b = BrokerProcess(tmp_path, capacity_chunks=16)
    try:
        vtm.connect(b.address, name="says-goodbye").close()
        subprocess.run([sys.executable, "-c", f"import vtm; vtm.connect({b.address!r}, name='exits')"],
                       check=True, timeout=60)
        deadline = time.monotonic() + 30
        while json.loads(_stats_json(b.address))["clients"]:  # the exit is seen through the process's pidfd
            assert time.monotonic() < deadline
            time.sleep(0.05)
        b.proc.send_signal(signal.SIGTERM)
        log = b.proc.communicate(timeout=30)[0]  # vtmd's stderr, after "listening"
    finally:
        b.kill()
    assert b.proc.returncode == 0 and log == "vtmd: stopped\n", log


def _stats_json(address: str) -> str:
    done = subprocess.run([sys.executable, "-m", "vtm.broker.ctl", "--address", address, "stats", "--json"],
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout


def test_vtmds_log_lines_are_its_own(capsys):
    """Python's last-resort handler printed a record's bare message, told from nobody else's."""
    with server._logging_to_stderr():
        logging.getLogger("vtm.broker").warning("%s: something to know", "/run/vtm/sock.fds")
        logging.getLogger("vtm.broker").debug("not shown")
    assert capsys.readouterr().err == "vtmd: warning: /run/vtm/sock.fds: something to know\n"


def test_vtmd_says_which_socket_folder_it_cannot_create(tmp_path):
    """It said "[Errno 2] No such file or directory: '/proc/x'"."""
    done = vtmd("--listen", "unix:/proc/nonexistent/sock", "--backend", "host", "--capacity-bytes", "4MiB")
    assert done.returncode == 2 and done.stderr == ("vtmd: error: cannot create the socket folder /proc/nonexistent "
                                                    "(--listen unix:/proc/nonexistent/sock): No such file or "
                                                    "directory\n"), done.stderr


def test_vtmctl_into_head_ends_quietly(broker):
    """`vtmctl ... | head -1` printed a BrokenPipeError traceback and exited 1
    when vtmctl wrote after head had gone (here: top's later frames)."""
    done = subprocess.run(f"{sys.executable} -m vtm.broker.ctl --address {broker.address} top --iterations 200 "
                          "--interval 0.01 | head -1; "
                          "exit ${PIPESTATUS[0]}", shell=True, executable="/bin/bash", capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.count("\n") == 1


def test_top_stops_on_sigint_even_when_started_with_it_ignored(broker):
    """A non-interactive shell starts a background job with SIGINT ignored
    (`vtmctl ... top & ...; kill -INT $!`): top went on refreshing, as
    flexinfer's commands no longer do. It ends with 130, as every vtm and
    flexinfer command interrupted by Ctrl-C (it exited 0: a script could
    not tell an interrupted vtmctl from one that had done its work)."""
    proc = subprocess.Popen([sys.executable, "-m", "vtm.broker.ctl", "--address", broker.address, "top",
                             "--interval", "0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert proc.stdout.readline().startswith("vtm broker at ")  # it runs: the first frame is out
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130 and err == "", err


@pytest.mark.parametrize("command", [["stats"], ["stats", "--json"], ["top"], ["set-quota", "someone", "1MiB"],
                                     ["trim"]])
def test_every_vtmctl_command_interrupted_exits_130(tmp_path, command):
    """Ctrl-C while vtmctl waits for a broker that does not answer (a listener
    that never speaks): 130, as flexinfer's commands, quietly. It was 0."""
    path = tmp_path / "silent.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.bind(str(path))
        silent.listen(8)
        proc = subprocess.Popen([sys.executable, "-m", "vtm.broker.ctl", "--address", f"unix:{path}", "--timeout", "60",
                                 *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        try:
            deadline = time.monotonic() + 30
            # Started with SIGINT ignored: caught once vtmctl's main has taken it, so the command runs.
            while not _catches(proc.pid, signal.SIGINT):
                assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
                time.sleep(0.01)
            time.sleep(0.3)  # waiting for the broker's answer
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
            proc.wait()
    assert (proc.returncode, out, err) == (130, "", "")


def test_trim_help_says_what_bytes_does(capsys):
    """It said 'at most this much'; a trim of --bytes frees at least that
    much, evicting cached prefixes when free chunks are not enough."""
    flat = " ".join(_help(ctl.main, ["trim"], capsys).split())
    assert "at least this much" in flat and "cached prefixes no client uses" in flat, flat


def test_a_vtmd_whose_control_port_is_taken_says_so_and_leaves_nothing(tmp_path):
    """gRPC raised a RuntimeError there: a traceback and status 1, with the
    socket and its folder left behind."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        done = vtmd("--listen", f"unix:{tmp_path}/a/b/sock", "--backend", "host", "--control", f"tcp:127.0.0.1:{port}")
    finally:
        taken.close()
    # One line: gRPC's own error lines came first.
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"vtmd: error: cannot listen at tcp:127.0.0.1:{port}: Address already in use\n", done.stderr
    assert os.listdir(tmp_path) == []


def test_a_control_host_is_taken_when_one_of_its_addresses_binds(monkeypatch):
    """Review: `localhost` resolves to 127.0.0.1 and ::1 (Docker's hosts
    file), and where IPv6 is off ::1 cannot be bound: the check refused
    what gRPC would have listened on. One address is enough, as for gRPC;
    when none binds, a port in use is what the error names."""
    import socket

    from vtm.broker import server

    unassigned = (socket.AF_INET6, socket.SOCK_STREAM, 0, "", ("2001:db8::1", 0, 0, 0))  # documentation range
    local = (socket.AF_INET, socket.SOCK_STREAM, 0, "", ("127.0.0.1", 0))
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: [unassigned, local])
    server._check_bindable("localhost:0", "tcp:localhost:0")
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: [unassigned])
    with pytest.raises(OSError, match="cannot listen at tcp:localhost:0: "):
        server._check_bindable("localhost:0", "tcp:localhost:0")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        busy = (socket.AF_INET, socket.SOCK_STREAM, 0, "", ("127.0.0.1", port))
        monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: [unassigned, busy])
        with pytest.raises(OSError, match="Address already in use"):
            server._check_bindable(f"localhost:{port}", f"tcp:localhost:{port}")
    finally:
        taken.close()


def test_a_second_vtmd_on_a_taken_control_port_fails_rather_than_shares_it(tmp_path):
    """gRPC binds with SO_REUSEPORT: a second vtmd given a first one's
    control port would have started, the kernel sharing the port's
    connections between two brokers."""
    first = BrokerProcess(tmp_path / "first", control="tcp:127.0.0.1:0")
    try:
        done = vtmd("--listen", f"unix:{tmp_path}/second/sock", "--backend", "host", "--control", first.control_address)
        assert done.returncode == 2 and "Address already in use" in done.stderr, done.stderr
    finally:
        first.kill()


def test_vtmd_makes_every_folder_it_creates_private(tmp_path):
    """os.makedirs gave the parents the umask's mode (0755): the documented
    fallback /tmp/vtm-$UID/vtm/sock had a parent others could read."""
    b = BrokerProcess(tmp_path / "vtm-1")  # listens in vtm-1/vtmd/sock: two folders to create
    try:
        for folder in (tmp_path / "vtm-1", tmp_path / "vtm-1" / "vtmd"):
            assert os.stat(folder).st_mode & 0o777 == 0o700, folder
    finally:
        b.kill()


@pytest.mark.parametrize("below", ["vtm", "a/b/vtm"])
def test_vtmd_refuses_a_socket_folder_under_a_folder_others_may_write(tmp_path, below):
    """Whoever may rename entries of a folder above may swap the private
    folder, or one on its way, for one of theirs (a sticky /tmp does not let
    them). Review: only the socket folder's own parent was looked at, so
    folders vtmd created under a shared one (a/b/vtm) were accepted."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    done = vtmd("--listen", f"unix:{shared}/{below}/sock", "--backend", "host")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"{shared}, above the socket folder, is another user's or writable by other users" in done.stderr
    assert os.listdir(shared) == []


def test_vtmd_refuses_a_socket_folder_under_a_folder_its_group_may_write(tmp_path):
    """Review: only the write bit for every user was looked at, though
    members of a folder's group may rename its entries as well. A group
    that is this user's alone (a private group) is no one else's."""
    import grp
    import pwd

    from vtm.broker.server import _private_folder, _private_group

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o770)
    others = next((u.pw_gid for u in pwd.getpwall() if u.pw_uid != os.getuid() and u.pw_gid != os.getgid()), None)
    try:
        os.chown(shared, -1, others)
    except (PermissionError, TypeError):
        pytest.skip("no group of another user that this user may give a folder to")
    done = vtmd("--listen", f"unix:{shared}/vtm/sock", "--backend", "host")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"{shared}, above the socket folder, is another user's or writable by other users" in done.stderr
    assert os.listdir(shared) == []
    # Review: a group with no member known (tty, a gid without an entry)
    # was taken for this user's own.
    for gid in (next((g.gr_gid for g in grp.getgrall() if not g.gr_mem and g.gr_gid not in
                      {u.pw_gid for u in pwd.getpwall()}), None), max(g.gr_gid for g in grp.getgrall()) + 4242):
        if gid is not None:
            os.chown(shared, -1, gid)
            assert not _private_group(gid, os.getuid())
            with pytest.raises(PermissionError, match="writable by other users"):
                _private_folder(str(shared / "vtm" / "sock"))
    if _private_group(os.getgid(), os.getuid()):
        os.chown(shared, -1, os.getgid())
        assert _private_folder(str(shared / "vtm" / "sock")) == [str(shared / "vtm")]


VTMD_COMMANDS = {"python -m vtm.broker": [sys.executable, "-m", "vtm.broker"],
                 "vtmd": [os.path.join(os.path.dirname(sys.executable), "vtmd")]}


def _catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (SigCgt in /proc: the kernel's word)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def _maps(pid: int, name: str) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return name in maps.read()


# When each signal is sent after vtmd's start: at once (the pid exists: the interpreter is starting),
# after a delay, or at a point of the start the process's own state shows: its SIGTERM handler
# installed, vtm's extension mapped (import vtm), grpc's mapped (the broker's modules load).
_MOMENTS = {"at once": lambda pid: True, "10 ms": 0.010, "20 ms": 0.020, "50 ms": 0.050,
            "handler installed": lambda pid: _catches(pid, signal.SIGTERM),
            "vtm's extension mapped": lambda pid: _maps(pid, "vtm/_core"),
            "grpc's extension mapped": lambda pid: _maps(pid, "cygrpc")}
# The moments at which each command has caught SIGTERM and SIGINT already, whatever the machine's speed:
# vtmd from its entry module's first statement (_vtmd.py), before anything of vtm loads; python -m vtm.broker
# once runpy has imported the vtm package (docs/broker.md).
_COVERED = {"vtmd": {"handler installed", "vtm's extension mapped", "grpc's extension mapped"},
            "python -m vtm.broker": {"handler installed", "grpc's extension mapped"}}


@pytest.mark.parametrize("command, moment, sig", [
    *[("vtmd", m, signal.SIGTERM) for m in _MOMENTS], ("vtmd", "vtm's extension mapped", signal.SIGINT),
    *[("python -m vtm.broker", m, signal.SIGTERM) for m in ("at once", "20 ms", "handler installed",
                                                             "grpc's extension mapped")],
])
def test_a_vtmd_stopped_while_it_starts_ends_as_a_running_one_does(tmp_path, command, moment, sig):
    """SIGTERM before vtmd's handler is installed meets the default action:
    vtmd dies with status -15 (143 in a shell), where a later SIGTERM ends it
    with status 0 after "vtmd: stopped" (docs/broker.md; SIGINT: 130); SIGINT
    printed a traceback. The handler used to come after `import vtm` (~45 ms with
    importlib.metadata): a SIGTERM once vtm's extension was mapped killed
    vtmd. Now a signal is clean from the entry module's first statement on.
    What comes before it, the interpreter's start (10-20 ms), no Python code
    can cover: a signal sent then (at once, or after a delay shorter than the
    start on this machine) may kill vtmd, but only one sent before the
    handler was installed, and it leaves nothing behind."""
    path = tmp_path / "vtmd" / "sock"
    proc = subprocess.Popen([*VTMD_COMMANDS[command], "--listen", f"unix:{path}", "--backend", "host",
                             "--capacity-bytes", "1MiB", "--chunk-bytes", "64KiB", "--granularity", "64KiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        when = _MOMENTS[moment]
        if callable(when):
            deadline = time.monotonic() + 30
            while not when(proc.pid):
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.0005)
        else:
            time.sleep(when)
        caught = _catches(proc.pid, signal.SIGTERM)  # the handlers of both signals come together
        proc.send_signal(sig)
        log = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    stopped = 130 if sig == signal.SIGINT else 0  # Ctrl-C ends vtmd as every vtm and flexinfer command
    if caught or moment in _COVERED[command]:
        assert proc.returncode == stopped and log.endswith("vtmd: stopped\n"), (proc.returncode, log)
        assert caught, f"{command} had no handler yet when {moment}"
    else:  # sent during the interpreter's start: killed before it printed or created anything
        assert proc.returncode in (stopped, -sig), log
        assert proc.returncode == stopped and log.endswith("vtmd: stopped\n") or log == "", log
    assert not path.exists()
