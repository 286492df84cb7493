// RmsNorm and SiluMul (layer_ops_cpu.h). The rotary embedding, which must not
// fuse products into sums, lives in rotary_kv_write_cpu.cc with FMA
// contraction off; here FMAs are welcome (exp's polynomial, the float64 sum).
#include "layer_ops_cpu.h"

#include <cmath>

#include "cpu_vec.h"

namespace flexinfer {
namespace {

// ---------------------------------------------------------------- RmsNorm

inline __attribute__((always_inline)) VecD SquaresLow(VecF v) {
  const VecD d = __builtin_convertvector(LowHalf(v), VecD);
  return d * d;
}
inline __attribute__((always_inline)) VecD SquaresHigh(VecF v) {
  const VecD d = __builtin_convertvector(HighHalf(v), VecD);
  return d * d;
}

template <class T>
inline __attribute__((always_inline)) void RmsNormRow(const T* x, const T* w, T* out, std::int64_t dim,
                                                      float eps) {
  // Squares of float32 values are exact in double and their sum is precise to
  // ~1e-16, so var below is, in effect, the correctly rounded mean whatever
  // the order of the sum.
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

// F: the vector type exp runs on (cpu_vec.h).
template <class T, class F>
inline __attribute__((always_inline)) VecF SiluTimes(VecF g, VecF up) {
  // torch's silu: g / (1 + e^-g), rounded to the dtype before the product.
  return Round<T>(g / (1.0f + Exp<F>(-g))) * up;
}

template <class T, class F>
inline __attribute__((always_inline)) void SiluMulRows(const SiluMulArgs& a, std::int64_t begin,
                                                       std::int64_t end) {
  const std::int64_t inter = a.inter;
  for (std::int64_t r = begin; r < end; ++r) {
    const T* gate = static_cast<const T*>(a.gate_up) + r * a.gate_up_stride;
    const T* up = gate + inter;
    T* out = static_cast<T*>(a.out) + r * a.out_stride;
    std::int64_t d = 0;
    // Four independent vectors at a time: exp's polynomial is one long chain
    // of dependent operations, and four chains side by side keep the vector
    // units busy (~1.2x on this Xeon).
    for (; d + 4 * kLanes <= inter; d += 4 * kLanes) {
      VecF s[4];
      for (int i = 0; i < 4; ++i) s[i] = SiluTimes<T, F>(Load(gate + d + i * kLanes), Load(up + d + i * kLanes));
      for (int i = 0; i < 4; ++i) Store(s[i], out + d + i * kLanes);
    }
    for (; d + kLanes <= inter; d += kLanes) Store(SiluTimes<T, F>(Load(gate + d), Load(up + d)), out + d);
    if (d < inter) {
      const std::int64_t n = inter - d;
      StorePartial(SiluTimes<T, F>(LoadPartial(gate + d, n), LoadPartial(up + d, n)), out + d, n);
    }
  }
}

FLEXINFER_CLONES void RmsNormF32(const RmsNormArgs& a, std::int64_t begin, std::int64_t end) {
  RmsNormRows<float>(a, begin, end);
}
FLEXINFER_CLONES void RmsNormBF16(const RmsNormArgs& a, std::int64_t begin, std::int64_t end) {
  RmsNormRows<std::uint16_t>(a, begin, end);
}
FLEXINFER_WIDE void SiluMulF32Wide(const SiluMulArgs& a, std::int64_t begin, std::int64_t end) {
  SiluMulRows<float, VecF>(a, begin, end);
}
FLEXINFER_WIDE void SiluMulBF16Wide(const SiluMulArgs& a, std::int64_t begin, std::int64_t end) {
  SiluMulRows<std::uint16_t, VecF>(a, begin, end);
}
FLEXINFER_HALVED void SiluMulF32Halved(const SiluMulArgs& a, std::int64_t begin, std::int64_t end) {
  SiluMulRows<float, VecF8>(a, begin, end);
}
FLEXINFER_HALVED void SiluMulBF16Halved(const SiluMulArgs& a, std::int64_t begin, std::int64_t end) {
  SiluMulRows<std::uint16_t, VecF8>(a, begin, end);
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
  const auto rows = WideVectors() ? (f32 ? SiluMulF32Wide : SiluMulBF16Wide)
                                  : (f32 ? SiluMulF32Halved : SiluMulBF16Halved);
  // exp costs several elementwise passes: count it as such for the threshold.
  ForRows(a.rows, 8 * a.rows * a.inter, a.threads, [&](std::int64_t begin, std::int64_t end) {
    rows(a, begin, end);
  });
}

}  // namespace flexinfer
