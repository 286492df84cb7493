"""Helpers for the broker tests: a vtmd process per test, and the bodies of
spawned client processes (module level, so `spawn` can import them).

Every broker is a real `python -m vtm.broker` process on a Unix socket in the
test's private temporary folder; `BrokerProcess.kill` and the fixture's
teardown make sure none outlives its test.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest

import fake_cuda_testing

KiB = 1024
CHUNK = 64 * KiB
ROW = 1000  # rows straddle pages: 65.5 rows a page
START_TIMEOUT_S = 30.0


class BrokerProcess:
    def __init__(self, folder, capacity_chunks: int = 64, chunk_bytes: int = CHUNK, backend: str = "host",
                 control: str | None = None, extra_args=(), env=None):
        self.backend = backend
        self.env = None if env is None else {**os.environ, **env}  # more environment for vtmd
        self.extra_args = list(extra_args)  # more vtmd flags (--max-sessions, --quota-file, ...)
        self.control = control  # tcp:HOST:PORT for vtmd --control; control_address is where it listens
        self.control_address = None
        self.folder = str(folder)
        self.path = os.path.join(self.folder, "vtmd", "sock")
        self.address = "unix:" + self.path
        self.capacity_bytes = capacity_chunks * chunk_bytes
        self.chunk_bytes = chunk_bytes
        self.proc = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vtm.broker", "--listen", self.address, "--backend", self.backend,
             "--capacity-bytes", str(self.capacity_bytes), "--chunk-bytes", str(self.chunk_bytes)]
            + (["--granularity", str(self.chunk_bytes)] if self.backend == "host" else [])
            + (["--control", self.control] if self.control else []) + self.extra_args,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env)
        line = self.proc.stdout.readline()  # "vtmd: listening on ..." once serving
        if "listening" not in line:
            rest = self.proc.stdout.read() if self.proc.poll() is not None else ""
            self.kill()
            raise RuntimeError(f"vtmd did not start: {line!r} {rest!r}")
        if ", control on " in line:
            self.control_address = line.rsplit(", control on ", 1)[1].strip()
        wait_serving(self.address, START_TIMEOUT_S)

    def terminate(self, timeout: float = 15.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()


def wait_serving(address: str, timeout: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service="vtm.v1.Broker"), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.05)


class RowView:
    """Bytes of a space through its tensor view: numpy on the host backend,
    a torch CUDA tensor on cuda (read back to numpy for comparisons), or
    under the fake driver (fake_cuda_testing.py) the space's memory by address."""

    def __init__(self, space, backend: str):
        self._base = None
        self._slot_bytes = space.slot_bytes
        if backend == "cuda" and fake_cuda_testing.active():
            self._torch = None
            self._base = space.base_address
        elif backend == "cuda":
            import torch

            self._torch = torch
            self._view = space.tensor(torch.uint8)
        else:
            self._torch = None
            self._view = space.tensor(np.uint8)

    def write(self, slot: int, start: int, data: np.ndarray) -> None:
        if self._base is not None:
            fake_cuda_testing.write_device(self._base + slot * self._slot_bytes + start, data)
        elif self._torch is not None:
            self._view[slot, start:start + len(data)] = self._torch.from_numpy(data).to(self._view.device)
            self._torch.cuda.synchronize()
        else:
            self._view[slot, start:start + len(data)] = data

    def read(self, slot: int, start: int, stop: int) -> np.ndarray:
        if self._base is not None:
            return fake_cuda_testing.read_device(self._base + slot * self._slot_bytes + start, stop - start)
        if self._torch is not None:
            return self._view[slot, start:stop].cpu().numpy()
        return np.array(self._view[slot, start:stop])


def pattern(tokens, row_bytes: int = ROW) -> np.ndarray:
    """Row t's bytes depend on tokens[:t+1] only (like vtm_testing's RowIO)."""
    out = np.empty(len(tokens) * row_bytes, np.uint8)
    acc = 0
    for t, tok in enumerate(tokens):
        acc = (acc * 1_000_003 + int(tok) + 7) % 2_147_483_647
        out[t * row_bytes:(t + 1) * row_bytes] = (np.arange(row_bytes, dtype=np.int64) * 31 + acc) % 251
    return out


# ----------------------------------------------------------------------------- child bodies
# Each reports through `q` and never raises: an exception is reported by name.

def child_allocate(address, tokens, q, hold_event=None):
    """Creates a vTensor of `tokens` rows, reports ("ok", pages) or the error
    class name, then holds it until hold_event is set."""
    import vtm

    try:
        with vtm.connect(address, name="child", timeout=10) as mgr:
            space = mgr.create_space(row_bytes=ROW, max_tokens=4096, max_slots=4)
            try:
                vt = space.create(tokens).result()
            except vtm.Error as exc:
                q.put((type(exc).__name__, None))
                return
            view = space.tensor(np.uint8)
            view[vt.slot, :tokens * ROW] = 5  # the memory is really there
            q.put(("ok", vt.page_chunks()))
            if hold_event is not None:
                hold_event.wait(30)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        q.put((type(exc).__name__, str(exc)))


def child_record(address, tokens, q, go_on, done, row=ROW, backend="host"):
    """Writes the pattern of `tokens`, records it, reports its page chunks;
    after `go_on`, checks its own bytes are intact and reports again."""
    import vtm

    try:
        with vtm.connect(address, name="writer", timeout=30) as mgr:
            space = mgr.create_space(row_bytes=row, max_tokens=4096, max_slots=4, namespace="shared")
            vt = space.create(len(tokens)).result()
            view = RowView(space, backend)
            view.write(vt.slot, 0, pattern(tokens, row))
            space.prefix_record(vt, tokens).result()
            q.put(("recorded", vt.page_chunks()))
            go_on.wait(30)
            intact = bool((view.read(vt.slot, 0, len(tokens) * row) == pattern(tokens, row)).all())
            q.put(("intact", intact))
            done.wait(30)
    except Exception as exc:  # noqa: BLE001
        q.put((type(exc).__name__, str(exc)))


