#include "sampling_cpu.h"

#include <cmath>
#include <limits>

#include "cpu_vec.h"

namespace flexinfer {
namespace {

// One row: 16 lanes each keep their running maximum and the first index that
// reached it (a later equal value does not replace it); lanes are merged by
// value, then by the smaller index, so the result is the row's first maximum.
FLEXINFER_CLONES std::int64_t PickRow(const float* row, std::int64_t vocab) {
  const float lowest = -std::numeric_limits<float>::infinity();
  std::int64_t v = 0;
  float best = lowest;
  std::int64_t best_index = -1;
  bool nan = false;
  if (vocab >= kLanes && vocab <= std::numeric_limits<std::int32_t>::max()) {
    VecF lane_best = Splat(lowest);
    VecI lane_index = VecI{} - 1;
    VecI index = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    VecI lane_nan = VecI{};
    for (; v + kLanes <= vocab; v += kLanes) {
      const VecF x = Load(row + v);
      const VecI greater = x > lane_best;
      lane_best = greater ? x : lane_best;
      lane_index = greater ? index : lane_index;
      lane_nan |= x != x;
      index += kLanes;
    }
    for (int i = 0; i < kLanes; ++i) {
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
  if (rows < 0 || vocab <= 0) Invalid("greedy_pick needs rows >= 0 and a vocabulary");
  if (rows > 1 && stride < vocab) Invalid("the logits' row stride is shorter than a row");
  if (rows > 0 && (logits == nullptr || out == nullptr)) Invalid("null logits or output");
  // Threads pay off from a few rows of a real vocabulary on.
  ForRows(rows, rows * vocab, threads, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) out[r] = PickRow(logits + r * stride, vocab);
  }, std::int64_t{1} << 17);
}

}  // namespace flexinfer
