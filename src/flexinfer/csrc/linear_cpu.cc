#include "linear_cpu.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu_vec.h"

namespace flexinfer {
namespace {

#define FLEXINFER_INLINE inline __attribute__((always_inline))

// Requests the 128 bytes (two lines) at `base` + `offset` where `base` is set:
// one k row of the next slab per k row of this one.
FLEXINFER_INLINE void Prefetch(const void* base, std::size_t offset) {
  if (base != nullptr) {
    const char* p = static_cast<const char*>(base) + offset;
    __builtin_prefetch(p);
    __builtin_prefetch(p + 64);
  }
}

std::int64_t PaddedK(std::int64_t k, DType dtype) { return dtype == DType::kBFloat16 ? k + k % 2 : k; }
std::int64_t SlabCount(std::int64_t n) { return (n + kSlabColumns - 1) / kSlabColumns; }

// The epilogue of one row tile: y[row0 + r][n0 + c] = sums[r][c] + bias[n0 + c]
// + residual[row0 + r][n0 + c], for the slab's columns that exist.
template <class T>
FLEXINFER_INLINE void Finish(const LinearArgs& a, std::int64_t row0, int rows, std::int64_t n0,
                             const float* sums) {
  const int valid = static_cast<int>(std::min<std::int64_t>(kSlabColumns, a.n - n0));
  const T* bias = a.bias ? static_cast<const T*>(a.bias) + n0 : nullptr;
  for (int r = 0; r < rows; ++r) {
    const float* s = sums + r * kSlabColumns;
    T* y = static_cast<T*>(a.y) + (row0 + r) * a.y_stride + n0;
    const T* res = a.residual ? static_cast<const T*>(a.residual) + (row0 + r) * a.residual_stride + n0 : nullptr;
    if (valid == kSlabColumns) {
      for (int half = 0; half < kSlabColumns; half += 16) {
        VecF v = Load(s + half);
        if (bias) v += Load(bias + half);
        if (res) v += Load(res + half);
        Store(v, y + half);
      }
    } else {
      for (int c = 0; c < valid; ++c) {
        float v = s[c];
        if (bias) v += Widen(bias[c]);
        if (res) v += Widen(res[c]);
        Narrow(v, &y[c]);
      }
    }
  }
}

// Rows of a tile at float vector F's width: their accumulators (32 columns
// each, 32 / lanes vectors) stay in registers beside the slab's weights. 16
// lanes: 8 rows take 16 of AVX-512's 32 registers. 8 lanes: a row takes 4 of
// AVX2's 16, so 3 rows (with the weights and the broadcast row values) is as
// far as it goes without spilling accumulators to the stack.
template <class F>
constexpr int kTileRows = std::is_same_v<F, VecF> ? kRowTile : 3;

// Sums of R rows of x against one float32 slab ([k][32]): each k loads the
// slab's 32 weights once for all R rows.
template <class F, int R>
FLEXINFER_INLINE void TileF32(const float* x, std::int64_t x_stride, const float* slab, std::int64_t k,
                              const float* next, float* sums) {
  constexpr int W = LanesOf<F>::kW, G = kSlabColumns / W;
  F acc[R][G] = {};
  for (std::int64_t kk = 0; kk < k; ++kk) {
    Prefetch(next, kk * kSlabColumns * sizeof(float));
    F w[G];
    for (int g = 0; g < G; ++g) w[g] = LoadAs<F>(slab + kk * kSlabColumns + g * W);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float xs = x[r * x_stride + kk];
      for (int g = 0; g < G; ++g) acc[r][g] += w[g] * xs;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) StoreAs(acc[r][g], sums + r * kSlabColumns + g * W);
}

// The same for a bfloat16 slab ([k/2][32][2]), widening each pair of k to
// two float32 vectors: the low half of a 32-bit lane is the even k. At 16
// lanes the pair's 4 widened weight vectors stay in registers while each
// row's two values are broadcast; at 8 lanes those would be 8 registers
// beside 12 accumulators, so each row's values are broadcast once per pair
// and the weights widened a column group at a time.
template <class F, int R>
FLEXINFER_INLINE void TileBF16(const std::uint16_t* x, std::int64_t x_stride, const std::uint16_t* slab,
                               std::int64_t k, const std::uint16_t* next, float* sums) {
  typedef typename LanesOf<F>::U U;
  constexpr int W = LanesOf<F>::kW, G = kSlabColumns / W;
  F acc[R][G] = {};
  const std::int64_t pairs = (k + 1) / 2;
  for (std::int64_t p = 0; p < pairs; ++p) {
    Prefetch(next, p * 2 * kSlabColumns * sizeof(std::uint16_t));
    const bool has_odd = 2 * p + 1 < k;  // an odd k's last pair has no second element to read
    const auto widened = [&](int g, F* even, F* odd) {
      U b;
      std::memcpy(&b, slab + p * 2 * kSlabColumns + g * 2 * W, sizeof b);
      *even = reinterpret_cast<F>(b << 16);
      *odd = reinterpret_cast<F>(b & 0xFFFF0000u);
    };
    if constexpr (std::is_same_v<F, VecF>) {
      F even[G], odd[G];
      for (int g = 0; g < G; ++g) widened(g, &even[g], &odd[g]);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const std::uint16_t* xr = x + r * x_stride + 2 * p;
        const float x0 = Widen(xr[0]), x1 = has_odd ? Widen(xr[1]) : 0.0f;
        for (int g = 0; g < G; ++g) acc[r][g] += even[g] * x0;
        for (int g = 0; g < G; ++g) acc[r][g] += odd[g] * x1;
      }
    } else {
      float x0[R], x1[R];
      for (int r = 0; r < R; ++r) {
        const std::uint16_t* xr = x + r * x_stride + 2 * p;
        x0[r] = Widen(xr[0]);
        x1[r] = has_odd ? Widen(xr[1]) : 0.0f;
      }
      for (int g = 0; g < G; ++g) {
        F even, odd;
        widened(g, &even, &odd);
        for (int r = 0; r < R; ++r) {
          acc[r][g] += even * x0[r];
          acc[r][g] += odd * x1[r];
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) StoreAs(acc[r][g], sums + r * kSlabColumns + g * W);
}

// The tile of `rows` (1..kTileRows<F>) rows, with R known at compile time.
template <class T, class F, int R = 1>
FLEXINFER_INLINE void Tile(int rows, const T* x, std::int64_t x_stride, const T* slab, std::int64_t k,
                           const T* next, float* sums) {
  if constexpr (R < kTileRows<F>) {
    if (rows > R) {
      Tile<T, F, R + 1>(rows, x, x_stride, slab, k, next, sums);
      return;
    }
  }
  if constexpr (std::is_same_v<T, float>) {
    TileF32<F, R>(x, x_stride, slab, k, next, sums);
  } else {
    TileBF16<F, R>(x, x_stride, slab, k, next, sums);
  }
}

// Slabs [s0, s1) for every row, in row tiles of up to kTileRows<F>: a slab
// is read from memory by the first tile and from cache by the others.
template <class T, class F>
FLEXINFER_INLINE void PortableSlabs(const LinearArgs& a, std::int64_t s0, std::int64_t s1) {
  alignas(64) float sums[kTileRows<F> * kSlabColumns];
  const T* x = static_cast<const T*>(a.x);
  const std::int64_t slab_size = PaddedK(a.k, a.dtype) * kSlabColumns;
  for (std::int64_t s = s0; s < s1; ++s) {
    const T* slab = static_cast<const T*>(a.packed) + s * slab_size;
    // The first row tile streams this slab from memory while it requests
    // the next one; later tiles read this slab from cache.
    const T* next = s + 1 < s1 ? slab + slab_size : nullptr;
    for (std::int64_t row0 = 0; row0 < a.m; row0 += kTileRows<F>, next = nullptr) {
      const int rows = static_cast<int>(std::min<std::int64_t>(kTileRows<F>, a.m - row0));
      Tile<T, F>(rows, x + row0 * a.x_stride, a.x_stride, slab, a.k, next, sums);
      Finish<T>(a, row0, rows, s * kSlabColumns, sums);
    }
  }
}

FLEXINFER_WIDE void PortableSlabsF32Wide(const LinearArgs& a, std::int64_t s0, std::int64_t s1) {
  PortableSlabs<float, VecF>(a, s0, s1);
}
FLEXINFER_WIDE void PortableSlabsBF16Wide(const LinearArgs& a, std::int64_t s0, std::int64_t s1) {
  PortableSlabs<std::uint16_t, VecF>(a, s0, s1);
}
FLEXINFER_HALVED void PortableSlabsF32Halved(const LinearArgs& a, std::int64_t s0, std::int64_t s1) {
  PortableSlabs<float, VecF8>(a, s0, s1);
}
FLEXINFER_HALVED void PortableSlabsBF16Halved(const LinearArgs& a, std::int64_t s0, std::int64_t s1) {
  PortableSlabs<std::uint16_t, VecF8>(a, s0, s1);
}

#if defined(__x86_64__)
#define FLEXINFER_HAVE_BF16_DOT 1
// AVX512-BF16: vdpbf16ps adds two bfloat16 products per float32 lane, so one
// instruction consumes a whole [32 bf16] pair row of a slab half. Compiled
// for that ISA only and called only where the CPU reports it.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bf16")

template <int R>
FLEXINFER_INLINE void DotTileBF16(const std::uint16_t* x, std::int64_t x_stride, const std::uint16_t* slab,
                                  std::int64_t k, float* sums) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const std::int64_t full_pairs = k / 2;
  for (std::int64_t p = 0; p < full_pairs; ++p) {
    const __m512i w0 = _mm512_loadu_si512(slab + p * 2 * kSlabColumns);
    const __m512i w1 = _mm512_loadu_si512(slab + p * 2 * kSlabColumns + 32);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      std::uint32_t pair;
      std::memcpy(&pair, x + r * x_stride + 2 * p, sizeof pair);
      const __m512i xv = _mm512_set1_epi32(static_cast<int>(pair));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)xv, (__m512bh)w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)xv, (__m512bh)w1);
    }
  }
  if (k % 2) {  // the last k alone: its pair's second weight is the zero pad
    const __m512i w0 = _mm512_loadu_si512(slab + full_pairs * 2 * kSlabColumns);
    const __m512i w1 = _mm512_loadu_si512(slab + full_pairs * 2 * kSlabColumns + 32);
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_set1_epi32(static_cast<int>(x[r * x_stride + k - 1]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)xv, (__m512bh)w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)xv, (__m512bh)w1);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(sums + r * kSlabColumns, acc[r][0]);
    _mm512_storeu_ps(sums + r * kSlabColumns + 16, acc[r][1]);
  }
}

