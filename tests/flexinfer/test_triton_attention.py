"""The Triton attention kernels (src/flexinfer/kernels/triton_attention.py) against
a per-request float64 reference on the same KV-cache views (attention_cases.py).

Without a GPU the kernels run in Triton's interpreter on CPU tensors, in a child
process (triton_interpreter_child.py): triton must be imported with
TRITON_INTERPRET=1 to interpret, and setting it here would leak into every
other test module and break the compiled kernels this module also checks. The
same cases run in process on CUDA where there is one (`gpu`).

The over-read checks run in that child too, over real vtm host memory whose
pages past each request's length are unmapped, so a load past a length is a
SIGSEGV (a failed test, not a crashed pytest), with a negative control proving
that such a read does die.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

import vtm  # noqa: E402
from attention_cases import CASES, SHAPES, SPLIT_CASES, TOLERANCE, fill_rows, kv_views, row_elems  # noqa: E402
from attention_cases import reference_decode, scaled_error  # noqa: E402
from flexinfer.errors import InvalidArgument  # noqa: E402
from flexinfer.kernels import triton_attention  # noqa: E402

HERE = Path(__file__).resolve().parent


def _child(*args):
    return subprocess.run([sys.executable, str(HERE / "triton_interpreter_child.py"), *args], capture_output=True,
                          text=True, timeout=600, cwd=HERE)


def _last_json(result):
    assert result.returncode == 0, f"child died ({result.returncode}):\n{result.stdout}\n{result.stderr[-3000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def _check(name, result):
    assert "exception" not in result, result["exception"]
    assert result["error"] <= TOLERANCE[CASES[name].dtype], result
    if name in SPLIT_CASES:
        assert result["splits"] > 1, "the case does not exercise the split path"


@pytest.fixture(scope="module")
def interpreted_results():
    """Every case, run once in one interpreter process."""
    return _last_json(_child("cases"))


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_kernels_match_reference(name, interpreted_results):
    _check(name, interpreted_results[name])


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_kernels_match_reference(name):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device and a CUDA build of torch")
    _check(name, CASES[name].run(triton_attention, torch.device("cuda")))


def test_bad_input_is_invalid_argument():
    heads, kv_heads, head_dim = SHAPES["smollm2"]
    flat = torch.zeros(3, 16 * row_elems(2, kv_heads, head_dim))
    _, k, v = kv_views(flat, 16, 2, kv_heads, head_dim, 1)
    q = torch.zeros(2, heads, head_dim)
    strided = torch.zeros(3, 16, kv_heads, 2 * head_dim)[..., ::2]
    s = n = torch.tensor([1, 2], dtype=torch.int32)
    decode, prefill = triton_attention.decode_attention, triton_attention.prefill_attention
    bad = {
        "multiple of kv_heads": lambda: decode(q[:, :8], k, v, s, n),
        "head_dim must match": lambda: decode(q[..., :32], k, v, s, n),
        "share one dtype": lambda: decode(q.bfloat16(), k, v, s, n),
        "share one dtype of": lambda: decode(q.double(), k.double(), v.double(), s, n),
        "slots must be int32": lambda: decode(q, k, v, s.long(), n),
        "seq_lens must be int32 of shape": lambda: decode(q, k, v, s, n[:1]),
        "head_dim must be contiguous": lambda: decode(q, strided, strided, s, n),
        "out must be": lambda: decode(q, k, v, s, n, out=torch.empty(2, heads, head_dim, dtype=torch.bfloat16)),
        "3-D": lambda: decode(q[0], k, v, s, n),
        "slots must be int32 of shape": lambda: prefill(q, k, v, torch.tensor([0, 2], dtype=torch.int32), s, n),
        "cu_seqlens_q must be int32": lambda: prefill(q, k, v, torch.tensor([0, 1, 2]), s, n),
        "scale must be positive": lambda: decode(q, k, v, s, n, scale=0.0),
        "scale must be positive and finite": lambda: decode(q, k, v, s, n, scale=float("inf")),
        "window must be 0": lambda: prefill(q, k, v, torch.tensor([0, 1, 2], dtype=torch.int32), s, n, window=-1),
        "window an int": lambda: decode(q, k, v, s, n, window=2.5),
        "softcap must be 0": lambda: decode(q, k, v, s, n, softcap=-1.0),
        "softcap must be 0 \\(none\\) or positive and finite": lambda: decode(q, k, v, s, n, softcap=float("nan")),
        # Well-formed CPU tensors: the compiled kernels refuse them before any launch.
        "need CUDA tensors": lambda: decode(q, k, v, s, n),
    }
    for message, call in bad.items():
        with pytest.raises(InvalidArgument, match=message):
            call()


# -------------------------------------------------------------------------- over-reads on vtm memory


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernels_read_only_mapped_pages(dtype):
    """Pages past each request's length are unmapped: the kernels run to the end
    and still match the reference."""
    errors = _last_json(_child("vtm", dtype))
    assert set(errors) == {"decode", "decode_split", "prefill"}
    for name, err in errors.items():
        assert err <= TOLERANCE[getattr(torch, dtype)], (name, err)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernels_index_slots_past_2_31_elements(dtype):
    """A space of max_slots * max_tokens * row_bytes can exceed 2**31 elements
    (here: requests in slots of 2 GiB each past it): the kernels' K/V offsets
    are 64-bit, so they read the right rows, and nothing else is mapped there."""
    errors = _last_json(_child("far", dtype))
    assert set(errors) == {"decode", "decode_split", "prefill"}
    for name, err in errors.items():
        assert err <= TOLERANCE[getattr(torch, dtype)], (name, err)


def test_kernels_read_nothing_below_a_window():
    """Every row below each request's window (per call: its first query's) is
    PROT_NONE: decode, a decode window split over programs and prefill blocks
    run to the end and match the reference."""
    errors = _last_json(_child("window"))
    assert len(errors) == 9
    for name, err in errors.items():
        assert err <= TOLERANCE[torch.float32], (name, err)


def test_the_harness_catches_an_over_read():
    """The negative control: one row past a page-aligned length, read with plain
    torch in the same setup, kills the child with SIGSEGV."""
    result = _child("torch", "float32")
    assert result.returncode == -signal.SIGSEGV, (result.returncode, result.stdout, result.stderr[-3000:])
    assert "read" not in result.stdout


# -------------------------------------------------------------------------- GPU code generation on the CPU


def _signature(kernel, dtype):
    pointers = {"slots_ptr": "*i32", "lens_ptr": "*i32", "cu_ptr": "*i32", "acc_ptr": "*fp32", "m_ptr": "*fp32",
                "l_ptr": "*fp32"}
    sig = {}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointers.get(name, "*" + dtype)
        elif name in ("qk_scale", "softcap_log2"):
            sig[name] = "fp32"
        else:
            sig[name] = "i64" if name in ("stride_ks", "stride_vs") else "i32"
    return sig


def _compile_sm90(kernel, dtype, constexprs, warps):
    pytest.importorskip("triton.backends.nvidia")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=kernel, signature=_signature(kernel, dtype), constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def _spilled_bytes(binary) -> int:
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.is_file():
        pytest.skip("triton's nvidia backend has no cuobjdump")
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"flexinfer-triton-{os.getpid()}.cubin"
    try:
        path.write_bytes(binary.asm["cubin"])
        report = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(path)], capture_output=True,
                                text=True, check=True).stdout
    finally:
        path.unlink(missing_ok=True)
    return sum(int(x) for x in re.findall(r"STACK:(\d+)", report))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_compile_for_sm90_without_spills(dtype):
    """The interpreter accepts code the GPU compiler rejects (e.g. non-constexpr
    globals): compile every kernel for an H100 here, at SmolLM2's shapes and the
    tiles the wrapper picks, plain and with a window and a softcap, and check
    that no registers spill."""
    heads, kv_heads, head_dim = SHAPES["smollm2"]
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    dot_f32 = dtype == torch.float32
    rows, keys, block_d, warps = triton_attention._decode_tiles(dtype, heads // kv_heads, head_dim)
    binaries = [_compile_sm90(triton_attention._decode_merge_kernel, name, dict(NUM_SPLITS=16, BLOCK_D=block_d), 4)]
    for variant in (dict(SOFTCAP=False, WINDOWED=False), dict(SOFTCAP=True, WINDOWED=True)):
        binaries += [_compile_sm90(triton_attention._decode_split_kernel, name, dict(
            DOT_F32=dot_f32, NUM_SPLITS=splits, BLOCK_G=rows, BLOCK_N=keys, BLOCK_D=block_d, **variant), warps)
            for splits in (1, 16)]
    rows, keys, block_d, warps = triton_attention._prefill_tiles(dtype, head_dim)
    for variant in (dict(SOFTCAP=False, WINDOWED=False), dict(SOFTCAP=True, WINDOWED=True)):
        binaries.append(_compile_sm90(triton_attention._prefill_kernel, name, dict(
            DOT_F32=dot_f32, BLOCK_M=rows, BLOCK_N=keys, BLOCK_D=block_d, **variant), warps))
    for binary in binaries:
        assert _spilled_bytes(binary) == 0


# -------------------------------------------------------------------------- CUDA graphs on vtm memory


@pytest.mark.gpu
def test_decode_graph_replays_after_vtensors_grow():
    """decode_attention captured once in a CUDA graph; then every vTensor grows
    (vtm maps new pages under the same addresses), the lengths change in place,
    and the replay still matches the reference."""
    if not torch.cuda.is_available() or not vtm.cuda_available():
        pytest.skip("needs a CUDA device, a driver and a CUDA build of torch")
    heads, kv_heads, head_dim = SHAPES["smollm2"]
    layers, dtype, max_tokens = 30, torch.bfloat16, 4096
    row_bytes = row_elems(layers, kv_heads, head_dim) * dtype.itemsize
    mgr = vtm.Manager(backend="cuda", capacity_bytes=512 << 20, chunk_bytes=2 << 20)
    try:
        space = mgr.create_space(row_bytes=row_bytes, max_tokens=max_tokens, max_slots=8)
        seq_lens = [1, 100, 0, 700, 2000, 37]
        vts = [space.create(n).result() for n in seq_lens]
        rows, k, v = kv_views(space.tensor(dtype), max_tokens, layers, kv_heads, head_dim, 7)
        gen = torch.Generator().manual_seed(7)
        for vt, n in zip(vts, seq_lens):
            fill_rows(rows, vt.slot, 0, n, gen)
        slots = [vt.slot for vt in vts]
        q = torch.randn(len(vts), heads, head_dim, generator=gen).to(device="cuda", dtype=dtype)
        slots_t = torch.tensor(slots, dtype=torch.int32, device="cuda")
        lens_t = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        triton_attention.decode_attention(q, k, v, slots_t, lens_t, out=out)  # compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            triton_attention.decode_attention(q, k, v, slots_t, lens_t, out=out)
        graph.replay()
        torch.cuda.synchronize()
        assert scaled_error(out, reference_decode(q, k, v, slots, seq_lens)) <= TOLERANCE[dtype]

        grown = [n if n == 0 else n + 300 for n in seq_lens]  # the idle row stays idle
        for vt, old, new in zip(vts, seq_lens, grown):
            if new > old:
                vt.extend(new).result()
                fill_rows(rows, vt.slot, old, new, gen)
        lens_t.copy_(torch.tensor(grown, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=gen).to(device="cuda", dtype=dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert scaled_error(out, reference_decode(q, k, v, slots, grown)) <= TOLERANCE[dtype]
        assert torch.all(out[2] == 0)
        del graph, rows, k, v
        for vt in vts:
            vt.release().result()
    finally:
        mgr.close()
