"""FlexInfer on a CUDA device (skipped without a driver): the vtm cuda backend
under real kernels. The CPU float32 engine is the reference (it is itself
checked against transformers in test_engine.py)."""

from __future__ import annotations

import pytest
import torch

import vtm

pytestmark = pytest.mark.gpu
if not vtm.cuda_available() or not torch.cuda.is_available():
    pytest.skip("needs a CUDA driver, a device and a CUDA build of torch", allow_module_level=True)

transformers = pytest.importorskip("transformers")

from flexinfer import LLM, SamplingParams  # noqa: E402

PROMPTS = [[1, 17, 42, 99, 7], [1] + list(range(200, 260)), [1, 5] * 20]


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [o.token_ids for o in outs]


def test_cuda_float32_sdpa_matches_cpu(tiny_gpu_folder):
    cpu = LLM(tiny_gpu_folder, dtype="float32", backend="host", max_model_len=256, max_num_seqs=4)
    expected = _greedy(cpu, PROMPTS)
    cpu.close()
    gpu = LLM(tiny_gpu_folder, dtype="float32", backend="cuda", attention="sdpa", max_model_len=256, max_num_seqs=4)
    assert gpu.manager.backend == "cuda" and gpu.kv_cache.device.type == "cuda"
    assert _greedy(gpu, PROMPTS) == expected
    again = _greedy(gpu, [p + t for p, t in zip(PROMPTS, expected)])  # prefix reuse on the GPU
    gpu.manager.check()
    gpu.kv_cache.space.clear_prefixes()
    gpu.manager.trim()
    # Only the sink stays: under sdpa the Triton layer ops still write K/V
    # through the views, and Triton checks the address where they begin.
    assert gpu.manager.stats()["chunks_held"] == (1 if gpu.engine._keeps_sink else 0)
    assert all(len(t) == 24 for t in again)
    gpu.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_flash_attn_matches_sdpa(tiny_gpu_folder, dtype):
    pytest.importorskip("flash_attn")
    outs = {}
    for attention in ("sdpa", "flash_attn"):
        llm = LLM(tiny_gpu_folder, dtype=dtype, backend="cuda", attention=attention, max_model_len=256, max_num_seqs=4)
        outs[attention] = _greedy(llm, PROMPTS)
        llm.close()
    # Not exact, for a numerical reason: two kernels that sum the same products
    # in different orders round differently in 16-bit precision (~3 decimal
    # digits), so a greedy step whose two best logits are that close may pick
    # either. One near-tie among the prompts is allowed; a broken cache would
    # change every prompt.
    agree = sum(a == b for a, b in zip(outs["sdpa"], outs["flash_attn"]))
    assert agree >= len(PROMPTS) - 1, outs


def test_shared_prompts_and_parallel_samples_match_cpu(tiny_gpu_folder):
    """Issue 17, finding 1: parallel samples (n > 1) and prompts sharing a
    prefix attend over KV that vtm copied from pages the prefill kernels
    were still writing when the prompt was recorded. Exactly the CPU
    engine's tokens, over several rounds (the race is one of timing)."""
    base = [1] + list(range(300, 420))
    prompts = [base + [5, 6, 7], base + [9], base[:70] + [11, 12]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, n=3)
    cpu = LLM(tiny_gpu_folder, dtype="float32", backend="host", max_model_len=256, max_num_seqs=8)
    expected = [[o.token_ids for o in out.outputs] for out in cpu.generate(prompts, params, use_tqdm=False)]
    cpu.close()
    gpu = LLM(tiny_gpu_folder, dtype="float32", backend="cuda", attention="sdpa", max_model_len=256, max_num_seqs=8)
    for _ in range(3):
        got = [[o.token_ids for o in out.outputs] for out in gpu.generate(prompts, params, use_tqdm=False)]
        assert got == expected
        gpu.kv_cache.space.clear_prefixes()
    gpu.manager.check()
    gpu.close()


def test_cuda_bytes_survive_sharing():
    """Bytes written through a CUDA view of one vTensor are read back through a
    matched vTensor's pages (shared chunks and the copy-on-write page)."""
    mgr = vtm.Manager(backend="cuda", capacity_bytes=64 << 21, chunk_bytes=2 << 20)
    space = mgr.create_space(row_bytes=46080, max_tokens=512, max_slots=4)
    kv = space.tensor(torch.uint8)
    assert kv.device.type == "cuda"
    vt = space.create(200).result()
    rows = kv[vt.slot, : 200 * 46080].view(200, 46080)
    rows.copy_(torch.arange(200, device="cuda", dtype=torch.uint8)[:, None].expand(200, 46080))
    torch.cuda.synchronize()
    tokens = list(range(200))
    space.prefix_record(vt, tokens).result()
    match = space.prefix_match(tokens[:150] + [999]).result()
    assert match.num_tokens == 150
    got = kv[match.vtensor.slot, : 150 * 46080].view(150, 46080)
    assert torch.equal(got[:, 0].cpu(), torch.arange(150, dtype=torch.uint8))
    assert torch.equal(got[:, -1].cpu(), torch.arange(150, dtype=torch.uint8))
    match.vtensor.release().result()
    vt.release().result()
    mgr.check()
    del kv, rows, got
    mgr.close()


