// Paged attention straight from the KV blocks: a portable path, an AVX-512 path and a bf16 tile path.
#include "common.h"

namespace {

constexpr int KC = 32;        // keys per chunk: converted to fp32 once, reused by every query row of a tile
constexpr int MAX_D = 256;    // largest head_dim supported (checked on the Python side)
constexpr int MAX_ROWS = 64;  // query rows (tokens x q heads) per work item
constexpr int MAX_KV_ROW = 1024;  // kv heads x head_dim of the SIMD path

// One work item: sequence b, kv head g, query tokens [t0, t0 + nt) of that sequence.
// Rows are (token, q head of this kv head) pairs; every row runs its own online softmax.
template <typename T>
void attend_item(const T* q, int64_t qs, const T* kc, const T* vc, T* out, const int32_t* table, int64_t ctx_len,
                 int64_t q_len, int64_t q_row0, int64_t t0, int64_t nt, int64_t g, int64_t H, int64_t Hkv,
                 int64_t D, int64_t bs, float scale) {  // one kv head g
  const int64_t G = H / Hkv, R = nt * G;
  float qf[MAX_ROWS][MAX_D], acc[MAX_ROWS][MAX_D], m[MAX_ROWS], l[MAX_ROWS];
  int64_t limit[MAX_ROWS];
  alignas(64) float kf[KC][MAX_D];
  alignas(64) float vf[KC][MAX_D];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = t0 + r / G, h = g * G + r % G;
    const T* src = q + (q_row0 + t) * qs + h * D;
    for (int64_t d = 0; d < D; ++d) { qf[r][d] = load(src, d) * scale; acc[r][d] = 0.f; }
    m[r] = -INFINITY; l[r] = 0.f;
    limit[r] = ctx_len - q_len + t;   // causal: the last key position this token sees
  }
  const int64_t end = limit[R - 1] + 1;
  const int64_t kv_row = Hkv * D, blk_stride = bs * kv_row;
  for (int64_t p = 0; p < end;) {
    const int64_t off = p % bs;
    const int64_t n = std::min<int64_t>({KC, bs - off, end - p});
    const int64_t base = int64_t(table[p / bs]) * blk_stride + off * kv_row + g * D;
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < D; ++d) { kf[j][d] = load(kc + base + j * kv_row, d); vf[j][d] = load(vc + base + j * kv_row, d); }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t nv = std::min<int64_t>(n, limit[r] - p + 1);  // keys of this chunk the row may see
      if (nv <= 0) continue;
      float s[KC];
      float smax = -INFINITY;
      for (int64_t j = 0; j < nv; ++j) {
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qf[r][d] * kf[j][d];
        s[j] = dot;
        smax = std::max(smax, dot);
      }
      const float mnew = std::max(m[r], smax);
      const float corr = std::exp(m[r] - mnew);
      float psum = 0.f;
      for (int64_t j = 0; j < nv; ++j) { s[j] = std::exp(s[j] - mnew); psum += s[j]; }
      l[r] = l[r] * corr + psum;
      m[r] = mnew;
      float* a = acc[r];
      for (int64_t d = 0; d < D; ++d) a[d] *= corr;
      for (int64_t j = 0; j < nv; ++j) {
        const float pj = s[j];
        for (int64_t d = 0; d < D; ++d) a[d] += pj * vf[j][d];
      }
    }
    p += n;
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = t0 + r / G, h = g * G + r % G;
    T* dst = out + ((q_row0 + t) * H + h) * D;
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < D; ++d) store(dst, d, acc[r][d] * inv);
  }
}

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

