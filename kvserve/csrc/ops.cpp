// Fused per-row layer ops in bf16 (RMSNorm + residual, per-head q/k norm, RoPE, SiLU * up, GELU-tanh * up).
#include "common.h"

extern "C" {
// 1 when kvserve_silu_mul_bf16 is vectorized (AVX-512 BF16 or AVX2); its scalar loop is slower than torch's ops
int kvserve_silu_mul_fast() {
#if (defined(KV_HAVE_AVX512) && defined(__AVX512BF16__)) || defined(KV_HAVE_AVX2)
  return 1;
#else
  return 0;
#endif
}
}

namespace {
// The gate activations of a gated MLP, on 16 lanes (AVX-512 BF16), 8 lanes (AVX2) and one value, each the same
// float32 arithmetic.
// silu(g) = g / (1 + exp(-g)). exp512/exp256 are accurate for any x >= -87 (their clamp); exp(-g) overflows to inf
// for g < -88, and g / inf = -0.
struct Silu {
#if defined(KV_HAVE_AVX512) && defined(__AVX512BF16__)
  static __m512 v16(__m512 g) {
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  }
#elif defined(KV_HAVE_AVX2)
  static __m256 v8(__m256 g) {
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
  }
#endif
  static float scalar(float g) { return g / (1.f + std::exp(-g)); }
};

// gelu's tanh approximation (GeGLU, Gemma) in torch's order: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))),
// tanh(y) = sign(y) (1 - 2 / (exp(2 |y|) + 1)) (so 1 + tanh(y) is 0 for y far below 0, as torch's is)
struct GeluTanh {
  static constexpr float beta = 0.7978845608028654f, kappa = 0.044715f;
#if defined(KV_HAVE_AVX512) && defined(__AVX512BF16__)
  static __m512 v16(__m512 g) {
    const __m512 one = _mm512_set1_ps(1.f), two = _mm512_set1_ps(2.f);
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    const __m512 y = _mm512_mul_ps(_mm512_set1_ps(beta), _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(kappa), cube)));
    const __m512i ys = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(int(0x80000000u)));
    const __m512 ay = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(y), ys));
    const __m512 e = exp512(_mm512_mul_ps(two, ay));
    const __m512 th = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(e, one)));
    const __m512 tanh = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(th), ys));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(.5f), g), _mm512_add_ps(one, tanh));
  }
#elif defined(KV_HAVE_AVX2)
  static __m256 v8(__m256 g) {
    const __m256 one = _mm256_set1_ps(1.f), two = _mm256_set1_ps(2.f);
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    const __m256 y = _mm256_mul_ps(_mm256_set1_ps(beta), _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(kappa), cube)));
    const __m256 ys = _mm256_and_ps(y, _mm256_set1_ps(-0.f));
    const __m256 e = exp256(_mm256_mul_ps(two, _mm256_xor_ps(y, ys)));
    const __m256 tanh = _mm256_xor_ps(_mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one))), ys);
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(.5f), g), _mm256_add_ps(one, tanh));
  }
#endif
  static float scalar(float g) {
    const float y = beta * (g + kappa * (g * g * g));
    const float th = std::copysign(1.f - 2.f / (std::exp(2.f * std::fabs(y)) + 1.f), y);
    return .5f * g * (1.f + th);
  }
};

// out[t] = bf16(bf16(act(gate)) * up) for x[t] = gate | up (I each): the rounding of torch's act(g) * u
template <class Act>
void gated_mul_bf16(const uint16_t* x, int64_t xs, uint16_t* out, int64_t T, int64_t I) {
  #pragma omp parallel for if (T * I > 65536)
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* g = x + t * xs;
    const uint16_t* u = g + I;
    uint16_t* o = out + t * I;
    int64_t i = 0;
#if defined(KV_HAVE_AVX512) && defined(__AVX512BF16__)
    for (; i + 16 <= I; i += 16) store16_bf16(o + i, _mm512_mul_ps(round_bf16(Act::v16(load16(g + i))), load16(u + i)));
#elif defined(KV_HAVE_AVX2)
    for (; i + 8 <= I; i += 8) store8(o + i, _mm256_mul_ps(round_bf16_8(Act::v8(load8(g + i))), load8(u + i)));
#endif
    for (; i < I; ++i)
      o[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(Act::scalar(bf16_to_f32(g[i])))) * bf16_to_f32(u[i]));
  }
}
}  // namespace

