#include "sampling_cpu.h"

#include <cmath>
#include <limits>

#include "cpu_vec.h"

namespace flexinfer {
namespace {

// One row: W lanes each keep their running maximum and the first index that
// reached it (a later equal value does not replace it); lanes are merged by
// value, then by the smaller index, so the result is the row's first maximum,
// whatever W. F: VecF or VecF8, the width of the registers the caller's
// target has (a running state in a vector wider than them would live in
// memory; cpu_vec.h).
template <class F>
inline __attribute__((always_inline)) std::int64_t PickRow(const float* row, std::int64_t vocab) {
  typedef typename LanesOf<F>::I I;
  constexpr int kW = LanesOf<F>::kW;
  const float lowest = -std::numeric_limits<float>::infinity();
  std::int64_t v = 0;
  float best = lowest;
  std::int64_t best_index = -1;
  bool nan = false;
  if (vocab >= kW && vocab <= std::numeric_limits<std::int32_t>::max()) {
    F lane_best = F{} + lowest;
    I lane_index = I{} - 1;
    I index;
    for (int i = 0; i < kW; ++i) index[i] = i;
    I lane_nan = I{};
    for (; v + kW <= vocab; v += kW) {
      const F x = LoadAs<F>(row + v);
      const I greater = x > lane_best;
      lane_best = greater ? x : lane_best;
      lane_index = greater ? index : lane_index;
      lane_nan |= x != x;
      index += kW;
    }
    for (int i = 0; i < kW; ++i) {
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

template <class F>
inline __attribute__((always_inline)) void PickRows(const float* logits, std::int64_t begin, std::int64_t end,
                                                    std::int64_t vocab, std::int64_t stride, std::int64_t* out) {
  for (std::int64_t r = begin; r < end; ++r) out[r] = PickRow<F>(logits + r * stride, vocab);
}
// 16 lanes where registers hold them (AVX-512), 8 elsewhere.
FLEXINFER_WIDE void PickRowsWide(const float* logits, std::int64_t begin, std::int64_t end, std::int64_t vocab,
                                 std::int64_t stride, std::int64_t* out) {
  PickRows<VecF>(logits, begin, end, vocab, stride, out);
}
FLEXINFER_HALVED void PickRowsHalved(const float* logits, std::int64_t begin, std::int64_t end, std::int64_t vocab,
                                     std::int64_t stride, std::int64_t* out) {
  PickRows<VecF8>(logits, begin, end, vocab, stride, out);
}

}  // namespace

void GreedyPick(const float* logits, std::int64_t rows, std::int64_t vocab, std::int64_t stride, int threads,
                std::int64_t* out) {
  if (rows < 0 || vocab <= 0) Invalid("greedy_pick needs rows >= 0 and a vocabulary");
  if (rows > 1 && stride < vocab) Invalid("the logits' row stride is shorter than a row");
  if (rows > 0 && (logits == nullptr || out == nullptr)) Invalid("null logits or output");
  // Threads pay off from a few rows of a real vocabulary on.
  const auto pick = WideVectors() ? PickRowsWide : PickRowsHalved;
  ForRows(rows, rows * vocab, threads, [&](std::int64_t begin, std::int64_t end) {
    pick(logits, begin, end, vocab, stride, out);
  }, std::int64_t{1} << 17);
}

}  // namespace flexinfer