@pytest.fixture(scope="module")
def sliding_folders(tmp_path_factory, save_word_tokenizer):
    """Tiny Gemma 3 (sliding and full layers, q/k norms, two RoPE bases) and
    Mistral (every layer sliding), windows of 8 keys (test_families.py's)."""
    from test_families import VOCAB, _family

    folders = {}
    for seed, name in enumerate(("gemma3", "mistral-sliding")):
        model_class, config = _family(name)
        torch.manual_seed(seed)
        folder = tmp_path_factory.mktemp(name)
        model_class(config).save_pretrained(folder)
        save_word_tokenizer(folder, VOCAB)
        folders[name] = str(folder)
    return folders


@pytest.mark.parametrize("name", ["gemma3", "mistral-sliding"])
def test_sliding_window_models_on_cuda_match_cpu(sliding_folders, name):
    """The Triton kernels' windows and the window spaces on the cuda backend
    (CUDA graphs included): float32 greedy tokens equal the CPU engine's on
    prompts longer than the window, with prefix hits on the second round."""
    folder = sliding_folders[name]
    prompts = [[1] + list(range(3, 40)), [1, 5, 9] * 7, [1, 200, 201]]
    with LLM(folder, dtype="float32", backend="host", max_model_len=128, max_num_seqs=4) as cpu:
        expected = _greedy(cpu, prompts)
    with LLM(folder, dtype="float32", backend="cuda", max_model_len=128, max_num_seqs=4) as gpu:
        assert gpu.kv_cache.windows[-1] == 8 and gpu.kv_cache.device.type == "cuda"
        for _ in range(2):
            assert _greedy(gpu, prompts) == expected
        gpu.manager.check()


def test_triton_layer_ops_equal_the_torch_code_on_cuda():
    """triton_layer_ops.py's checks (test_triton_layer_ops.py runs them in the
    interpreter) on the GPU, where a conversion to bfloat16 rounds to nearest:
    the residual add bit for bit in every dtype, the rotary embedding and the
    K/V write within a unit in the last place (the compiler fuses an FMA), the
    model's forward on them close to the torch ops'."""
    import sys
    from pathlib import Path

    here = str(Path(__file__).resolve().parent)
    sys.path.insert(0, here)
    try:
        from test_triton_layer_ops import check_layer_op_results
        from triton_layer_ops_child import run_checks
    finally:
        sys.path.remove(here)
    check_layer_op_results(run_checks("cuda"), bfloat16_rounds=True)


def test_triton_linear_equals_the_torch_code_on_cuda():
    """triton_linear.py's checks (test_triton_linear.py runs them in the
    interpreter) on the GPU, where a conversion to bfloat16 rounds to nearest."""
    import sys
    from pathlib import Path

    here = str(Path(__file__).resolve().parent)
    sys.path.insert(0, here)
    try:
        from test_triton_linear import check_triton_linear_results
        from triton_linear_child import run_checks
    finally:
        sys.path.remove(here)
    check_triton_linear_results(run_checks("cuda"), bfloat16_rounds=True)


def test_the_fused_decode_layers_decode_the_tokens_of_the_separate_ones(tiny_gpu_folder):
    """float32 greedy tokens with linear="triton" (decode steps of up to 8
    rows on the fused kernels), in CUDA graphs and eager, equal linear="torch"'s;
    linear="auto" timed them and chose per row bucket."""
    tokens = {}
    for name, kwargs in {"fused": dict(linear="triton"), "fused eager": dict(linear="triton", cuda_graphs=False),
                         "separate": dict(linear="torch"), "auto": dict(linear="auto")}.items():
        with LLM(tiny_gpu_folder, dtype="float32", backend="cuda", max_model_len=256, max_num_seqs=4,
                 **kwargs) as llm:
            if name.startswith("fused"):
                assert llm.model.fused_kinds == {1: "triton", 8: "triton"}
            elif name == "separate":
                assert llm.model.fused_kinds == {}
            else:
                assert set(llm.model.fused_kinds) == {1, 8}
                assert set(llm.model.fused_kinds.values()) <= {"triton", "torch"}
            tokens[name] = _greedy(llm, PROMPTS)
            llm.manager.check()
    assert tokens["fused"] == tokens["fused eager"] == tokens["separate"] == tokens["auto"]


def test_cuda_models_run_the_triton_layer_ops(tiny_gpu_folder):
    """The CUDA engine's decoder uses the fused ops (and adds the residual in the norms)."""
    from flexinfer.kernels import triton_layer_ops

    with LLM(tiny_gpu_folder, dtype="bfloat16", backend="cuda", max_model_len=128, max_num_seqs=2) as gpu:
        assert gpu.model.layer_ops is triton_layer_ops and gpu.model.norm_adds_residual


def test_the_draw_kernel_is_compiled_at_load_where_the_batch_can_use_it(tiny_gpu_folder):
    """Triton compiles a kernel on its first launch: the engine compiles the
    sampler's draw kernel at load, so no step of a busy server waits for it."""
    from flexinfer.sampling import DRAW_KERNEL_FROM_ROWS

    with LLM(tiny_gpu_folder, dtype="bfloat16", backend="cuda", max_model_len=128,
             max_num_seqs=DRAW_KERNEL_FROM_ROWS) as gpu:
        assert gpu.engine.draw_kernel_warm
        prompts = [[1, 5 + i, 6] for i in range(DRAW_KERNEL_FROM_ROWS)]
        outs = gpu.generate(prompts, SamplingParams(max_tokens=3, temperature=0.8, top_p=0.9, seed=7),
                            use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
    with LLM(tiny_gpu_folder, dtype="bfloat16", backend="cuda", max_model_len=128,
             max_num_seqs=DRAW_KERNEL_FROM_ROWS - 1) as small:
        assert not small.engine.draw_kernel_warm  # its batches never reach the kernel
