// tandem's product: y = x @ weight^T (+ bias), for any number of tokens, over a copy of
// the weight laid out in panels; float32, and bfloat16 where built with AVX512_BF16.
//
// Built with the decode kernel by tandem/scheduler/kernels/cpu_build.py and
// registered as torch.ops.tandem.linear_panels, on CPUs with AVX-512, or AVX2 and FMA
// for float32 (the library has no such op elsewhere); see docs/guides/adding-a-model.md,
// "Adding a new architecture", its bullet "The fused CPU ops".
//
// The panels (models/packing.py, to_panels) hold the weight's output columns 48 at a
// time: panel p is a contiguous [K, 48] block, columns 48p..48p+47 of weight^T, the
// last one zero-filled past N. A tile of up to 8 rows of x by one panel keeps 8 x 3
// vectors of sums in registers while it reads the panel once, from the first of its K
// rows to the last: one address-ordered stream, which the hardware prefetchers keep
// ahead of the arithmetic. The tiles of one panel follow each other, so the panel is
// read from memory once and from the core's cache after that. A decode step of a few
// tokens thus reads every weight at about the rate the machine streams memory, and one
// of a few dozen runs at about the arithmetic's rate, where oneDNN's products run
// slower (measurements: docs/benchmarks.md). AVX2 has half the vector width and
// registers: its tiles (below) are smaller, over the same panels (a float32 one stored
// by halves).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "cpu_math.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define TANDEM_PANELS 1
#include <immintrin.h>

namespace {

constexpr int64_t kPanel = 48;     // output columns per panel: three vectors of 16
constexpr int64_t kChunkRows = 64; // most rows of x per work item, with one panel

}  // namespace
#endif

#if defined(__AVX512F__)
namespace {

constexpr int64_t kTileRows = 8;   // rows of x per tile: 8 x 3 sums in registers
static_assert(kTileRows == 8, "panel_rows' tail cases cover 1 to kTileRows - 1 rows");

// y[0:MR, 0:16V) = x[0:MR, :] @ panel (+ bias) (+ res, the residual rows, laid out as
// y); the last vector's valid lanes are `lanes`. The residual is added to the finished
// sum, as `res + x @ w` adds it after the product.
template <int MR, int V>
inline void tile(const float* x, int64_t ldx, int64_t K, const float* panel, const float* bias,
                 const float* res, float* y, int64_t ldy, __mmask16 lanes) {
  const auto mask = [lanes](int v) { return v == V - 1 ? lanes : __mmask16(0xFFFF); };
  __m512 acc[MR][V];
  for (int v = 0; v < V; ++v) {
    const __m512 start = bias != nullptr ? _mm512_maskz_loadu_ps(mask(v), bias + 16 * v)
                                         : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) acc[m][v] = start;
  }
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[V];
    for (int v = 0; v < V; ++v) w[v] = _mm512_loadu_ps(panel + k * kPanel + 16 * v);
    for (int m = 0; m < MR; ++m) {
      const __m512 xk = _mm512_set1_ps(x[m * ldx + k]);
      for (int v = 0; v < V; ++v) acc[m][v] = _mm512_fmadd_ps(xk, w[v], acc[m][v]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < V; ++v) {
      __m512 out = acc[m][v];
      if (res != nullptr) {
        out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(mask(v), res + m * ldy + 16 * v));
      }
      _mm512_mask_storeu_ps(y + m * ldy + 16 * v, mask(v), out);
    }
  }
}

#if defined(__AVX512BF16__)
// The bfloat16 product: the same tiles over panels of k-pairs. Panel p is a contiguous
// [ceil(K / 2), 48, 2] block (packing.to_panels): for each pair of input features
// (2j, 2j + 1), the 48 columns' two weights side by side, zero past N and, for an odd
// K, in the last pair's second place. One vdpbf16ps multiplies a broadcast pair of x by
// 16 columns' pairs and adds both products to float32 sums, twice the work of a float32
// FMA per instruction over half the bytes; the sums are rounded to bfloat16 once, at
// the store, as oneDNN's bfloat16 products do.