void DotSlabsBF16(const LinearArgs& a, std::int64_t s0, std::int64_t s1) {
  alignas(64) float sums[kRowTile * kSlabColumns];
  const std::uint16_t* x = static_cast<const std::uint16_t*>(a.x);
  const std::int64_t slab_size = PaddedK(a.k, a.dtype) * kSlabColumns;
  for (std::int64_t s = s0; s < s1; ++s) {
    const std::uint16_t* slab = static_cast<const std::uint16_t*>(a.packed) + s * slab_size;
    for (std::int64_t row0 = 0; row0 < a.m; row0 += kRowTile) {
      const int rows = static_cast<int>(std::min<std::int64_t>(kRowTile, a.m - row0));
      const std::uint16_t* xr = x + row0 * a.x_stride;
      switch (rows) {
        case 1: DotTileBF16<1>(xr, a.x_stride, slab, a.k, sums); break;
        case 2: DotTileBF16<2>(xr, a.x_stride, slab, a.k, sums); break;
        case 3: DotTileBF16<3>(xr, a.x_stride, slab, a.k, sums); break;
        case 4: DotTileBF16<4>(xr, a.x_stride, slab, a.k, sums); break;
        case 5: DotTileBF16<5>(xr, a.x_stride, slab, a.k, sums); break;
        case 6: DotTileBF16<6>(xr, a.x_stride, slab, a.k, sums); break;
        case 7: DotTileBF16<7>(xr, a.x_stride, slab, a.k, sums); break;
        default: DotTileBF16<8>(xr, a.x_stride, slab, a.k, sums); break;
      }
      Finish<std::uint16_t>(a, row0, rows, s * kSlabColumns, sums);
    }
  }
}

