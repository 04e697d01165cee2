// tandem's float32 product for a few tokens: y = x @ weight^T (+ bias) for x of one or
// two rows, reading the weight once, in its column-major storage, at the rate the
// machine streams memory.
//
// Built with the decode kernel by tandem/scheduler/attention/cpu_kernel.py and
// registered as torch.ops.tandem.linear_few_rows, on CPUs with AVX-512 only (the
// library has no such op elsewhere); see docs/guides/adding-a-model.md, "Adding a new
// architecture", its bullet "The fused CPU ops". A decode step of one or two tokens
// is a pass over every weight of the model, so its products are bound by memory, not
// arithmetic: oneDNN's reads the ~100M benchmark model's weights at about 23 GB/s
// where the machine streams 29, and MKL's matrix-vector product runs on one thread.
//
// The weight is stored column-major (models/packing.py), so weight^T is a row-major
// [K, N] matrix and each row k of it is the k-th input's contribution to every
// output. Each thread takes a contiguous block of output columns; within it, a few
// rows of weight^T at a time (kRows), each read in address order across the block,
// keep the number of memory streams small enough for the hardware prefetchers, and
// the partial sums wait in the output between one group of rows and the next.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int64_t kRows = 8;  // rows of weight^T per pass over a column block
constexpr int64_t kMaxTokens = 2;  // from three on, oneDNN's products are the faster

// Columns [n, n + 16 * V) of y's M rows over weight^T rows [k0, k1); `first`: start
// from the bias (or zero) instead of the sums so far. Masked: one vector whose valid
// lanes are `lanes` (the end of a row); unmasked loads are the faster elsewhere.
template <int M, int V, bool Masked>
inline void tile(const float* x, int64_t K, const float* wt, int64_t N, const float* bias,
                 float* y, int64_t n, __mmask16 lanes, int64_t k0, int64_t k1, bool first) {
  static_assert(!Masked || V == 1, "a masked tile is one vector");
  const auto load = [lanes](const float* p) {
    return Masked ? _mm512_maskz_loadu_ps(lanes, p) : _mm512_loadu_ps(p);
  };
  __m512 acc[M][V];
  for (int m = 0; m < M; ++m) {
    for (int v = 0; v < V; ++v) {
      if (!first) {
        acc[m][v] = load(y + m * N + n + 16 * v);
      } else if (bias != nullptr) {
        acc[m][v] = load(bias + n + 16 * v);
      } else {
        acc[m][v] = _mm512_setzero_ps();
      }
    }
  }
  for (int64_t k = k0; k < k1; ++k) {
    const float* row = wt + k * N + n;
    __m512 w[V];
    for (int v = 0; v < V; ++v) w[v] = load(row + 16 * v);
    for (int m = 0; m < M; ++m) {
      const __m512 xk = _mm512_set1_ps(x[m * K + k]);
      for (int v = 0; v < V; ++v) acc[m][v] = _mm512_fmadd_ps(xk, w[v], acc[m][v]);
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int v = 0; v < V; ++v) {
      float* out = y + m * N + n + 16 * v;
      if (Masked) {
        _mm512_mask_storeu_ps(out, lanes, acc[m][v]);
      } else {
        _mm512_storeu_ps(out, acc[m][v]);
      }
    }
  }
}

// y's columns [n0, n1): tiles of 16 * V columns, then single vectors for the rest.
template <int M, int V>
void column_block(const float* x, int64_t K, const float* wt, int64_t N, const float* bias,
                  float* y, int64_t n0, int64_t n1) {
  for (int64_t k0 = 0; k0 < K; k0 += kRows) {
    const int64_t k1 = k0 + kRows < K ? k0 + kRows : K;
    int64_t n = n0;
    const bool first = k0 == 0;
    for (; n + 16 * V <= n1; n += 16 * V) tile<M, V, false>(x, K, wt, N, bias, y, n, 0, k0, k1, first);
    for (; n + 16 <= n1; n += 16) tile<M, 1, false>(x, K, wt, N, bias, y, n, 0, k0, k1, first);
    if (n < n1) {
      const __mmask16 lanes = __mmask16((1u << (n1 - n)) - 1);
      tile<M, 1, true>(x, K, wt, N, bias, y, n, lanes, k0, k1, first);
    }
  }
}

template <int M>
void product(const float* x, int64_t K, const float* wt, int64_t N, const float* bias, float* y) {
  constexpr int V = 4;  // accumulators: M * V registers of 16 lanes
  // Blocks of whole vectors, handed out evenly: each thread one contiguous range.
  const int64_t vectors = (N + 15) / 16;
  at::parallel_for(0, vectors, 1, [&](int64_t begin, int64_t end) {
    const int64_t n1 = end * 16 < N ? end * 16 : N;
    column_block<M, V>(x, K, wt, N, bias, y, begin * 16, n1);
  });
}

at::Tensor linear_few_rows(const at::Tensor& x, const at::Tensor& weight,
                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "tandem::linear_few_rows takes float32, got ", x.scalar_type(), " and ",
              weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2, "tandem::linear_few_rows: the weight is [out, in]");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N > 0 && K > 0, "tandem::linear_few_rows: an empty weight");
  TORCH_CHECK(weight.stride(0) == 1 && (weight.stride(1) == N || K == 1),
              "tandem::linear_few_rows: the weight must be column-major (packing.make_column_major)");
  TORCH_CHECK(x.size(-1) == K, "tandem::linear_few_rows: x has ", x.size(-1),
              " features, the weight takes ", K);
  const at::Tensor rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  TORCH_CHECK(M >= 1 && M <= kMaxTokens, "tandem::linear_few_rows takes 1 or ", kMaxTokens,
              " tokens, got ", M);
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(),
                "tandem::linear_few_rows: the bias is a contiguous float32 [out]");
    bp = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, rows.options());
  const float* xp = rows.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M == 1) {
    product<1>(xp, K, wp, N, bp, yp);
  } else {
    product<2>(xp, K, wp, N, bp, yp);
  }
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("linear_few_rows(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("linear_few_rows", linear_few_rows); }

#endif  // __AVX512F__