// 16 bfloat16 values as float32.
inline __m512 widen(__m256i raw) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 16 bfloat16 values (the `lanes` of them) as float32.
inline __m512 load_bf16(const at::BFloat16* p, __mmask16 lanes) {
  return widen(_mm256_maskz_loadu_epi16(lanes, p));
}

// x[m, 2j] and x[m, 2j + 1] as one 32-bit lane, repeated; `half`: only x[m, 2j] (the
// last pair of an odd K, whose second place is past the row).
inline __m512bh pair(const at::BFloat16* row, int64_t j, bool half) {
  uint32_t bits = 0;
  std::memcpy(&bits, row + 2 * j, half ? sizeof(uint16_t) : sizeof(bits));
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(bits));
}

template <int MR, int V>
inline void tile(const at::BFloat16* x, int64_t ldx, int64_t K, const at::BFloat16* panel,
                 const at::BFloat16* bias, const at::BFloat16* res, at::BFloat16* y, int64_t ldy,
                 __mmask16 lanes) {
  const auto mask = [lanes](int v) { return v == V - 1 ? lanes : __mmask16(0xFFFF); };
  __m512 acc[MR][V];
  for (int v = 0; v < V; ++v) {
    const __m512 start = bias != nullptr ? load_bf16(bias + 16 * v, mask(v)) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) acc[m][v] = start;
  }
  const auto step = [&](int64_t j, bool half) {
    __m512bh w[V];
    for (int v = 0; v < V; ++v) {
      w[v] = (__m512bh)_mm512_loadu_si512(panel + j * 2 * kPanel + 32 * v);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512bh xj = pair(x + m * ldx, j, half);
      for (int v = 0; v < V; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xj, w[v]);
    }
  };
  for (int64_t j = 0; j < K / 2; ++j) step(j, false);
  if (K % 2 == 1) step(K / 2, true);
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < V; ++v) {
      __m256i out = (__m256i)_mm512_cvtneps_pbh(acc[m][v]);
      if (res != nullptr) {  // rounded, then added and rounded again, as torch's add
        const __m512 sum = _mm512_add_ps(widen(out), load_bf16(res + m * ldy + 16 * v, mask(v)));
        out = (__m256i)_mm512_cvtneps_pbh(sum);
      }
      _mm256_mask_storeu_epi16(y + m * ldy + 16 * v, mask(v), out);
    }
  }
}

#endif  // __AVX512BF16__

// Rows [0, M) of x by one panel whose first V vectors are valid: tiles of kTileRows
// rows, then one tile of the rest (T: float, or at::BFloat16 with its tile above).
template <typename T, int V>
void panel_rows(const T* x, int64_t ldx, int64_t M, int64_t K, const T* panel, const T* bias,
                const T* res, T* y, int64_t ldy, __mmask16 lanes) {
  int64_t m = 0;
  const auto at = [res, ldy](int64_t row) { return res != nullptr ? res + row * ldy : nullptr; };
  for (; m + kTileRows <= M; m += kTileRows) {
    tile<kTileRows, V>(x + m * ldx, ldx, K, panel, bias, at(m), y + m * ldy, ldy, lanes);
  }
  const T* xm = x + m * ldx;
  const T* rm = at(m);
  T* ym = y + m * ldy;
  switch (M - m) {
    case 1: tile<1, V>(xm, ldx, K, panel, bias, rm, ym, ldy, lanes); break;
    case 2: tile<2, V>(xm, ldx, K, panel, bias, rm, ym, ldy, lanes); break;
    case 3: tile<3, V>(xm, ldx, K, panel, bias, rm, ym, ldy, lanes); break;
    case 4: tile<4, V>(xm, ldx, K, panel, bias, rm, ym, ldy, lanes); break;
    case 5: tile<5, V>(xm, ldx, K, panel, bias, rm, ym, ldy, lanes); break;
    case 6: tile<6, V>(xm, ldx, K, panel, bias, rm, ym, ldy, lanes); break;
    case 7: tile<7, V>(xm, ldx, K, panel, bias, rm, ym, ldy, lanes); break;
    default: break;
  }
}