#pragma GCC pop_options

// AMX: tdpbf16ps multiplies a tile of up to 16 x rows by 32 k (64 bytes per
// row) with a tile of 16 k pairs x 16 columns, into 16 x 16 float32 sums.
// The bfloat16 slab layout is already AMX's: a k-pair row of a slab is 32
// columns x 2, so columns [0, 16) and [16, 32) are two B tiles 128 bytes
// apart per row. Up to 32 rows at once: C tiles 0-3 (row half x column
// half), A tiles 4-5, B tiles 6-7. Taken for k a multiple of 32.
#pragma GCC push_options
#pragma GCC target("avx512f,amx-tile,amx-bf16")

struct alignas(64) TileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

// Tiles for a block of `rows` (1..32) x rows.
void ConfigureTiles(int rows) {
  TileConfig config;
  const int upper = std::min(rows, 16), lower = rows - upper;
  for (int t : {0, 1, 4}) {  // C of the first 16 rows, A of them
    config.rows[t] = static_cast<std::uint8_t>(upper);
    config.colsb[t] = 64;
  }
  for (int t : {2, 3, 5}) {  // the same for rows 16..31 (unused below 17 rows)
    config.rows[t] = static_cast<std::uint8_t>(lower > 0 ? lower : 1);
    config.colsb[t] = 64;
  }
  for (int t : {6, 7}) {  // B: 16 k pairs x 16 columns
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

void AmxSlabsBF16(const LinearArgs& a, std::int64_t s0, std::int64_t s1) {
  constexpr int kBlockRows = 32;
  alignas(64) float sums[kBlockRows * kSlabColumns];
  const std::uint16_t* x = static_cast<const std::uint16_t*>(a.x);
  const std::int64_t slab_size = a.k * kSlabColumns;
  const std::int64_t x_bytes = a.x_stride * static_cast<std::int64_t>(sizeof(std::uint16_t));
  int configured = 0;
  for (std::int64_t s = s0; s < s1; ++s) {
    const std::uint16_t* slab = static_cast<const std::uint16_t*>(a.packed) + s * slab_size;
    const std::uint16_t* next = s + 1 < s1 ? slab + slab_size : nullptr;
    for (std::int64_t row0 = 0; row0 < a.m; row0 += kBlockRows, next = nullptr) {
      const int rows = static_cast<int>(std::min<std::int64_t>(kBlockRows, a.m - row0));
      if (rows != configured) {
        ConfigureTiles(rows);
        configured = rows;
      }
      const std::uint16_t* xr = x + row0 * a.x_stride;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (std::int64_t kk = 0; kk < a.k; kk += 32) {
        // 16 k pairs of the slab: 16 rows of 128 bytes.
        const std::uint16_t* b = slab + kk * kSlabColumns;
        if (next != nullptr) {
          const char* ahead = reinterpret_cast<const char*>(next + kk * kSlabColumns);
          for (int line = 0; line < 32; ++line) __builtin_prefetch(ahead + 64 * line);
        }
        _tile_loadd(6, b, 128);
        _tile_loadd(7, b + 32, 128);
        _tile_loadd(4, xr + kk, x_bytes);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (rows > 16) {
          _tile_loadd(5, xr + 16 * a.x_stride + kk, x_bytes);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, sums, kSlabColumns * sizeof(float));
      _tile_stored(1, sums + 16, kSlabColumns * sizeof(float));
      if (rows > 16) {
        _tile_stored(2, sums + 16 * kSlabColumns, kSlabColumns * sizeof(float));
        _tile_stored(3, sums + 16 * kSlabColumns + 16, kSlabColumns * sizeof(float));
      }
      Finish<std::uint16_t>(a, row0, rows, s * kSlabColumns, sums);
    }
  }
  if (configured) _tile_release();
}

#pragma GCC pop_options
#endif

void CheckShape(std::int64_t n, std::int64_t k, DType dtype) {
  if (n < 0 || k < 0) Invalid("negative weight shape");
  if (dtype != DType::kFloat32 && dtype != DType::kBFloat16)
    Invalid("the packed linear kernel takes float32 or bfloat16");
}

void Validate(const LinearArgs& a) {
  CheckShape(a.n, a.k, a.dtype);
  if (a.m < 0) Invalid("negative row count");
  if (a.m == 0 || a.n == 0) return;
  if (a.x == nullptr || a.y == nullptr || (a.k > 0 && a.packed == nullptr)) Invalid("null x, y or weight");
  if (a.x_stride < a.k) Invalid("x's row stride is shorter than a row");
  if (a.y_stride < a.n) Invalid("y's row stride is shorter than a row");
  if (a.residual != nullptr && a.residual_stride < a.n) Invalid("residual's row stride is shorter than a row");
}

}  // namespace

std::int64_t PackedLinearSize(std::int64_t n, std::int64_t k, DType dtype) {
  CheckShape(n, k, dtype);
  return SlabCount(n) * kSlabColumns * PaddedK(k, dtype);
}

namespace {

template <class T>
void Pack(const T* w, std::int64_t w_stride, std::int64_t n, std::int64_t k, T* packed) {
  const std::int64_t slabs = SlabCount(n);
  const std::int64_t slab_size = PaddedK(k, sizeof(T) == 2 ? DType::kBFloat16 : DType::kFloat32) * kSlabColumns;
  // Padding columns (and bfloat16's odd-k pad) are zeros.
  std::memset(packed, 0, sizeof(T) * slabs * slab_size);
  for (std::int64_t row = 0; row < n; ++row) {
    T* slab = packed + (row / kSlabColumns) * slab_size;
    const std::int64_t c = row % kSlabColumns;
    const T* src = w + row * w_stride;
    for (std::int64_t kk = 0; kk < k; ++kk) {
      if constexpr (sizeof(T) == 2) {
        slab[(kk / 2) * 2 * kSlabColumns + c * 2 + kk % 2] = src[kk];
      } else {
        slab[kk * kSlabColumns + c] = src[kk];
      }
    }
  }
}

}  // namespace

void PackLinearWeight(const void* w, std::int64_t w_stride, std::int64_t n, std::int64_t k, DType dtype,
                      void* packed) {
  CheckShape(n, k, dtype);
  if (n > 0 && k > 0 && (w == nullptr || packed == nullptr)) Invalid("null weight");
  if (n > 1 && w_stride < k) Invalid("the weight's row stride is shorter than a row");
  if (dtype == DType::kFloat32) {
    Pack(static_cast<const float*>(w), w_stride, n, k, static_cast<float*>(packed));
  } else {
    Pack(static_cast<const std::uint16_t*>(w), w_stride, n, k, static_cast<std::uint16_t*>(packed));
  }
}

bool HasAmxBF16() {
#if defined(FLEXINFER_HAVE_BF16_DOT)
  static const bool has = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool cpu = (edx >> 22 & 1) && (edx >> 24 & 1);  // AMX-BF16, AMX-TILE
    if (!cpu || !(ecx >> 27 & 1)) return false;             // and OSXSAVE for xgetbv
    std::uint32_t lo, hi;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo >> 17 & 3) != 3) return false;  // the OS saves tile state (XTILECFG, XTILEDATA)
    // Linux hands out the tile state only on request, once per process.
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return has;
#else
  return false;
#endif
}

