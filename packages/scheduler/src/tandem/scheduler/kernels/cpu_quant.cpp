// tandem's product by a quantized weight: y = x @ weight^T (+ bias) (+ residual), x and
// y float32, the weight kept in small integer codes with a scale (and offset) per block
// of inputs of each output column. Registered as torch.ops.tandem.linear_quant
// on CPUs with AVX-512, or AVX2 and FMA; models/quant_panels.py lays the weights out.
//
// Two kinds of code cover the GGUF types tandem keeps quantized (models/quant_rows.py):
//   u4: 4-bit codes q in 0..15, w = scale * q + offset (Q4_0, Q4_1, Q4_K);
//   i8: 8-bit signed codes, w = scale * q (Q8_0, Q6_K, weight-only int8).
// The codes lie in panels of 48 output columns, as linear_panels' float32 panels do:
// panel p holds columns 48p..48p+47 (zero past N), code row after code row of the 48
// columns' codes side by side (the int8 path's layout below), so that one product reads
// each panel once, in address order. Scales, offsets: [P, K / block, 48], float32, or
// float16 where each of the weight's is exact in it (Q4_0, Q4_1 and Q8_0 carry float16
// scales): a Q4_1 weight then reads 20 bytes per 32 inputs, as its file holds it.
//
// x is rounded per block of the weight's to 8-bit parts, which multiply the codes with
// int8 dot products: AVX512-VNNI's vpdpbusd, or without it AVX2's vpmaddubsw and
// vpmaddwd. A token reads 4.5 to 9 bits a weight and no float copy of it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_math.h"
#include "cpu_stream.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

namespace {

constexpr int64_t kPanel = 48;      // output columns per panel
constexpr int64_t kChunkRows = 64;  // most rows of x per work item, with one panel

// Where a tile's sums go: y at its first column, after its bias and before its residual.
struct Out {
  const float* bias;  // [cols] or null
  const float* res;   // row-strided like y, or null
  float* y;
  int64_t ldy;
  int64_t cols;       // valid columns of the panel, 1 to 48
};

// Rows [0, M) in tiles of up to R rows (the rest in one smaller tile):
// tile(rows, first row) runs a tile of a compile-time row count.
template <int R, typename Tile>
inline void in_tiles(int64_t M, Tile tile) {
  int64_t m = 0;
  for (; m + R <= M; m += R) tile(std::integral_constant<int, R>{}, m);
  if constexpr (R > 1) {
    if (M - m > 0) {
      // Remainders dispatch to the next smaller tile, down to one row.
      in_tiles<R - 1>(M - m, [&](auto rows, int64_t r) { tile(rows, m + r); });
    }
  }
}

// The int8 path: each block of codes multiplied by x, four products summed into a
// 32-bit lane (vpdpbusd, or vpmaddubsw and vpmaddwd), over x in two 8-bit parts per
// block of the weight's: x = scale * (q + r / 256) up to scale / 512, q = round(x /
// scale) and r the rounded rest in units of scale / 256 (an error of 1 / 65,000 of the
// block's largest |x|). With `parts` 1, x is q alone, as llama.cpp rounds its
// activations: half the dot products, and a slightly higher perplexity
// (docs/benchmarks.md). A code row holds, for each of the 48 columns, four bytes side by
// side: 4-bit codes of inputs 8j..8j+3 in their low nibbles and 8j+4..8j+7 in their
// high ones, or 8-bit codes of inputs 4j..4j+3 plus 128 (vpdpbusd multiplies unsigned
// bytes by signed ones; the 128 times the block's sum of x's parts is taken off again,
// exactly, in integers, or without VNNI the code's sign moves onto x).
constexpr int64_t kRow = kPanel * 4;  // bytes of a code row

using Half = uint16_t;  // float16's bits

// A vector of a block's scales (or offsets), 16 or 8 columns, as float32, from either
// type they are held in.
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// x's rows in two 8-bit parts, and per block the scale, the parts' sum, 256 q + r (what
// the +128 adds), and the sum of x as rounded, scale * (256 q + r) / 256 (what an offset
// multiplies).
struct Quantized {
  std::vector<int8_t> q, r;
  std::vector<float> scale, sum;
  std::vector<int32_t> qsum;
};

// Two helpers of quantize_block, one vector width each: the block's largest |x|, and its
// values rounded to their parts (units: x times `inverse`) a vector at a time, the sum
// of 256 q + r added to `qsum`; returns where the vectors stopped.
#if defined(__AVX512F__)
inline float largest(const float* at, int64_t block) {
  __m512 vmax = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= block; k += 16) {
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(at + k)));
  }
  float amax = _mm512_reduce_max_ps(vmax);
  for (; k < block; ++k) amax = std::max(amax, std::abs(at[k]));
  return amax;
}