// One work item: rows [m0, m0 + m) of x by panel p (of a weight with K inputs and N
// outputs, panels of panel_size elements), its output columns cut at N; res, the
// residual [M, N] or null.
template <typename T>
void run_item(const T* x, const T* panels, int64_t panel_size, const T* bias, const T* res,
              T* y, int64_t K, int64_t N, int64_t m0, int64_t m, int64_t p) {
  const int64_t n0 = p * kPanel;
  const int64_t cols = N - n0 < kPanel ? N - n0 : kPanel;
  const int64_t vectors = (cols + 15) / 16, tail = cols - 16 * (vectors - 1);
  const __mmask16 lanes = tail == 16 ? __mmask16(0xFFFF) : __mmask16((1u << tail) - 1);
  const T* xm = x + m0 * K;
  const T* panel = panels + p * panel_size;
  const T* b = bias != nullptr ? bias + n0 : nullptr;
  const T* r = res != nullptr ? res + m0 * N + n0 : nullptr;
  T* ym = y + m0 * N + n0;
  switch (vectors) {
    case 1: panel_rows<T, 1>(xm, K, m, K, panel, b, r, ym, N, lanes); break;
    case 2: panel_rows<T, 2>(xm, K, m, K, panel, b, r, ym, N, lanes); break;
    default: panel_rows<T, 3>(xm, K, m, K, panel, b, r, ym, N, lanes); break;
  }
}

}  // namespace

#elif defined(TANDEM_PANELS)
// AVX2 with FMA (eight float32 lanes, sixteen vector registers): the same work items,
// two kinds of tile. A work item of four rows or more goes in tall tiles, 4 rows by
// part of a panel (4 x 3 vectors of sums, or 4 x 2 for bfloat16, the weight vectors
// loaded once a k for the four rows), over each part of the panel in turn; the rows
// left, and items of fewer rows, in tiles of 2 rows (or 1) by the whole panel row
// (2 x 6 sums, each weight vector an operand straight from the cache), which read the
// panel in address order, as a decode step of a few tokens needs.
//
// A float32 panel is stored by halves here (packing.to_panels with halves): its first
// 24 columns for every k, then its last 24, so that a tall tile reads 96 contiguous
// bytes a k. Over 48-column rows it read half of each 192-byte row, a row every other
// k across three cache lines instead of two, and a prefill's products ran slower
// (measurements: docs/benchmarks.md, Measurements behind the code).
//
// bfloat16 (AVX2 has no bfloat16 arithmetic): the k-pair panels of the AVX-512 tile
// above, widened in registers. A 32-bit lane holds one column's weights for inputs 2j
// and 2j + 1; as float32, the first is the lane shifted left by 16 and the second the
// lane with its low half cleared, exactly (a bfloat16 is a float32's high half). x and
// the bias are widened to float32 once a call, and the sums kept in float32 and
// rounded to bfloat16 once, at the store, as oneDNN's bfloat16 products do. The
// weights are half the bytes of float32 ones, which shortens a decode step of a few
// tokens, where they stream from memory.
namespace {

constexpr int64_t kTileRows = 2;   // rows of x per tile: 2 x 6 sums in registers
constexpr int64_t kTallRows = 4;   // rows of x per tall tile
constexpr int kVectors = kPanel / 8;
constexpr int64_t kHalf = kPanel / 2;  // a float32 panel's columns per half

using Pairs = uint16_t;  // a bfloat16 panel's elements, read as bits

// A bfloat16 panel's row j (the pair of inputs 2j, 2j + 1).
inline const Pairs* panel_row(const Pairs* panel, int64_t j) { return panel + j * 2 * kPanel; }

// The float32 weights for inputs 2j (even) and 2j + 1 (odd) of the eight columns whose
// pairs are at w.
inline void widen_pairs(const Pairs* w, __m256& even, __m256& odd) {
  const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(lanes, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(lanes, _mm256_set1_epi32(-65536)));
}

// s += b0 * the even weights + b1 * the odd ones of the eight columns at w.
inline void add_pairs(__m256& s, __m256 b0, __m256 b1, const Pairs* w) {
  __m256 even, odd;
  widen_pairs(w, even, odd);
  s = _mm256_fmadd_ps(b1, odd, _mm256_fmadd_ps(b0, even, s));
}

// The first `valid` (0 to 8) lanes of a vector, as maskload and maskstore take them.
inline __m256i first_lanes(int64_t valid) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), index);
}

