"""The CPU attention kernel against per-request SDPA and the float64 reference
of attention_cases.py (with per-layer scale, window and softcap), on random
caches, on real vtm host-backend memory where every page past a request's
length is unmapped, and on memory where every row below a window is PROT_NONE
(an over-read kills the process: those checks run in a subprocess)."""

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from attention_cases import CASES
from attention_cases import TOLERANCE as CASE_TOLERANCE
from attention_cases import reference_decode

from flexinfer.errors import InvalidArgument
from flexinfer.kernels import cpu_attention
from flexinfer.kernels.cpu_attention import decode_attention, prefill_attention

HERE = Path(__file__).resolve().parent

TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def make_cache(slots, tokens, kv_heads, dim, dtype, layers=2, seed=0):
    """K and V views of layer 1 of a token-major [slot, token, layer, k|v, head, dim] block, like KVCache's."""
    gen = torch.Generator().manual_seed(seed)
    block = torch.randn(slots, tokens, layers, 2, kv_heads, dim, generator=gen).to(dtype)
    return block[:, :, 1, 0], block[:, :, 1, 1]


def reference(q, k, v, cu, slots, lens):
    """Per-request SDPA in float64, causal aligned to the end of each request."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(len(slots)):
        n, length = int(cu[b + 1] - cu[b]), int(lens[b])
        if n == 0:
            continue
        kk = k[int(slots[b]), :length].permute(1, 0, 2)[None].double()
        vv = v[int(slots[b]), :length].permute(1, 0, 2)[None].double()
        qb = q[cu[b]:cu[b + 1]].transpose(0, 1)[None].double()
        mask = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
        out[cu[b]:cu[b + 1]] = F.scaled_dot_product_attention(qb, kk, vv, attn_mask=mask,
                                                              enable_gqa=True)[0].transpose(0, 1)
    return out


def int32(values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (8, 1, 128)])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_matches_sdpa(dtype, heads, kv_heads, dim, threads):
    k, v = make_cache(6, 1100, kv_heads, dim, dtype)
    slots, lens = int32([5, 0, 3, 2, 1]), int32([1, 37, 1100, 0, 257])
    q = torch.randn(5, heads, dim).to(dtype)
    out = decode_attention(q, k, v, slots, lens, threads=threads)
    ref = reference(q, k, v, torch.arange(6), slots, lens)
    assert (out[3] == 0).all()  # the idle row
    assert (out.double() - ref).abs().max() < TOLERANCE[dtype] * 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_long_decode_split_across_threads_matches_sdpa(dtype, threads):
    """One request with a long context is split into pieces merged afterwards."""
    k, v = make_cache(2, 5000, 3, 64, dtype)
    q = torch.randn(1, 9, 64).to(dtype)
    for length in (255, 256, 257, 1023, 4999, 5000):
        out = decode_attention(q, k, v, int32([1]), int32([length]), threads=threads)
        ref = reference(q, k, v, torch.arange(2), int32([1]), int32([length]))
        assert (out.double() - ref).abs().max() < TOLERANCE[dtype] * 10, length


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_and_chunks_continuing_a_prefix_match_sdpa(dtype, threads):
    """Whole prompts (n == len), chunks after a cached prefix (n < len), single tokens and empty entries."""
    k, v = make_cache(5, 700, 3, 64, dtype)
    slots, lens, new = int32([4, 0, 2, 3, 1]), int32([40, 700, 33, 1, 9]), [40, 65, 1, 1, 0]
    cu = torch.zeros(6, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(new), 0)
    q = torch.randn(int(cu[-1]), 9, 64).to(dtype)
    out = prefill_attention(q, k, v, cu, slots, lens, threads=threads)
    assert (out.double() - reference(q, k, v, cu, slots, lens)).abs().max() < TOLERANCE[dtype] * 10


def test_output_in_place_and_strided_queries():
    """q may be a strided slice of the fused qkv projection; out is written in place."""
    k, v = make_cache(3, 50, 3, 64, torch.float32)
    qkv = torch.randn(2, 9 + 6, 64)
    q = qkv[:, :9]
    out = torch.full((2, 9, 64), float("nan"))
    result = decode_attention(q, k, v, int32([2, 0]), int32([50, 7]), out=out)
    assert result is out
    assert (out.double() - reference(q, k, v, torch.arange(3), int32([2, 0]), int32([50, 7]))).abs().max() < 1e-5


@pytest.mark.parametrize("case", ["slot", "negative_slot", "length", "negative_length", "queries", "offsets",
                                  "dtype", "heads", "lengths_dtype"])
def test_bad_arguments_raise_and_write_nothing(case):
    k, v = make_cache(3, 64, 3, 64, torch.float32)
    slots, lens, q = int32([0, 1]), int32([5, 6]), torch.randn(2, 9, 64)
    cu = int32([0, 1, 2])
    if case == "slot":
        slots = int32([0, 3])
    elif case == "negative_slot":
        slots = int32([-1, 0])
    elif case == "length":
        lens = int32([5, 65])
    elif case == "negative_length":
        lens = int32([5, -1])
    elif case == "queries":
        cu, lens = int32([0, 1, 2]), int32([5, 0])
    elif case == "offsets":
        cu = int32([0, 2, 1])
    elif case == "dtype":
        q = q.double()
    elif case == "heads":
        q = torch.randn(2, 8, 64)
    elif case == "lengths_dtype":
        lens = torch.tensor([5, 6])
    out = torch.full(q.shape, 7.0, dtype=q.dtype)
    with pytest.raises(InvalidArgument):
        if case in ("queries", "offsets"):
            prefill_attention(q, k, v, cu, slots, lens, out=out)
        else:
            decode_attention(q, k, v, slots, lens, out=out)
    assert (out == 7.0).all()


# A K/V cache on vtm host memory: 64 KiB pages, 1536-byte rows (3 kv heads x 64
# dims x K|V, float32), so a length of 128 rows ends exactly on a page boundary
# and row 128 lies on an unmapped page.
VTM_CACHE = """
import sys
import torch
import vtm
import torch.nn.functional as F
from flexinfer.kernels.cpu_attention import decode_attention, prefill_attention

