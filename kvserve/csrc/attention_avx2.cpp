// The AVX2 paged attention over the standard layout [blocks, bs, Hkv, D] (bf16, float32 or FP8 pools): per chunk
// of KC key positions a work item's query rows pass over the chunk together (scores, softmax, then P @ V); a
// row spanning key segments folds them (RowFolds, attention.cpp).
#include "common.h"

namespace {

#ifdef KV_HAVE_AVX2
// lanes 0-3: the sums of the lanes of a0 .. a3
KV_ALWAYS_INLINE __m128 transpose_sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// 16 values of a K or V row as two float vectors, in the AVX2 kernel's order of dims: bf16 as its 8 even and 8
// odd values (a shift or an and on one load, no conversion pass), float32 as they come. Queries and accumulators
// use the same order (q16), and the output is put back in place (unpermute16).
KV_ALWAYS_INLINE void load16_halves(const uint16_t* p, __m256& a, __m256& b) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  a = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  b = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int32_t(0xffff0000u))));
}
KV_ALWAYS_INLINE void load16_halves(const float* p, __m256& a, __m256& b) {
  a = _mm256_loadu_ps(p);
  b = _mm256_loadu_ps(p + 8);
}
#ifdef __F16C__
// FP8 as fp16 codes, 16 at a time, for vcvtph2ps to widen exactly. E5M2 is fp16's upper byte. E4M3's exponent and
// mantissa sit below fp16's by 7 bits (S.EEEE.MMM -> S.0EEEE.MMM0000000: 2^-8 of its value, denormals too;
// kFp8Unit); its one NaN code is made fp16's NaN.
KV_ALWAYS_INLINE __m256i fp8_as_fp16(const fp8_e5m2* p) {
  return _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
}
KV_ALWAYS_INLINE __m256i fp8_as_fp16(const fp8_e4m3* p) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(w, 8), 1), _mm256_set1_epi16(int16_t(0xbfff)));
  const __m256i m7 = _mm256_set1_epi16(0x7f);
  return _mm256_or_si256(h, _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(w, m7), m7),
                                             _mm256_set1_epi16(0x7e00)));
}
// 16 values as they come (no split)
template <typename KV, typename = std::enable_if_t<kFp8<KV>>>
KV_ALWAYS_INLINE void load16_halves(const KV* p, __m256& a, __m256& b) {
  fp16_halves(fp8_as_fp16(p), a, b);
}
template <typename KV> constexpr bool kAvx2Kv = kFp8<KV>;
#else
template <typename KV> constexpr bool kAvx2Kv = false;
#endif
// the order of dims the K/V type loads in: bf16 split into even and odd values, the others as they come
template <typename KV> constexpr bool kSplit16 = std::is_same_v<KV, uint16_t>;
template <typename KV, typename T> inline void q16(const T* src, float scale, float* dst) {   // 16 values so
  for (int k = 0; k < 8; ++k) {
    dst[k] = load(src, kSplit16<KV> ? 2 * k : k) * scale;
    dst[8 + k] = load(src, kSplit16<KV> ? 2 * k + 1 : 8 + k) * scale;
  }
}
template <typename KV> inline int unpermute16(int k) {   // where value k of 16 sits in that order
  return kSplit16<KV> ? (k % 2) * 8 + k / 2 : k;
}

// the scores of NR (1 or 2) query rows q[r] against keys j .. j + 3 of the chunk (rows kr[j], D = 16 n16) into
// s[r][j ..]: each key's loads serve both rows, each row's sums are its own
template <int NR, typename T>
KV_ALWAYS_INLINE void scores4(const float* const* q, const T* const* kr, int64_t j, int64_t n16, float* const* s) {
  __m256 a[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int k = 0; k < 4; ++k) a[r][k] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n16; ++i) {
    __m256 qa[NR], qb[NR];
    for (int r = 0; r < NR; ++r) {
      qa[r] = _mm256_load_ps(q[r] + 16 * i);
      qb[r] = _mm256_load_ps(q[r] + 16 * i + 8);
    }
    for (int k = 0; k < 4; ++k) {
      __m256 ka, kb;
      load16_halves(kr[j + k] + 16 * i, ka, kb);
      for (int r = 0; r < NR; ++r) a[r][k] = _mm256_fmadd_ps(qb[r], kb, _mm256_fmadd_ps(qa[r], ka, a[r][k]));
    }
  }
  for (int r = 0; r < NR; ++r) _mm_store_ps(s[r] + j, transpose_sum4(a[r][0], a[r][1], a[r][2], a[r][3]));
}