// Eight float32 sums rounded to bfloat16 (to nearest, ties to even; a NaN stays a
// quiet NaN), as torch rounds them.
inline __m128i round_bf16(__m256 sums) {
  const __m256i bits = _mm256_castps_si256(sums);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i top = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(sums, sums, _CMP_UNORD_Q);
  top = _mm256_blendv_epi8(top, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  return _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
}

// The V vectors a row's sums start from: bias[0:cols) (cols 1 to 8V), zero past it.
template <int V>
inline void start_sums(const float* bias, int64_t cols, __m256 (&start)[V]) {
  float values[8 * V] = {};
  if (bias != nullptr) std::memcpy(values, bias, sizeof(float) * cols);
  for (int v = 0; v < V; ++v) start[v] = _mm256_loadu_ps(values + 8 * v);
}

// y[0:cols) = one row's V vectors of sums (+ res[0:cols)), the residual added to the
// finished sum, as `res + x @ w` adds it after the product.
template <int V>
inline void store_row(const __m256 (&sums)[V], int64_t cols, const float* res, float* y) {
  for (int v = 0; v < V; ++v) {
    const int64_t left = cols - 8 * v;
    const __m256i lanes = first_lanes(left < 0 ? 0 : (left > 8 ? 8 : left));
    __m256 out = sums[v];
    if (res != nullptr) out = _mm256_add_ps(out, _mm256_maskload_ps(res + 8 * v, lanes));
    _mm256_maskstore_ps(y + 8 * v, lanes, out);
  }
}

// The same in bfloat16: the sums rounded, then, with a residual, added to it and
// rounded again, as torch's add of the rounded product.
template <int V>
inline void store_row(const __m256 (&sums)[V], int64_t cols, const at::BFloat16* res,
                      at::BFloat16* y) {
  for (int v = 0; v < V && 8 * v < cols; ++v) {
    const int64_t valid = cols - 8 * v < 8 ? cols - 8 * v : 8;
    __m128i out = round_bf16(sums[v]);
    if (res != nullptr) {
      uint16_t added[8] = {};
      std::memcpy(added, res + 8 * v, sizeof(uint16_t) * valid);
      const auto widen = [](__m128i half) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
      };
      const __m128i r = _mm_loadu_si128(reinterpret_cast<const __m128i*>(added));
      out = round_bf16(_mm256_add_ps(widen(out), widen(r)));
    }
    uint16_t values[8];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(values), out);
    std::memcpy(y + 8 * v, values, sizeof(uint16_t) * valid);
  }
}

// The sums of one row of a tile: six vectors, one panel row's 48 columns.
struct Row {
  __m256 s0, s1, s2, s3, s4, s5;

  // += x[k] * the panel's row k, whose halves' rows k are at lo and hi: six vectors,
  // the operands straight from the cache.
  inline void add(const float* x, int64_t k, const float* lo, const float* hi) {
    const __m256 b = _mm256_set1_ps(x[k]);
    s0 = _mm256_fmadd_ps(b, _mm256_loadu_ps(lo), s0);
    s1 = _mm256_fmadd_ps(b, _mm256_loadu_ps(lo + 8), s1);
    s2 = _mm256_fmadd_ps(b, _mm256_loadu_ps(lo + 16), s2);
    s3 = _mm256_fmadd_ps(b, _mm256_loadu_ps(hi), s3);
    s4 = _mm256_fmadd_ps(b, _mm256_loadu_ps(hi + 8), s4);
    s5 = _mm256_fmadd_ps(b, _mm256_loadu_ps(hi + 16), s5);
  }

