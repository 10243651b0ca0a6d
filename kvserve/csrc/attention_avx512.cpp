// The AVX-512 paged attention: over the standard layout [blocks, bs, Hkv, D] (bf16, float32 or FP8 pools), and
// the bf16 kernel over the tiled layout (kvserve/attention/kv_layout.py) whose K/V tiles vdpbf16ps reads.
#include "common.h"

namespace {

#ifdef KV_HAVE_AVX512
// a[j] (16 vectors) -> one vector whose lane j is the sum of a[j]'s lanes
inline __m512 transpose_sum16(__m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// dot products of one query row with one key, as a vector of partial sums (D = 16 * nd)
inline __m512 qk_partial(const float* k, const __m512* qv, int nd, const float*) {
  __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
  for (int i = 1; i < nd; ++i) acc = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(k + 16 * i), acc);
  return acc;
}
inline __m512 qk_partial(const uint16_t* k, const __m512* qv, int nd, const uint16_t* qraw) {
#if defined(__AVX512BF16__)
  // bf16 pairs straight from the cache: 32 multiply-adds per instruction, no conversion
  __m512 acc = _mm512_setzero_ps();
  for (int i = 0; i < nd / 2; ++i)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qraw + 32 * i), (__m512bh)_mm512_loadu_si512(k + 32 * i));
  return acc;
#else
  __m512 acc = _mm512_mul_ps(qv[0], load16(k));
  for (int i = 1; i < nd; ++i) acc = _mm512_fmadd_ps(qv[i], load16(k + 16 * i), acc);
  return acc;
#endif
}

// FP8 pools, 16 values widened exactly (fp8_as_fp16: E4M3 as 2^-8 of its value)
template <typename KV, typename = std::enable_if_t<kFp8<KV>>>
KV_ALWAYS_INLINE __m512 load16(const KV* p) {
  return _mm512_cvtph_ps(fp8_as_fp16(p));
}

