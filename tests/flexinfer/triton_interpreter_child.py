"""Runs the Triton attention kernels in Triton's interpreter, in a process of its
own (run as a script by test_triton_attention.py).

Triton decides whether kernels are interpreted when it is imported (its own
library functions are jit functions too), so TRITON_INTERPRET=1 is set here,
before the import, and never in the pytest process.

    triton_interpreter_child.py cases        every attention_cases.CASES under the interpreter on CPU
                                             tensors; prints {case: result} as JSON
    triton_interpreter_child.py vtm DTYPE    the over-read check: K/V in REAL vtm host-backend memory,
                                             each request mapping exactly the pages its length needs,
                                             several lengths ending on a page boundary (the next row is
                                             PROT_NONE); a load past a length is SIGSEGV. Prints the
                                             kernels' errors against the reference as JSON
    triton_interpreter_child.py torch DTYPE  the negative control: the same setup, then one row past a
                                             page-aligned length read with plain torch (must die)
    triton_interpreter_child.py window       the window bound: K/V on memory where every row below each
                                             request's window (per call: its first query's) is PROT_NONE
                                             (attention_cases.GuardedRows); a load below a window is SIGSEGV.
                                             Prints the kernels' errors against the reference as JSON
    triton_interpreter_child.py far DTYPE    requests in slots whose K/V lie more than 2**31 elements
                                             past the views' base (a space of 2 GiB slots, only reserved):
                                             an offset computed in int32 would wrap to another address.
                                             Prints the kernels' errors against the reference as JSON
"""

from __future__ import annotations

import json
import os
import sys

# Before triton is imported: it decides at decoration time whether kernels are interpreted.
os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import vtm  # noqa: E402

from attention_cases import (CASES, GuardedRows, cu_seqlens, fill_rows, kv_views, reference_decode,  # noqa: E402
                             reference_prefill, scaled_error, window_start)

PAGE = 64 << 10
LAYERS, KV_HEADS, HEADS, HEAD_DIM, LAYER = 2, 3, 9, 64, 1  # SmolLM2's heads: rows straddle pages


def run_cases() -> None:
    from flexinfer.kernels import triton_attention

    results = {}
    for name, case in CASES.items():
        try:
            results[name] = case.run(triton_attention, torch.device("cpu"))
        except Exception as exc:  # reported per case, so that one failure does not hide the others
            results[name] = {"exception": repr(exc)}
    print(json.dumps(results), flush=True)