  // += x[2j] * the even weights of the panel's row j + x[2j + 1] * its odd ones.
  inline void add(const float* x, int64_t j, const Pairs* w) {
    const __m256 b0 = _mm256_set1_ps(x[2 * j]), b1 = _mm256_set1_ps(x[2 * j + 1]);
    add_pairs(s0, b0, b1, w);
    add_pairs(s1, b0, b1, w + 16);
    add_pairs(s2, b0, b1, w + 32);
    add_pairs(s3, b0, b1, w + 48);
    add_pairs(s4, b0, b1, w + 64);
    add_pairs(s5, b0, b1, w + 80);
  }
};

// y[0:MR, 0:cols) = x[0:MR, :] @ panel (+ bias) (+ res), MR 1 or 2, over `steps` panel
// rows; the residual is added to the finished sum, as `res + x @ w` adds it after the
// product. The sums are named variables, not an array: GCC kept an array's twelve
// vectors in registers but also stored them all to the stack at every k, which slowed
// the tile down.
template <int MR, typename W, typename O>
inline void tile(const float* x, int64_t ldx, int64_t steps, const W* panel, const float* bias,
                 const O* res, O* y, int64_t ldy, int64_t cols) {
  static_assert(MR == 1 || MR == 2, "a tile is one or two rows");
  __m256 start[kVectors];
  start_sums(bias, cols, start);
  const Row first{start[0], start[1], start[2], start[3], start[4], start[5]};
  Row r0 = first, r1 = first;
  const float* x1 = x + (MR == 2 ? ldx : 0);
  for (int64_t j = 0; j < steps; ++j) {
    if constexpr (std::is_same_v<W, float>) {
      const float *lo = panel + j * kHalf, *hi = lo + steps * kHalf;
      r0.add(x, j, lo, hi);
      if constexpr (MR == 2) r1.add(x1, j, lo, hi);
    } else {
      const W* w = panel_row(panel, j);
      r0.add(x, j, w);
      if constexpr (MR == 2) r1.add(x1, j, w);
    }
  }
  const Row rows[2] = {r0, r1};
  for (int m = 0; m < MR; ++m) {
    const __m256 sums[kVectors] = {rows[m].s0, rows[m].s1, rows[m].s2,
                                   rows[m].s3, rows[m].s4, rows[m].s5};
    store_row(sums, cols, res != nullptr ? res + m * ldy : nullptr, y + m * ldy);
  }
}

// The sums of one row of a tall tile: three vectors, half a float32 panel row's 24
// columns, or two, a third of a bfloat16 one's 48 (whose even and odd weights take
// twice the registers).
struct Half {
  __m256 s0, s1, s2;

  inline void add(float xk, __m256 w0, __m256 w1, __m256 w2) {
    const __m256 b = _mm256_set1_ps(xk);
    s0 = _mm256_fmadd_ps(b, w0, s0);
    s1 = _mm256_fmadd_ps(b, w1, s1);
    s2 = _mm256_fmadd_ps(b, w2, s2);
  }
};

struct Third {
  __m256 s0, s1;

  inline void add(const float* x, int64_t j, __m256 e0, __m256 o0, __m256 e1, __m256 o1) {
    const __m256 b0 = _mm256_set1_ps(x[2 * j]), b1 = _mm256_set1_ps(x[2 * j + 1]);
    s0 = _mm256_fmadd_ps(b1, o0, _mm256_fmadd_ps(b0, e0, s0));
    s1 = _mm256_fmadd_ps(b1, o1, _mm256_fmadd_ps(b0, e1, s1));
  }
};

