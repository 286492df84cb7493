// Built with -ffp-contract=off (CMakeLists.txt): the rotary embedding must
// round x * cos and rotate_half(x) * sin before adding them, as torch does,
// and the compiler would otherwise fuse a product and a sum into one FMA.
#include "layer_ops_cpu.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace flexinfer {
namespace {

// Below this many elements per call a parallel region costs more than it
// saves (a decode step's norms and rotary at batch 32 stay on one thread).
constexpr std::int64_t kParallelElements = std::int64_t{1} << 16;

// 16 lanes: GCC's vector extension compiles to one AVX-512 register, two
// AVX2 or four SSE registers, whichever the clone targets.
typedef float VecF __attribute__((vector_size(64)));
typedef std::int32_t VecI __attribute__((vector_size(64)));
typedef std::uint32_t VecU __attribute__((vector_size(64)));
typedef std::uint16_t VecH __attribute__((vector_size(32)));
typedef double VecD __attribute__((vector_size(64)));
typedef float VecF8 __attribute__((vector_size(32)));
constexpr int kLanes = 16;

inline __attribute__((always_inline)) VecF Splat(float x) { return VecF{} + x; }

inline __attribute__((always_inline)) VecF Load(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline __attribute__((always_inline)) VecF Load(const std::uint16_t* p) {  // bfloat16
  VecH h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<VecF>(__builtin_convertvector(h, VecU) << 16);
}

// The bits of v rounded to bfloat16 (nearest even; NaN stays a quiet NaN), in
// the high half of each lane: the vector form of Narrow in cpu_numeric.h.
inline __attribute__((always_inline)) VecU BF16Bits(VecF v) {
  const VecU u = reinterpret_cast<VecU>(v);
  const VecU rounded = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000u;
  const VecU quiet_nan = (u | 0x400000) & 0xFFFF0000u;
  return v != v ? quiet_nan : rounded;
}

// v rounded to the element type T and widened back to float32: where
// transformers rounds an intermediate to the model's dtype.
template <class T>
inline __attribute__((always_inline)) VecF Round(VecF v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return reinterpret_cast<VecF>(BF16Bits(v));
  }
}

inline __attribute__((always_inline)) void Store(VecF v, float* p) { std::memcpy(p, &v, sizeof v); }
inline __attribute__((always_inline)) void Store(VecF v, std::uint16_t* p) {
  const VecH h = __builtin_convertvector(BF16Bits(v) >> 16, VecH);
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
  VecF c = x < lo ? lo : x;
  c = c > hi ? hi : c;
  c = x != x ? Splat(0.0f) : c;
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

// ---------------------------------------------------------------- RmsNorm

inline __attribute__((always_inline)) VecD SquaresLow(VecF v) {
  const VecF8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const VecD d = __builtin_convertvector(h, VecD);
  return d * d;
}
inline __attribute__((always_inline)) VecD SquaresHigh(VecF v) {
  const VecF8 h = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const VecD d = __builtin_convertvector(h, VecD);
  return d * d;
}

template <class T>
inline __attribute__((always_inline)) void RmsNormRow(const T* x, const T* w, T* out, std::int64_t dim,
                                                      float eps) {
  // Squares of float32 values are exact in double and their sum is far more
  // precise than float32, so var below is the correctly rounded mean.
  VecD acc_lo = {}, acc_hi = {};
  std::int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) {
    const VecF v = Load(x + d);
    acc_lo += SquaresLow(v);
    acc_hi += SquaresHigh(v);
  }
  if (d < dim) {
    const VecF v = LoadPartial(x + d, dim - d);
    acc_lo += SquaresLow(v);
    acc_hi += SquaresHigh(v);
  }
  const VecD acc = acc_lo + acc_hi;
  double sum = 0.0;
  for (int i = 0; i < 8; ++i) sum += acc[i];
  const float var = static_cast<float>(sum / static_cast<double>(dim));
  // torch.rsqrt on the CPU is the correctly rounded 1 / sqrt (checked by the tests).
  const float inv = 1.0f / std::sqrt(var + eps);
  for (d = 0; d + kLanes <= dim; d += kLanes) {
    Store(Load(w + d) * Round<T>(Load(x + d) * inv), out + d);
  }
  if (d < dim) {
    const std::int64_t n = dim - d;
    StorePartial(LoadPartial(w + d, n) * Round<T>(LoadPartial(x + d, n) * inv), out + d, n);
  }
}

template <class T>
inline __attribute__((always_inline)) void RmsNormRows(const RmsNormArgs& a, std::int64_t begin,
                                                       std::int64_t end) {
  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.weight);
  T* out = static_cast<T*>(a.out);
  for (std::int64_t r = begin; r < end; ++r) {
    RmsNormRow(x + r * a.x_stride, w, out + r * a.out_stride, a.dim, a.eps);
  }
}

// ---------------------------------------------------------------- SiluMul

template <class T>
inline __attribute__((always_inline)) VecF SiluTimes(VecF g, VecF up) {
  // torch's silu: g / (1 + e^-g), rounded to the dtype before the product.
  return Round<T>(g / (1.0f + Exp(-g))) * up;
}