def on_vtm_memory(mode: str, dtype_name: str) -> None:
    dtype = getattr(torch, dtype_name)
    row_bytes = LAYERS * 2 * KV_HEADS * HEAD_DIM * dtype.itemsize
    # Rows do not divide a page (most straddle two), but `aligned` rows fill
    # exactly three pages: a length that is a multiple of it ends on a page
    # boundary, so the very next row is unmapped.
    assert PAGE % row_bytes and 3 * PAGE % row_bytes == 0
    aligned = 3 * PAGE // row_bytes
    # Page-aligned lengths, a single token, an idle request whose slot maps
    # nothing, a length whose last row straddles two pages.
    seq_lens = [aligned, 1, 2 * aligned, 0, aligned // 3 + 1, 3 * aligned]
    new_lens = [aligned, 1, aligned // 2, 0, aligned // 3 + 1, 5]
    max_tokens = 4 * aligned
    mgr = vtm.Manager(backend="host", capacity_bytes=64 * PAGE, chunk_bytes=PAGE, granularity=PAGE)
    space = mgr.create_space(row_bytes=row_bytes, max_tokens=max_tokens, max_slots=len(seq_lens))
    vts = [space.create(n).result() for n in seq_lens]
    for vt, n in zip(vts, seq_lens):
        pages = vt.page_chunks()
        needed = -(-n * row_bytes // PAGE)
        assert all(c is not None for c in pages[:needed]) and all(c is None for c in pages[needed:]), pages
    rows, k, v = kv_views(space.tensor(dtype), max_tokens, LAYERS, KV_HEADS, HEAD_DIM, LAYER)
    gen = torch.Generator().manual_seed(0)
    for vt, n in zip(vts, seq_lens):
        fill_rows(rows, vt.slot, 0, n, gen)
    # The batch lists requests in another order than their slots.
    order = [4, 0, 3, 5, 1, 2]
    slots = [vts[i].slot for i in order]
    lens = [seq_lens[i] for i in order]
    news = [new_lens[i] for i in order]

    if mode == "torch":
        aligned = vts[0]
        print("read", float(k[aligned.slot, seq_lens[0], 0, 0]), flush=True)  # must fault
        return

    from flexinfer.kernels.triton_attention import decode_attention, prefill_attention

    i32 = dict(dtype=torch.int32)
    errors = {}
    q = torch.randn(len(slots), HEADS, HEAD_DIM, generator=gen).to(dtype)
    out = decode_attention(q, k, v, torch.tensor(slots, **i32), torch.tensor(lens, **i32))
    errors["decode"] = scaled_error(out, reference_decode(q, k, v, slots, lens))
    # Batch 1 over the longest context: several splits, the trailing ones empty.
    one = [vts[5].slot]
    out = decode_attention(q[:1], k, v, torch.tensor(one, **i32), torch.tensor([3 * aligned], **i32))
    errors["decode_split"] = scaled_error(out, reference_decode(q[:1], k, v, one, [3 * aligned]))
    cu = cu_seqlens(news)
    q = torch.randn(cu[-1], HEADS, HEAD_DIM, generator=gen).to(dtype)
    out = prefill_attention(q, k, v, torch.tensor(cu, **i32), torch.tensor(slots, **i32), torch.tensor(lens, **i32),
                            max_q_len=max(news))
    errors["prefill"] = scaled_error(out, reference_prefill(q, k, v, cu, slots, lens))
    print(json.dumps(errors), flush=True)
    del rows, k, v, q, out
    for vt in vts:
        vt.release().result()
    mgr.close()


def on_far_slots(dtype_name: str) -> None:
    dtype = getattr(torch, dtype_name)
    row_bytes = LAYERS * 2 * KV_HEADS * HEAD_DIM * dtype.itemsize
    max_tokens = (2 << 30) // row_bytes  # slots of about 2 GiB: VA only, nothing is mapped but the rows used
    first_far = -(-(2**31) * dtype.itemsize // (max_tokens * row_bytes))  # the first slot past 2**31 elements
    seq_lens = [300, 1, 77]  # the first long enough for several splits at batch 1
    mgr = vtm.Manager(backend="host", capacity_bytes=64 * PAGE, chunk_bytes=PAGE, granularity=PAGE)
    space = mgr.create_space(row_bytes=row_bytes, max_tokens=max_tokens, max_slots=first_far + len(seq_lens))
    empty = [space.create(0).result() for _ in range(first_far)]  # slots below the far ones, mapping nothing
    vts = [space.create(n).result() for n in seq_lens]
    assert [vt.slot for vt in vts] == list(range(first_far, first_far + len(seq_lens)))
    rows, k, v = kv_views(space.tensor(dtype), max_tokens, LAYERS, KV_HEADS, HEAD_DIM, LAYER)
    assert vts[0].slot * k.stride(0) >= 2**31
    gen = torch.Generator().manual_seed(0)
    for vt, n in zip(vts, seq_lens):
        fill_rows(rows, vt.slot, 0, n, gen)
    slots = [vt.slot for vt in vts]

    from flexinfer.kernels.triton_attention import decode_attention, prefill_attention

    i32 = dict(dtype=torch.int32)
    errors = {}
    q = torch.randn(len(slots), HEADS, HEAD_DIM, generator=gen).to(dtype)
    out = decode_attention(q, k, v, torch.tensor(slots, **i32), torch.tensor(seq_lens, **i32))
    errors["decode"] = scaled_error(out, reference_decode(q, k, v, slots, seq_lens))
    out = decode_attention(q[:1], k, v, torch.tensor(slots[:1], **i32), torch.tensor(seq_lens[:1], **i32))
    errors["decode_split"] = scaled_error(out, reference_decode(q[:1], k, v, slots[:1], seq_lens[:1]))
    news = [40, 1, 77]
    cu = cu_seqlens(news)
    q = torch.randn(cu[-1], HEADS, HEAD_DIM, generator=gen).to(dtype)
    out = prefill_attention(q, k, v, torch.tensor(cu, **i32), torch.tensor(slots, **i32),
                            torch.tensor(seq_lens, **i32), max_q_len=max(news))
    errors["prefill"] = scaled_error(out, reference_prefill(q, k, v, cu, slots, seq_lens))
    print(json.dumps(errors), flush=True)
    del rows, k, v, q, out
    for vt in vts + empty:
        vt.release().result()
    mgr.close()


def below_windows() -> None:
    # float32 rows of 2 layers x K|V x 2 kv heads x 128 dims: two whole pages.
    heads, kv_heads, head_dim = 4, 2, 128
    lengths = [300, 37, 1, 150, 129]
    cache = GuardedRows(len(lengths), 300, 2, kv_heads, head_dim, torch.float32)
    gen = torch.Generator().manual_seed(0)
    for slot, n in enumerate(lengths):
        fill_rows(cache.rows, slot, 0, n, gen)
    k, v, slots = cache.k, cache.v, list(range(len(lengths)))

    from flexinfer.kernels.triton_attention import decode_attention, prefill_attention

    def i32(values):
        return torch.tensor(values, dtype=torch.int32)

    guarded = cache.run_guarded
    errors = {}
    for window, softcap in ((1, 0.0), (17, 5.0), (130, 0.0)):
        variant = dict(window=window, softcap=softcap)
        q = torch.randn(len(lengths), heads, head_dim, generator=gen)
        out = guarded([window_start(n - 1, window) for n in lengths],
                      lambda: decode_attention(q, k, v, i32(slots), i32(lengths), **variant))
        errors[f"decode-w{window}"] = scaled_error(out, reference_decode(q, k, v, slots, lengths, **variant))
        # Batch 1: the window splits over several programs.
        out = guarded([window_start(lengths[0] - 1, window)],
                      lambda: decode_attention(q[:1], k, v, i32([0]), i32(lengths[:1]), **variant))
        errors[f"decode-split-w{window}"] = scaled_error(out, reference_decode(q[:1], k, v, [0], lengths[:1],
                                                                               **variant))
        new = [70, 37, 1, 5, 16]
        cu = cu_seqlens(new)
        q = torch.randn(cu[-1], heads, head_dim, generator=gen)
        out = guarded([window_start(n - m, window) for n, m in zip(lengths, new)],
                      lambda: prefill_attention(q, k, v, i32(cu), i32(slots), i32(lengths), max_q_len=max(new),
                                                **variant))
        errors[f"prefill-w{window}"] = scaled_error(out, reference_prefill(q, k, v, cu, slots, lengths, **variant))
    print(json.dumps(errors), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "cases":
        run_cases()
    elif sys.argv[1] == "window":
        below_windows()
    elif sys.argv[1] == "far":
        on_far_slots(sys.argv[2])
    else:
        on_vtm_memory(sys.argv[1], sys.argv[2])