inline int64_t round_vectors(const float* at, int64_t block, float inverse, bool two, int8_t* q,
                             int8_t* r, int32_t& qsum) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 vinverse = _mm512_set1_ps(inverse), bound = _mm512_set1_ps(127.f);
  __m512i vqsum = _mm512_setzero_si512();
  int64_t k = 0;
  for (; k + 16 <= block; k += 16) {
    const __m512 units = _mm512_mul_ps(_mm512_loadu_ps(at + k), vinverse);  // |units| <= 127
    const __m512 whole = _mm512_roundscale_ps(units, kNearest);
    __m512 rest = _mm512_roundscale_ps(
        _mm512_mul_ps(_mm512_sub_ps(units, whole), _mm512_set1_ps(two ? 256.f : 0.f)), kNearest);
    rest = _mm512_min_ps(bound, _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), bound), rest));
    const __m512i wq = _mm512_cvtps_epi32(whole), rq = _mm512_cvtps_epi32(rest);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtsepi32_epi8(wq));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(r + k), _mm512_cvtsepi32_epi8(rq));
    vqsum = _mm512_add_epi32(vqsum, _mm512_add_epi32(_mm512_slli_epi32(wq, 8), rq));
  }
  qsum += _mm512_reduce_add_epi32(vqsum);
  return k;
}
#else
inline float largest(const float* at, int64_t block) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 vmax = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= block; k += 8) {
    vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(at + k), magnitude));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, vmax);
  float amax = 0.f;
  for (const float lane : lanes) amax = std::max(amax, lane);
  for (; k < block; ++k) amax = std::max(amax, std::abs(at[k]));
  return amax;
}

inline int64_t round_vectors(const float* at, int64_t block, float inverse, bool two, int8_t* q,
                             int8_t* r, int32_t& qsum) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256 vinverse = _mm256_set1_ps(inverse), bound = _mm256_set1_ps(127.f);
  // The low byte of each 32-bit lane, gathered into the first four bytes of each half.
  const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                             -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1,
                                             -1, -1, -1, -1, -1, -1);
  const __m256i halves = _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0);
  const auto store8 = [&](int8_t* to, __m256i lanes32) {
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(lanes32, low_bytes),
                                                      halves);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(to), _mm256_castsi256_si128(bytes));
  };
  __m256i vqsum = _mm256_setzero_si256();
  int64_t k = 0;
  for (; k + 8 <= block; k += 8) {
    const __m256 units = _mm256_mul_ps(_mm256_loadu_ps(at + k), vinverse);  // |units| <= 127
    const __m256 whole = _mm256_round_ps(units, kNearest);
    __m256 rest = _mm256_round_ps(
        _mm256_mul_ps(_mm256_sub_ps(units, whole), _mm256_set1_ps(two ? 256.f : 0.f)), kNearest);
    rest = _mm256_min_ps(bound, _mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), bound), rest));
    const __m256i wq = _mm256_cvtps_epi32(whole), rq = _mm256_cvtps_epi32(rest);
    store8(q + k, wq);
    store8(r + k, rq);
    vqsum = _mm256_add_epi32(vqsum, _mm256_add_epi32(_mm256_slli_epi32(wq, 8), rq));
  }
  int32_t sums[8];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums), vqsum);
  for (const int32_t lane : sums) qsum += lane;
  return k;
}
#endif

