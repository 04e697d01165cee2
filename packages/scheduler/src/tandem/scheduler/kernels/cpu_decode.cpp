// tandem's CPU decode attention: one query token per request against its keys, float32,
// and bfloat16 where the CPU has AVX512-BF16.
//
// Built on first use by tandem/scheduler/kernels/cpu_build.py and registered as
// torch.ops.tandem.decode_attention, with store_kv (at the end of this file), which
// writes a step's new K/V to the paged cache and the decode stage; see
// docs/guides/adding-an-attention-backend.md, "The two backends", its bullet "The CPU
// decode kernel".
//
// Each (request, KV head) pair is one task for the forward's intra-op threads, which
// take them one at a time (for_each_item, cpu_math.h): its G query heads are scored
// against each key as the key is read, so a pair's keys and values leave memory once,
// whatever G. Keys past the last one whose bias is finite (past the request's length)
// are not read. SDPA's CPU kernel is slower on the same step, with one small matrix
// product per pair (measurements: docs/benchmarks.md, Measurements behind the code).
//
// float32 on AVX-512 (heads of a multiple of 16 elements, at most 256, at most 8 query
// heads per KV head) scores sixteen keys at a time, their sixteen partial-sum
// registers added across in four steps (sum16) instead of one horizontal sum per key
// and query head; on AVX2 (heads of a multiple of 8), eight keys at a time the same
// way (sum8), asking for keys and values before it reads them; elsewhere, four keys at
// a time with the compiler's vectorization.
//
// bfloat16 (built with -mavx512bf16, which cpu_build.py passes on CPUs that have it)
// multiplies pairs of bfloat16 values into float32 sums (vdpbf16ps), its scores made
// sixteen keys at a time the same way; the weights, normalized in float32, are rounded
// to bfloat16 and meet the values two keys at a time. Heads of a multiple of 32
// elements only.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_math.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using tandem_cpu::exp_fast;
using tandem_cpu::for_each_item;
using tandem_cpu::to_bf16;

// One (request, KV head) pair's operands. T: float, or uint16_t for bfloat16's bits.
template <typename T>
struct Pair {
  const T* q;         // [G, D], contiguous
  const T* k;         // key j at k + j * key_stride, D contiguous elements
  const T* v;
  const float* bias;  // [length], 0 or -inf
  T* out;             // [G, D]
  int64_t end;        // keys past the last one attended (finite bias) are never read
};

// Calls attend(pair, buffers) for every (request, KV head) pair of the step, each one
// item of for_each_item (the forward's intra-op threads), with buffers = scratch()
// made once per thread. K and V share their strides (checked by decode_attention).
template <typename T, typename Scratch, typename Attend>
void for_each_pair(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& bias, const at::Tensor& out, Scratch scratch,
                   Attend attend) {
  const int64_t batch = k.size(0), kv_heads = k.size(1), length = k.size(2);
  const int64_t head = q.size(1) / kv_heads * k.size(3);  // elements of a pair's q and out
  const auto* qp = static_cast<const T*>(q.data_ptr());
  const auto* kp = static_cast<const T*>(k.data_ptr());
  const auto* vp = static_cast<const T*>(v.data_ptr());
  const float* bp = bias.data_ptr<float>();
  auto* op = static_cast<T*>(out.data_ptr());
  const int64_t request_stride = k.stride(0), head_stride = k.stride(1);
  for_each_item(batch * kv_heads, scratch, [&](int64_t i, auto& buffers) {
    const int64_t r = i / kv_heads, h = i % kv_heads;
    const int64_t at = r * request_stride + h * head_stride;
    const float* row = bp + r * length;
    int64_t last = length;
    while (last > 0 && row[last - 1] == kNegInf) --last;
    attend(Pair<T>{qp + i * head, kp + at, vp + at, row, op + i * head, last}, buffers);
  });
}

// Replaces s[0, n) by e^(s - max s) and returns 1 / their sum, 0 when every score
// is -inf (a request whose every key is masked then gets zeros).
inline float exp_in_place(float* s, int64_t n) {
  float top = kNegInf;
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < n; ++i) top = s[i] > top ? s[i] : top;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float e = exp_fast(s[i] - top);
    s[i] = e;
    sum += e;
  }
  return sum > 0.f ? 1.f / sum : 0.f;
}

