"""Soak: concurrent OpenAI-client users against `flexinfer serve --manager`
while the broker (vtmd) is SIGKILLed and restarted and other vtm clients are
SIGKILLed, for a bounded time, on loopback only.

    python scripts/soak.py [--minutes 10] [--users 8] [--json PATH]

What runs (all in a private temporary folder, all on 127.0.0.1 / Unix sockets):
  * vtmd (host backend) and one `flexinfer serve --manager` on a tiny random
    Llama built here (word-level tokenizer over its 512 ids; no download);
  * `--neighbours` other vtm clients of the same broker: each writes a byte
    pattern into its vTensors, records and matches prefixes, and checks every
    byte it reads back (a chunk handed to two tenants would show up here);
  * a chaos thread: SIGKILL vtmd every ~`--broker-kill-every` s and restart it
    after a pause; SIGKILL a neighbour every ~`--client-kill-every` s and start
    another;
  * `--users` threads with the official `openai` client: greedy completions
    (whole and streamed), streams cancelled midway, and bad requests of every
    kind the server must refuse.

Judged at the end (the exit status is 1 when any fails):
  * every good request either returned exactly the oracle's greedy tokens
    (transformers on the same weights) or failed with a typed retryable error
    (HTTP 503 or 429); any other status, or wrong tokens, is a failure;
  * every bad request got a 4xx, never a 5xx;
  * no neighbour ever read a byte it did not write;
  * after the chaos stops, the server is healthy and serves oracle-equal tokens;
  * once every client is gone, vtmd's Check() passes and it holds no chunk;
  * memory is flat: RSS of vtmd and of the server, first fifth vs last fifth.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

VOCAB = 512
PROMPTS = 24  # the pool: lengths 8..120, some sharing prefixes (prefix reuse under chaos)
MAX_TOKENS = 24
NEIGHBOUR = r"""
import os, sys, time, random
import numpy as np
import vtm
address, seed = sys.argv[1], int(sys.argv[2])
rng = random.Random(seed)
ROW = 1000
try:
    mgr = vtm.connect(address, name=f"neighbour-{os.getpid()}", timeout=5)
    space = mgr.create_space(row_bytes=ROW, max_tokens=400, max_slots=8, namespace=f"soak-neighbour-{seed}")
    view = space.tensor(np.uint8)
    while True:
        n = rng.randrange(20, 400)
        tokens = [rng.randrange(1000) for _ in range(n)]
        vt = space.create(n).result()
        pattern = (np.arange(n * ROW, dtype=np.int64) * 7 + seed).astype(np.uint8)
        view[vt.slot, : n * ROW] = pattern
        space.prefix_record(vt, tokens).result()
        m = space.prefix_match(tokens[: n // 2] + [10**6]).result()
        for mine, length in ((vt, n), (m.vtensor, m.num_tokens)):
            if mine is not None and not np.array_equal(view[mine.slot, : length * ROW], pattern[: length * ROW]):
                print(f"CORRUPTION: vTensor {mine.id} slot {mine.slot} does not hold its bytes", flush=True)
                os._exit(3)
        if m.vtensor is not None:
            m.vtensor.release().result()
        vt.release().result()
        if rng.random() < 0.2:
            space.clear_prefixes()
except vtm.Error as exc:  # the broker went away (its restart is the soak's doing)
    print(f"neighbour: {type(exc).__name__}: {exc}", flush=True)
    sys.exit(0)
"""


# ----------------------------------------------------------------------------- the model and its oracle


def build_model(folder: Path, seed: int = 0):
    """A tiny random Llama (2 layers, logits of order 1: no near-ties) and a
    word-level tokenizer over its ids; returns transformers' model (the oracle)."""
    import torch
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_gpu import save_tokenizer

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                                      initializer_range=0.1)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    save_tokenizer(folder, VOCAB)
    return model


def oracle_tokens(model, prompts: list[list[int]]) -> list[list[int]]:
    import torch
    import transformers

    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=[],
                                           pad_token_id=0, bos_token_id=None)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 generation_config=config)
            out.append(ids[0, len(prompt):].tolist())
    return out