// Keys are taken CH = 32 at a time, in three passes over the rows so each pass is short enough for
// out-of-order execution to overlap rows (one long per-row body serializes on its reductions and exps):
//   1. scores of every row (bf16 dot products, transposed sums), 2. online-softmax update, 3. P @ V.
template <typename T>
void attend_item_simd(const T* q, int64_t qs, const T* kc, const T* vc, T* out, const int32_t* table, int64_t ctx_len,
                      int64_t q_len, int64_t q_row0, int64_t t0, int64_t nt, int64_t g0, int64_t ng, int64_t H,
                      int64_t Hkv, int64_t D, int64_t bs, float scale) {
  constexpr int CH = 32;
  const int64_t G = H / Hkv, RH = ng * G, R = nt * RH;   // RH: rows per token
  const int nd = int(D / 16);
  // compact strides: power-of-two row strides would put every row in the same L1 set
  alignas(64) float acc[MAX_ROWS * MAX_D];
  alignas(64) float vf[CH * (MAX_KV_ROW + 16)];
  alignas(64) float sc[MAX_ROWS * CH];
  float corr[MAX_ROWS], m[MAX_ROWS], l[MAX_ROWS];
  const T* qraw[MAX_ROWS];
  const T* krow[CH];
  int64_t koff[MAX_ROWS], limit[MAX_ROWS], nvis[MAX_ROWS];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = t0 + r / RH, h = g0 * G + r % RH;
    qraw[r] = q + (q_row0 + t) * qs + h * D;
    koff[r] = (h / G - g0) * D;
    for (int i = 0; i < nd; ++i) _mm512_store_ps(acc + r * D + 16 * i, _mm512_setzero_ps());
    m[r] = -INFINITY; l[r] = 0.f;
    limit[r] = ctx_len - q_len + t;
  }
  const int64_t end = limit[R - 1] + 1;
  const int64_t kv_row = Hkv * D, blk_stride = bs * kv_row, nvf = ng * D, vstride = nvf + 16;
  const __m512 vscale = _mm512_set1_ps(scale), neg_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t p = 0; p < end; p += CH) {
    const int64_t n = std::min<int64_t>(CH, end - p);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pos = p + j;
      krow[j] = kc + int64_t(table[pos / bs]) * blk_stride + (pos % bs) * kv_row + g0 * D;
      const T* vrow = vc + (krow[j] - kc);
      for (int64_t i = 0; i < nvf; i += 16) _mm512_store_ps(vf + j * vstride + i, load16(vrow + i));
    }
    // 1. scores
    for (int64_t r = 0; r < R; ++r) {
      const int64_t nv = std::min<int64_t>(n, limit[r] - p + 1);
      nvis[r] = nv;
      if (nv <= 0) continue;
      __m512 qv[MAX_D / 16];
      for (int i = 0; i < nd; ++i) qv[i] = load16(qraw[r] + 16 * i);
      for (int64_t j0 = 0; j0 < nv; j0 += 16) {
        __m512 part[16];
        for (int64_t j = 0; j < 16; ++j)
          part[j] = j0 + j < nv ? qk_partial(krow[j0 + j] + koff[r], qv, nd, qraw[r]) : _mm512_setzero_ps();
        const int64_t left = nv - j0;
        const __mmask16 valid = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
        _mm512_store_ps(sc + r * CH + j0,
                        _mm512_mask_blend_ps(valid, neg_inf, _mm512_mul_ps(transpose_sum16(part), vscale)));
      }
      if (nv <= 16) _mm512_store_ps(sc + r * CH + 16, neg_inf);
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
        for (int64_t j = 0; j < nv; ++j) {
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
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < D; ++d) store(dst, d, acc[r * D + d] * inv);
  }
}
#endif

#if defined(KV_HAVE_AVX512) && defined(__AVX512BF16__) && !defined(KV_NO_BF16_TILE)
#define KV_HAVE_BF16_TILE 1
// bf16 tiles: every multiply-add of QK^T and PV is a vdpbf16ps (two bf16 products per fp32 lane).
// Per chunk of 32 keys of one kv head, the K rows are transposed into dim-pair-major tiles (Kt[k] holds dim
// pair k of 16 keys) and V rows of key pairs are interleaved (Vi[k] holds keys 2k, 2k+1 per dim), once, for all
// query rows of the item. Scores: acc[16 keys] += q[dim pair k] (broadcast) . Kt[k]. P is rounded to bf16 (as
// flash attention does on GPUs) so its dword k is the pair (p_2k, p_2k+1): acc[16 dims] += that pair (broadcast)
// . Vi[k]. The V interleave (unpacklo/hi_epi16) permutes the dims inside each 32-dim segment; the accumulators
// keep that order and the final store undoes it.
constexpr int TCH = 32;

