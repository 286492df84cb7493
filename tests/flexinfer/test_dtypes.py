"""bfloat16 on CPU: the same engine with half the KV row and weights. Its greedy
output follows float32's (rounding may flip a late near-tie, not the start)."""

from __future__ import annotations

import pytest
import torch

from flexinfer import LLM, SamplingParams



def test_bfloat16_follows_float32_on_smollm2():
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # Text, and ids that are not a count: a run of digits (ids 300..339) ends in a
    # near-tie between two digits that bfloat16 rounding may flip at any step.
    prompts = ["The capital of France is", "def fibonacci(n):", [1, 9, 77, 1000, 2000]]
    outs, rows = {}, {}
    for dtype in ("float32", "bfloat16"):
        with LLM("smollm2", dtype=dtype, max_model_len=256, kv_capacity_bytes=64 << 20, max_num_seqs=4) as llm:
            assert llm.model.embed.dtype == getattr(torch, dtype)
            outs[dtype] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            rows[dtype] = llm.kv_cache.row_bytes
            llm.manager.check()
    assert rows["bfloat16"] * 2 == rows["float32"]
    for a, b in zip(outs["float32"], outs["bfloat16"]):
        assert a[:6] == b[:6], (a, b)