// Keys are taken CH = 32 at a time, in three passes over the rows so each pass is short enough for
// out-of-order execution to overlap rows (one long per-row body serializes on its reductions and exps):
//   1. scores of every row (bf16 dot products, transposed sums), 2. online-softmax update, 3. P @ V.
// FP8 pools (KV) are widened once a chunk, K as V is, so the rows of an item share the conversion; K's scale
// multiplies the scores, V's the output.
template <typename T, typename KV = T>
void attend_item_simd(const T* q, int64_t qs, const KV* kc, const KV* vc, T* out, const int32_t* table,
                      int64_t ctx_len, int64_t q_len, int64_t q_row0, int64_t t0, int64_t nt, int64_t g0, int64_t ng,
                      int64_t H, int64_t Hkv, int64_t D, int64_t bs, float scale, float k_scale, float v_scale,
                      int64_t window, float softcap) {
  constexpr int CH = KC;
  constexpr bool fp8 = kFp8<KV>;
  const int64_t G = H / Hkv, RH = ng * G, R = nt * RH;   // RH: rows per token
  const int nd = int(D / 16);
  // compact strides: power-of-two row strides would put every row in the same L1 set
  alignas(64) float acc[MAX_ROWS * MAX_D];
  alignas(64) float vf[CH * (MAX_KV_ROW + 16)];
  alignas(64) float kf[fp8 ? CH * (MAX_KV_ROW + 16) : 1];
  alignas(64) float sc[MAX_ROWS * CH];
  float corr[MAX_ROWS], m[MAX_ROWS], l[MAX_ROWS];
  const T* qraw[MAX_ROWS];
  const KV* krow[CH];
  int64_t koff[MAX_ROWS], limit[MAX_ROWS], first[MAX_ROWS], nvis[MAX_ROWS], lo[MAX_ROWS];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = t0 + r / RH, h = g0 * G + r % RH;
    qraw[r] = q + (q_row0 + t) * qs + h * D;
    koff[r] = (h / G - g0) * D;
    for (int i = 0; i < nd; ++i) _mm512_store_ps(acc + r * D + 16 * i, _mm512_setzero_ps());
    m[r] = -INFINITY; l[r] = 0.f;
    limit[r] = ctx_len - q_len + t;
    first[r] = window_first(limit[r], window);
  }
  const int64_t end = limit[R - 1] + 1;
  const int64_t kv_row = Hkv * D, blk_stride = bs * kv_row, nvf = ng * D, vstride = nvf + 16;
  const __m512 vscale = _mm512_set1_ps(scale * k_scale * kFp8Unit<KV>), neg_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t p = chunk_start(first[0], bs); p < end; p += CH) {
    const int64_t n = std::min<int64_t>(CH, end - p), nn = std::max<int64_t>(0, std::min<int64_t>(CH, end - p - CH));
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pos = p + j;
      krow[j] = kc + int64_t(table[pos / bs]) * blk_stride + (pos % bs) * kv_row + g0 * D;
      const KV* vrow = vc + (krow[j] - kc);
      for (int64_t i = 0; i < nvf; i += 16) _mm512_store_ps(vf + j * vstride + i, load16(vrow + i));
      if constexpr (fp8)
        for (int64_t i = 0; i < nvf; i += 16) _mm512_store_ps(kf + j * vstride + i, load16(krow[j] + i));
      if (j < nn) {   // the next chunk's row j on its way to L2 (blocks lie anywhere: no hardware prefetcher knows)
        const int64_t at = int64_t(table[(pos + CH) / bs]) * blk_stride + ((pos + CH) % bs) * kv_row + g0 * D;
        for (int64_t b = 0; b < nvf * int64_t(sizeof(KV)); b += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(kc + at) + b, _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(vc + at) + b, _MM_HINT_T1);
        }
      }
    }
    // 1. scores of the keys [lo, nv) of the chunk the row sees; -inf elsewhere
    for (int64_t r = 0; r < R; ++r) {
      const int64_t nv = std::min<int64_t>(n, limit[r] - p + 1);
      lo[r] = std::max<int64_t>(0, first[r] - p);
      nvis[r] = nv > lo[r] ? nv : 0;
      if (nvis[r] <= 0) continue;
      __m512 qv[MAX_D / 16];
      for (int i = 0; i < nd; ++i) qv[i] = load16(qraw[r] + 16 * i);
      for (int64_t j0 = 0; j0 < nv; j0 += 16) {
        __m512 part[16];
        for (int64_t j = 0; j < 16; ++j) {
          if (j0 + j >= nv || j0 + j < lo[r])
            part[j] = _mm512_setzero_ps();
          else if constexpr (fp8)
            part[j] = qk_partial(kf + (j0 + j) * vstride + koff[r], qv, nd, nullptr);
          else
            part[j] = qk_partial(krow[j0 + j] + koff[r], qv, nd, qraw[r]);
        }
        const int64_t left = nv - j0, skip = std::min<int64_t>(16, std::max<int64_t>(0, lo[r] - j0));
        const __mmask16 valid = (left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1)) &
                                __mmask16(0xffffu << skip);
        _mm512_store_ps(sc + r * CH + j0,
                        _mm512_mask_blend_ps(valid, neg_inf, _mm512_mul_ps(transpose_sum16(part), vscale)));
      }
      if (nv <= 16) _mm512_store_ps(sc + r * CH + 16, neg_inf);
      soft_cap(sc + r * CH, lo[r], nv, softcap);
    }
    // 2. online softmax: new running max, rescale factor, probabilities
    for (int64_t r = 0; r < R; ++r) {
      if (nvis[r] <= 0) continue;
      const __m512 s0 = _mm512_load_ps(sc + r * CH), s1 = _mm512_load_ps(sc + r * CH + 16);
      const float mnew = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
      const __m512 vm = _mm512_set1_ps(mnew);
      const __m512 p0 = exp512(_mm512_sub_ps(s0, vm)), p1 = exp512(_mm512_sub_ps(s1, vm));
      // masked keys hold -inf; exp512 clamps to exp(-87), so zero them explicitly
      const __m512 z0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s0, neg_inf, _CMP_NEQ_OQ), p0);
      const __m512 z1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s1, neg_inf, _CMP_NEQ_OQ), p1);
      corr[r] = std::exp(m[r] - mnew);
      l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(_mm512_add_ps(z0, z1));
      m[r] = mnew;
      _mm512_store_ps(sc + r * CH, z0);
      _mm512_store_ps(sc + r * CH + 16, z1);
    }
    // 3. acc = acc * corr + P @ V
    for (int64_t r = 0; r < R; ++r) {
      const int64_t nv = nvis[r];
      if (nv <= 0) continue;
      const __m512 vcorr = _mm512_set1_ps(corr[r]);
      const float* vr = vf + koff[r];
      const float* pr = sc + r * CH;
      for (int i0 = 0; i0 < nd; i0 += 4) {   // 4 accumulators (64 dims) in registers at a time
        const int ni = std::min(4, nd - i0);
        __m512 a[4];
        for (int i = 0; i < ni; ++i) a[i] = _mm512_mul_ps(_mm512_load_ps(acc + r * D + 16 * (i0 + i)), vcorr);
        for (int64_t j = lo[r]; j < nv; ++j) {
          const __m512 b = _mm512_set1_ps(pr[j]);
          for (int i = 0; i < ni; ++i)
            a[i] = _mm512_fmadd_ps(b, _mm512_load_ps(vr + j * vstride + 16 * (i0 + i)), a[i]);
        }
        for (int i = 0; i < ni; ++i) _mm512_store_ps(acc + r * D + 16 * (i0 + i), a[i]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = t0 + r / RH, h = g0 * G + r % RH;
    T* dst = out + ((q_row0 + t) * H + h) * D;
    const float inv = v_scale * kFp8Unit<KV> / l[r];
    for (int64_t d = 0; d < D; ++d) store(dst, d, acc[r * D + d] * inv);
  }
}
#endif

#if defined(KV_HAVE_AVX512) && defined(__AVX512BF16__)
#define KV_HAVE_BF16_TILE 1
// The bf16 kernel layout of the cache (kvserve/attention/kv_layout.py): each block holds bs / 16 groups of 16
// keys; per group and kv head, a K tile [D/2][16][2] (dim pair k of the 16 keys in one 64-byte vector) and a
// V tile [8][D][2] (key pairs 2k, 2k+1 interleaved per dim). Both are what vdpbf16ps takes, straight from the
// cache: scores acc[16 keys] += q[dim pair k] (broadcast) . K[k]; output acc[16 dims] += (p_2k, p_2k+1)
// (broadcast) . V[k]. The kernel reads the tiles in address order and never transposes or copies K/V.
// P is rounded to bf16, as flash attention does on GPUs.
constexpr int TCH = 32;   // keys per chunk: two 16-key groups
constexpr int PF_CHUNKS = 1;   // a tunable: the prefetch distance in chunks (benchmarks/attention_kernel.py)

inline int64_t tile_offset(const int32_t* table, int64_t pos, int64_t bs, int64_t Hkv, int64_t D, int64_t g) {
  return ((int64_t(table[pos / bs]) * (bs / 16) + (pos % bs) / 16) * Hkv + g) * 16 * D;
}

// raw scores of NR rows against the 32 keys of the chunk (K0: keys 0-15, K1: 16-31): s[2r + h] covers keys 16h..
// pf (or nullptr): the K tiles of a chunk ahead, prefetched one line per line read
template <int NR>
inline void tile_scores(const __m512i* K0, const __m512i* K1, int nd2, const int32_t* const* qd, __m512* s,
                        const __m512i* const* pf) {
  __m512 a[NR][2];
  for (int r = 0; r < NR; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int k = 0; k < nd2; ++k) {
    if (pf) {
      _mm_prefetch(reinterpret_cast<const char*>(pf[0] + k), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(pf[1] + k), _MM_HINT_T1);
    }
    const __m512bh k0 = (__m512bh)_mm512_load_si512(K0 + k), k1 = (__m512bh)_mm512_load_si512(K1 + k);
    for (int r = 0; r < NR; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(qd[r][k]);
      a[r][0] = _mm512_dpbf16_ps(a[r][0], qb, k0);
      a[r][1] = _mm512_dpbf16_ps(a[r][1], qb, k1);
    }
  }
  for (int r = 0; r < NR; ++r) { s[2 * r] = a[r][0]; s[2 * r + 1] = a[r][1]; }
}

// acc[r][16 (i0 + i) ...] = acc * corr[r] + P_r @ V over NI accumulators (16 dims each) and np key pairs;
// V[k] points at key pair k's D / 16 vectors
// pf (or nullptr): the two V tiles of a chunk ahead, prefetched one line per line read
template <int NR, int NI>
inline void tile_pv(const __m512i* const* V, int nseg, int i0, int np, const int32_t* const* pp, float* const* acc,
                    const float* corr, const __m512i* const* pf) {
  __m512 a[NR][NI];
  for (int r = 0; r < NR; ++r) {
    const __m512 c = _mm512_set1_ps(corr[r]);
    for (int i = 0; i < NI; ++i) a[r][i] = _mm512_mul_ps(_mm512_load_ps(acc[r] + 16 * (i0 + i)), c);
  }
  for (int k = 0; k < np; ++k) {
    if (pf)
      for (int i = 0; i < NI; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(pf[k / 8] + (k % 8) * nseg + i0 + i), _MM_HINT_T1);
    __m512bh v[NI];
    for (int i = 0; i < NI; ++i) v[i] = (__m512bh)_mm512_load_si512(V[k] + i0 + i);
    for (int r = 0; r < NR; ++r) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(pp[r][k]);
      for (int i = 0; i < NI; ++i) a[r][i] = _mm512_dpbf16_ps(a[r][i], pb, v[i]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NI; ++i) _mm512_store_ps(acc[r] + 16 * (i0 + i), a[r][i]);
}

template <int NR>
inline void tile_pv_rows(const __m512i* const* V, int nseg, int np, const int32_t* const* pp, float* const* acc,
                         const float* corr, const __m512i* const* pf) {
  int i0 = 0;
  for (; i0 + 4 <= nseg; i0 += 4) tile_pv<NR, 4>(V, nseg, i0, np, pp, acc, corr, pf);
  if (i0 < nseg) tile_pv<NR, 2>(V, nseg, i0, np, pp, acc, corr, pf);   // nseg is even (D % 32 == 0)
}

// online softmax of one row over the chunk's raw scores (s0: keys 0-15, s1: 16-31), keys [lo, nv) visible:
// updates the running max m and sum l, sets the rescale factor corr and the bf16 probability pairs pp
inline void softmax_row(__m512 s0, __m512 s1, int64_t lo, int64_t nv, float scale, float softcap, float& m,
                        float& l, float& corr, int32_t* pp) {
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY), vscale = _mm512_set1_ps(scale);
  const uint32_t seen = (nv >= 32 ? 0xffffffffu : (1u << nv) - 1) & (0xffffffffu << lo);   // lo < nv <= 32
  const __mmask16 m0 = __mmask16(seen), m1 = __mmask16(seen >> 16);
  s0 = _mm512_mask_blend_ps(m0, neg_inf, _mm512_mul_ps(s0, vscale));
  s1 = _mm512_mask_blend_ps(m1, neg_inf, _mm512_mul_ps(s1, vscale));
  if (softcap > 0.f) {
    alignas(64) float s[32];
    _mm512_store_ps(s, s0);
    _mm512_store_ps(s + 16, s1);
    soft_cap(s, lo, nv, softcap);
    s0 = _mm512_load_ps(s);
    s1 = _mm512_load_ps(s + 16);
  }
  const float mnew = std::max(m, _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
  const __m512 vm = _mm512_set1_ps(mnew);
  const __m512 z0 = _mm512_maskz_mov_ps(m0, exp512(_mm512_sub_ps(s0, vm)));
  const __m512 z1 = _mm512_maskz_mov_ps(m1, exp512(_mm512_sub_ps(s1, vm)));
  corr = std::exp(m - mnew);
  l = l * corr + _mm512_reduce_add_ps(_mm512_add_ps(z0, z1));
  m = mnew;
  _mm512_store_si512(pp, (__m512i)_mm512_cvtne2ps_pbh(z1, z0));
}

// One work item over the kernel layout: sequence b, kv heads [g0, g0 + ng), query tokens [t0, t0 + nt). Rows are
// kv-head-major (kv head, token, q head of that kv head), so each kv head's rows are one range whose causal
// limits grow.
// a row's output from its accumulator and sum (one compiled copy: an item's rows and the second pass's round alike)
__attribute__((noinline)) void store_row_tiled(uint16_t* dst, const float* acc, float l, int64_t D) {
  const __m512 inv = _mm512_set1_ps(1.f / l);
  for (int64_t d = 0; d < D; d += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc + d), inv)));
}

