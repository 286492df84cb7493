"""`flexinfer serve` against careless or hostile clients and a failing
broker (issue 17, findings 6, 7 and 13): what no request may make the
server do (queue unbounded work, stall the event loop, run what can never
fit), and what /health and /metrics say when the engine cannot serve.

Every refusal is checked for its status and OpenAI error body, and for
leaving the engine as it was: the next request gives the greedy tokens of
LLM.generate on the same weights, nothing runs or waits, and no vTensor is
left alive. Tests that a handler does not stall the event loop block the
slow part on an event that only an answered /health sets, instead of
timing anything.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("transformers")  # builds the tiny model's weights
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from server_testing import ServerProcess, build_tiny_chat_model, free_port  # noqa: E402

import vtm  # noqa: E402
from flexinfer import LLM, SamplingParams  # noqa: E402

MAX_MODEL_LEN = 1024
SERVER_FLAGS = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-capacity-gib", "0.0625", "--linear", "torch",
                "--threads", "1"]
ENGINE_OPTIONS = dict(max_model_len=MAX_MODEL_LEN, kv_capacity_bytes=64 << 20, linear="torch", threads=1)


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> str:
    return str(build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")))


@pytest.fixture(scope="module")
def reference(tiny_chat):
    with LLM(tiny_chat, **ENGINE_OPTIONS) as llm:
        yield llm


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def metrics(url: str) -> dict[str, float]:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def wait_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        vtensors = sum(v for k, v in m.items() if k.startswith("vtm_space_vtensors"))
        if m["flexinfer_num_requests_running"] == 0 and m["flexinfer_num_requests_waiting"] == 0 and vtensors == 0:
            return m
        assert time.monotonic() < deadline, f"still busy after {timeout} s: {m}"
        time.sleep(0.05)


def assert_error(response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_serves(url: str, reference: LLM, prompt: str = "The capital of France is") -> None:
    """The engine is untouched: a greedy request gives LLM.generate's tokens, then all is released."""
    out = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True}).json()
    want = reference.generate([prompt], greedy(8), use_tqdm=False)[0]
    assert out["choices"][0]["token_ids"] == want.token_ids, out
    wait_idle(url)


def _start_in_thread(app):
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{server.config.port}"


@pytest.fixture
def in_process(tiny_chat):
    """An app in this process (to reach into its LLM), started by `start(llm)`; stopped at the end."""
    from flexinfer.server.app import create_app

    running = []

    def start(llm: LLM, **kwargs):
        server, thread, url = _start_in_thread(create_app(lambda: llm, "tiny", **kwargs))
        running.append((server, thread))
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        return url

    yield start
    for server, thread in running:
        server.should_exit = True
        thread.join(30)


# -- /health, /metrics and 500s (finding 7) ------------------------------------------


def test_health_is_503_once_the_broker_is_lost(tiny_chat, tmp_path, reference):
    from broker_testing import BrokerProcess

    broker = BrokerProcess(tmp_path, capacity_chunks=2048, chunk_bytes=4096)
    process = None
    try:
        process = ServerProcess(tiny_chat, tmp_path / "server.log", *SERVER_FLAGS, "--manager", broker.address)
        process.wait_ready()
        assert_serves(process.url, reference)
        broker.kill()
        deadline = time.monotonic() + 30
        while (response := httpx.get(f"{process.url}/health", timeout=10)).status_code == 200:
            assert time.monotonic() < deadline, "/health still says 200 without a broker"
            time.sleep(0.1)
        error = assert_error(response, 503, code="service_unavailable")
        assert "broker" in error["message"]
    finally:
        if process is not None:
            process.stop()
        broker.kill()


