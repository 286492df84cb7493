// Batched attention over a vtm space on the CPU: one call per layer for the
// whole batch.
//
// K and V are read in place through the space's per-layer strided views
// [slot, token, kv_head, head_dim] (head_dim contiguous). Request b owns slot
// slots[b] and seq_lens[b] cached tokens; its n_b new queries (the last n_b
// tokens, already written into the cache) sit at positions
// seq_lens[b] - n_b .. seq_lens[b] - 1 and attend causally, aligned to the end,
// so one call serves decode, prefill and chunked prefill that continues a
// cached prefix.
//
// Per-layer variants (Gemma, Mistral): a score is s = scale * q.k, capped to
// softcap * tanh(s / softcap) when softcap > 0, then masked: a query at
// position p sees keys max(0, p - window + 1) .. p when window > 0 (the last
// `window` keys, itself included), keys 0 .. p when window == 0.
//
// Invariants the kernel keeps:
//  * every K/V load of request b is at a token < seq_lens[b], and with a
//    window at a token >= the window start of the call's first query of b:
//    pages past a request's length, and pages that slid out of a window, are
//    unmapped and must never be touched (the host backend turns an over-read
//    into a fault). Nothing is loaded and masked afterwards;
//  * a request with seq_lens[b] == 0 reads nothing and writes zeros (an idle
//    padding row);
//  * arguments are validated before any memory is read; a bad argument throws
//    std::invalid_argument and writes nothing.
//
// Softmax is computed online in float32 (K/V of any dtype are widened to
// float32 as they are loaded). Work is split over (request, query block),
// every head of a request in one item so that each page of its rows is
// visited once, and, for long decode contexts, over key ranges merged
// afterwards, so a single long request still occupies every thread.
#pragma once

#include <cstdint>

#include "cpu_numeric.h"

namespace flexinfer {

struct AttentionArgs {
  // Queries [T, heads, head_dim] and the output of the same shape; strides in
  // elements, head_dim contiguous.
  const void* q = nullptr;
  std::int64_t q_stride_token = 0, q_stride_head = 0;
  void* out = nullptr;
  std::int64_t out_stride_token = 0, out_stride_head = 0;
  // K and V per-layer views [max_slots, max_tokens, kv_heads, head_dim].
  const void* k = nullptr;
  const void* v = nullptr;
  std::int64_t kv_stride_slot = 0, kv_stride_token = 0, kv_stride_head = 0;
  std::int64_t max_slots = 0, max_tokens = 0;
  // Per request: slot, cached length, and (prefill) query offsets [B + 1];
  // cu_q == nullptr means one query per request (decode).
  const std::int32_t* slots = nullptr;
  const std::int32_t* seq_lens = nullptr;
  const std::int32_t* cu_q = nullptr;
  std::int64_t batch = 0, num_queries = 0;
  int heads = 0, kv_heads = 0, head_dim = 0;
  DType dtype = DType::kFloat32;
  float scale = 1.0f;     // > 0 and finite
  std::int64_t window = 0;  // keys a query sees, itself included; 0: all before it
  float softcap = 0.0f;     // 0: no cap; else finite and > 0
  int threads = 1;  // parallel workers (OpenMP); 1 runs on the calling thread
};

// Computes attention for every query; throws std::invalid_argument on bad
// arguments (before reading any K/V).
void Attention(const AttentionArgs& args);

// The checks Attention runs first, for callers that must reject a whole
// sequence of calls before making the first.
void CheckAttention(const AttentionArgs& args);

}  // namespace flexinfer