// the lines of rows[j0, j1) (each `bytes` long) on their way to L2: the next chunk's K and V rows, a few at a time
// while this chunk computes (a burst at a chunk's start overflows the miss queues: benchmarks/LOG.md, tiled kernel)
template <typename T>
KV_ALWAYS_INLINE void prefetch_rows(const T* const* rows, int64_t j0, int64_t j1, int64_t bytes) {
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(rows[j]) + b, _MM_HINT_T1);
}

// dims 16 i0 .. 16 (i0 + NI) of NR rows' accumulators (in load16_halves' order): acc = acc * corr + the sum over
// keys j0 <= j < j1 of p[r][j] v[j] (rows vr[j])
template <int NR, int NI, typename T>
KV_ALWAYS_INLINE void pv_rows(float* const* acc, const float* const* p, const float* corr, const T* const* vr,
                              int64_t j0, int64_t j1, int64_t i0) {
  __m256 a[NR][2 * NI];
  for (int r = 0; r < NR; ++r) {
    const __m256 c = _mm256_set1_ps(corr[r]);
    for (int i = 0; i < 2 * NI; ++i) a[r][i] = _mm256_mul_ps(_mm256_load_ps(acc[r] + 16 * i0 + 8 * i), c);
  }
  for (int64_t j = j0; j < j1; ++j) {
    __m256 v[2 * NI];
    for (int i = 0; i < NI; ++i) load16_halves(vr[j] + 16 * (i0 + i), v[2 * i], v[2 * i + 1]);
    for (int r = 0; r < NR; ++r) {
      const __m256 pj = _mm256_broadcast_ss(p[r] + j);
      for (int i = 0; i < 2 * NI; ++i) a[r][i] = _mm256_fmadd_ps(pj, v[i], a[r][i]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < 2 * NI; ++i) _mm256_store_ps(acc[r] + 16 * i0 + 8 * i, a[r][i]);
}

template <int NR, typename T>
inline void pv_dims(float* const* acc, const float* const* p, const float* corr, const T* const* vr, int64_t j0,
                    int64_t j1, int64_t n16) {
  int64_t i0 = 0;
  for (; i0 + 2 <= n16; i0 += 2) pv_rows<NR, 2>(acc, p, corr, vr, j0, j1, i0);
  if (i0 < n16) pv_rows<NR, 1>(acc, p, corr, vr, j0, j1, i0);
}

// the online-softmax step of one row over its keys [lo, nv) of the chunk's raw scores s [KC]: updates its running
// max m and sum l, sets the rescale factor corr and turns s into exp(s - m), exactly 0 outside [lo, nv)
inline void softmax_chunk(float* s, int64_t lo, int64_t nv, float& m, float& l, float& corr) {
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), vn = _mm256_set1_ps(float(nv));
  const __m256 vlo = _mm256_set1_ps(float(lo));
  const auto visible = [&](int64_t j) {
    const __m256 pos = _mm256_add_ps(lane, _mm256_set1_ps(float(j)));
    return _mm256_and_ps(_mm256_cmp_ps(pos, vn, _CMP_LT_OQ), _mm256_cmp_ps(pos, vlo, _CMP_GE_OQ));
  };
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < nv; j += 8)
    vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_load_ps(s + j), visible(j)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float mnew = std::max(m, _mm_cvtss_f32(h));
  corr = std::exp(m - mnew);
  const __m256 vm = _mm256_set1_ps(mnew);
  __m256 psum = _mm256_setzero_ps();
  for (int64_t j = 0; j < KC; j += 8) {
    const __m256 e = j < nv ? _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_load_ps(s + j), vm)), visible(j))
                            : _mm256_setzero_ps();
    _mm256_store_ps(s + j, e);
    psum = _mm256_add_ps(psum, e);
  }
  l = l * corr + hsum8(psum);
  m = mnew;
}

