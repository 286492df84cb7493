"""FlexInfer on one CUDA GPU against transformers, on a SmolLM2-135M-shaped Llama
with random weights (same weights, prompts and run for every engine).

Needs only this repository (vtm built), torch, transformers and triton: the
model (hidden 576, 30 layers, 9 heads, 3 kv heads, head_dim 64, intermediate
1536, vocabulary 49152, tied embeddings) and a word-level tokenizer are built
here and saved as a Hugging Face folder; nothing is downloaded.

0. Correctness: FlexInfer float32 greedy tokens, the chosen attention backend
   versus per-request SDPA (the reference path).
1. Throughput, bfloat16, greedy, 32-token prompts, 128 new tokens, EOS ignored
   (FlexInfer: SamplingParams(ignore_eos=True); transformers: min_new_tokens):
   FlexInfer `generate` versus transformers `generate` at batch 1, 8, 32, 128;
   tokens/s and the ratio, medians of alternating repeats.
2. Decode attention, one layer, bfloat16, over a vtm CUDA space (KVCache
   views): the batched Triton kernel, the same kernel replayed from a CUDA
   graph, and the per-request SDPA loop the engine's `sdpa` backend runs; µs.
3. Decode with and without CUDA graphs: FlexInfer `cuda_graphs=True` versus
   `False` (skipped, and said so, where the engine has no such option).
4. Where a decode step's time goes, per batch size: the median step, split
   into GPU busy time (the graph replay, timed with CUDA events) and host
   time (the rest, while the GPU waits), against the weight-streaming bound
   (the weights' bytes over a device copy's bandwidth measured in the run);
   the engine as it is (Triton layer ops, overlap), then as baselines in the
   same run without overlap (the host reads each step's tokens before it
   plans the next) and with the layer ops as torch ops; at batches up to 8,
   the fused decode layers (linear="triton") against cuBLAS's GEMMs and the
   separate layer ops (linear="torch"); sampled rows, and
   sampled rows with the Triton draw against the draw as torch ops.
5. The kernels of a decode step by time (eager steps under torch.profiler).

Usage: python scripts/bench_gpu.py [--quick] [--json PATH] [--attention NAME] [--hf-attn sdpa|eager]
                                   [--parts 0,1,2,3,4,5]
       python scripts/bench_gpu.py --dry-run   (CPU: build the model folder, load it in both engines,
                                                check their float32 greedy tokens agree)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                     rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
                     eos_token_id=2)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1 (bos), 2 (eos)
PROMPT_TOKENS = 32


# ----------------------------------------------------------------------------- the model folder


def build_tokenizer(vocab_size: int):
    """A word-level tokenizer covering every id of the model's vocabulary, so
    that any generated id decodes."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    return tokenizer


def save_tokenizer(folder: Path, vocab_size: int) -> None:
    """tokenizer.json + tokenizer_config.json of build_tokenizer (also the GPU tests' tiny model's)."""
    build_tokenizer(vocab_size).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": SPECIAL_TOKENS[1], "eos_token": SPECIAL_TOKENS[2], "unk_token": SPECIAL_TOKENS[0]}))