// One (request, KV head) pair. kDim > 0: the head size known when compiling (the inner
// loops unroll); 0: `dim` at run time. Keys go four at a time: four independent sums
// per query head keep the vector units busy where one sum would wait on its own
// additions. `acc` holds G * D + G floats (the weighted values, then each head's
// 1 / sum); `scores` G * length.
template <int64_t kDim>
void attend(const Pair<float>& p, int64_t key_stride, int64_t dim_arg, int64_t groups,
            int64_t length, float scale, float* scores, float* acc) {
  const int64_t dim = kDim > 0 ? kDim : dim_arg;
  const int64_t end = p.end;
  int64_t j = 0;
  for (; j + 4 <= end; j += 4) {
    const float* k0 = p.k + j * key_stride;
    const float* k1 = k0 + key_stride;
    const float* k2 = k1 + key_stride;
    const float* k3 = k2 + key_stride;
    for (int64_t g = 0; g < groups; ++g) {
      const float* qg = p.q + g * dim;
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
      for (int64_t d = 0; d < dim; ++d) {
        const float x = qg[d];
        s0 += x * k0[d];
        s1 += x * k1[d];
        s2 += x * k2[d];
        s3 += x * k3[d];
      }
      float* sg = scores + g * length + j;
      sg[0] = s0 * scale + p.bias[j];
      sg[1] = s1 * scale + p.bias[j + 1];
      sg[2] = s2 * scale + p.bias[j + 2];
      sg[3] = s3 * scale + p.bias[j + 3];
    }
  }
  for (; j < end; ++j) {
    const float* kj = p.k + j * key_stride;
    for (int64_t g = 0; g < groups; ++g) {
      const float* qg = p.q + g * dim;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < dim; ++d) s += qg[d] * kj[d];
      scores[g * length + j] = s * scale + p.bias[j];
    }
  }
  float* inv = acc + groups * dim;
  for (int64_t g = 0; g < groups; ++g) inv[g] = exp_in_place(scores + g * length, end);
  for (int64_t i = 0; i < groups * dim; ++i) acc[i] = 0.f;
  j = 0;
  for (; j + 4 <= end; j += 4) {
    const float* v0 = p.v + j * key_stride;
    const float* v1 = v0 + key_stride;
    const float* v2 = v1 + key_stride;
    const float* v3 = v2 + key_stride;
    for (int64_t g = 0; g < groups; ++g) {
      const float* w = scores + g * length + j;
      const float w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
      float* ag = acc + g * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) ag[d] += w0 * v0[d] + w1 * v1[d] + w2 * v2[d] + w3 * v3[d];
    }
  }
  for (; j < end; ++j) {
    const float* vj = p.v + j * key_stride;
    for (int64_t g = 0; g < groups; ++g) {
      const float w = scores[g * length + j];
      float* ag = acc + g * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) ag[d] += w * vj[d];
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    const float* ag = acc + g * dim;
    float* og = p.out + g * dim;
    const float s = inv[g];
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) og[d] = ag[d] * s;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// How many keys ahead of the ones being scored the AVX2 kernel asks for keys.
constexpr int64_t kKeysAhead = 16;

// The eight float32 sums of each of v[0..7], lane s holding v[s]'s, in key order: two
// rounds of pairwise horizontal adds leave each v's two 128-bit halves summed apart,
// and adding the halves finishes them.
inline __m256 sum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// Asks for the `bytes` bytes from `row` on, into L1 (kL1) or L2.
template <bool kL1>
inline void fetch(const float* row, int64_t bytes) {
  const char* at = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < bytes; b += 64) {
    if constexpr (kL1) _mm_prefetch(at + b, _MM_HINT_T0);
    else _mm_prefetch(at + b, _MM_HINT_T1);
  }
}