def prompt_pool(rng: random.Random) -> list[list[int]]:
    shared = [1] + [rng.randrange(3, VOCAB) for _ in range(60)]
    pool = []
    for i in range(PROMPTS):
        if i % 3 == 0:
            pool.append(shared[: rng.randrange(20, 61)] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 40))])
        else:
            pool.append([1] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(8, 120))])
    return pool


# ----------------------------------------------------------------------------- processes


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Broker:
    def __init__(self, folder: Path, capacity_mib: int):
        self.folder = folder
        self.path = folder / "vtmd" / "sock"
        self.address = f"unix:{self.path}"
        self.capacity = capacity_mib << 20
        self.proc = None
        self.starts = 0

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vtm.broker", "--listen", self.address, "--backend", "host",
             "--capacity-bytes", str(self.capacity), "--chunk-bytes", str(64 << 10), "--granularity", str(64 << 10)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=self.folder)
        line = self.proc.stdout.readline()
        if "listening" not in line:
            raise RuntimeError(f"vtmd did not start: {line!r}")
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # drain
        self.starts += 1

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def control(self):
        import grpc

        from vtm.proto.vtm.v1 import vtm_pb2, vtm_pb2_grpc

        channel = grpc.insecure_channel(self.address)
        return channel, vtm_pb2_grpc.BrokerStub(channel), vtm_pb2


