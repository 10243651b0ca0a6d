// The quantized matmul itself (kvserve_quant_matmul), over the formats, unpacking and dot products of quant.cpp
// (with quant_avx2.cpp and quant_dispatch.cpp) and quant_k.cpp. The activations are quantized first, per row, to int8 with one float scale per 32 values for the
// 32-value formats, Q4_K and Q6_K (QX: quant.cpp's octets), per 128 for Q2_K, Q3_K, Q5_K and IQ4_XS (quant_k.cpp's
// QK: blocks of 256); INT8 segments go to quant_int8.cpp.
#include "common.h"
#if defined(__AVX2__) && !defined(KVSERVE_PORTABLE)
#include <immintrin.h>
#endif

#pragma GCC push_options
#pragma GCC optimize("no-associative-math")

namespace {

// out[r] = dot(weight row w, x row r) over the row's nblocks weight blocks, for R rows; A: the activations (QK
// for the on_qk formats, QX otherwise: octets of 8 blocks)
template <int T, int R, typename A>
inline void dot_rows(const uint8_t* w, const A* const* x, int64_t nblocks, float* out) {
  if constexpr (std::is_same_v<A, QK>) {
#ifdef KV_HAVE_QAVX2
    row_dot_k_simd<T, R>(w, x, nblocks, out);
#else
    row_dot_k_scalar<T, R>(w, x, nblocks, out);
#endif
  } else {
    row_dot<T, R>(w, x, nblocks, out);
  }
}

// x rows [M, K] (float32 or bf16, row stride xs) -> 256-value blocks [M, K / 256], one scale per 32 QKJ values
template <typename X>
void quantize_rows(const X* x, int64_t xs, int64_t M, int64_t K, QK* out) {
  constexpr int S = 32 * QKJ;   // values per scale
  const int64_t nb = K / 256;
  #pragma omp parallel for if (M * K >= 65536)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      QK& o = out[m * nb + b];
      for (int s0 = 0; s0 < 256; s0 += S) {
        const X* p = x + m * xs + 256 * b + s0;
        float v[S];
        const float amax = load_amax(p, S, v);
        const float id = inv_scale(amax), d = amax / 127.f;
        for (int g = 0; g < S / 16; ++g) {
          int sum = 0;
          for (int i = 16 * g; i < 16 * g + 16; ++i) {
            const int q = int(__builtin_rintf(clamp127(v[i] * id)));   // to nearest even, as nearbyint
            o.q[s0 + i] = int8_t(q);
            sum += q;
          }
          o.sum16[(s0 + 16 * g) / 16] = int16_t(sum);
        }
        for (int j = s0 / 32; j < (s0 + S) / 32; ++j) o.dl[j] = d;
      }
    }
}

#ifdef KV_HAVE_AVX2
// 32 values at p -> their int8 bytes (to nearest even: vcvtps2dq in the default rounding mode, as rintf) in *q as
// vpacksswb leaves them: dword i holds values 4 c .. 4 c + 3 of chunk c = PACKED_CHUNK[i]. Returns the scale;
// *sum = the sum of the bytes, *half that of values 0..15.
constexpr int PACKED_CHUNK[8] = {0, 2, 4, 6, 1, 3, 5, 7};
template <typename X>
KV_ALWAYS_INLINE float quantize32_packed(const X* p, __m256i* q, int* sum, int* half) {
  __m256 v[4], amax8 = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int i = 0; i < 4; ++i) {
    v[i] = load8(p + 8 * i);
    amax8 = _mm256_max_ps(_mm256_and_ps(v[i], abs_mask), amax8);   // a NaN value is passed over, as below
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const __m256 id = _mm256_set1_ps(inv_scale(amax));
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  __m256i qi[4];
  for (int i = 0; i < 4; ++i)   // clamp127's order of operands
    qi[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[i], id), lo), hi));
  // lane 0: [a0+a1, a2+a3, b0+b1, b2+b3], lane 1: the same of 4..7, for a = values 0..15 (qi 0, 1), b = 16..31
  const __m256i h = _mm256_hadd_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
  const __m128i s2 = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  const __m128i s1 = _mm_hadd_epi32(s2, s2);   // [sum of a, sum of b, ...]
  *half = _mm_cvtsi128_si32(s1);
  *sum = *half + _mm_extract_epi32(s1, 1);
  *q = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  return amax / 127.f;
}

