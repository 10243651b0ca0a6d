// int8 W8A8 (--quantization int8): weights int8 with one float scale per output row (per channel), activations int8
// with one float scale per row of x and group of IG values (IG = i8_act_group(K): 128 where K allows; one scale
// per whole row cost several times the perplexity, docs/quantization.md), quantized as they arrive. Each
// group's products are exact int32 sums, added up in float in a fixed order:
//   y[m][n] = sw[n] * sum_g dx[m][g] * sum_(k in g) qx[m][k] qw[n][k],
// so every path (AVX-512 VNNI, AVX2, scalar) and every row tile gives the same bits (fused multiply-adds all).
// The weights are packed in groups of 16 rows (INT8_GROUP), each group:
//   K / 4 lines of 64 bytes, line j = the 16 rows' values k = 4 j .. 4 j + 3 (row by row within the line),
//   then the 16 rows' float32 scales sw, then per activation group g the rows' int32 sums of qw over g,
// so that vpdpbusd multiplies one line by four broadcast values of x: 16 outputs x 4 inputs per instruction.
// That takes x unsigned: the VNNI path stores qx + 128 and takes 128 sum_(k in g) qw[n][k] back out. AVX2 has no
// 4-way dot product without saturation for such pairs; it multiplies |qw| by qx with qw's sign (vpsignb,
// vpmaddubsw), whose pair sums stay below 2^15 since |q| <= 127 on both sides.
#include "common.h"

#pragma GCC push_options
#pragma GCC optimize("no-associative-math")

namespace {

constexpr int INT8_GROUP = 16;
#if defined(__AVX512VNNI__) && defined(KV_HAVE_AVX512)
#define KV_HAVE_I8_VNNI 1
constexpr int I8_BIAS = 128;   // x is stored as qx + 128 (unsigned for vpdpbusd)
constexpr int I8_MR = 6, I8_NB = 2;   // row tile: rows of x x groups of 16 weight rows (12 + 12 accumulators)
#else
constexpr int I8_BIAS = 0;
constexpr int I8_MR = 4, I8_NB = 1;   // AVX2: 8 int32 accumulators in its 16 registers (8 float ones beside)
#endif

// values per activation scale: 128, or the largest of 64 and 32 that divides K (kvserve/model/quantization.py's
// int8_act_group)
inline int64_t i8_act_group(int64_t K) { return K % 128 == 0 ? 128 : K % 64 == 0 ? 64 : 32; }
inline int64_t i8_group_bytes(int64_t K) { return INT8_GROUP * (K + 4 + 4 * (K / i8_act_group(K))); }
// where row i (0..15) of a group keeps its value k: line k / 4, lane i, byte k % 4
inline int64_t i8_offset(int i, int64_t k) { return 16 * (k & ~int64_t(3)) + 4 * i + (k & 3); }

// x rows [M, K] (float32 or bf16, row stride xs) -> q [M, K] (qx + I8_BIAS) and d [M, K / IG]: x ~= d qx per IG
// values, qx in -127..127
template <typename X>
void i8_quantize_rows(const X* x, int64_t xs, int64_t M, int64_t K, uint8_t* q, float* d) {
  const int64_t IG = i8_act_group(K), ng = K / IG;
  #pragma omp parallel for if (M * K >= 65536)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ng; ++g) {
      float v[128];   // IG values
      const float amax = load_amax(x + m * xs + g * IG, int(IG), v);
      const float id = inv_scale(amax);
      d[m * ng + g] = amax * (1.f / 127.f);   // what -ffast-math makes of amax / 127 anyway, written out
      uint8_t* o = q + m * K + g * IG;
      for (int64_t k = 0; k < IG; ++k) o[k] = uint8_t(int(__builtin_rintf(clamp127(v[k] * id))) + I8_BIAS);
    }
}

// acc[r][16 j + i] = sum_g dx[r][g] * sum_(k in g) qx[r][k] qw[16 j + i][k] for R rows of x (x[r], their scales
// dx[r]) and NB groups of 16 weight rows
template <int R, int NB>
inline void i8_tile(const uint8_t* w, int64_t gbytes, const uint8_t* const* x, const float* const* dx, int64_t K,
                    float (*acc)[16 * I8_NB]) {
  const int64_t IG = i8_act_group(K);
#if defined(KV_HAVE_I8_VNNI)
  const uint8_t* wsum = w + INT8_GROUP * (K + 4);   // the first weight group's sums per activation group
  __m512 f[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) f[r][j] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += IG) {
    __m512i a[R][NB];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j) a[r][j] = _mm512_setzero_si512();
    for (int64_t k = k0; k < k0 + IG; k += 4) {
      __m512i wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(w + j * gbytes + 16 * k);
      for (int r = 0; r < R; ++r) {
        int32_t xk;
        std::memcpy(&xk, x[r] + k, 4);
        const __m512i xb = _mm512_set1_epi32(xk);
        for (int j = 0; j < NB; ++j) a[r][j] = _mm512_dpbusd_epi32(a[r][j], xb, wv[j]);
      }
    }
    const int64_t g = k0 / IG;
    for (int j = 0; j < NB; ++j) {
      const __m512i bias = _mm512_slli_epi32(_mm512_loadu_si512(wsum + j * gbytes + 64 * g), 7);   // 128 sums
      for (int r = 0; r < R; ++r)
        f[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a[r][j], bias)), _mm512_set1_ps(dx[r][g]),
                                  f[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(acc[r] + 16 * j, f[r][j]);
#elif defined(KV_HAVE_QAVX2)
  static_assert(NB == 1, "the AVX2 tile takes one group");
  __m256 f[R][2];
  for (int r = 0; r < R; ++r) f[r][0] = f[r][1] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t k0 = 0; k0 < K; k0 += IG) {
    __m256i a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_si256();
    for (int64_t k = k0; k < k0 + IG; k += 4) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * k));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * k + 32));
      const __m256i u0 = _mm256_sign_epi8(w0, w0), u1 = _mm256_sign_epi8(w1, w1);
      for (int r = 0; r < R; ++r) {
        int32_t xk;
        std::memcpy(&xk, x[r] + k, 4);
        const __m256i xb = _mm256_set1_epi32(xk);
        const __m256i p0 = _mm256_maddubs_epi16(u0, _mm256_sign_epi8(xb, w0));
        const __m256i p1 = _mm256_maddubs_epi16(u1, _mm256_sign_epi8(xb, w1));
        a[r][0] = _mm256_add_epi32(a[r][0], _mm256_madd_epi16(p0, ones));
        a[r][1] = _mm256_add_epi32(a[r][1], _mm256_madd_epi16(p1, ones));
      }
    }
    const int64_t g = k0 / IG;
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h)
        f[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][h]), _mm256_set1_ps(dx[r][g]), f[r][h]);
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(acc[r], f[r][0]);
    _mm256_storeu_ps(acc[r] + 8, f[r][1]);
  }
