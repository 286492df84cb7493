"""bfloat16 on CPU: the same engine with half the KV row and weights. Its greedy
output follows float32's (rounding may flip a late near-tie, not the start)."""

from __future__ import annotations

import pytest
import torch

from flexinfer import LLM, SamplingParams


@pytest.fixture(scope="module")
def smollm2_bfloat16():
    """load_model("smollm2", torch.bfloat16), once for this module's engine and forward pass."""
    from flexinfer.model.loader import load_model

    return load_model("smollm2", torch.bfloat16)


def test_bfloat16_follows_float32_on_smollm2(smollm2_float32, smollm2_bfloat16, reusing_smollm2):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # Text, and ids that are not a count: a run of digits (ids 300..339) ends in a
    # near-tie between two digits that bfloat16 rounding may flip at any step.
    prompts = ["The capital of France is", "def fibonacci(n):", [1, 9, 77, 1000, 2000]]
    outs, rows = {}, {}
    with reusing_smollm2({torch.float32: smollm2_float32, torch.bfloat16: smollm2_bfloat16}):
        for dtype in ("float32", "bfloat16"):
            with LLM("smollm2", dtype=dtype, max_model_len=256, kv_capacity_bytes=64 << 20, max_num_seqs=4) as llm:
                assert llm.model.embed.dtype == getattr(torch, dtype)
                outs[dtype] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
                rows[dtype] = llm.kv_cache.row_bytes
                llm.manager.check()
    assert rows["bfloat16"] * 2 == rows["float32"]
    for a, b in zip(outs["float32"], outs["bfloat16"]):
        assert a[:6] == b[:6], (a, b)


def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(smollm2_hf_model, smollm2_bfloat16):
    """Issue 19 measured FlexInfer's bfloat16 greedy tokens leaving float32's
    sooner than transformers' bfloat16 does. That measure (the median position
    of the first differing token over 32 prompts) swings with near-ties: on
    one Intel Xeon it gave FlexInfer 21 vs transformers 11 with 64-token
    prompts, and 20.5 vs 40 with 32-token ones. This test measures each step
    instead, teacher-forced on float32's greedy continuation (40 steps after
    16 prompts of 32 tokens): the mean distance of the logits from float32's
    and how often the top token differs, FlexInfer's default CPU path
    (one-call decoder, packed projections, the C++ attention kernel; `packed`
    named, so that the kernels do not depend on a timing) against
    transformers in bfloat16 on the same weights. Measured there: 0.107 vs
    0.111, flips 1.7 % vs 2.2 %."""
    import copy

    import vtm
    from flexinfer.attention import make_attention
    from flexinfer.kv_cache import KVCache
    from flexinfer.model.llama import ForwardBatch, LlamaModel

    n, prompt_len, steps = 16, 32, 40
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40000, (n, prompt_len), generator=generator)
    with torch.no_grad():
        seqs = smollm2_hf_model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=steps,
                                         min_new_tokens=steps, do_sample=False, pad_token_id=0)
        exact = smollm2_hf_model(seqs).logits[:, prompt_len - 1:-1].float()
        theirs = copy.deepcopy(smollm2_hf_model).to(torch.bfloat16)(seqs).logits[:, prompt_len - 1:-1].float()

    loaded = smollm2_bfloat16
    # `packed` named, not "auto": auto times the kernels at load, and once on
    # a loaded machine its pick flipped 2.2 % of the top tokens against
    # transformers' 1.1 % + the margin (kernels round differently).
    model = LlamaModel(loaded.config, dict(loaded.weights), torch.bfloat16, linear="packed")
    ours = torch.empty_like(exact)
    with vtm.Manager(backend="host", capacity_bytes=256 << 20) as manager:
        kv = KVCache(manager, loaded.config, torch.bfloat16, max_tokens=128, max_slots=n)
        attention = make_attention("auto", torch.device("cpu"))
        vtensors = [kv.create(prompt_len + steps) for _ in range(n)]
        slots = [tuple(vt.slot for vt in group) for group in vtensors]
        batch = ForwardBatch.build(slots, [0] * n, [prompt_len] * n, torch.device("cpu"))
        ours[:, 0] = model.forward(seqs[:, :prompt_len].reshape(-1), batch, kv, attention)
        for step in range(1, steps):
            position = prompt_len + step - 1
            batch = ForwardBatch.build(slots, [position] * n, [1] * n, torch.device("cpu"))
            ours[:, step] = model.forward(seqs[:, position], batch, kv, attention)
        for group in vtensors:
            kv.release(group)
        kv.close()

    def distance(logits):
        return (logits - exact).abs().mean().item(), (logits.argmax(-1) != exact.argmax(-1)).float().mean().item()

    (ours_error, ours_flips), (theirs_error, theirs_flips) = distance(ours), distance(theirs)
    assert ours_error <= 1.05 * theirs_error, (ours_error, theirs_error)
    assert ours_flips <= theirs_flips + 0.01, (ours_flips, theirs_flips)
