// A matmul for few rows on the CPU: y[M, N] = x[M, K] · Wᵀ (+ bias[N])
// (+ residual[M, N]), with W [N, K] packed once, at load.
//
// Why our own: a decode step multiplies a handful of rows by every weight
// matrix, so each projection is one pass over its weight and the step is as
// fast as the weights stream from memory. The library kernels leave much of
// that bandwidth unused at few rows (scripts/bench_linear.py: oneDNN streams
// bfloat16 weights at ~12 GB/s on a machine that reads 20). Here every weight
// element is loaded once per call for all rows: the weight is packed into
// slabs of 32 output columns, k-major, so the vector loads of one k row feed
// 32 outputs of every row of a tile held in registers (kRowTile rows where
// the registers hold 16 lanes, 3 where they hold 8); rows beyond a tile
// re-read the slab from cache, not memory.
//
// Packed layout: N is padded to a multiple of kSlabColumns with zero columns;
// slab s holds columns [32 s, 32 s + 32):
//   float32   [K][32]            element (n, k) at k * 32 + n % 32
//   bfloat16  [ceil(K / 2)][32][2]  element (n, k) at (k / 2) * 64 + (n % 32) * 2 + k % 2
// (consecutive k in pairs, zero-padded to even K: the operand order of the
// AVX512-BF16 dot product, which takes two products per float32 lane).
//
// Invariants:
//  * no element of x, bias or residual outside [M, K], [N], [M, N] is read and
//    no element of y outside [M, N] is written (the padding columns and the
//    odd-K pad are never stored nor multiplied with memory past a row);
//  * every output is a float32 sum, rounded once to the output dtype;
//  * arguments are checked before anything is read; a bad one throws
//    std::invalid_argument.
// Kernels are picked at run time by the CPU's features (never by vendor): for
// bfloat16 AMX tiles (k a multiple of 32) or the AVX512-BF16 dot product where
// the CPU has them, vector code compiled for AVX-512, AVX2 and baseline
// x86-64 otherwise.
#pragma once

#include <cstdint>

#include "cpu_numeric.h"

namespace flexinfer {

constexpr int kSlabColumns = 32;
// Rows whose accumulators stay in registers while a slab streams past, at
// 16 lanes (AVX-512).
constexpr int kRowTile = 8;

// Elements (of the weight's dtype) of W [n, k] packed.
std::int64_t PackedLinearSize(std::int64_t n, std::int64_t k, DType dtype);

// Packs W ([n, k], row stride `w_stride` elements, k contiguous) into `packed`
// (PackedLinearSize elements of the same dtype).
void PackLinearWeight(const void* w, std::int64_t w_stride, std::int64_t n, std::int64_t k, DType dtype,
                      void* packed);

struct LinearArgs {
  const void* x = nullptr;  // [m, k], row stride x_stride, k contiguous
  std::int64_t x_stride = 0;
  const void* packed = nullptr;  // PackLinearWeight's output for [n, k]
  const void* bias = nullptr;    // [n] or null
  const void* residual = nullptr;  // [m, n], row stride residual_stride, or null
  std::int64_t residual_stride = 0;
  void* y = nullptr;  // [m, n], row stride y_stride
  std::int64_t y_stride = 0;
  std::int64_t m = 0, n = 0, k = 0;
  DType dtype = DType::kFloat32;  // of x, the weight, bias, residual and y alike
  int threads = 1;  // parallel workers (OpenMP); 1 runs on the calling thread
  // Forces the portable vector code where AMX or the bfloat16 dot product
  // would run (tests compare them).
  bool portable = false;
};

void PackedLinear(const LinearArgs& args);

// Whether bfloat16 calls use the CPU's AVX512-BF16 dot product.
bool HasBF16DotProduct();

// Whether bfloat16 calls with k a multiple of 32 use AMX tiles (the CPU has
// AMX-BF16 and the kernel granted this process the tile state).
bool HasAmxBF16();

}  // namespace flexinfer
