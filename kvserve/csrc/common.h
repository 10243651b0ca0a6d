// Shared by the kernel files: bf16 conversions and AVX-512 helpers. The files are compiled as one unit
// (common.h first), see kvserve/attention/kernels.py.
#pragma once

#include <cstdint>
#include <cstring>
#include <cmath>
#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>
#include <omp.h>

namespace {

inline float bf16_to_f32(uint16_t x) { uint32_t u = uint32_t(x) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept NaN
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
template <typename T> inline float load(const T* p, int64_t i);
template <> inline float load<float>(const float* p, int64_t i) { return p[i]; }
template <> inline float load<uint16_t>(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }
template <typename T> inline void store(T* p, int64_t i, float v);
template <> inline void store<float>(float* p, int64_t i, float v) { p[i] = v; }
template <> inline void store<uint16_t>(uint16_t* p, int64_t i, float v) { p[i] = f32_to_bf16(v); }

// FP8 KV cache values (kvserve/attention/fp8.py): one byte per value, e4m3 (OCP "fn": no infinities, largest
// 448) or e5m2 (largest 57344). A pool stores x / scale, saturated to the largest finite value and rounded to
// nearest even, as torch's conversion of the clamped value; reads multiply the scale back in.
enum Fp8Format { FP8_E4M3 = 1, FP8_E5M2 = 2 };
struct fp8_e4m3 { uint8_t bits; };
struct fp8_e5m2 { uint8_t bits; };

inline int fp8_mbits(int fmt) { return fmt == FP8_E4M3 ? 3 : 2; }
inline int fp8_bias(int fmt) { return fmt == FP8_E4M3 ? 7 : 15; }
inline float fp8_max(int fmt) { return fmt == FP8_E4M3 ? 448.f : 57344.f; }

inline uint8_t fp8_encode(float x, int fmt) {
  const int M = fp8_mbits(fmt), bias = fp8_bias(fmt);
  uint32_t u;
  std::memcpy(&u, &x, 4);   // the sign bit itself: -ffast-math may treat -0.0 as 0.0
  const uint8_t sign = uint8_t((u >> 24) & 0x80);
  if (std::isnan(x)) return sign | 0x7f;   // torch's NaN in both formats
  const float a = std::min(std::fabs(x), fp8_max(fmt));
  if (a == 0.f) return sign;
  int e;
  std::frexp(a, &e);                               // a in [2^(e-1), 2^e)
  const int ex = std::max(e - 1, 1 - bias);        // subnormals share the smallest normal exponent
  const int q = int(std::nearbyint(std::ldexp(a, M - ex)));   // 2^M + mantissa (normal) or mantissa
  return uint8_t(sign | (((ex + bias - 1) << M) + q));        // q = 2^(M+1) carries into the exponent
}

inline float fp8_decode(uint8_t c, int fmt) {
  const int M = fp8_mbits(fmt), bias = fp8_bias(fmt);
  const int field = (c & 0x7f) >> M, m = c & ((1 << M) - 1);
  float v;
  if (fmt == FP8_E4M3 && (c & 0x7f) == 0x7f) v = NAN;
  else if (fmt == FP8_E5M2 && field == 31) v = m ? NAN : INFINITY;
  else v = field == 0 ? std::ldexp(float(m), 1 - bias - M) : std::ldexp(float((1 << M) + m), field - bias - M);
  return c & 0x80 ? -v : v;
}

struct Fp8Table {
  float v[256];
  explicit Fp8Table(int fmt) { for (int c = 0; c < 256; ++c) v[c] = fp8_decode(uint8_t(c), fmt); }
};
const Fp8Table kE4M3(FP8_E4M3), kE5M2(FP8_E5M2);
template <> inline float load<fp8_e4m3>(const fp8_e4m3* p, int64_t i) { return kE4M3.v[p[i].bits]; }
template <> inline float load<fp8_e5m2>(const fp8_e5m2* p, int64_t i) { return kE5M2.v[p[i].bits]; }

#if defined(__AVX512F__) && !defined(KVSERVE_PORTABLE)
#include <immintrin.h>
#define KV_HAVE_AVX512 1

// exp(x) for x <= 0 (softmax arguments): 2^(x log2 e) with a degree-6 polynomial, ~2 ulp
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

#if defined(__AVX512BF16__)
// v rounded to bf16 (nearest even) and widened back: the value a bf16 tensor would hold
inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
inline void store16_bf16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

#endif

}  // namespace
