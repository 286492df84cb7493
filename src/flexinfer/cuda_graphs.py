"""Decode steps as CUDA graph replays, one graph per batch-size bucket.

Why it works on vtm: a request's KV lives at a fixed virtual address for its
whole life and vtm maps new pages *under* that address, so the only things
that change between two decode steps are a handful of small vectors (token
ids, positions, slots, lengths). A graph captured once over static copies of
those vectors stays valid while the cache grows: each step copies the new
values into the static buffers (one host-to-device copy, and the token ids
from where the engine has them: on the device, when the step before chose
them) and replays. Nothing in `run` waits for the device: the host copy is
a new pinned tensor per step, which torch's pinned-memory cache does not
hand out again before the copy that reads it has run.

Padding: a batch of B requests replays the graph of the smallest bucket >= B.
The extra rows are idle: their length is 0, so attention reads nothing for
them, and they write their K/V row into the *sink*, one token of a vTensor the
engine holds for its whole life and that no request ever reads. They never
touch a request's memory.

Invariants:
 * the static buffers and every graph's output are allocated once and never
   move (graphs read and write them by address);
 * a graph is captured only from idle rows (all rows point at the sink), so
   capturing mid-serving touches no request's KV;
 * the scheduler has mapped every page a step writes before `run` (its
   pre-extend future is awaited first), as for an eager step.
"""

from __future__ import annotations

import torch

from flexinfer.model.llama import ForwardBatch, long_tensor


def buckets_up_to(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] + (8 if sizes[-1] < 32 else 32 if sizes[-1] < 256 else 128))
    return [s for s in sizes if s < max_batch] + [max_batch]


class DecodeGraphs:
    def __init__(self, model, kv_cache, attention, max_batch: int, sink_slots: list[int]):
        self.model, self.kv_cache, self.attention = model, kv_cache, attention
        self.buckets = buckets_up_to(max_batch)
        self.sink_slots = list(sink_slots)  # per layer group
        groups = len(sink_slots)
        device = kv_cache.device
        size = self.buckets[-1]
        # Rows of the static input: token ids, positions, lengths, then the slot per group.
        self._rows = 3 + groups
        self._static = torch.zeros(self._rows, size, dtype=torch.long, device=device)
        self._slots32 = torch.zeros(groups, size, dtype=torch.int32, device=device)
        self._lens32 = torch.zeros(size, dtype=torch.int32, device=device)
        self._last = torch.arange(size, dtype=torch.long, device=device)
        self._cu = torch.arange(size + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self._static.copy_(self._idle_host(size))

    def bucket_for(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def run(self, token_ids: torch.Tensor, slots, starts: list[int]) -> torch.Tensor:
        """Logits [B, vocab] of one decode step: token_ids[i] (a tensor of B
        ids, on the device or the host) at position starts[i] of the
        vTensor in `slots[i]` (an int, or one per group)."""
        batch = len(starts)
        size = self.bucket_for(batch)
        if size not in self._graphs:
            self._capture(size)
        host = self._idle_host(size)
        host[1, :batch] = long_tensor(starts)
        host[2, :batch] = host[1, :batch] + 1
        per_seq = [(s,) if isinstance(s, int) else tuple(s) for s in slots]
        host[3:, :batch] = torch.tensor(per_seq, dtype=torch.long).T
        self._static[:, :size].copy_(host, non_blocking=True)
        self._static[0, :batch].copy_(token_ids, non_blocking=True)
        graph, logits = self._graphs[size]
        graph.replay()
        return logits[:batch]

    def _idle_host(self, size: int) -> torch.Tensor:
        """Static rows for `size` idle columns, in new pinned host memory:
        token 0 at position 0, length 0 (attention reads nothing), the sink's slots."""
        host = torch.zeros(self._rows, size, dtype=torch.long, pin_memory=True)
        for g, sink in enumerate(self.sink_slots):
            host[3 + g] = sink
        return host

    def _forward(self, size: int) -> torch.Tensor:
        """The captured body: casts of the static vectors, then the model."""
        s = self._static
        for g in range(len(self.sink_slots)):
            self._slots32[g, :size].copy_(s[3 + g, :size])
        self._lens32[:size].copy_(s[2, :size])
        batch = ForwardBatch(slots=[[sink] * size for sink in self.sink_slots], starts=[0] * size,
                             new_lens=[1] * size, slot_index=[s[3 + g, :size] for g in range(len(self.sink_slots))],
                             positions=s[1, :size], last_index=self._last[:size],
                             slot_vector=[self._slots32[g, :size] for g in range(len(self.sink_slots))],
                             seq_lens=self._lens32[:size], cu_seqlens_q=self._cu[:size + 1], max_q_len=1)
        return self.model.forward(s[0, :size], batch, self.kv_cache, self.attention)

    def _capture(self, size: int) -> None:
        # Every static row idle first: warm-up and capture write only into the sink.
        self._static[:, :size].copy_(self._idle_host(size))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(size)  # compiles the kernels outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # Thread-local capture: vtm's worker threads keep mapping pages (the
        # pre-extend runs while this step computes), and under the default
        # global mode their driver calls would be refused during a capture.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self._forward(size)
        self._graphs[size] = (graph, logits)
