// RotaryKVWrite (layer_ops_cpu.h). Built with -ffp-contract=off
// (CMakeLists.txt): x * cos and rotate_half(x) * sin are each rounded before
// they are added, as torch does, where the compiler would otherwise fuse a
// product and the sum into one FMA.
#include <string>

#include "layer_ops_cpu.h"
#include "cpu_vec.h"

namespace flexinfer {
namespace {

// x*cos + rotate_half(x)*sin for the lanes [d, d + n) of both halves of one
// head (n == kLanes in a row's body, less at its tail), each product and the
// sum rounded to T. rotate_half(x) = [-x2, x1]; the sign is in sin.
template <class T, bool kFull>
inline __attribute__((always_inline)) void RotateLanes(T* x, const T* cos, const T* sin, std::int64_t half,
                                                       std::int64_t d, std::int64_t n) {
  const VecF x1 = LoadLanes<kFull>(x + d, n), x2 = LoadLanes<kFull>(x + half + d, n);
  const VecF lo = Round<T>(x1 * LoadLanes<kFull>(cos + d, n)) + Round<T>(x2 * LoadLanes<kFull>(sin + d, n));
  const VecF hi =
      Round<T>(x2 * LoadLanes<kFull>(cos + half + d, n)) + Round<T>(x1 * LoadLanes<kFull>(sin + half + d, n));
  if constexpr (kFull) {
    Store(lo, x + d);
    Store(hi, x + half + d);
  } else {
    StorePartial(lo, x + d, n);
    StorePartial(hi, x + half + d, n);
  }
}

template <class T>
inline __attribute__((always_inline)) void RotaryKVWriteTokens(const RotaryKVWriteArgs& a, std::int64_t begin,
                                                               std::int64_t end) {
  const std::int64_t half = a.head_dim / 2;
  const std::size_t row_bytes = sizeof(T) * a.head_dim;
  for (std::int64_t t = begin; t < end; ++t) {
    T* token = static_cast<T*>(a.qkv) + t * a.qkv_stride_token;
    const T* cos = static_cast<const T*>(a.cos) + t * a.cos_stride;
    const T* sin = static_cast<const T*>(a.sin) + t * a.sin_stride;
    for (int h = 0; h < a.heads + a.kv_heads; ++h) {  // q heads, then k heads
      T* x = token + h * a.qkv_stride_head;
      std::int64_t d = 0;
      for (; d + kLanes <= half; d += kLanes) RotateLanes<T, true>(x, cos, sin, half, d, kLanes);
      if (d < half) RotateLanes<T, false>(x, cos, sin, half, d, half - d);
    }
    T* row = static_cast<T*>(a.kv) + a.slots[t] * a.kv_stride_slot + a.positions[t] * a.kv_stride_token;
    for (int h = 0; h < a.kv_heads; ++h) {
      std::memcpy(row + h * a.kv_stride_head, token + (a.heads + h) * a.qkv_stride_head, row_bytes);
      std::memcpy(row + a.kv_stride_kv + h * a.kv_stride_head,
                  token + (a.heads + a.kv_heads + h) * a.qkv_stride_head, row_bytes);
    }
  }
}

FLEXINFER_CLONES void RotaryKVWriteF32(const RotaryKVWriteArgs& a, std::int64_t begin, std::int64_t end) {
  RotaryKVWriteTokens<float>(a, begin, end);
}
FLEXINFER_CLONES void RotaryKVWriteBF16(const RotaryKVWriteArgs& a, std::int64_t begin, std::int64_t end) {
  RotaryKVWriteTokens<std::uint16_t>(a, begin, end);
}

}  // namespace

void CheckRotaryKVWrite(const RotaryKVWriteArgs& a) {
  CheckDType(a.dtype);
  if (a.tokens < 0 || a.heads <= 0 || a.kv_heads <= 0)
    Invalid("rotary_kv_write needs tokens >= 0 and positive head counts");
  if (a.head_dim <= 0 || a.head_dim % 2 != 0)
    Invalid("rotary_kv_write needs a positive, even head_dim, got " + std::to_string(a.head_dim));
  // Every destination first: a bad slot or position writes nothing at all.
  for (std::int64_t t = 0; t < a.tokens; ++t) {
    const std::int64_t slot = a.slots[t], position = a.positions[t];
    if (slot < 0 || slot >= a.max_slots)
      Invalid("slot " + std::to_string(slot) + " of token " + std::to_string(t) + " is outside [0, " +
              std::to_string(a.max_slots) + ")");
    if (position < 0 || position >= a.max_tokens)
      Invalid("position " + std::to_string(position) + " of token " + std::to_string(t) + " is outside [0, " +
              std::to_string(a.max_tokens) + ")");
  }
}

void RotaryKVWrite(const RotaryKVWriteArgs& a) {
  CheckRotaryKVWrite(a);
  const bool f32 = a.dtype == DType::kFloat32;
  const std::int64_t elements = a.tokens * (a.heads + 2 * a.kv_heads) * a.head_dim;
  ForRows(a.tokens, elements, a.threads, [&](std::int64_t begin, std::int64_t end) {
    f32 ? RotaryKVWriteF32(a, begin, end) : RotaryKVWriteBF16(a, begin, end);
  });
}

}  // namespace flexinfer
