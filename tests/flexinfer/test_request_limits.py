"""What one request may ask of the engine (issue 17, findings 6 and 13), checked
where LLM.generate and the server both meet it: SamplingParams (stop strings
bounded, seeds in torch's range), the stop-string scan (each step looks only
where a stop string can end, in the engine and in the server's streamed
text), and the KV budget (a request whose KV can never fit in the pool is
refused at submission with its own error, instead of running until memory
runs out and losing its output).
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")  # builds the tiny model's weights

from server_testing import ENGINE_OPTIONS, greedy, small_pool_llm  # noqa: E402
from server_testing import reference, tiny_chat  # noqa: E402,F401 (fixtures)

from flexinfer import SamplingParams, sampling  # noqa: E402
from flexinfer.detokenizer import IncrementalText, final_text  # noqa: E402
from flexinfer.errors import InvalidArgument  # noqa: E402
from flexinfer.inputs import KVBudget  # noqa: E402


# -- SamplingParams ------------------------------------------------------------------


def test_stop_strings_are_bounded():
    SamplingParams(stop=[chr(0x41 + i) * 256 for i in range(16)])  # the limit itself
    for stop in ([f"s{i}" for i in range(17)], ["x" * 257], [f"s{i}" for i in range(20000)]):
        with pytest.raises(InvalidArgument, match="^stop takes at most 16 strings of at most 256 characters"):
            SamplingParams(stop=stop)


def test_seeds_are_in_torchs_range():
    """Sample i is seeded with seed + i: every one must be in [-2**63, 2**64 - 1] (else torch raises a
    ValueError at submission, which the server answered with a 500)."""
    for seed, n in ((-(1 << 63), 1), (-1, 3), ((1 << 64) - 1, 1), ((1 << 64) - 3, 3)):
        SamplingParams(seed=seed, n=n)
    for seed, n in ((-(1 << 63) - 1, 1), (1 << 64, 1), ((1 << 64) - 2, 3)):
        with pytest.raises(InvalidArgument, match="^seed must be in"):
            SamplingParams(seed=seed, n=n)


def test_an_extreme_seed_samples(reference):
    out = reference.generate(["Hello"], SamplingParams(max_tokens=4, seed=(1 << 64) - 2, n=2), use_tqdm=False)[0]
    assert out.outputs[0].error is None and len(out.outputs) == 2


# -- stop strings ----------------------------------------------------------------------


def test_stop_strings_are_scanned_incrementally(reference):
    """The engine keeps only the end of the output a stop string may still complete (longest - 1
    characters), so each step scans a window of constant size; a stop string spanning many tokens is
    still found, at the same token as a whole-text search would find it."""
    plain = reference.generate(["Hello"], greedy(120, ignore_eos=True), use_tqdm=False)[0]
    text = plain.text
    assert len(text) > 100
    # A stop string spanning several tokens, whose first occurrence is far from the start.
    stop = next(text[p:p + 12] for p in range(50, len(text) - 12) if text.find(text[p:p + 12]) == p)
    longest = "z" * 40
    seqs = []
    engine = reference.engine
    original = engine._stop_reason

    def watch(seq, token):
        reason = original(seq, token)
        seqs.append(len(seq.text))
        return reason

    engine._stop_reason = watch
    try:
        out = reference.generate(["Hello"], greedy(120, ignore_eos=True, stop=[longest, stop]), use_tqdm=False)[0]
    finally:
        engine._stop_reason = original
    assert text.find(stop) > len(longest)  # so that keeping the whole output would show
    assert out.finish_reason == "stop" and out.text == text[:text.find(stop)]
    assert seqs and max(seqs) <= len(longest) - 1, seqs  # never the whole output


def test_incremental_text_holds_back_and_cuts_like_the_whole_text():
    """The server's streamed text (IncrementalText, now incremental too) equals final_text at every
    split of the output, with stop strings that straddle pushes or overlap each other."""
    class Chars:  # a tokenizer whose tokens are characters
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

        def decode_incremental(self, ids, prefix_offset, read_offset, skip_special_tokens=True):
            return "".join(map(chr, ids[read_offset:])), read_offset, len(ids)

    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 40)))
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(0, 3))]
        ids = [ord(c) for c in text]
        inc, sent, i = IncrementalText(Chars(), stops), "", 0
        while i < len(ids):
            step = rng.randint(1, 4)
            piece = inc.push(ids[i:i + step])
            sent += piece
            i += step
            assert final_text(Chars(), ids[:i], stops).startswith(sent)  # nothing sent is taken back
        sent += inc.finish()
        assert sent == final_text(Chars(), ids, stops), (text, stops)



def test_incremental_text_with_min_tokens_counts_stop_strings_from_that_token_on():
    """Stop strings count only where they end in the text of the min_tokens-th token or a later one
    (the engine looks for none before it): streamed pieces still add up to final_text, at every split."""
    class Chars:  # a tokenizer whose tokens are characters
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

        def decode_incremental(self, ids, prefix_offset, read_offset, skip_special_tokens=True):
            return "".join(map(chr, ids[read_offset:])), read_offset, len(ids)

    ids = [ord(c) for c in "abXab Xab"]
    assert final_text(Chars(), ids, ["ab"], min_tokens=0) == ""
    assert final_text(Chars(), ids, ["ab"], min_tokens=2) == ""  # "ab" ends in token 2
    assert final_text(Chars(), ids, ["ab"], min_tokens=3) == "abX"
    assert final_text(Chars(), ids, ["X"], min_tokens=4) == "abXab "  # the first "X" ends in token 3
    assert final_text(Chars(), ids, ["b X"], min_tokens=6) == "abXa"  # begins before, ends after
    rng = random.Random(1)
    for _ in range(300):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 40)))
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(0, 3))]
        min_tokens = rng.randint(0, 20)
        ids = [ord(c) for c in text]
        inc, sent, i = IncrementalText(Chars(), stops, min_tokens=min_tokens), "", 0
        while i < len(ids):
            step = rng.randint(1, 4)
            sent += inc.push(ids[i:i + step])
            i += step
            assert final_text(Chars(), ids[:i], stops, min_tokens=min_tokens).startswith(sent)
        sent += inc.finish()
        assert sent == final_text(Chars(), ids, stops, min_tokens=min_tokens), (text, stops, min_tokens)


def test_a_stop_string_before_min_tokens_keeps_its_text(reference):
    """The engine does not look for stop strings before min_tokens, so the text they are found in is
    the output's: it was cut at the first stop string anywhere, leaving '' with finish_reason stop."""
    prompt, min_tokens = "The capital of France is", 10
    plain = reference.generate([prompt], greedy(30, ignore_eos=True), use_tqdm=False)[0]
    tokenizer, ids = reference.tokenizer, plain.token_ids
    stop = tokenizer.decode(ids[:3])[-2:]
    before = len(tokenizer.decode(ids[:min_tokens - 1]))
    assert 0 <= plain.text.find(stop) < before - len(stop)  # a stop string long before min_tokens
    cut = plain.text.find(stop, before - len(stop) + 1)
    out = reference.generate([prompt], greedy(30, ignore_eos=True, stop=[stop], min_tokens=min_tokens),
                             use_tqdm=False)[0]
    assert out.text == (plain.text if cut < 0 else plain.text[:cut])
    assert out.finish_reason == ("length" if cut < 0 else "stop")
    assert len(out.token_ids) >= min_tokens and out.token_ids == ids[:len(out.token_ids)]
    streamed = IncrementalText(tokenizer, [stop], min_tokens=min_tokens)
    pieces = [streamed.push([t]) for t in out.token_ids]
    assert "".join(pieces) + streamed.finish() == out.text

