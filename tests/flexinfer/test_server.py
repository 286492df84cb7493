"""`flexinfer serve` end to end: a real server process on a tiny random chat
model (server_testing.py), driven by the official `openai` client and by
raw HTTP (httpx), checked against LLM.generate / LLM.chat in this process on
the same weights: greedy outputs token for token, streamed and not, alone
and with 8 concurrent clients; /metrics parsed with prometheus-client's
parser; errors as OpenAI error bodies; a client leaving mid-stream has its
request cancelled and its KV released; SIGTERM lets a stream finish.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("transformers")  # builds the tiny model's weights
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from server_testing import (BROKER_SERVER_FLAGS, ENGINE_OPTIONS, MAX_MODEL_LEN, SERVER_FLAGS,  # noqa: E402
                            ServerProcess, free_port, greedy, start_in_thread)
from server_testing import reference, tiny_chat  # noqa: E402,F401 (fixtures)

from flexinfer import LLM, ModelLoadError  # noqa: E402

PROMPTS = ["The capital of France is", "Write a short story about a robot", "def fibonacci(n):",
           "Hello! How are you today?", "What is 2 + 2?", "The capital of Italy is", "you are a helpful assistant",
           "Paris. Rome. Paris."]


@pytest.fixture(scope="module")
def server(tiny_chat, tmp_path_factory):
    process = ServerProcess(tiny_chat, tmp_path_factory.mktemp("server") / "server.log", *SERVER_FLAGS)
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def metrics(server) -> dict[str, float]:
    """Every sample of /metrics, by name and labels: {"name{k=v}": value}."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def wait_idle(server, timeout: float = 15.0) -> dict[str, float]:
    """/metrics once nothing runs or waits and no vTensor is alive (the KV of every request released)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        vtensors = sum(v for k, v in m.items() if k.startswith("vtm_space_vtensors"))
        if m["flexinfer_num_requests_running"] == 0 and m["flexinfer_num_requests_waiting"] == 0 and vtensors == 0:
            return m
        assert time.monotonic() < deadline, f"still busy after {timeout} s: {m}"
        time.sleep(0.05)


def collect_stream(chunks) -> tuple[dict, dict, dict, object]:
    """Text, token ids and finish reason per choice index, and the usage, from streamed chunks."""
    texts, ids, finish, usage = {}, {}, {}, None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + piece
            ids.setdefault(choice.index, []).extend(getattr(choice, "token_ids", None) or [])
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    return texts, ids, finish, usage


# -- outputs ---------------------------------------------------------------


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    # Fuzzing the API: OpenAI's retrieve-model route was a 404, and a
    # load balancer's HEAD /health a 405.
    assert client.models.retrieve("tiny").id == "tiny"
    missing = httpx.get(f"{server.url}/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{server.url}/v1/models/tiny/").json()["id"] == "tiny"
    assert httpx.get(f"{server.url}/v1/models/").json()["error"]["code"] is None  # a route, not a model
    assert httpx.head(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("path, body", [
    ("completions", {"prompt": "Hi"}),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
])
def test_null_is_the_default_of_an_optional_field(server, path, body):
    """Fuzzing the API: clients that write every field send null for those
    they leave unset, as OpenAI's reference allows (n, stream, logprobs,
    echo): such requests were refused as wrong types."""
    nulls = {"n": None, "stream": None, "logprobs": None, "min_tokens": None, "ignore_eos": None,
             "return_token_ids": None, "temperature": 0.0, "max_tokens": 4, "stream_options": None}
    if path == "completions":
        nulls["echo"] = None
    want = httpx.post(f"{server.url}/v1/{path}", json={**body, "temperature": 0.0, "max_tokens": 4}, timeout=30)
    got = httpx.post(f"{server.url}/v1/{path}", json={**body, **nulls}, timeout=30)
    assert got.status_code == want.status_code == 200, got.text
    assert [c.get("text", c.get("message")) for c in got.json()["choices"]] == \
        [c.get("text", c.get("message")) for c in want.json()["choices"]]
    # Review: a nested field's null too.
    streamed = httpx.post(f"{server.url}/v1/{path}", timeout=30,
                          json={**body, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": None}})
    assert streamed.status_code == 200 and '"usage":{' not in streamed.text, streamed.text


def test_errors_name_the_max_tokens_field_the_request_used(server):
    """Fuzzing the API: a chat request with max_completion_tokens too large
    was told its max_tokens was; one that left it unset was told of a
    max_tokens (1) it never sent."""
    messages = [{"role": "user", "content": "Hi"}]
    response = httpx.post(f"{server.url}/v1/chat/completions",
                          json={"messages": messages, "max_completion_tokens": MAX_MODEL_LEN}, timeout=30)
    assert response.status_code == 400
    assert f"max_completion_tokens ({MAX_MODEL_LEN})" in response.json()["error"]["message"], response.text
    response = httpx.post(f"{server.url}/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "Hi " * 1100}]}, timeout=30)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "one new token exceeds" in message and "max_tokens" not in message, message
    # Review: min_tokens was compared with a "max_tokens" the request did not send.
    response = httpx.post(f"{server.url}/v1/chat/completions",
                          json={"messages": messages, "max_completion_tokens": 3, "min_tokens": 5}, timeout=30)
    assert "min_tokens must be in [0, max_completion_tokens (3)], got 5" in response.json()["error"]["message"]
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": None,
                                                               "min_tokens": 10 * MAX_MODEL_LEN}, timeout=30)
    assert "min_tokens must be in [0, the default max_tokens (" in response.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["text", "token ids"])
def test_completions_equal_generate(client, reference, stream, kind):
    prompts = PROMPTS[:3] if kind == "text" else [reference.tokenizer.encode(p) for p in PROMPTS[3:5]]
    want = reference.generate(prompts, greedy(16), use_tqdm=False)
    request = dict(model="tiny", prompt=prompts, max_tokens=16, temperature=0.0,
                   extra_body={"return_token_ids": True})
    if stream:
        chunks = client.completions.create(stream=True, stream_options={"include_usage": True}, **request)
        texts, ids, finish, usage = collect_stream(chunks)
    else:
        response = client.completions.create(**request)
        texts = {c.index: c.text for c in response.choices}
        ids = {c.index: c.token_ids for c in response.choices}
        finish = {c.index: c.finish_reason for c in response.choices}
        usage = response.usage
        assert response.prompt_token_ids == [w.prompt_token_ids for w in want]
    assert sorted(texts) == list(range(len(prompts)))
    for i, w in enumerate(want):
        assert ids[i] == w.token_ids and texts[i] == w.text and finish[i] == w.finish_reason
    assert usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    assert usage.completion_tokens == sum(len(w.token_ids) for w in want)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_tokens_text_is_not_in_the_output(client, reference, stream):
    """Fuzzing the API: the text of the stop_token_ids token that ended a
    choice was in its text (vLLM's and an end-of-sequence token's is not);
    it stays in token_ids."""
    prompt = reference.tokenizer.encode(PROMPTS[0])
    full = reference.generate([prompt], greedy(16), use_tqdm=False)[0]
    stop = full.token_ids[3]
    want = reference.generate([prompt], greedy(16, stop_token_ids=[stop]), use_tqdm=False)[0]
    assert want.token_ids[-1] == stop and want.finish_reason == "stop"
    request = dict(model="tiny", prompt=prompt, max_tokens=16, temperature=0.0,
                   extra_body={"stop_token_ids": [stop], "return_token_ids": True})
    if stream:
        texts, ids, finish, _ = collect_stream(client.completions.create(stream=True, **request))
        text, ids, finish = texts[0], ids[0], finish[0]
    else:
        choice = client.completions.create(**request).choices[0]
        text, ids, finish = choice.text, choice.token_ids, choice.finish_reason
    shown = reference.tokenizer.decode(want.token_ids[:-1], skip_special_tokens=True)
    assert (text, ids, finish) == (want.text, want.token_ids, "stop")
    assert text == shown != reference.tokenizer.decode(want.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_llm_chat(client, reference, stream):
    messages = [{"role": "system", "content": "you are a helpful assistant"},
                {"role": "user", "content": f"What is 2 + 2? ({'streamed' if stream else 'whole'})"}]
    want = reference.chat(messages, greedy(20))
    request = dict(model="tiny", messages=messages, max_completion_tokens=20, temperature=0.0,
                   extra_body={"return_token_ids": True})
    if stream:
        texts, ids, finish, usage = collect_stream(
            client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **request))
        text, token_ids, finish_reason = texts[0], ids[0], finish[0]
    else:
        response = client.chat.completions.create(**request)
        choice = response.choices[0]
        text, token_ids, finish_reason, usage = choice.message.content, choice.token_ids, choice.finish_reason, \
            response.usage
        assert choice.message.role == "assistant" and response.prompt_token_ids == want.prompt_token_ids
    assert token_ids == want.token_ids and text == want.text and finish_reason == want.finish_reason
    assert usage.prompt_tokens == len(want.prompt_token_ids) and usage.completion_tokens == len(want.token_ids)


def test_chat_content_parts_n_stop_and_extras(client, reference):
    """Text content parts read as one string; n samples; a stop string cuts the text; vLLM's extras reach the engine."""
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 2?"}]
    want = reference.chat([{"role": "user", "content": "What is 2 + 2?"}], greedy(12, ignore_eos=True, min_tokens=12))
    response = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}],
                                              max_tokens=12, temperature=0.0, n=2,
                                              extra_body={"ignore_eos": True, "min_tokens": 12, "top_k": -1})
    assert [c.index for c in response.choices] == [0, 1]
    assert all(c.message.content == want.text and c.finish_reason == "length" for c in response.choices)
    # A stop string taken from the greedy text: the reply ends right before it.
    stop = want.text[4:7]
    assert stop and want.text.find(stop) >= 0
    cut = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What is 2 + 2?"}],
                                         max_tokens=12, temperature=0.0, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].message.content == want.text[:want.text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    # Seeded sampling is reproducible through the server.
    seeded = [client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=1.0, seed=7,
                                        top_p=0.9, extra_body={"top_k": 50}).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_eight_concurrent_streaming_clients_equal_sequential_runs(server, reference):
    tokens = 200  # long enough for the eight streams to overlap
    want = [reference.generate([p], greedy(tokens, ignore_eos=True), use_tqdm=False)[0] for p in PROMPTS]

    def stream_one(prompt: str):
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=tokens, temperature=0.0,
                                           stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
        first = next(iter(chunks))
        started = time.monotonic()
        texts, ids, finish, _ = collect_stream([first, *chunks])
        return (texts[0], ids[0], finish[0]), started, time.monotonic()

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(stream_one, PROMPTS))
    assert [(w.text, w.token_ids, "length") for w in want] == [r[0] for r in results]
    # Every stream had begun before any ended: all eight ran at once.
    assert max(r[1] for r in results) < min(r[2] for r in results)
    wait_idle(server)


