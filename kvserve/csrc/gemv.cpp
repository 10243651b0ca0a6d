// bf16 matmul y[M, N] = x[M, K] @ W[N, K]^T of every linear layer on the CPU, on W repacked once into the order
// the loops stream it:
//   Wp[n / 16][k / 2][n % 16] = the bf16 pair (W[n][k], W[n][k + 1]) as one dword,
// so every vdpbf16ps multiplies one 64-byte line of Wp (16 outputs x 2 inputs) by a broadcast pair of x.
// Up to GEMV_MAX_ROWS rows a step is bound by reading W: the GEMV streams it once with every row in registers.
// More rows are compute-bound: register tiles of GEMM_MR rows x GEMM_NB column blocks (see gemm_tile), which
// match or beat oneDNN at every size measured (benchmarks/matmul.py; the runs are in benchmarks/LOG.md).
// Without AVX-512 BF16 (AVX2, and AVX-512 CPUs without it) the same packed W is widened to float32 in registers
// (see below); there an fp16 W in the same layout is widened too (F16C), for fp16 checkpoints kept exact.
#include "common.h"

namespace {

#ifndef GEMV_MAX_ROWS
#define GEMV_MAX_ROWS 8      // the GEMV and the tiles are even at 6-8 rows; the tiles win from 10
#endif
static_assert(GEMV_MAX_ROWS >= 1 && GEMV_MAX_ROWS <= 8, "kvserve_packed_matmul_bf16 dispatches 1-8 rows to the GEMV");

#if defined(KV_HAVE_AVX512) && defined(__AVX512BF16__)
#define KV_HAVE_GEMV 1

// outputs [16 nb, 16 nb + 16) of the M rows; K2 = K / 2 pairs. P partial sums per row keep at least ~6
// independent vdpbf16ps chains in flight. No software prefetch: the hardware streamer does better on these
// sequential reads (benchmarks/LOG.md).
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
// GEMV above needs one broadcast per vdpbf16ps); faster than oneDNN on these shapes (benchmarks/matmul.py).
// Same packed W; fp32 sums rounded once to bf16.
template <int MR, int NB, bool PF>
void gemm_tile(const uint16_t* x, int64_t xs, const int32_t* w, int64_t K2, uint16_t* y, int64_t ys, int64_t left,
               const char* pf, int64_t pf_lines) {
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const int32_t* xd[MR];
  for (int m = 0; m < MR; ++m) xd[m] = reinterpret_cast<const int32_t*>(x + m * xs);
  const int64_t bstride = K2 * 16;
  // pf: pf_lines 64-byte lines to bring into L2 for the next unit, q per k step, while this tile computes
  const int64_t q = (pf_lines + K2 - 1) / K2;
  for (int64_t k = 0; k < K2; ++k) {
    if (PF)
      for (int64_t i = k * q; i < std::min(pf_lines, k * q + q); ++i) _mm_prefetch(pf + 64 * i, _MM_HINT_T1);
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
// Up to this many row tiles per group (48 rows) the next group's slice is prefetched: the first tile of a group
// would otherwise wait on DRAM for most of its time. With more tiles that wait is amortized and the prefetches
// cost more than they save (benchmarks/LOG.md).
constexpr int64_t GEMM_PREFETCH_TILES = 8;
using GemmFn = void (*)(const uint16_t*, int64_t, const int32_t*, int64_t, uint16_t*, int64_t, int64_t, const char*,
                       int64_t);
template <int NB, bool PF>
constexpr GemmFn gemm_row_fns[GEMM_MR + 1] = {nullptr, gemm_tile<1, NB, PF>, gemm_tile<2, NB, PF>,
                                              gemm_tile<3, NB, PF>, gemm_tile<4, NB, PF>, gemm_tile<5, NB, PF>,
                                              gemm_tile<6, NB, PF>};
// [prefetching][column blocks][rows]
const GemmFn* const gemm_fns[2][GEMM_NB + 1] = {
    {nullptr, gemm_row_fns<1, false>, gemm_row_fns<2, false>, gemm_row_fns<3, false>, gemm_row_fns<4, false>},
    {nullptr, gemm_row_fns<1, true>, gemm_row_fns<2, true>, gemm_row_fns<3, true>, gemm_row_fns<4, true>}};
#elif defined(KV_HAVE_AVX2)
#define KV_HAVE_GEMV 2
// loops over the register arrays unrolled whole: a loop left rolled makes GCC keep the accumulators in memory
#define KV_UNROLL _Pragma("GCC unroll 16")
// AVX2, and AVX-512 without BF16: the same packed W, each pair widened to two float32 vectors in registers (a bf16
// is the top half of its float32: the low dword half shifted up, the high half masked), FMAs in float32. The GEMV
// is bound by reading W and runs on 8 lanes everywhere; the GEMM's tiles take 16 lanes where the CPU has AVX-512
// (one vector a panel row), with every column's sum the same chain of FMAs as on 8 lanes: both builds give the same
// bits.

#ifdef __F16C__
#define KV_HAVE_F16_GEMV 1
#endif

// the k and k + 1 floats of 8 columns from their 8 packed pairs: bf16 (F16 false), or fp16 converted by F16C
template <bool F16>
KV_ALWAYS_INLINE void widen_pairs(const int32_t* p, __m256& even, __m256& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
#ifdef KV_HAVE_F16_GEMV
  if constexpr (F16) {   // kvserve_gemv_pack_f16's order: the 8 columns' k values, then their k + 1 values
    fp16_halves(v, even, odd);
    return;
  }
#endif
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xffff0000u))));
}

