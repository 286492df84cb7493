#include "sampling_cpu.h"

#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace flexinfer {
namespace {

typedef float Vec16 __attribute__((vector_size(64)));
typedef std::int32_t Int16 __attribute__((vector_size(64)));

#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define FLEXINFER_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FLEXINFER_CLONES
#endif

// One row: 16 lanes each keep their running maximum and the first index that
// reached it (a later equal value does not replace it); lanes are merged by
// value, then by the smaller index, so the result is the row's first maximum.
FLEXINFER_CLONES std::int64_t PickRow(const float* row, std::int64_t vocab) {
  const float lowest = -std::numeric_limits<float>::infinity();
  std::int64_t v = 0;
  float best = lowest;
  std::int64_t best_index = -1;
  bool nan = false;
  if (vocab >= 16 && vocab <= std::numeric_limits<std::int32_t>::max()) {
    Vec16 lane_best = Vec16{} + lowest;
    Int16 lane_index = Int16{} - 1;
    Int16 index = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    Int16 lane_nan = Int16{};
    for (; v + 16 <= vocab; v += 16) {
      Vec16 x;
      std::memcpy(&x, row + v, sizeof x);
      const Int16 greater = x > lane_best;
      lane_best = greater ? x : lane_best;
      lane_index = greater ? index : lane_index;
      lane_nan |= x != x;
      index += 16;
    }
    for (int i = 0; i < 16; ++i) {
      nan |= lane_nan[i] != 0;
      if (lane_index[i] >= 0 && (lane_best[i] > best || (lane_best[i] == best && lane_index[i] < best_index))) {
        best = lane_best[i];
        best_index = lane_index[i];
      }
    }
  }
  for (; v < vocab; ++v) {
    nan |= std::isnan(row[v]);
    if (row[v] > best) {
      best = row[v];
      best_index = v;
    }
  }
  return nan || !std::isfinite(best) ? -1 : best_index;
}

}  // namespace

void GreedyPick(const float* logits, std::int64_t rows, std::int64_t vocab, std::int64_t stride, int threads,
                std::int64_t* out) {
  if (rows < 0 || vocab <= 0) throw std::invalid_argument("greedy_pick needs rows >= 0 and a vocabulary");
  if (rows > 1 && stride < vocab) throw std::invalid_argument("the logits' row stride is shorter than a row");
  if (rows > 0 && (logits == nullptr || out == nullptr)) throw std::invalid_argument("null logits or output");
  // Threads pay off from a few rows of a real vocabulary on.
  const bool parallel = threads > 1 && rows > 1 && rows * vocab >= (std::int64_t{1} << 17);
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
  for (std::int64_t r = 0; r < rows; ++r) out[r] = PickRow(logits + r * stride, vocab);
}

}  // namespace flexinfer
