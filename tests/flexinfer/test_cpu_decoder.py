"""The one-call CPU decoder (src/flexinfer/csrc/decoder_cpu.h), both its calls
(the whole pass, and the layers alone), against the model's Python loop over
the same kernels: logits and every cache byte equal, bit for bit, through
prefill, decode and chunks that continue a cached prefix, in float32 and
bfloat16, with q/k/v biases and with layer groups whose rows differ in
length. Bad ids, slots and positions change nothing. Runs on vtm's host
backend, whose unmapped pages fault on an over-read."""

from __future__ import annotations

import dataclasses
import gc
from types import SimpleNamespace

import pytest
import torch

import vtm
from flexinfer.attention import KernelAttention, SdpaAttention
from flexinfer.errors import InvalidArgument
from flexinfer.kv_cache import KVCache
from flexinfer.model.config import FULL, ModelConfig
from flexinfer.model.linear import ONE_ROW_TIE, TIE, choose_kind
from flexinfer.model.llama import ForwardBatch, LlamaModel

CPU = torch.device("cpu")
PAGE = 4096


def tiny_config(layers: int = 3, bias: bool = False) -> ModelConfig:
    return ModelConfig(architecture="qwen2" if bias else "llama", vocab_size=96, hidden_size=48,
                       intermediate_size=80, num_hidden_layers=layers, num_attention_heads=6, num_key_value_heads=2,
                       head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None, max_position_embeddings=128,
                       tie_word_embeddings=False, attention_bias=bias, bos_token_id=1, eos_token_ids=(2,))


def random_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    c = config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim

    def t(*shape):
        return torch.randn(*shape, generator=gen) * (0.3 if len(shape) == 2 else 1.0)

    weights = {"model.embed_tokens.weight": t(c.vocab_size, c.hidden_size), "model.norm.weight": t(c.hidden_size),
               "lm_head.weight": t(c.vocab_size, c.hidden_size)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": t(c.hidden_size), p + "post_attention_layernorm.weight": t(c.hidden_size),
            p + "self_attn.q_proj.weight": t(q, c.hidden_size), p + "self_attn.k_proj.weight": t(kv, c.hidden_size),
            p + "self_attn.v_proj.weight": t(kv, c.hidden_size), p + "self_attn.o_proj.weight": t(c.hidden_size, q),
            p + "mlp.gate_proj.weight": t(c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": t(c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": t(c.hidden_size, c.intermediate_size)})
        if c.attention_bias:
            weights.update({p + "self_attn.q_proj.bias": t(q), p + "self_attn.k_proj.bias": t(kv),
                            p + "self_attn.v_proj.bias": t(kv)})
    return weights