// rows [0, M) of x as float32, K each, in a buffer of the calling thread
inline const float* widen_rows(const uint16_t* x, int64_t xs, int64_t M, int64_t K) {
  static thread_local std::vector<float> buf;
  if (int64_t(buf.size()) < M * K) buf.resize(M * K);
  float* out = buf.data();   // (inside the parallel loop `buf` would name each thread's own)
  #pragma omp parallel for if (M * K >= 65536)
  for (int64_t m = 0; m < M; ++m) {
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) _mm256_storeu_ps(out + m * K + k, load8(x + m * xs + k));
    for (; k < K; ++k) out[m * K + k] = bf16_to_f32(x[m * xs + k]);
  }
  return out;
}

// store 8 float sums of columns [c, c + 8) of one row as bf16 (nearest even), `left` of them inside the matrix
KV_ALWAYS_INLINE void store_cols(uint16_t* y, __m256 v, int64_t left) {
  if (left >= 8) {
    store8(y, v);
    return;
  }
  alignas(32) uint16_t tmp[8];
  store8(tmp, v);
  for (int64_t i = 0; i < left; ++i) y[i] = tmp[i];
}

// GEMV: columns of H halves (8 each) of one 16-column block from half h0, M rows of xf (K floats each); P
// independent sums per row and half, each of the pair's two products on its own, keep 4+ FMA chains in flight
template <int M, int H, int P, bool F16>
inline void gemv_block(const float* xf, int64_t K, const int32_t* w, int64_t K2, int h0, __m256* out) {
  __m256 acc[M][H][P][2];
  KV_UNROLL for (int m = 0; m < M; ++m)
    KV_UNROLL for (int h = 0; h < H; ++h)
      KV_UNROLL for (int u = 0; u < P; ++u) acc[m][h][u][0] = acc[m][h][u][1] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + P <= K2; k += P)
    KV_UNROLL for (int u = 0; u < P; ++u)
      KV_UNROLL for (int h = 0; h < H; ++h) {
        __m256 we, wo;
        widen_pairs<F16>(w + (k + u) * 16 + (h0 + h) * 8, we, wo);
        KV_UNROLL for (int m = 0; m < M; ++m) {
          const float* xr = xf + m * K + 2 * (k + u);
          acc[m][h][u][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(xr), we, acc[m][h][u][0]);
          acc[m][h][u][1] = _mm256_fmadd_ps(_mm256_broadcast_ss(xr + 1), wo, acc[m][h][u][1]);
        }
      }
  for (; k < K2; ++k)
    KV_UNROLL for (int h = 0; h < H; ++h) {
      __m256 we, wo;
      widen_pairs<F16>(w + k * 16 + (h0 + h) * 8, we, wo);
      KV_UNROLL for (int m = 0; m < M; ++m) {
        const float* xr = xf + m * K + 2 * k;
        acc[m][h][0][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(xr), we, acc[m][h][0][0]);
        acc[m][h][0][1] = _mm256_fmadd_ps(_mm256_broadcast_ss(xr + 1), wo, acc[m][h][0][1]);
      }
    }
  KV_UNROLL for (int m = 0; m < M; ++m)
    KV_UNROLL for (int h = 0; h < H; ++h) {
      __m256 s = _mm256_add_ps(acc[m][h][0][0], acc[m][h][0][1]);
      KV_UNROLL for (int u = 1; u < P; ++u)
        s = _mm256_add_ps(s, _mm256_add_ps(acc[m][h][u][0], acc[m][h][u][1]));
      out[m * H + h] = s;
    }
}