KVH, D = 3, 64
row_bytes = 2 * KVH * D * 4
mgr = vtm.Manager(backend="host", capacity_bytes=256 << 16, chunk_bytes=1 << 16, granularity=1 << 16)
space = mgr.create_space(row_bytes=row_bytes, max_tokens=1024, max_slots=8)
flat = space.tensor(torch.float32)
rows = flat[:, : 1024 * 2 * KVH * D].view(8, 1024, 2, KVH, D)
k, v = rows[:, :, 0], rows[:, :, 1]
lengths = [128, 256, 85, 1, 640]
vts = [space.create(n).result() for n in lengths]
gen = torch.Generator().manual_seed(0)
for vt, n in zip(vts, lengths):
    assert (n * row_bytes) % (1 << 16) != 0 or vt.page_chunks()[n * row_bytes >> 16] is None
    rows[vt.slot, :n] = torch.randn(n, 2, KVH, D, generator=gen)
slots = torch.tensor([vt.slot for vt in vts], dtype=torch.int32)
lens = torch.tensor(lengths, dtype=torch.int32)
"""

VTM_CHECK = VTM_CACHE + """
def ref(qb, b):
    L, n = lengths[b], qb.shape[0]
    kk = k[slots[b], :L].permute(1, 0, 2)[None]
    vv = v[slots[b], :L].permute(1, 0, 2)[None]
    mask = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
    return F.scaled_dot_product_attention(qb.transpose(0, 1)[None], kk, vv, attn_mask=mask,
                                          enable_gqa=True)[0].transpose(0, 1)

for threads in (1, 2):
    q = torch.randn(len(lengths), 9, D, generator=gen)
    out = decode_attention(q, k, v, slots, lens, threads=threads)
    for b in range(len(lengths)):
        assert (out[b:b + 1] - ref(q[b:b + 1], b)).abs().max() < 1e-5
    new = [128, 3, 85, 1, 17]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(new), 0)
    q = torch.randn(int(cu[-1]), 9, D, generator=gen)
    out = prefill_attention(q, k, v, cu, slots, lens, threads=threads)
    for b in range(len(lengths)):
        assert (out[cu[b]:cu[b + 1]] - ref(q[cu[b]:cu[b + 1]], b)).abs().max() < 1e-5