def raw(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as integers: equal bits compare equal, NaNs included."""
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


# The three ways a CPU pass of a Llama runs: one call for the whole pass, one
# call for the layers (the model makes the embeddings and the logits), and
# the model's Python loop. Every pass runs all three, each on its own cache.
PATHS = ("whole", "layers", "loop")


class Runner:
    """One model, a cache per path of the same layout; every pass compares
    the logits and every cached row of each path with the loop's."""

    def __init__(self, manager, config, dtype, layer_groups, requests, max_tokens=64):
        # Positions up to the caches' length, as an engine's max_model_len gives them.
        self.model = LlamaModel(config, random_weights(config, seed=3), dtype, linear="packed",
                                max_positions=max_tokens)
        assert self.model.decoder is not None and self.model.decoder.runs_whole_pass
        self.attention = KernelAttention(CPU)
        self.manager = manager
        self.caches = [KVCache(manager, config, dtype, max_tokens=max_tokens, max_slots=requests + 2,
                               layer_groups=layer_groups) for _ in PATHS]
        # A vTensor in each cache's first slot, outside the batch: no pass may touch its rows.
        self.bystanders = [cache.create(3) for cache in self.caches]
        self.bystander_rows = [self.rows(cache, self.bystanders[cache], 3) for cache in range(len(PATHS))]
        # One more slot taken in the last group only: each group's slots differ.
        self.offsets = [cache.spaces[-1].create(0).result() if layer_groups > 1 else None for cache in self.caches]
        self.vts = [[cache.create(0) for _ in range(requests)] for cache in self.caches]
        self.lengths = [0] * requests

    def rows(self, cache: int, vts, length: int) -> list[torch.Tensor]:
        """The first `length` cached rows of one request (its vTensor per group) in every layer."""
        c = self.caches[cache]
        return [raw(c.kv[layer][vts[c.group_of[layer]].slot, :length]).clone() for layer in range(len(c.kv))]

    def slots(self, cache: int) -> list[tuple[int, ...]]:
        return [tuple(vt.slot for vt in group) for group in self.vts[cache]]

    def forward(self, cache: int, ids: torch.Tensor, new_lens: list[int], path: str) -> torch.Tensor:
        """A pass through `path`, which must be the one that runs."""
        batch = ForwardBatch.build(self.slots(cache), self.lengths, new_lens, CPU)
        decoder = self.model.decoder
        calls = []

        def counted(name):
            def call(*args):
                calls.append(name)
                return getattr(decoder, name)(*args)
            return call

        self.model.decoder = None if path == "loop" else SimpleNamespace(
            run=counted("run"), forward=counted("forward"), runs_whole_pass=path == "whole")
        try:
            logits = self.model.forward(ids, batch, self.caches[cache], self.attention)
        finally:
            self.model.decoder = decoder
        assert calls == {"whole": ["forward"], "layers": ["run"], "loop": []}[path]
        return logits

    def step(self, new_lens: list[int], seed: int) -> torch.Tensor:
        """One pass of `new_lens[i]` new tokens per request through every path."""
        for cache in range(len(PATHS)):
            self.manager.step({vt: length + n for group, length, n in zip(self.vts[cache], self.lengths, new_lens)
                               for vt in group}).result()
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, self.model.config.vocab_size, (sum(new_lens),), generator=gen)
        *fused, loop = (self.forward(cache, ids, new_lens, path) for cache, path in enumerate(PATHS))
        assert torch.isfinite(loop).all()
        for logits in fused:
            assert logits.dtype is torch.float32 and torch.equal(raw(logits), raw(loop))
        self.lengths = [length + n for length, n in zip(self.lengths, new_lens)]
        for cache in range(len(PATHS) - 1):
            for a, b, length in zip(self.vts[cache], self.vts[-1], self.lengths):
                for got, want in zip(self.rows(cache, a, length), self.rows(len(PATHS) - 1, b, length)):
                    assert torch.equal(got, want)
        for cache, rows in enumerate(self.bystander_rows):
            assert all(torch.equal(got, want) for got, want in zip(self.rows(cache, self.bystanders[cache], 3), rows))
        return loop

    def close(self) -> None:
        for cache, bystander, vts, offset in zip(self.caches, self.bystanders, self.vts, self.offsets):
            cache.release([vt for group in vts for vt in group] + bystander + [offset])
            cache.close()


def host_manager() -> vtm.Manager:
    return vtm.Manager(backend="host", capacity_bytes=256 * PAGE, chunk_bytes=PAGE, granularity=PAGE)