template <class T>
inline __attribute__((always_inline)) void SiluMulRows(const SiluMulArgs& a, std::int64_t begin,
                                                       std::int64_t end) {
  const std::int64_t inter = a.inter;
  for (std::int64_t r = begin; r < end; ++r) {
    const T* gate = static_cast<const T*>(a.gate_up) + r * a.gate_up_stride;
    const T* up = gate + inter;
    T* out = static_cast<T*>(a.out) + r * a.out_stride;
    std::int64_t d = 0;
    for (; d + kLanes <= inter; d += kLanes) Store(SiluTimes<T>(Load(gate + d), Load(up + d)), out + d);
    if (d < inter) {
      const std::int64_t n = inter - d;
      StorePartial(SiluTimes<T>(LoadPartial(gate + d, n), LoadPartial(up + d, n)), out + d, n);
    }
  }
}

// ---------------------------------------------------------------- RotaryKVWrite

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

// One entry point per op and dtype, compiled for several instruction sets and
// picked at load time by the CPU's features (never by vendor).
#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define FLEXINFER_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FLEXINFER_CLONES
#endif

FLEXINFER_CLONES void RmsNormF32(const RmsNormArgs& a, std::int64_t begin, std::int64_t end) {
  RmsNormRows<float>(a, begin, end);
}
FLEXINFER_CLONES void RmsNormBF16(const RmsNormArgs& a, std::int64_t begin, std::int64_t end) {
  RmsNormRows<std::uint16_t>(a, begin, end);
}
FLEXINFER_CLONES void SiluMulF32(const SiluMulArgs& a, std::int64_t begin, std::int64_t end) {
  SiluMulRows<float>(a, begin, end);
}
FLEXINFER_CLONES void SiluMulBF16(const SiluMulArgs& a, std::int64_t begin, std::int64_t end) {
  SiluMulRows<std::uint16_t>(a, begin, end);
}
FLEXINFER_CLONES void RotaryKVWriteF32(const RotaryKVWriteArgs& a, std::int64_t begin, std::int64_t end) {
  RotaryKVWriteTokens<float>(a, begin, end);
}
FLEXINFER_CLONES void RotaryKVWriteBF16(const RotaryKVWriteArgs& a, std::int64_t begin, std::int64_t end) {
  RotaryKVWriteTokens<std::uint16_t>(a, begin, end);
}

[[noreturn]] void Invalid(const std::string& message) { throw std::invalid_argument(message); }

void CheckDType(DType dtype) {
  if (dtype != DType::kFloat32 && dtype != DType::kBFloat16) Invalid("layer ops take float32 or bfloat16");
}

// Runs body(begin, end) over [0, rows): split into one contiguous range per
// thread when the call has `elements` enough to pay for a parallel region.
template <class Body>
void ForRows(std::int64_t rows, std::int64_t elements, int threads, Body body) {
  const int workers = static_cast<int>(std::min<std::int64_t>(std::max(threads, 1), rows));
  if (workers <= 1 || elements < kParallelElements) {
    body(std::int64_t{0}, rows);
    return;
  }
#pragma omp parallel num_threads(workers)
  {
    const std::int64_t w = omp_get_thread_num(), n = omp_get_num_threads();
    body(rows * w / n, rows * (w + 1) / n);
  }
}

}  // namespace

void RmsNorm(const RmsNormArgs& a) {
  CheckDType(a.dtype);
  if (a.rows < 0 || a.dim <= 0) Invalid("rms_norm needs rows >= 0 and dim > 0");
  if (a.rows > 1 && a.out_stride < a.dim) Invalid("rms_norm's output rows overlap");
  if (!(a.eps >= 0.0f) || std::isinf(a.eps)) Invalid("rms_norm's eps must be finite and >= 0");
  const bool f32 = a.dtype == DType::kFloat32;
  ForRows(a.rows, a.rows * a.dim, a.threads, [&](std::int64_t begin, std::int64_t end) {
    f32 ? RmsNormF32(a, begin, end) : RmsNormBF16(a, begin, end);
  });
}

void SiluMul(const SiluMulArgs& a) {
  CheckDType(a.dtype);
  if (a.rows < 0 || a.inter <= 0) Invalid("silu_mul needs rows >= 0 and a positive intermediate size");
  if (a.rows > 1 && a.out_stride < a.inter) Invalid("silu_mul's output rows overlap");
  const bool f32 = a.dtype == DType::kFloat32;
  // exp costs several elementwise passes: count it as such for the threshold.
  ForRows(a.rows, 8 * a.rows * a.inter, a.threads, [&](std::int64_t begin, std::int64_t end) {
    f32 ? SiluMulF32(a, begin, end) : SiluMulBF16(a, begin, end);
  });
}

void RotaryKVWrite(const RotaryKVWriteArgs& a) {
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
  const bool f32 = a.dtype == DType::kFloat32;
  const std::int64_t elements = a.tokens * (a.heads + 2 * a.kv_heads) * a.head_dim;
  ForRows(a.tokens, elements, a.threads, [&](std::int64_t begin, std::int64_t end) {
    f32 ? RotaryKVWriteF32(a, begin, end) : RotaryKVWriteBF16(a, begin, end);
  });
}

}  // namespace flexinfer
