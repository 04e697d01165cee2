// tandem's CPU decode attention: one query token per request against its keys, float32.
//
// Built on first use by tandem/scheduler/attention/cpu_kernel.py and registered as
// torch.ops.tandem.decode_attention; see docs/guides/adding-an-attention-backend.md,
// "The two backends", its bullet "The CPU decode kernel".
//
// Each (request, KV head) pair is one task of at::parallel_for, the forward's intra-op
// threads: its G query heads are scored against each key as the key is read, so a
// pair's keys and values leave memory once, whatever G. Keys past the last one whose
// bias is finite (past the request's length) are not read. SDPA's CPU kernel spends
// about twice as long on the same step, in one small matrix product per pair.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 (a score minus its row's maximum) in a form the compiler
// vectorizes: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial
// (relative error under 3e-7), 2^n from the exponent bits. 0 below -87 and at -inf.
inline float exp_nonpositive(float x) {
  const float clamped = x < -87.f ? -87.f : x;
  // Rounded to the nearest integer by adding and taking away 1.5 * 2^23: roundf itself
  // rounds halves away from zero, which the vector units have no instruction for, and
  // would keep the loop scalar.
  const float n = (clamped * 1.44269504088896341f + 12582912.f) - 12582912.f;
  // ln2 in two parts, so that n * ln2 is exact enough for |n| <= 126.
  const float r = clamped - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return x < -87.f ? 0.f : p * two_n;
}

struct Pair {
  const float* q;     // [G, D], contiguous
  const float* k;     // key j at k + j * key_stride, D contiguous floats
  const float* v;
  const float* bias;  // [length], 0 or -inf
  float* out;         // [G, D]
};

// One (request, KV head) pair. kDim > 0: the head size known when compiling (the inner
// loops unroll); 0: `dim` at run time. Keys go four at a time: four independent sums
// per query head keep the vector units busy where one sum would wait on its own
// additions. `acc` holds G * D + G floats (the weighted values, then each head's
// 1 / sum); `scores` G * length.
template <int64_t kDim>
void attend(const Pair& p, int64_t key_stride, int64_t dim_arg, int64_t groups, int64_t length,
            float scale, float* scores, float* acc) {
  const int64_t dim = kDim > 0 ? kDim : dim_arg;
  int64_t end = length;  // keys past the last one attended are never read
  while (end > 0 && p.bias[end - 1] == kNegInf) --end;
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
  for (int64_t g = 0; g < groups; ++g) {
    float* sg = scores + g * length;
    float top = kNegInf;
#pragma omp simd reduction(max : top)
    for (int64_t i = 0; i < end; ++i) top = sg[i] > top ? sg[i] : top;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < end; ++i) {
      const float e = exp_nonpositive(sg[i] - top);
      sg[i] = e;
      sum += e;
    }
    inv[g] = sum > 0.f ? 1.f / sum : 0.f;
  }
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

template <int64_t kDim>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
         const at::Tensor& out, float scale) {
  const int64_t batch = k.size(0), kv_heads = k.size(1), length = k.size(2), dim = k.size(3);
  const int64_t groups = q.size(1) / kv_heads;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* bp = bias.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // K and V share their strides (checked by decode_attention).
  const int64_t request_stride = k.stride(0), head_stride = k.stride(1), key_stride = k.stride(2);
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(groups * length), acc(groups * dim + groups);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / kv_heads, h = i % kv_heads;
      const int64_t first = (r * kv_heads + h) * groups * dim;
      const int64_t at = r * request_stride + h * head_stride;
      const Pair pair{qp + first, kp + at, vp + at, bp + r * length, op + first};
      attend<kDim>(pair, key_stride, dim, groups, length, scale, scores.data(), acc.data());
    }
  });
}

// q [B, H, D]; keys and values [B, Hkv, L, D], any strides but a contiguous last
// dimension, the same for both; bias [B, 1, 1, L], 0 where a query attends a key and
// -inf elsewhere; all float32. Returns [B, H * D]. A decode query attends at least its
// own key; a request whose every key is masked gets zeros (SDPA would give NaN).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys,
                            const at::Tensor& values, const at::Tensor& bias, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
                  values.scalar_type() == at::kFloat && bias.scalar_type() == at::kFloat,
              "tandem::decode_attention takes float32 tensors");
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
  const at::Tensor qc = q.contiguous();
  const at::Tensor bc = bias.contiguous();
  at::Tensor out = at::empty({batch, q.size(1) * dim}, q.options());
  const float s = static_cast<float>(scale);
  switch (dim) {
    case 16: run<16>(qc, keys, values, bc, out, s); break;
    case 32: run<32>(qc, keys, values, bc, out, s); break;
    case 64: run<64>(qc, keys, values, bc, out, s); break;
    case 128: run<128>(qc, keys, values, bc, out, s); break;
    default: run<0>(qc, keys, values, bc, out, s);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(tandem, m) {
  m.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor bias, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("decode_attention", decode_attention); }