def test_second_chat_turn_is_served_from_the_prefix_cache(client):
    history = [{"role": "system", "content": "you are a helpful assistant; answer briefly."},
               {"role": "user", "content": "Write a short story about a robot who learns to paint."}]
    first = client.chat.completions.create(model="tiny", messages=history, max_tokens=8, temperature=0.0)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And what is 2 + 2?"}]
    second = client.chat.completions.create(model="tiny", messages=history, max_tokens=8, temperature=0.0)
    # The first turn may share the template's opening with earlier requests, not more.
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens // 2
    # The second: at least the whole first prompt (the reply's text may tokenize differently from the ids generated).
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens


def test_null_max_tokens_means_up_to_the_context_length(server):
    out = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": "Hi", "max_tokens": None, "temperature": 0.0, "ignore_eos": True}).json()
    assert out["usage"]["total_tokens"] == MAX_MODEL_LEN and out["choices"][0]["finish_reason"] == "length"


# -- metrics -----------------------------------------------------------------


def test_metrics(server, client):
    before = metrics(server)
    client.completions.create(model="tiny", prompt="Hello! How are you?", max_tokens=5, temperature=0.0,
                              extra_body={"ignore_eos": True})
    client.completions.create(model="tiny", prompt="Hello! How are you?", max_tokens=5, temperature=0.0,
                              extra_body={"ignore_eos": True})
    after = wait_idle(server)
    text = httpx.get(f"{server.url}/metrics").text
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    for name, kind in [("flexinfer_num_requests_running", "gauge"), ("flexinfer_num_requests_waiting", "gauge"),
                       ("flexinfer_kv_cache_usage_ratio", "gauge"), ("flexinfer_prefix_cache_queries", "counter"),
                       ("flexinfer_prefix_cache_hits", "counter"), ("flexinfer_num_preemptions", "counter"),
                       ("flexinfer_time_to_first_token_seconds", "histogram"),
                       ("flexinfer_inter_token_latency_seconds", "histogram"),
                       ("flexinfer_e2e_request_latency_seconds", "histogram"), ("vtm_chunks_held", "gauge"),
                       ("vtm_capacity_bytes", "gauge"), ("vtm_chunk_bytes", "gauge"), ("vtm_evictions", "counter"),
                       ("vtm_space_vtensors", "gauge")]:
        assert families.get(name) == kind, name

    def delta(name):
        return after[name] - before.get(name, 0.0)

    assert delta("flexinfer_time_to_first_token_seconds_count") == 2
    assert delta("flexinfer_e2e_request_latency_seconds_count") == 2
    assert delta("flexinfer_inter_token_latency_seconds_count") == 2 * 4
    assert delta("flexinfer_generation_tokens_total") == 10
    assert delta("flexinfer_requests_total{finish_reason=length}") == 2
    # The second request found the first one's prompt in the prefix cache.
    assert delta("flexinfer_prefix_cache_hits_total{tier=device}") > 0
    assert after["flexinfer_prefix_cache_hits_total{tier=host}"] == 0  # no host tier here
    assert after["flexinfer_prefix_cache_hits_total{tier=device}"] <= after["flexinfer_prefix_cache_queries_total"]
    assert after["flexinfer_kv_cache_usage_ratio"] == 0  # nothing runs
    assert after["vtm_capacity_bytes"] == 64 << 20 and after["vtm_chunks_held"] > 0  # the prefix tree's