print("OK")
"""


def run_python(source, tmp_path):
    script = tmp_path / "check.py"
    script.write_text(SAME_KERNELS + textwrap.dedent(source))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=_env())


def _env():
    import os

    env = dict(os.environ)
    # Under `make test-sanitize` AddressSanitizer would turn the fault a
    # read of an unmapped page takes into its own report and an abort:
    # leave faults to the kernel, so the harness sees SIGSEGV either way.
    env["ASAN_OPTIONS"] = ":".join(filter(None, [env.get("ASAN_OPTIONS"), "handle_segv=0"]))
    return env


# Under `make test-isa` and `make test-sanitize` the subprocess loads the
# kernels this process does: those of FLEXINFER_KERNELS_DIR (see conftest.py).
SAME_KERNELS = """
import os
import flexinfer
if os.environ.get("FLEXINFER_KERNELS_DIR"):
    flexinfer.__path__.insert(0, os.environ["FLEXINFER_KERNELS_DIR"])
"""


def test_kernel_reads_only_each_requests_own_rows_on_vtm_memory(tmp_path):
    result = run_python(VTM_CHECK, tmp_path)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


def test_over_read_harness_catches_a_read_past_the_length(tmp_path):
    """Negative control: reading row 128 of the 128-row request faults, so the
    check above would have caught a kernel that over-reads."""
    result = run_python(VTM_CACHE + "\nprint(float(k[slots[0], 128].sum()))\nprint('read')\n", tmp_path)
    assert result.returncode == -11 and "read" not in result.stdout, (result.returncode, result.stderr[-2000:])


def test_plan_runs_every_layer_like_the_checked_calls():
    """The engine's path: one Plan per pass, one run per layer."""
    from flexinfer.kernels.cpu_attention import Plan

    block = torch.randn(4, 80, 3, 2, 3, 64)  # three layers
    slots, lens = int32([3, 1]), int32([80, 5])
    cu = int32([0, 4, 9])
    q = torch.randn(9, 9, 64)
    plan = Plan(slots, lens, cu)
    for layer in range(3):
        k, v = block[:, :, layer, 0], block[:, :, layer, 1]
        out = plan.run(q, k, v, torch.empty_like(q))
        assert torch.equal(out, prefill_attention(q, k, v, cu, slots, lens))
    with pytest.raises(InvalidArgument):
        Plan(slots, lens, int32([0, 4]))
    bad = Plan(int32([4, 1]), lens, cu)  # slot 4 is past the view: the kernel refuses before reading
    with pytest.raises(InvalidArgument):
        bad.run(q, block[:, :, 0, 0], block[:, :, 0, 1], torch.empty_like(q))


# -------------------------------------------------------------------------- per-layer variants