// y[0:4, 0:cols) = x[0:4, :] @ part (+ bias) (+ res), cols 1 to 24 of the panel's
// half that starts at `part` (its rows 24 floats apart): four rows by three vectors,
// the weights loaded once a k for all four (a tall tile reads fewer bytes per
// multiply-add than the two-row one, whose loads, not its arithmetic, bound it).
template <typename O>
inline void tall_tile(const float* x, int64_t ldx, int64_t steps, const float* part,
                      const float* bias, const O* res, O* y, int64_t ldy, int64_t cols) {
  __m256 start[3];
  start_sums(bias, cols, start);
  const Half first{start[0], start[1], start[2]};
  Half r0 = first, r1 = first, r2 = first, r3 = first;
  const float *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx;
  for (int64_t k = 0; k < steps; ++k) {
    const float* w = part + k * kHalf;
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
    const __m256 w2 = _mm256_loadu_ps(w + 16);
    r0.add(x[k], w0, w1, w2);
    r1.add(x1[k], w0, w1, w2);
    r2.add(x2[k], w0, w1, w2);
    r3.add(x3[k], w0, w1, w2);
  }
  const Half rows[4] = {r0, r1, r2, r3};
  for (int m = 0; m < 4; ++m) {
    const __m256 sums[3] = {rows[m].s0, rows[m].s1, rows[m].s2};
    store_row(sums, cols, res != nullptr ? res + m * ldy : nullptr, y + m * ldy);
  }
}

// The same for bfloat16, cols 1 to 16 of the third of a panel whose pairs start at
// `part`: four rows by two vectors, each pair of weight vectors widened once a j.
template <typename O>
inline void tall_tile(const float* x, int64_t ldx, int64_t steps, const Pairs* part,
                      const float* bias, const O* res, O* y, int64_t ldy, int64_t cols) {
  __m256 start[2];
  start_sums(bias, cols, start);
  const Third first{start[0], start[1]};
  Third r0 = first, r1 = first, r2 = first, r3 = first;
  const float *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx;
  for (int64_t j = 0; j < steps; ++j) {
    const Pairs* w = panel_row(part, j);
    __m256 e0, o0, e1, o1;
    widen_pairs(w, e0, o0);
    widen_pairs(w + 16, e1, o1);
    r0.add(x, j, e0, o0, e1, o1);
    r1.add(x1, j, e0, o0, e1, o1);
    r2.add(x2, j, e0, o0, e1, o1);
    r3.add(x3, j, e0, o0, e1, o1);
  }
  const Third rows[4] = {r0, r1, r2, r3};
  for (int m = 0; m < 4; ++m) {
    const __m256 sums[2] = {rows[m].s0, rows[m].s1};
    store_row(sums, cols, res != nullptr ? res + m * ldy : nullptr, y + m * ldy);
  }
}