def child_extend_forever(address, q):
    """Extends one vTensor step by step until killed; reports after each step."""
    import vtm

    mgr = vtm.connect(address, name="doomed", timeout=10)
    space = mgr.create_space(row_bytes=ROW, max_tokens=60000, max_slots=2, namespace="doomed")
    vt = space.create(100).result()
    space.prefix_record(vt, list(range(100))).result()
    n = 100
    while True:
        n = min(n + 300, 60000)
        vt.extend(n).result()
        q.put(n)


def end_liveness_stream(mgr) -> None:
    """What a transport reset or a client bug does: the session's liveness
    channel ends while the client process lives on."""
    mgr._session.drop()


def child_allocate_release_hold(address, tokens, q, done):
    """Maps `tokens` rows, writes them, releases them, reports ("released",
    chunks imported after the release), then stays alive until `done`."""
    import vtm

    try:
        with vtm.connect(address, name="former", timeout=10) as mgr:
            space = mgr.create_space(row_bytes=ROW, max_tokens=4096, max_slots=1)
            vt = space.create(tokens).result()
            view = space.tensor(np.uint8)
            view[vt.slot, :tokens * ROW] = 9
            del view
            vt.release().result()
            q.put(("released", mgr.imports))
            done.wait(60)
    except Exception as exc:  # noqa: BLE001
        q.put((type(exc).__name__, str(exc)))


def child_idle_sessions(address, n, q, done):
    """Opens `n` sessions and keeps them idle until `done`; reports ("open", n)."""
    import vtm

    managers = []
    try:
        for _ in range(n):
            managers.append(vtm.connect(address, name="idle", timeout=10))
        q.put(("open", len(managers)))
        done.wait(120)
    except Exception as exc:  # noqa: BLE001
        q.put((type(exc).__name__, str(exc)))
    finally:
        for mgr in managers:
            mgr.close()


def child_quarantined(address, tokens, q):
    """Maps and writes `tokens` rows, then loses its liveness channel while it
    lives on; reports ("dropped", its page chunks) and waits to be killed."""
    import vtm

    try:
        mgr = vtm.connect(address, name="cut-off", timeout=10)
        space = mgr.create_space(row_bytes=ROW, max_tokens=4096, max_slots=1)
        vt = space.create(tokens).result()
        space.tensor(np.uint8)[vt.slot, :tokens * ROW] = 3
        end_liveness_stream(mgr)
        q.put(("dropped", vt.page_chunks()))
        time.sleep(120)
    except Exception as exc:  # noqa: BLE001
        q.put((type(exc).__name__, str(exc)))


@pytest.fixture
def broker(tmp_path):
    """A broker process with a 16-chunk pool, killed after the test (import
    it into a test module to use it)."""
    b = BrokerProcess(tmp_path, capacity_chunks=16)
    yield b
    b.kill()


def held(mgr) -> int:
    return mgr.stats()["chunks_held"]


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout} s")
        time.sleep(0.02)


def client_state(mgr, name: str):
    """The broker's state of the client named `name`, None once it is gone."""
    states = [c.get("state", "live") for c in mgr.stats()["clients"] if c["name"] == name]
    return states[0] if states else None


def mapped_chunks(manager, name: str, chunk_bytes: int = CHUNK) -> int:
    """The chunks the broker's clients named `name` map (not its cached prefixes)."""
    return sum(c["mapped_bytes"] for c in manager.stats()["clients"] if c["name"] == name) // chunk_bytes


def holder(manager, chunks: int, name: str, chunks_each: int = 2) -> list:
    """`chunks` chunks mapped by `manager` in a space `name` of vTensors of
    `chunks_each`, which a reclaim notice releases, latest first, until it
    freed what was asked. The list of those still held."""
    rows = chunks_each * (CHUNK // ROW)
    space = manager.create_space(row_bytes=ROW, max_tokens=2000, max_slots=chunks // chunks_each, name=name)
    vts = [space.create(rows).result() for _ in range(chunks // chunks_each)]

    def give_back(nbytes):
        freed = 0
        while freed < nbytes and vts:
            vts.pop().release().result()
            freed += chunks_each * CHUNK
        return freed

    manager.set_reclaim_handler(give_back)
    return vts


def memfd_inodes(pid: int) -> set[int]:
    """The host backend's chunks (memfds) that process `pid` keeps alive:
    those it holds an fd of and those it maps. A memfd lives while either
    remains in any process, so the union over every process of a broker and
    its clients is the physical memory their chunks hold."""
    inodes = set()
    folder = f"/proc/{pid}/fd"
    for name in os.listdir(folder):
        try:
            if os.readlink(f"{folder}/{name}").startswith("/memfd:vtm-chunk"):
                inodes.add(os.stat(f"{folder}/{name}").st_ino)
        except FileNotFoundError:
            continue  # closed meanwhile
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith("/memfd:vtm-chunk"):
                inodes.add(int(fields[4]))
    return inodes


@pytest.fixture
def spawn():
    """Starts spawned client processes (start(target, *args)); kills any
    still alive at teardown."""
    context = multiprocessing.get_context("spawn")
    children = []

    def start(target, *args):
        p = context.Process(target=target, args=args, daemon=True)
        p.start()
        children.append(p)
        return p

    yield start
    for p in children:
        if p.is_alive():
            p.kill()
        p.join(10)


def median_seconds(fn, n: int = 15) -> float:
    """The median time of n calls of fn()."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")
