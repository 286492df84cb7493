#include "attention_cpu.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

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

// A unit of work: queries [j0, j1) of request b for the query heads of kv
// head kvh, over keys [key_lo, key_hi) (a piece of the context when split).
struct WorkItem {
  std::int32_t b, kvh, j0, j1, split;
  std::int64_t key_lo, key_hi;
};

float Widen(float x) { return x; }
float Widen(std::uint16_t bits) {  // bfloat16
  std::uint32_t u = static_cast<std::uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
float Widen(_Float16 x) { return static_cast<float>(x); }

void Narrow(float x, float* dst) { *dst = x; }
void Narrow(float x, std::uint16_t* dst) {  // to bfloat16, round to nearest even
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if (std::isnan(x)) {
    *dst = static_cast<std::uint16_t>((u >> 16) | 0x40);
    return;
  }
  u += 0x7FFF + ((u >> 16) & 1);
  *dst = static_cast<std::uint16_t>(u >> 16);
}
void Narrow(float x, _Float16* dst) { *dst = static_cast<_Float16>(x); }

// Row `t` of a K or V head as float32: the row itself for float32 caches, a
// widened copy in `buf` otherwise.
template <class T>
inline __attribute__((always_inline)) const float* LoadRow(const T* src, float* buf, int dim) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (int d = 0; d < dim; ++d) buf[d] = Widen(src[d]);
    return buf;
  }
}

// Per-thread scratch, grown once and reused across calls.
struct Scratch {
  std::vector<float> q, acc, m, l, keys, values, scores;
};
thread_local Scratch scratch;

// Partial results of a split decode context: running max, sum and the
// unnormalised output per (request, query head, split).
struct Partials {
  int splits = 1, dim = 0, heads = 0;
  std::vector<float> m, l, acc;
  std::size_t Index(std::int64_t b, int h, int s) const {
    return (static_cast<std::size_t>(b) * heads + h) * splits + s;
  }
};

template <class T>
inline __attribute__((always_inline)) void RunItem(const AttentionArgs& a, const WorkItem& w,
                                                   Partials* partials) {
  const int dim = a.head_dim, group = a.heads / a.kv_heads;
  const std::int64_t len = a.seq_lens[w.b];
  const std::int64_t q_begin = a.cu_q ? a.cu_q[w.b] : w.b;
  const std::int64_t n_new = a.cu_q ? a.cu_q[w.b + 1] - a.cu_q[w.b] : 1;
  const int nq = w.j1 - w.j0, rows = nq * group;

  Scratch& s = scratch;
  s.q.resize(static_cast<std::size_t>(rows) * dim);
  s.acc.assign(static_cast<std::size_t>(rows) * dim, 0.0f);
  s.m.assign(rows, -std::numeric_limits<float>::infinity());
  s.l.assign(rows, 0.0f);
  s.keys.resize(static_cast<std::size_t>(kKeyTile) * dim);
  s.values.resize(static_cast<std::size_t>(kKeyTile) * dim);
  s.scores.resize(kKeyTile);

  const T* q = static_cast<const T*>(a.q);
  for (int j = 0; j < nq; ++j) {
    for (int g = 0; g < group; ++g) {
      const T* src = q + (q_begin + w.j0 + j) * a.q_stride_token + (w.kvh * group + g) * a.q_stride_head;
      float* dst = &s.q[(static_cast<std::size_t>(j) * group + g) * dim];
      for (int d = 0; d < dim; ++d) dst[d] = Widen(src[d]) * a.scale;
    }
  }

  const T* kbase = static_cast<const T*>(a.k) + a.slots[w.b] * a.kv_stride_slot + w.kvh * a.kv_stride_head;
  const T* vbase = static_cast<const T*>(a.v) + a.slots[w.b] * a.kv_stride_slot + w.kvh * a.kv_stride_head;
  // Query j sits at position len - n_new + j and sees keys up to it; the
  // last query of the block sees the most. Never read at or past `len`.
  const std::int64_t first_pos = len - n_new + w.j0;
  const std::int64_t key_end = std::min(w.key_hi, first_pos + nq);
  const float* key_rows[kKeyTile];
  const float* value_rows[kKeyTile];
  for (std::int64_t t0 = w.key_lo; t0 < key_end; t0 += kKeyTile) {
    const int tile = static_cast<int>(std::min<std::int64_t>(kKeyTile, key_end - t0));
    for (int t = 0; t < tile; ++t) {
      key_rows[t] = LoadRow(kbase + (t0 + t) * a.kv_stride_token, &s.keys[static_cast<std::size_t>(t) * dim], dim);
      value_rows[t] =
          LoadRow(vbase + (t0 + t) * a.kv_stride_token, &s.values[static_cast<std::size_t>(t) * dim], dim);
    }
    for (int j = 0; j < nq; ++j) {
      const std::int64_t visible = first_pos + j + 1 - t0;  // keys of this tile query j may see
      if (visible <= 0) continue;
      const int n = static_cast<int>(std::min<std::int64_t>(tile, visible));
      for (int g = 0; g < group; ++g) {
        const int row = j * group + g;
        const float* qr = &s.q[static_cast<std::size_t>(row) * dim];
        float tile_max = -std::numeric_limits<float>::infinity();
        for (int t = 0; t < n; ++t) {
          const float* kr = key_rows[t];
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int d = 0; d < dim; ++d) dot += qr[d] * kr[d];
          s.scores[t] = dot;
          tile_max = std::max(tile_max, dot);
        }
        const float m_new = std::max(s.m[row], tile_max);
        const float correction = std::exp(s.m[row] - m_new);
        float* acc = &s.acc[static_cast<std::size_t>(row) * dim];
        if (correction != 1.0f) {
          for (int d = 0; d < dim; ++d) acc[d] *= correction;
        }
        float sum = s.l[row] * correction;
        for (int t = 0; t < n; ++t) {
          const float p = std::exp(s.scores[t] - m_new);
          sum += p;
          const float* vr = value_rows[t];
#pragma omp simd
          for (int d = 0; d < dim; ++d) acc[d] += p * vr[d];
        }
        s.m[row] = m_new;
        s.l[row] = sum;
      }
    }
  }

  if (partials != nullptr) {
    for (int g = 0; g < group; ++g) {  // decode: one query
      const std::size_t i = partials->Index(w.b, w.kvh * group + g, w.split);
      partials->m[i] = s.m[g];
      partials->l[i] = s.l[g];
      std::memcpy(&partials->acc[i * dim], &s.acc[static_cast<std::size_t>(g) * dim], sizeof(float) * dim);
    }
    return;
  }
  T* out = static_cast<T*>(a.out);
  for (int j = 0; j < nq; ++j) {
    for (int g = 0; g < group; ++g) {
      const int row = j * group + g;
      const float inv = s.l[row] > 0.0f ? 1.0f / s.l[row] : 0.0f;  // no keys: an idle row, zeros
      const float* acc = &s.acc[static_cast<std::size_t>(row) * dim];
      T* dst = out + (q_begin + w.j0 + j) * a.out_stride_token + (w.kvh * group + g) * a.out_stride_head;
      for (int d = 0; d < dim; ++d) Narrow(acc[d] * inv, &dst[d]);
    }
  }
}