extern "C" {
void kvserve_silu_mul_bf16(const uint16_t* x, int64_t xs, uint16_t* out, int64_t T, int64_t I) {
  gated_mul_bf16<Silu>(x, xs, out, T, I);
}
void kvserve_gelu_tanh_mul_bf16(const uint16_t* x, int64_t xs, uint16_t* out, int64_t T, int64_t I) {
  gated_mul_bf16<GeluTanh>(x, xs, out, T, I);
}
// one row of kvserve_rmsnorm_bf16 (N <= 8192); o may be xr (the row is read whole before it is written)
static void rmsnorm_row(const uint16_t* xr, uint16_t* rr, const uint16_t* w, uint16_t* o, int64_t N, float eps) {
  float buf[8192];
  float ss = 0.f;
  int64_t i = 0;
#if defined(KV_HAVE_AVX512) && defined(__AVX512BF16__)
  __m512 ssv = _mm512_setzero_ps();
  for (; i + 16 <= N; i += 16) {
    __m512 r = load16(xr + i);
    if (rr) {
      r = round_bf16(_mm512_add_ps(r, load16(rr + i)));
      store16_bf16(rr + i, r);
    }
    _mm512_storeu_ps(buf + i, r);
    ssv = _mm512_fmadd_ps(r, r, ssv);
  }
  ss = _mm512_reduce_add_ps(ssv);
#elif defined(KV_HAVE_AVX2)
  __m256 ssv = _mm256_setzero_ps();
  for (; i + 8 <= N; i += 8) {
    __m256 r = load8(xr + i);
    if (rr) {
      r = round_bf16_8(_mm256_add_ps(r, load8(rr + i)));
      store8(rr + i, r);
    }
    _mm256_storeu_ps(buf + i, r);
    ssv = _mm256_fmadd_ps(r, r, ssv);
  }
  ss = hsum8(ssv);
#endif
  for (int64_t j = i; j < N; ++j) {
    float r = bf16_to_f32(xr[j]);
    if (rr) { r = bf16_to_f32(f32_to_bf16(r + bf16_to_f32(rr[j]))); rr[j] = f32_to_bf16(r); }
    buf[j] = r;
    ss += r * r;
  }
  const float inv = 1.f / std::sqrt(ss / float(N) + eps);
  i = 0;
#if defined(KV_HAVE_AVX512) && defined(__AVX512BF16__)
  const __m512 vinv = _mm512_set1_ps(inv);
  for (; i + 16 <= N; i += 16)
    store16_bf16(o + i, _mm512_mul_ps(load16(w + i), round_bf16(_mm512_mul_ps(_mm512_loadu_ps(buf + i), vinv))));
#elif defined(KV_HAVE_AVX2)
  const __m256 vinv = _mm256_set1_ps(inv);
  for (; i + 8 <= N; i += 8)
    store8(o + i, _mm256_mul_ps(load8(w + i), round_bf16_8(_mm256_mul_ps(_mm256_loadu_ps(buf + i), vinv))));
#endif
  for (; i < N; ++i) o[i] = f32_to_bf16(bf16_to_f32(w[i]) * bf16_to_f32(f32_to_bf16(buf[i] * inv)));
}
// out = rmsnorm(x [+ residual]) * w, bf16 rounding as torch's ops: r = bf16(x + residual) (written back to
// residual), y = bf16(r * rsqrt(mean(r^2) + eps)), out = bf16(w * y)
void kvserve_rmsnorm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* w, uint16_t* out, int64_t T, int64_t N,
                     float eps) {
  #pragma omp parallel for if (T * N > 65536)
  for (int64_t t = 0; t < T; ++t) rmsnorm_row(x + t * N, residual ? residual + t * N : nullptr, w, out + t * N, N, eps);
}
// per-head q/k norm in place (Qwen3, Gemma 3): each of the first nh heads of every row of x by qw [D], the next nkv
// heads by kw [D], the rounding of kvserve_rmsnorm_bf16 on the heads as rows
void kvserve_qk_norm_bf16(uint16_t* x, int64_t xs, const uint16_t* qw, const uint16_t* kw, int64_t T, int64_t nh,
                          int64_t nkv, int64_t D, float eps) {
  #pragma omp parallel for if (T * (nh + nkv) * D > 65536)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < nh + nkv; ++h) {
      uint16_t* row = x + t * xs + h * D;
      rmsnorm_row(row, nullptr, h < nh ? qw : kw, row, D, eps);
    }
}
// rotate (rotate_half convention) the first nh heads of every row of x in place:
// x = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), cos/sin [T, D] bf16
void kvserve_rope_bf16(uint16_t* x, int64_t xs, const uint16_t* cos, const uint16_t* sin, int64_t T, int64_t nh, int64_t D) {
  const int64_t half = D / 2;
  #pragma omp parallel for if (T * nh * D > 65536)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < nh; ++h) {
      uint16_t* p = x + t * xs + h * D;
      const uint16_t* c = cos + t * D;
      const uint16_t* s = sin + t * D;
#if defined(KV_HAVE_AVX512) && defined(__AVX512BF16__)
      if (half % 16 == 0) {   // 16 dims of each half at a time, the same roundings as below
        for (int64_t d = 0; d < half; d += 16) {
          const __m512 lo = load16(p + d), hi = load16(p + d + half);
          const __m512 xlo = round_bf16(_mm512_mul_ps(lo, load16(c + d)));
          const __m512 rlo = round_bf16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), hi), load16(s + d)));
          const __m512 xhi = round_bf16(_mm512_mul_ps(hi, load16(c + d + half)));
          const __m512 rhi = round_bf16(_mm512_mul_ps(lo, load16(s + d + half)));
          store16_bf16(p + d, _mm512_add_ps(xlo, rlo));
          store16_bf16(p + d + half, _mm512_add_ps(xhi, rhi));
        }
        continue;
      }