// One block of x (at, `block` values) into its parts at q and r; returns its scale, and
// its parts' sum through `qsum`. The same roundings with either width.
inline float quantize_block(const float* at, int64_t block, bool two, int8_t* q, int8_t* r,
                            int32_t& qsum) {
  const float amax = largest(at, block);
  const float scale = amax / 127.f;
  const float inverse = amax > 0.f ? 1.f / scale : 0.f;
  qsum = 0;
  for (int64_t t = round_vectors(at, block, inverse, two, q, r, qsum); t < block; ++t) {
    const float units = at[t] * inverse;
    const float whole = std::nearbyint(units);
    const float rest = two ? std::nearbyint((units - whole) * 256.f) : 0.f;
    q[t] = static_cast<int8_t>(whole);
    r[t] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, rest)));
    qsum += 256 * q[t] + r[t];
  }
  return scale;
}

Quantized quantize(const float* x, int64_t M, int64_t K, int64_t block, bool two) {
  const int64_t groups = M * (K / block);
  Quantized out{std::vector<int8_t>(M * K), std::vector<int8_t>(M * K),
                std::vector<float>(groups), std::vector<float>(groups),
                std::vector<int32_t>(groups)};
  const auto run = [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      out.scale[g] = quantize_block(x + g * block, block, two, out.q.data() + g * block,
                                    out.r.data() + g * block, out.qsum[g]);
      out.sum[g] = out.scale[g] / 256.f * static_cast<float>(out.qsum[g]);
    }
  };
  // Rows in parallel where there are enough of them to repay the threads' start.
  if (M >= 8) {
    at::parallel_for(0, groups, (K / block) * 4, run);
  } else {
    run(0, groups);
  }
  return out;
}

#if defined(__AVX512VNNI__)
// Sixteen float32 lanes; a tile's row of sums is 3 vectors (48 columns).
struct Vec {
  using F = __m512;
  static constexpr int kLanes = 16;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static __mmask16 mask(int64_t valid) {
    return valid >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (valid > 0 ? valid : 0)) - 1);
  }
  static F load_part(const float* p, int64_t valid) {
    return _mm512_maskz_loadu_ps(mask(valid), p);
  }
  static void store_part(float* p, F v, int64_t valid) { _mm512_mask_storeu_ps(p, mask(valid), v); }
};

constexpr int kV = 3;  // vectors of a panel's row
using F = Vec::F;

template <int MR>
inline void store(F (&acc)[MR][kV], const Out& out) {
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < kV; ++v) {
      const int64_t valid = out.cols - v * Vec::kLanes;
      if (valid <= 0) break;
      F sum = acc[m][v];
      if (out.res != nullptr) {
        sum = Vec::add(sum, Vec::load_part(out.res + m * out.ldy + v * Vec::kLanes, valid));
      }
      Vec::store_part(out.y + m * out.ldy + v * Vec::kLanes, sum, valid);
    }
  }
}

template <int MR>
inline void start(F (&acc)[MR][kV], const Out& out) {
  for (int v = 0; v < kV; ++v) {
    const F b = out.bias != nullptr
                    ? Vec::load_part(out.bias + v * Vec::kLanes, out.cols - v * Vec::kLanes)
                    : Vec::zero();
    for (int m = 0; m < MR; ++m) acc[m][v] = b;
  }
}

// sums += codes (unsigned bytes) times x's four bytes at `at`, repeated in every lane.
inline __m512i dot(__m512i sums, __m512i codes, const int8_t* at) {
  int32_t four;
  std::memcpy(&four, at, 4);
  return _mm512_dpbusd_epi32(sums, codes, _mm512_set1_epi32(four));
}