# -- the KV budget -------------------------------------------------------------------


def test_kv_budget_arithmetic():
    """8 tokens a chunk, 16 chunks: the KV of prompt + max_tokens - 1 tokens, whole chunks per layer group,
    plus one chunk per group for the prefix tree's copy of a prompt that ends inside a page."""
    one = KVBudget((512,), 4096, 16, prefix_caching=True)
    assert one.max_tokens == 128
    assert one.chunks_needed(15, 106) == 16 and one.chunks_needed(15, 107) == 17
    assert one.max_new_tokens(15) == 106 and one.max_new_tokens(16) == 113  # a whole-page prompt: no copy
    assert KVBudget((512,), 4096, 16, prefix_caching=False).max_new_tokens(15) == 114
    assert one.max_new_tokens(200) == 0
    groups = KVBudget((300, 212), 4096, 16, prefix_caching=True)  # rows straddle pages in both groups
    assert groups.chunks_needed(15, groups.max_new_tokens(15)) <= 16 < groups.chunks_needed(
        15, groups.max_new_tokens(15) + 1)
    assert KVBudget((512,), 4096, 0, prefix_caching=True).max_tokens == 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_generate_refuses_what_can_never_fit_and_runs_what_just_fits(tiny_chat, prefix_caching):
    """16 chunks of 8 tokens. A 15-token prompt can have 106 new tokens (120 of KV: its last, partial page
    is copied into the prefix tree) or 114 without prefix caching (128 of KV); one more is refused at
    submission, with its own error, while the request beside it runs."""
    llm, manager = small_pool_llm(tiny_chat, prefix_caching, **ENGINE_OPTIONS)
    try:
        prompt = llm.tokenizer.encode("Hello! How are you today? I am fine, thank you.")
        assert len(prompt) == 15
        fits = 106 if prefix_caching else 114
        outs = llm.generate([prompt, prompt], [greedy(fits + 1, ignore_eos=True), greedy(fits, ignore_eos=True)],
                            use_tqdm=False)
        too_big, just_fits = outs
        assert isinstance(too_big.outputs[0].error, InvalidArgument)
        assert "can never fit in the KV pool" in str(too_big.outputs[0].error)
        assert too_big.token_ids == [] and too_big.outputs[0].finish_reason == "error"
        assert just_fits.outputs[0].error is None and len(just_fits.token_ids) == fits
        assert just_fits.outputs[0].finish_reason == "length"
        assert llm.kv_budget.max_new_tokens(len(prompt)) == fits
        manager.check()
        assert manager.stats()["chunks_mapped"] - manager.stats()["chunks_cached"] == 0
    finally:
        llm.close()
        manager.close()