def build_model_folder(folder: Path, shape: dict, seed: int = 0) -> None:
    """config.json + model.safetensors (bfloat16) + tokenizer.json + tokenizer_config.json."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the tables stay readable
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(torch.bfloat16)
    model.save_pretrained(folder)
    save_tokenizer(folder, shape["vocab_size"])


def make_prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return [[1] + torch.randint(len(SPECIAL_TOKENS), vocab, (length - 1,), generator=g).tolist()
            for _ in range(batch)]


# ----------------------------------------------------------------------------- engines


def hf_model(folder: Path, dtype: torch.dtype, device: str, attn: str):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, attn_implementation=attn)
    return model.to(device=device, dtype=dtype).eval()


def run_hf(model, prompts, new_tokens) -> tuple[float, list[list[int]]]:
    """(tokens/s, generated ids)."""
    device = next(model.parameters()).device
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    _sync(device)
    elapsed = time.perf_counter() - start
    assert out.shape[1] - ids.shape[1] == new_tokens
    return len(prompts) * new_tokens / elapsed, out[:, ids.shape[1]:].tolist()


def run_flexinfer(llm, prompts, new_tokens, temperature: float = 0.0,
                  seed: int | None = None) -> tuple[float, list[list[int]]]:
    from flexinfer import SamplingParams

    start = time.perf_counter()
    params = SamplingParams(max_tokens=new_tokens, temperature=temperature, top_p=0.95 if temperature else 1.0,
                            ignore_eos=True)
    if seed is not None:  # each request a seed of its own
        params = [SamplingParams(max_tokens=new_tokens, temperature=temperature, top_p=0.95, ignore_eos=True,
                                 seed=seed + i) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start  # the token ids are on the host: the step synchronised
    assert all(len(o.token_ids) == new_tokens for o in outs)
    return len(prompts) * new_tokens / elapsed, [o.token_ids for o in outs]


def make_llm(folder: Path, dtype: str, backend: str, attention: str, max_batch: int, cuda_graphs: bool | None = None,
             overlap: bool | None = None, linear: str | None = None):
    """An LLM, or None when `cuda_graphs`, `overlap` or `linear` is asked for and the engine has no such option
    (value). An attention backend the engine does not know falls back to sdpa, and says so."""
    from flexinfer import LLM, InvalidArgument

    kwargs = dict(dtype=dtype, backend=backend, attention=attention, kv_capacity_bytes=8 << 30, max_model_len=1024,
                  max_num_seqs=max_batch, max_batch_tokens=max_batch * PROMPT_TOKENS, enable_prefix_caching=False)
    if cuda_graphs is not None:
        kwargs["cuda_graphs"] = cuda_graphs
    if overlap is not None:
        kwargs["overlap"] = overlap
    if linear is not None:
        kwargs["linear"] = linear
    try:
        return LLM(str(folder), **kwargs)
    except TypeError:
        if cuda_graphs is None and overlap is None:
            raise
        return None
    except InvalidArgument as exc:
        if linear is not None and "linear" in str(exc):
            return None
        if "attention" not in str(exc) or attention == "sdpa":
            raise
        print(f"  note: attention={attention!r} refused ({exc}); using sdpa")
        kwargs["attention"] = "sdpa"
        return LLM(str(folder), **kwargs)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _close(*things) -> None:
    for thing in things:
        if thing is not None and hasattr(thing, "close"):
            thing.close()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- sections


def correctness(folder: Path, attention: str, batch: int, new_tokens: int) -> dict:
    prompts = make_prompts(batch, PROMPT_TOKENS, SMOLLM2_SHAPE["vocab_size"])
    tokens = {}
    used = {}
    for name in ("sdpa", attention):
        llm = make_llm(folder, "float32", "cuda", name, batch)
        used[name] = getattr(llm.attention, "name", name)
        tokens[name] = run_flexinfer(llm, prompts, new_tokens)[1]
        _close(llm)
    same = sum(a == b for a, b in zip(tokens["sdpa"], tokens[attention]))
    print(f"  float32 greedy, batch {batch}, {new_tokens} tokens: {used[attention]} equals sdpa on "
          f"{same}/{batch} sequences")
    return dict(batch=batch, new_tokens=new_tokens, attention=used[attention], sequences_equal=same)


def throughput(folder: Path, attention: str, hf_attn: str, batches: list[int], new_tokens: int,
               repeats: int) -> tuple[list[dict], str]:
    hf = hf_model(folder, torch.bfloat16, "cuda", hf_attn)
    llm = make_llm(folder, "bfloat16", "cuda", attention, max(batches))
    warm = make_prompts(2, PROMPT_TOKENS, SMOLLM2_SHAPE["vocab_size"])
    run_hf(hf, warm[:1], 4)
    for batch in batches:  # compiles kernels (and captures graphs) for every size outside the timings
        run_flexinfer(llm, make_prompts(batch, PROMPT_TOKENS, SMOLLM2_SHAPE["vocab_size"]), 4)
    rows = []
    print("  batch   FlexInfer tok/s   transformers tok/s   ratio")
    for batch in batches:
        prompts = make_prompts(batch, PROMPT_TOKENS, SMOLLM2_SHAPE["vocab_size"])
        ours, theirs = [], []
        for _ in range(repeats):
            theirs.append(run_hf(hf, prompts, new_tokens)[0])
            ours.append(run_flexinfer(llm, prompts, new_tokens)[0])
        row = dict(batch=batch, prompt_tokens=PROMPT_TOKENS, new_tokens=new_tokens,
                   flexinfer_tok_s=statistics.median(ours), hf_tok_s=statistics.median(theirs),
                   flexinfer_all=ours, hf_all=theirs)
        row["ratio"] = row["flexinfer_tok_s"] / row["hf_tok_s"]
        rows.append(row)
        print(f"  {batch:>5}   {row['flexinfer_tok_s']:>15.1f}   {row['hf_tok_s']:>18.1f}   {row['ratio']:>5.2f}x",
              flush=True)
    used = getattr(llm.attention, "name", attention)
    _close(llm)
    del hf
    _close()
    return rows, used


def _cuda_time_us(fn, iters: int) -> float:
    """Median of `iters` timings of fn() with CUDA events, µs."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def _sdpa_loop(q, k_heads, v_heads, slots, lens):
    """The per-request loop of the engine's sdpa backend for one decode layer:
    one SDPA call per request on its [1, kv_heads, length, head_dim] views."""
    q_heads = q.unsqueeze(2)
    _, kv_heads, _, head_dim = k_heads.shape
    outs = []
    for i, (slot, length) in enumerate(zip(slots, lens)):
        offset = k_heads.storage_offset() + slot * k_heads.stride(0)
        k = k_heads.as_strided((1, kv_heads, length, head_dim), k_heads.stride(), offset)
        v = v_heads.as_strided((1, kv_heads, length, head_dim), v_heads.stride(), v_heads.storage_offset()
                               + slot * v_heads.stride(0))
        outs.append(F.scaled_dot_product_attention(q_heads[i:i + 1], k, v, enable_gqa=True))
    return torch.cat(outs).squeeze(2)


