// Fused per-row layer ops in bf16 (RMSNorm + residual, RoPE, SiLU * up).
#include "common.h"

extern "C" {
// 1 when kv_silu_mul_bf16 is vectorized (AVX-512 BF16); its scalar loop is slower than torch's own ops
int kv_silu_mul_fast() {
#if defined(KV_HAVE_AVX512) && defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}
// out[t] = bf16(bf16(silu(gate)) * up) for x[t] = gate | up (I each), the rounding of torch's F.silu(g) * u
void kv_silu_mul_bf16(const uint16_t* x, int64_t xs, uint16_t* out, int64_t T, int64_t I) {
  #pragma omp parallel for if (T * I > 65536)
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* g = x + t * xs;
    const uint16_t* u = g + I;
    uint16_t* o = out + t * I;
    int64_t i = 0;
#if defined(KV_HAVE_AVX512) && defined(__AVX512BF16__)
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= I; i += 16) {
      const __m512 gv = load16(g + i), uv = load16(u + i);
      // exp512 is accurate for any x >= -87 (its clamp); exp(-g) overflows to inf for g < -88, and g / inf = -0
      const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
      const __m256i sb = (__m256i)_mm512_cvtneps_pbh(s);   // silu rounded to bf16, as torch's output
      const __m512 sr = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(sb), 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(sr, uv)));
    }
#endif
    for (; i < I; ++i) {
      const float gf = bf16_to_f32(g[i]);
      const float s = bf16_to_f32(f32_to_bf16(gf / (1.f + std::exp(-gf))));
      o[i] = f32_to_bf16(s * bf16_to_f32(u[i]));
    }
  }
}
// out = rmsnorm(x [+ residual]) * w, bf16 rounding as torch's ops: r = bf16(x + residual) (written back to
// residual), y = bf16(r * rsqrt(mean(r^2) + eps)), out = bf16(w * y)
void kv_rmsnorm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* w, uint16_t* out, int64_t T, int64_t N,
                     float eps) {
  #pragma omp parallel for if (T * N > 65536)
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* xr = x + t * N;
    uint16_t* rr = residual ? residual + t * N : nullptr;
    float buf[8192];
    float ss = 0.f;
    for (int64_t i = 0; i < N; ++i) {
      float r = bf16_to_f32(xr[i]);
      if (rr) { r = bf16_to_f32(f32_to_bf16(r + bf16_to_f32(rr[i]))); rr[i] = f32_to_bf16(r); }
      buf[i] = r;
      ss += r * r;
    }
    const float inv = 1.f / std::sqrt(ss / float(N) + eps);
    for (int64_t i = 0; i < N; ++i)
      out[t * N + i] = f32_to_bf16(bf16_to_f32(w[i]) * bf16_to_f32(f32_to_bf16(buf[i] * inv)));
  }
}
// rotate (rotate_half convention) the first nh heads of every row of x in place:
// x = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), cos/sin [T, D] bf16
void kv_rope_bf16(uint16_t* x, int64_t xs, const uint16_t* cos, const uint16_t* sin, int64_t T, int64_t nh, int64_t D) {
  const int64_t half = D / 2;
  #pragma omp parallel for if (T * nh * D > 65536)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < nh; ++h) {
      uint16_t* p = x + t * xs + h * D;
      const uint16_t* c = cos + t * D;
      const uint16_t* s = sin + t * D;
      float a[512];
      for (int64_t d = 0; d < D; ++d) a[d] = bf16_to_f32(p[d]);
      for (int64_t d = 0; d < D; ++d) {
        const float rot = d < half ? -a[d + half] : a[d - half];
        const float xc = bf16_to_f32(f32_to_bf16(a[d] * bf16_to_f32(c[d])));
        const float rs = bf16_to_f32(f32_to_bf16(rot * bf16_to_f32(s[d])));
        p[d] = f32_to_bf16(xc + rs);
      }
    }
}
}
