// The elementwise parts of a decoder layer on the CPU, each one fused loop
// instead of several torch ops: RMSNorm, SiLU(gate) * up, and the rotary
// embedding of q and k together with the K/V cache write. RmsNorm and
// SiluMul are in layer_ops_cpu.cc, RotaryKVWrite in rotary_kv_write_cpu.cc
// (built without FMA contraction), their vector code in cpu_vec.h.
//
// Every op rounds as Hugging Face transformers' Llama does, step by step
// (bfloat16 results are rounded to bfloat16 wherever transformers rounds
// them), so the engine's output follows the reference:
//  * RmsNorm: var = mean(x^2), h = x * (1 / sqrt(var + eps)) in float32;
//    out = weight * h, where bfloat16 rounds h to bfloat16 first. The sum of
//    squares is accumulated in double precision and var rounded once to
//    float32: in effect the correctly rounded mean, whatever the summation
//    order (transformers' float32 sum may differ from it in its last bits);
//  * SiluMul: s = g / (1 + exp(-g)) in float32, rounded to bfloat16 for
//    bfloat16, then out = s * up, rounded;
//  * RotaryKVWrite: x * cos + rotate_half(x) * sin with each product and the
//    sum rounded to the element type (never fused into an FMA), using the
//    caller's cos/sin tables.
//
// Invariants:
//  * arguments, including every slot and position, are validated before any
//    memory is read or written; a bad argument throws std::invalid_argument
//    and changes nothing;
//  * float32 and bfloat16 only (float16 throws);
//  * rows are independent: large calls are split over OpenMP threads by
//    rows, small ones run on the calling thread.
#pragma once

#include <cstdint>

#include "cpu_numeric.h"

namespace flexinfer {

struct RmsNormArgs {
  // x and out [rows, dim] (dim contiguous, rows `*_stride` elements apart);
  // weight [dim]. out must not overlap x unless it is x itself.
  const void* x = nullptr;
  std::int64_t x_stride = 0;
  const void* weight = nullptr;
  void* out = nullptr;
  std::int64_t out_stride = 0;
  std::int64_t rows = 0, dim = 0;
  float eps = 0.0f;
  DType dtype = DType::kFloat32;
  int threads = 1;
};

// out[r] = rms_norm(x[r]) * weight for every row.
void RmsNorm(const RmsNormArgs& args);

struct SiluMulArgs {
  // gate_up [rows, 2 * inter]: gate is the first half of each row, up the
  // second; out [rows, inter]. Inner dimensions contiguous.
  const void* gate_up = nullptr;
  std::int64_t gate_up_stride = 0;
  void* out = nullptr;
  std::int64_t out_stride = 0;
  std::int64_t rows = 0, inter = 0;
  DType dtype = DType::kFloat32;
  int threads = 1;
};

// out[r] = silu(gate[r]) * up[r] for every row.
void SiluMul(const SiluMulArgs& args);

struct RotaryKVWriteArgs {
  // qkv [tokens, heads + 2 * kv_heads, head_dim]: q heads, then k heads, then
  // v heads (head_dim contiguous).
  void* qkv = nullptr;
  std::int64_t qkv_stride_token = 0, qkv_stride_head = 0;
  // cos and sin [tokens, head_dim] of each token's position; sin has its
  // first half negated (rotate_half's sign folded in), as the model's tables.
  const void* cos = nullptr;
  const void* sin = nullptr;
  std::int64_t cos_stride = 0, sin_stride = 0;
  // One layer's cache view [max_slots, max_tokens, 2 (k|v), kv_heads, head_dim].
  void* kv = nullptr;
  std::int64_t kv_stride_slot = 0, kv_stride_token = 0, kv_stride_kv = 0, kv_stride_head = 0;
  std::int64_t max_slots = 0, max_tokens = 0;
  // Per token: the slot it is written to and its position there.
  const std::int64_t* slots = nullptr;
  const std::int64_t* positions = nullptr;
  std::int64_t tokens = 0;
  int heads = 0, kv_heads = 0, head_dim = 0;
  DType dtype = DType::kFloat32;
  int threads = 1;
};

// Rotates the q and k heads of qkv in place, then copies each token's k and
// v heads into the cache at (slots[t], positions[t]).
void RotaryKVWrite(const RotaryKVWriteArgs& args);

// The checks RotaryKVWrite runs first, for callers that must reject a whole
// sequence of calls before making the first.
void CheckRotaryKVWrite(const RotaryKVWriteArgs& args);

}  // namespace flexinfer