# Prefill of unequal prompts, decode, then chunks continuing cached prefixes
# mixed with decode rows, and a pass where a request adds nothing (an idle
# row; not the first, whose last token would not exist).
SCHEDULE = [[5, 11, 2], [1, 1, 1], [1, 1, 1], [7, 1, 3], [1, 9, 1], [1, 0, 1], [1, 1, 1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qkv-bias"])
@pytest.mark.parametrize("layer_groups", [1, 2])
def test_fused_layers_equal_the_loop_bit_for_bit(dtype, bias, layer_groups):
    with host_manager() as manager:
        runner = Runner(manager, tiny_config(bias=bias), dtype, layer_groups, requests=3)
        for seed, new_lens in enumerate(SCHEDULE):
            runner.step(new_lens, seed)
        runner.close()
        manager.check()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_long_context_splits_equal_the_loop(dtype, monkeypatch):
    """A 600-token prompt (many query blocks), then decode steps long enough
    that the attention kernel splits each context over two threads and
    merges the pieces, beside a request of a few tokens."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    with host_manager() as manager:
        runner = Runner(manager, tiny_config(), dtype, layer_groups=1, requests=2, max_tokens=640)
        for seed, new_lens in enumerate([[600, 3], [1, 1], [1, 1], [5, 1]]):
            runner.step(new_lens, seed)
        runner.close()
        manager.check()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_one_request_equals_the_loop(dtype):
    with host_manager() as manager:
        runner = Runner(manager, tiny_config(bias=True), dtype, layer_groups=2, requests=1)
        for seed, new_lens in enumerate([[9], [1], [1], [4], [1]]):
            runner.step(new_lens, seed)
        runner.close()
        manager.check()


def test_decoder_follows_the_cache_it_is_given_and_refuses_a_closed_or_foreign_one():
    """Three caches in turn (the cache table is rebuilt for each), then a
    closed cache and one of another geometry: InvalidArgument, nothing written."""
    config = tiny_config()
    with host_manager() as manager:
        runner = Runner(manager, config, torch.float32, layer_groups=2, requests=2)
        runner.step([4, 6], seed=0)
        # Every cache through the decoder now, in turn (the loop's too, which
        # gets the same tokens), through both its calls: all must keep giving
        # equal logits.
        paths = ("whole", "layers", "whole")
        for seed in range(1, 4):
            for cache in range(len(paths)):
                manager.step({vt: length + 1 for group, length in zip(runner.vts[cache], runner.lengths)
                              for vt in group}).result()
            gen = torch.Generator().manual_seed(seed)
            ids = torch.randint(3, config.vocab_size, (2,), generator=gen)
            first, *others = (runner.forward(cache, ids, [1, 1], path) for cache, path in enumerate(paths))
            assert all(torch.equal(raw(first), raw(other)) for other in others)
            runner.lengths = [length + 1 for length in runner.lengths]
            # Each cache got its own rows (a stale table would have written one cache twice).
            for cache in range(1, len(paths)):
                for vts_a, vts_b, length in zip(runner.vts[0], runner.vts[cache], runner.lengths):
                    for got, want in zip(runner.rows(0, vts_a, length), runner.rows(cache, vts_b, length)):
                        assert torch.equal(got, want)
        decoder = runner.model.decoder
        other = KVCache(manager, dataclasses.replace(config, num_key_value_heads=1), torch.float32, max_tokens=64,
                        max_slots=4)
        closed = KVCache(manager, config, torch.float32, max_tokens=64, max_slots=4, layer_groups=2)
        closed.close()
        batch = ForwardBatch.build(runner.slots(0), runner.lengths, [1, 1], CPU)
        cos, sin = runner.model._rope(batch.positions)[FULL]
        for cache, message in ((closed, "layers"), (other, "cache view")):
            hidden = torch.randn(2, config.hidden_size)
            kept = hidden.clone()
            batch = ForwardBatch.build([(0,)] * 2 if cache is other else runner.slots(0), runner.lengths, [1, 1],
                                       CPU)
            with pytest.raises(InvalidArgument, match=message):
                decoder.run(hidden, cos, sin, batch, cache)
            assert torch.equal(hidden, kept)
            with pytest.raises(InvalidArgument, match=message):
                decoder.forward(torch.tensor([5, 6]), batch, cache)
        other.close()
        runner.close()
        manager.check()


def one_token_pass(manager, config, decoder) -> torch.Tensor:
    """The whole pass of one token at position 0 through `decoder`, on a cache of its own."""
    cache = KVCache(manager, config, torch.float32, max_tokens=64, max_slots=2)
    group = cache.create(0)
    manager.step({vt: 1 for vt in group}).result()
    try:
        return decoder.forward(torch.tensor([5]), ForwardBatch.build([tuple(vt.slot for vt in group)], [0], [1], CPU),
                               cache)
    finally:
        cache.release(group)
        cache.close()


def test_the_whole_pass_returns_float32_logits_whatever_the_default_dtype():
    """The logits' buffer took torch's default dtype, while the call writes
    float32: under torch.set_default_dtype(torch.bfloat16) it wrote past the
    buffer's end (the process aborted)."""
    config = tiny_config(layers=1)
    with host_manager() as manager:
        model = LlamaModel(config, random_weights(config, seed=3), torch.float32, linear="packed", max_positions=64)
        want = one_token_pass(manager, config, model.decoder)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            got = one_token_pass(manager, config, model.decoder)
        finally:
            torch.set_default_dtype(default)
        assert got.dtype is torch.float32 and torch.equal(raw(got), raw(want))


def test_the_decoder_keeps_the_tensors_it_reads_alive():
    """The C++ side keeps the addresses of the model's embeddings, RoPE
    tables, norms and packed weights: a decoder that outlived its model read
    freed memory (NaN logits)."""
    config = tiny_config(layers=1)
    with host_manager() as manager:
        model = LlamaModel(config, random_weights(config, seed=3), torch.float32, linear="packed", max_positions=64)
        decoder = model.decoder
        want = one_token_pass(manager, config, decoder)
        del model
        gc.collect()
        junk = [torch.full((96, 48), 1e30) for _ in range(50)]  # takes the freed memory, if any
        assert torch.equal(raw(one_token_pass(manager, config, decoder)), raw(want))
        del junk


def test_model_runs_the_decoder_only_with_packed_projections_and_the_kernel_attention():
    config = tiny_config()
    assert LlamaModel(config, random_weights(config, 1), torch.float32, linear="torch").decoder is None
    model = LlamaModel(config, random_weights(config, 1), torch.float32, linear="packed")
    assert not model._runs_decoder(1, SdpaAttention())
    assert model._runs_decoder(1, KernelAttention(CPU))
    model.layers[0]["qkv"].kinds = {1: "torch", 8: "packed", 32: "packed", 128: "packed"}
    model.layers[0]["qkv"].kind = "mixed"
    assert not model._runs_decoder(1, KernelAttention(CPU)) and model._runs_decoder(2, KernelAttention(CPU))


# The ids, the RoPE tables' bound and the last-token index are the whole
# pass's alone: the layers' call takes embeddings and rows the model gathered.
@pytest.mark.parametrize("bad, call", [(bad, call) for bad in ("slot", "position", "seq_len")
                                       for call in ("whole", "layers")]
                         + [("id", "whole"), ("table", "whole"), ("last", "whole")])
def test_bad_id_slot_or_position_changes_nothing(bad, call):
    """A bad value in any vector a call reads: InvalidArgument, no cache row
    and no input written."""
    config = tiny_config()
    with host_manager() as manager:
        runner = Runner(manager, config, torch.float32, layer_groups=2, requests=2)
        decoder, cache = runner.model.decoder, runner.caches[0]
        if bad == "table":  # tables of 6 positions: the cache holds the next token's position 6, they do not
            runner.model = LlamaModel(config, random_weights(config, seed=3), torch.float32, linear="packed",
                                      max_positions=6)
            decoder = runner.model.decoder
        runner.step([4, 6], seed=0)
        for c in range(len(PATHS)):
            manager.step({vt: length + 1 for group, length in zip(runner.vts[c], runner.lengths)
                          for vt in group}).result()
        batch = ForwardBatch.build(runner.slots(0), runner.lengths, [1, 1], CPU)
        ids = torch.tensor([5, 6])
        if bad == "slot":  # the second group's slot of the last request, past the space
            batch.slot_index[1][1] = cache.max_slots
        elif bad == "position":
            batch.positions[1] = cache.max_tokens
        elif bad == "seq_len":
            batch.seq_lens[0] = cache.max_tokens + 1
        elif bad == "id":
            ids[1] = config.vocab_size
        elif bad == "last":
            batch.last_index[0] = 2
        before = [runner.rows(0, vts, length + 1) for vts, length in zip(runner.vts[0], runner.lengths)]
        hidden = torch.randn(2, config.hidden_size)
        kept, ids_kept = hidden.clone(), ids.clone()
        with pytest.raises(InvalidArgument, match="outside"):
            if call == "whole":
                decoder.forward(ids, batch, cache)
            else:
                cos, sin = runner.model._rope(batch.positions.clamp(max=63))[FULL]
                decoder.run(hidden, cos, sin, batch, cache)
        assert torch.equal(hidden, kept) and torch.equal(ids, ids_kept)
        after = [runner.rows(0, vts, length + 1) for vts, length in zip(runner.vts[0], runner.lengths)]
        for rows_before, rows_after in zip(before, after):
            assert all(torch.equal(x, y) for x, y in zip(rows_before, rows_after))
        runner.close()
        manager.check()


def test_decoder_refuses_inputs_of_the_wrong_shape_or_dtype():
    config = tiny_config()
    with host_manager() as manager:
        runner = Runner(manager, config, torch.float32, layer_groups=1, requests=1)
        runner.step([3], seed=0)
        batch = ForwardBatch.build(runner.slots(0), [0], [3], CPU)
        cos, sin = runner.model._rope(batch.positions)[FULL]
        decoder, cache = runner.model.decoder, runner.caches[0]
        for hidden in (torch.zeros(3, config.hidden_size, dtype=torch.bfloat16), torch.zeros(3, 7),
                       torch.zeros(config.hidden_size, 3).t()):
            with pytest.raises(InvalidArgument, match="hidden"):
                decoder.run(hidden, cos, sin, batch, cache)
        with pytest.raises(InvalidArgument, match="cos"):
            decoder.run(torch.zeros(3, config.hidden_size), cos[:2], sin, batch, cache)
        for ids in (torch.zeros(3, dtype=torch.int32), torch.zeros(3, 1, dtype=torch.int64)):
            with pytest.raises(InvalidArgument, match="input ids"):
                decoder.forward(ids, batch, cache)
        with pytest.raises(InvalidArgument, match="last-token index"):
            decoder.forward(torch.zeros(3, dtype=torch.int64), dataclasses.replace(
                batch, last_index=batch.last_index.int()), cache)
        runner.close()


def test_ties_go_to_the_preferred_kernel():
    assert choose_kind({"torch": 1.0, "packed": 1.05}) == "torch"
    assert choose_kind({"torch": 1.0, "packed": 1.05}, prefer="packed") == "packed"
    assert choose_kind({"torch": 1.0, "packed": ONE_ROW_TIE * 1.01}, prefer="packed") == "torch"
    # One row's margin is wider (a cache-hot timing against a step that streams from memory).
    assert choose_kind({"torch": 1.0, "packed": TIE * 1.01}, prefer="packed") == "packed"
    assert choose_kind({"torch": 1.0, "packed": TIE * 1.01}, prefer="packed", rows=8) == "torch"
    assert choose_kind({"torch": 1.0, "onednn": 0.9}, prefer="packed") == "onednn"
    # Beyond decode sizes the preference's fixed saving no longer covers the margin.
    assert choose_kind({"torch": 1.0, "packed": 1.05}, prefer="packed", rows=128) == "torch"
    assert choose_kind({"torch": 1.0, "packed": 0.9}, prefer="packed", rows=128) == "packed"