void attend_item_tiled(const uint16_t* q, int64_t qs, const uint16_t* kc, const uint16_t* vc, uint16_t* out,
                       const int32_t* table, int64_t ctx_len, int64_t q_len, int64_t q_row0, int64_t t0, int64_t nt,
                       int64_t g0, int64_t ng, int64_t H, int64_t Hkv, int64_t D, int64_t bs, float scale,
                       int64_t window, float softcap, const Segments& sg) {
  const int64_t G = H / Hkv, RH = nt * G, R = ng * RH;   // RH: rows per kv head
  const int nd2 = int(D / 2), nseg = int(D / 16);
  const int64_t tile = 16 * D;   // elements of one K (or V) tile
  alignas(64) float acc[MAX_ROWS * MAX_D];
  RowFolds folds;
  int64_t tok[MAX_ROWS], head[MAX_ROWS];
  alignas(64) int32_t pp[MAX_ROWS][16];
  alignas(64) __m512i vlast[MAX_D / 16];   // a last key pair whose second key lies past the end, that key zeroed
  float m[MAX_ROWS], l[MAX_ROWS], corr[MAX_ROWS];
  const int32_t* qd[MAX_ROWS];
  const int32_t* ppr[MAX_ROWS];
  float* accr[MAX_ROWS];
  int64_t limit[MAX_ROWS], first[MAX_ROWS], hrow[MAX_ROWS];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = t0 + (r % RH) / G, h = (g0 + r / RH) * G + r % G;
    tok[r] = t;
    head[r] = h;
    hrow[r] = (q_row0 + t) * H + h;
    qd[r] = reinterpret_cast<const int32_t*>(q + (q_row0 + t) * qs + h * D);
    ppr[r] = pp[r];
    accr[r] = acc + r * D;
    std::memset(accr[r], 0, D * sizeof(float));
    m[r] = -INFINITY; l[r] = 0.f;
    limit[r] = ctx_len - q_len + t;
    first[r] = window_first(limit[r], window);
    folds.init(r, first[r], limit[r], sg, D);
  }
  const int64_t end = std::min(limit[RH - 1] + 1, sg.hi), start = std::max(chunk_start(first[0], bs), sg.lo);
  // per kv head: rows before r0 have seen all their keys, rows from r1 on have not reached their first
  int64_t r0[MAX_ROWS], r1[MAX_ROWS];
  for (int64_t gi = 0; gi < ng; ++gi) r0[gi] = r1[gi] = gi * RH;
  static_assert(TCH == KC, "the tiled kernel's chunks are on chunk_start's grid");
  for (int64_t p = start; p < end; p += TCH) {
    if (p % SEG == 0 && p > start)
      for (int64_t r = 0; r < R; ++r) folds.end_segment(sg, r, p, tok[r], head[r], H, accr[r], m[r], l[r], D);
    const int64_t n = std::min<int64_t>(TCH, end - p);
    // the chunk's two groups; a second group past the end reuses the first (its keys are masked out)
    const int64_t base0 = tile_offset(table, p, bs, Hkv, D, g0);
    const int64_t base1 = n > 16 ? tile_offset(table, p + 16, bs, Hkv, D, g0) : base0;
    // the tiles PF_CHUNKS ahead go to L2 one line per line the chunk reads: a burst of prefetches at the start of
    // each chunk overflows the miss queues (benchmarks/LOG.md)
    const int64_t ahead = p + PF_CHUNKS * TCH;
    const bool prefetch = ahead < end;
    const int64_t pf0 = prefetch ? tile_offset(table, ahead, bs, Hkv, D, g0) : 0;
    const int64_t pf1 = prefetch && ahead + 16 < end ? tile_offset(table, ahead + 16, bs, Hkv, D, g0) : pf0;
    const int np = int((n + 1) / 2);
    for (int64_t gi = 0; gi < ng; ++gi) {
      const int64_t rall = (gi + 1) * RH;   // a kv head's rows: their limits and firsts grow
      while (r0[gi] < rall && limit[r0[gi]] < p) ++r0[gi];
      while (r1[gi] < rall && first[r1[gi]] < p + n) ++r1[gi];
      const int64_t rend = r1[gi];
      if (r0[gi] >= rend) continue;
      const __m512i* K0 = reinterpret_cast<const __m512i*>(kc + base0 + gi * tile);
      const __m512i* K1 = reinterpret_cast<const __m512i*>(kc + base1 + gi * tile);
      const __m512i* V[TCH / 2];
      for (int k = 0; k < np; ++k)
        V[k] = reinterpret_cast<const __m512i*>(vc + (k < 8 ? base0 : base1) + gi * tile) + (k % 8) * nseg;
      if (n % 2) {   // P of the missing key is 0, but 0 * (stale inf or NaN) is not: zero that key's V
        for (int i = 0; i < nseg; ++i) vlast[i] = _mm512_maskz_mov_epi16(0x55555555u, _mm512_load_si512(V[np - 1] + i));
        V[np - 1] = vlast;
      }
      const __m512i* pfk[2] = {reinterpret_cast<const __m512i*>(kc + pf0 + gi * tile),
                               reinterpret_cast<const __m512i*>(kc + pf1 + gi * tile)};
      const __m512i* pfv[2] = {reinterpret_cast<const __m512i*>(vc + pf0 + gi * tile),
                               reinterpret_cast<const __m512i*>(vc + pf1 + gi * tile)};
      for (int64_t rb = r0[gi]; rb < rend; rb += 4) {
        const int nr = int(std::min<int64_t>(4, rend - rb));
        const __m512i* const* pf = prefetch && rb == r0[gi] ? pfk : nullptr;   // the first row block prefetches
        __m512 s[8];
        switch (nr) {
          case 4: tile_scores<4>(K0, K1, nd2, qd + rb, s, pf); break;
          case 3: tile_scores<3>(K0, K1, nd2, qd + rb, s, pf); break;
          case 2: tile_scores<2>(K0, K1, nd2, qd + rb, s, pf); break;
          default: tile_scores<1>(K0, K1, nd2, qd + rb, s, pf); break;
        }
        for (int i = 0; i < nr; ++i) {
          const int64_t r = rb + i, nv = std::min<int64_t>(n, limit[r] - p + 1);   // >= 1 for rows from r0
          softmax_row(s[2 * i], s[2 * i + 1], std::max<int64_t>(0, first[r] - p), nv, scale, softcap, m[r], l[r],
                      corr[r], pp[r]);   // lo < nv for rows before r1
        }
      }
      for (int64_t rb = r0[gi]; rb < rend; rb += 4) {
        const int nr = int(std::min<int64_t>(4, rend - rb));
        const __m512i* const* pf = prefetch && rb == r0[gi] ? pfv : nullptr;
        switch (nr) {
          case 4: tile_pv_rows<4>(V, nseg, np, ppr + rb, accr + rb, corr + rb, pf); break;
          case 3: tile_pv_rows<3>(V, nseg, np, ppr + rb, accr + rb, corr + rb, pf); break;
          case 2: tile_pv_rows<2>(V, nseg, np, ppr + rb, accr + rb, corr + rb, pf); break;
          default: tile_pv_rows<1>(V, nseg, np, ppr + rb, accr + rb, corr + rb, pf); break;
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    uint16_t* dst = out + hrow[r] * D;
    folds.finish(sg, r, first[r], start, end, tok[r], head[r], H, accr[r], m[r], l[r], D,
                 [&](const float* a, float sum) { store_row_tiled(dst, a, sum, D); });
  }
}
#endif

}  // namespace
