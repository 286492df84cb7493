"""Helpers for the server tests: a tiny chat model built on the spot, and a
real `flexinfer serve` process on a free port.

The model: a random 2-layer Llama whose vocabulary is a byte-level BPE
trained here on a few sentences (about 400 tokens, with ChatML's special
tokens and template), so that any text, and any chat, tokenizes inside it.
Built in well under a second: no download, no GGUF conversion.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Write a short story about a robot who learns to paint.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Hello! How are you today? I am fine, thank you. What is 2 + 2? It is 4.",
    "system user assistant: you are a helpful assistant; answer briefly.",
]


def build_tiny_chat_model(folder: Path, seed: int = 0) -> Path:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_CORPUS * 4, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}))
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        bos_token_id=None, eos_token_id=2, initializer_range=0.1, tie_word_embeddings=True)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


# The tiny model's KV row is 512 bytes (2 layers x K,V x 2 heads x 16 x float32): 8 tokens a 4 KiB chunk.
SMALL_CHUNK = 4096
SMALL_POOL_CHUNKS = 16


def small_pool_llm(model: str, prefix_caching: bool = True, **options):
    """An LLM on its own 16-chunk pool of 4 KiB chunks (128 tiny rows); returns (llm, manager): close both."""
    import vtm
    from flexinfer import LLM

    manager = vtm.Manager(backend="host", capacity_bytes=SMALL_POOL_CHUNKS * SMALL_CHUNK, chunk_bytes=SMALL_CHUNK,
                          granularity=SMALL_CHUNK)
    options = {k: v for k, v in options.items() if k != "kv_capacity_bytes"}
    try:
        return LLM(model, manager=manager, enable_prefix_caching=prefix_caching, **options), manager
    except BaseException:
        manager.close()
        raise


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`flexinfer serve` in a subprocess. Invariant: once constructed, the
    process is ended by `stop()` (SIGTERM, then SIGKILL), which every user
    calls in a finally."""

    def __init__(self, model: str, log_path: Path, *extra: str, name: str = "tiny"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        self.log_path = log_path
        argv = ["serve", "--model", model, "--served-model-name", name, "--port", str(self.port),
                "--log-level", "warning", *extra]
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen([sys.executable, "-m", "flexinfer", *argv], stdout=self._log,
                                        stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"the server is not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self, timeout: float = 15.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode


def start_in_thread(app):
    """uvicorn serving `app` on a thread of this process: (server, thread, url)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{server.config.port}"


# The engine every server test compares against, and the flags that make a
# server run that same engine (a 64 MiB pool, torch's linear, one thread);
# on a broker (--manager) the pool is the broker's.
MAX_MODEL_LEN = 1024
BROKER_SERVER_FLAGS = ["--max-model-len", str(MAX_MODEL_LEN), "--linear", "torch", "--threads", "1"]
SERVER_FLAGS = [*BROKER_SERVER_FLAGS, "--kv-capacity-gib", "0.0625"]
ENGINE_OPTIONS = dict(max_model_len=MAX_MODEL_LEN, kv_capacity_bytes=64 << 20, linear="torch", threads=1)


def greedy(max_tokens: int, **kwargs):
    from flexinfer import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> str:
    return str(build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")))


@pytest.fixture(scope="module")
def reference(tiny_chat):
    """The in-process engine a server's answers are compared with."""
    from flexinfer import LLM

    with LLM(tiny_chat, **ENGINE_OPTIONS) as llm:
        yield llm
