// tandem's fused CPU ops for the model's element-wise steps: RMSNorm, SiLU-and-multiply
// and the rotary embedding, each one pass over its rows instead of the four to six
// passes (and float32 copies) their torch formulas make. Float32 or bfloat16.
//
// Built with the decode kernel by tandem/scheduler/kernels/cpu_build.py and
// registered as torch.ops.tandem.rms_norm, silu_mul and rotary; see
// docs/guides/adding-a-model.md, "Adding a new architecture", its bullet "The fused
// CPU ops". Each op rounds where the torch formula it replaces rounds (the same
// float32 arithmetic up to the order of a sum), so bfloat16 results match the formula's
// to the last bit but where a sum's order moves one.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "cpu_math.h"

namespace {

using tandem_cpu::exp_fast;
using tandem_cpu::widen;

inline float widen(float x) { return x; }

// x rounded to T: float as it is; bfloat16 to nearest, ties to even (tandem_cpu::to_bf16).
template <typename T>
inline T narrow(float x);

template <>
inline float narrow<float>(float x) {
  return x;
}

template <>
inline uint16_t narrow<uint16_t>(float x) {
  return tandem_cpu::to_bf16(x);
}

// Rows of 16 KiB or more are worth a task of their own; shorter ones go in groups.
int64_t grain(int64_t row_elements) {
  const int64_t rows = 4096 / (row_elements > 0 ? row_elements : 1);
  return rows > 1 ? rows : 1;
}

void check_dtype(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "tandem::", op, " takes float32 or bfloat16, got ", x.scalar_type());
}

// weight * round(x * rsqrt(mean(x^2) + eps)), the statistics in float32, over the last
// dimension of x's rows.
template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps,
                   const at::Tensor& out) {
  const int64_t rows = x.size(0), size = x.size(1), stride = x.stride(0);
  const T* xp = static_cast<const T*>(x.data_ptr());
  const T* wp = static_cast<const T*>(weight.data_ptr());
  T* op = static_cast<T*>(out.data_ptr());
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(size), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * stride;
      T* o = op + r * size;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < size; ++i) {
        const float v = widen(row[i]);
        squares += v * v;
      }
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(size) + e);
#pragma omp simd
      for (int64_t i = 0; i < size; ++i) {
        const float normed = widen(narrow<T>(widen(row[i]) * inv));
        o[i] = narrow<T>(widen(wp[i]) * normed);
      }
    }
  });
}

// silu(gate) * up: silu in float32 and rounded, then the product rounded.
template <typename T>
void silu_mul_rows(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& out) {
  const int64_t rows = gate.size(0), size = gate.size(1);
  const int64_t gate_stride = gate.stride(0), up_stride = up.stride(0);
  const T* gp = static_cast<const T*>(gate.data_ptr());
  const T* upp = static_cast<const T*>(up.data_ptr());
  T* op = static_cast<T*>(out.data_ptr());
  at::parallel_for(0, rows, grain(size), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gp + r * gate_stride;
      const T* u = upp + r * up_stride;
      T* o = op + r * size;
#pragma omp simd
      for (int64_t i = 0; i < size; ++i) {
        const float v = widen(g[i]);
        const float silu = widen(narrow<T>(v / (1.f + exp_fast(-v))));
        o[i] = narrow<T>(silu * widen(u[i]));
      }
    }
  });
}

// Each head of x rotated by its token's angles, in float32, then rounded:
// out[i] = x[i] cos[i] + x[i + D/2 mod D] sin[i] (sin's first half negated by
// RotaryEmbedding, so the pairs (i, i + D/2) turn by their angle).
template <typename T>
void rotary_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                 const at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  const T* xp = static_cast<const T*>(x.data_ptr());
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  T* op = static_cast<T*>(out.data_ptr());
  at::parallel_for(0, tokens, grain(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * dim;
      const float* s = sp + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* row = xp + t * token_stride + h * head_stride;
        T* o = op + (t * heads + h) * dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          o[i] = narrow<T>(widen(row[i]) * c[i] + widen(row[i + half]) * s[i]);
          o[i + half] = narrow<T>(widen(row[i + half]) * c[i + half] + widen(row[i]) * s[i + half]);
        }
      }
    }
  });
}

// x [T, H], its last dimension contiguous; weight [H], x's dtype. Returns [T, H].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_dtype(x, "rms_norm");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "tandem::rms_norm: x [T, H] with contiguous rows");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 &&
                  weight.size(0) == x.size(1) && weight.stride(0) == 1,
              "tandem::rms_norm: weight ", weight.sizes(), " of ", weight.scalar_type(),
              " does not match x ", x.sizes(), " of ", x.scalar_type());
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows<float>(x, weight, eps, out);
  } else {
    rms_norm_rows<uint16_t>(x, weight, eps, out);
  }
  return out;
}

// gate and up [T, I], one dtype, their last dimension contiguous (the two halves of a
// fused projection's output). Returns [T, I].
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_dtype(gate, "silu_mul");
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() &&
                  up.scalar_type() == gate.scalar_type() && gate.stride(1) == 1 &&
                  up.stride(1) == 1,
              "tandem::silu_mul: gate and up [T, I] of one dtype with contiguous rows, got ",
              gate.sizes(), " and ", up.sizes());
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  if (gate.scalar_type() == at::kFloat) {
    silu_mul_rows<float>(gate, up, out);
  } else {
    silu_mul_rows<uint16_t>(gate, up, out);
  }
  return out;
}

// x [T, heads, D], its last dimension contiguous; cos and sin [T, 1, D] float32,
// contiguous. Returns [T, heads, D] in x's dtype.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_dtype(x, "rotary");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "tandem::rotary: x [T, heads, D] with D even and contiguous, got ", x.sizes());
  for (const at::Tensor* table : {&cos, &sin}) {
    TORCH_CHECK(table->scalar_type() == at::kFloat && table->is_contiguous() &&
                    table->numel() == x.size(0) * x.size(2),
                "tandem::rotary: cos and sin [T, 1, D] float32 and contiguous, got ",
                table->sizes(), " of ", table->scalar_type(), " for x ", x.sizes());
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) {
    rotary_rows<float>(x, cos, sin, out);
  } else {
    rotary_rows<uint16_t>(x, cos, sin, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("silu_mul", silu_mul);
  m.impl("rotary", rotary);
}