def decode_attention_bench(folder: Path, cases: list[tuple[int, int]], iters: int) -> list[dict]:
    """(batch, context) cases on a vtm CUDA space holding every layer (token-major rows)."""
    import vtm
    from flexinfer.kernels.triton_attention import decode_attention
    from flexinfer.kv_cache import KVCache
    from flexinfer.model.config import ModelConfig

    config = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    dtype = torch.bfloat16
    chunk = 2 << 20
    max_batch = max(b for b, _ in cases)
    # Request i holds the longest context of the cases it takes part in.
    tokens = [max(c for b, c in cases if i < b) for i in range(max_batch)]
    capacity = sum(-(-n * config.kv_row_bytes(dtype.itemsize) // chunk) + 1 for n in tokens) * chunk
    manager = vtm.Manager(backend="cuda", capacity_bytes=capacity, chunk_bytes=chunk)
    kv = KVCache(manager, config, dtype, max_tokens=max(tokens), max_slots=max_batch)
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    print("  batch  context   Triton µs   graph µs   SDPA loop µs   SDPA/Triton   max |diff|")
    try:
        vts = [kv.space.create(n).result() for n in tokens]
        k, v = kv.k[0], kv.v[0]
        for vt, n in zip(vts, tokens):  # layer 0's K and V of every token the request holds
            for cache in (k, v):
                cache[vt.slot, :n] = torch.randn((n,) + tuple(cache.shape[2:]), generator=g, device="cuda",
                                                 dtype=dtype)
        for batch, context in cases:
            slots = [vt.slot for vt in vts[:batch]]
            lens = [context - i % 7 for i in range(batch)]  # not all equal
            q = torch.randn(batch, config.num_attention_heads, config.head_dim, generator=g, device="cuda",
                            dtype=dtype)
            slots_t = torch.tensor(slots, dtype=torch.int32, device="cuda")
            lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
            out = torch.empty_like(q)

            def triton_call(q=q, slots_t=slots_t, lens_t=lens_t, out=out):
                decode_attention(q, k, v, slots_t, lens_t, out=out)

            triton_call()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                triton_call()
            ref = _sdpa_loop(q, kv.k_heads[0], kv.v_heads[0], slots, lens)
            graph.replay()
            torch.cuda.synchronize()
            diff = (out.float() - ref.float()).abs().max().item()
            row = dict(batch=batch, context=context, triton_us=_cuda_time_us(triton_call, iters),
                       graph_us=_cuda_time_us(graph.replay, iters),
                       sdpa_loop_us=_cuda_time_us(lambda q=q, s=slots, n=lens: _sdpa_loop(
                           q, kv.k_heads[0], kv.v_heads[0], s, n), max(3, iters // 5)),
                       max_abs_diff=diff)
            row["sdpa_over_triton"] = row["sdpa_loop_us"] / row["triton_us"]
            rows.append(row)
            print(f"  {batch:>5}  {context:>7}   {row['triton_us']:>9.1f}   {row['graph_us']:>8.1f}   "
                  f"{row['sdpa_loop_us']:>12.1f}   {row['sdpa_over_triton']:>10.1f}x   {diff:.4f}", flush=True)
            del graph
        kv.release(vts)
    finally:
        kv.close()
        manager.close()
    return rows


def graphs_vs_eager(folder: Path, attention: str, batches: list[int], new_tokens: int, repeats: int) -> dict:
    engines = {flag: make_llm(folder, "bfloat16", "cuda", attention, max(batches), cuda_graphs=flag)
               for flag in (True, False)}
    if any(llm is None for llm in engines.values()):
        _close(*engines.values())
        print("  skipped: this FlexInfer has no cuda_graphs option")
        return dict(available=False)
    for llm in engines.values():
        for batch in batches:
            run_flexinfer(llm, make_prompts(batch, PROMPT_TOKENS, SMOLLM2_SHAPE["vocab_size"]), 4)
    rows = []
    print("  batch   graphs tok/s   no graphs tok/s   ratio   same tokens")
    for batch in batches:
        prompts = make_prompts(batch, PROMPT_TOKENS, SMOLLM2_SHAPE["vocab_size"])
        rates = {True: [], False: []}
        tokens = {}
        for _ in range(repeats):
            for flag, llm in engines.items():
                rate, tokens[flag] = run_flexinfer(llm, prompts, new_tokens)
                rates[flag].append(rate)
        row = dict(batch=batch, graphs_tok_s=statistics.median(rates[True]),
                   eager_tok_s=statistics.median(rates[False]), same_tokens=tokens[True] == tokens[False])
        row["ratio"] = row["graphs_tok_s"] / row["eager_tok_s"]
        rows.append(row)
        print(f"  {batch:>5}   {row['graphs_tok_s']:>12.1f}   {row['eager_tok_s']:>15.1f}   {row['ratio']:>5.2f}x"
              f"   {row['same_tokens']}", flush=True)
    _close(*engines.values())
    return dict(available=True, rows=rows)


def weight_stream_bound_us(folder: Path) -> tuple[float, float, float]:
    """(µs to read the model's weights once at the bandwidth measured now,
    weight bytes, GB/s): the floor of a decode step, which reads every
    weight once whatever the batch. The bandwidth is a device-to-device copy
    of 1 GiB (read + write bytes over its time), median of 10."""
    from safetensors import safe_open

    weight_bytes = 0
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            t = f.get_slice(name)
            weight_bytes += torch.Size(t.get_shape()).numel() * torch.bfloat16.itemsize
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_us = _cuda_time_us(lambda s=src, d=dst: d.copy_(s), 10)
    del src, dst
    _close()
    gb_s = 2 * (1 << 30) / copy_us / 1e3
    return weight_bytes / (gb_s * 1e3), weight_bytes, gb_s


class StepClock:
    """Times an engine's decode steps on its own thread: each step's wall
    time (Engine.step, from one call's start to the next one's, so the
    loop's own work counts too) and the GPU time of its CUDA graph replay
    (events just before and after DecodeGraphs.run: the replay is one
    launch, so the GPU runs it without waiting for the host in between).
    A step is a decode step when it replayed a graph. The events are read
    after the run (`samples`): waiting for them during it would stop the
    host from running ahead of the device, which is what overlap does."""

    def __init__(self, engine):
        self.engine = engine
        self._timed: list[tuple[float, tuple | None]] = []  # (step wall µs, its replay's events)
        self._events = None  # the graph replay of the step running now
        self._pending = None  # that of the step before
        self._last_start = None
        self._step, self._run = engine.step, engine.graphs.run
        engine.step, engine.graphs.run = self._timed_step, self._timed_run

    def _timed_run(self, *args):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self._run(*args)
        end.record()
        self._events = (start, end)
        return out

    def _timed_step(self):
        now = time.perf_counter()
        if self._last_start is not None:
            self._timed.append(((now - self._last_start) * 1e6, self._pending))
        self._events = None
        self._last_start = now
        out = self._step()
        self._pending = self._events
        return out

    @property
    def samples(self) -> list[tuple[float, float]]:
        """(step wall µs, graph GPU µs) of each decode step so far."""
        torch.cuda.synchronize()
        return [(wall, start.elapsed_time(end) * 1e3) for wall, events in self._timed if events is not None
                for start, end in [events]]

    def reset(self) -> None:
        self._timed, self._last_start, self._pending = [], None, None

    def close(self) -> None:
        self.engine.step, self.engine.graphs.run = self._step, self._run


def _forced_draw(make_sampler, kernel: bool):
    """The engine's sampler factory, its samplers drawing with the Triton
    kernel (kernel) or with torch ops (a sort of the vocabulary for top-p)
    whatever the batch: the engine picks by DRAW_KERNEL_FROM_ROWS, so as it
    is the two would be the same draw at some batch sizes."""
    from flexinfer.kernels import triton_sampling

    def make(facts):
        sampler = make_sampler(facts)
        sampler._draw_kernel = triton_sampling.draw if kernel else None
        return sampler
    return make


def step_split(folder: Path, attention: str, batches: list[int], new_tokens: int, bound_us: float) -> list[dict]:
    """Per batch size: the median decode step, the GPU's busy part of it (the
    graph replay) and the host's (the rest: the GPU waits for the host), and
    the step over the weight-streaming bound; for the engine as it is (the
    layer ops as Triton kernels on CUDA, overlap on) and, as baselines in the
    same run, without overlap, and with the layer ops as torch ops (norm,
    residual add, rotary embedding and K/V write, SiLU*up: the CUDA path
    before triton_layer_ops.py). Then, at the smallest and largest batch,
    sampled requests (temperature 0.8, top_p 0.95): chosen on the device
    (unseeded, and each with a seed of its own; the draw as the engine
    picks it by batch size), with the Triton draw and with the draw as
    torch ops at every size (kernels/triton_sampling.py against its
    reference), and on the host as before BatchSampler (each step read at
    once)."""
    rows = []
    print(f"  weight-streaming bound {bound_us:.1f} µs a step")
    print("  engine          batch   step µs   GPU µs   host µs   GPU busy   tok/s      step/bound")
    # "now" is the engine's default (overlap on CUDA): an engine without the option still runs it.
    ends = sorted({min(batches), max(batches)})
    # The fused decode layers run up to 8 rows: `linear="auto"` ("now") timed
    # them at load; these force each way at the batches they can change.
    few = [b for b in batches if b <= 8]
    variants = (("now", "triton", None, 0.0, batches, None, None),
                ("fused layers", "triton", None, 0.0, few, None, "triton"),
                ("cuBLAS layers", "triton", None, 0.0, few, None, "torch"),
                ("no overlap", "triton", False, 0.0, batches, None, None),
                ("torch ops", "torch", None, 0.0, batches, None, "torch"),
                ("sampled", "triton", None, 0.8, ends, None, None),
                ("sampled, seeded", "triton", None, 0.8, ends, 1, None),
                ("sampled, Triton draw", "triton", None, 0.8, ends, None, None),
                ("sampled, torch draw", "triton", None, 0.8, ends, None, None),
                ("sampled on host", "triton", None, 0.8, ends, None, None))
    for name, ops, overlap, temperature, sizes, seed, linear in variants:
        llm = make_llm(folder, "bfloat16", "cuda", attention, max(batches), overlap=overlap, linear=linear) \
            if sizes else None
        if llm is None or llm.engine.graphs is None or (name == "sampled on host"
                                                         and not hasattr(llm.engine, "sampling_device")):
            _close(llm)
            print(f"  {name}: skipped, the engine has no such option or does not decode with CUDA graphs here")
            continue
        if name == "now":
            print(f"  linear='auto' chose the fused decode layers at row buckets: "
                  f"{getattr(llm.model, 'fused_kinds', None)}")
        if ops == "torch":  # before any graph is captured
            llm.model.layer_ops, llm.model.norm_adds_residual = None, False
        if name == "sampled on host":
            llm.engine.sampling_device = None
        if name in ("sampled, Triton draw", "sampled, torch draw"):
            llm.engine._batch_sampler = _forced_draw(llm.engine._batch_sampler, kernel=name == "sampled, Triton draw")
        clock = StepClock(llm.engine)
        try:
            for batch in sizes:
                prompts = make_prompts(batch, PROMPT_TOKENS, SMOLLM2_SHAPE["vocab_size"])
                run_flexinfer(llm, prompts, 4, temperature, seed)  # graphs captured, kernels compiled
                clock.reset()
                run_flexinfer(llm, prompts, new_tokens, temperature, seed)
                # The first decode steps follow the prefill; the last ones may end sequences.
                samples = clock.samples
                samples = samples[2:-2] or samples
                step = statistics.median(w for w, _ in samples)
                gpu = statistics.median(g for _, g in samples)
                row = dict(engine=name, layer_ops=ops, linear=linear, overlap=overlap, temperature=temperature,
                           seeded=seed is not None, batch=batch, steps=len(samples), step_us=step,
                           gpu_us=gpu, host_us=max(0.0, step - gpu), gpu_busy=min(1.0, gpu / step),
                           tok_s=batch / step * 1e6, step_over_bound=step / bound_us)
                rows.append(row)
                print(f"  {name:<15} {batch:>5}   {step:>7.1f}   {gpu:>6.1f}   {row['host_us']:>7.1f}   "
                      f"{row['gpu_busy']:>7.0%}   {row['tok_s']:>9.0f}   {row['step_over_bound']:>6.1f}x", flush=True)
        finally:
            clock.close()
            _close(llm)
    baselines = {"no overlap": ("now", "speedup_of_overlap"), "torch ops": ("now", "speedup_over_torch_ops"),
                 "cuBLAS layers": ("fused layers", "speedup_of_the_fused_layers"),
                 "sampled, torch draw": ("sampled, Triton draw", "speedup_of_the_draw_kernel"),
                 "sampled on host": ("sampled", "speedup_of_device_sampling")}
    by_name = {(r["engine"], r["batch"]): r for r in rows}
    for r in rows:
        if r["engine"] not in baselines:
            continue
        target, key = baselines[r["engine"]]
        faster = by_name.get((target, r["batch"]))
        if faster is not None:
            faster[key] = r["step_us"] / faster["step_us"]
            print(f"  batch {r['batch']}: {target!r} step is {faster[key]:.2f}x faster than "
                  f"{r['engine']!r} (GPU {r['gpu_us'] / faster['gpu_us']:.2f}x)")
    return rows


def kernel_profile(folder: Path, attention: str, batch: int, steps: int, top: int = 12) -> list[dict]:
    """The CUDA kernels of one decode step (eager, so that the profiler sees
    each launch), by total time per step: what the GPU part of a step is."""
    from torch.profiler import ProfilerActivity, profile

    llm = make_llm(folder, "bfloat16", "cuda", attention, batch, cuda_graphs=False)
    prompts = make_prompts(batch, PROMPT_TOKENS, SMOLLM2_SHAPE["vocab_size"])
    try:
        run_flexinfer(llm, prompts, 4)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run_flexinfer(llm, prompts, steps)
        torch.cuda.synchronize()
        totals: dict[str, list[float]] = {}
        for e in prof.key_averages():
            us = getattr(e, "self_device_time_total", None)
            if us is None:
                us = getattr(e, "self_cuda_time_total", 0.0)
            if us > 0:
                totals[e.key] = [us, e.count]
    finally:
        _close(llm)
    all_us = sum(us for us, _ in totals.values()) / steps
    rows = [dict(kernel=k, us_per_step=us / steps, calls_per_step=n / steps)
            for k, (us, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]]
    print(f"  batch {batch}: {all_us:.1f} µs of kernels a step (eager; prefill included, {steps} steps)")
    for r in rows:
        print(f"    {r['us_per_step']:>8.1f} µs  {r['calls_per_step']:>6.1f} calls  {r['kernel'][:90]}")
    return [dict(kernel="(all)", us_per_step=all_us)] + rows


def dry_run(folder: Path, shape: dict) -> dict:
    """CPU: the folder loads in FlexInfer and transformers, and both agree on float32 greedy tokens."""
    prompts = make_prompts(2, 8, shape["vocab_size"])
    hf = hf_model(folder, torch.float32, "cpu", "sdpa")
    theirs = [run_hf(hf, [p], 4)[1][0] for p in prompts]
    del hf
    llm = make_llm(folder, "float32", "host", "sdpa", 2)
    ours = run_flexinfer(llm, prompts, 4)[1]
    text = llm.tokenizer.decode(ours[0])
    llm.close()
    print(f"  transformers {theirs}\n  FlexInfer    {ours}  ({text!r})")
    if ours != theirs:
        raise SystemExit("dry run: FlexInfer and transformers disagree on the random model")
    return dict(tokens=ours, text=text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and tokens, one repeat (a smoke run)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--attention", default="kernel", help="FlexInfer's attention backend (default: kernel, the batched Triton kernels)")
    parser.add_argument("--hf-attn", default="sdpa", choices=["sdpa", "eager"], help="transformers' attention")
    parser.add_argument("--dry-run", action="store_true", help="CPU only: build the model and check it loads")
    parser.add_argument("--parts", default="0,1,2,3,4,5",
                        help="the parts to run, comma-separated (default: all; e.g. 4 for the step split alone)")
    args = parser.parse_args()
    try:
        parts = {int(p) for p in args.parts.split(",")}
    except ValueError:
        parser.error(f"--parts takes part numbers 0 to 5, comma-separated, got {args.parts!r}")
    if not parts or not parts <= set(range(6)):
        parser.error(f"--parts takes part numbers 0 to 5, comma-separated, got {args.parts!r}")
    started = time.perf_counter()
    result = dict(torch=torch.__version__, quick=args.quick, shape=SMOLLM2_SHAPE)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-model-") as tmp:
        folder = Path(tmp)
        build_model_folder(folder, SMOLLM2_SHAPE)
        print(f"model: SmolLM2-135M shape, random weights, in {folder} ({time.perf_counter() - started:.1f} s)")
        if args.dry_run:
            print("\nDry run (CPU, float32)")
            result["dry_run"] = dry_run(folder, SMOLLM2_SHAPE)
        else:
            if not torch.cuda.is_available():
                raise SystemExit("needs a CUDA device (use --dry-run on a CPU)")
            result["device"] = torch.cuda.get_device_name()
            print(f"device: {result['device']}, torch {torch.__version__}")
            batches = [1, 8] if args.quick else [1, 8, 32, 128]
            new_tokens = 32 if args.quick else 128
            repeats = 1 if args.quick else 2
            if 0 in parts:
                print("\n0. Correctness: float32 greedy tokens")
                result["correctness"] = correctness(folder, args.attention, 4, 16 if args.quick else 32)
            if 1 in parts:
                print(f"\n1. Throughput, bfloat16, greedy, {PROMPT_TOKENS}-token prompts, {new_tokens} new tokens "
                      f"(median of {repeats}; transformers attention {args.hf_attn})")
                result["throughput"], result["attention"] = throughput(folder, args.attention, args.hf_attn,
                                                                       batches, new_tokens, repeats)
            if 2 in parts:
                print("\n2. Decode attention, one layer, bfloat16, vtm CUDA space")
                cases = [(8, 160), (32, 160)] if args.quick else [(8, 160), (32, 160), (128, 160), (8, 1024),
                                                                   (32, 1024), (128, 1024), (1, 4096)]
                result["decode_attention"] = decode_attention_bench(folder, cases, 20 if args.quick else 50)
            if 3 in parts:
                print("\n3. Decode with and without CUDA graphs")
                result["cuda_graphs"] = graphs_vs_eager(folder, args.attention, [8] if args.quick else [8, 32],
                                                        new_tokens, repeats)
            if 4 in parts:
                print("\n4. Where a decode step's time goes (bfloat16, CUDA graphs)")
                bound_us, weight_bytes, gb_s = weight_stream_bound_us(folder)
                print(f"  weights {weight_bytes / 1e6:.0f} MB, device copy bandwidth {gb_s:.0f} GB/s")
                result["weight_stream"] = dict(bound_us=bound_us, weight_bytes=weight_bytes, copy_gb_s=gb_s)
                result["step_split"] = step_split(folder, args.attention, [1, 8, 32, 128] if not args.quick
                                                  else [1, 32], new_tokens, bound_us)
            if 5 in parts:
                print("\n5. The kernels of a decode step (eager, torch.profiler)")
                result["kernels"] = {b: kernel_profile(folder, args.attention, b, 16 if args.quick else 32)
                                     for b in ([1] if args.quick else [1, 128])}
    result["total_s"] = time.perf_counter() - started
    print(f"\ntotal {result['total_s']:.1f} s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
