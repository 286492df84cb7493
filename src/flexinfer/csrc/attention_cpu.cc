#include "attention_cpu.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_vec.h"

namespace flexinfer {
namespace {

// Keys per tile: a tile of K and V rows (widened to float32) stays in L1
// while every query of the work item passes over it.
constexpr int kKeyTile = 32;
// Queries per prefill work item: enough to reuse each K/V tile, few enough to
// keep many work items for the threads.
constexpr int kQueryBlock = 16;
// A decode context is split across workers only in pieces of at least this
// many keys: shorter pieces cost more to merge than they save.
constexpr std::int64_t kMinSplitKeys = 256;
constexpr int kMaxHeadDim = 512;

// A unit of work: queries [j0, j1) of request b, every head, over keys
// [key_lo, key_hi) (a piece of the context when a decode context is split).
// All heads together: in the token-major layout one token's K and V rows
// for every head lie in the same page, so each page is visited once.
struct WorkItem {
  std::int32_t b, j0, j1, split;
  std::int64_t key_lo, key_hi;
};


// The kernel's vector code is written for a float vector type F of kW lanes:
// VecF (16) where the registers hold 16 floats (AVX-512), VecF8 (8) elsewhere,
// so that the score tiles and accumulators it carries across its loops stay
// in registers (cpu_vec.h; a head_dim of 128 at 8 lanes takes two passes:
// Accumulate). The two round differently only in the order of
// a dot product's and a row's additions.

// Row `t` of a K or V head as float32: the row itself for float32 caches, a
// widened copy in `buf` otherwise (once per tile, for every query head of its
// group). kVecs = head_dim / kW when known (bfloat16 then widens kW lanes at
// a time), 0 for any head_dim.
template <int kVecs, class F, class T>
inline __attribute__((always_inline)) const float* LoadRow(const T* src, float* buf, int dim) {
  constexpr int kW = LanesOf<F>::kW;
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else if constexpr (std::is_same_v<T, std::uint16_t> && kVecs > 0) {
    for (int i = 0; i < kVecs; ++i) StoreAs(LoadAs<F>(src + kW * i), buf + kW * i);
    return buf;
  } else {
    for (int d = 0; d < dim; ++d) buf[d] = Widen(src[d]);
    return buf;
  }
}

// Per-thread scratch, grown once and reused across calls.
struct Scratch {
  std::vector<float> q, acc, m, l, keys, values, scores;
  std::vector<const float*> key_rows, value_rows;  // [kv_head][tile]
};
thread_local Scratch scratch;

// Partial results of a split decode context: running max, sum and the
// unnormalised output per (request, query head, split).
struct Partials {
  int splits = 1, heads = 0;
  std::vector<float> m, l, acc;
  std::size_t Index(std::int64_t b, int h, int s) const {
    return (static_cast<std::size_t>(b) * heads + h) * splits + s;
  }
};

// A horizontal sum by halving (shuffle + add steps, not a lane extract each).
inline __attribute__((always_inline)) float Sum(VecF8 h8) {
  typedef float Vec4 __attribute__((vector_size(16)));
  const Vec4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}
inline __attribute__((always_inline)) float Sum(VecF v) { return Sum(LowHalf(v) + HighHalf(v)); }

// The sums of 16 vectors, lane i holding the sum of p[kTreeOrder16[i]]: four
// rounds of pairwise shuffles and adds (45 operations) instead of 16
// horizontal sums (~8 each). The order is an involution, so feeding the
// vectors in kTreeOrder16 (4-bit reversal) gives the sums in natural order.
// For 8 vectors of 8 lanes the same in three rounds (kTreeOrder8, 3-bit
// reversal).
constexpr int kTreeOrder16[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
constexpr int kTreeOrder8[8] = {0, 4, 2, 6, 1, 5, 3, 7};
template <class F>
constexpr const int* TreeOrder() {
  return LanesOf<F>::kW == 16 ? kTreeOrder16 : kTreeOrder8;
}
inline __attribute__((always_inline)) VecF8 SumLanes(const VecF8 (&p)[8]) {
  VecF8 r[4], s2[2];
  for (int j = 0; j < 4; ++j) {
    r[j] = __builtin_shufflevector(p[2 * j], p[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(p[2 * j], p[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int j = 0; j < 2; ++j) {
    s2[j] = __builtin_shufflevector(r[2 * j], r[2 * j + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
            __builtin_shufflevector(r[2 * j], r[2 * j + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  return __builtin_shufflevector(s2[0], s2[1], 0, 8, 2, 10, 4, 12, 6, 14) +
         __builtin_shufflevector(s2[0], s2[1], 1, 9, 3, 11, 5, 13, 7, 15);
}
inline __attribute__((always_inline)) VecF SumLanes(const VecF (&p)[16]) {
  VecF r[8], s4[4], u[2];
  for (int j = 0; j < 8; ++j) {
    r[j] = __builtin_shufflevector(p[2 * j], p[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(p[2 * j], p[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                   30, 31);
  }
  for (int j = 0; j < 4; ++j) {
    s4[j] = __builtin_shufflevector(r[2 * j], r[2 * j + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26,
                                    27) +
            __builtin_shufflevector(r[2 * j], r[2 * j + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30,
                                    31);
  }
  for (int j = 0; j < 2; ++j) {
    u[j] = __builtin_shufflevector(s4[2 * j], s4[2 * j + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28,
                                   29) +
           __builtin_shufflevector(s4[2 * j], s4[2 * j + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30,
                                   31);
  }
  return __builtin_shufflevector(u[0], u[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(u[0], u[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

// Scores of one query row against `n` key rows (float32), written to
// `scores`; returns their maximum. kVecs = head_dim / kW when known at compile
// time (the query row then lives in registers and keys go kW at a time), 0
// for any head_dim.
template <int kVecs, class F>
inline __attribute__((always_inline)) float Scores(const float* q, const float* const* keys, int n, int dim,
                                                   float* scores) {
  constexpr int kW = LanesOf<F>::kW;
  float tile_max = -std::numeric_limits<float>::infinity();
  if constexpr (kVecs > 0) {
    F qv[kVecs];
    for (int i = 0; i < kVecs; ++i) qv[i] = LoadAs<F>(q + kW * i);
    auto partial = [&](const float* key) {
      F dot = qv[0] * LoadAs<F>(key);
      for (int i = 1; i < kVecs; ++i) dot += qv[i] * LoadAs<F>(key + kW * i);
      return dot;
    };
    int t = 0;
    if (n >= kW) {
      F block_max = F{} - std::numeric_limits<float>::infinity();
      for (; t + kW <= n; t += kW) {
        F p[kW];
        for (int i = 0; i < kW; ++i) p[i] = partial(keys[t + TreeOrder<F>()[i]]);
        const F block = SumLanes(p);
        StoreAs(block, scores + t);
        block_max = block > block_max ? block : block_max;
      }
      for (int i = 0; i < kW; ++i) tile_max = block_max[i] > tile_max ? block_max[i] : tile_max;
    }
    for (; t < n; ++t) {
      scores[t] = Sum(partial(keys[t]));
      tile_max = scores[t] > tile_max ? scores[t] : tile_max;
    }
  } else {
    for (int t = 0; t < n; ++t) {
      float dot = 0.0f;
      for (int d = 0; d < dim; ++d) dot += q[d] * keys[t][d];
      scores[t] = dot;
      tile_max = dot > tile_max ? dot : tile_max;
    }
  }
  return tile_max;
}

// tanh(x) = sign(x) (1 - e) / (1 + e) with e = e^(-2|x|) in (0, 1]: no
// overflow for any x. Near 0 that form keeps only an absolute error of about
// 1e-7 (e rounds near 1), which a cap of 50 would turn into ~5e-6 of a score:
// there the odd Taylor series to x^11 is used instead, whose first omitted
// term is below 2e-9 for |x| < 0.3.
template <class F>
inline __attribute__((always_inline)) F Tanh(F x) {
  typedef typename LanesOf<F>::U U;
  const U sign = reinterpret_cast<U>(x) & 0x80000000u;
  const F magnitude = reinterpret_cast<F>(reinterpret_cast<U>(x) ^ sign);
  const F e = ExpLanes(magnitude * -2.0f);
  const F far = reinterpret_cast<F>(reinterpret_cast<U>((1.0f - e) / (1.0f + e)) | sign);
  const F x2 = x * x;
  F p = F{} + -1382.0f / 155925;
  p = p * x2 + 62.0f / 2835;
  p = p * x2 - 17.0f / 315;
  p = p * x2 + 2.0f / 15;
  p = p * x2 - 1.0f / 3;
  const F near = x + x * x2 * p;
  return magnitude < 0.3f ? near : far;
}

// Gemma 2's logit cap on n scores that were computed from a query divided by
// `softcap`: scores[t] = softcap * tanh(scores[t]), in place; returns their
// maximum. The capped maximum is taken from the capped values themselves, so
// no weight e^(score - max) can exceed 1 by a rounding of tanh.
template <class F>
inline __attribute__((always_inline)) float Cap(float* scores, int n, float softcap) {
  constexpr int kW = LanesOf<F>::kW;
  F block_max = F{} - std::numeric_limits<float>::infinity();
  int t = 0;
  for (; t + kW <= n; t += kW) {
    const F c = Tanh(LoadAs<F>(scores + t)) * softcap;
    StoreAs(c, scores + t);
    block_max = c > block_max ? c : block_max;
  }
  float tile_max = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < kW; ++i) tile_max = block_max[i] > tile_max ? block_max[i] : tile_max;
  if (t < n) {
    const F c = Tanh(LoadPartialAs<F>(scores + t, n - t)) * softcap;
    StorePartialAs(c, scores + t, n - t);
    for (int i = 0; i < n - t; ++i) tile_max = c[i] > tile_max ? c[i] : tile_max;
  }
  return tile_max;
}

// acc = acc * correction + sum_t weights[t] * values[t] over kVecs vectors
// of acc from `offset` on, keeping them in registers across the tile: two
// sets of accumulators, even and odd keys, so consecutive keys' FMAs do not
// wait on each other.
template <int kVecs, class F>
inline __attribute__((always_inline)) void AccumulateVectors(float* acc, float correction, const float* weights,
                                                             const float* const* values, int n, int offset) {
  constexpr int kW = LanesOf<F>::kW;
  F even[kVecs], odd[kVecs];
  for (int i = 0; i < kVecs; ++i) {
    even[i] = LoadAs<F>(acc + offset + kW * i) * correction;
    odd[i] = F{};
  }
  int t = 0;
  for (; t + 2 <= n; t += 2) {
    for (int i = 0; i < kVecs; ++i) {
      even[i] += weights[t] * LoadAs<F>(values[t] + offset + kW * i);
      odd[i] += weights[t + 1] * LoadAs<F>(values[t + 1] + offset + kW * i);
    }
  }
  if (t < n) {
    for (int i = 0; i < kVecs; ++i) even[i] += weights[t] * LoadAs<F>(values[t] + offset + kW * i);
  }
  for (int i = 0; i < kVecs; ++i) StoreAs(even[i] + odd[i], acc + offset + kW * i);
}

// The same for a whole row of head_dim = kVecs vectors (0: any head_dim),
// at most 8 vectors a pass: two sets of 8 fill AVX2's 16 registers (AVX-512
// has 32), so a wider row (head_dim 128 at 8 lanes) goes over the tile once
// per 8 vectors rather than keep its accumulators in memory.
template <int kVecs, class F>
inline __attribute__((always_inline)) void Accumulate(float* acc, float correction, const float* weights,
                                                      const float* const* values, int n, int dim) {
  constexpr int kW = LanesOf<F>::kW;
  if constexpr (kVecs > 8) {
    static_assert(kVecs % 8 == 0, "rows of whole passes");
    for (int pass = 0; pass < kVecs; pass += 8) {
      AccumulateVectors<8, F>(acc, correction, weights, values, n, kW * pass);
    }
  } else if constexpr (kVecs > 0) {
    AccumulateVectors<kVecs, F>(acc, correction, weights, values, n, 0);
  } else {
    for (int d = 0; d < dim; ++d) acc[d] *= correction;
    for (int t = 0; t < n; ++t) {
      for (int d = 0; d < dim; ++d) acc[d] += weights[t] * values[t][d];
    }
  }
}

template <class T, int kVecs, class F>
inline __attribute__((always_inline)) void RunItem(const AttentionArgs& a, const WorkItem& w,
                                                   Partials* partials) {
  constexpr int kW = LanesOf<F>::kW;
  const int dim = a.head_dim, heads = a.heads, kv_heads = a.kv_heads, group = heads / kv_heads;
  const std::int64_t len = a.seq_lens[w.b];
  const std::int64_t q_begin = a.cu_q ? a.cu_q[w.b] : w.b;
  const std::int64_t n_new = a.cu_q ? a.cu_q[w.b + 1] - a.cu_q[w.b] : 1;
  const int nq = w.j1 - w.j0, rows = nq * heads;  // row = j * heads + h

  Scratch& s = scratch;
  s.q.resize(static_cast<std::size_t>(rows) * dim);
  s.acc.assign(static_cast<std::size_t>(rows) * dim, 0.0f);
  s.m.assign(rows, -std::numeric_limits<float>::infinity());
  s.l.assign(rows, 0.0f);
  s.keys.resize(static_cast<std::size_t>(kKeyTile) * kv_heads * dim);
  s.values.resize(static_cast<std::size_t>(kKeyTile) * kv_heads * dim);
  s.scores.resize(kKeyTile);

  // The query carries the scale, and with a cap its division by the cap too:
  // Scores then gives s / softcap, the argument of the tanh.
  const bool capped = a.softcap > 0.0f;
  const float q_scale = capped ? a.scale / a.softcap : a.scale;
  const T* q = static_cast<const T*>(a.q);
  for (int j = 0; j < nq; ++j) {
    for (int h = 0; h < heads; ++h) {
      const T* src = q + (q_begin + w.j0 + j) * a.q_stride_token + h * a.q_stride_head;
      float* dst = &s.q[(static_cast<std::size_t>(j) * heads + h) * dim];
      for (int d = 0; d < dim; ++d) dst[d] = Widen(src[d]) * q_scale;
    }
  }

  const T* kbase = static_cast<const T*>(a.k) + a.slots[w.b] * a.kv_stride_slot;
  const T* vbase = static_cast<const T*>(a.v) + a.slots[w.b] * a.kv_stride_slot;
  // Query j sits at position len - n_new + j and sees keys up to it; the
  // last query of the block sees the most. Never read at or past `len`, nor
  // below w.key_lo (with a window: where the block's first query's window
  // starts, the lowest of the block's).
  const std::int64_t first_pos = len - n_new + w.j0;
  const std::int64_t key_end = std::min(w.key_hi, first_pos + nq);
  std::vector<const float*>& key_rows = s.key_rows;
  std::vector<const float*>& value_rows = s.value_rows;
  key_rows.resize(static_cast<std::size_t>(kKeyTile) * kv_heads);
  value_rows.resize(static_cast<std::size_t>(kKeyTile) * kv_heads);
  float* scores = s.scores.data();
  // Consecutive tokens' rows lie a whole row of every layer apart (tens of
  // KiB), one page each: the hardware prefetcher does not follow, so the
  // next tile's rows are requested while this one is computed.
  const std::size_t row_bytes = static_cast<std::size_t>(dim) * sizeof(T);
  auto prefetch_tile = [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t t = first; t < last; ++t) {
      for (int kvh = 0; kvh < kv_heads; ++kvh) {
        const std::int64_t offset = t * a.kv_stride_token + kvh * a.kv_stride_head;
        const char* kp = reinterpret_cast<const char*>(kbase + offset);
        const char* vp = reinterpret_cast<const char*>(vbase + offset);
        for (std::size_t line = 0; line < row_bytes; line += 64) {
          __builtin_prefetch(kp + line);
          __builtin_prefetch(vp + line);
        }
      }
    }
  };
  prefetch_tile(w.key_lo, std::min(key_end, w.key_lo + kKeyTile));
  for (std::int64_t t0 = w.key_lo; t0 < key_end; t0 += kKeyTile) {
    const int tile = static_cast<int>(std::min<std::int64_t>(kKeyTile, key_end - t0));
    prefetch_tile(t0 + tile, std::min(key_end, t0 + tile + kKeyTile));
    for (int t = 0; t < tile; ++t) {
      for (int kvh = 0; kvh < kv_heads; ++kvh) {
        const std::int64_t offset = (t0 + t) * a.kv_stride_token + kvh * a.kv_stride_head;
        const std::size_t slot = static_cast<std::size_t>(kvh) * kKeyTile + t;
        key_rows[slot] = LoadRow<kVecs, F>(kbase + offset, &s.keys[slot * dim], dim);
        value_rows[slot] = LoadRow<kVecs, F>(vbase + offset, &s.values[slot * dim], dim);
      }
    }
    for (int j = 0; j < nq; ++j) {
      const std::int64_t visible = first_pos + j + 1 - t0;  // keys of this tile query j may see
      if (visible <= 0) continue;
      // Query j sees n keys of the tile from `skip` on: with a window, the
      // first `skip` lie below it.
      const int skip = a.window > 0 ? static_cast<int>(std::clamp<std::int64_t>(visible - a.window, 0, tile)) : 0;
      const int n = static_cast<int>(std::min<std::int64_t>(tile, visible)) - skip;
      if (n <= 0) continue;
      for (int h = 0; h < heads; ++h) {
        const int row = j * heads + h;
        const float* const* krows = &key_rows[static_cast<std::size_t>(h / group) * kKeyTile + skip];
        const float* const* vrows = &value_rows[static_cast<std::size_t>(h / group) * kKeyTile + skip];
        const float* qr = &s.q[static_cast<std::size_t>(row) * dim];
        float tile_max = Scores<kVecs, F>(qr, krows, n, dim, scores);
        if (capped) tile_max = Cap<F>(scores, n, a.softcap);
        const float m_new = std::max(s.m[row], tile_max);
        const float correction = std::exp(s.m[row] - m_new);
        // The weights e^(score - max), in place, kW at a time; a zero-padded
        // tail is computed whole but only its n lanes are kept and summed.
        F lanes = {};
        int t = 0;
        for (; t + kW <= n; t += kW) {
          const F e = ExpLanes(LoadAs<F>(scores + t) - m_new);
          StoreAs(e, scores + t);
          lanes += e;
        }
        float sum = Sum(lanes);
        if (t < n) {
          const F e = ExpLanes(LoadPartialAs<F>(scores + t, n - t) - m_new);
          StorePartialAs(e, scores + t, n - t);
          for (int i = 0; i < n - t; ++i) sum += e[i];
        }
        Accumulate<kVecs, F>(&s.acc[static_cast<std::size_t>(row) * dim], correction, scores, vrows, n, dim);
        s.m[row] = m_new;
        s.l[row] = s.l[row] * correction + sum;
      }
    }
  }

  if (partials != nullptr) {
    for (int h = 0; h < heads; ++h) {  // decode: one query
      const std::size_t i = partials->Index(w.b, h, w.split);
      partials->m[i] = s.m[h];
      partials->l[i] = s.l[h];
      std::memcpy(&partials->acc[i * dim], &s.acc[static_cast<std::size_t>(h) * dim], sizeof(float) * dim);
    }
    return;
  }
  T* out = static_cast<T*>(a.out);
  for (int j = 0; j < nq; ++j) {
    for (int h = 0; h < heads; ++h) {
      const int row = j * heads + h;
      const float inv = s.l[row] > 0.0f ? 1.0f / s.l[row] : 0.0f;  // no keys: an idle row, zeros
      const float* acc = &s.acc[static_cast<std::size_t>(row) * dim];
      T* dst = out + (q_begin + w.j0 + j) * a.out_stride_token + h * a.out_stride_head;
      for (int d = 0; d < dim; ++d) Narrow(acc[d] * inv, &dst[d]);
    }
  }
}

template <class T, class F>
inline __attribute__((always_inline)) void RunItemAnyDim(const AttentionArgs& a, const WorkItem& w,
                                                         Partials* p) {
  constexpr int kW = LanesOf<F>::kW;
  switch (a.head_dim) {
    case 64: RunItem<T, 64 / kW, F>(a, w, p); break;
    case 128: RunItem<T, 128 / kW, F>(a, w, p); break;
    default: RunItem<T, 0, F>(a, w, p); break;
  }
}

// One entry point per dtype and vector width, picked at run time by the
// CPU's features (never by vendor; cpu_vec.h).
FLEXINFER_WIDE void RunItemF32Wide(const AttentionArgs& a, const WorkItem& w, Partials* p) {
  RunItemAnyDim<float, VecF>(a, w, p);
}
FLEXINFER_WIDE void RunItemBF16Wide(const AttentionArgs& a, const WorkItem& w, Partials* p) {
  RunItemAnyDim<std::uint16_t, VecF>(a, w, p);
}
FLEXINFER_WIDE void RunItemF16Wide(const AttentionArgs& a, const WorkItem& w, Partials* p) {
  RunItemAnyDim<_Float16, VecF>(a, w, p);
}
FLEXINFER_HALVED void RunItemF32Halved(const AttentionArgs& a, const WorkItem& w, Partials* p) {
  RunItemAnyDim<float, VecF8>(a, w, p);
}
FLEXINFER_HALVED void RunItemBF16Halved(const AttentionArgs& a, const WorkItem& w, Partials* p) {
  RunItemAnyDim<std::uint16_t, VecF8>(a, w, p);
}
FLEXINFER_HALVED void RunItemF16Halved(const AttentionArgs& a, const WorkItem& w, Partials* p) {
  RunItemAnyDim<_Float16, VecF8>(a, w, p);
}

typedef void (*RunItemFn)(const AttentionArgs&, const WorkItem&, Partials*);
RunItemFn RunItemFor(DType dtype) {
  const bool wide = WideVectors();
  switch (dtype) {
    case DType::kFloat32: return wide ? RunItemF32Wide : RunItemF32Halved;
    case DType::kBFloat16: return wide ? RunItemBF16Wide : RunItemBF16Halved;
    case DType::kFloat16: return wide ? RunItemF16Wide : RunItemF16Halved;
  }
  Invalid("attention takes float32, bfloat16 or float16");
}

template <class T>
void MergeSplits(const AttentionArgs& a, const Partials& p, std::int64_t b, int h) {
  const int dim = a.head_dim;
  float m = -std::numeric_limits<float>::infinity();
  for (int s = 0; s < p.splits; ++s) m = std::max(m, p.m[p.Index(b, h, s)]);
  float acc[kMaxHeadDim] = {};
  float sum = 0.0f;
  for (int s = 0; s < p.splits; ++s) {
    const std::size_t i = p.Index(b, h, s);
    if (p.l[i] == 0.0f) continue;  // an empty piece
    const float w = std::exp(p.m[i] - m);
    sum += p.l[i] * w;
    for (int d = 0; d < dim; ++d) acc[d] += p.acc[i * dim + d] * w;
  }
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  T* dst = static_cast<T*>(a.out) + b * a.out_stride_token + h * a.out_stride_head;
  for (int d = 0; d < dim; ++d) Narrow(acc[d] * inv, &dst[d]);
}

}  // namespace

void CheckAttention(const AttentionArgs& a) {
  if (a.batch < 0 || a.num_queries < 0) Invalid("negative batch or query count");
  if (a.heads <= 0 || a.kv_heads <= 0 || a.heads % a.kv_heads != 0)
    Invalid("heads must be a positive multiple of kv_heads, got " + std::to_string(a.heads) + " and " +
            std::to_string(a.kv_heads));
  if (a.head_dim <= 0 || a.head_dim > kMaxHeadDim)
    Invalid("head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "], got " + std::to_string(a.head_dim));
  // Negated comparisons: NaN fails them too.
  if (!(a.scale > 0.0f) || !std::isfinite(a.scale)) Invalid("scale must be positive and finite");
  if (a.window < 0) Invalid("window must be 0 (none) or positive, got " + std::to_string(a.window));
  if (!(a.softcap >= 0.0f) || !std::isfinite(a.softcap)) Invalid("softcap must be 0 (none) or positive and finite");
  if (a.cu_q == nullptr && a.num_queries != a.batch) Invalid("decode takes one query per request");
  if (a.cu_q != nullptr && (a.cu_q[0] != 0 || a.cu_q[a.batch] != a.num_queries))
    Invalid("query offsets must start at 0 and end at the number of queries");
  for (std::int64_t b = 0; b < a.batch; ++b) {
    const std::int64_t slot = a.slots[b], len = a.seq_lens[b];
    if (slot < 0 || slot >= a.max_slots)
      Invalid("slot " + std::to_string(slot) + " of request " + std::to_string(b) + " is outside [0, " +
              std::to_string(a.max_slots) + ")");
    if (len < 0 || len > a.max_tokens)
      Invalid("seq_len " + std::to_string(len) + " of request " + std::to_string(b) + " is outside [0, " +
              std::to_string(a.max_tokens) + "]");
    const std::int64_t n = a.cu_q ? a.cu_q[b + 1] - a.cu_q[b] : (len > 0 ? 1 : 0);
    if (n < 0) Invalid("query offsets must not decrease");
    if (n > len)
      Invalid("request " + std::to_string(b) + " has " + std::to_string(n) + " queries but only " +
              std::to_string(len) + " cached tokens");
  }
}

void Attention(const AttentionArgs& a) {
  CheckAttention(a);
  const int group = a.heads / a.kv_heads;
  const bool decode = a.cu_q == nullptr;
  const int threads = std::max(1, a.threads);

  // The first key a query at `pos` sees: the window bounds every load from below.
  auto window_start = [&](std::int64_t pos) {
    return a.window > 0 ? std::max<std::int64_t>(0, pos - a.window + 1) : std::int64_t{0};
  };

  // Decode: split each context (its window) into pieces when requests x kv
  // heads alone would leave threads idle (a few long requests).
  Partials partials;
  if (decode && threads > 1) {
    std::int64_t longest = 0;
    for (std::int64_t b = 0; b < a.batch; ++b) {
      const std::int64_t len = a.seq_lens[b];
      longest = std::max<std::int64_t>(longest, len - window_start(len - 1));
    }
    const std::int64_t units = std::max<std::int64_t>(1, a.batch);
    const std::int64_t wanted = (2 * threads + units - 1) / units;
    partials.splits = static_cast<int>(std::clamp<std::int64_t>(longest / kMinSplitKeys, 1, wanted));
  }
  const bool split = partials.splits > 1;
  if (split) {
    partials.heads = a.heads;
    const std::size_t n = static_cast<std::size_t>(a.batch) * a.heads * partials.splits;
    partials.m.assign(n, -std::numeric_limits<float>::infinity());
    partials.l.assign(n, 0.0f);
    partials.acc.assign(n * a.head_dim, 0.0f);
  }

  std::vector<WorkItem> items;
  std::int64_t work = 0;  // ~ query-key pairs, to decide whether threads pay off
  for (std::int32_t b = 0; b < a.batch; ++b) {
    const std::int64_t len = a.seq_lens[b];
    const std::int32_t n = decode ? 1 : a.cu_q[b + 1] - a.cu_q[b];
    if (decode && len == 0) {  // idle row: zeros, nothing read
      for (int h = 0; h < a.heads; ++h) {
        if (a.dtype == DType::kFloat32) {
          std::memset(static_cast<float*>(a.out) + b * a.out_stride_token + h * a.out_stride_head, 0,
                      sizeof(float) * a.head_dim);
        } else {
          std::memset(static_cast<std::uint16_t*>(a.out) + b * a.out_stride_token + h * a.out_stride_head, 0,
                      sizeof(std::uint16_t) * a.head_dim);
        }
      }
      continue;
    }
    if (split) {
      const std::int64_t lo = window_start(len - 1);
      const std::int64_t piece = (len - lo + partials.splits - 1) / partials.splits;
      for (int s = 0; s < partials.splits; ++s) {
        items.push_back({b, 0, 1, s, std::min(len, lo + s * piece), std::min(len, lo + (s + 1) * piece)});
      }
    } else {
      for (std::int32_t j0 = 0; j0 < n; j0 += kQueryBlock) {
        items.push_back({b, j0, std::min(n, j0 + kQueryBlock), 0, window_start(len - n + j0), len});
      }
    }
    const std::int64_t seen = a.window > 0 ? std::min<std::int64_t>(a.window, len) : len;  // keys a query sees, at most
    work += static_cast<std::int64_t>(n) * seen * group;
  }

  const int workers = static_cast<int>(std::min<std::int64_t>(threads, items.size()));
  // Below this much work a parallel region costs more than it saves.
  const bool parallel = workers > 1 && work * a.head_dim >= (std::int64_t{1} << 16);
  Partials* out_partials = split ? &partials : nullptr;
  const std::int64_t count = static_cast<std::int64_t>(items.size());
  const RunItemFn run_item = RunItemFor(a.dtype);
#pragma omp parallel for schedule(dynamic, 1) num_threads(workers) if (parallel)
  for (std::int64_t i = 0; i < count; ++i) run_item(a, items[i], out_partials);
  if (!split) return;
  for (std::int64_t b = 0; b < a.batch; ++b) {
    if (a.seq_lens[b] == 0) continue;
    for (int h = 0; h < a.heads; ++h) {
      switch (a.dtype) {
        case DType::kFloat32: MergeSplits<float>(a, partials, b, h); break;
        case DType::kBFloat16: MergeSplits<std::uint16_t>(a, partials, b, h); break;
        case DType::kFloat16: MergeSplits<_Float16>(a, partials, b, h); break;
      }
    }
  }
}

}  // namespace flexinfer
