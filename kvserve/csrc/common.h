// Shared by the kernel files: bf16 conversions and AVX-512 helpers. The files are compiled as one unit
// (common.h first), see kvserve/attention/kernels.py.
#pragma once

#include <cstdint>
#include <cstring>
#include <cmath>
#include <numeric>
#include <algorithm>
#include <array>
#include <atomic>
#include <type_traits>
#include <utility>
#include <memory>
#include <vector>
#include <omp.h>

namespace {

// the helpers called per value or per block: always inlined, also into the quantized kernels (quant*.cpp), which
// compile in a region of other optimize options that GCC does not otherwise inline across
#define KV_ALWAYS_INLINE __attribute__((always_inline)) inline

KV_ALWAYS_INLINE float bf16_to_f32(uint16_t x) {
  uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
KV_ALWAYS_INLINE uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept NaN
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
template <typename T> inline float load(const T* p, int64_t i);
template <> KV_ALWAYS_INLINE float load<float>(const float* p, int64_t i) { return p[i]; }
template <> KV_ALWAYS_INLINE float load<uint16_t>(const uint16_t* p, int64_t i) {
  return bf16_to_f32(p[i]);
}
template <typename T> inline void store(T* p, int64_t i, float v);
template <> KV_ALWAYS_INLINE void store<float>(float* p, int64_t i, float v) { p[i] = v; }
template <> KV_ALWAYS_INLINE void store<uint16_t>(uint16_t* p, int64_t i, float v) {
  p[i] = f32_to_bf16(v);
}

// The activations' int8 quantization (quant_matmul.cpp, quant_int8.cpp): a block's values times inv_scale(amax),
// rounded to nearest even within -127..127 whatever the input (a NaN goes to -127, as the AVX2 path's max/min with
// NaN in the first operand; so does an infinity, which makes amax infinite and inv_scale 0, and its block's other
// values 0): every build and path makes the same bytes, and the integer sums kept beside them match the bytes, also
// for garbage rows. The clamp changes no finite row's bytes.
KV_ALWAYS_INLINE float clamp127(float v) {
  v = v > -127.f ? v : -127.f;   // maxps / minps: the second operand where the first is NaN
  return v < 127.f ? v : 127.f;
}
// v[0..n) = the n values at p as floats; returns their largest magnitude, a NaN passed over (as maxps with the NaN
// in the second operand)
template <typename X>
KV_ALWAYS_INLINE float load_amax(const X* p, int n, float* v) {
  float amax = 0.f;
  for (int i = 0; i < n; ++i) {
    v[i] = load(p, i);
    amax = amax < __builtin_fabsf(v[i]) ? __builtin_fabsf(v[i]) : amax;   // std::max, which is not inlined here
  }
  return amax;
}
// 127 / amax, at most FLT_MAX: a block of tiny values (amax below 127 / FLT_MAX, about 3.7e-37) stays finite, and
// its zeros zero (std::min's result, written out: a call of it is not inlined into the quantized kernels)
KV_ALWAYS_INLINE float inv_scale(float amax) {
  const float id = 127.f / amax;
  return amax > 0.f ? (3.4028235e38f < id ? 3.4028235e38f : id) : 0.f;
}

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

KV_ALWAYS_INLINE __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
KV_ALWAYS_INLINE __m512 load16(const uint16_t* p) {
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

#if defined(__AVX2__) && defined(__FMA__) && !defined(KVSERVE_PORTABLE)
#include <immintrin.h>
#define KV_HAVE_AVX2 1

// 8 bf16 -> 8 floats; 8 floats -> 8 bf16 rounded as f32_to_bf16 (nearest even, NaN kept NaN)
KV_ALWAYS_INLINE __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
KV_ALWAYS_INLINE __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256i bf16_bits8(__m256 v) {   // the 8 bf16 codes, one per 32-bit lane
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline __m256 round_bf16_8(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16)); }
inline void store8(uint16_t* p, __m256 v) {
  const __m256i b = bf16_bits8(v);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
#ifdef __F16C__
// 16 fp16 codes (one 256-bit load) -> their first 8 and last 8 values as floats, exactly (F16C)
KV_ALWAYS_INLINE void fp16_halves(__m256i h, __m256& a, __m256& b) {
  a = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  b = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}
#endif

// exp(x): exp512's polynomial on 8 lanes; below -87 it returns exp(-87), above 88.7 inf (as exp512's scalef)
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(89.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.5403530e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022651e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  // 2^n as two factors, each a normal float: n = 128 (x above 88.7) overflows their product to inf
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(ni, 1);
  const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
  const __m256 b = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}

KV_ALWAYS_INLINE float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

}  // namespace