// The sum of v's eight floats.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// One (request, KV head) pair in float32 with AVX2 and FMA, D a multiple of 8: the
// AVX-512 kernel's shape in eight-float registers. Scores eight keys at a time, one
// register of partial sums per key, added across by sum8 (where the generic kernel
// makes a horizontal sum per key and query head); then each query head's weighted
// values in at most eight registers (64 elements) at a time, one key after another.
// `scores` holds G * length floats.
template <int64_t kDim>
void attend_avx2(const Pair<float>& p, int64_t key_stride, int64_t dim_arg, int64_t groups,
                 int64_t length, float scale, float* scores) {
  const int64_t dim = kDim > 0 ? kDim : dim_arg;
  const int64_t chunks = dim / 8;
  const int64_t end = p.end;
  const __m256 scale8 = _mm256_set1_ps(scale);
  // A pair's keys and values are too short a stream for the hardware's prefetcher to
  // reach speed on: the kernel asks for the keys kKeysAhead ahead of those it scores,
  // and for the values of the keys it scores into L2, where the weighted sum finds
  // them.
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(float));
  for (int64_t s = 0; s < kKeysAhead && s < end; ++s) {
    fetch<true>(p.k + s * key_stride, row_bytes);
  }
  int64_t j = 0;
  for (; j + 8 <= end; j += 8) {
    const __m256 bias = _mm256_loadu_ps(p.bias + j);
    const float* keys = p.k + j * key_stride;
    for (int64_t s = j; s < j + 8; ++s) {
      if (s + kKeysAhead < end) fetch<true>(p.k + (s + kKeysAhead) * key_stride, row_bytes);
      fetch<false>(p.v + s * key_stride, row_bytes);
    }
    for (int64_t g = 0; g < groups; ++g) {
      const float* qg = p.q + g * dim;
      __m256 sums[8];
      for (int s = 0; s < 8; ++s) sums[s] = _mm256_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        const __m256 x = _mm256_loadu_ps(qg + 8 * c);
        for (int s = 0; s < 8; ++s) {
          sums[s] = _mm256_fmadd_ps(x, _mm256_loadu_ps(keys + s * key_stride + 8 * c), sums[s]);
        }
      }
      _mm256_storeu_ps(scores + g * length + j, _mm256_fmadd_ps(sum8(sums), scale8, bias));
    }
  }
  for (; j < end; ++j) {
    const float* key = p.k + j * key_stride;
    for (int64_t g = 0; g < groups; ++g) {
      const float* qg = p.q + g * dim;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), _mm256_loadu_ps(key + 8 * c), acc);
      }
      scores[g * length + j] = hsum8(acc) * scale + p.bias[j];
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    float* w = scores + g * length;
    const __m256 inv = _mm256_set1_ps(exp_in_place(w, end));
    for (int64_t d0 = 0; d0 < dim; d0 += 64) {
      const int64_t n = dim - d0 < 64 ? (dim - d0) / 8 : 8;  // registers this slice
      __m256 acc[8];
      for (int64_t c = 0; c < n; ++c) acc[c] = _mm256_setzero_ps();
      const float* value = p.v + d0;
      for (int64_t i = 0; i < end; ++i, value += key_stride) {
        const __m256 wi = _mm256_broadcast_ss(w + i);
        for (int64_t c = 0; c < n; ++c) {
          acc[c] = _mm256_fmadd_ps(wi, _mm256_loadu_ps(value + 8 * c), acc[c]);
        }
      }
      for (int64_t c = 0; c < n; ++c) {
        _mm256_storeu_ps(p.out + g * dim + d0 + 8 * c, _mm256_mul_ps(acc[c], inv));
      }
    }
  }
}

#endif  // __AVX2__ && __FMA__

#if defined(__AVX512F__)