def test_metrics_survive_a_failing_stats_source():
    """A broker gone away makes stats() raise: a scrape still gives the server's own metrics."""
    import asyncio

    import vtm
    from flexinfer.server.metrics import ServerMetrics

    def stats():
        raise vtm.Unavailable("the broker is gone")

    m = ServerMetrics(stats)
    try:
        asyncio.run(m.refresh())
        names = {f.name for f in text_string_to_metric_families(m.render().decode())}
    finally:
        m.close()
    assert "flexinfer_time_to_first_token_seconds" in names and "flexinfer_num_requests_running" not in names


# -- errors ------------------------------------------------------------------


@pytest.mark.parametrize("path, body, status, param, code", [
    ("completions", {"prompt": "Hi", "temperature": "hot"}, 400, "temperature", None),
    ("completions", {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens", None),
    ("completions", {"prompt": "Hi", "n": True}, 400, "n", None),
    ("completions", {"prompt": "Hi", "n": 129}, 400, "n", None),
    ("completions", {"prompt": "Hi", "top_p": 2}, 400, "top_p", None),
    ("completions", {"prompt": "Hi", "top_k": -2}, 400, "top_k", None),
    ("completions", {"prompt": "Hi", "top_k": 10**30}, 400, "top_k", None),
    ("completions", {"prompt": "Hi", "stop_token_ids": [1] * 1025}, 400, "stop_token_ids", None),
    ("completions", {"prompt": [1.5, 2]}, 400, "prompt", None),
    ("completions", {"prompt": []}, 400, "prompt", None),
    ("completions", {"prompt": [100000]}, 400, "prompt", None),
    ("completions", {"max_tokens": 4}, 400, "prompt", None),
    ("completions", {"prompt": "Hi", "logprobs": 1}, 400, "logprobs", None),
    # Both endpoints, as docs/server.md says: completions ignored it (a new user's walkthrough).
    ("completions", {"prompt": "Hi", "response_format": {"type": "json_object"}}, 400, "response_format", None),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                          "response_format": {"type": "json_object"}}, 400, "response_format", None),
    ("completions", {"prompt": "Hi", "stream_options": {"include_usage": "yes"}}, 400, "stream_options", None),
    ("completions", {"prompt": "Hi", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("completions", {"prompt": "Hi " * 1100}, 400, "prompt", "context_length_exceeded"),
    ("completions", {"prompt": "Hi", "max_tokens": MAX_MODEL_LEN}, 400, "prompt", "context_length_exceeded"),
    ("chat/completions", {"messages": []}, 400, "messages", None),
    ("chat/completions", {"messages": [{"role": "user"}]}, 400, None, None),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages", None),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi " * 1100}]}, 400, "messages",
     "context_length_exceeded"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function"}]}, 400,
     "tools", None),
    # Fuzzing the API: a forced function call, with tools or the older functions, was answered with text.
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tool_choice": "required"}, 400,
     "tool_choice", None),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "functions": [{"name": "f"}],
                          "function_call": {"name": "f"}}, 400, "functions", None),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "function_call": {"name": "f"}}, 400,
     "function_call", None),
    # ... stream_options without stream was ignored (OpenAI and vLLM refuse it);
    ("completions", {"prompt": "Hi", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    # ... a stop string no text can hold (a lone surrogate) was accepted (such a prompt is a 400).
    ("completions", {"prompt": "Hi", "stop": ["\ud800"]}, 400, "stop", None),
    ("completions", {"prompt": "\ud800"}, 400, "prompt", None),
])
def test_bad_requests_get_openai_error_bodies(server, path, body, status, param, code):
    response = httpx.post(f"{server.url}/v1/{path}", content=json.dumps(body), timeout=30,  # ASCII: surrogates escaped
                          headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if param is not None:
        assert error["param"] == param, error
    assert error["code"] == code


_PROMPT_TYPES = "prompt: expected a string, a list of strings, a list of integers or a list of lists of integers"
_TEXT_PARTS = 'a list of text parts ({"type": "text", "text": ...})'


@pytest.mark.parametrize("path, body, param, message", [
    ("completions", {"prompt": 5}, "prompt", _PROMPT_TYPES),
    ("completions", {"prompt": [1.5]}, "prompt", _PROMPT_TYPES),
    # Where one alternative goes further than the others, its own complaint follows.
    ("completions", {"prompt": [[1, "a"]]}, "prompt", f"{_PROMPT_TYPES}; prompt.0.1: Input should be a valid integer"),
    ("completions", {"prompt": "Hi", "stop": 5}, "stop", "stop: expected a string or a list of strings"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages",
     f"messages.0.content: expected a string or {_TEXT_PARTS}"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages",
     f"messages.0.content: expected a string or {_TEXT_PARTS}; messages.0.content.0.type: Input should be 'text', "
     "messages.0.content.0.text: Field required"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tool_choice": 5}, "tool_choice",
     "tool_choice: expected a string or an object"),
    ("completions", {"prompt": "Hi", "stream_options": 5}, "stream_options", "stream_options: expected an object"),
])
def test_a_field_of_several_types_is_named_with_what_it_accepts(server, path, body, param, message):
    """pydantic reports a union field once per alternative, by its internal
    names: "prompt.list[list[int]].0.1: ...; prompt.str: ...",
    "content.list[TextPart].0.type", "instance of StreamOptions". The 400
    now names the field and what it accepts, as the API documents it."""
    response = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error == {"message": message, "type": "invalid_request_error", "param": param, "code": None}, error


@pytest.mark.parametrize("path, body", [
    ("completions", {"prompt": "Hi"}),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
])
def test_a_model_name_no_text_can_hold_is_a_404_not_a_500(server, path, body):
    """Fuzzing the API: a lone surrogate in `model` (valid JSON, not UTF-8)
    made the 404 that quotes the name fail to render: a 500 instead."""
    response = httpx.post(f"{server.url}/v1/{path}", content=json.dumps({**body, "model": "gpt-\ud800"}),
                          timeout=30, headers={"content-type": "application/json"})  # ASCII: the surrogate escaped
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "`gpt-\\ud800`" in error["message"], error
    wait_idle(server)


def test_malformed_bodies_and_routes(server, client):
    response = httpx.post(f"{server.url}/v1/completions", content=b"{not json", timeout=10,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    response = httpx.get(f"{server.url}/v1/nothing-here", timeout=10)
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=MAX_MODEL_LEN)
    assert info.value.code == "context_length_exceeded"
    # None of it touched the engine, which serves the next request.
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0.0).choices[0].text \
        is not None
    wait_idle(server)