// One work item, as the AVX-512 one: rows [m0, m0 + M) of x by panel p. x and the
// bias are float32 (a bfloat16 call's widened, x with K rounded up to even, the pad
// zero), W the panel's elements (float, or Pairs), O the output's and residual's type;
// `steps`: the panel's rows, `ldx`: x's row stride.
template <typename W, typename O>
void run_item(const float* x, int64_t ldx, const W* panels, int64_t panel_size,
              const float* bias, const O* res, O* y, int64_t steps, int64_t N, int64_t m0,
              int64_t M, int64_t p) {
  constexpr bool pairs = std::is_same_v<W, Pairs>;
  constexpr int64_t part_cols = pairs ? 16 : kHalf;  // a tall tile's columns
  const int64_t n0 = p * kPanel;
  const int64_t cols = N - n0 < kPanel ? N - n0 : kPanel;
  const W* panel = panels + p * panel_size;
  const float* b = bias != nullptr ? bias + n0 : nullptr;
  const auto at = [&](int64_t row) {
    return res != nullptr ? res + (m0 + row) * N + n0 : nullptr;
  };
  int64_t m = 0;
  if (M >= kTallRows) {  // tall tiles over each part of the panel, then the rows left
    for (int64_t h = 0; h < cols; h += part_cols) {
      const int64_t width = cols - h < part_cols ? cols - h : part_cols;
      const float* bh = b != nullptr ? b + h : nullptr;
      for (m = 0; m + kTallRows <= M; m += kTallRows) {
        const O* rh = res != nullptr ? at(m) + h : nullptr;
        const W* part = pairs ? panel + 2 * h : panel + h * steps;  // h is 0 or kHalf
        tall_tile(x + (m0 + m) * ldx, ldx, steps, part, bh, rh, y + (m0 + m) * N + n0 + h, N,
                  width);
      }
    }
  }
  for (; m + kTileRows <= M; m += kTileRows) {
    tile<kTileRows>(x + (m0 + m) * ldx, ldx, steps, panel, b, at(m), y + (m0 + m) * N + n0, N,
                    cols);
  }
  if (m < M) tile<1>(x + (m0 + m) * ldx, ldx, steps, panel, b, at(m), y + (m0 + m) * N + n0, N,
                     cols);
}

}  // namespace
#endif  // __AVX512F__, else AVX2

#if defined(TANDEM_PANELS)
namespace {

// x @ weight^T (+ bias) (+ residual): the residual, of the output's shape and x's
// dtype, added to the finished product (a layer's `hidden + o_proj(attn)` in one pass).
at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& panels,
                         const c10::optional<at::Tensor>& bias, int64_t out_features,
                         const c10::optional<at::Tensor>& residual) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK((x.scalar_type() == at::kFloat || bf16) && panels.scalar_type() == x.scalar_type(),
              "tandem::linear_panels takes float32 or bfloat16 (x and weight alike), got ",
              x.scalar_type(), " and ", panels.scalar_type());
#if defined(__AVX512F__) && !defined(__AVX512BF16__)
  TORCH_CHECK(!bf16, "tandem::linear_panels: bfloat16 needs AVX512_BF16 in an AVX-512 build, "
              "not in this one");
#endif
#if defined(__AVX512F__)
  const bool halves = false;
#else
  const bool halves = !bf16;  // the AVX2 tiles' float32 panels are stored by halves
#endif
  const int64_t width = bf16 ? 2 * kPanel : kPanel;  // a bfloat16 panel row is a k-pair
  const bool laid_out =
      halves ? panels.dim() == 4 && panels.size(1) == 2 && panels.size(3) == kPanel / 2
             : panels.dim() == 3 && panels.size(2) == width;
  TORCH_CHECK(laid_out && panels.is_contiguous(),
              "tandem::linear_panels: the weight must be in panels of ", kPanel,
              " columns, a contiguous ",
              bf16 ? "[P, ceil(in / 2), 96]" : (halves ? "[P, 2, in, 24]" : "[P, in, 48]"),
              " tensor (packing.to_panels)");
  const int64_t P = panels.size(0), depth = panels.size(halves ? 2 : 1), N = out_features;
  TORCH_CHECK(P > 0 && depth > 0, "tandem::linear_panels: an empty weight");
  TORCH_CHECK(N > (P - 1) * kPanel && N <= P * kPanel, "tandem::linear_panels: ", P,
              " panels hold ", (P - 1) * kPanel + 1, " to ", P * kPanel,
              " output features, not ", N);
  const int64_t K = x.dim() >= 1 ? x.size(-1) : 0;
  TORCH_CHECK(K > 0 && (bf16 ? (K + 1) / 2 : K) == depth, "tandem::linear_panels: x has ", K,
              " features, the weight takes ", bf16 ? 2 * depth - 1 : depth,
              bf16 ? " or " + std::to_string(2 * depth) : std::string());
  const void* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == N &&
                    bias->is_contiguous(),
                "tandem::linear_panels: the bias is a contiguous [out] of x's dtype");
    bp = bias->data_ptr();
  }
  const at::Tensor rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  at::Tensor y = at::empty({M, N}, rows.options());
  auto shape = x.sizes().vec();
  shape.back() = N;
  const void* rp = nullptr;
  if (residual.has_value() && residual->defined()) {
    TORCH_CHECK(residual->scalar_type() == x.scalar_type() && residual->sizes() == shape &&
                    residual->is_contiguous(),
                "tandem::linear_panels: the residual is a contiguous tensor of the output's "
                "shape ", at::IntArrayRef(shape), " and x's dtype, got ", residual->sizes(), " ",
                residual->scalar_type());
    rp = residual->data_ptr();
  }
  if (M == 0) return y.view(shape);
  // Work items: (chunk of rows, panel), panels inner, taken by the threads one at a
  // time (tandem_cpu::for_each_item). The chunks are of equal size (96 rows: two of 48,
  // not 64 and 32).
  const int64_t chunks = (M + kChunkRows - 1) / kChunkRows;
  const int64_t chunk_rows = (M + chunks - 1) / chunks;
  const auto items = [&](auto&& run) {
    tandem_cpu::for_each_item(
        chunks * P, [] { return 0; },
        [&](int64_t item, int) {
          const int64_t chunk = item / P, p = item % P;
          const int64_t m0 = chunk * chunk_rows;
          run(m0, M - m0 < chunk_rows ? M - m0 : chunk_rows, p);
        });
  };
  const int64_t panel_size = depth * width;