// One entry point per dtype, compiled for several instruction sets and picked
// at load time by the CPU's features (never by vendor).
#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define FLEXINFER_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FLEXINFER_CLONES
#endif

FLEXINFER_CLONES void RunItemF32(const AttentionArgs& a, const WorkItem& w, Partials* p) {
  RunItem<float>(a, w, p);
}
FLEXINFER_CLONES void RunItemBF16(const AttentionArgs& a, const WorkItem& w, Partials* p) {
  RunItem<std::uint16_t>(a, w, p);
}
FLEXINFER_CLONES void RunItemF16(const AttentionArgs& a, const WorkItem& w, Partials* p) {
  RunItem<_Float16>(a, w, p);
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

[[noreturn]] void Invalid(const std::string& message) { throw std::invalid_argument(message); }

void Validate(const AttentionArgs& a) {
  if (a.batch < 0 || a.num_queries < 0) Invalid("negative batch or query count");
  if (a.heads <= 0 || a.kv_heads <= 0 || a.heads % a.kv_heads != 0)
    Invalid("heads must be a positive multiple of kv_heads, got " + std::to_string(a.heads) + " and " +
            std::to_string(a.kv_heads));
  if (a.head_dim <= 0 || a.head_dim > kMaxHeadDim)
    Invalid("head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "], got " + std::to_string(a.head_dim));
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

}  // namespace

void Attention(const AttentionArgs& a) {
  Validate(a);
  const int group = a.heads / a.kv_heads;
  const bool decode = a.cu_q == nullptr;
  const int threads = std::max(1, a.threads);

  // Decode: split each context into pieces when requests x kv heads alone
  // would leave threads idle (a few long requests).
  Partials partials;
  if (decode && threads > 1) {
    std::int64_t longest = 0;
    for (std::int64_t b = 0; b < a.batch; ++b) longest = std::max<std::int64_t>(longest, a.seq_lens[b]);
    const std::int64_t units = std::max<std::int64_t>(1, a.batch * a.kv_heads);
    const std::int64_t wanted = (2 * threads + units - 1) / units;
    partials.splits = static_cast<int>(std::clamp<std::int64_t>(longest / kMinSplitKeys, 1, wanted));
  }
  const bool split = partials.splits > 1;
  if (split) {
    partials.dim = a.head_dim;
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
    for (std::int32_t kvh = 0; kvh < a.kv_heads; ++kvh) {
      if (split) {
        const std::int64_t piece = (len + partials.splits - 1) / partials.splits;
        for (int s = 0; s < partials.splits; ++s) {
          items.push_back({b, kvh, 0, 1, s, std::min(len, s * piece), std::min(len, (s + 1) * piece)});
        }
      } else {
        for (std::int32_t j0 = 0; j0 < n; j0 += kQueryBlock) {
          items.push_back({b, kvh, j0, std::min(n, j0 + kQueryBlock), 0, 0, len});
        }
      }
    }
    work += static_cast<std::int64_t>(n) * len * group;
  }

  const int workers = static_cast<int>(std::min<std::int64_t>(threads, items.size()));
  // Below this much work a parallel region costs more than it saves.
  const bool parallel = workers > 1 && work * a.head_dim >= (std::int64_t{1} << 16);
  Partials* out_partials = split ? &partials : nullptr;
  const std::int64_t count = static_cast<std::int64_t>(items.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(workers) if (parallel)
  for (std::int64_t i = 0; i < count; ++i) {
    switch (a.dtype) {
      case DType::kFloat32: RunItemF32(a, items[i], out_partials); break;
      case DType::kBFloat16: RunItemBF16(a, items[i], out_partials); break;
      case DType::kFloat16: RunItemF16(a, items[i], out_partials); break;
    }
  }
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