// MR rows of quantized x by one panel (all 48 columns). In a tile of two or three rows
// over x in two parts the float32 sums gather in the tile's rows of y, a block at a
// time: the registers then hold the block's 2 x MR x 3 integer sums and the codes of a
// code row without spilling (GCC spilled the sums inside the loop with them in
// registers too), and the L1 round trip a block costs little beside its dot products.
// A one-row tile, and tiles over one part, keep their sums in registers.
template <int MR, bool U4, bool Two, typename S>
inline void int8_tile(const Quantized& xq, int64_t row0, int64_t K, const uint8_t* codes,
                      const S* scales, const S* offsets, int64_t block, const Out& out) {
  constexpr int64_t per_row = U4 ? 8 : 4;  // inputs a code row covers
  const int64_t groups = K / block, rows_per_block = block / per_row;
  constexpr bool in_y = Two && MR > 1;  // where the float32 sums gather
  F acc[in_y ? 1 : MR][kV];
  if constexpr (in_y) {  // y starts as bias + residual
    for (int m = 0; m < MR; ++m) {
      for (int v = 0; v < kV; ++v) {
        const int64_t valid = out.cols - v * Vec::kLanes;
        if (valid <= 0) break;
        F sum = out.bias != nullptr ? Vec::load_part(out.bias + v * Vec::kLanes, valid)
                                    : Vec::zero();
        if (out.res != nullptr) {
          sum = Vec::add(sum, Vec::load_part(out.res + m * out.ldy + v * Vec::kLanes, valid));
        }
        Vec::store_part(out.y + m * out.ldy + v * Vec::kLanes, sum, valid);
      }
    }
  } else {
    start<MR>(acc, out);
  }
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < groups; ++b) {
    __m512i whole[MR][kV], rest[MR][kV];
    for (int m = 0; m < MR; ++m) {
      for (int v = 0; v < kV; ++v) whole[m][v] = rest[m][v] = _mm512_setzero_si512();
    }
    for (int64_t i = 0; i < rows_per_block; ++i) {
      const int64_t j = b * rows_per_block + i;
      const uint8_t* row = codes + j * kRow;
      for (int v = 0; v < kV; ++v) {
        const __m512i raw = _mm512_loadu_si512(row + 64 * v);
        const __m512i lo = U4 ? _mm512_and_si512(raw, low) : raw;
        const __m512i hi = U4 ? _mm512_and_si512(_mm512_srli_epi16(raw, 4), low) : raw;
        for (int m = 0; m < MR; ++m) {
          const int64_t at = (row0 + m) * K + j * per_row;
          whole[m][v] = dot(whole[m][v], lo, xq.q.data() + at);
          if constexpr (Two) rest[m][v] = dot(rest[m][v], lo, xq.r.data() + at);
          if constexpr (U4) {
            whole[m][v] = dot(whole[m][v], hi, xq.q.data() + at + 4);
            if constexpr (Two) rest[m][v] = dot(rest[m][v], hi, xq.r.data() + at + 4);
          }
        }
      }
    }
    for (int v = 0; v < kV; ++v) {
      const int64_t valid = out.cols - v * Vec::kLanes;
      if (in_y && valid <= 0) break;
      const F scale = load16(scales + b * kPanel + v * Vec::kLanes);
      const F offset = U4 ? load16(offsets + b * kPanel + v * Vec::kLanes) : Vec::zero();
      for (int m = 0; m < MR; ++m) {
        const int64_t g = (row0 + m) * groups + b;
        // 256 q + r, exactly, in 32 bits (at most 2^28 for a block of 32)
        __m512i s = _mm512_add_epi32(_mm512_slli_epi32(whole[m][v], 8), rest[m][v]);
        if constexpr (!U4) s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * xq.qsum[g]));
        const F step = _mm512_mul_ps(scale, Vec::set1(xq.scale[g] / 256.f));
        float* at = out.y + m * out.ldy + v * Vec::kLanes;
        F sum = Vec::fma(step, _mm512_cvtepi32_ps(s), in_y ? Vec::load_part(at, valid) : acc[m][v]);
        // The offset times the sum of x as rounded, which the codes' term multiplies
        // too: the rounding errors then meet the weights, of either sign, not the
        // codes' steps above the offset, all of one sign, which add them up (the
        // perplexity with one part: docs/benchmarks.md).
        if constexpr (U4) sum = Vec::fma(offset, Vec::set1(xq.sum[g]), sum);
        if constexpr (in_y) {
          Vec::store_part(at, sum, valid);
        } else {
          acc[m][v] = sum;
        }
      }
    }
  }
  if constexpr (!in_y) store<MR>(acc, out);
}