#if defined(__AVX512F__)
  const auto product = [&](const auto* x, const auto* w, const auto* b, const auto* r, auto* out) {
    items([&](int64_t m0, int64_t m, int64_t p) {
      run_item(x, w, panel_size, b, r, out, K, N, m0, m, p);
    });
  };
  if (!bf16) {
    product(rows.const_data_ptr<float>(), panels.const_data_ptr<float>(),
            static_cast<const float*>(bp), static_cast<const float*>(rp), y.data_ptr<float>());
  }
#if defined(__AVX512BF16__)
  using bf = at::BFloat16;
  if (bf16) {
    product(rows.const_data_ptr<bf>(), panels.const_data_ptr<bf>(), static_cast<const bf*>(bp),
            static_cast<const bf*>(rp), y.data_ptr<bf>());
  }
#endif
#else
  if (!bf16) {
    const float* x = rows.const_data_ptr<float>();
    const float* w = panels.const_data_ptr<float>();
    float* out = y.data_ptr<float>();
    items([&](int64_t m0, int64_t m, int64_t p) {
      run_item(x, K, w, panel_size, static_cast<const float*>(bp), static_cast<const float*>(rp),
               out, K, N, m0, m, p);
    });
  } else {
    // x widened to float32 once, its rows padded to whole pairs (the pad times the
    // panels' zero second place), and the bias with it.
    const at::Tensor wide = at::zeros({M, 2 * depth}, rows.options().dtype(at::kFloat));
    wide.narrow(1, 0, K).copy_(rows);
    const at::Tensor bias32 = bp != nullptr ? bias->to(at::kFloat) : at::Tensor();
    const float* x = wide.const_data_ptr<float>();
    const float* b = bp != nullptr ? bias32.const_data_ptr<float>() : nullptr;
    const auto* w = reinterpret_cast<const Pairs*>(panels.const_data_ptr<at::BFloat16>());
    at::BFloat16* out = y.data_ptr<at::BFloat16>();
    items([&](int64_t m0, int64_t m, int64_t p) {
      run_item(x, 2 * depth, w, panel_size, b, static_cast<const at::BFloat16*>(rp), out, depth,
               N, m0, m, p);
    });
  }
#endif
  return y.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def(
      "linear_panels(Tensor x, Tensor panels, Tensor? bias, int out_features, "
      "Tensor? residual=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("linear_panels", linear_panels); }

#endif  // TANDEM_PANELS