// raw scores of NR rows against the 32 keys of the chunk: s[2r + h] covers keys 16h..16h+15
template <int NR>
inline void tile_scores(const __m512i* Kt, int nd2, const int32_t* const* qd, __m512* s) {
  __m512 a[NR][2];
  for (int r = 0; r < NR; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int k = 0; k < nd2; ++k) {
    const __m512bh k0 = (__m512bh)_mm512_load_si512(Kt + k), k1 = (__m512bh)_mm512_load_si512(Kt + nd2 + k);
    for (int r = 0; r < NR; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(qd[r][k]);
      a[r][0] = _mm512_dpbf16_ps(a[r][0], qb, k0);
      a[r][1] = _mm512_dpbf16_ps(a[r][1], qb, k1);
    }
  }
  for (int r = 0; r < NR; ++r) { s[2 * r] = a[r][0]; s[2 * r + 1] = a[r][1]; }
}

// acc[r][16 (i0 + i) ...] = acc * corr[r] + P_r @ V over NI accumulators (16 dims each) and np key pairs
template <int NR, int NI>
inline void tile_pv(const __m512i* Vi, int nseg, int i0, int np, const int32_t* const* pp, float* const* acc,
                    const float* corr) {
  __m512 a[NR][NI];
  for (int r = 0; r < NR; ++r) {
    const __m512 c = _mm512_set1_ps(corr[r]);
    for (int i = 0; i < NI; ++i) a[r][i] = _mm512_mul_ps(_mm512_load_ps(acc[r] + 16 * (i0 + i)), c);
  }
  for (int k = 0; k < np; ++k) {
    __m512bh v[NI];
    for (int i = 0; i < NI; ++i) v[i] = (__m512bh)_mm512_load_si512(Vi + k * nseg + i0 + i);
    for (int r = 0; r < NR; ++r) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(pp[r][k]);
      for (int i = 0; i < NI; ++i) a[r][i] = _mm512_dpbf16_ps(a[r][i], pb, v[i]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NI; ++i) _mm512_store_ps(acc[r] + 16 * (i0 + i), a[r][i]);
}

template <int NR>
inline void tile_pv_rows(const __m512i* Vi, int nseg, int np, const int32_t* const* pp, float* const* acc,
                         const float* corr) {
  int i0 = 0;
  for (; i0 + 4 <= nseg; i0 += 4) tile_pv<NR, 4>(Vi, nseg, i0, np, pp, acc, corr);
  if (i0 < nseg) tile_pv<NR, 2>(Vi, nseg, i0, np, pp, acc, corr);   // nseg is even (D % 32 == 0)
}

// Kt (32 keys, dim-pair-major) and Vi (np key pairs interleaved) of one kv head at offset go of each key row
inline void build_tiles(const uint16_t* kb, const uint16_t* vb, const int64_t* off, int64_t go, int nblk, int nseg,
                        int nd2, int np, __m512i* Kt, __m512i* Vi) {
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < nblk; ++c) {
      __m512i rows[16];
      for (int j = 0; j < 16; ++j) rows[j] = _mm512_loadu_si512(kb + off[16 * h + j] + go + 32 * c);
      transpose16x16(rows);
      for (int j = 0; j < 16; ++j) _mm512_store_si512(Kt + h * nd2 + 16 * c + j, rows[j]);
    }
  for (int k = 0; k < np; ++k)
    for (int c = 0; c < nblk; ++c) {
      const __m512i a = _mm512_loadu_si512(vb + off[2 * k] + go + 32 * c);
      const __m512i b = _mm512_loadu_si512(vb + off[2 * k + 1] + go + 32 * c);
      _mm512_store_si512(Vi + k * nseg + 2 * c, _mm512_unpacklo_epi16(a, b));
      _mm512_store_si512(Vi + k * nseg + 2 * c + 1, _mm512_unpackhi_epi16(a, b));
    }
}

// buf row j = the `row` elements at src + off[j], for j < n, read in address order
inline void stage_rows(const uint16_t* src, const int64_t* off, int64_t n, int64_t row, uint16_t* buf) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t e = 0; e < row; e += 32) _mm512_store_si512(buf + j * row + e, _mm512_loadu_si512(src + off[j] + e));
}