# -- one request's sampling parameters and its batch ------------------------------------


def test_a_rows_sampling_parameters_never_fail_its_batch_mates(tiny_chat):
    """On the device sampling path (a CUDA engine's, forced here on a CPU), a batch's parameters are
    gathered into tensors once per batch: a top_k torch cannot hold (set after SamplingParams checked
    it) failed that step, so every request in it got an error. Both now complete. LLM's calls check
    the parameters again since, so this one reaches the engine below them."""
    from flexinfer import LLM

    with LLM(tiny_chat, **ENGINE_OPTIONS) as llm:
        llm.engine.sampling_device = torch.device("cpu")
        wide = SamplingParams(max_tokens=6, temperature=1.0, top_k=5, ignore_eos=True, seed=1)
        wide.top_k = 10**30
        innocent = SamplingParams(max_tokens=12, temperature=0.7, ignore_eos=True, seed=2)
        with llm._loop.together():  # one batch, as generate submits it
            handles = [llm._loop.submit(text, llm.tokenizer.encode(text), params)
                       for text, params in (("Hi", wide), ("The capital of France is", innocent))]
        outs = [handle.result() for handle in handles]
    assert [o.outputs[0].error for o in outs] == [None, None]
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 12]


# -- stop token ids ----------------------------------------------------------------------


def test_stop_token_ids_are_bounded_and_deduplicated():
    """Every step before min_tokens bans a sequence's stop ids: their number bounds that work."""
    limit = sampling.MAX_STOP_TOKEN_IDS
    assert SamplingParams(stop_token_ids=list(range(limit))).stop_token_ids == list(range(limit))
    assert SamplingParams(stop_token_ids=[5, 3, 5, 3, 7]).stop_token_ids == [5, 3, 7]
    for ids in ([0] * (limit + 1), list(range(250_000))):
        with pytest.raises(InvalidArgument, match=f"^stop_token_ids takes at most {limit} ids, got {len(ids)}"):
            SamplingParams(stop_token_ids=ids)


def test_a_sequences_banned_ids_are_built_once(reference, monkeypatch):
    """Before min_tokens the sampler is given the sequence's stop ids (EOS included) to ban: one list,
    built when the sequence is, not sorted again at every step."""
    from flexinfer import engine as engine_module

    given = []
    real_sample = engine_module.sample

    def recording_sample(logits, params, generators, banned=None):
        given.append(banned)
        return real_sample(logits, params, generators, banned)

    monkeypatch.setattr(engine_module, "sample", recording_sample)
    params = SamplingParams(max_tokens=8, min_tokens=6, temperature=0.8, seed=3, stop_token_ids=[9, 4, 9])
    out = reference.generate(["Hello"], params, use_tqdm=False)[0]
    assert out.outputs[0].error is None and len(out.outputs[0].token_ids) >= 6
    banned = [b[0] for b in given if b is not None]
    eos = reference.engine.config.eos_token_ids
    assert len(banned) >= 6 and banned[0] == sorted({4, 9, *eos})
    assert all(b is banned[0] for b in banned)


def test_a_request_that_bans_every_token_before_min_tokens_is_refused(reference):
    """Stop ids (with end-of-sequence, unless ignore_eos) covering the vocabulary leave no token to
    sample before min_tokens: refused at submission, not run until the engine blames the model."""
    vocab, eos = reference.config.vocab_size, set(reference.config.eos_token_ids)
    all_but_eos = [t for t in range(vocab) if t not in eos]
    for temperature in (0.0, 1.0):
        for ids, ignore_eos in ((list(range(vocab)), False), (list(range(vocab)), True), (all_but_eos, False)):
            params = SamplingParams(max_tokens=4, min_tokens=2, temperature=temperature, stop_token_ids=ids,
                                    ignore_eos=ignore_eos)
            error = reference.generate(["Hi"], params, use_tqdm=False)[0].outputs[0].error
            assert isinstance(error, InvalidArgument), error
            assert "leave no token to sample before min_tokens" in str(error)
    # One token left, or no min_tokens: these run.
    for params in (SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=all_but_eos, ignore_eos=True),
                   SamplingParams(max_tokens=4, stop_token_ids=list(range(vocab)))):
        assert reference.generate(["Hi"], params, use_tqdm=False)[0].outputs[0].error is None
