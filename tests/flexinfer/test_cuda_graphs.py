"""CUDA-graph decode: bucket sizes and argument checks everywhere; on a GPU,
greedy outputs with graphs equal the eager batched kernels and per-request
SDPA (float32), across batch sizes that need padding rows."""

from __future__ import annotations

import pytest
import torch

import vtm
from flexinfer import LLM, InvalidArgument, SamplingParams
from flexinfer.cuda_graphs import buckets_up_to


def test_buckets_cover_every_batch_size_up_to_the_maximum():
    assert buckets_up_to(1) == [1]
    assert buckets_up_to(8) == [1, 2, 4, 8]
    assert buckets_up_to(20) == [1, 2, 4, 8, 16, 20]
    big = buckets_up_to(300)
    assert big[-1] == 300 and big == sorted(set(big))
    assert all(b - a <= 128 for a, b in zip(big, big[1:]))


def test_graphs_need_cuda_and_the_batched_kernels():
    # Checked before any weight loads, so the model path is never read.
    with pytest.raises(InvalidArgument, match="cuda_graphs"):
        LLM("no-such-model", backend="host", cuda_graphs=True, max_model_len=64)


gpu = pytest.mark.skipif(not (vtm.cuda_available() and torch.cuda.is_available()),
                         reason="needs a CUDA driver, a device and a CUDA build of torch")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_decode_matches_eager_kernels_and_sdpa(tiny_gpu_folder, dtype):
    # Lengths that end at different steps, so batches shrink through the buckets (7 -> 1).
    prompts = [[1] + list(range(10 + i, 30 + 3 * i)) for i in range(7)]
    params = [SamplingParams(max_tokens=6 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(7)]
    outs = {}
    for name, kwargs in {"graphs": dict(cuda_graphs=True), "eager": dict(cuda_graphs=False),
                         "sdpa": dict(attention="sdpa")}.items():
        with LLM(tiny_gpu_folder, dtype=dtype, backend="cuda", max_model_len=256, max_num_seqs=8, **kwargs) as llm:
            outs[name] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            if name == "graphs":
                again = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
                assert again == outs[name]  # replays after prefix hits and slot reuse
            if name != "sdpa" or llm.model.layer_ops is not None:
                # Engines that launch Triton kernels on the K/V views (attention's,
                # or the layer ops' K/V write under sdpa) keep the sink in slot 0,
                # mapping the page where the views begin (Triton checks that address
                # at launch): the steps below run with every other page unmapped.
                assert [vt.slot for vt in llm.engine._sink] == [0] and llm.engine._sink[0].mapped_bytes > 0
                llm.kv_cache.clear_prefixes()
                llm.manager.trim()
                assert llm.manager.stats()["chunks_held"] == 1  # only the sink
                # Steps with every other page of the space unmapped (batch 1:
                # other kernel splits, so tokens may differ from the batch's).
                alone = llm.generate([prompts[3]], [params[3]], use_tqdm=False)[0]
                assert alone.finish_reason == "length", alone.error
                assert len(alone.token_ids) == params[3].max_tokens
    assert outs["graphs"] == outs["eager"]
    if dtype == "float32":
        assert outs["graphs"] == outs["sdpa"]