class Server:
    def __init__(self, folder: Path, model: Path, broker: Broker, port: int):
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(folder / "serve.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flexinfer", "serve", "--model", str(model), "--served-model-name", "tiny",
             "--manager", broker.address, "--port", str(port), "--max-model-len", "256", "--max-num-seqs", "16",
             "--log-level", "warning", "--threads", "1"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=folder)

    def health(self) -> int | None:
        import httpx

        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code
        except httpx.HTTPError:
            return None

    def wait_healthy(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if self.health() == 200:
                return True
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ----------------------------------------------------------------------------- users


class Tally:
    """Outcomes, by kind, shared by the user threads."""

    def __init__(self):
        self.mu = threading.Lock()
        self.counts = Counter()
        self.failures: list[str] = []
        self.latency_s: list[float] = []

    def add(self, kind: str, failure: str | None = None, latency: float | None = None) -> None:
        with self.mu:
            self.counts[kind] += 1
            if failure is not None and len(self.failures) < 50:
                self.failures.append(failure)
            if latency is not None:
                self.latency_s.append(latency)


BAD_REQUESTS = {
    "stop token outside the vocabulary": dict(extra_body={"stop_token_ids": [VOCAB + 7], "min_tokens": 1}),
    "empty prompt": dict(prompt=[]),
    "prompt longer than the context": dict(prompt=[5] * 400),
    "max_tokens 0": dict(max_tokens=0),
    "seed 2**70": dict(seed=2**70),
    "n 100000": dict(n=100000),
    "temperature -1": dict(temperature=-1),
    "token id outside the vocabulary": dict(prompt=[1, VOCAB + 3]),
    "20,000 stop strings": dict(stop=[f"s{i}" for i in range(20000)]),
    "a 12 MB body": dict(extra_body={"padding": "x" * (12 << 20)}),
    "model of another name": dict(model="gpt-4"),
}


def user(index: int, url: str, pool, expected, deadline: float, tally: Tally, seed: int) -> None:
    import httpx
    import openai

    rng = random.Random(seed)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    while time.monotonic() < deadline:
        roll = rng.random()
        i = rng.randrange(len(pool))
        n_tokens = rng.randrange(1, MAX_TOKENS + 1)
        base = dict(model="tiny", prompt=pool[i], max_tokens=n_tokens, temperature=0.0)
        extra = {"ignore_eos": True, "return_token_ids": True}
        started = time.monotonic()
        try:
            if roll < 0.1:
                name, change = rng.choice(sorted(BAD_REQUESTS.items()))
                request = {**base, **change}
                request["extra_body"] = {**extra, **change.get("extra_body", {})}
                try:
                    client.completions.create(**request)
                    tally.add(f"bad: {name}: accepted", f"user {index}: {name} was accepted")
                except openai.APIStatusError as exc:
                    ok = 400 <= exc.status_code < 500
                    tally.add(f"bad: {name}: {exc.status_code}",
                              None if ok else f"user {index}: {name}: {exc.status_code} {exc.message[:200]}")
                continue
            if roll < 0.2:  # a stream the user walks away from
                with client.completions.create(**base, stream=True, extra_body=extra) as stream:
                    for k, _ in enumerate(stream):
                        if k >= 2:
                            break
                tally.add("cancelled stream")
                continue
            if roll < 0.45:
                tokens = []
                for chunk in client.completions.create(**base, stream=True, extra_body=extra):
                    for choice in chunk.choices:
                        tokens += (choice.model_extra or {}).get("token_ids") or []
            else:
                reply = client.completions.create(**base, extra_body=extra)
                tokens = reply.choices[0].model_extra["token_ids"]
            want = expected[i][:n_tokens]
            if tokens == want:
                tally.add("good: oracle tokens", latency=time.monotonic() - started)
            else:
                tally.add("good: WRONG tokens", f"user {index}: prompt {i}, {n_tokens} tokens: {tokens} != {want}")
        except openai.APIStatusError as exc:
            retryable = exc.status_code in (429, 503)
            tally.add(f"good: retryable {exc.status_code}" if retryable else f"good: failed {exc.status_code}",
                      None if retryable else f"user {index}: {exc.status_code} {exc.message[:300]}")
            if retryable:
                time.sleep(0.2)
        except (openai.APIConnectionError, openai.APITimeoutError, httpx.HTTPError) as exc:
            tally.add("good: connection error", f"user {index}: {type(exc).__name__}: {exc}")
        except openai.APIError as exc:  # an error event inside a stream (its status line was 200)
            retryable = exc.code == "service_unavailable"
            tally.add("good: retryable in stream" if retryable else "good: failed in stream",
                      None if retryable else f"user {index}: in stream: {exc.type} {exc.message[:300]}")


# ----------------------------------------------------------------------------- the run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--neighbours", type=int, default=2)
    parser.add_argument("--broker-kill-every", type=float, default=60.0, help="mean seconds between vtmd SIGKILLs")
    parser.add_argument("--client-kill-every", type=float, default=20.0,
                        help="mean seconds between SIGKILLs of a neighbour client")
    parser.add_argument("--capacity-mib", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    folder = Path(tempfile.mkdtemp(prefix="flexinfer-soak-"))
    os.chmod(folder, 0o700)
    print(f"soak: {args.minutes:g} min, {args.users} users, {args.neighbours} neighbours, in {folder}", flush=True)

    model = build_model(folder / "model", args.seed)
    pool = prompt_pool(rng)
    expected = oracle_tokens(model, pool)
    broker = Broker(folder, args.capacity_mib)
    broker.start()
    server = Server(folder, folder / "model", broker, free_port())
    neighbours: list[subprocess.Popen] = []
    exits = Counter()
    faults = Counter()
    samples = []  # (t, vtmd rss, server rss)
    tally = Tally()
    report: dict = {}
    try:
        if not server.wait_healthy(120):
            raise RuntimeError("the server did not become healthy:\n" + (folder / "serve.log").read_text()[-3000:])

        def spawn_neighbour() -> subprocess.Popen:
            return subprocess.Popen([sys.executable, "-c", NEIGHBOUR, broker.address, str(rng.randrange(1 << 30))],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=folder)

        def reap_neighbours() -> None:
            for k, proc in enumerate(neighbours):
                code = proc.poll()
                if code is not None:
                    out = proc.stdout.read()
                    exits[code] += 1
                    if code == 3 or "CORRUPTION" in out:
                        tally.add("neighbour: CORRUPTION", out.strip()[-300:])
                    neighbours[k] = spawn_neighbour()

        neighbours.extend(spawn_neighbour() for _ in range(args.neighbours))
        start = time.monotonic()
        deadline = start + args.minutes * 60
        threads = [threading.Thread(target=user, args=(u, server.url, pool, expected, deadline, tally, args.seed + u),
                                    daemon=True) for u in range(args.users)]
        for t in threads:
            t.start()
        next_broker_kill = start + rng.expovariate(1 / args.broker_kill_every)
        next_client_kill = start + rng.expovariate(1 / args.client_kill_every)
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = time.monotonic()
            samples.append((now - start, rss_mib(broker.proc.pid), rss_mib(server.proc.pid)))
            reap_neighbours()
            if now >= next_client_kill and neighbours:
                victim = rng.choice(neighbours)
                if victim.poll() is None:
                    victim.send_signal(signal.SIGKILL)
                    faults["client SIGKILL"] += 1
                next_client_kill = now + rng.expovariate(1 / args.client_kill_every)
            if now >= next_broker_kill and now < deadline - 20:
                broker.kill()
                faults["vtmd SIGKILL"] += 1
                time.sleep(rng.uniform(0.5, 3.0))  # the broker is away: requests wait, /health says 503
                faults[f"/health while vtmd away: {server.health()}"] += 1
                broker.start()
                faults["vtmd restart"] += 1
                next_broker_kill = now + rng.expovariate(1 / args.broker_kill_every)
        for t in threads:
            t.join(150)
        # After the chaos: healthy again, and exact.
        recovered = server.wait_healthy(60)
        final = Tally()
        if recovered:
            user(-1, server.url, pool, expected, time.monotonic() + 10, final, args.seed + 999)
        for proc in neighbours:
            proc.kill()
            proc.wait()
        server.stop()
        # Every client is gone: vtmd holds nothing and its invariants hold.
        time.sleep(1.0)
        channel, stub, pb = broker.control()
        with contextlib.closing(channel):
            stub.Trim(pb.TrimRequest(all=True), timeout=10)
            stub.Check(pb.StatsRequest(), timeout=10)
            vtmd_stats = json.loads(stub.Stats(pb.StatsRequest(), timeout=10).json)
        first = [s for s in samples if s[0] < samples[-1][0] / 5]
        last = [s for s in samples if s[0] > samples[-1][0] * 4 / 5]

        def median(values):
            values = [v for v in values if v is not None]
            return round(statistics.median(values), 1) if values else None

        latency = sorted(tally.latency_s)
        report = {
            "minutes": args.minutes, "users": args.users, "neighbours": args.neighbours,
            "cpu": _cpu_model(), "outcomes": dict(tally.counts), "failures": tally.failures,
            "faults": dict(faults), "neighbour_exits": {str(k): v for k, v in exits.items()},
            "vtmd_starts": broker.starts, "recovered": recovered, "after_chaos": dict(final.counts),
            "after_chaos_failures": final.failures,
            "good_latency_s": {"p50": round(latency[len(latency) // 2], 3) if latency else None,
                               "p99": round(latency[int(len(latency) * 0.99)], 3) if latency else None},
            "vtmd_at_end": {"chunks_held": vtmd_stats["chunks_held"], "clients": len(vtmd_stats["clients"]),
                            "tree_nodes": vtmd_stats["tree_nodes"]},
            "rss_mib": {"vtmd_first": median(s[1] for s in first), "vtmd_last": median(s[1] for s in last),
                        "server_first": median(s[2] for s in first), "server_last": median(s[2] for s in last)},
        }
    finally:
        for proc in neighbours:
            if proc.poll() is None:
                proc.kill()
        if server.proc.poll() is None:
            server.proc.kill()
        if broker.proc is not None and broker.proc.poll() is None:
            broker.proc.kill()
    failed = bool(report["failures"] or report["after_chaos_failures"] or not report["recovered"]
                  or report["vtmd_at_end"]["chunks_held"] or report["vtmd_at_end"]["clients"])
    rss = report["rss_mib"]
    for who in ("vtmd", "server"):
        if rss[f"{who}_first"] and rss[f"{who}_last"] and rss[f"{who}_last"] > 1.25 * rss[f"{who}_first"] + 20:
            failed = True
            report["failures"].append(f"{who} RSS grew from {rss[f'{who}_first']} to {rss[f'{who}_last']} MiB")
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    print("soak: FAILED" if failed else "soak: passed", flush=True)
    return 1 if failed else 0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_model() -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import cpu_model

    return cpu_model()


if __name__ == "__main__":
    sys.exit(main())
