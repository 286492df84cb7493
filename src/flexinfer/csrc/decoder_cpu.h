// A Llama decoder's layers in one call on the CPU: every layer of a forward
// pass, each as the same sequence of kernel calls the Python loop in
// src/flexinfer/model/llama.py makes (RmsNorm, PackedLinear, RotaryKVWrite,
// Attention, SiluMul), so the result is bit for bit the loop's with
// `linear="packed"` and the batched attention kernel.
//
// Why: at a few rows a layer's kernels run for microseconds each, and the
// loop paid Python's price for each of them (a wrapper's checks, a pybind
// call, an output tensor): ~9 calls x 30 layers a step, 2-3 ms of a 30 ms
// float32 step at batch 1. Here the pass pays it once.
//
// Per layer, with the residual stream h [tokens, hidden]:
//   x = rms_norm(h, input_norm);  qkv = x W_qkv^T (+ bias)
//   rotate q and k of qkv, write k and v at (slot_index[t], positions[t])
//   a = attention(q, the layer's K/V, slots, seq_lens, cu_q)
//   h' = a W_o^T + h;  x = rms_norm(h', post_norm)
//   h = silu(x W_gate^T) * (x W_up^T) W_down^T + h'
//
// Invariants:
//  * every argument, every layer's slots, lengths, offsets, token slots and
//    positions included, is checked before anything is read or written: a
//    bad one throws std::invalid_argument and changes nothing (neither the
//    hidden state nor any cache row);
//  * the cache is touched only where the kernels it calls touch it: rows
//    (slot_index[t], positions[t]) are written and attention reads no token
//    at or past a request's length;
//  * scratch is allocated per call and freed on every path; running out of
//    memory for it throws std::bad_alloc before anything is written. (The
//    attention kernel's own per-thread buffers grow inside its parallel
//    region, where a failed allocation cannot be caught: as in a direct call.)
#pragma once

#include <cstdint>

#include "cpu_numeric.h"

namespace flexinfer {

// One layer's weights: norms [hidden]; projections packed by PackLinearWeight
// from [out, in]: qkv [(heads + 2 kv_heads) head_dim, hidden] (q, k, v heads
// in that order), o [hidden, heads head_dim], gate_up [2 inter, hidden]
// (gate rows first), down [hidden, inter]. qkv_bias may be null.
struct DecoderLayerWeights {
  const void* input_norm = nullptr;
  const void* qkv = nullptr;
  const void* qkv_bias = nullptr;
  const void* o = nullptr;
  const void* post_norm = nullptr;
  const void* gate_up = nullptr;
  const void* down = nullptr;
};

// One layer's cache view [max_slots, max_tokens, 2 (k|v), kv_heads, head_dim]
// (strides in elements; groups of layers live in separate spaces, whose rows
// differ in length).
struct DecoderLayerCache {
  void* kv = nullptr;
  std::int64_t stride_slot = 0, stride_token = 0, stride_kv = 0, stride_head = 0;
  std::int64_t group = 0;
};

struct DecoderArgs {
  // The model.
  std::int64_t layers = 0, hidden_size = 0, intermediate_size = 0;
  int heads = 0, kv_heads = 0, head_dim = 0;
  float eps = 0.0f, scale = 1.0f;  // the norms' epsilon; the attention scale
  DType dtype = DType::kFloat32;  // of the weights, the hidden state and the cache
  const DecoderLayerWeights* weights = nullptr;  // [layers]

  // The cache: each layer's view, its strides and its layer group (< groups,
  // the count of per-group vectors below), and the views' common bounds.
  const DecoderLayerCache* cache = nullptr;  // [layers]
  std::int64_t groups = 1;
  std::int64_t max_slots = 0, max_tokens = 0;

  // The pass: `tokens` new tokens of `batch` requests.
  std::int64_t tokens = 0, batch = 0;
  void* hidden = nullptr;  // [tokens, hidden_size], dense: the embeddings in, the last layer's output out
  const void* cos = nullptr;  // [tokens, head_dim], dense, as RotaryKVWrite takes them
  const void* sin = nullptr;
  const std::int64_t* positions = nullptr;  // [tokens]
  const std::int64_t* const* slot_index = nullptr;  // [groups][tokens]: the slot each token is written to
  const std::int32_t* const* slots = nullptr;  // [groups][batch]: each request's slot
  const std::int32_t* seq_lens = nullptr;  // [batch]
  const std::int32_t* cu_q = nullptr;  // [batch + 1] query offsets, or null for decode (one query each)
  int threads = 1;
};

// Runs every layer over args.hidden in place.
void DecoderLayers(const DecoderArgs& args);

}  // namespace flexinfer