// online softmax of one row over the chunk's raw scores (s0: keys 0-15, s1: 16-31), nv of them visible:
// updates the running max m and sum l, sets the rescale factor corr and the bf16 probability pairs pp
inline void softmax_row(__m512 s0, __m512 s1, int64_t nv, float scale, float& m, float& l, float& corr,
                        int32_t* pp) {
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY), vscale = _mm512_set1_ps(scale);
  const __mmask16 m0 = nv >= 16 ? __mmask16(0xffff) : __mmask16((1u << nv) - 1);
  const __mmask16 m1 = nv >= 32 ? __mmask16(0xffff) : nv > 16 ? __mmask16((1u << (nv - 16)) - 1) : __mmask16(0);
  s0 = _mm512_mask_blend_ps(m0, neg_inf, _mm512_mul_ps(s0, vscale));
  s1 = _mm512_mask_blend_ps(m1, neg_inf, _mm512_mul_ps(s1, vscale));
  const float mnew = std::max(m, _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
  const __m512 vm = _mm512_set1_ps(mnew);
  const __m512 z0 = _mm512_maskz_mov_ps(m0, exp512(_mm512_sub_ps(s0, vm)));
  const __m512 z1 = _mm512_maskz_mov_ps(m1, exp512(_mm512_sub_ps(s1, vm)));
  corr = std::exp(m - mnew);
  l = l * corr + _mm512_reduce_add_ps(_mm512_add_ps(z0, z1));
  m = mnew;
  _mm512_store_si512(pp, (__m512i)_mm512_cvtne2ps_pbh(z1, z0));
}