// The sixteen float32 sums of each of v[0..15], lane i holding v[s]'s sum where
// s = (i % 4) * 4 + i / 4: pairs of registers exchange halves and add, four times.
inline __m512 sum16(const __m512* v) {
  __m512 c[8], d[4], e[2];
  for (int i = 0; i < 8; ++i) {
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {
    e[i] = _mm512_add_ps(_mm512_shuffle_ps(d[2 * i], d[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(d[2 * i], d[2 * i + 1], 0xEE));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xDD));
}

// The sixteen float32 sums of each of sums[0..15], lane s holding sums[s]'s: sum16,
// then one permutation back to the keys' order (so the keys are read in address order).
inline __m512 dots16(const __m512* sums) {
  const __m512i in_order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(in_order, sum16(sums));
}

// One (request, KV head) pair in float32 on AVX512, D a multiple of 16 and at most 256,
// G <= 8: sixteen keys' scores at a time, their partial sums added across registers
// (sum16) instead of one horizontal sum per key and head, and the weighted values in
// sixteen-float registers, four keys at a time. `scores` holds G * length floats.
template <int64_t kDim>
void attend_avx512(const Pair<float>& p, int64_t key_stride, int64_t dim_arg, int64_t groups,
                   int64_t length, float scale, float* scores) {
  const int64_t dim = kDim > 0 ? kDim : dim_arg;
  const int64_t chunks = dim / 16;
  const int64_t end = p.end;
  const __m512 scale16 = _mm512_set1_ps(scale);
  int64_t j = 0;
  for (; j + 16 <= end; j += 16) {
    const __m512 bias = _mm512_loadu_ps(p.bias + j);
    for (int64_t g = 0; g < groups; ++g) {
      const float* qg = p.q + g * dim;
      __m512 sums[16];
      for (int s = 0; s < 16; ++s) {
        const float* key = p.k + (j + s) * key_stride;
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), _mm512_loadu_ps(key));
        for (int64_t c = 1; c < chunks; ++c) {
          acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), _mm512_loadu_ps(key + 16 * c), acc);
        }
        sums[s] = acc;
      }
      _mm512_storeu_ps(scores + g * length + j, _mm512_fmadd_ps(dots16(sums), scale16, bias));
    }
  }
  for (; j < end; ++j) {
    const float* key = p.k + j * key_stride;
    for (int64_t g = 0; g < groups; ++g) {
      const float* qg = p.q + g * dim;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), _mm512_loadu_ps(key + 16 * c), acc);
      }
      scores[g * length + j] = _mm512_reduce_add_ps(acc) * scale + p.bias[j];
    }
  }
  float inv[8];
  for (int64_t g = 0; g < groups; ++g) inv[g] = exp_in_place(scores + g * length, end);
  __m512 acc[8][16];  // [group][chunk]
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t c = 0; c < chunks; ++c) acc[g][c] = _mm512_setzero_ps();
  }
  j = 0;
  for (; j + 4 <= end; j += 4) {
    const float* v0 = p.v + j * key_stride;
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512 x0 = _mm512_loadu_ps(v0 + 16 * c);
      const __m512 x1 = _mm512_loadu_ps(v0 + key_stride + 16 * c);
      const __m512 x2 = _mm512_loadu_ps(v0 + 2 * key_stride + 16 * c);
      const __m512 x3 = _mm512_loadu_ps(v0 + 3 * key_stride + 16 * c);
      for (int64_t g = 0; g < groups; ++g) {
        const float* w = scores + g * length + j;
        __m512 a = _mm512_fmadd_ps(_mm512_set1_ps(w[0]), x0, acc[g][c]);
        a = _mm512_fmadd_ps(_mm512_set1_ps(w[1]), x1, a);
        a = _mm512_fmadd_ps(_mm512_set1_ps(w[2]), x2, a);
        acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[3]), x3, a);
      }
    }
  }
  for (; j < end; ++j) {
    const float* vj = p.v + j * key_stride;
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512 x = _mm512_loadu_ps(vj + 16 * c);
      for (int64_t g = 0; g < groups; ++g) {
        acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * length + j]), x, acc[g][c]);
      }
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 s = _mm512_set1_ps(inv[g]);
    for (int64_t c = 0; c < chunks; ++c) {
      _mm512_storeu_ps(p.out + g * dim + 16 * c, _mm512_mul_ps(acc[g][c], s));
    }
  }
}

#endif  // __AVX512F__

#if defined(__AVX512BF16__)

inline __m512bh load_bf16(const uint16_t* p) {
  return (__m512bh)_mm512_loadu_si512(p);
}

