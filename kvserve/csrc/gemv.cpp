// bf16 matmul y[M, N] = x[M, K] @ W[N, K]^T of every linear layer on the CPU, on W repacked once into the order
// the loops stream it:
//   Wp[n / 16][k / 2][n % 16] = the bf16 pair (W[n][k], W[n][k + 1]) as one dword,
// so every vdpbf16ps multiplies one 64-byte line of Wp (16 outputs x 2 inputs) by a broadcast pair of x.
// Up to GEMV_MAX_ROWS rows a step is bound by reading W: the GEMV streams it once with every row in registers.
// More rows are compute-bound: register tiles of GEMM_MR rows x GEMM_NB column blocks (see gemm_tile), which
// match or beat oneDNN at every size measured (1.1-1.4x at 12-256 rows, 1.0-1.04x at 1024-4096).
#include "common.h"

namespace {

#ifndef GEMV_MAX_ROWS
#define GEMV_MAX_ROWS 8      // the GEMV and the tiles are even at 6-8 rows; the tiles win from 10
#endif
static_assert(GEMV_MAX_ROWS >= 1 && GEMV_MAX_ROWS <= 8, "kv_packed_matmul_bf16 dispatches 1-8 rows to the GEMV");

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

// Small GEMM for steps of a few dozen rows (decode batches): register tiles of MR rows x NB 16-column blocks,
// MR * NB accumulators, so each weight vector loaded feeds MR vdpbf16ps and each broadcast of x feeds NB (the
// GEMV above needs one broadcast per vdpbf16ps). 400-440 GFLOP/s on SmolLM2's shapes from 32 rows on 2 cores,
// against oneDNN's 240-380 (benchmarks/skinny_matmul.py). Same packed W; fp32 sums rounded once to bf16.
template <int MR, int NB>
void gemm_tile(const uint16_t* x, int64_t xs, const int32_t* w, int64_t K2, uint16_t* y, int64_t ys, int64_t left) {
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const int32_t* xd[MR];
  for (int m = 0; m < MR; ++m) xd[m] = reinterpret_cast<const int32_t*>(x + m * xs);
  const int64_t bstride = K2 * 16;
  for (int64_t k = 0; k < K2; ++k) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_load_si512(w + j * bstride + k * 16);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xd[m][k]);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, wv[j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t l = left - 16 * j;
    const __mmask16 mask = l >= 16 ? __mmask16(0xffff) : __mmask16((1u << l) - 1);
    for (int m = 0; m < MR; ++m)
      _mm256_mask_storeu_epi16(y + m * ys + 16 * j, mask, (__m256i)_mm512_cvtneps_pbh(acc[m][j]));
  }
}

constexpr int GEMM_MR = 6, GEMM_NB = 4;
using GemmFn = void (*)(const uint16_t*, int64_t, const int32_t*, int64_t, uint16_t*, int64_t, int64_t);
template <int NB>
constexpr GemmFn gemm_row_fns[GEMM_MR + 1] = {nullptr, gemm_tile<1, NB>, gemm_tile<2, NB>, gemm_tile<3, NB>,
                                              gemm_tile<4, NB>, gemm_tile<5, NB>, gemm_tile<6, NB>};
const GemmFn* const gemm_fns[GEMM_NB + 1] = {nullptr, gemm_row_fns<1>, gemm_row_fns<2>, gemm_row_fns<3>,
                                             gemm_row_fns<4>};
#endif

}  // namespace

extern "C" {
// 1 when kv_packed_matmul_bf16 is built (AVX-512 BF16)
int kv_has_packed_matmul() {
#ifdef KV_HAVE_GEMV
  return 1;
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
// y[M, N] = x[M, K] @ W^T; rows of x and y may be strided (xs, ys elements); K even; any M
void kv_packed_matmul_bf16(const uint16_t* x, int64_t xs, const uint16_t* wp, uint16_t* y, int64_t ys, int64_t M,
                           int64_t N, int64_t K) {
#ifdef KV_HAVE_GEMV
  const int32_t* w = reinterpret_cast<const int32_t*>(wp);
  const int64_t K2 = K / 2, nb = (N + 15) / 16;
  if (M <= GEMV_MAX_ROWS) {
    switch (M) {
      case 1: gemv_rows<1, 4>(x, xs, w, y, ys, N, K); break;
      case 2: gemv_rows<2, 4>(x, xs, w, y, ys, N, K); break;
      case 3: gemv_rows<3, 2>(x, xs, w, y, ys, N, K); break;
      case 4: gemv_rows<4, 2>(x, xs, w, y, ys, N, K); break;
      case 5: gemv_rows<5, 1>(x, xs, w, y, ys, N, K); break;
      case 6: gemv_rows<6, 1>(x, xs, w, y, ys, N, K); break;
      case 7: gemv_rows<7, 1>(x, xs, w, y, ys, N, K); break;
      default: gemv_rows<8, 1>(x, xs, w, y, ys, N, K); break;
    }
    return;
  }
  const int64_t groups = (nb + GEMM_NB - 1) / GEMM_NB, row_tiles = (M + GEMM_MR - 1) / GEMM_MR;
  const int64_t items = groups * row_tiles;
  // items column-group-major: a thread's consecutive items reuse one group of W from its L1/L2. Handed out in
  // chunks of up to one group, so that when another process preempts one thread (the HTTP frontend and its
  // clients share the cores) the others take over its items instead of waiting for it at the barrier.
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(row_tiles, items / (8 * omp_get_max_threads())));
  #pragma omp parallel for schedule(dynamic, chunk)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t g = item / row_tiles, t = item % row_tiles;
    const int64_t b0 = g * GEMM_NB, m0 = t * GEMM_MR;
    const int nbk = int(std::min<int64_t>(GEMM_NB, nb - b0)), mr = int(std::min<int64_t>(GEMM_MR, M - m0));
    gemm_fns[nbk][mr](x + m0 * xs, xs, w + b0 * K2 * 16, K2, y + m0 * ys + b0 * 16, ys, N - b0 * 16);
  }
#endif
}
}
