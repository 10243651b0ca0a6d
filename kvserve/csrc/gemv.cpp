// Skinny bf16 matmul y[M, N] = x[M, K] @ W[N, K]^T for the few rows of a decode step (M <= GEMV_MAX_ROWS).
// Such a step is bound by reading W, so W is repacked once into the order the loop streams it:
//   Wp[n / 16][k / 2][n % 16] = the bf16 pair (W[n][k], W[n][k + 1]) as one dword,
// and every vdpbf16ps multiplies one 64-byte line of Wp (16 outputs x 2 inputs) by a broadcast pair of x.
#include "common.h"

namespace {

#ifndef GEMV_MAX_ROWS
#define GEMV_MAX_ROWS 10   // beyond, oneDNN catches up (1.02x at 12 rows, 0.90x at 16 on one thread)
#endif

#if defined(KV_HAVE_AVX512) && defined(__AVX512BF16__)
#define KV_HAVE_GEMV 1

// outputs [16 nb, 16 nb + 16) of the M rows; K2 = K / 2 pairs. P partial sums per row keep at least ~6
// independent vdpbf16ps chains in flight. No software prefetch: the hardware streamer does better on these
// sequential reads (29.7 against 24-27 GB/s).
template <int M, int P>
inline void gemv_block(const int32_t* const* xd, const int32_t* w, int64_t K2, __m512* out) {
  __m512 acc[M][P];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < P; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + P <= K2; k += P) {
    for (int u = 0; u < P; ++u) {
      const __m512bh wv = (__m512bh)_mm512_load_si512(w + (k + u) * 16);
      for (int m = 0; m < M; ++m)
        acc[m][u] = _mm512_dpbf16_ps(acc[m][u], (__m512bh)_mm512_set1_epi32(xd[m][k + u]), wv);
    }
  }
  for (; k < K2; ++k) {
    const __m512bh wv = (__m512bh)_mm512_load_si512(w + k * 16);
    for (int m = 0; m < M; ++m) acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)_mm512_set1_epi32(xd[m][k]), wv);
  }
  for (int m = 0; m < M; ++m) {
    out[m] = acc[m][0];
    for (int u = 1; u < P; ++u) out[m] = _mm512_add_ps(out[m], acc[m][u]);
  }
}

template <int M, int P>
void gemv_rows(const uint16_t* x, int64_t xs, const int32_t* wp, uint16_t* y, int64_t ys, int64_t N, int64_t K) {
  const int64_t K2 = K / 2, nb = (N + 15) / 16;
  const int32_t* xd[M];
  for (int m = 0; m < M; ++m) xd[m] = reinterpret_cast<const int32_t*>(x + m * xs);
  #pragma omp parallel for schedule(static) if (nb * K2 >= 4096)
  for (int64_t b = 0; b < nb; ++b) {
    __m512 out[M];
    gemv_block<M, P>(xd, wp + b * K2 * 16, K2, out);
    const int64_t left = N - b * 16;
    const __mmask16 mask = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
    for (int m = 0; m < M; ++m)   // round to nearest even, as torch's bf16 output
      _mm256_mask_storeu_epi16(y + m * ys + b * 16, mask, (__m256i)_mm512_cvtneps_pbh(out[m]));
  }
}
#endif

}  // namespace

extern "C" {
int kv_gemv_max_rows() {
#ifdef KV_HAVE_GEMV
  return GEMV_MAX_ROWS;
#else
  return 0;
#endif
}
// Wp (see above) from W [N, K] bf16 row-major; Wp holds ceil(N / 16) * 16 * K bf16, padding rows are zero
void kv_gemv_pack(const uint16_t* w, int64_t N, int64_t K, uint16_t* wp) {
  const int64_t K2 = K / 2, nb = (N + 15) / 16;
  #pragma omp parallel for
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t k = 0; k < K2; ++k)
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t n = b * 16 + j;
        uint16_t* dst = wp + ((b * K2 + k) * 16 + j) * 2;
        dst[0] = n < N ? w[n * K + 2 * k] : 0;
        dst[1] = n < N ? w[n * K + 2 * k + 1] : 0;
      }
}
// y[M, N] = x[M, K] @ W^T; rows of x and y may be strided (xs, ys elements); K even. Fastest up to
// kv_gemv_max_rows() rows; more are taken 16 at a time, re-reading W
void kv_gemv_bf16(const uint16_t* x, int64_t xs, const uint16_t* wp, uint16_t* y, int64_t ys, int64_t M, int64_t N,
                  int64_t K) {
#ifdef KV_HAVE_GEMV
  const int32_t* w = reinterpret_cast<const int32_t*>(wp);
  for (int64_t m0 = 0; m0 < M; m0 += 16) {   // 16 rows at a time: more would not fit the registers
    const uint16_t* xm = x + m0 * xs;
    uint16_t* ym = y + m0 * ys;
    switch (std::min<int64_t>(16, M - m0)) {
      case 1: gemv_rows<1, 4>(xm, xs, w, ym, ys, N, K); break;
      case 2: gemv_rows<2, 4>(xm, xs, w, ym, ys, N, K); break;
      case 3: gemv_rows<3, 2>(xm, xs, w, ym, ys, N, K); break;
      case 4: gemv_rows<4, 2>(xm, xs, w, ym, ys, N, K); break;
      case 5: gemv_rows<5, 1>(xm, xs, w, ym, ys, N, K); break;
      case 6: gemv_rows<6, 1>(xm, xs, w, ym, ys, N, K); break;
      case 7: gemv_rows<7, 1>(xm, xs, w, ym, ys, N, K); break;
      case 8: gemv_rows<8, 1>(xm, xs, w, ym, ys, N, K); break;
      case 9: gemv_rows<9, 1>(xm, xs, w, ym, ys, N, K); break;
      case 10: gemv_rows<10, 1>(xm, xs, w, ym, ys, N, K); break;
      case 11: gemv_rows<11, 1>(xm, xs, w, ym, ys, N, K); break;
      case 12: gemv_rows<12, 1>(xm, xs, w, ym, ys, N, K); break;
      case 13: gemv_rows<13, 1>(xm, xs, w, ym, ys, N, K); break;
      case 14: gemv_rows<14, 1>(xm, xs, w, ym, ys, N, K); break;
      case 15: gemv_rows<15, 1>(xm, xs, w, ym, ys, N, K); break;
      default: gemv_rows<16, 1>(xm, xs, w, ym, ys, N, K); break;
    }
  }
#endif
}
}