#else
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j)
      for (int i = 0; i < 16; ++i) {
        const int8_t* wg = reinterpret_cast<const int8_t*>(w + j * gbytes);
        float f = 0.f;
        for (int64_t k0 = 0; k0 < K; k0 += IG) {
          int32_t s = 0;
          for (int64_t k = k0; k < k0 + IG; ++k)
            s += int32_t(int8_t(x[r][k] - I8_BIAS)) * wg[i8_offset(i, k)];
          f = std::fma(float(s), dx[r][k0 / IG], f);
        }
        acc[r][16 * j + i] = f;
      }
#endif
}

template <int R>
inline void i8_tile_groups(int nb, const uint8_t* w, int64_t gbytes, const uint8_t* const* x, const float* const* dx,
                           int64_t K, float (*acc)[16 * I8_NB]) {
  if constexpr (I8_NB > 1)
    if (nb < I8_NB) return i8_tile<R, 1>(w, gbytes, x, dx, K, acc);
  i8_tile<R, I8_NB>(w, gbytes, x, dx, K, acc);
}

template <int R = I8_MR>
void i8_tile_rows(int rows, int nb, const uint8_t* w, int64_t gbytes, const uint8_t* const* x, const float* const* dx,
                  int64_t K, float (*acc)[16 * I8_NB]) {
  if constexpr (R > 1)
    if (rows < R) return i8_tile_rows<R - 1>(rows, nb, w, gbytes, x, dx, K, acc);
  i8_tile_groups<R>(nb, w, gbytes, x, dx, K, acc);
}

// y[M, N] = x @ W^T on N / 16 packed groups (x quantized: xq, dx): each thread takes units of I8_NB groups (read
// from memory once per call) and runs every row tile of x over them
template <typename Y>
void i8_matmul(const uint8_t* w, int64_t N, const uint8_t* xq, const float* dx, int64_t M, int64_t K, Y* y,
               int64_t ys) {
  const int64_t groups = N / INT8_GROUP, gbytes = i8_group_bytes(K), ng = K / i8_act_group(K);
  const int64_t units = (groups + I8_NB - 1) / I8_NB;
  #pragma omp parallel for schedule(static) if (N * K * M >= 65536)
  for (int64_t u = 0; u < units; ++u) {
    const int64_t g0 = u * I8_NB;
    const int nb = int(std::min<int64_t>(I8_NB, groups - g0));
    const uint8_t* wg = w + g0 * gbytes;
    const uint8_t* xr[I8_MR];
    const float* dr[I8_MR];
    float acc[I8_MR][16 * I8_NB];
    for (int64_t m = 0; m < M; m += I8_MR) {
      const int rows = int(std::min<int64_t>(I8_MR, M - m));
      for (int r = 0; r < rows; ++r) {
        xr[r] = xq + (m + r) * K;
        dr[r] = dx + (m + r) * ng;
      }
      i8_tile_rows(rows, nb, wg, gbytes, xr, dr, K, acc);
      for (int j = 0; j < nb; ++j) {
        float sw[INT8_GROUP];   // copied: a segment after a Q8_0 one in the same buffer may start unaligned
        std::memcpy(sw, wg + j * gbytes + INT8_GROUP * K, sizeof(sw));
        for (int r = 0; r < rows; ++r)
          for (int i = 0; i < 16; ++i) store(y + (m + r) * ys, (g0 + j) * 16 + i, sw[i] * acc[r][16 * j + i]);
      }
    }
  }
}

// row n of a packed INT8 matrix, dequantized: out[k] = sw[n] qw[n][k]
template <typename Y>
void i8_dequant_row(const uint8_t* w, int64_t n, int64_t K, Y* out) {
  const uint8_t* g = w + (n / INT8_GROUP) * i8_group_bytes(K);
  const int i = int(n % INT8_GROUP);
  float s;
  std::memcpy(&s, g + INT8_GROUP * K + 4 * i, 4);
  for (int64_t k = 0; k < K; ++k)
    store(out, k, s * float(reinterpret_cast<const int8_t*>(g)[i8_offset(i, k)]));
}

}  // namespace

#pragma GCC pop_options