// rows r[0..7] of dwords -> their columns, in place
KV_ALWAYS_INLINE void transpose8_epi32(__m256i* r) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}
#else
// 32 values at p -> int8 q (to nearest even) with one scale, returned; *sum = the sum of the q
template <typename X>
inline float quantize32(const X* p, int8_t* q, int* sum) {
  float v[32];
  const float amax = load_amax(p, 32, v);
  const float id = inv_scale(amax);
  *sum = 0;
  for (int i = 0; i < 32; ++i) {
    const int qi = int(__builtin_rintf(clamp127(v[i] * id)));
    q[i] = int8_t(qi);
    *sum += qi;
  }
  return amax / 127.f;
}
#endif

// x rows [M, K] -> octets of 32-value blocks [M, ceil(K / 256)], one scale per 32 values (QX: chunk-major, zero
// past the row's end: value i of block b at q[i / 4][4 b + i % 4])
template <typename X>
void quantize_rows(const X* x, int64_t xs, int64_t M, int64_t K, QX* out) {
  const int64_t nb = K / 32, no = (nb + QXB - 1) / QXB;
  #pragma omp parallel for if (M * K >= 65536)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t o = 0; o < no; ++o) {
      QX& ox = out[m * no + o];
#ifdef KV_HAVE_AVX2
      __m256i r[QXB];   // block b's bytes, then (transposed) chunk PACKED_CHUNK[i] of every block
#endif
      for (int b = 0; b < QXB; ++b) {
        const int64_t j = o * QXB + b;
        int sum = 0, half = 0;
        float d = 0.f;
#ifdef KV_HAVE_AVX2
        r[b] = _mm256_setzero_si256();
        if (j < nb) d = quantize32_packed(x + m * xs + 32 * j, &r[b], &sum, &half);
#else
        int8_t q[32] = {};
        if (j < nb) d = quantize32(x + m * xs + 32 * j, q, &sum);
        for (int c = 0; c < 8; ++c) std::memcpy(&ox.q[c][4 * b], q + 4 * c, 4);
        for (int i = 0; i < 16; ++i) half += q[i];
#endif
        ox.d[b] = d;
        ox.sum[b] = d * float(sum);
        ox.halves[2 * b] = int16_t(half);
        ox.halves[2 * b + 1] = int16_t(sum - half);
      }
#ifdef KV_HAVE_AVX2
      transpose8_epi32(r);
      for (int i = 0; i < 8; ++i) _mm256_store_si256(reinterpret_cast<__m256i*>(ox.q[PACKED_CHUNK[i]]), r[i]);
#endif
    }
}

// activation units per row of x: QK blocks of 256, QX octets of 8 blocks of 32 (the last one partial)
template <typename A> inline int64_t units_per_row(int64_t K) {
  if constexpr (std::is_same_v<A, QK>) return K / 256;
  else return (K / 32 + QXB - 1) / QXB;
}

// the activation units a format's kernel reads
template <int T> using Acts = std::conditional_t<in_octets<T>(), QX, QK>;

constexpr int64_t QNB = 16;   // weight rows per work unit: they stay in L1/L2 while every row tile of x passes

// the blocks of a row's last group that tail_dot runs across rows (1, 2 or 4 of a 32-value format's, on AVX2),
// else 0: a partial group of its own costs a whole octet's work
template <int T> inline int shared_tail(int64_t nblocks) {
#ifdef KV_HAVE_QAVX2
  const int t = int(nblocks % QXB);
  if constexpr (Format<T>::SUBS == 1) return t == 1 || t == 2 || t == 4 ? t : 0;
#endif
  return 0;
}