// One work item: sequence b, kv heads [g0, g0 + ng), query tokens [t0, t0 + nt). Rows are kv-head-major
// (kv head, token, q head of that kv head), so each kv head's rows are one range whose causal limits grow.
void attend_item_bf16(const uint16_t* q, int64_t qs, const uint16_t* kc, const uint16_t* vc, uint16_t* out,
                      const int32_t* table, int64_t ctx_len, int64_t q_len, int64_t q_row0, int64_t t0, int64_t nt,
                      int64_t g0, int64_t ng, int64_t H, int64_t Hkv, int64_t D, int64_t bs, float scale) {
  const int64_t G = H / Hkv, RH = nt * G, R = ng * RH;   // RH: rows per kv head
  const int nd2 = int(D / 2), nseg = int(D / 16), nblk = int(D / 32);
  alignas(64) __m512i Kt[2 * MAX_D / 2];
  alignas(64) __m512i Vi[(TCH / 2) * (MAX_D / 16)];
  alignas(64) float acc[MAX_ROWS * MAX_D];
  alignas(64) uint16_t kbuf[TCH * MAX_KV_ROW];
  alignas(64) uint16_t vbuf[TCH * MAX_KV_ROW];
  alignas(64) int32_t pp[MAX_ROWS][16];
  float m[MAX_ROWS], l[MAX_ROWS], corr[MAX_ROWS];
  const int32_t* qd[MAX_ROWS];
  const int32_t* ppr[MAX_ROWS];
  float* accr[MAX_ROWS];
  int64_t limit[MAX_ROWS], hrow[MAX_ROWS];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = t0 + (r % RH) / G, h = (g0 + r / RH) * G + r % G;
    hrow[r] = (q_row0 + t) * H + h;
    qd[r] = reinterpret_cast<const int32_t*>(q + (q_row0 + t) * qs + h * D);
    ppr[r] = pp[r];
    accr[r] = acc + r * D;
    std::memset(accr[r], 0, D * sizeof(float));
    m[r] = -INFINITY; l[r] = 0.f;
    limit[r] = ctx_len - q_len + t;
  }
  const int64_t end = limit[RH - 1] + 1, kv_row = Hkv * D, blk_stride = bs * kv_row;
  const int64_t span = ng * D * 2;   // bytes of one key row this item reads
  int64_t r0[MAX_ROWS];   // per kv head: rows before r0 have seen all their keys
  for (int64_t gi = 0; gi < ng; ++gi) r0[gi] = gi * RH;
  for (int64_t p = 0; p < end; p += TCH) {
    const int64_t n = std::min<int64_t>(TCH, end - p);
    int64_t off[TCH];
    for (int64_t j = 0; j < TCH; ++j) {   // keys past the end read key 0 again; their P is 0
      const int64_t pos = p + (j < n ? j : 0);
      off[j] = int64_t(table[pos / bs]) * blk_stride + (pos % bs) * kv_row + g0 * D;
    }
    // K/V rows two chunks ahead, into L2 (measured best of distances 1-8, hints T0/T1/T2/NTA: the blocks are
    // scattered, so the hardware prefetcher restarts at every block)
    for (int64_t pos = p + 2 * TCH; pos < std::min<int64_t>(p + 3 * TCH, end); ++pos) {
      const int64_t o = int64_t(table[pos / bs]) * blk_stride + (pos % bs) * kv_row + g0 * D;
      for (int64_t b = 0; b < span; b += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(kc + o) + b, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(vc + o) + b, _MM_HINT_T1);
      }
    }
    // An item with several kv heads first copies the chunk's K rows, then its V rows, in address order, so
    // DRAM sees two streams rather than head-by-head strided passes (4% faster on W1-shaped decode steps)
    const uint16_t* kb = kc;
    const uint16_t* vb = vc;
    if (ng > 1) {
      const int64_t row = ng * D;
      stage_rows(kc, off, n, row, kbuf);
      stage_rows(vc, off, n, row, vbuf);
      for (int64_t j = 0; j < TCH; ++j) off[j] = (j < n ? j : 0) * row;
      kb = kbuf;
      vb = vbuf;
    }
    const int np = int((n + 1) / 2);
    for (int64_t gi = 0; gi < ng; ++gi) {
      const int64_t go = gi * D, rend = (gi + 1) * RH;
      while (r0[gi] < rend && limit[r0[gi]] < p) ++r0[gi];
      if (r0[gi] == rend) continue;
      build_tiles(kb, vb, off, go, nblk, nseg, nd2, np, Kt, Vi);
      for (int64_t rb = r0[gi]; rb < rend; rb += 4) {
        const int nr = int(std::min<int64_t>(4, rend - rb));
        __m512 s[8];
        switch (nr) {
          case 4: tile_scores<4>(Kt, nd2, qd + rb, s); break;
          case 3: tile_scores<3>(Kt, nd2, qd + rb, s); break;
          case 2: tile_scores<2>(Kt, nd2, qd + rb, s); break;
          default: tile_scores<1>(Kt, nd2, qd + rb, s); break;
        }
        for (int i = 0; i < nr; ++i) {
          const int64_t r = rb + i, nv = std::min<int64_t>(n, limit[r] - p + 1);   // >= 1 for rows from r0
          softmax_row(s[2 * i], s[2 * i + 1], nv, scale, m[r], l[r], corr[r], pp[r]);
        }
      }
      for (int64_t rb = r0[gi]; rb < rend; rb += 4) {
        const int nr = int(std::min<int64_t>(4, rend - rb));
        switch (nr) {
          case 4: tile_pv_rows<4>(Vi, nseg, np, ppr + rb, accr + rb, corr + rb); break;
          case 3: tile_pv_rows<3>(Vi, nseg, np, ppr + rb, accr + rb, corr + rb); break;
          case 2: tile_pv_rows<2>(Vi, nseg, np, ppr + rb, accr + rb, corr + rb); break;
          default: tile_pv_rows<1>(Vi, nseg, np, ppr + rb, accr + rb, corr + rb); break;
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    uint16_t* dst = out + hrow[r] * D;
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < D; ++d) {   // undo the unpack order: dim 32c + 8L + 4hl + e sits at lane 4L + e of acc 2c + hl
      const int64_t c = d / 32, L = (d % 32) / 8, hl = (d % 8) / 4, e = d % 4;
      dst[d] = f32_to_bf16(accr[r][(2 * c + hl) * 16 + 4 * L + e] * inv);
    }
  }
}
#endif