// One (request, KV head) pair in bfloat16, D a multiple of 32 and at most 256.
// `scores` holds G * (length + 1) floats, `weights` G * (length + 2) bfloat16s.
void attend_bf16(const Pair<uint16_t>& p, int64_t key_stride, int64_t dim, int64_t groups,
                 int64_t length, float scale, float* scores, uint16_t* weights) {
  const int64_t chunks = dim / 32;  // registers of 32 bfloat16s per head
  const int64_t row = length + 1;
  const int64_t end = p.end;
  for (int64_t g = 0; g < groups; ++g) {
    const uint16_t* qg = p.q + g * dim;
    float* sg = scores + g * row;
    int64_t j = 0;
    for (; j + 16 <= end; j += 16) {
      __m512 sums[16];
      for (int s = 0; s < 16; ++s) {
        const uint16_t* key = p.k + (j + s) * key_stride;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c) {
          acc = _mm512_dpbf16_ps(acc, load_bf16(qg + 32 * c), load_bf16(key + 32 * c));
        }
        sums[s] = acc;
      }
      const __m512 bias = _mm512_loadu_ps(p.bias + j);
      _mm512_storeu_ps(sg + j, _mm512_fmadd_ps(dots16(sums), _mm512_set1_ps(scale), bias));
    }
    for (; j < end; ++j) {
      const uint16_t* key = p.k + j * key_stride;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        acc = _mm512_dpbf16_ps(acc, load_bf16(qg + 32 * c), load_bf16(key + 32 * c));
      }
      sg[j] = _mm512_reduce_add_ps(acc) * scale + p.bias[j];
    }
    const float inv = exp_in_place(sg, end);
    // Normalized, then rounded to bfloat16; one zero weight past an odd count, so the
    // keys go in pairs.
    uint16_t* wg = weights + g * (length + 2);
    int64_t i = 0;
    for (; i + 16 <= end; i += 16) {
      const __m512 w = _mm512_mul_ps(_mm512_loadu_ps(sg + i), _mm512_set1_ps(inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(wg + i), (__m256i)_mm512_cvtneps_pbh(w));
    }
    for (; i < end; ++i) {
      const __m512 w = _mm512_set1_ps(sg[i] * inv);
      const __m256i bits = (__m256i)_mm512_cvtneps_pbh(w);
      wg[i] = static_cast<uint16_t>(_mm256_extract_epi16(bits, 0));
    }
    wg[end] = 0;
  }
  // The weighted values: two keys' rows interleaved element by element (unpacklo/hi
  // within each 128-bit lane), times the two keys' weights as one bfloat16 pair. Lane
  // l of the lo accumulator of chunk c holds element 32c + 8(l / 4) + l % 4, of the
  // hi one that plus 4.
  __m512 acc[8][16];  // [group][2 * chunk + lo/hi], groups <= 8
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t c = 0; c < 2 * chunks; ++c) acc[g][c] = _mm512_setzero_ps();
  }
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t j = 0; j < end; j += 2) {
    const uint16_t* v0 = p.v + j * key_stride;
    const uint16_t* v1 = v0 + key_stride;
    const bool pair = j + 1 < end;  // past the last key: a zero row, weight 0
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512i r0 = _mm512_loadu_si512(v0 + 32 * c);
      const __m512i r1 = pair ? _mm512_loadu_si512(v1 + 32 * c) : zero;
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(r0, r1);
      const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
      for (int64_t g = 0; g < groups; ++g) {
        uint32_t both;
        std::memcpy(&both, weights + g * (length + 2) + j, sizeof both);
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(both));
        acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], lo, w);
        acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], hi, w);
      }
    }
  }
  alignas(64) float lanes[16];
  for (int64_t g = 0; g < groups; ++g) {
    uint16_t* og = p.out + g * dim;
    for (int64_t c = 0; c < 2 * chunks; ++c) {
      _mm512_store_ps(lanes, acc[g][c]);
      const int64_t first = 32 * (c / 2) + 4 * (c % 2);
      for (int l = 0; l < 16; ++l) og[first + 8 * (l / 4) + l % 4] = to_bf16(lanes[l]);
    }
  }
}

void run_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& bias, const at::Tensor& out, float scale) {
  const int64_t length = k.size(2), dim = k.size(3), key_stride = k.stride(2);
  const int64_t groups = q.size(1) / k.size(1);
  using Buffers = std::pair<std::vector<float>, std::vector<uint16_t>>;
  for_each_pair<uint16_t>(
      q, k, v, bias, out,
      [&] { return Buffers(groups * (length + 1), groups * (length + 2)); },
      [&](const Pair<uint16_t>& pair, Buffers& buffers) {
        attend_bf16(pair, key_stride, dim, groups, length, scale, buffers.first.data(),
                    buffers.second.data());
      });
}

#endif  // __AVX512BF16__