// One work item on 8 lanes (D % 16 == 0; K/V of the query's type): sequence b, kv head g, query tokens
// [t0, t0 + nt). Per chunk of KC key positions (fixed positions, so a row's result does not depend on its tile or
// step), three passes over the rows, two rows at a time, reading K and V straight from the cache, so that
// out-of-order execution overlaps rows and each load serves both: 1. scores, 2. online-softmax update, 3. P @ V.
// A row's sums are its own in every pass and it reads no key past its causal limit (a pair's P @ V runs together
// over the keys both see, then the longer row alone, its factor 1), so its result does not depend on its partner.
// The next chunk's K and V rows are prefetched into L2 while this chunk's scores are computed: a sequence's blocks
// lie anywhere in the pool, so no hardware prefetcher can tell where its next rows are.
// KV: the query's type, or an FP8 format (F16C), whose K scale is folded into the queries, V's into the output.
// a row's output from its accumulator (in load16_halves' order of dims) and sum
// (one compiled copy: an item's rows and the second pass's round alike)
template <typename T, typename KV>
__attribute__((noinline)) void store_row_avx2(T* dst, const float* acc, float l, float v_scale, int64_t D) {
  const float inv = v_scale * kFp8Unit<KV> / l;
  for (int64_t d = 0; d < D; d += 16)
    for (int k = 0; k < 16; ++k) store(dst, d + k, acc[d + unpermute16<KV>(k)] * inv);
}