template <int M, int H, int P, bool F16>
void gemv_rows(const uint16_t* x, int64_t xs, const int32_t* wp, uint16_t* y, int64_t ys, int64_t N, int64_t K) {
  const int64_t K2 = K / 2, nb = (N + 15) / 16;
  const float* xf = widen_rows(x, xs, M, K);
  #pragma omp parallel for schedule(static) if (nb * K2 >= 4096)
  for (int64_t b = 0; b < nb; ++b)
    for (int h0 = 0; h0 < 2; h0 += H) {   // H = 1: the block's second half read again from L1/L2
      __m256 out[M * H];
      gemv_block<M, H, P, F16>(xf, K, wp + b * K2 * 16, K2, h0, out);
      KV_UNROLL for (int m = 0; m < M; ++m)
        KV_UNROLL for (int h = 0; h < H; ++h) {
          const int64_t c = b * 16 + (h0 + h) * 8;
          if (c < N) store_cols(y + m * ys + c, out[m * H + h], N - c);
        }
    }
}

#ifdef KV_HAVE_AVX512
constexpr int GEMM_MR = 12;   // each panel row loaded feeds 12 FMAs; 12 + 2 of the 32 vector registers
// the 16-lane tiles read x widened and packed per tile, k-major (see widen_tile): each k step's 12 broadcasts come
// from one line, not from a line of each row (tiles of 12 rows reading rows run well below oneDNN's float32 GEMM;
// packed, about as fast); the 8-lane tiles of 6 rows gain nothing from it
constexpr bool PACK_X = true;
#else
constexpr int GEMM_MR = 6;
constexpr bool PACK_X = false;
#endif

// row m, column k of a tile of x widened to float32: packed k-major or row-major (widen_tile)
KV_ALWAYS_INLINE const float& x_at(const float* x, int64_t K, int64_t k, int m) {
  return PACK_X ? x[k * GEMM_MR + m] : x[m * K + k];
}

// step k of a tile's loop brings lines [k q, k q + q) of the pf_lines at pf into L2: spread over the loop, not in
// one burst before it
KV_ALWAYS_INLINE void prefetch_step(const char* pf, int64_t pf_lines, int64_t k, int64_t q) {
  for (int64_t i = k * q; i < std::min(pf_lines, k * q + q); ++i) _mm_prefetch(pf + 64 * i, _MM_HINT_T1);
}