@pytest.mark.parametrize("name", list(CASES))
def test_shared_cases_match_the_float64_reference(name):
    """attention_cases' cases (the Triton kernels' too): windows of 1, 3, 17 keys,
    longer than every sequence and than the slot, softcap 0 and 5, scale
    overrides, GQA, mixed lengths, chunks continuing a prefix; every row below a
    window is NaN."""
    case = CASES[name]
    assert case.run(cpu_attention, torch.device("cpu"))["error"] <= CASE_TOLERANCE[case.dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_long_decode_split_over_its_window_only(dtype, threads):
    """A long context with a window splits the window, not the context: the rows
    below it are NaN and the result still matches."""
    q = torch.randn(1, 9, 64).to(dtype)
    for length, window, softcap in ((5000, 600, 0.0), (5000, 1100, 5.0), (4999, 257, 0.0), (300, 4000, 5.0)):
        k, v = make_cache(2, 5000, 3, 64, dtype)
        k[1, :max(0, length - window)] = v[1, :max(0, length - window)] = float("nan")
        out = decode_attention(q, k, v, int32([1]), int32([length]), threads=threads, window=window,
                               softcap=softcap)
        ref = reference_decode(q, k, v, [1], [length], window=window, softcap=softcap)
        assert (out.double() - ref).abs().max() < TOLERANCE[dtype] * 10, (length, window)


def test_plan_runs_variants_like_the_checked_calls():
    """Plan.run takes the layer's variant; it equals prefill_attention's."""
    from flexinfer.kernels.cpu_attention import Plan

    block = torch.randn(4, 80, 2, 2, 3, 64)
    k, v = block[:, :, 1, 0], block[:, :, 1, 1]
    slots, lens, cu = int32([3, 1]), int32([80, 5]), int32([0, 4, 9])
    q = torch.randn(9, 9, 64)
    plan = Plan(slots, lens, cu)
    for scale, window, softcap in ((None, 0, 0.0), (0.2, 3, 0.0), (None, 0, 30.0), (0.5, 70, 5.0)):
        out = plan.run(q, k, v, torch.empty_like(q), scale, window, softcap)
        assert torch.equal(out, prefill_attention(q, k, v, cu, slots, lens, scale=scale, window=window,
                                                  softcap=softcap))
    default = plan.run(q, k, v, torch.empty_like(q))
    assert torch.equal(default, plan.run(q, k, v, torch.empty_like(q), 64 ** -0.5, 0, 0.0))


BAD_VARIANTS = {"scale 0": dict(scale=0.0), "negative scale": dict(scale=-1.0), "NaN scale": dict(scale=math.nan),
                "infinite scale": dict(scale=math.inf), "negative window": dict(window=-1),
                "fractional window": dict(window=2.5), "negative softcap": dict(softcap=-1.0),
                "NaN softcap": dict(softcap=math.nan), "infinite softcap": dict(softcap=math.inf)}


@pytest.mark.parametrize("bad", list(BAD_VARIANTS))
def test_bad_variants_raise_and_write_nothing(bad):
    from flexinfer.kernels.cpu_attention import Plan

    k, v = make_cache(3, 64, 3, 64, torch.float32)
    slots, lens, q = int32([0, 1]), int32([5, 6]), torch.randn(2, 9, 64)
    out = torch.full(q.shape, 7.0)
    with pytest.raises(InvalidArgument):
        decode_attention(q, k, v, slots, lens, out=out, **BAD_VARIANTS[bad])
    with pytest.raises(InvalidArgument):
        prefill_attention(q, k, v, int32([0, 1, 2]), slots, lens, out=out, **BAD_VARIANTS[bad])
    with pytest.raises(InvalidArgument):
        Plan(slots, lens).run(q, k, v, out, **BAD_VARIANTS[bad])
    assert (out == 7.0).all()


# Rows below each request's window made PROT_NONE (attention_cases.GuardedRows):
# float32 rows of 2 layers x K|V x 2 kv heads x 128 dims are two whole pages.
GUARDED_CACHE = """
import sys
sys.path.insert(0, {here!r})
import torch
from attention_cases import GuardedRows, TOLERANCE, cu_seqlens, fill_rows, reference_decode, reference_prefill
from attention_cases import scaled_error, window_start
from flexinfer.kernels.cpu_attention import decode_attention, prefill_attention

HEADS, KVH, D = 4, 2, 128
lengths = [1200, 37, 1, 300, 129]
cache = GuardedRows(len(lengths), 1200, 2, KVH, D, torch.float32)
gen = torch.Generator().manual_seed(0)
for slot, n in enumerate(lengths):
    fill_rows(cache.rows, slot, 0, n, gen)
k, v = cache.k, cache.v
"""

GUARDED_CHECK = GUARDED_CACHE + """
def i32(values):
    return torch.tensor(values, dtype=torch.int32)

guarded = cache.run_guarded
for window, softcap in ((1, 0.0), (17, 5.0), (520, 0.0)):
    variant = dict(window=window, softcap=softcap)
    for threads in (1, 2):
        q = torch.randn(len(lengths), HEADS, D, generator=gen)
        out = guarded([window_start(n - 1, window) for n in lengths],
                      lambda: decode_attention(q, k, v, i32(range(5)), i32(lengths), threads=threads, **variant))
        assert scaled_error(out, reference_decode(q, k, v, list(range(5)), lengths, **variant)) < 1e-5
        # Batch 1: the window splits over the threads.
        out = guarded([window_start(lengths[0] - 1, window)],
                      lambda: decode_attention(q[:1], k, v, i32([0]), i32(lengths[:1]), threads=threads, **variant))
        assert scaled_error(out, reference_decode(q[:1], k, v, [0], lengths[:1], **variant)) < 1e-5
        new = [70, 37, 1, 5, 16]
        cu = cu_seqlens(new)
        q = torch.randn(cu[-1], HEADS, D, generator=gen)
        out = guarded([window_start(n - m, window) for n, m in zip(lengths, new)],
                      lambda: prefill_attention(q, k, v, i32(cu), i32(range(5)), i32(lengths), threads=threads,
                                                **variant))
        assert scaled_error(out, reference_prefill(q, k, v, cu, list(range(5)), lengths, **variant)) < 1e-5
print("OK")
"""


def test_kernel_reads_nothing_below_a_window(tmp_path):
    """Every row below each request's window (per call: its first query's) is
    PROT_NONE: decode, a decode window split over threads and prefill chunks
    run to the end and match the float64 reference."""
    result = run_python(GUARDED_CHECK.format(here=str(HERE)), tmp_path)
    assert result.returncode == 0 and "OK" in result.stdout, (result.returncode, result.stderr[-3000:])


def test_window_harness_catches_a_read_below_the_window(tmp_path):
    """Negative control: with rows below 600 guarded, reading row 599 faults."""
    source = GUARDED_CACHE.format(here=str(HERE)) + textwrap.dedent("""
        cache.guard(0, 600)
        print(float(k[0, 599].sum()))
        print("read")
        """)
    result = run_python(source, tmp_path)
    assert result.returncode == -11 and "read" not in result.stdout, (result.returncode, result.stderr[-2000:])


# -------------------------------------------------------------------------- attention.py's CPU backends


@pytest.mark.parametrize("kind", ["prefill", "decode"])
@pytest.mark.parametrize("window,softcap,scale", [(0, 0.0, None), (0, 5.0, 0.3), (1, 0.0, None), (17, 5.0, None),
                                                  (17, 0.0, 0.3), (1000, 5.0, None)])
def test_backends_take_the_layer_variant(kind, window, softcap, scale):
    """SdpaAttention (the reference, explicit when capped) and KernelAttention
    give the float64 reference's output for a layer's variant, reading no row
    below a window (those rows are NaN)."""
    from types import SimpleNamespace

    from attention_cases import cu_seqlens, fill_rows, kv_views, reference_prefill, row_elems, window_start

    from flexinfer.attention import KernelAttention, SdpaAttention
    from flexinfer.model.llama import ForwardBatch

    heads, kv_heads, dim, max_tokens = 9, 3, 64, 128
    starts, new_lens = ([0, 40, 89, 0, 10], [40, 23, 1, 1, 20]) if kind == "prefill" else ([0, 40, 89, 5], [1] * 4)
    slots = [4, 1, 2, 3, 0][:len(starts)]
    flat = torch.full((5, max_tokens * row_elems(2, kv_heads, dim)), float("nan"))
    rows, k, v = kv_views(flat, max_tokens, 2, kv_heads, dim, 1)
    gen = torch.Generator().manual_seed(3)
    for slot, start, n in zip(slots, starts, new_lens):
        fill_rows(rows, slot, 0, start + n, gen)
        rows[slot, :window_start(start, window)] = float("nan")
    cache = SimpleNamespace(k=[k], v=[v], k_heads=[k.permute(0, 2, 1, 3)], v_heads=[v.permute(0, 2, 1, 3)],
                            group_of=[0], max_tokens=max_tokens, device=torch.device("cpu"))
    batch = ForwardBatch.build(slots, starts, new_lens, torch.device("cpu"))
    q = torch.randn(sum(new_lens), heads, dim, generator=gen)
    lens = [s + n for s, n in zip(starts, new_lens)]
    ref = reference_prefill(q, k, v, cu_seqlens(new_lens), slots, lens, scale, window, softcap)
    for backend in (SdpaAttention(), KernelAttention(torch.device("cpu"))):
        backend.prepare(batch, cache)
        out = backend.forward(0, q, batch, cache, scale=scale, window=window, softcap=softcap)
        assert (out.double() - ref).abs().max() < 1e-5, backend.name
    sdpa = SdpaAttention()
    sdpa.prepare(batch, cache)
    with pytest.raises(InvalidArgument):
        sdpa.forward(0, q, batch, cache, window=-1)
