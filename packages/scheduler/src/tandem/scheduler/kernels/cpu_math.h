// Helpers of tandem's CPU kernels (cpu_decode.cpp beside this file, kernels/cpu_fused.cpp
// and kernels/cpu_linear.cpp): scalar ones, written so that the loops calling them
// vectorize, and the way a kernel shares its work between the forward's threads.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>

namespace tandem_cpu {

// Calls work(item, state) for every item in [0, total) on the forward's intra-op
// threads (at::parallel_for), state = start() made once per thread. Each thread takes
// the next item from a shared counter until none is left, instead of a fixed share of
// the range: a thread that the OS stops for a while (another process, or the scheduler
// thread, wanted its core) leaves its items to the others, where with fixed shares
// every other thread would wait for it at the end (measurements: docs/benchmarks.md,
// Measurements behind the code).
template <typename Start, typename Work>
void for_each_item(int64_t total, Start start, Work work) {
  if (total <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), total);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    auto state = start();
    for (int64_t item = next.fetch_add(1, std::memory_order_relaxed); item < total;
         item = next.fetch_add(1, std::memory_order_relaxed)) {
      work(item, state);
    }
  });
}

// e^x in a form the compiler vectorizes: x = n ln2 + r with |r| <= ln2 / 2, e^r by
// its degree-6 Taylor polynomial (relative error under 3e-7), 2^n from the exponent
// bits. 0 below -87 (and at -inf); infinity above 88, so that silu(x) of a very
// negative x is -0, as torch gives it.
inline float exp_fast(float x) {
  const float clamped = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
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
  const float finite = x < -87.f ? 0.f : p * two_n;
  return x > 88.f ? std::numeric_limits<float>::infinity() : finite;
}

// A bfloat16 (its bits) as float32: exact, the upper half of the float's bits.
inline float widen(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

// x rounded to the nearest bfloat16 (its bits), ties to even; NaN kept a NaN.
inline uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return x != x ? static_cast<uint16_t>(0x7fc0) : static_cast<uint16_t>(rounded);
}

}  // namespace tandem_cpu