// Rows of a tile: 3 x 3 block sums of each part in registers, or with one part of x,
// 4 x 3 and the 4 x 3 float32 sums.
template <bool Two>
constexpr int kInt8Rows = Two ? 3 : 4;
#else
// Without VNNI (AVX2, or AVX-512 without it), the same layout and parts multiply with
// vpmaddubsw (unsigned bytes by signed ones, adjacent products summed in 16 bits) and
// vpmaddwd (adjacent 16-bit sums times 256 for q, 1 for r, summed in 32 bits): the
// four products of a column gather in its 32-bit lane, as vpdpbusd gathers them. No
// 16-bit sum saturates: 4-bit codes give 2 x 15 x 127 a pair, from the low nibbles and
// as much from the high ones; 8-bit codes (their 128 taken off again, XOR 0x80) lend
// their sign to x (vpsignb) and multiply as magnitudes, 2 x 128 x 127 at most.
constexpr int kIV = kPanel / 8;  // vectors of a code row: 6

// The first `valid` of eight 32-bit lanes.
inline __m256i lanes_mask(int64_t valid) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline __m256i four_bytes(const int8_t* at) {
  int32_t four;
  std::memcpy(&four, at, 4);
  return _mm256_set1_epi32(four);
}

// One row of quantized x by a panel, its code rows read once, in address order: a
// decode step's products wait on memory, and a tile over half a panel, its code rows
// read in two passes, waited longer (docs/benchmarks.md). The block's integer sums fill
// the 16 registers; the float32 sums gather in an array of the tile's, a block at a
// time, and y is written once, at the end (a masked store is slow on some CPUs).
template <int MR, bool U4, bool Two, typename S>
inline void int8_tile(const Quantized& xq, int64_t row0, int64_t K, const uint8_t* codes,
                      const S* scales, const S* offsets, int64_t block, const Out& out) {
  static_assert(MR == 1, "a tile of one row");
  constexpr int64_t per_row = U4 ? 8 : 4;  // inputs a code row covers
  const int64_t groups = K / block, rows_per_block = block / per_row;
  alignas(32) float gathered[kPanel];
  for (int v = 0; v < kIV; ++v) {
    const int64_t valid = out.cols - v * 8;
    const __m256 bias = out.bias != nullptr && valid > 0
                            ? _mm256_maskload_ps(out.bias + v * 8, lanes_mask(valid))
                            : _mm256_setzero_ps();
    _mm256_store_ps(gathered + v * 8, bias);
  }
  const __m256i low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1), k256 = _mm256_set1_epi16(256);
  const int8_t* q = xq.q.data() + row0 * K;
  const int8_t* r = xq.r.data() + row0 * K;
  for (int64_t b = 0; b < groups; ++b) {
    __m256i sums[kIV];  // 256 q + r, summed over the block
    for (int v = 0; v < kIV; ++v) sums[v] = _mm256_setzero_si256();
    for (int64_t i = 0; i < rows_per_block; ++i) {
      const int64_t j = b * rows_per_block + i;
      const uint8_t* row = codes + j * kRow;
      const int64_t at = j * per_row;
      for (int v = 0; v < kIV; ++v) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * v));
        if constexpr (U4) {
          const __m256i lo = _mm256_and_si256(raw, low);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
          const auto pairs = [&](const int8_t* x) {
            return _mm256_add_epi16(_mm256_maddubs_epi16(lo, four_bytes(x + at)),
                                    _mm256_maddubs_epi16(hi, four_bytes(x + at + 4)));
          };
          sums[v] = _mm256_add_epi32(sums[v], _mm256_madd_epi16(pairs(q), k256));
          if constexpr (Two) {
            sums[v] = _mm256_add_epi32(sums[v], _mm256_madd_epi16(pairs(r), ones));
          }
        } else {
          const __m256i code = _mm256_xor_si256(raw, flip);
          const __m256i magnitude = _mm256_abs_epi8(code);
          const auto pairs = [&](const int8_t* x) {
            return _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(four_bytes(x + at), code));
          };
          sums[v] = _mm256_add_epi32(sums[v], _mm256_madd_epi16(pairs(q), k256));
          if constexpr (Two) {
            sums[v] = _mm256_add_epi32(sums[v], _mm256_madd_epi16(pairs(r), ones));
          }
        }
      }
    }
    const int64_t g = row0 * groups + b;
    const __m256 unit = _mm256_set1_ps(xq.scale[g] / 256.f), sum_x = _mm256_set1_ps(xq.sum[g]);
    for (int v = 0; v < kIV; ++v) {
      const __m256 step = _mm256_mul_ps(load8(scales + b * kPanel + v * 8), unit);
      __m256 sum = _mm256_fmadd_ps(step, _mm256_cvtepi32_ps(sums[v]),
                                   _mm256_load_ps(gathered + v * 8));
      if constexpr (U4) {
        sum = _mm256_fmadd_ps(load8(offsets + b * kPanel + v * 8), sum_x, sum);
      }
      _mm256_store_ps(gathered + v * 8, sum);
    }
  }
  for (int v = 0; v < kIV; ++v) {
    const int64_t valid = out.cols - v * 8;
    if (valid <= 0) break;
    const __m256i mask = lanes_mask(valid);
    __m256 sum = _mm256_load_ps(gathered + v * 8);
    if (out.res != nullptr) sum = _mm256_add_ps(sum, _mm256_maskload_ps(out.res + v * 8, mask));
    if (valid >= 8) {
      _mm256_storeu_ps(out.y + v * 8, sum);
    } else {
      _mm256_maskstore_ps(out.y + v * 8, mask, sum);
    }
  }
}