template <int64_t kDim>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
         const at::Tensor& out, float scale) {
  const int64_t length = k.size(2), dim = k.size(3), key_stride = k.stride(2);
  const int64_t groups = q.size(1) / k.size(1);
#if defined(__AVX512F__)
  if (dim % 16 == 0 && dim <= 256 && groups <= 8) {
    for_each_pair<float>(
        q, k, v, bias, out, [&] { return std::vector<float>(groups * length); },
        [&](const Pair<float>& pair, std::vector<float>& scores) {
          attend_avx512<kDim>(pair, key_stride, dim, groups, length, scale, scores.data());
        });
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (dim % 8 == 0) {
    for_each_pair<float>(
        q, k, v, bias, out, [&] { return std::vector<float>(groups * length); },
        [&](const Pair<float>& pair, std::vector<float>& scores) {
          attend_avx2<kDim>(pair, key_stride, dim, groups, length, scale, scores.data());
        });
    return;
  }
#endif
  for_each_pair<float>(
      q, k, v, bias, out,
      [&] { return std::vector<float>(groups * length + groups * dim + groups); },
      [&](const Pair<float>& pair, std::vector<float>& scratch) {
        attend<kDim>(pair, key_stride, dim, groups, length, scale, scratch.data(),
                     scratch.data() + groups * length);
      });
}

// q [B, H, D]; keys and values [B, Hkv, L, D], any strides but a contiguous last
// dimension, the same for both; bias [B, 1, 1, L], 0 where a query attends a key and
// -inf elsewhere; all float32. Returns [B, H * D]. A decode query attends at least its
// own key; a request whose every key is masked gets zeros (SDPA would give NaN).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys,
                            const at::Tensor& values, const at::Tensor& bias, double scale) {
  const bool bf16 = keys.scalar_type() == at::kBFloat16;
  TORCH_CHECK((keys.scalar_type() == at::kFloat || bf16) && q.scalar_type() == keys.scalar_type() &&
                  values.scalar_type() == keys.scalar_type() &&
                  bias.scalar_type() == keys.scalar_type(),
              "tandem::decode_attention takes float32 or bfloat16 tensors, all of one dtype");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes(),
              "tandem::decode_attention: q [B, H, D], keys and values [B, Hkv, L, D]");
  const int64_t batch = keys.size(0), kv_heads = keys.size(1), length = keys.size(2);
  const int64_t dim = keys.size(3);
  TORCH_CHECK(q.size(0) == batch && q.size(2) == dim && q.size(1) % kv_heads == 0,
              "tandem::decode_attention: q ", q.sizes(), " does not match keys ", keys.sizes());
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1 &&
                  values.strides() == keys.strides(),
              "tandem::decode_attention: keys and values need the same strides, the last 1");
  TORCH_CHECK(bias.numel() == batch * length, "tandem::decode_attention: bias ", bias.sizes(),
              " is not [B, 1, 1, L] for keys ", keys.sizes());
  at::Tensor out = at::empty({batch, q.size(1) * dim}, q.options());
  const float s = static_cast<float>(scale);
  if (bf16) {
#if defined(__AVX512BF16__)
    TORCH_CHECK(dim % 32 == 0 && dim <= 256 && q.size(1) / kv_heads <= 8,
                "tandem::decode_attention: bfloat16 takes heads of a multiple of 32 elements, "
                "at most 256, and at most 8 query heads per KV head; got keys ", keys.sizes(),
                " and q ", q.sizes());
    run_bf16(q.contiguous(), keys, values, bias.to(at::kFloat).contiguous(), out, s);
    return out;
#else
    TORCH_CHECK(false, "tandem::decode_attention: bfloat16 needs a build with AVX512-BF16");
#endif
  }
  const at::Tensor qc = q.contiguous();
  const at::Tensor bc = bias.contiguous();
  switch (dim) {
    case 16: run<16>(qc, keys, values, bc, out, s); break;
    case 32: run<32>(qc, keys, values, bc, out, s); break;
    case 64: run<64>(qc, keys, values, bc, out, s); break;
    case 128: run<128>(qc, keys, values, bc, out, s); break;
    default: run<0>(qc, keys, values, bc, out, s);
  }
  return out;
}

// Rows [0, T * Hkv) of new (a [T, Hkv, D] K or V, each head's D elements contiguous),
// row t * Hkv + h copied to cache[loc[t], h] and, with a stage, to stage row
// append[t * Hkv + h]; store_kv has checked every index.
void store_rows(const at::Tensor& in, const at::Tensor& cache, const int64_t* loc,
                const at::Tensor* stage, const int64_t* append) {
  const int64_t tokens = in.size(0), heads = in.size(1);
  const int64_t bytes = in.size(2) * in.element_size();
  const auto* src = static_cast<const char*>(in.data_ptr());
  auto* dst = static_cast<char*>(cache.data_ptr());
  auto* staged = stage != nullptr ? static_cast<char*>(stage->data_ptr()) : nullptr;
  const int64_t t_stride = in.stride(0) * in.element_size();
  const int64_t h_stride = in.stride(1) * in.element_size();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const char* row = src + t * t_stride + h * h_stride;
        std::memcpy(dst + (loc[t] * heads + h) * bytes, row, bytes);
        if (staged != nullptr) std::memcpy(staged + append[t * heads + h] * bytes, row, bytes);
      }
    }
  });
}