#ifdef KV_HAVE_QAVX2
// R rows of x go in runs of octets once their activations exceed L1_ACTS bytes, a little over half of a 32 KiB L1
// (which the weights' stream shares); a run reads RUN_BYTES of them
constexpr int64_t L1_ACTS = 18432, RUN_BYTES = 12288;
template <int R> constexpr int64_t run_octets() {
  return std::max<int64_t>(1, RUN_BYTES / (R * int64_t(sizeof(QX))));
}

// rows_over's rows that are not taken in pairs, when their R rows of x overflow L1 (a down projection of 8960
// inputs: 12 KiB a row of x, from 2 rows on): the rows go a run of run_octets at a time, every weight row
// through each run, so that the run's activations stay in L1 while the rows pass. Each (weight row, row of x) keeps
// its float lanes between runs, so its octets add in the same order and the result is the same bits as in one pass
// (octets_dot). The runs' jumps between rows defeat the hardware's prefetchers: each run prefetches, into L2, the
// same bytes QNB rows on, the next unit's, which the same thread takes next within its static share of the units
// (from a unit's first row tile, which reads it from memory; a later tile's prefetch finds it cached). A prefetch
// into L1, or 2 KiB ahead in the row, measured slower (benchmarks/LOG.md).
template <int T, int R>
void rows_in_runs(const uint8_t* w, int64_t count, int64_t row_bytes, const QX* const* xr, int64_t nblocks,
                  float (*out)[QKR]) {
  const int64_t noct = (nblocks + QXB - 1) / QXB;
  __m256 acc[QNB][R];
  for (int64_t i = 0; i < count; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t o0 = 0; o0 < noct; o0 += run_octets<R>()) {
    const int64_t o1 = std::min(noct, o0 + run_octets<R>());
    for (int64_t i = 0; i < count; ++i) {
      __m256 a[R];   // in registers over the run (else GCC steps through acc's memory: a store-to-load chain)
      for (int r = 0; r < R; ++r) a[r] = acc[i][r];
      octets_dot<T, R, true>(w + i * row_bytes, xr, nblocks, o0, o1, a, QNB * row_bytes);
      for (int r = 0; r < R; ++r) acc[i][r] = a[r];
    }
  }
  for (int64_t i = 0; i < count; ++i)
    for (int r = 0; r < R; ++r) out[i][r] = hsum8(acc[i][r]);
}
#endif

// weight rows w, w + row_bytes, ... (count of them) over their first nblocks blocks against R rows of x, into out[i]:
// rows in cache go two at a time (row_dot_pair, R split in two passes past 4) where the format and whole octets
// allow. Rows read from memory go one at a time: a pair's two interleaved streams defeat the hardware prefetchers
// (benchmarks/LOG.md). The rows not taken in pairs go in runs of octets (rows_in_runs) where their rows of x
// overflow L1.
template <int T, int R, typename A>
KV_ALWAYS_INLINE void rows_over(const uint8_t* w, int64_t count, int64_t row_bytes, const A* const* xr,
                                int64_t nblocks, float (*out)[QKR], bool cached) {
  int64_t i = 0;
#ifdef KV_HAVE_QAVX2
  const bool pairs = in_pairs<T>() && R > 1 && cached && nblocks % QXB == 0;
  if constexpr (std::is_same_v<A, QX> && R > 1) {
    if (!pairs && count <= QNB && R * ((nblocks + QXB - 1) / QXB) * int64_t(sizeof(QX)) > L1_ACTS)
      return rows_in_runs<T, R>(w, count, row_bytes, xr, nblocks, out);
  }
  if constexpr (std::is_same_v<A, QX> && in_pairs<T>()) {
    if (pairs) {
      constexpr int R1 = R <= 4 ? R : (R + 1) / 2, R2 = R - R1;
      for (; i + 1 < count; i += 2) {
        const uint8_t* wa = w + i * row_bytes;
        row_dot_pair<T, R1>(wa, wa + row_bytes, xr, nblocks / QXB, out[i], out[i + 1]);
        if constexpr (R2 > 0) row_dot_pair<T, R2>(wa, wa + row_bytes, xr + R1, nblocks / QXB, out[i] + R1,
                                                  out[i + 1] + R1);
      }
    }
  }
#endif
  for (; i < count; ++i) dot_rows<T, R>(w + i * row_bytes, xr, nblocks, out[i]);
}