#elif defined(KV_HAVE_AVX2)
      if (half % 8 == 0) {   // 8 dims of each half at a time, the same roundings as below
        for (int64_t d = 0; d < half; d += 8) {
          const __m256 lo = load8(p + d), hi = load8(p + d + half);
          const __m256 xlo = round_bf16_8(_mm256_mul_ps(lo, load8(c + d)));
          const __m256 rlo = round_bf16_8(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), hi), load8(s + d)));
          const __m256 xhi = round_bf16_8(_mm256_mul_ps(hi, load8(c + d + half)));
          const __m256 rhi = round_bf16_8(_mm256_mul_ps(lo, load8(s + d + half)));
          store8(p + d, _mm256_add_ps(xlo, rlo));
          store8(p + d + half, _mm256_add_ps(xhi, rhi));
        }
        continue;
      }
#endif
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

namespace {
// index of the first maximum of p[0, V), NaN counting as the maximum (torch.argmax's rule)
int64_t argmax_row_scalar(const float* p, int64_t from, int64_t V, int64_t best, float best_v) {
  for (int64_t i = from; i < V; ++i) {
    if (std::isnan(p[i])) return i;
    if (p[i] > best_v) { best_v = p[i]; best = i; }
  }
  return best;
}
}  // namespace

extern "C" {
// out[r] = torch.argmax(x[r, :V]) for each of the rows (row stride xs floats): the first index of the maximum,
// or of the first NaN. The greedy sampler's argmax over a decode batch's logits (several times torch's speed).
void kvserve_argmax_f32(const float* x, int64_t xs, int64_t rows, int64_t V, int64_t* out) {
  #pragma omp parallel for schedule(static) if (rows * V >= 262144)
  for (int64_t r = 0; r < rows; ++r) {
    const float* p = x + r * xs;
    if (V <= 0) { out[r] = 0; continue; }
#ifdef KV_HAVE_AVX512
    if (V >= 32) {
      __m512 best_v = _mm512_loadu_ps(p);
      __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      __m512i best_i = idx;
      __mmask16 nan = _mm512_cmp_ps_mask(best_v, best_v, _CMP_UNORD_Q);
      int64_t i = 16;
      for (; i + 16 <= V; i += 16) {   // per lane: strictly greater keeps the first occurrence
        idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
        const __m512 v = _mm512_loadu_ps(p + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, best_v, _CMP_GT_OQ);
        best_v = _mm512_mask_mov_ps(best_v, gt, v);
        best_i = _mm512_mask_mov_epi32(best_i, gt, idx);
      }
      if (nan) { out[r] = argmax_row_scalar(p, 0, V, 0, -INFINITY); continue; }
      const float m = _mm512_reduce_max_ps(best_v);
      const __mmask16 eq = _mm512_cmp_ps_mask(best_v, _mm512_set1_ps(m), _CMP_EQ_OQ);
      const int32_t first = _mm512_mask_reduce_min_epi32(eq, best_i);   // the earliest lane holding the maximum
      out[r] = argmax_row_scalar(p, i, V, first, m);
      continue;
    }
#endif
    out[r] = std::isnan(p[0]) ? 0 : argmax_row_scalar(p, 1, V, 0, p[0]);
  }
}
}

extern "C" {
// Ends the calling thread's OpenMP worker threads (omp_pause_resource_all; they start again at its next parallel
// region). libgomp counts every worker it keeps; once they outnumber the CPUs it shortens its spin waits, and each
// parallel region of another thread then wakes its workers through the kernel (the server's engine thread ran
// its matmuls several times slower while the main thread's workers, from loading the model, lived on). libgomp
// pauses the calling thread's pool only (LLVM's libomp, which these builds do not link, pauses them all); -1
// inside a parallel region.
int kvserve_omp_release() { return omp_pause_resource_all(omp_pause_soft); }

// Structured outputs: x[rows[i], t] = -inf wherever bit t of bitmask[rows[i]] is clear, for t < V (row strides xs
// floats and ws 32-bit words). A word with every bit set, the common case outside a grammar's narrow spots, is
// skipped whole; one with none set is filled whole.
void kvserve_apply_bitmask_f32(float* x, int64_t xs, const int32_t* bitmask, int64_t ws, const int64_t* rows,
                               int64_t num_rows, int64_t V) {
  #pragma omp parallel for schedule(static) if (num_rows * V >= 262144)
  for (int64_t i = 0; i < num_rows; ++i) {
    float* p = x + rows[i] * xs;
    const uint32_t* words = reinterpret_cast<const uint32_t*>(bitmask + rows[i] * ws);
    for (int64_t w = 0; w * 32 < V; ++w) {
      const uint32_t bits = words[w];
      if (bits == 0xFFFFFFFFu) continue;
      const int64_t end = std::min<int64_t>(32, V - w * 32);
      float* q = p + w * 32;
      for (int64_t b = 0; b < end; ++b)
        if (!((bits >> b) & 1u)) q[b] = -INFINITY;
    }
  }
}
}