template <typename T>
void paged_attention(const T* q, int64_t qs, const T* kc, const T* vc, T* out, const int32_t* block_tables, int64_t table_stride,
                     const int32_t* seq_lens, const int32_t* query_start, int64_t B, int64_t H, int64_t Hkv,
                     int64_t D, int64_t bs, float scale) {
  const int64_t G = H / Hkv;
  bool simd = false;
#ifdef KV_HAVE_AVX512
  simd = D % 32 == 0 && Hkv * D <= MAX_KV_ROW && H <= MAX_ROWS;
#endif
  bool bf16_tile = false;
#ifdef KV_HAVE_BF16_TILE
  bf16_tile = std::is_same<T, uint16_t>::value && D % 32 == 0 && G <= MAX_ROWS;
#endif
  // A work item is (sequence, query tile, kv heads). With many sequences an item takes all kv heads, so it
  // reads whole contiguous KV rows; with few (single-stream decode) it takes one kv head, for parallelism.
  // The bf16 tile kernel decides per sequence: all kv heads when every row of the sequence fits one item
  // (decodes, short chunks), else one kv head per item with the longest token tiles (prefill).
  const int64_t total_q = query_start[B];
  const bool many = B >= 4 * omp_get_max_threads();
  const int64_t ng_all = simd && (many || total_q > 4 * B) ? Hkv : 1;
  std::vector<int64_t> first(B + 1, 0), ngs(B), tiles(B);   // first item, kv heads per item, tokens per item
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = query_start[b + 1] - query_start[b];
    ngs[b] = bf16_tile ? (many && q_len * H <= MAX_ROWS && Hkv * D <= MAX_KV_ROW ? Hkv : 1) : ng_all;
    tiles[b] = std::max<int64_t>(1, MAX_ROWS / (ngs[b] * G));
    first[b + 1] = first[b] + ((q_len + tiles[b] - 1) / tiles[b]) * (Hkv / ngs[b]);
  }
  #pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < first[B]; ++item) {
    const int64_t b = std::upper_bound(first.begin(), first.end(), item) - first.begin() - 1;
    const int64_t rest = item - first[b], ng = ngs[b], tile = tiles[b], groups = Hkv / ng;
    const int64_t q_len = query_start[b + 1] - query_start[b];
    const int64_t tile_idx = rest / groups, g = (rest % groups) * ng;
    const int64_t t0 = tile_idx * tile, nt = std::min(tile, q_len - t0);
    const int32_t* table = block_tables + b * table_stride;
#ifdef KV_HAVE_BF16_TILE
    if constexpr (std::is_same<T, uint16_t>::value) {
      if (bf16_tile) {
        attend_item_bf16(q, qs, kc, vc, out, table, seq_lens[b], q_len, query_start[b], t0, nt, g, ng, H, Hkv, D, bs,
                         scale);
        continue;
      }
    }
#endif
#ifdef KV_HAVE_AVX512
    if (simd) {
      attend_item_simd<T>(q, qs, kc, vc, out, table, seq_lens[b], q_len, query_start[b], t0, nt, g, ng, H, Hkv, D, bs,
                          scale);
      continue;
    }
#endif
    attend_item<T>(q, qs, kc, vc, out, table, seq_lens[b], q_len, query_start[b], t0, nt, g, H, Hkv, D, bs, scale);
  }
}

}  // namespace

extern "C" {
int kv_abi_version() { return 1; }
int kv_simd() {
#ifdef KV_HAVE_AVX512
  return 1;
#else
  return 0;
#endif
}
void kv_paged_attention_f32(const float* q, int64_t qs, const float* kc, const float* vc, float* out,
                            const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,
                            const int32_t* query_start, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs,
                            float scale) {
  paged_attention<float>(q, qs, kc, vc, out, tables, table_stride, seq_lens, query_start, B, H, Hkv, D, bs, scale);
}
void kv_paged_attention_bf16(const uint16_t* q, int64_t qs, const uint16_t* kc, const uint16_t* vc, uint16_t* out,
                             const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,
                             const int32_t* query_start, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs,
                             float scale) {
  paged_attention<uint16_t>(q, qs, kc, vc, out, tables, table_stride, seq_lens, query_start, B, H, Hkv, D, bs,
                            scale);
}
}