bool HasBF16DotProduct() {
#if defined(FLEXINFER_HAVE_BF16_DOT)
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

void PackedLinear(const LinearArgs& a) {
  Validate(a);
  if (a.m == 0 || a.n == 0) return;
  const std::int64_t slabs = SlabCount(a.n);
  const bool native = a.dtype == DType::kBFloat16 && !a.portable;
  const bool amx = native && a.k % 32 == 0 && HasAmxBF16();
  const bool dot = native && HasBF16DotProduct();
  const bool wide = WideVectors();
  auto run = [&a, amx, dot, wide](std::int64_t s0, std::int64_t s1) {
    if (a.dtype == DType::kFloat32) {
      (wide ? PortableSlabsF32Wide : PortableSlabsF32Halved)(a, s0, s1);
#if defined(FLEXINFER_HAVE_BF16_DOT)
    } else if (amx) {
      AmxSlabsBF16(a, s0, s1);
    } else if (dot) {
      DotSlabsBF16(a, s0, s1);
#endif
    } else {
      (wide ? PortableSlabsBF16Wide : PortableSlabsBF16Halved)(a, s0, s1);
    }
  };
  // Each worker streams its own contiguous run of slabs. Below 64K
  // multiply-adds a parallel region costs more than it saves.
  ForRows(slabs, a.m * a.n * std::max<std::int64_t>(a.k, 1), a.threads, run, std::int64_t{1} << 16);
}

}  // namespace flexinfer