// A step's new keys and values ([T, Hkv, D] each) into the paged cache ([S, Hkv, D]
// each, at the slots loc, [T]) and, given, into the decode stage ([B, Hkv, capacity,
// D] each, at the flat rows append, [T * Hkv]; attention/decode_stage.py): the four
// index_copy_ calls of write_kv and append_to_stage as one pass over the rows.
void store_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
              const at::Tensor& v_cache, const at::Tensor& loc,
              const c10::optional<at::Tensor>& k_stage,
              const c10::optional<at::Tensor>& v_stage,
              const c10::optional<at::Tensor>& append) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 3 &&
                  v_cache.sizes() == k_cache.sizes() &&
                  k.sizes().slice(1) == k_cache.sizes().slice(1),
              "tandem::store_kv: k and v [T, Hkv, D], the caches [S, Hkv, D]; got ", k.sizes(),
              " and ", k_cache.sizes());
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type() &&
                  v_cache.scalar_type() == k.scalar_type(),
              "tandem::store_kv: k, v and the caches take one dtype");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "tandem::store_kv: contiguous caches, and heads of contiguous elements");
  TORCH_CHECK(loc.scalar_type() == at::kLong && loc.dim() == 1 && loc.size(0) == k.size(0),
              "tandem::store_kv: loc is an int64 [T], T = ", k.size(0), ", got ", loc.sizes(),
              " ", loc.scalar_type());
  const at::Tensor slots_of = loc.contiguous();  // a verify step's may be a strided view
  const int64_t tokens = k.size(0), heads = k.size(1), slots = k_cache.size(0);
  const int64_t* lp = slots_of.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(lp[t] >= 0 && lp[t] < slots, "tandem::store_kv: slot ", lp[t],
                " is outside the cache's ", slots);
  }
  const bool staged = k_stage.has_value() && k_stage->defined();
  TORCH_CHECK(staged == (v_stage.has_value() && v_stage->defined()) &&
                  staged == (append.has_value() && append->defined()),
              "tandem::store_kv: k_stage, v_stage and append come together");
  const int64_t* ap = nullptr;
  at::Tensor rows_of;
  if (staged) {
    TORCH_CHECK(k_stage->dim() == 4 && v_stage->sizes() == k_stage->sizes() &&
                    k_stage->size(3) == k.size(2) &&
                    k_stage->scalar_type() == k.scalar_type() &&
                    v_stage->scalar_type() == k.scalar_type() && k_stage->is_contiguous() &&
                    v_stage->is_contiguous(),
                "tandem::store_kv: the stages are contiguous [B, Hkv, capacity, D] of k's dtype");
    TORCH_CHECK(append->scalar_type() == at::kLong && append->dim() == 1 &&
                    append->numel() == tokens * heads,
                "tandem::store_kv: append is an int64 [T * Hkv], T * Hkv = ", tokens * heads,
                ", got ", append->sizes());
    rows_of = append->contiguous();
    ap = rows_of.data_ptr<int64_t>();
    const int64_t rows = k_stage->numel() / k_stage->size(3);
    for (int64_t i = 0; i < tokens * heads; ++i) {
      TORCH_CHECK(ap[i] >= 0 && ap[i] < rows, "tandem::store_kv: stage row ", ap[i],
                  " is outside the stage's ", rows);
    }
  }
  store_rows(k, k_cache, lp, staged ? &*k_stage : nullptr, ap);
  store_rows(v, v_cache, lp, staged ? &*v_stage : nullptr, ap);
}

}  // namespace

TORCH_LIBRARY(tandem, m) {
  m.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor bias, float scale) -> Tensor");
  m.def(
      "store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor loc, "
      "Tensor(c!)? k_stage, Tensor(d!)? v_stage, Tensor? append) -> ()");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("decode_attention", decode_attention);
  m.impl("store_kv", store_kv);
}
