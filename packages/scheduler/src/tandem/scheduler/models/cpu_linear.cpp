// tandem's float32 product: y = x @ weight^T (+ bias), for any number of tokens, over a
// copy of the weight laid out in panels.
//
// Built with the decode kernel by tandem/scheduler/attention/cpu_kernel.py and
// registered as torch.ops.tandem.linear_panels, on CPUs with AVX-512 only (the library
// has no such op elsewhere); see docs/guides/adding-a-model.md, "Adding a new
// architecture", its bullet "The fused CPU ops".
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
// about 10-35 % slower (docs/benchmarks.md).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int64_t kPanel = 48;     // output columns per panel: three vectors of 16
constexpr int64_t kTileRows = 8;   // rows of x per tile: 8 x 3 sums in registers
constexpr int64_t kChunkRows = 64; // most rows of x per work item, with one panel
static_assert(kTileRows == 8, "panel_rows' tail cases cover 1 to kTileRows - 1 rows");

// y[0:MR, 0:16V) = x[0:MR, :] @ panel (+ bias); the last vector's valid lanes are `lanes`.
template <int MR, int V>
inline void tile(const float* x, int64_t ldx, int64_t K, const float* panel, const float* bias,
                 float* y, int64_t ldy, __mmask16 lanes) {
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
    for (int v = 0; v < V; ++v) _mm512_mask_storeu_ps(y + m * ldy + 16 * v, mask(v), acc[m][v]);
  }
}

// Rows [0, M) of x by one panel whose first V vectors are valid: tiles of kTileRows
// rows, then one tile of the rest.
template <int V>
void panel_rows(const float* x, int64_t ldx, int64_t M, int64_t K, const float* panel,
                const float* bias, float* y, int64_t ldy, __mmask16 lanes) {
  int64_t m = 0;
  for (; m + kTileRows <= M; m += kTileRows) {
    tile<kTileRows, V>(x + m * ldx, ldx, K, panel, bias, y + m * ldy, ldy, lanes);
  }
  const float* xm = x + m * ldx;
  float* ym = y + m * ldy;
  switch (M - m) {
    case 1: tile<1, V>(xm, ldx, K, panel, bias, ym, ldy, lanes); break;
    case 2: tile<2, V>(xm, ldx, K, panel, bias, ym, ldy, lanes); break;
    case 3: tile<3, V>(xm, ldx, K, panel, bias, ym, ldy, lanes); break;
    case 4: tile<4, V>(xm, ldx, K, panel, bias, ym, ldy, lanes); break;
    case 5: tile<5, V>(xm, ldx, K, panel, bias, ym, ldy, lanes); break;
    case 6: tile<6, V>(xm, ldx, K, panel, bias, ym, ldy, lanes); break;
    case 7: tile<7, V>(xm, ldx, K, panel, bias, ym, ldy, lanes); break;
    default: break;
  }
}

at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& panels,
                         const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat,
              "tandem::linear_panels takes float32, got ", x.scalar_type(), " and ",
              panels.scalar_type());
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous(),
              "tandem::linear_panels: the weight must be in panels of ", kPanel,
              " columns, a contiguous [P, in, ", kPanel, "] tensor (packing.to_panels)");
  const int64_t P = panels.size(0), K = panels.size(1), N = out_features;
  TORCH_CHECK(P > 0 && K > 0, "tandem::linear_panels: an empty weight");
  TORCH_CHECK(N > (P - 1) * kPanel && N <= P * kPanel, "tandem::linear_panels: ", P,
              " panels hold ", (P - 1) * kPanel + 1, " to ", P * kPanel,
              " output features, not ", N);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "tandem::linear_panels: x has ",
              x.dim() >= 1 ? x.size(-1) : 0, " features, the weight takes ", K);
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(),
                "tandem::linear_panels: the bias is a contiguous float32 [out]");
    bp = bias->data_ptr<float>();
  }
  const at::Tensor rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  at::Tensor y = at::empty({M, N}, rows.options());
  auto shape = x.sizes().vec();
  shape.back() = N;
  if (M == 0) return y.view(shape);
  const float* xp = rows.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Work items: (chunk of rows, panel), panels inner, handed out evenly: a few tokens'
  // step splits the panels between the threads, a prefill its rows. The chunks are of
  // equal size (96 rows: two of 48, not 64 and 32).
  const int64_t chunks = (M + kChunkRows - 1) / kChunkRows;
  const int64_t chunk_rows = (M + chunks - 1) / chunks;
  at::parallel_for(0, chunks * P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / P, p = item % P;
      const int64_t m0 = chunk * chunk_rows;
      const int64_t m = M - m0 < chunk_rows ? M - m0 : chunk_rows;
      const int64_t n0 = p * kPanel;
      const int64_t cols = N - n0 < kPanel ? N - n0 : kPanel;
      const int64_t vectors = (cols + 15) / 16, tail = cols - 16 * (vectors - 1);
      const __mmask16 lanes = tail == 16 ? __mmask16(0xFFFF) : __mmask16((1u << tail) - 1);
      const float* xm = xp + m0 * K;
      const float* panel = pp + p * K * kPanel;
      const float* b = bp != nullptr ? bp + n0 : nullptr;
      float* ym = yp + m0 * N + n0;
      switch (vectors) {
        case 1: panel_rows<1>(xm, K, m, K, panel, b, ym, N, lanes); break;
        case 2: panel_rows<2>(xm, K, m, K, panel, b, ym, N, lanes); break;
        default: panel_rows<3>(xm, K, m, K, panel, b, ym, N, lanes); break;
      }
    }
  });
  return y.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("linear_panels(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("linear_panels", linear_panels); }

#endif  // __AVX512F__