#ifdef KV_HAVE_AVX512
// GEMM tile: MR rows x 16 columns from a widened float32 panel [K][16], MR accumulators of 16 lanes; pf_lines
// 64-byte lines from pf brought into L2 along the way (prefetch_step)
template <int MR>
void gemm_tile(const float* xt, int64_t K, const float* panel, uint16_t* y, int64_t ys, int64_t left, const char* pf,
               int64_t pf_lines) {
  __m512 acc[MR];
  KV_UNROLL for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t q = (pf_lines + K - 1) / K;
  for (int64_t k = 0; k < K; ++k) {
    prefetch_step(pf, pf_lines, k, q);
    const __m512 w = _mm512_load_ps(panel + k * 16);
    KV_UNROLL for (int m = 0; m < MR; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x_at(xt, K, k, m)), w, acc[m]);
  }
  KV_UNROLL for (int m = 0; m < MR; ++m) {
    store_cols(y + m * ys, _mm512_castps512_ps256(acc[m]), left);
    if (left > 8)   // (the upper half through AVX-512F alone: extractf32x8 needs DQ)
      store_cols(y + m * ys + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[m]), 1)), left - 8);
  }
}
#else
// GEMM tile: MR rows x 16 columns from a widened float32 panel [K][16], 2 MR accumulators; pf_lines 64-byte lines
// from pf brought into L2 along the way (prefetch_step)
template <int MR>
void gemm_tile(const float* xt, int64_t K, const float* panel, uint16_t* y, int64_t ys, int64_t left, const char* pf,
               int64_t pf_lines) {
  __m256 acc[MR][2];
  KV_UNROLL for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const int64_t q = (pf_lines + K - 1) / K;
  for (int64_t k = 0; k < K; ++k) {
    prefetch_step(pf, pf_lines, k, q);
    const __m256 w0 = _mm256_load_ps(panel + k * 16), w1 = _mm256_load_ps(panel + k * 16 + 8);
    KV_UNROLL for (int m = 0; m < MR; ++m) {
      const __m256 xb = _mm256_broadcast_ss(&x_at(xt, K, k, m));
      acc[m][0] = _mm256_fmadd_ps(xb, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(xb, w1, acc[m][1]);
    }
  }
  KV_UNROLL for (int m = 0; m < MR; ++m) {
    store_cols(y + m * ys, acc[m][0], left);
    if (left > 8) store_cols(y + m * ys + 8, acc[m][1], left - 8);
  }
}
#endif

// rows [0, rows) of x (one tile's) widened to float32 as the tiles read them (x_at): k-major, dst[k][r] =
// x[r][k], or row-major
inline void widen_tile(const uint16_t* x, int64_t xs, int64_t rows, int64_t K, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* src = x + r * xs;
    if (!PACK_X) {
      int64_t k = 0;
      for (; k + 8 <= K; k += 8) _mm256_storeu_ps(dst + r * K + k, load8(src + k));
      for (; k < K; ++k) dst[r * K + k] = bf16_to_f32(src[k]);
      continue;
    }
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      alignas(32) float v[8];
      _mm256_store_ps(v, load8(src + k));
      for (int j = 0; j < 8; ++j) dst[(k + j) * GEMM_MR + r] = v[j];
    }
    for (; k < K; ++k) dst[k * GEMM_MR + r] = bf16_to_f32(src[k]);
  }
}

// rows of x widened to float32 at a time: each 16-column block's panel is widened once per chunk
constexpr int64_t GEMM_CHUNK_ROWS = 96;
static_assert(GEMM_CHUNK_ROWS % GEMM_MR == 0, "a chunk is whole tiles but its last");
using TileFn = void (*)(const float*, int64_t, const float*, uint16_t*, int64_t, int64_t, const char*, int64_t);
template <int... R>
constexpr std::array<TileFn, sizeof...(R) + 1> tile_table(std::integer_sequence<int, R...>) {
  return {nullptr, gemm_tile<R + 1>...};
}
constexpr auto gemm_tiles = tile_table(std::make_integer_sequence<int, GEMM_MR>{});