// weight rows n0 .. n1 - 1 against R rows of x; tail (shared_tail): the rows' whole octets (rows_over), then the
// last groups of 8 / tail rows at a time against xt (repeat_tail's)
template <int T, int R, typename A>
void tile_rows(const uint8_t* w, int64_t n0, int64_t n1, int64_t row_bytes, const A* const* xr, int64_t nblocks,
               float (*out)[QKR], int tail, const QX* const* xt, bool cached) {
#ifdef KV_HAVE_QAVX2
  if constexpr (std::is_same_v<A, QX> && Format<T>::SUBS == 1) {
    const auto shared = [&](auto t) {
      constexpr int p = QXB / t;
      const int64_t whole = nblocks - t, at = whole / QXB * octet_bytes<T>();
      for (int64_t n = n0; n < n1; n += p) {
        const int rows = int(std::min<int64_t>(p, n1 - n));
        rows_over<T, R>(w + n * row_bytes, rows, row_bytes, xr, whole, out + (n - n0), cached);
        tail_dot<T, R, t>(w + n * row_bytes + at, row_bytes, rows, xt, out + (n - n0));
      }
    };
    switch (tail) {
      case 1: shared(std::integral_constant<int, 1>()); return;
      case 2: shared(std::integral_constant<int, 2>()); return;
      case 4: shared(std::integral_constant<int, 4>()); return;
      default: break;
    }
  }
#endif
  rows_over<T, R>(w + n0 * row_bytes, n1 - n0, row_bytes, xr, nblocks, out, cached);
}

thread_local std::vector<QX> xt_buffer;   // repeat_tail's octet of each row of x

template <int T, typename Y>
void matmul_rows(const uint8_t* w, int64_t N, int64_t row_bytes, const void* xv, int64_t M, int64_t K, Y* y,
                 int64_t ys) {
  // each thread takes units of QNB whole weight rows, read from memory once per step, and runs every row tile of
  // x over them (a tile shares each unpacked sub-block)
  using A = Acts<T>;
  constexpr bool KQ = std::is_same_v<A, QK>;
  constexpr int TILE = KQ ? QKR : QMR;
  const A* xq = static_cast<const A*>(xv);
  const int64_t nblocks = KQ ? K / 256 : K / 32, stride = units_per_row<A>(K);   // blocks per weight row; x units
  const int64_t units = (N + QNB - 1) / QNB;
  const int tail = shared_tail<T>(nblocks);
#ifdef KV_HAVE_QAVX2
  if constexpr (std::is_same_v<A, QX>) {
    if (tail && int64_t(xt_buffer.size()) < M) xt_buffer.resize(M);
    for (int64_t m = 0; tail && m < M; ++m) repeat_tail(xq[(m + 1) * stride - 1], tail, xt_buffer[m]);
  }
#endif
  const QX* xt_all = xt_buffer.data();
  #pragma omp parallel for schedule(static) if (N * K * M >= 65536)
  for (int64_t u = 0; u < units; ++u) {
    const int64_t n0 = u * QNB, n1 = std::min(N, n0 + QNB);
    const A* xr[TILE];
    const QX* xt[TILE] = {};
    static_assert(QMR <= QKR && QNB % QXB == 0);   // a unit's rows share last groups only among themselves
    float out[QNB][QKR];
    for (int64_t m = 0; m < M; m += TILE) {
      const int rows = int(std::min<int64_t>(TILE, M - m));
      for (int r = 0; r < rows; ++r) {
        xr[r] = xq + (m + r) * stride;
        if (tail) xt[r] = xt_all + m + r;
      }
      // the first row tile reads the unit's weight rows from memory; the later ones find them in cache
      const auto run = [&](auto r) {
        tile_rows<T, decltype(r)::value>(w, n0, n1, row_bytes, xr, nblocks, out, tail, xt, m > 0);
      };
      switch (rows) {
        case 8: if constexpr (TILE >= 8) { run(std::integral_constant<int, 8>()); break; }
          [[fallthrough]];
        case 7: if constexpr (TILE >= 7) { run(std::integral_constant<int, 7>()); break; }
          [[fallthrough]];
        case 6: if constexpr (TILE >= 6) { run(std::integral_constant<int, 6>()); break; }
          [[fallthrough]];
        case 5: if constexpr (TILE >= 5) { run(std::integral_constant<int, 5>()); break; }
          [[fallthrough]];
        case 4: run(std::integral_constant<int, 4>()); break;
        case 3: run(std::integral_constant<int, 3>()); break;
        case 2: run(std::integral_constant<int, 2>()); break;
        default: run(std::integral_constant<int, 1>()); break;
      }
      for (int64_t n = n0; n < n1; ++n)
        for (int r = 0; r < rows; ++r) store(y + (m + r) * ys, n, out[n - n0][r]);
    }
  }
}

