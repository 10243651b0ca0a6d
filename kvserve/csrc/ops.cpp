// Fused per-row layer ops in bf16 (RMSNorm + residual, RoPE) and the KV cache write.
#include "common.h"

extern "C" {
// cache rows [slot] = k/v rows [t] (rows of n elements, element size es bytes)
void kv_write_kv(const char* k, int64_t ks, const char* v, int64_t vs, const int64_t* slots, int64_t T, int64_t n,
                 int64_t es, char* kc, char* vc) {
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(kc + slots[t] * n * es, k + t * ks * es, n * es);
    std::memcpy(vc + slots[t] * n * es, v + t * vs * es, n * es);
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