template <bool Two>
constexpr int kInt8Rows = 1;
#endif  // __AVX512VNNI__

at::Tensor linear_quant(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& offsets, int64_t block,
                        const c10::optional<at::Tensor>& bias, int64_t out_features,
                        const c10::optional<at::Tensor>& residual, int64_t parts) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "tandem::linear_quant takes float32 x, got ",
              x.scalar_type());
  TORCH_CHECK(parts == 1 || parts == 2, "tandem::linear_quant: x in 1 or 2 parts, not ", parts);
  const bool u4 = offsets.has_value() && offsets->defined();  // 4-bit codes have offsets
  const int64_t K = x.dim() >= 1 ? x.size(-1) : 0, N = out_features;
  // Inputs per code row: a block must hold whole rows.
  const int64_t per_row = u4 ? 8 : 4, width = kRow;
  TORCH_CHECK(codes.scalar_type() == at::kByte,
              "tandem::linear_quant: codes are uint8, got ", codes.scalar_type());
  TORCH_CHECK(K > 0 && block > 0 && K % block == 0 && block % per_row == 0,
              "tandem::linear_quant: x's ", K, " features are not whole blocks of ", block,
              " (a block a multiple of ", per_row, ")");
  const int64_t rows_of_k = K / per_row;
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && codes.size(2) == width &&
                  codes.size(1) == rows_of_k,
              "tandem::linear_quant: the codes must be a contiguous [P, ", rows_of_k, ", ", width,
              "] tensor (models/quant_panels.py), got ", codes.sizes());
  const int64_t P = codes.size(0);
  TORCH_CHECK(P > 0 && N > (P - 1) * kPanel && N <= P * kPanel, "tandem::linear_quant: ", P,
              " panels hold ", (P - 1) * kPanel + 1, " to ", P * kPanel, " output features, not ",
              N);
  const std::vector<int64_t> per_block{P, K / block, kPanel};
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK((half || scales.scalar_type() == at::kFloat) && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef(per_block),
              "tandem::linear_quant: the scales must be a contiguous float32 or float16 ",
              at::IntArrayRef(per_block), " tensor, got ", scales.sizes(), " ",
              scales.scalar_type());
  if (u4) {
    TORCH_CHECK(offsets->scalar_type() == scales.scalar_type() && offsets->is_contiguous() &&
                    offsets->sizes() == at::IntArrayRef(per_block),
                "tandem::linear_quant: the offsets are shaped and typed as the scales");
  }
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(),
                "tandem::linear_quant: the bias is a contiguous float32 [out]");
    bp = bias->const_data_ptr<float>();
  }
  const at::Tensor rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  at::Tensor y = at::empty({M, N}, rows.options());
  auto shape = x.sizes().vec();
  shape.back() = N;
  const float* rp = nullptr;
  if (residual.has_value() && residual->defined()) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->sizes() == shape &&
                    residual->is_contiguous(),
                "tandem::linear_quant: the residual is a contiguous float32 tensor of the "
                "output's shape ", at::IntArrayRef(shape), ", got ", residual->sizes(), " ",
                residual->scalar_type());
    rp = residual->const_data_ptr<float>();
  }
  if (M == 0) return y.view(shape);
  tandem_cpu::weight_reached(codes.const_data_ptr(), M);
  const float* xp = rows.const_data_ptr<float>();
  const int64_t chunks = (M + kChunkRows - 1) / kChunkRows;
  const int64_t chunk_rows = (M + chunks - 1) / chunks;
  float* yp = y.data_ptr<float>();
  const auto items = [&](auto&& run) {
    tandem_cpu::for_each_item(
        chunks * P, [] { return 0; },
        [&](int64_t item, int) {
          const int64_t chunk = item / P, p = item % P, m0 = chunk * chunk_rows;
          run(m0, M - m0 < chunk_rows ? M - m0 : chunk_rows, p);
        });
  };
  const uint8_t* cp = codes.const_data_ptr<uint8_t>();
  const int64_t groups = K / block;
  const Quantized xq = quantize(xp, M, K, block, parts == 2);
  const auto product = [&](auto u4_tag, auto two_tag, auto scale_type) {
    constexpr bool U4 = decltype(u4_tag)::value, Two = decltype(two_tag)::value;
    using S = decltype(scale_type);  // float or Half, passed as a value of it
    const S* sp = static_cast<const S*>(scales.const_data_ptr());
    const S* op = u4 ? static_cast<const S*>(offsets->const_data_ptr()) : nullptr;
    items([&](int64_t m0, int64_t m, int64_t p) {
      const int64_t n0 = p * kPanel;
      const uint8_t* panel = cp + p * rows_of_k * kRow;
      const S* ps = sp + p * groups * kPanel;
      const S* po = op != nullptr ? op + p * groups * kPanel : nullptr;
      in_tiles<kInt8Rows<Two>>(m, [&](auto tile_rows, int64_t r) {
        const int64_t row = m0 + r;
        const Out out{bp != nullptr ? bp + n0 : nullptr,
                      rp != nullptr ? rp + row * N + n0 : nullptr, yp + row * N + n0, N,
                      std::min(N - n0, kPanel)};
        int8_tile<decltype(tile_rows)::value, U4, Two, S>(xq, row, K, panel, ps, po, block, out);
      });
    });
  };
  using Yes = std::true_type;
  using No = std::false_type;
  const auto typed = [&](auto scale_type) {
    if (u4 && parts == 2) product(Yes{}, Yes{}, scale_type);
    if (u4 && parts == 1) product(Yes{}, No{}, scale_type);
    if (!u4 && parts == 2) product(No{}, Yes{}, scale_type);
    if (!u4 && parts == 1) product(No{}, No{}, scale_type);
  };
  if (half) {
    typed(Half{});
  } else {
    typed(float{});
  }
  return y.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def(
      "linear_quant(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, int block, "
      "Tensor? bias, int out_features, Tensor? residual=None, int parts=2) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("linear_quant", linear_quant); }

#endif  // AVX-512, or AVX2 and FMA
