// What FlexInfer's CPU kernels share (attention, linear, sampling and the
// layer ops): 16-lane float vectors with float32 and bfloat16 loads, stores
// and rounding, the instruction-set clones, and the range-parallel loop.
// Header-only, inline, in an unnamed namespace: each file compiles it for its
// own clones.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "cpu_numeric.h"

namespace flexinfer {
namespace {

// 16 lanes: GCC's vector extension compiles arithmetic on them to one AVX-512
// register, two AVX2 or four SSE registers, whichever the code targets.
typedef float VecF __attribute__((vector_size(64)));
typedef std::int32_t VecI __attribute__((vector_size(64)));
typedef std::uint32_t VecU __attribute__((vector_size(64)));
typedef std::uint16_t VecH __attribute__((vector_size(32)));
typedef double VecD __attribute__((vector_size(64)));
typedef float VecF8 __attribute__((vector_size(32)));
typedef std::int32_t VecI8 __attribute__((vector_size(32)));
typedef std::uint32_t VecU8 __attribute__((vector_size(32)));
typedef std::uint16_t VecH8 __attribute__((vector_size(16)));
constexpr int kLanes = 16;

// The int32, uint32 and bfloat16 vectors with the lanes of float vector F,
// for code written for either width (VecF or VecF8).
template <class F>
struct LanesOf;
template <>
struct LanesOf<VecF> {
  typedef VecI I;
  typedef VecU U;
  typedef VecH H;
  static constexpr int kW = 16;
};
template <>
struct LanesOf<VecF8> {
  typedef VecI8 I;
  typedef VecU8 U;
  typedef VecH8 H;
  static constexpr int kW = 8;
};

// Comparisons, `?:` selects and shuffles are another matter: GCC lowers
// those of a vector wider than the target's registers lane by lane, through
// memory, and a vector of 16 lanes carried across a loop lives in memory
// too. On an AVX2 CPU (no AVX-512) that made the greedy pick ~20x and
// bfloat16 silu_mul ~6x slower than they are now (docs/benchmarks.md). So
// code with lane operations or loop state is written for a float vector type
// F of either width, VecF or VecF8 (LanesOf<F> names its companions), and
// compiled for each: 16 lanes where registers hold them, 8 elsewhere.

// Entry points are compiled for several instruction sets and picked at run
// time by the CPU's features, never by vendor. A kernel of 16-lane
// arithmetic only is one function cloned for AVX-512, AVX2 and baseline
// x86-64 (FLEXINFER_CLONES). One written for F is compiled twice: with VecF
// for CPUs with AVX-512 (FLEXINFER_WIDE) and with VecF8, cloned for AVX2 and
// baseline x86-64, for the others (FLEXINFER_HALVED); WideVectors() says
// which to call. (Baseline x86-64's SSE registers hold 4 lanes: there GCC
// still compares lane by lane; AVX2 is what the 8-lane code is for.) A
// build with FLEXINFER_KERNEL_ARCH set (`make test-isa`) compiles every
// entry point for that one instruction set instead and picks
// the width a CPU of that set would, so that a machine with AVX-512 also
// tests the code an AVX2-only or a baseline x86-64 CPU runs. Elsewhere (other
// architectures, sanitizer builds) one build of each runs, at 16 lanes.
// FLEXINFER_KERNEL_LANES=8 in the environment runs the 8-lane code on any
// CPU: the sanitizer build's tests run it, and a test compares the two
// widths where the CPU has AVX-512.
inline bool EightLanesAsked() {
  const char* lanes = std::getenv("FLEXINFER_KERNEL_LANES");
  return lanes != nullptr && std::string(lanes) == "8";
}
#if defined(FLEXINFER_KERNEL_ARCH)
#define FLEXINFER_CLONES __attribute__((target("arch=" FLEXINFER_KERNEL_ARCH)))
#define FLEXINFER_WIDE FLEXINFER_CLONES
#define FLEXINFER_HALVED FLEXINFER_CLONES
inline bool WideVectors() {
  static const bool wide = std::string(FLEXINFER_KERNEL_ARCH) == "x86-64-v4" && !EightLanesAsked();
  return wide;
}
#elif defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define FLEXINFER_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define FLEXINFER_WIDE __attribute__((target("arch=x86-64-v4")))
#define FLEXINFER_HALVED __attribute__((target_clones("arch=x86-64-v3", "default")))
inline bool WideVectors() {
  static const bool wide = __builtin_cpu_supports("x86-64-v4") && !EightLanesAsked();
  return wide;
}
#else
#define FLEXINFER_CLONES
#define FLEXINFER_WIDE
#define FLEXINFER_HALVED
inline bool WideVectors() {
  static const bool wide = !EightLanesAsked();
  return wide;
}
#endif

// The low and high 8 lanes of v (copies GCC keeps in registers at any width).
inline __attribute__((always_inline)) VecF8 LowHalf(VecF v) {
  VecF8 h;
  std::memcpy(&h, &v, sizeof h);
  return h;
}
inline __attribute__((always_inline)) VecF8 HighHalf(VecF v) {
  VecF8 h;
  std::memcpy(&h, reinterpret_cast<const char*>(&v) + sizeof h, sizeof h);
  return h;
}

// Loads of a float vector F's lanes (LoadAs) and of 16 lanes (Load).
template <class F>
inline __attribute__((always_inline)) F LoadAs(const float* p) {
  F v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
// bfloat16 is the high half of a float32: widened and shifted into place.
// (A conversion, not a shuffle: GCC splits conversions well at any width.)
template <class F>
inline __attribute__((always_inline)) F LoadAs(const std::uint16_t* p) {
  typename LanesOf<F>::H h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<F>(__builtin_convertvector(h, typename LanesOf<F>::U) << 16);
}
inline __attribute__((always_inline)) VecF Load(const float* p) { return LoadAs<VecF>(p); }
inline __attribute__((always_inline)) VecF Load(const std::uint16_t* p) { return LoadAs<VecF>(p); }
template <class F>
inline __attribute__((always_inline)) void StoreAs(F v, float* p) {
  std::memcpy(p, &v, sizeof v);
}

// v rounded to bfloat16 (nearest even; NaN stays a quiet NaN) in the high
// half of each lane, the low half left over: the vector form of Narrow in
// cpu_numeric.h. A lane is NaN when its magnitude's bits exceed infinity's:
// the sign of their difference, found by arithmetic (no comparison, which
// GCC lowers lane by lane where registers are narrower than 16 lanes).
inline __attribute__((always_inline)) VecU BF16High(VecF v) {
  const VecU u = reinterpret_cast<VecU>(v);
  const VecU nan = reinterpret_cast<VecU>(reinterpret_cast<VecI>(0x7F800000u - (u & 0x7FFFFFFFu)) >> 31);
  return ((u | 0x400000) & nan) | ((u + 0x7FFF + ((u >> 16) & 1)) & ~nan);
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

inline __attribute__((always_inline)) void Store(VecF v, float* p) { StoreAs(v, p); }
inline __attribute__((always_inline)) void Store(VecF v, std::uint16_t* p) {
  const VecH h = __builtin_convertvector(BF16High(v) >> 16, VecH);
  std::memcpy(p, &h, sizeof h);
}

// The last n < 16 elements of a row go through the same vector code, padded
// with zeros, so a row's tail rounds exactly as its body. (LoadPartialAs:
// the same for fewer than F's lanes.)
template <class F, class T>
inline __attribute__((always_inline)) F LoadPartialAs(const T* p, std::int64_t n) {
  T buf[LanesOf<F>::kW] = {};
  std::memcpy(buf, p, sizeof(T) * n);
  return LoadAs<F>(buf);
}
template <class T>
inline __attribute__((always_inline)) VecF LoadPartial(const T* p, std::int64_t n) {
  return LoadPartialAs<VecF>(p, n);
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
template <class F>
inline __attribute__((always_inline)) void StorePartialAs(F v, float* p, std::int64_t n) {
  std::memcpy(p, &v, sizeof(float) * n);
}

// e^x over all of float's range, to within ~2 ulp: x = n ln2 + r with
// |r| <= ln2/2 and a degree-7 Taylor polynomial; 2^n is applied as two
// factors so that results near overflow (x up to 88.7) and subnormal ones
// (down to -103) stay exact in their exponent. Beyond those, inf and 0; NaN
// stays NaN. F: VecF or VecF8.
template <class F>
inline __attribute__((always_inline)) F ExpLanes(F x) {
  typedef typename LanesOf<F>::I I;
  const F lo = F{} - 104.0f, hi = F{} + 89.0f;
  F c = x > lo ? x : lo;  // NaN becomes lo: the integer conversion below sees no NaN
  c = c < hi ? c : hi;
  // Round to nearest by adding and subtracting 1.5 * 2^23.
  const F n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const F r = (c - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  F p = F{} + 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const I ni = __builtin_convertvector(n, I);
  const I half = ni >> 1;
  const F scale1 = reinterpret_cast<F>((half + 127) << 23);
  const F scale2 = reinterpret_cast<F>((ni - half + 127) << 23);
  F e = p * scale1 * scale2;
  e = x < lo ? F{} : e;
  return x != x ? x : e;
}

// e^x of 16 lanes computed on vectors of F's lanes: as one vector, or as two
// halves of 8, each in a register of its own. The same lanes either way.
template <class F>
inline __attribute__((always_inline)) VecF Exp(VecF x) {
  if constexpr (std::is_same_v<F, VecF8>) {
    const VecF8 halves[2] = {ExpLanes(LowHalf(x)), ExpLanes(HighHalf(x))};
    VecF e;
    std::memcpy(&e, halves, sizeof e);
    return e;
  } else {
    return ExpLanes(x);
  }
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
