// The element types FlexInfer's CPU kernels take, and their conversions to
// and from the float32 every kernel computes in.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace flexinfer {

// Codes shared with the Python wrappers (src/flexinfer/kernels).
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

inline float Widen(float x) { return x; }
inline float Widen(std::uint16_t bits) {  // bfloat16
  std::uint32_t u = static_cast<std::uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float Widen(_Float16 x) { return static_cast<float>(x); }

inline void Narrow(float x, float* dst) { *dst = x; }
// To bfloat16, rounding to nearest even; a NaN stays a (quiet) NaN.
inline void Narrow(float x, std::uint16_t* dst) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if (std::isnan(x)) {
    *dst = static_cast<std::uint16_t>((u >> 16) | 0x40);
    return;
  }
  u += 0x7FFF + ((u >> 16) & 1);
  *dst = static_cast<std::uint16_t>(u >> 16);
}
inline void Narrow(float x, _Float16* dst) { *dst = static_cast<_Float16>(x); }

}  // namespace flexinfer