// the block's pairs of W (K2 of them, 16 columns) as its float32 panel [K][16]
template <bool F16>
inline void widen_panel(const int32_t* w, int64_t K2, float* panel) {
  for (int64_t k = 0; k < K2; ++k) {
    __m256 e0, o0, e1, o1;
    widen_pairs<F16>(w + k * 16, e0, o0);
    widen_pairs<F16>(w + k * 16 + 8, e1, o1);
    _mm256_store_ps(panel + 32 * k, e0);
    _mm256_store_ps(panel + 32 * k + 8, e1);
    _mm256_store_ps(panel + 32 * k + 16, o0);
    _mm256_store_ps(panel + 32 * k + 24, o1);
  }
}

// Per chunk of rows, the threads widen the chunk's tiles of x, then each claims 16-column blocks one at a time: it
// widens the block's panel, then runs the chunk's tiles over it. A block's W comes from DRAM once per chunk; the
// thread claims its next block before it starts the tiles and prefetches that block's W into L2, a slice during each
// tile, so the next panel's reads do not stall on DRAM. Dynamic claims: a thread the OS preempts leaves its blocks
// to the others. Every tile computes the same sums whichever thread runs it.
template <bool F16>
void gemm_rows(const uint16_t* x, int64_t xs, const int32_t* wp, uint16_t* y, int64_t ys, int64_t M, int64_t N,
               int64_t K) {
  const int64_t K2 = K / 2, nb = (N + 15) / 16, block_lines = K2;   // a block's pairs: K2 lines of 64 bytes
  static thread_local std::vector<float> x_buf;   // the calling thread's: every thread reads it
  if (int64_t(x_buf.size()) < GEMM_CHUNK_ROWS * K) x_buf.resize(GEMM_CHUNK_ROWS * K);
  float* xt = x_buf.data();
  for (int64_t c0 = 0; c0 < M; c0 += GEMM_CHUNK_ROWS) {
    const int64_t mc = std::min(GEMM_CHUNK_ROWS, M - c0), tiles = (mc + GEMM_MR - 1) / GEMM_MR;
    const int64_t per_tile = (block_lines + tiles - 1) / tiles;
    std::atomic<int64_t> counter{0};
    #pragma omp parallel
    {
      #pragma omp for schedule(static)
      for (int64_t t = 0; t < tiles; ++t)
        widen_tile(x + (c0 + t * GEMM_MR) * xs, xs, std::min<int64_t>(GEMM_MR, mc - t * GEMM_MR), K,
                   xt + t * GEMM_MR * K);
      static thread_local std::vector<float> panel_buf;
      if (int64_t(panel_buf.size()) < 16 * K + 16) panel_buf.resize(16 * K + 16);
      float* panel = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(panel_buf.data()) + 63) & ~uintptr_t(63));
      int64_t b = counter.fetch_add(1, std::memory_order_relaxed);
      while (b < nb) {
        const int64_t next = counter.fetch_add(1, std::memory_order_relaxed);
        const char* pf = next < nb ? reinterpret_cast<const char*>(wp + next * K2 * 16) : nullptr;
        widen_panel<F16>(wp + b * K2 * 16, K2, panel);
        for (int64_t t = 0; t < tiles; ++t) {   // tile t prefetches its slice of the next block
          const int64_t m0 = t * GEMM_MR, done = t * per_tile;
          const int mr = int(std::min<int64_t>(GEMM_MR, mc - m0));
          const int64_t lines = pf ? std::max<int64_t>(0, std::min(per_tile, block_lines - done)) : 0;
          gemm_tiles[mr](xt + m0 * K, K, panel, y + (c0 + m0) * ys + b * 16, ys, N - b * 16,
                         lines ? pf + 64 * done : nullptr, lines);
        }
        b = next;
      }
    }
  }
}
#endif

#if KV_HAVE_GEMV == 2
template <bool F16>
void widened_matmul(const uint16_t* x, int64_t xs, const uint16_t* wp, uint16_t* y, int64_t ys, int64_t M, int64_t N,
                    int64_t K) {
  const int32_t* w = reinterpret_cast<const int32_t*>(wp);
  switch (M) {   // registers: M rows x H halves x P partial sums x 2 (the pair's products) accumulators
    case 1: gemv_rows<1, 2, 2, F16>(x, xs, w, y, ys, N, K); return;
    case 2: gemv_rows<2, 2, 1, F16>(x, xs, w, y, ys, N, K); return;
    case 3: gemv_rows<3, 1, 1, F16>(x, xs, w, y, ys, N, K); return;
    case 4: gemv_rows<4, 1, 1, F16>(x, xs, w, y, ys, N, K); return;
    default: gemm_rows<F16>(x, xs, w, y, ys, M, N, K); return;
  }
}
#endif