// the activations quantized for a segment of this type (Acts: QK for the on_qk formats, QX otherwise)
template <typename Y>
bool matmul_typed(int64_t type, const uint8_t* w, int64_t N, int64_t row_bytes, const QX* qx, const QK* qk, int64_t M,
                  int64_t K, Y* y, int64_t ys) {
  switch (type) {
    case OCTETS | Q4_0: matmul_rows<Q4_0>(w, N, row_bytes, qx, M, K, y, ys); return true;
    case OCTETS | Q4_1: matmul_rows<Q4_1>(w, N, row_bytes, qx, M, K, y, ys); return true;
    case OCTETS | Q5_0: matmul_rows<Q5_0>(w, N, row_bytes, qx, M, K, y, ys); return true;
    case OCTETS | Q5_1: matmul_rows<Q5_1>(w, N, row_bytes, qx, M, K, y, ys); return true;
    case OCTETS | Q4_K: matmul_rows<Q4_K>(w, N, row_bytes, qx, M, K, y, ys); return true;
    case OCTETS | Q8_0: matmul_rows<Q8_0>(w, N, row_bytes, qx, M, K, y, ys); return true;
    case OCTETS | IQ4_NL: matmul_rows<IQ4_NL>(w, N, row_bytes, qx, M, K, y, ys); return true;
    case Q2_K: matmul_rows<Q2_K>(w, N, row_bytes, qk, M, K, y, ys); return true;
    case Q3_K: matmul_rows<Q3_K>(w, N, row_bytes, qk, M, K, y, ys); return true;
    case Q5_K: matmul_rows<Q5_K>(w, N, row_bytes, qk, M, K, y, ys); return true;
    case IQ4_XS: matmul_rows<IQ4_XS>(w, N, row_bytes, qk, M, K, y, ys); return true;
    case OCTETS | Q6_K: matmul_rows<Q6_K>(w, N, row_bytes, qx, M, K, y, ys); return true;
    default: return false;
  }
}

inline bool takes_qk(int64_t type) { return type == Q2_K || type == Q3_K || type == Q5_K || type == IQ4_XS; }

// the quantized activations of one call, reused across calls (one engine thread calls at a time per library)
thread_local std::vector<QX> qx_buffer;
thread_local std::vector<QK> qk_buffer;

template <typename A, typename X>
const A* quantized(std::vector<A>& buf, const X* x, int64_t xs, int64_t M, int64_t K) {
  const int64_t n = M * units_per_row<A>(K);
  if (int64_t(buf.size()) < n) buf.resize(n);
  quantize_rows(x, xs, M, K, buf.data());
  return buf.data();
}

thread_local std::vector<uint8_t> i8_buffer;   // INT8: qx rows [M, K], then their scales dx [M, K / IG]

inline float* i8_scales(const uint8_t* q, int64_t M, int64_t K) {
  return reinterpret_cast<float*>(const_cast<uint8_t*>(q) + ((M * K + 3) & ~int64_t(3)));
}

template <typename X>
const uint8_t* quantized_i8(const X* x, int64_t xs, int64_t M, int64_t K) {
  const int64_t n = M * K + 4 * M * (K / i8_act_group(K)) + 4;
  if (int64_t(i8_buffer.size()) < n) i8_buffer.resize(n);
  i8_quantize_rows(x, xs, M, K, i8_buffer.data(), i8_scales(i8_buffer.data(), M, K));
  return i8_buffer.data();
}