def test_stop_token_id_problems_name_stop_token_ids(server, reference):
    """An id outside the vocabulary, or ids (with end-of-sequence) that leave no token to sample before
    min_tokens: a 400 naming stop_token_ids, for either endpoint."""
    vocab = reference.config.vocab_size
    for ids, expected in (([vocab], "outside the vocabulary"), (list(range(vocab)), "leave no token")):
        for path, prompt in (("completions", {"prompt": "Hi"}),
                             ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
            response = httpx.post(f"{server.url}/v1/{path}", timeout=30, json={
                **prompt, "max_tokens": 4, "min_tokens": 2, "stop_token_ids": ids})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "stop_token_ids" and expected in error["message"], error
    wait_idle(server)


@pytest.mark.parametrize("path, body, param, message", [
    ("chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must be >= 1"),
    ("chat/completions", {"max_completion_tokens": 0, "max_tokens": 5}, "max_completion_tokens",
     "max_completion_tokens must be >= 1"),
    ("chat/completions", {"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1"),
    ("completions", {"stop": ""}, "stop", "stop must be a non-empty str or a list of non-empty str, got ''"),
    ("chat/completions", {"stop": ""}, "stop", "stop must be a non-empty str or a list of non-empty str, got ''"),
    ("completions", {"stop": ["", "x"]}, "stop",
     "stop must be a non-empty str or a list of non-empty str, got ['', 'x']"),
])
def test_errors_name_the_field_the_client_sent(server, path, body, param, message):
    """max_completion_tokens 0 was reported as max_tokens; stop "" was taken for no stop at all while
    ["", "x"] was refused."""
    prompt = {"prompt": "Hi"} if path == "completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    response = httpx.post(f"{server.url}/v1/{path}", json={**prompt, **body}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(message), error


def test_a_stop_string_before_min_tokens_is_kept_streamed_or_not(server, reference):
    """Streamed and whole responses give the text LLM.generate gives: a stop string that ends before
    the min_tokens-th token's text does not cut it."""
    prompt = "The capital of France is"
    plain = reference.generate([prompt], greedy(30, ignore_eos=True), use_tqdm=False)[0]
    stop = reference.tokenizer.decode(plain.token_ids[:3])[-2:]
    params = greedy(30, ignore_eos=True, stop=[stop], min_tokens=10)
    want = reference.generate([prompt], params, use_tqdm=False)[0]
    assert len(want.text) > len(reference.tokenizer.decode(plain.token_ids[:3]))
    body = {"prompt": prompt, "max_tokens": 30, "temperature": 0.0, "ignore_eos": True, "stop": [stop],
            "min_tokens": 10}
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert (whole["text"], whole["finish_reason"]) == (want.text, want.finish_reason)
    text, finish = "", None
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    assert (text, finish) == (want.text, want.finish_reason)


@pytest.mark.parametrize("path, field, depth", [
    ("completions", "x", 1000), ("completions", "x", 100_000), ("completions", "prompt", 100_000),
    ("completions", "prompt", 900), ("chat/completions", "messages", 100_000),
    ("chat/completions", "messages", 900)])
def test_deeply_nested_bodies_are_400(server, path, field, depth):
    """JSON nested deeper than the parser recurses raised RecursionError, answered 500 (even in a
    field the server ignores); nested just less deep, it is a field of the wrong type."""
    body = b'{"prompt": "Hi", "messages": [], "' + field.encode() + b'": ' + b"[" * depth + b"]" * depth + b"}"
    response = httpx.post(f"{server.url}/v1/{path}", content=body, timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"

# -- cancellation and shutdown -----------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_client_leaving_cancels_its_request_and_releases_its_kv(server, stream):
    before = metrics(server)
    # Four samples of 1000 tokens: over a second on the tiny model, several times the 0.3 s a client waits.
    body = {"prompt": "Write a short story", "max_tokens": 1000, "temperature": 0.0, "ignore_eos": True, "n": 4,
            "stream": stream}
    with httpx.Client(timeout=30) as http:
        if stream:
            with http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                        break  # tokens are flowing: hang up
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post(f"{server.url}/v1/completions", json=body, timeout=0.3)
    after = wait_idle(server)
    assert after["flexinfer_requests_total{finish_reason=abort}"] - before.get(
        "flexinfer_requests_total{finish_reason=abort}", 0) == 4
    assert after["flexinfer_generation_tokens_total"] - before["flexinfer_generation_tokens_total"] < 4 * 1000


@pytest.mark.parametrize("grace", ["long", "short"])
def test_sigterm_lets_a_stream_finish_or_aborts_it_then_exits_0(tiny_chat, tmp_path, grace):
    """SIGTERM: the stream in flight finishes within --shutdown-timeout, or is
    aborted when that runs out (it ends with finish_reason "abort" and
    [DONE], not cut); either way the process exits with 0."""
    timeout = "30" if grace == "long" else "0.2"
    tokens = 120 if grace == "long" else 1000
    process = ServerProcess(tiny_chat, tmp_path / "server.log", *SERVER_FLAGS, "--shutdown-timeout", timeout)
    try:
        process.wait_ready()
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{process.url}/v1/completions", json={
                    "prompt": "Hello", "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True,
                    "stream": True, "return_token_ids": True}) as response:
                lines = response.iter_lines()
                received = len(json.loads(next(line for line in lines if line.startswith("data: "))[6:])
                               ["choices"][0]["token_ids"])
                process.process.send_signal(signal.SIGTERM)
                done, finish_reason = False, None
                for line in lines:
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        choice = json.loads(line[6:])["choices"][0]
                        received += len(choice["token_ids"])
                        finish_reason = choice["finish_reason"] or finish_reason
        assert done
        if grace == "long":
            assert received == tokens and finish_reason == "length"
        else:
            assert received < tokens and finish_reason == "abort"
        # New connections are refused (or told 503) while it shuts down.
        try:
            assert httpx.get(f"{process.url}/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass
        assert process.process.wait(20) == 0, process.log()
    finally:
        process.stop()


def test_ctrl_c_stops_the_server_gracefully_with_status_130(tiny_chat, tmp_path):
    """Ctrl-C shuts down as SIGTERM does, and the status says it was
    interrupted, as every flexinfer and vtm command's (it was 0)."""
    process = ServerProcess(tiny_chat, tmp_path / "server.log", *SERVER_FLAGS)
    try:
        process.wait_ready()
        process.process.send_signal(signal.SIGINT)
        assert process.process.wait(30) == 130, process.log()
        assert "Traceback" not in process.log()
    finally:
        process.stop()


# `flexinfer serve` whose load takes a second a tensor (a tiny model then loads for ~20 s):
# long enough that a stop which waits for the whole load cannot pass for one that stops it.
_SLOW_LOAD = ("import sys, time\n"
              "from flexinfer.model import loader\n"
              "check_stop = loader.check_stop\n"
              "loader.check_stop = lambda stop, source: (time.sleep(1.0), check_stop(stop, source))\n"
              "from flexinfer.cli import run\n"
              "sys.exit(run())\n")


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_a_signal_while_the_model_loads_stops_the_load(tiny_chat, tmp_path, sig, status):
    """SIGTERM or Ctrl-C while serve loads the model: it waited for the whole
    load before it stopped (~4 s for SmolLM2; here ~20 s). Now the load ends
    at its next tensor, and serve exits with its usual status for the
    signal, not as a model that failed to load."""
    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        child = subprocess.Popen([sys.executable, "-c", _SLOW_LOAD, "serve", "--model", tiny_chat, "--port", str(port),
                                  "--log-level", "warning", *SERVER_FLAGS], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:  # up and loading: /health says 503
            assert time.monotonic() < deadline and child.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 503:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        _stops_promptly(child, sig, status, log_path)
    finally:
        child.kill()
        child.wait()


def _stops_promptly(child: subprocess.Popen, sig: int, status: int, log_path: Path) -> None:
    """`sig` to a serve child ends it within 8 s, with `status`, and no
    traceback or load failure in its log."""
    signalled = time.monotonic()
    child.send_signal(sig)
    assert child.wait(60) == status, log_path.read_text()
    assert time.monotonic() - signalled < 8, log_path.read_text()
    text = log_path.read_text()
    assert "Traceback" not in text and "failed to load" not in text, text


# `flexinfer serve` that waits two minutes, not 10 s, for a --manager broker that is not there:
# a stop that waits out the wait cannot pass for one that ends it.
_LONG_BROKER_WAIT = ("import sys\n"
                     "from flexinfer import cli\n"
                     "cli.BROKER_START_WAIT_S = 120.0\n"
                     "sys.exit(cli.run())\n")


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_a_signal_while_serve_waits_for_its_broker_ends_the_wait(tiny_chat, tmp_path, sig, status):
    """SIGTERM or Ctrl-C while serve --manager waits for a broker whose
    socket is not there yet: the shutdown waited for vtm.connect's whole
    wait (10 s), and serve then said the model failed to load. Now the wait
    ends at once, and serve exits with its usual status for the signal."""
    address = f"unix:{tmp_path / 'run' / 'sock'}"
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        child = subprocess.Popen([sys.executable, "-c", _LONG_BROKER_WAIT, "serve", "--model", tiny_chat,
                                  "--port", str(free_port()), "--log-level", "warning", "--manager", address,
                                  *BROKER_SERVER_FLAGS], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while f"waiting up to 120 s for the vtm broker at {address}" not in log_path.read_text():
            assert time.monotonic() < deadline and child.poll() is None, log_path.read_text()
            time.sleep(0.1)
        _stops_promptly(child, sig, status, log_path)
    finally:
        child.kill()
        child.wait()


def test_bench_serving_load_against_the_server(server, monkeypatch):
    """scripts/bench_serving.py's multi-turn load, small, against this server: every turn answered with
    exactly max_tokens tokens, and turns >= 2 served mostly from the prefix cache."""
    import argparse
    import asyncio
    import importlib.util
    from pathlib import Path

    scripts = Path(__file__).resolve().parents[2] / "scripts"
    monkeypatch.syspath_prepend(str(scripts))  # its sibling modules (machine.py)
    spec = importlib.util.spec_from_file_location("bench_serving", scripts / "bench_serving.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_serving", bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    args = argparse.Namespace(users=3, turns=3, rate=0.0, think_s=0.0, max_tokens=6, first_words=60, words=10,
                              seed=1, request_timeout=60.0)
    run = asyncio.run(bench.run_load(server.url, "tiny", args))
    summary = bench.summarize(run)
    assert summary["requests"] == 9 and summary["errors"] == 0, summary["first_error"]
    assert all(t["output_tokens"] == 6 for t in run["turns"])
    assert all(t["ttft_s"] > 0 and t["e2e_s"] >= t["ttft_s"] for t in run["turns"])
    assert summary["prefix_hit_rate_later"] > 0.5 and summary["ttft_later_p50_s"] is not None


def test_serving_on_a_vtm_broker(tiny_chat, tmp_path, reference):
    """--manager unix:PATH: the KV lives in the broker's pool, outputs are the same, and /metrics shows the pool."""
    from broker_testing import BrokerProcess

    broker = BrokerProcess(tmp_path, capacity_chunks=2048, chunk_bytes=4096)
    process = None
    try:
        process = ServerProcess(tiny_chat, tmp_path / "server.log", *BROKER_SERVER_FLAGS, "--manager",
                                broker.address)
        process.wait_ready()
        client = openai.OpenAI(base_url=f"{process.url}/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0.0)
        assert out.choices[0].text == reference.generate([PROMPTS[0]], greedy(12), use_tqdm=False)[0].text
        m = wait_idle(process)
        assert m["vtm_capacity_bytes"] == broker.capacity_bytes and m["vtm_chunk_bytes"] == 4096
        assert m["vtm_chunks_held"] > 0  # the prompt the prefix tree keeps
    finally:
        if process is not None:
            assert process.stop() == 0, process.log()
        broker.kill()


# -- lifetime, in this process --------------------------------------------------


def test_503_while_loading_then_serves(tiny_chat):
    from flexinfer.server.app import create_app

    release = threading.Event()
    loaded: list[LLM] = []

    def load() -> LLM:
        release.wait(30)
        loaded.append(LLM(tiny_chat, **ENGINE_OPTIONS))
        return loaded[0]

    server, thread, url = start_in_thread(create_app(load, "tiny"))
    try:
        for response in (httpx.get(f"{url}/health"), httpx.get(f"{url}/v1/models"),
                         httpx.post(f"{url}/v1/completions", json={"prompt": "Hi"})):
            assert response.status_code == 503
            assert "loading" in response.json()["error"]["message"]
        assert httpx.get(f"{url}/metrics").status_code == 200  # the server's own metrics, no engine yet
        release.set()
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        out = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=30).json()
        assert out["usage"]["completion_tokens"] >= 1
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)
    # Shutting down closed the LLM: its engine takes nothing more.
    assert not thread.is_alive() and not loaded[0]._loop._thread.is_alive()


def test_a_model_that_fails_to_load_is_reported(tmp_path):
    from flexinfer.server.app import create_app

    told: list[BaseException] = []

    def load() -> LLM:
        return LLM(str(tmp_path / "missing"))

    server, thread, url = start_in_thread(create_app(load, "tiny", told.append))
    try:
        deadline = time.monotonic() + 10
        while not told:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert isinstance(told[0], ModelLoadError)
        response = httpx.get(f"{url}/health")
        assert response.status_code == 503 and "failed to load" in response.json()["error"]["message"]
    finally:
        server.should_exit = True
        thread.join(30)


def test_serve_on_a_port_in_use_is_one_line_and_status_2(tiny_chat, capsys):
    from flexinfer.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["serve", "--model", tiny_chat, "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err == (f"flexinfer: error: cannot listen on 127.0.0.1:{port}: Address already in use (another server "
                   f"has it: --port 0 picks a free one)\n")


def test_serve_a_model_that_fails_to_load_is_status_2(tmp_path, capsys):
    """A file whose header cannot be read is refused before the port is
    bound, in one line (its config is read first, for the KV pool's
    checks); one whose weights fail to load stops the server."""
    import numpy as np
    from gguf_testing import write_tiny_llama

    from flexinfer.cli import main

    (tmp_path / "broken.gguf").write_bytes(b"not a GGUF file")
    assert main(["serve", "--model", str(tmp_path / "broken.gguf"), "--port", "0", "--log-level", "critical"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flexinfer: error: {tmp_path}/broken.gguf: not a readable GGUF file") and err.count("\n") == 1
    weight = np.ones((16, 16), np.float32)
    weight[3, 5] = np.nan
    path = write_tiny_llama(tmp_path / "nan.gguf", tensors={"blk.1.attn_output.weight": weight})
    assert main(["serve", "--model", str(path), "--port", "0", "--log-level", "critical"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("flexinfer: error: the model failed to load: ") and "nan.gguf" in err[-1]


@pytest.mark.parametrize("argv, message", [
    (["--model", "/nonexistent/model.gguf"], "/nonexistent/model.gguf: no such file or folder"),
    (["--kv-capacity-gib", "1", "--manager", "unix:/nonexistent/sock"], "--kv-capacity-gib sizes an in-process pool"),
])
def test_serve_refuses_what_generate_does_before_it_binds(capsys, argv, message):
    """A missing model bound the port and started uvicorn, then was reported twice (its load failed in
    the load thread); as generate does, it is one line and status 2, and nothing listens meanwhile."""
    from flexinfer.cli import main

    assert main(["serve", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flexinfer: error: {message}") and err.count("\n") == 1, err