def test_metrics_during_a_broker_stall_never_break_the_engine(tiny_chat, tmp_path, reference):
    """A stopped (hung) broker: /metrics answers from its cache after its short timeout instead of
    freezing the server for the broker's 10 s, /health answers meanwhile, and once the broker runs
    again the engine serves: the timed-out stats call did not mark the manager broken."""
    from broker_testing import BrokerProcess

    broker = BrokerProcess(tmp_path, capacity_chunks=2048, chunk_bytes=4096)
    process = None
    try:
        process = ServerProcess(tiny_chat, tmp_path / "server.log", *SERVER_FLAGS, "--manager", broker.address)
        process.wait_ready()
        assert_serves(process.url, reference)
        before = metrics(process.url)
        broker.proc.send_signal(signal.SIGSTOP)
        try:
            results = {}
            scrape = threading.Thread(target=lambda: results.update(m=metrics(process.url)))
            scrape.start()
            assert httpx.get(f"{process.url}/health", timeout=5).status_code == 200
            scrape.join(60)
        finally:
            broker.proc.send_signal(signal.SIGCONT)
        assert httpx.get(f"{process.url}/health", timeout=10).status_code == 200
        assert_serves(process.url, reference, "Paris. Rome. Paris.")
        # The scrape during the stall: the cached figures, marked stale, the timeout counted.
        stalled = results["m"]
        assert before.get("flexinfer_metrics_stale") == 0 and stalled.get("flexinfer_metrics_stale") == 1
        assert stalled["flexinfer_metrics_stats_failures_total{reason=timeout}"] >= 1
        assert stalled["vtm_capacity_bytes"] == before["vtm_capacity_bytes"]
        assert metrics(process.url)["flexinfer_metrics_stale"] == 0
    finally:
        if process is not None:
            process.stop()
        broker.kill()


def test_health_is_503_once_the_engine_thread_stopped(tiny_chat, in_process):
    class Fatal(BaseException):
        pass

    llm = LLM(tiny_chat, **ENGINE_OPTIONS)
    url = in_process(llm)

    def step():
        raise Fatal("the engine thread dies")

    llm.engine.step = step
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=30)
    assert response.status_code == 500
    error = assert_error(httpx.get(f"{url}/health", timeout=10), 503)
    assert "engine thread" in error["message"]


def test_an_internal_error_keeps_the_connection(tiny_chat, in_process, reference, monkeypatch):
    """A bug answered 500 (OpenAI body, no traceback) leaves the keep-alive connection usable."""
    from flexinfer.server.serving import Serving

    url = in_process(LLM(tiny_chat, **ENGINE_OPTIONS))
    completions = Serving.completions

    async def buggy(self, request, body):
        if body.prompt == "boom":
            raise RuntimeError("a bug")
        return await completions(self, request, body)

    monkeypatch.setattr(Serving, "completions", buggy)
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        reader = sock.makefile("rb")
        status, body = _http_post(sock, reader, "/v1/completions", {"prompt": "boom"})
        assert status == 500 and json.loads(body)["error"]["type"] == "internal_server_error"
        assert b"RuntimeError" in body and b"Traceback" not in body
        status, body = _http_post(sock, reader, "/v1/completions",
                                  {"prompt": "Hello", "max_tokens": 3, "temperature": 0.0})
        assert status == 200, body
        want = reference.generate(["Hello"], greedy(3), use_tqdm=False)[0]
        assert json.loads(body)["choices"][0]["text"] == want.text


def _http_post(sock, reader, path: str, payload: dict) -> tuple[int, bytes]:
    """One HTTP/1.1 request on a kept-alive socket; (status, body)."""
    data = json.dumps(payload).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    status_line = reader.readline()
    assert status_line, "the server closed the connection"
    status = int(status_line.split()[1])
    headers = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, reader.read(int(headers["content-length"]))


def test_metrics_keep_the_last_figures_when_stats_fail():
    """The unit under /metrics: a failing read keeps the previous figures, marked stale and counted."""
    from flexinfer.server.metrics import ServerMetrics

    answers = [{"running": 1, "waiting": 2, "preemptions": 0, "prefix_query_tokens": 0, "prefix_hit_tokens": 0,
                "vtm": {"capacity_bytes": 4096, "chunk_bytes": 4096, "chunks_mapped": 0, "chunks_cached": 0}}]

    def stats():
        if not answers:
            raise vtm.Unavailable("the broker is gone")
        return answers.pop()

    m = ServerMetrics(stats, timeout_s=5)

    def scrape() -> dict:
        asyncio.run(m.refresh())
        return {s.name + "".join(f"{{{v}}}" for v in s.labels.values()): s.value
                for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}

    try:
        first = scrape()
        assert first["flexinfer_num_requests_waiting"] == 2 and first["flexinfer_metrics_stale"] == 0
        second = scrape()
        assert second["flexinfer_num_requests_waiting"] == 2 and second["flexinfer_metrics_stale"] == 1
        assert second["flexinfer_metrics_stats_failures_total{error}"] == 1
    finally:
        m.close()
