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

// What a whole forward pass adds around the layers: the embedding in, RoPE's
// rows from tables, the final norm and the LM head out. Why: at one token a
// 1-layer model's pass cost ~60 us, of which the layers' call was ~15; the
// rest was Python around five small torch calls (embedding, two gathers, the
// norm, the head) and the checks of their arguments.
struct DecoderEnds {
  const std::int64_t* input_ids = nullptr;  // [tokens], each in [0, vocab)
  const void* embed = nullptr;  // [vocab, hidden_size], dense
  std::int64_t vocab = 0;
  // [table_positions, head_dim] each, dense: cos and sin (its first half
  // negated) of every position, as RotaryKVWrite takes their rows.
  const void* cos_table = nullptr;
  const void* sin_table = nullptr;
  std::int64_t table_positions = 0;
  const void* final_norm = nullptr;  // [hidden_size]
  const void* lm_head = nullptr;  // packed by PackLinearWeight from [lm_vocab, hidden_size]
  std::int64_t lm_vocab = 0;
  const std::int64_t* last_index = nullptr;  // [batch]: the row of each request's last token, in [0, tokens)
  float* logits = nullptr;  // [batch, lm_vocab], dense: the output
};

// A whole forward pass, ids in, logits out: hidden = embed[input_ids]; the
// layers as DecoderLayers runs them, with cos and sin the tables' rows at the
// positions; logits = lm_head(rms_norm(hidden[last_index], final_norm)),
// rounded to the dtype, then widened to float32. args.hidden, args.cos and
// args.sin are ignored: the call makes them in its scratch. Checked as
// DecoderLayers is, and every id, position (against the tables) and last
// index too, before anything is written; the logits are written last.
void DecoderForward(const DecoderArgs& args, const DecoderEnds& ends);

}  // namespace flexinfer