template <typename X, typename Y>
int quant_matmul(const int64_t* desc, const X* x, int64_t xs, Y* y, int64_t ys, int64_t M, int64_t K) {
  const int64_t nseg = desc[0];
  const QX* qx = nullptr;
  const QK* qk = nullptr;
  const uint8_t* qi = nullptr;
  for (int64_t s = 0; s < nseg; ++s) {   // each kind of activation blocks the segments need, once
    const int64_t type = desc[1 + 4 * s];
    if (type == INT8) { if (!qi) qi = quantized_i8(x, xs, M, K); }
    else if (takes_qk(type)) { if (!qk) qk = quantized(qk_buffer, x, xs, M, K); }
    else if (!qx) { qx = quantized(qx_buffer, x, xs, M, K); }
  }
  int64_t col = 0;
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t* seg = desc + 1 + 4 * s;
    const uint8_t* w = reinterpret_cast<const uint8_t*>(seg[1]);
    if (seg[0] == INT8) {
      if (seg[2] % INT8_GROUP || K % i8_act_group(K) || seg[3] != i8_group_bytes(K) / INT8_GROUP) return -1;
      i8_matmul(w, seg[2], qi, i8_scales(qi, M, K), M, K, y + col, ys);
    } else if (!matmul_typed(seg[0], w, seg[2], seg[3], qx, qk, M, K, y + col, ys)) {
      return -1;
    }
    col += seg[2];
  }
  return 0;
}

}  // namespace

#pragma GCC pop_options

extern "C" {
// A quantized linear: desc = [num_segments, then per segment: type, data pointer, rows, bytes per row] (the type:
// the ggml type, OCTETS | it for the formats whose rows kvserve_quant_repack put in octets: Q4_0, Q4_1, Q5_0,
// Q5_1, Q8_0, IQ4_NL, Q4_K, Q6_K, which are refused in the file's order); the segments' rows stack into the N
// output columns (a fused q|k|v may mix formats). y[M, N] = x[M, K] @ W^T with x and y float32 (x_bf16 = 0) or
// bf16 (1), rows strided by xs / ys elements; K a multiple of 256 for the segments of 256-value formats, of 32
// otherwise; INT8 segments (quant_int8.cpp) have rows in groups of 16. Returns 0, or -1 for a
// type it does not know or an INT8 segment of another shape (the segments before it are written).
int kvserve_quant_matmul(const int64_t* desc, const void* x, int64_t xs, int64_t x_bf16, void* y, int64_t ys,
                         int64_t M, int64_t K) {
  if (x_bf16)
    return quant_matmul(desc, static_cast<const uint16_t*>(x), xs, static_cast<uint16_t*>(y), ys, M, K);
  return quant_matmul(desc, static_cast<const float*>(x), xs, static_cast<float*>(y), ys, M, K);
}

// out[i, :] = row ids[i] of a quantized [rows, K] matrix, dequantized (float32 or bf16): embedding lookups
int kvserve_quant_rows(int64_t type, const uint8_t* w, int64_t row_bytes, const int64_t* ids, int64_t n, int64_t K,
                       void* out, int64_t out_bf16) {
  bool ok = true;
  #pragma omp parallel for if (n * K >= 65536) reduction(&& : ok)
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* row = w + ids[i] * row_bytes;
    if (type == INT8) {   // packed in groups of rows (quant_int8.cpp)
      if (out_bf16) i8_dequant_row(w, ids[i], K, static_cast<uint16_t*>(out) + i * K);
      else i8_dequant_row(w, ids[i], K, static_cast<float*>(out) + i * K);
      continue;
    }
    const bool done = out_bf16 ? dequant_typed(type, row, K / 32, static_cast<uint16_t*>(out) + i * K)
                               : dequant_typed(type, row, K / 32, static_cast<float*>(out) + i * K);
    ok = ok && done;
  }
  return ok ? 0 : -1;
}
}
