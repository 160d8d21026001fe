// Math functions that the compiler can vectorize inside `#pragma omp simd` loops.
//
// Without -ffast-math, GCC will not call glibc's vector exp, so std::exp stays scalar and the
// softmaxes of attention and cross-entropy and the SiLU of the MLP pay for a scalar call per
// element. The float version below is plain arithmetic, so it vectorizes, and it is the same code
// on every machine, so results do not depend on the libm version.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>

namespace malleus::backend {

// e^x for float, within about 2 ulp of the exact value over the range where e^x is normal;
// 0 below it (where the exact value is at most a denormal), and e^88 above 88.
inline float vexp(float x) {
  // Cephes expf: x = n·ln2 + r with |r| <= ln2/2, e^r by a degree-7 polynomial, 2^n through the
  // exponent bits. ln2 is split in two (Cody–Waite) so n·ln2 is exact enough in float.
  // std::max/min (not fmax/fmin) so that a NaN input stays NaN and training can notice it.
  const float lower = -87.33654f;
  const float clamped = std::min(std::max(x, lower), 88.0f);
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  // Below the range, 2^-127 has all exponent bits clear, i.e. 0. n is NaN only for a NaN input,
  // whose result is NaN through y anyway; the select keeps the int conversion defined.
  const float exponent = x < lower ? -127.0f : (n == n ? n : 0.0f);
  float r = clamped - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const float two_n = std::bit_cast<float>((static_cast<int32_t>(exponent) + 127) << 23);
  return y * two_n;
}

// Double precision is the reference path (gradient checks), where libm's accuracy matters more
// than speed.
inline double vexp(double x) {
  return std::exp(x);
}

// Σ a[i]·b[i]. An `omp simd` reduction keeps one vector accumulator, so every addition waits for
// the previous one; 32 independent lanes (four AVX vectors of float) hide that latency. The lanes
// are combined in a fixed order, so the result is still deterministic.
template <typename T>
T dot_product(const T* a, const T* b, size_t count) {
  constexpr size_t kLanes = 32;
  T lanes[kLanes] = {};
  size_t j = 0;
  for (; j + kLanes <= count; j += kLanes) {
    for (size_t l = 0; l < kLanes; ++l) lanes[l] += a[j + l] * b[j + l];
  }
  T tail = 0;
  for (; j < count; ++j) tail += a[j] * b[j];
  for (size_t width = kLanes / 2; width > 0; width /= 2) {
    for (size_t l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0] + tail;
}

}  // namespace malleus::backend