// W [N, K] into the packed layout: 32 bytes per 8 columns and pair of inputs (k, k + 1), as (k, k + 1) pairs per
// column, or `split`: the 8 columns' k values, then their k + 1 values
void pack_pairs(const uint16_t* w, int64_t N, int64_t K, uint16_t* wp, bool split) {
  const int64_t K2 = K / 2, nb = (N + 15) / 16, second = split ? 8 : 1;
  #pragma omp parallel for
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t k = 0; k < K2; ++k)
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t n = b * 16 + j;
        uint16_t* dst = wp + (b * K2 + k) * 32 + (split ? (j / 8) * 16 + j % 8 : 2 * j);
        dst[0] = n < N ? w[n * K + 2 * k] : 0;
        dst[second] = n < N ? w[n * K + 2 * k + 1] : 0;
      }
}

}  // namespace

extern "C" {
// 1 when kvserve_packed_matmul_f16 is built: the widening matmuls (AVX2, AVX-512 without BF16) with F16C
int kvserve_has_packed_matmul_f16() {
#if KV_HAVE_GEMV == 2 && defined(KV_HAVE_F16_GEMV)
  return 1;
#else
  return 0;
#endif
}
// y[M, N] = x[M, K] @ W^T for W fp16 packed by kvserve_gemv_pack_f16 (x and y bf16): each fp16 weight
// widened to float32 exactly, the same FMAs as kvserve_packed_matmul_bf16's on those floats. Only where
// kvserve_has_packed_matmul_f16.
void kvserve_packed_matmul_f16(const uint16_t* x, int64_t xs, const uint16_t* wp, uint16_t* y, int64_t ys, int64_t M,
                               int64_t N, int64_t K) {
#if KV_HAVE_GEMV == 2 && defined(KV_HAVE_F16_GEMV)
  widened_matmul<true>(x, xs, wp, y, ys, M, N, K);
#else
  (void)x, (void)xs, (void)wp, (void)y, (void)ys, (void)M, (void)N, (void)K;
#endif
}
// 1 when kvserve_packed_matmul_bf16 is built (AVX-512 BF16, or AVX2 / AVX-512 widening the bf16 weights)
int kvserve_has_packed_matmul() {
#ifdef KV_HAVE_GEMV
  return 1;
#else
  return 0;
#endif
}
// which kvserve_packed_matmul_bf16 is built: 0 none, 1 AVX-512 BF16 (vdpbf16ps), 2 bf16 widened to float32 (AVX2,
// or AVX-512 without BF16)
int kvserve_packed_matmul_kind() {
#ifdef KV_HAVE_GEMV
  return KV_HAVE_GEMV;
#else
  return 0;
#endif
}
// Wp (see above) from W [N, K] bf16 row-major; Wp holds ceil(N / 16) * 16 * K bf16, padding rows are zero
void kvserve_gemv_pack(const uint16_t* w, int64_t N, int64_t K, uint16_t* wp) { pack_pairs(w, N, K, wp, false); }
// Wp for kvserve_packed_matmul_f16 from W [N, K] fp16: the same 32 bytes per 8 columns and pair of inputs as
// kvserve_gemv_pack's, ordered (W[n][k] for the 8 columns, then W[n][k + 1]) so that F16C widens each half whole
void kvserve_gemv_pack_f16(const uint16_t* w, int64_t N, int64_t K, uint16_t* wp) { pack_pairs(w, N, K, wp, true); }
// y[M, N] = x[M, K] @ W^T; rows of x and y may be strided (xs, ys elements); K even; any M
void kvserve_packed_matmul_bf16(const uint16_t* x, int64_t xs, const uint16_t* wp, uint16_t* y, int64_t ys, int64_t M,
                           int64_t N, int64_t K) {
#if KV_HAVE_GEMV == 2
  widened_matmul<false>(x, xs, wp, y, ys, M, N, K);
#elif defined(KV_HAVE_GEMV)
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
  const int64_t groups = (nb + GEMM_NB - 1) / GEMM_NB, R = (M + GEMM_MR - 1) / GEMM_MR;
  // Work units, column-group-major: the row tiles of one group of GEMM_NB 16-column blocks reuse its slice of W
  // from L2. Units are whole groups except the last 2 groups per thread, which are split into single tiles so
  // the threads finish together. Each thread claims its next unit before it starts the current one: with few
  // row tiles (GEMM_PREFETCH_TILES), that unit's slice is prefetched over the current unit's k loops. The claims
  // are dynamic, so when another process preempts one thread (the HTTP frontend shares the cores) the others
  // take over its units instead of waiting for it at the barrier. Every tile computes the same sums whichever
  // thread runs it, so the result does not depend on the schedule.
  const int64_t tail = std::min<int64_t>(groups, 2 * omp_get_max_threads()), head = groups - tail;
  const int64_t units = head + tail * R;
  // a tile of 1-2 rows runs far below the peak: 13 rows run as 6 + 4 + 3, not 6 + 6 + 1
  const bool short_last = R >= 2 && (M % GEMM_MR == 1 || M % GEMM_MR == 2);
  std::atomic<int64_t> counter{0};
  auto unit_range = [&](int64_t u, int64_t& g, int64_t& t0, int64_t& t1) {
    if (u < head) { g = u; t0 = 0; t1 = R; return; }
    g = head + (u - head) / R; t0 = (u - head) % R; t1 = t0 + 1;
  };
  #pragma omp parallel
  {
    int64_t u = counter.fetch_add(1, std::memory_order_relaxed);
    while (u < units) {
      const int64_t next = counter.fetch_add(1, std::memory_order_relaxed);
      int64_t g, t0, t1, ng = -1, n0, n1;
      unit_range(u, g, t0, t1);
      if (next < units) unit_range(next, ng, n0, n1);
      const int64_t b0 = g * GEMM_NB;
      const int nbk = int(std::min<int64_t>(GEMM_NB, nb - b0));
      // the next unit's slice when it is another group's (the last group may have fewer than GEMM_NB blocks)
      const bool fetch = ng > g && R <= GEMM_PREFETCH_TILES;
      const char* pf = fetch ? reinterpret_cast<const char*>(w + ng * GEMM_NB * K2 * 16) : nullptr;
      const int64_t pf_lines = fetch ? std::min<int64_t>(GEMM_NB, nb - ng * GEMM_NB) * K2 : 0;
      const int64_t per_tile = (pf_lines + (t1 - t0) - 1) / (t1 - t0);
      for (int64_t t = t0; t < t1; ++t) {
        int64_t m0 = t * GEMM_MR, mr = std::min<int64_t>(GEMM_MR, M - m0);
        if (short_last && t >= R - 2) {   // the last 6 + 1 or 6 + 2 rows as 4 + 3 or 4 + 4
          m0 = (R - 2) * GEMM_MR + (t == R - 1 ? 4 : 0);
          mr = t == R - 2 ? 4 : M % GEMM_MR + 2;
        }
        const int64_t done = (t - t0) * per_tile;
        const int64_t lines = std::max<int64_t>(0, std::min(per_tile, pf_lines - done));
        gemm_fns[lines > 0][nbk][int(mr)](x + m0 * xs, xs, w + b0 * K2 * 16, K2, y + m0 * ys + b0 * 16, ys,
                                     N - b0 * 16, lines > 0 ? pf + 64 * done : nullptr, lines);
      }
      u = next;
    }
  }
#endif
}
}
