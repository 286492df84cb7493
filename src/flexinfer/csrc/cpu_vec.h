// What FlexInfer's CPU kernels share (attention, linear, sampling and the
// layer ops): 16-lane float vectors with float32 and bfloat16 loads, stores
// and rounding, the instruction-set clones, and the range-parallel loop.
// Header-only, inline, in an unnamed namespace: each file compiles it for its
// own clones.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "cpu_numeric.h"

namespace flexinfer {
namespace {

// One entry point per kernel and dtype, compiled for several instruction sets and
// picked at load time by the CPU's features (never by vendor). A build with
// FLEXINFER_KERNEL_ARCH set (`make test-isa`) compiles them for that one
// instruction set instead, so that a machine with AVX-512 also tests the code
// an AVX2-only or a baseline x86-64 CPU would pick.
#if defined(FLEXINFER_KERNEL_ARCH)
#define FLEXINFER_CLONES __attribute__((target("arch=" FLEXINFER_KERNEL_ARCH)))
#elif defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define FLEXINFER_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FLEXINFER_CLONES
#endif

// 16 lanes: GCC's vector extension compiles to one AVX-512 register, two
// AVX2 or four SSE registers, whichever the clone targets.
typedef float VecF __attribute__((vector_size(64)));
typedef std::int32_t VecI __attribute__((vector_size(64)));
typedef std::uint32_t VecU __attribute__((vector_size(64)));
typedef std::uint16_t VecH __attribute__((vector_size(32)));
typedef std::uint16_t VecH32 __attribute__((vector_size(64)));
typedef double VecD __attribute__((vector_size(64)));
typedef float VecF8 __attribute__((vector_size(32)));
constexpr int kLanes = 16;

inline __attribute__((always_inline)) VecF Splat(float x) { return VecF{} + x; }

inline __attribute__((always_inline)) VecF Load(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
// bfloat16 is the high half of a float32: interleaving the 16 values with
// zeros widens them in one shuffle (little-endian lanes).
inline __attribute__((always_inline)) VecF Load(const std::uint16_t* p) {
  VecH h;
  std::memcpy(&h, p, sizeof h);
  const VecH zero = {};
  const VecH32 wide = __builtin_shufflevector(zero, h, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23, 8, 24,
                                              9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  return reinterpret_cast<VecF>(wide);
}

// v rounded to bfloat16 (nearest even; NaN stays a quiet NaN) in the high
// half of each lane, the low half left over: the vector form of Narrow in
// cpu_numeric.h.
inline __attribute__((always_inline)) VecU BF16High(VecF v) {
  const VecU u = reinterpret_cast<VecU>(v);
  return v != v ? (u | 0x400000) : u + 0x7FFF + ((u >> 16) & 1);
}

// v rounded to the element type T and widened back to float32: where
// transformers rounds an intermediate to the model's dtype.
template <class T>
inline __attribute__((always_inline)) VecF Round(VecF v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return reinterpret_cast<VecF>(BF16High(v) & 0xFFFF0000u);
  }
}

inline __attribute__((always_inline)) void Store(VecF v, float* p) { std::memcpy(p, &v, sizeof v); }
inline __attribute__((always_inline)) void Store(VecF v, std::uint16_t* p) {
  const VecH32 halves = reinterpret_cast<VecH32>(BF16High(v));
  const VecH h = __builtin_shufflevector(halves, halves, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  std::memcpy(p, &h, sizeof h);
}

// The last n < 16 elements of a row go through the same vector code, padded
// with zeros, so a row's tail rounds exactly as its body.
template <class T>
inline __attribute__((always_inline)) VecF LoadPartial(const T* p, std::int64_t n) {
  T buf[kLanes] = {};
  std::memcpy(buf, p, sizeof(T) * n);
  return Load(buf);
}
// n lanes from p: all 16 (kFull) or a zero-padded tail.
template <bool kFull, class T>
inline __attribute__((always_inline)) VecF LoadLanes(const T* p, std::int64_t n) {
  if constexpr (kFull) {
    return Load(p);
  } else {
    return LoadPartial(p, n);
  }
}
template <class T>
inline __attribute__((always_inline)) void StorePartial(VecF v, T* p, std::int64_t n) {
  T buf[kLanes];
  Store(v, buf);
  std::memcpy(p, buf, sizeof(T) * n);
}

// e^x over all of float's range, to within ~2 ulp: x = n ln2 + r with
// |r| <= ln2/2 and a degree-7 Taylor polynomial; 2^n is applied as two
// factors so that results near overflow (x up to 88.7) and subnormal ones
// (down to -103) stay exact in their exponent. Beyond those, inf and 0; NaN
// stays NaN.
inline __attribute__((always_inline)) VecF Exp(VecF x) {
  const VecF lo = Splat(-104.0f), hi = Splat(89.0f);
  VecF c = x > lo ? x : lo;  // NaN becomes lo: the integer conversion below sees no NaN
  c = c < hi ? c : hi;
  // Round to nearest by adding and subtracting 1.5 * 2^23.
  const VecF n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const VecF r = (c - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  VecF p = Splat(1.0f / 5040);
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const VecI ni = __builtin_convertvector(n, VecI);
  const VecI half = ni >> 1;
  const VecF scale1 = reinterpret_cast<VecF>((half + 127) << 23);
  const VecF scale2 = reinterpret_cast<VecF>((ni - half + 127) << 23);
  VecF e = p * scale1 * scale2;
  e = x < lo ? Splat(0.0f) : e;
  return x != x ? x : e;
}

// Below this many elements per call an elementwise op's parallel region costs
// more than it saves (measured: a bfloat16 norm of 32 x 576 runs ~1.5x faster
// on two threads, one of 8 x 576 no faster).
constexpr std::int64_t kParallelElements = std::int64_t{1} << 14;

// Runs body(begin, end) over [0, rows): split into one contiguous range per
// thread when the call has `work` enough (at least `min_work`) to pay for a
// parallel region.
template <class Body>
void ForRows(std::int64_t rows, std::int64_t work, int threads, Body body,
             std::int64_t min_work = kParallelElements) {
  const int workers = static_cast<int>(std::min<std::int64_t>(std::max(threads, 1), rows));
  if (workers <= 1 || work < min_work) {
    body(std::int64_t{0}, rows);
    return;
  }
#pragma omp parallel num_threads(workers)
  {
    const std::int64_t w = omp_get_thread_num(), n = omp_get_num_threads();
    body(rows * w / n, rows * (w + 1) / n);
  }
}

[[noreturn]] inline void Invalid(const std::string& message) { throw std::invalid_argument(message); }

inline void CheckDType(DType dtype) {
  if (dtype != DType::kFloat32 && dtype != DType::kBFloat16) Invalid("layer ops take float32 or bfloat16");
}

}  // namespace
}  // namespace flexinfer