template <typename T, typename KV>
void attend_item_avx2(const T* q, int64_t qs, const KV* kc, const KV* vc, T* out, const int32_t* table,
                      int64_t ctx_len, int64_t q_len, int64_t q_row0, int64_t t0, int64_t nt, int64_t g, int64_t H,
                      int64_t Hkv, int64_t D, int64_t bs, float scale, float k_scale, float v_scale, int64_t window,
                      float softcap, const Segments& sg) {
  const int64_t G = H / Hkv, R = nt * G, n16 = D / 16;
  alignas(32) float qf[MAX_ROWS][MAX_D], acc[MAX_ROWS][MAX_D];
  RowFolds folds;
  alignas(32) float s[MAX_ROWS][KC];
  alignas(32) static const KV zero_row[MAX_D] = {};   // the keys past a chunk's end, up to a multiple of 4
  const KV* kr[KC];
  const KV* vr[KC];
  const KV* nk[KC];   // the next chunk's K and V rows (prefetched during this chunk's scores)
  const KV* nvr[KC];
  float m[MAX_ROWS], l[MAX_ROWS], corr[MAX_ROWS];
  int64_t limit[MAX_ROWS], first[MAX_ROWS], nv[MAX_ROWS], lo[MAX_ROWS];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = t0 + r / G, h = g * G + r % G;
    const T* src = q + (q_row0 + t) * qs + h * D;
    for (int64_t d = 0; d < D; d += 16) q16<KV>(src + d, scale * k_scale * kFp8Unit<KV>, qf[r] + d);
    for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(acc[r] + d, _mm256_setzero_ps());
    m[r] = -INFINITY; l[r] = 0.f;
    limit[r] = ctx_len - q_len + t;   // causal: the last key position this token sees
    first[r] = window_first(limit[r], window);
    folds.init(r, first[r], limit[r], sg, D);
  }
  const int64_t end = std::min(limit[R - 1] + 1, sg.hi), start = std::max(chunk_start(first[0], bs), sg.lo);
  const int64_t kv_row = Hkv * D, blk_stride = bs * kv_row, row_bytes = D * int64_t(sizeof(KV));
  const auto rows_of = [&](int64_t p, int64_t n, const KV** k, const KV** v) {   // chunk p's rows, block by block
    for (int64_t j = 0; j < n;) {
      const int64_t off = (p + j) % bs, run = std::min(n - j, bs - off);
      const int64_t at = int64_t(table[(p + j) / bs]) * blk_stride + off * kv_row + g * D;
      for (int64_t i = 0; i < run; ++i, ++j) {
        k[j] = kc + at + i * kv_row;
        v[j] = vc + at + i * kv_row;
      }
    }
  };
  int64_t p = start;
  if (p < end) rows_of(p, std::min<int64_t>(KC, end - p), nk, nvr);
  for (; p < end; p += KC) {
    if (p % SEG == 0 && p > start)
      for (int64_t r = 0; r < R; ++r) folds.end_segment(sg, r, p, t0 + r / G, g * G + r % G, H, acc[r], m[r], l[r], D);
    const int64_t n = std::min<int64_t>(KC, end - p), n4 = (n + 3) & ~int64_t(3);
    std::copy(nk, nk + n, kr);
    std::copy(nvr, nvr + n, vr);
    const int64_t nn = std::max<int64_t>(0, std::min<int64_t>(KC, end - p - KC));   // the next chunk's keys
    if (nn > 0) rows_of(p + KC, nn, nk, nvr);
    for (int64_t j = n; j < n4; ++j) kr[j] = vr[j] = zero_row;
    for (int64_t r = 0; r < R; ++r) {   // the row sees keys [lo, nv) of the chunk
      nv[r] = std::max<int64_t>(0, std::min<int64_t>(n, limit[r] - p + 1));
      lo[r] = std::max<int64_t>(0, first[r] - p);
      if (lo[r] >= nv[r]) nv[r] = lo[r] = 0;
    }
    int64_t fetched = 0;   // the next chunk's rows prefetched so far: four keys a step of the first scores
    const auto fetch_next = [&](int64_t upto) {
      upto = std::min(upto, nn);
      if (fetched < upto) {
        prefetch_rows(nk, fetched, upto, row_bytes);
        prefetch_rows(nvr, fetched, upto, row_bytes);
        fetched = upto;
      }
    };
    int64_t r = 0;
    for (; r + 1 < R; r += 2) {   // 1. scores
      const float* qq[2] = {qf[r], qf[r + 1]};
      float* ss[2] = {s[r], s[r + 1]};
      for (int64_t j = 0; j < std::max(nv[r], nv[r + 1]); j += 4) {
        fetch_next(j + 4);
        scores4<2>(qq, kr, j, n16, ss);
      }
    }
    if (r < R) {
      const float* qq[1] = {qf[r]};
      float* ss[1] = {s[r]};
      for (int64_t j = 0; j < nv[r]; j += 4) {
        fetch_next(j + 4);
        scores4<1>(qq, kr, j, n16, ss);
      }
    }
    fetch_next(nn);   // the rest, where the rows saw fewer keys of this chunk than the next one has
    for (r = 0; r < R; ++r) {   // 2. online softmax
      corr[r] = 1.f;
      if (nv[r] <= 0) continue;
      soft_cap(s[r], lo[r], nv[r], softcap);
      softmax_chunk(s[r], lo[r], nv[r], m[r], l[r], corr[r]);
    }
    const float one = 1.f;
    for (r = 0; r < R; r += 2) {   // 3. P @ V: the keys both rows see together, then the longer row's rest alone
      const int64_t pair = r + 1 < R, both = pair ? std::min(nv[r], nv[r + 1]) : 0;
      if (both > 0) {
        float* aa[2] = {acc[r], acc[r + 1]};
        const float* pp[2] = {s[r], s[r + 1]};
        pv_dims<2>(aa, pp, corr + r, vr, 0, both, n16);
      }
      for (int64_t i = r; i <= r + pair; ++i) {
        if (nv[i] <= both) continue;
        float* aa[1] = {acc[i]};
        const float* pp[1] = {s[i]};
        pv_dims<1>(aa, pp, both > 0 ? &one : corr + i, vr, both, nv[i], n16);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = t0 + r / G, h = g * G + r % G;
    T* dst = out + ((q_row0 + t) * H + h) * D;
    folds.finish(sg, r, first[r], start, end, t, h, H, acc[r], m[r], l[r], D,
                 [&](const float* a, float sum) { store_row_avx2<T, KV>(dst, a, sum, v_scale, D); });
  }
}
#endif

}  // namespace
